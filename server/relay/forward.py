"""A relay's verb handlers, one per verb from its declared relay treatment (``Command.relay``).

They replace the usual handlers (:mod:`..protocol.handlers`, :mod:`..protocol.tables`)
of a server started with ``--follow`` (through ``ServerState.handlers``) and fall
back to them for names the relay does not follow, which live on the relay as on
any server.  Each returns an outcome (``server/protocol/outcome.py``).

* ``FORWARD`` (PUT, APPEND, DELETE, GET) and ``PASS`` (the table verbs): a
  request about a followed name is sent upstream as it came (a value's
  description and payload bytes, never decoded) and answered only once the
  upstream has answered, with its reply code.  A ``FORWARD`` verb changes a bin:
  whatever its handler, :func:`_forward` answers it only once the relay's mirror
  shows the change too (when it mirrors the bin), so a client reads its own writes
  on the relay; a GET's items are handed on.  A ``PASS`` verb's reply is the
  upstream's as it came (tables live upstream: a relay mirrors bins, not tables).
  Nothing is retried: a request whose upstream connection drops gets 421, and the
  client decides (the upstream may or may not have made the change), so nothing is
  done twice by the relay.  A request that may wait upstream (``wait``, §4.5: a
  blocking GET, an APPEND ``below``, a table verb's wait) goes on a connection of its
  own, so that it holds up no other request of the relay there, and is called off
  when its client goes: the relay closes that connection and the upstream drops the
  request unrun, as it would the client's own (a GET takes nothing).
* ``MIRROR`` (PEEK, LISTEN): a followed bin is mirrored from then on and the
  request waits for its first copy; then it is answered from the mirror, like any
  bin (same-host zero-copy included; a PEEK that waits for a change waits for the
  mirror's).  A PEEK with ``incoming`` (a relay following this one) also asks for
  every later copy to be pushed to its connection as it arrives (:mod:`.stream`).
  A mirror a client listens to is kept for it, so one connection may listen to at
  most a quarter of the bins the relay may mirror (:data:`SHARE`): the rest stays
  for others (made-up names read once are not kept at all).
* ``MERGE`` (LIST): the upstream's followed bins with the relay's own, and the
  relay's state (``relay``: upstream, connected, how far behind).
* ``LOCAL`` (NOOP, UNLISTEN, AUTH): as on any server.
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import RemoteError, TensorShareError
from tensorshare.protocol.items import item_table, item_tags
from tensorshare.protocol.messages import (
    APPEND, COMMANDS, DELETE, GET, LIST, LISTEN, PEEK, PUT, TOO_LARGE, UNAVAILABLE, ZERO_COPY_REFUSED, Key, Relay, Route,
)
from tensorshare.wire.frames import frame_head

from ..protocol import handlers as local
from ..protocol.outcome import later
from ..protocol.registry import HANDLERS

MARGIN_S = 5.0  # a forwarded call's timeout beyond what the request itself may wait in the upstream
SHARE = 4  # one connection may hold by listening at most this fraction of a relay's mirrors
_NOT_FORWARDED = (Key.RELEASE, Key.REF)  # about this connection only (§10.3): never sent upstream


def relay_handlers() -> dict:
    """The handlers a relay uses instead of the usual ones: one per verb whose declared
    treatment is not ``LOCAL``."""
    made = {Relay.FORWARD: _forwarding, Relay.PASS: _passing, Relay.MIRROR: _mirroring,
            Relay.MERGE: lambda command: listing}
    return {command: made[command.relay](command) for command in COMMANDS.values() if command.relay != Relay.LOCAL}


def _as_remote(error: BaseException) -> RemoteError:
    """The reply for a forwarded call that failed: the upstream's own refusal, or 421."""
    if isinstance(error, RemoteError):
        return error
    return RemoteError(f"relay: upstream failed ({error}); the change may or may not have been made there",
                       UNAVAILABLE)


