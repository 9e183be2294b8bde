"""A relay's verb handlers: writes to followed bins go upstream, reads wait for the mirror.

They replace the usual handlers (:mod:`..protocol.handlers`) of a server started
with ``--follow`` (through ``ServerState.handlers``) and fall back to them for bins
the relay does not follow, which live on the relay as on any server.

* PUT, APPEND, DELETE, GET of a followed bin are sent upstream as they came (the
  value's description and payload bytes, never decoded) and answered only once the
  upstream has answered, with its reply code; a change to a bin the relay mirrors
  is answered once the mirror shows it too, so a client reads its own writes on
  the relay.  Nothing is retried: a write whose upstream connection drops gets
  421, and the client decides (the upstream may or may not have stored it), so a
  forwarded write is never stored twice by the relay.
* PEEK and LISTEN of a followed bin start mirroring it and wait for its first
  copy; then they are answered from the mirror, like any bin (same-host zero-copy
  included; a PEEK that waits for a change waits for the mirror's).  A PEEK with
  ``incoming`` (a relay following this one) also asks for every later copy to be
  pushed to its connection as it arrives (:mod:`.stream`).
* LIST merges the upstream's followed bins with the relay's own, and carries the
  relay's state (``relay``: upstream, connected, how far behind).
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import RemoteError, TensorShareError
from tensorshare.protocol.messages import (
    APPEND, DELETE, GET, LIST, LISTEN, PEEK, PUT, UNAVAILABLE, ZERO_COPY_REFUSED, Key,
)
from tensorshare.wire.codec import Encoded
from tensorshare._client.connection import item_table

from ..bins.store import Item
from ..protocol import handlers as local

MARGIN_S = 5.0  # a forwarded call's timeout beyond what the request itself may wait in the upstream


def relay_handlers() -> dict:
    """The handlers a relay uses instead of the usual ones."""
    return {PUT: store, APPEND: store, DELETE: delete, GET: get, PEEK: peek, LISTEN: read(local.listen),
            LIST: listing}


def _as_remote(error: BaseException) -> RemoteError:
    """The reply for a forwarded call that failed: the upstream's own refusal, or 421."""
    if isinstance(error, RemoteError):
        return error
    return RemoteError(f"relay: upstream failed ({error}); the change may or may not have been made there",
                       UNAVAILABLE)


def _forward(session, rid: int, command, fields: dict, value=None, timeout: float | None = None,
             on_reply: Callable | None = None, mirrored: str | None = None) -> None:
    """Send ``command`` upstream; ``on_reply(reply)`` with its raw reply (once the
    mirror of bin ``mirrored`` shows the change, if the relay mirrors it), or the
    request refused with the upstream's error.  Later requests of this connection
    wait meanwhile (their replies keep request order)."""
    relay = session.state.relay

    def start(done: Callable) -> None:
        relay.when_started(lambda error: send(done) if error is None else done(None, _as_remote(error)))

    def send(done: Callable) -> None:
        kwargs = {} if value is None else {"value": value}
        try:
            d = relay.client._call(command, fields, decode=False, zero_copy=False, then=lambda reply: reply,
                                   timeout=timeout, **kwargs)
        except TensorShareError as exc:
            done(None, _as_remote(exc))
            return

        def replied(reply) -> None:
            if mirrored is None:
                done(reply, None)
                return
            relay.after(mirrored, reply.header[Key.SEQ],
                        lambda error: done(None, _as_remote(error)) if error is not None else done(reply, None))

        d.addCallbacks(replied, lambda failure: done(None, _as_remote(failure.value)))

    def finish(reply, error) -> None:
        if error is not None:
            session.refuse(rid, error)
            return
        try:
            on_reply(reply)
        except RemoteError as exc:
            session.refuse(rid, exc)

    session.wait_for(start, finish)


def _local_seq(session, name: str, upstream_seq: int) -> tuple[bool, int, int]:
    """``(mirrored, n_items, seq)``: the mirror's state of ``name`` if the relay mirrors it."""
    if name in session.state.relay.mirrors:
        state = session.storage.state(name)
        return True, state.n_items, state.seq
    return False, 0, upstream_seq


