"""What the server does for each verb: one handler per declared command.

A handler gets the :class:`~.session.ServerSession` and a request already checked
against its :class:`~tensorshare.protocol.messages.Command` (PROTOCOL.md §4.2-4.3).
It reaches bins only through ``session.storage``; a storage call that may wait for
the disk goes through :meth:`~.session.ServerSession.wait_for`, which keeps replies
in request order.  A handler refuses by raising the
:class:`~tensorshare.errors.RemoteError` whose code is the reply.
"""

from __future__ import annotations

import logging
from typing import Callable

from tensorshare.errors import BusyError, ProtocolError, RemoteError
from tensorshare.protocol.messages import (
    APPEND, AUTH, BAD_ARGS, BAD_SEQUENCE, DELETE, GET, LIST, LISTEN, NOOP, PEEK, PUT, TOO_LARGE, UNLISTEN, Command,
    Key,
)
from tensorshare.wire.description import check_description
from tensorshare.wire.frames import frame_head

from ..bins.store import Change, Item
from . import longpoll

log = logging.getLogger("tensorshare.server")

HANDLERS: dict[Command, Callable] = {}


def handles(*commands: Command) -> Callable:
    """Register the decorated function as the handler of ``commands``."""
    def register(handler: Callable) -> Callable:
        for command in commands:
            HANDLERS[command] = handler
        return handler
    return register


# -- PUT, APPEND


@handles(PUT, APPEND)
def store(session, request) -> None:
    """Replace the bin's items (PUT) or add one (APPEND): from the payload, or from
    the item directory a same-host client wrote (PROTOCOL.md §10.4).  An APPEND
    with ``below`` first waits for room (:func:`_when_room`)."""
    storage, replace = session.storage, request.command is PUT
    name, blob, tag = request.bin, request.value, request.tag
    ephemeral = replace and request.ephemeral is True
    if ephemeral or session.state.ephemeral:
        _check_ephemeral(session, request, ephemeral)
    if request.shm is not None:
        incoming, item_name, size = session.shared.adoption(request)
        _check_value(session, blob, size)
        limits = session.decode_limits

        def add(done: Callable) -> None:
            storage.adopt(name, incoming, item_name, blob, size, tag, replace, done, limits)
    else:
        _check_value(session, blob, request.payload_len)
        item = Item(blob, tuple(request.payload), request.payload_len, tag)

        def add(done: Callable) -> None:
            storage.add(name, item, replace, done, lasting=not ephemeral)  # ephemeral: in memory only
    finish = _stored(session, request)
    if ephemeral:
        if session.closed:  # run after its connection ended (§8.3): it would end with it
            return
        finish = _claiming(session, name, finish)
    if not replace and request.below is not None and not _room_now(session, request):
        session.wait_for(lambda done: _when_room(session, request, add, done), finish)
    elif request.shm is None and (ephemeral or not storage.durable):  # stored in memory at once
        add(finish)
    else:
        session.wait_for(add, finish)


def _check_ephemeral(session, request, ephemeral: bool) -> None:
    """501 for a store that would mix an ephemeral bin with lasting items
    (:mod:`.ephemeral`)."""
    if ephemeral and request.shm is not None:
        raise RemoteError("an ephemeral value comes over TCP, not through shared memory", BAD_ARGS)
    session.state.ephemeral.check_store(request.bin, ephemeral, session.storage.state(request.bin).exists)


def _claiming(session, name: str, finish: Callable) -> Callable:
    """``finish``, once this connection owns the ephemeral bin it stored."""
    def stored(change: Change | None, error: RemoteError | None) -> None:
        if error is None:
            session.state.ephemeral.claim(name, session)
        finish(change, error)
    return stored


def _room_now(session, request) -> bool:
    """Whether an APPEND with ``below`` can be stored at once, as any APPEND: in
    memory, nobody waiting on its bin before it, and room (the usual case of a
    producer that is not ahead; it then keeps the pipelined path)."""
    name, waits, storage = request.bin, session.state.waits, session.storage
    return (request.shm is None and not storage.durable and not waits.waiting(name)
            and _has_room(session, name, request.below))


def _has_room(session, name: str, below: int) -> bool:
    """Whether bin ``name`` holds fewer than ``below`` items, those being stored included."""
    return session.storage.count(name) + session.state.waits.going(name) < below