def _forward(session, command, fields: dict, value=None, timeout: float | None = None,
             on_reply: Callable | None = None):
    """A :class:`~..protocol.outcome.Pending`: ``command`` sent upstream; the request
    answered with ``on_reply(reply)`` (the upstream's raw reply) or refused with the
    upstream's error.  A change of a bin (``Relay.FORWARD``, as its verb declares) is
    answered once the relay's mirror of the bin shows it, if the relay mirrors it."""
    relay = session.state.relay
    mirrored = fields[Key.BIN] if command.relay == Relay.FORWARD else None

    owner = fields.get(Key.BIN) if command.route is Route.OWNER else None  # (a bin's own worker suffices)
    waits = owner is not None and bool(fields.get(Key.WAIT))  # the upstream may hold it: alone, called off
    sent: list = []  # the request upstream (its Deferred), once sent
    cancelled = False

    def start(done: Callable) -> None:
        relay.when_started(lambda error: send(done) if error is None else done(None, _as_remote(error)), owner)

    def send(done: Callable) -> None:
        if cancelled:  # (its client went while the relay waited for its upstream)
            return
        try:
            d = relay.forward(command, fields, value, timeout, alone=waits)
        except TensorShareError as exc:
            done(None, _as_remote(exc))
            return
        sent.append(d)

        def replied(reply) -> None:
            if mirrored is None:
                done(reply, None)
                return
            relay.after(mirrored, reply.header[Key.SEQ],
                        lambda error: done(None, _as_remote(error)) if error is not None else done(reply, None))

        d.addCallbacks(replied, lambda failure: done(None, _as_remote(failure.value)))

    def finish(reply, error: RemoteError | None):
        if error is not None:
            raise error
        return on_reply(reply)

    def cancel() -> None:
        """The client went: the request still held upstream is dropped there, unrun."""
        nonlocal cancelled
        cancelled = True
        for d in sent:
            d.cancel()

    return later(start, finish, cancel if waits else None)


def _local_seq(session, name: str, upstream_seq: int) -> tuple[bool, int, int]:
    """``(mirrored, n_items, seq)``: the mirror's state of ``name`` if the relay mirrors it."""
    if name in session.state.relay.mirrors:
        state = session.storage.state(name)
        return True, state.n_items, state.seq
    return False, 0, upstream_seq


def _forwarding(command) -> Callable:
    """The handler of a ``FORWARD`` verb: those with more to do than pass the request
    on have their own; any handler's answer waits for the mirror (:func:`_forward`)."""
    special = {PUT: store, APPEND: store, DELETE: delete, GET: get}.get(command)
    return special if special is not None else _passing(command)


def _passing(command) -> Callable:
    """A handler that sends a followed name's request upstream as it came and answers
    with the upstream's reply (its seq the mirror's, for a ``FORWARD`` verb)."""
    plain = HANDLERS[command]
    changes = command.relay == Relay.FORWARD

    def passed(session, request):
        relay, name = session.state.relay, request.bin
        if not relay.follows(name):
            return plain(session, request)
        fields = {}
        for field in command.fields:
            value = getattr(request, field.key)
            if value is not None and field.key not in _NOT_FORWARDED and field.key != Key.VALUE:
                fields[field.key] = value
        value = (request.value, request.payload or (), request.payload_len) if command.payload else None
        timeout = relay.timeout + (getattr(request, Key.WAIT, None) or 0) + MARGIN_S

        def answered(reply) -> list:
            header = dict(reply.header)
            header[Key.ID] = request.id
            if changes:  # (as the mirror numbers its changes)
                header[Key.SEQ] = _local_seq(session, name, header[Key.SEQ])[2]
            frame = reply.frame
            if not frame.payload_len:
                return [frame_head(header, 0)]
            return [frame_head(header, frame.payload_len), frame.payload]

        return _forward(session, command, fields, value, timeout, answered)

    passed.__name__ = f"{command.relay}_{command.verb.lower()}"
    return passed