def store(session, request) -> None:
    """PUT/APPEND: forwarded upstream for a followed bin."""
    relay, name = session.state.relay, request.bin
    if not relay.follows(name):
        return local.store(session, request)
    if request.shm is not None:  # the client falls back to TCP (PROTOCOL.md §10.4)
        raise RemoteError("a relay forwards this bin's writes upstream: send the value over TCP", ZERO_COPY_REFUSED)
    local._check_value(session, request.value, request.payload_len)
    fields = {Key.BIN: name}
    if request.tag is not None:
        fields[Key.TAG] = request.tag
    timeout = relay.timeout
    if request.command is APPEND and request.below is not None:
        fields[Key.BELOW], fields[Key.WAIT] = request.below, request.wait or 0
        timeout = (request.wait or 0) + MARGIN_S
    value = Encoded(request.value, list(request.payload or ()), request.payload_len)
    command = request.command
    # An ephemeral PUT (PROTOCOL.md §4.6) is owned upstream by the relay's connection;
    # the relay owns it for the client's and deletes it upstream when that one ends.
    ephemeral = command is PUT and getattr(request, "ephemeral", None) is True
    if ephemeral:
        fields[Key.EPHEMERAL] = True

    def stored(reply) -> None:
        if ephemeral:
            session.state.ephemeral.claim(name, session)
        mirrored, n, seq = _local_seq(session, name, reply.header[Key.SEQ])
        session.send_header(command.reply(request.id, n=n if mirrored else reply.header[Key.N], seq=seq))

    _forward(session, request.id, command, fields, value, timeout, stored, name)


def delete(session, request) -> None:
    relay, name = session.state.relay, request.bin
    if not relay.follows(name):
        return local.delete(session, request)

    def deleted(reply) -> None:
        session.state.ephemeral.forget(name)
        session.send_header(DELETE.reply(request.id, n=0, seq=_local_seq(session, name, reply.header[Key.SEQ])[2]))

    _forward(session, request.id, DELETE, {Key.BIN: name}, None, relay.timeout, deleted, name)


def get(session, request) -> None:
    """GET of a followed bin takes the items upstream and hands them on."""
    relay, name = session.state.relay, request.bin
    if not relay.follows(name):
        return local.get(session, request)
    fields = {Key.BIN: name, Key.TAGS: True}
    timeout = relay.timeout
    for key in (Key.MAX, Key.LEAST, Key.WAIT):  # a take that waits, waits upstream
        if getattr(request, key) is not None:
            fields[key] = getattr(request, key)
    if request.wait:
        timeout = request.wait + MARGIN_S

    def taken(reply) -> None:
        frame = reply.frame
        payload = memoryview(frame.payload).cast("B") if frame.payload_len else memoryview(b"")
        tags = reply.header.get(Key.TAGS) or []
        items, parts, base = [], [], 0
        for i, (blob, size, _ref) in enumerate(item_table(reply.header, frame.payload_len)):
            segment = payload[base: base + size]
            items.append(Item(blob, (segment,) if size else (), size, tags[i] if i < len(tags) else None))
            if size:
                parts.append(segment)
            base += size
        local._send_items(session, request, items, parts, _local_seq(session, name, reply.header[Key.SEQ])[2], None)

    _forward(session, request.id, GET, fields, None, timeout, taken, name)


def read(handler: Callable) -> Callable:
    """PEEK/LISTEN: answered from the mirror once it holds the bin."""
    def relayed(session, request) -> None:
        relay, name = session.state.relay, request.bin
        if not relay.follows(name):
            return handler(session, request)
        mirror = relay.mirrors.get(name)
        if mirror is not None and mirror.synced:  # the usual case: answered from the mirror now
            return handler(session, request)

        def synced(error, _) -> None:
            if error is not None:
                session.refuse(request.id, _as_remote(error))
                return
            try:
                handler(session, request)
            except RemoteError as exc:
                session.refuse(request.id, exc)

        session.wait_for(lambda done: relay.when_synced(name, lambda e: done(e, None)), synced)

    relayed.__name__ = handler.__name__
    return relayed


_peek_mirror = read(local.peek)


def peek(session, request) -> None:
    """PEEK: from the mirror; ``incoming`` (a relay following this one) also asks for
    the copies that start arriving here from now on, pushed as they arrive."""
    relay, name = session.state.relay, request.bin
    if request.incoming and relay.follows(name):
        relay.watch(name, session)
    _peek_mirror(session, request)


def listing(session, request) -> None:
    """LIST: the upstream's followed bins and the relay's own, and the relay's state."""
    relay = session.state.relay

    def merged(reply) -> None:
        bins = {name: n for name, n in reply.header[Key.BINS].items() if relay.follows(name)}
        bins.update((name, n) for name, n in session.storage.listing().items() if not relay.follows(name))
        session.send_header(LIST.reply(request.id, bins=bins, relay=relay.status()))

    if relay.failure or (relay.client is not None and not relay.client.connected):  # what the mirror holds, and why
        session.send_header(LIST.reply(request.id, bins=session.storage.listing(), relay=relay.status()))
        return
    _forward(session, request.id, LIST, {}, None, relay.timeout, merged)