def _when_room(session, request, add: Callable, done: Callable) -> None:
    """Run ``add(done)`` once the bin holds fewer than ``request.below`` items (those
    being stored count), waiting up to ``request.wait`` seconds (PROTOCOL.md §4.4)."""
    storage, waits, name, below = session.storage, session.state.waits, request.bin, request.below
    wait = request.wait or 0

    def stored(change, error) -> None:
        done(change, error)  # published first: notifications keep the order of seq
        waits.settled(name)

    def go() -> None:
        try:
            add(stored)
        except RemoteError as exc:  # a limit: refused like any APPEND
            stored(None, exc)

    def expire() -> None:
        done(None, BusyError(f"bin {name!r} still held {storage.count(name)} items (below {below} asked) "
                             f"after waiting {wait:g}s; nothing stored"))

    session.park(name, lambda: _has_room(session, name, below), go, wait, expire)


def _check_value(session, blob: bytes, nbytes: int) -> None:
    """501 unless ``blob`` describes a value whose payload is ``nbytes`` long."""
    try:  # cheap for a description seen before (the codec remembers them)
        check_description(blob, nbytes, session.decode_limits)
    except ProtocolError as exc:
        raise RemoteError(f"bad value: {exc}", BAD_ARGS) from None


def _stored(session, request) -> Callable:
    """The reply to a PUT/APPEND once the storage is done with it."""
    def finish(change: Change | None, error: RemoteError | None) -> None:
        if error is not None:
            session.refuse(request.id, error)
            return
        session.send_header(request.command.reply(request.id, n=change.n_items, seq=change.seq))
        session.state.listeners.publish(change)
        if request.tag is not None and session.counters is not None:  # versions of RL experiments
            session.counters.stored(session.stats, request.command.verb, request.bin, request.tag)
    return finish


# -- GET, PEEK


@handles(GET)
def get(session, request) -> None:
    """Take the bin's items (at most ``max``); with ``wait``, once it holds ``least``
    of them (:mod:`.longpoll`)."""
    if request.least is not None and request.max is not None and request.least > request.max:
        raise RemoteError(f"least ({request.least}) must not exceed max ({request.max})", BAD_ARGS)
    if request.wait and not longpoll.enough_items(session, request):
        longpoll.hold(session, request, longpoll.enough_items, _take)
        return
    _take(session, request, None)


def _take(session, request, done: Callable[[], None] | None) -> None:
    """Take the items out of the bin.  The take and its notification happen now;
    the reply follows once the items' files are open (if any is only on disk), and
    the items go back to the front of the bin if it cannot be delivered.
    ``done``: called once the reply is queued (a request that waited); None: a
    wait for the disk holds the connection as usual."""
    storage, listeners, name = session.storage, session.state.listeners, request.bin
    items = storage.peek(name)[: request.max]  # (max: None takes them all)
    _check_reply_size(session, items)  # refused before anything is taken
    refs = session.shared.refs(request.ref, items, taking=True)
    items, change = storage.take(name, request.max)

    def put_back() -> None:
        listeners.publish(storage.restore(name, items))

    def finish(parts: list | None, error: RemoteError | None) -> None:
        if error is not None:
            put_back()
            session.refuse(request.id, error)
        else:
            _send_items(session, request, items, parts, change.seq, refs, put_back,
                        lambda: storage.delivered(name, items))
            session.shared.pin(request.id, items, refs)
        if done is not None:
            done()

    parts = storage.parts_in_memory(items, refs)
    if parts is not None:  # the usual case: the reply, then the notifications
        finish(parts, None)
        listeners.publish(change)
        return

    def start(read_done: Callable) -> None:
        listeners.publish(change)  # this connection's own notification follows the reply
        storage.read(items, refs, read_done)

    if done is not None:  # already holding the connection (it waited)
        start(finish)
    else:
        session.wait_for(start, finish)


@handles(PEEK)
def peek(session, request) -> None:
    """Read every item of the bin, which keeps them; with ``since``, none while the
    bin is still at that seq, and with ``wait`` too, once it has moved on
    (:mod:`.longpoll`)."""
    if request.wait and not longpoll.moved_on(session, request):
        longpoll.hold(session, request, longpoll.moved_on, _read)
        return
    _read(session, request, None)