def store(session, request):
    """PUT/APPEND: forwarded upstream for a followed bin."""
    relay, name = session.state.relay, request.bin
    if not relay.follows(name):
        return local.store(session, request)
    if request.shm is not None:  # the client falls back to TCP (PROTOCOL.md §10.4)
        raise RemoteError("a relay forwards this bin's writes upstream: send the value over TCP", ZERO_COPY_REFUSED)
    local.check_value(session, request.value, request.payload_len)
    fields = {Key.BIN: name}
    if request.tag is not None:
        fields[Key.TAG] = request.tag
    timeout = relay.timeout
    if request.command is APPEND and request.below is not None:
        fields[Key.BELOW], fields[Key.WAIT] = request.below, request.wait or 0
        timeout = (request.wait or 0) + MARGIN_S
    value = (request.value, request.payload or (), request.payload_len)
    command = request.command
    # An ephemeral PUT (PROTOCOL.md §4.6) is owned upstream by the relay's connection
    # with an owner value of this client's; the relay owns it for the client's and
    # deletes it upstream, with that value, when that one ends.
    ephemeral = command is PUT and getattr(request, "ephemeral", None) is True
    owner = None
    if ephemeral:
        owner = relay.owner_value(session, request.owner)
        fields[Key.EPHEMERAL], fields[Key.OWNER] = True, owner

    def stored(reply) -> dict:
        if ephemeral:
            session.state.ephemeral.claim(name, session, owner)
        mirrored, n, seq = _local_seq(session, name, reply.header[Key.SEQ])
        return command.reply(request.id, n=n if mirrored else reply.header[Key.N], seq=seq)

    return _forward(session, command, fields, value, timeout, stored)


def delete(session, request):
    relay, name = session.state.relay, request.bin
    if not relay.follows(name):
        return local.delete(session, request)
    fields = {Key.BIN: name}
    owned = True
    if request.owner is not None:  # a relay following this one: its client's bin, if still that one's
        fields[Key.OWNER] = owner = relay.owner_value(session, request.owner)
        # not this client's: the upstream changes nothing either (§4.6, its claim has another
        # owner value), and answers with n and seq as they are (this relay's mirror may have none)
        owned = session.state.ephemeral.owns(name, session, owner)

    def deleted(reply) -> dict:
        if owned:
            session.state.ephemeral.forget(name)
        return DELETE.reply(request.id, n=reply.header[Key.N],
                            seq=_local_seq(session, name, reply.header[Key.SEQ])[2])

    return _forward(session, DELETE, fields, None, relay.timeout, deleted)


def get(session, request):
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

    def taken(reply) -> list:
        frame = reply.frame
        payload = frame.payload if frame.payload_len else memoryview(b"")
        table = item_table(reply.header, frame.payload_len)
        copy, parts, base = [], [], 0
        for (blob, size, _ref), tag in zip(table, item_tags(reply.header, len(table))):
            segment = payload[base: base + size]
            copy.append((blob, (segment,) if size else (), size, tag))
            if size:
                parts.append(segment)
            base += size
        return local.items_reply(session, request, session.storage.as_items(copy), parts,
                                 _local_seq(session, name, reply.header[Key.SEQ])[2], None)

    return _forward(session, GET, fields, None, timeout, taken)


def _mirroring(command) -> Callable:
    """The handler of a ``MIRROR`` verb (PEEK, LISTEN): answered from the mirror once it holds the bin."""
    handler = HANDLERS[command]
    pushes = command is PEEK  # PEEK incoming: copies pushed as they arrive (a relay following this one)

    def relayed(session, request):
        relay, name = session.state.relay, request.bin
        if not relay.follows(name):
            return handler(session, request)
        if command is LISTEN and name not in session.listening:
            share = max(1, relay.max_mirrors // SHARE)
            if sum(1 for n in session.listening if relay.follows(n)) >= share:
                raise RemoteError(f"relay: a connection may listen to {share} of the bins it mirrors", TOO_LARGE)
        if pushes and request.incoming:
            relay.watch(name, session)
        mirror = relay.mirrors.get(name)
        if mirror is not None and mirror.synced:  # the usual case: answered from the mirror now
            return handler(session, request)

        def synced(error, _):
            if error is not None:
                raise _as_remote(error)
            return handler(session, request)

        return later(lambda done: relay.when_synced(name, lambda e: done(e, None)), synced)

    relayed.__name__ = f"mirror_{command.verb.lower()}"
    return relayed


def listing(session, request):
    """LIST: the upstream's followed bins and the relay's own, and the relay's state."""
    relay = session.state.relay

    def merged(reply) -> dict:
        bins = {name: n for name, n in reply.header[Key.BINS].items() if relay.follows(name)}
        bins.update((name, n) for name, n in session.storage.listing().items() if not relay.follows(name))
        return LIST.reply(request.id, bins=bins, relay=relay.status())

    if relay.failure or (relay.started and not relay.connected):  # what the mirror holds, and why
        return LIST.reply(request.id, bins=session.storage.listing(), relay=relay.status())
    return _forward(session, LIST, {}, None, relay.timeout, merged)