def _read(session, request, done: Callable[[], None] | None) -> None:
    """Send the bin's items, or none if it is still at seq ``since`` (nothing new;
    ``done``: as for :func:`_take`)."""
    storage, name = session.storage, request.bin
    seq = storage.seq(name)
    items = [] if request.since is not None and seq == request.since else storage.peek(name)
    _check_reply_size(session, items)
    refs = session.shared.refs(request.ref, items)

    def finish(parts: list | None, error: RemoteError | None) -> None:
        if error is not None:
            session.refuse(request.id, error)
        else:
            _send_items(session, request, items, parts, seq, refs)
            session.shared.pin(request.id, items, refs)
            session.shared.promote(request.ref, items, refs, session.decode_limits)
        if done is not None:
            done()

    parts = storage.parts_in_memory(items, refs)
    if parts is not None:  # the usual case: no disk, no wait
        finish(parts, None)
    elif done is not None:
        storage.read(items, refs, finish)
    else:
        session.wait_for(lambda read_done: storage.read(items, refs, read_done), finish)


def _check_reply_size(session, items: list[Item]) -> None:
    """552 for a reply whose header, holding every item's description, would be
    larger than max_reply_header."""
    limit = session.config.max_reply_header
    size = sum(len(item.description) for item in items)
    if size > limit:
        raise RemoteError(f"the bin's {len(items)} item descriptions take {size} bytes, over the {limit} one "
                          f"reply may carry", TOO_LARGE)


def _send_items(session, request, items: list[Item], parts: list, seq: int, refs: list | None,
                on_abandon: Callable[[], None] | None = None, on_written: Callable[[], None] | None = None) -> None:
    sizes = [item.nbytes for item in items]
    header = request.command.reply(request.id)
    header[Key.SEQ], header[Key.ITEMS], header[Key.SIZES] = seq, [item.description for item in items], sizes
    if getattr(request, "tags", None):  # asked for (relays): every item's tag
        header[Key.TAGS] = [item.tag for item in items]
    if refs is None:
        payload_len = sum(sizes)
    else:
        header[Key.REFS] = [None if files is None else files.ref() for files in refs]
        payload_len = sum(item.nbytes for item, files in zip(items, refs) if files is None)
    parts.insert(0, frame_head(header, payload_len))
    session.send(parts, on_abandon, on_written)
    counters = session.counters
    if counters is not None:
        counters.verbs[request.command.verb].bytes_out += payload_len
        if items and items[-1].tag is not None:  # the version a worker holds
            counters.read(session.stats, request.bin, items[-1].tag)


# -- LIST, DELETE


@handles(LIST)
def listing(session, request) -> None:
    session.send_header(LIST.reply(request.id, bins=session.storage.listing()))


@handles(DELETE)
def delete(session, request) -> None:
    def finish(change: Change | None, error: RemoteError | None) -> None:
        if error is not None:
            session.refuse(request.id, error)
            return
        session.state.ephemeral.forget(request.bin)
        session.send_header(DELETE.reply(request.id, n=0, seq=change.seq))
        session.state.listeners.publish(change)

    session.wait_for(lambda done: session.storage.delete(request.bin, done), finish)


# -- LISTEN, UNLISTEN


@handles(LISTEN)
def listen(session, request) -> None:
    name, limit = request.bin, session.config.max_listens
    if name not in session.listening and len(session.listening) >= limit:
        raise RemoteError(f"a connection may listen to {limit} bins", TOO_LARGE)
    session.listening.add(name)
    session.state.listeners.add(name, session, bool(request.first_append))
    state = session.storage.state(name)
    # Sent before any later notification: the snapshot and the stream are atomic.
    session.send_header(LISTEN.reply(request.id, exists=state.exists, n=state.n_items, seq=state.seq, tag=state.tag))


@handles(UNLISTEN)
def unlisten(session, request) -> None:
    session.listening.discard(request.bin)
    session.state.listeners.discard(request.bin, session)
    session.notifier.forget(request.bin)
    session.send_header(UNLISTEN.reply(request.id))


# -- NOOP, AUTH


@handles(NOOP)
def noop(session, request) -> None:
    session.send_header(NOOP.reply(request.id))


@handles(AUTH)
def auth_again(session, request) -> None:
    """AUTH once authenticated, or on a server without a token (PROTOCOL.md §4.3)."""
    if session.state.token is None:
        raise RemoteError("this server does not use authentication", BAD_SEQUENCE)
    raise RemoteError("already authenticated", BAD_SEQUENCE)


from . import tables as _tables  # noqa: E402,F401 - registers the table verbs (TCREATE...; PROTOCOL.md §12)
