"""What the server does for each bin verb: one handler per declared command.

A handler gets the :class:`~.session.ServerSession` and a request already checked
against its :class:`~tensorshare.protocol.messages.Command` (PROTOCOL.md §4.2-4.3),
and returns the request's outcome (:mod:`.outcome`): its reply now, or a
:class:`~.outcome.Pending` for one that waits for the disk or for its bin; a
refusal is raised as the :class:`~tensorshare.errors.RemoteError` whose code is
the reply.  It reaches bins only through ``session.storage``, which publishes
every change it makes (this connection's own notifications follow its reply).
The table verbs are in :mod:`.tables`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

from tensorshare.errors import BusyError, ProtocolError, RemoteError
from tensorshare.protocol.messages import (
    APPEND, AUTH, BAD_ARGS, BAD_SEQUENCE, DELETE, GET, LIST, LISTEN, NOOP, PEEK, PUT, TOO_LARGE, UNAVAILABLE,
    UNLISTEN, Key,
)
from tensorshare.wire.description import check_description
from tensorshare.wire.frames import frame_head

from ..bins.store import Change, Item
from . import devices, longpoll
from .outcome import in_lane, later
from .registry import handles

_SMALL_REPLY = 16 << 10  # payload bytes of a GET/PEEK reply made as one bytes (copied once: cheaper than parts)

log = logging.getLogger("tensorshare.server")


# -- PUT, APPEND


@handles(PUT, APPEND)
def store(session, request):
    """Replace the bin's items (PUT) or add one (APPEND): from the payload, or from
    the item directory a same-host client wrote (PROTOCOL.md §10.4).  An APPEND
    with ``below`` first waits for room (:func:`_when_room`)."""
    storage, replace = session.storage, request.command is PUT
    name, blob, tag = request.bin, request.value, request.tag
    if replace:
        ephemeral = request.ephemeral is True
        usual = not ephemeral and request.cuda is None and request.fill is None
    else:
        ephemeral = False
        usual = request.below is None
    if usual and request.shm is None and storage.data_dir is None and not session.state.ephemeral.owners:
        # the usual store: over TCP, into memory at once, no bin that ends with a connection
        nbytes = request.payload_len
        check_value(session, blob, nbytes)
        return stored(session, request, storage.add_now(name, blob, tuple(request.payload), nbytes, tag, replace))
    return _store_otherwise(session, request, storage, replace, name, blob, tag, ephemeral)


def _store_otherwise(session, request, storage, replace: bool, name: str, blob: bytes, tag, ephemeral: bool):
    """:func:`store` for all but the usual case.  (Apart, so that the usual one makes
    none of the cells its callbacks need: one per variable they name, every call.)"""
    if ephemeral or session.state.ephemeral.owners:
        _check_ephemeral(session, request, ephemeral)
    if replace and (request.cuda is not None or request.fill is not None):  # by device reference (§13)
        return devices.store(session, request, check_value, stored)
    waits_for_room = not replace and request.below is not None and not _room_now(session, request)
    if request.shm is not None:
        incoming, item_name, size = session.shared.adoption(request)
        check_value(session, blob, size)
        limits = session.decode_limits

        def add(done: Callable) -> None:
            storage.adopt(name, incoming, item_name, blob, size, tag, replace, done, limits)
    else:
        nbytes = request.payload_len
        check_value(session, blob, nbytes)
        segments = tuple(request.payload)
        if ephemeral:
            if session.closed:  # run after its connection ended (§8.3): it would end with it
                return None
            change = storage.add_now(name, blob, segments, nbytes, tag, replace)  # ephemeral: in memory only
            session.state.ephemeral.claim(name, session, request.owner)
            return stored(session, request, change)
        if not waits_for_room and not storage.durable:  # the usual case: stored in memory at once
            return stored(session, request, storage.add_now(name, blob, segments, nbytes, tag, replace))

        def add(done: Callable) -> None:
            storage.add(name, blob, segments, nbytes, tag, replace, done)

    def finish(change: Change | None, error: RemoteError | None):
        if error is not None:
            raise error
        return stored(session, request, change)

    if waits_for_room:
        return _when_room(session, request, add, finish)
    return later(add, finish)


def _check_ephemeral(session, request, ephemeral: bool) -> None:
    """501 for a store that would mix an ephemeral bin with lasting items
    (:mod:`.ephemeral`)."""
    if ephemeral and request.shm is not None:
        raise RemoteError("an ephemeral value comes over TCP, not through shared memory", BAD_ARGS)
    session.state.ephemeral.check_store(request.bin, ephemeral, session.storage.exists_or_coming(request.bin))


def _room_now(session, request) -> bool:
    """Whether an APPEND with ``below`` can be stored at once, as any APPEND: in
    memory, nobody waiting for room in its bin before it, and room (the usual case
    of a producer that is not ahead; it then keeps the pipelined path)."""
    key = (request.bin, APPEND.lane)
    return (request.shm is None and not session.storage.durable and not session.state.waits.waiting(key)
            and _has_room(session, request.bin, request.below))


def _has_room(session, name: str, below: int) -> bool:
    """Whether bin ``name`` holds fewer than ``below`` items, those being stored included."""
    return session.storage.count(name) + session.state.waits.going((name, APPEND.lane)) < below


def _when_room(session, request, add: Callable, finish: Callable):
    """``add(done)`` once the bin holds fewer than ``request.below`` items (those
    being stored count), waiting up to ``request.wait`` seconds (PROTOCOL.md §4.4)."""
    storage, name, below = session.storage, request.bin, request.below
    wait = request.wait or 0

    def expire(done: Callable) -> None:
        done(None, BusyError(f"bin {name!r} still held {storage.count(name)} items (below {below} asked) "
                             f"after waiting {wait:g}s; nothing stored"))

    return in_lane(name, APPEND, lambda: _has_room(session, name, below), add, finish, wait, expire)


def check_value(session, blob: bytes, nbytes: int) -> None:
    """501 unless ``blob`` describes a value whose payload is ``nbytes`` long."""
    try:  # cheap for a description seen before (the codec remembers them)
        check_description(blob, nbytes, session.decode_limits)
    except ProtocolError as exc:
        raise RemoteError(f"bad value: {exc}", BAD_ARGS) from None


def stored(session, request, change: Change) -> dict | bytes:
    """The reply to a PUT/APPEND the storage is done with (and has published)."""
    if request.tag is not None and session.counters is not None:  # versions of RL experiments
        session.counters.stored(session.stats, request.command.verb, request.bin, request.tag)
    shared = session.shared
    if shared.devices is None and not (shared.same_host and request.bin in shared.mapped):  # (not shared.maps())
        return request.command.success.head(request.id, change.n_items, change.seq)  # the usual reply
    header = shared.stored_reply(request.command.reply(request.id, n=change.n_items, seq=change.seq), request.bin)
    return header if shared.devices is None else devices.with_freed(session, header)


# -- GET, PEEK


@handles(GET)
def get(session, request):
    """Take the bin's items (at most ``max``); with ``wait``, once it holds ``least``
    of them (:mod:`.longpoll`)."""
    if request.least is not None and request.max is not None and request.least > request.max:
        raise RemoteError(f"least ({request.least}) must not exceed max ({request.max})", BAD_ARGS)
    if request.wait and not longpoll.enough_items(session, request):
        return longpoll.hold(session, request, longpoll.enough_items, take)
    return take(session, request)


def take(session, request):
    """Take the items out of the bin.  The take and its notification happen now;
    the reply follows once any file the items live in is open (if any is only on
    disk), and the items go back to the front of the bin if it cannot be delivered."""
    storage, name = session.storage, request.bin
    items = storage.peek(name)
    if request.max is not None:
        items = items[: request.max]
    small = _small(session, request, items)
    if small is not None:  # the usual case: a few small items in memory
        items, change = storage.take(name, request.max)
        return ([_small_reply(session, request, change.seq, items, small)], partial(storage.restore, name, items),
                partial(storage.delivered, name, items))
    if devices.unready(items, None):  # bytes still in a publisher's device memory (§13)
        return devices.hold_for_bytes(session, request, take)
    _check_reply_size(session, items)  # refused before anything is taken
    refs = None if request.ref is None else session.shared.refs(request.bin, request.ref, items, taking=True)
    if refs is not None and session.outbox.peer_gone():
        # Writing the items into shared memory for reference took long enough for the
        # client to give up (a timeout) and close: a reply now would reach nobody, and
        # its references are too small to be caught undelivered (§8.3).  Take nothing.
        raise RemoteError("the client closed the connection before its items could be referred to", UNAVAILABLE)
    items, change = storage.take(name, request.max)  # (this connection's own notification follows the reply)
    parts = storage.parts_in_memory(items, refs)
    if parts is not None:  # the usual case
        return _taken(session, request, items, change.seq, refs, parts)
    return _take_from_files(session, request, items, change.seq, refs)


def _taken(session, request, items: list[Item], seq: int, refs: list | None, parts: list):
    """The reply of a GET that took ``items``: they go back to the front of the bin if
    it is not delivered, and count against the budget until it is."""
    storage, name = session.storage, request.bin
    out = items_reply(session, request, items, parts, seq, refs, partial(storage.restore, name, items),
                      partial(storage.delivered, name, items))
    if refs is not None:
        session.shared.pin(request.id, items, refs)
    return out


def _take_from_files(session, request, items: list[Item], seq: int, refs: list | None):
    """:func:`take`'s reply once the files of the items only on disk are open.  (Apart,
    as :func:`_store_otherwise`.)"""
    storage = session.storage

    def read(parts: list | None, error: RemoteError | None):
        if error is not None:
            storage.restore(request.bin, items)
            raise error
        return _taken(session, request, items, seq, refs, parts)

    return later(lambda done: storage.read(items, refs, done), read)


@handles(PEEK)
def peek(session, request):
    """Read every item of the bin, which keeps them; with ``since``, none while the
    bin is still at that seq, and with ``wait`` too, once it has moved on
    (:mod:`.longpoll`)."""
    if request.wait and not longpoll.moved_on(session, request):
        return longpoll.hold(session, request, longpoll.moved_on, read)
    return read(session, request)


def read(session, request):
    """Send the bin's items, or none if it is still at seq ``since`` (nothing new)."""
    storage, name = session.storage, request.bin
    seq = storage.seq(name)
    items = [] if request.since is not None and seq == request.since else storage.peek(name)
    if request.cuda is None:
        small = _small(session, request, items)
        if small is not None:  # the usual case: a few small items in memory
            return _small_reply(session, request, seq, items, small)
    cuda = devices.refs(session, request.cuda, items) if request.cuda is not None else None
    if devices.unready(items, cuda):  # bytes still in a publisher's device memory (§13)
        return devices.hold_for_bytes(session, request, read)
    _check_reply_size(session, items)
    refs = away = None if request.ref is None else session.shared.refs(name, request.ref, items)
    if cuda is not None:  # items whose bytes the payload does not carry: by file or by device reference
        refs = devices.besides(refs, cuda)
        away = devices.merged(refs, cuda)
    parts = storage.parts_in_memory(items, away)
    if parts is not None:  # the usual case: no disk, no wait
        return _read(session, request, items, seq, refs, cuda, away, parts)
    return _read_from_files(session, request, items, seq, refs, cuda, away)


def _read(session, request, items: list[Item], seq: int, refs: list | None, cuda: list | None, away: list | None,
          parts: list):
    """The reply of a PEEK carrying ``items``: ``refs``/``cuda``, per item, its file or
    device reference (``away``: either), ``parts`` the payload of the others."""
    out = items_reply(session, request, items, parts, seq, refs, cuda=cuda)
    if away is not None:
        session.shared.pin(request.id, items, away)
    if request.ref is not None:
        session.shared.promote(request.ref, items, away, session.decode_limits)
    return out


def _read_from_files(session, request, items: list[Item], seq: int, refs: list | None, cuda: list | None,
                     away: list | None):
    """:func:`read`'s reply once the files of the items only on disk are open.  (Apart,
    as :func:`_store_otherwise`.)"""

    def opened(parts: list | None, error: RemoteError | None):
        if error is not None:
            raise error
        return _read(session, request, items, seq, refs, cuda, away, parts)

    return later(lambda done: session.storage.read(items, away, done), opened)


def _small(session, request, items: list[Item]) -> tuple | None:
    """``(payload parts, sizes, descriptions, payload bytes)`` of the reply carrying
    ``items`` when it is small and in memory, one ``bytes`` made at once (what the
    general path would give, less its work: no item is large enough to go by
    reference, none waits for a device or the disk, the header is within
    ``max_reply_header``, no tags asked for); None otherwise."""
    if request.tags:
        return None
    limit = _SMALL_REPLY
    if request.ref is not None and session.config.zero_copy_min < limit:  # (not min(): a costly call)
        limit = session.config.zero_copy_min
    parts, sizes, descriptions, total, described = [], [], [], 0, 0
    for item in items:
        segments = item.segments
        total += item.nbytes
        if segments is None or total >= limit:  # (a large reply is given up at its first large item)
            return None
        parts.extend(segments)
        sizes.append(item.nbytes)
        descriptions.append(item.description)
        described += len(item.description)
    if described > session.config.max_reply_header:
        return None
    return parts, sizes, descriptions, total


def _small_reply(session, request, seq: int, items: list[Item], small: tuple) -> bytes:
    """The 226 reply carrying ``items`` (:func:`_small`'s), one ``bytes``: the frame head, then the payload."""
    parts, sizes, descriptions, total = small
    if session.counters is not None:
        _count_read(session, request, items, total)
    parts.insert(0, _items_head(request, seq, descriptions, sizes, total))
    return b"".join(parts)


def _items_head(request, seq: int, descriptions: list, sizes: list, payload_len: int, more: dict | None = None) -> bytes:
    """The frame head of a 226 reply carrying items with these ``descriptions`` and
    ``sizes`` (``more``: its other fields): one item and nothing more, the usual read of
    a bin of one value, from the reply's prepared template (``Message.lone``)."""
    success = request.command.success
    if more is None and len(sizes) == 1:
        return success.lone(request.id, seq, descriptions[0], payload_len)
    header = {Key.CODE: success.code, Key.ID: request.id, Key.SEQ: seq, Key.ITEMS: descriptions, Key.SIZES: sizes}
    if more is not None:
        header.update(more)
    return frame_head(header, payload_len)


def _check_reply_size(session, items: list[Item]) -> None:
    """552 for a reply whose header, holding every item's description, would be
    larger than max_reply_header."""
    limit = session.config.max_reply_header
    size = 0
    for item in items:
        size += len(item.description)
    if size > limit:
        raise RemoteError(f"the bin's {len(items)} item descriptions take {size} bytes, over the {limit} one "
                          f"reply may carry", TOO_LARGE)


def items_reply(session, request, items: list[Item], parts: list, seq: int, refs: list | None,
                on_abandon: Callable[[], None] | None = None, on_written: Callable[[], None] | None = None,
                cuda: list | None = None):
    """A 226 reply carrying ``items``: its frame parts (with the hooks of a GET's);
    ``refs`` and ``cuda``: per item, a reference to its files or to its device
    memory standing for its bytes (PROTOCOL.md §10.3, §13.2)."""
    sizes, descriptions, more = [], [], None
    for item in items:
        sizes.append(item.nbytes)
        descriptions.append(item.description)
    if getattr(request, "tags", None):  # asked for (relays): every item's tag
        more = {Key.TAGS: [item.tag for item in items]}
    if refs is None and cuda is None:
        payload_len = sum(sizes)
    else:
        more = more or {}
        if refs is not None:
            more[Key.REFS] = [None if files is None else files.ref() for files in refs]
        if cuda is not None:  # device references (§13.2)
            more[Key.CUDA] = cuda
        away = devices.merged(refs, cuda)
        payload_len = sum(item.nbytes for item, files in zip(items, away) if files is None)
    parts.insert(0, _items_head(request, seq, descriptions, sizes, payload_len, more))
    if session.counters is not None:
        _count_read(session, request, items, payload_len)
    if on_abandon is None and on_written is None:
        return parts
    return parts, on_abandon, on_written


def _count_read(session, request, items: list[Item], payload_len: int) -> None:
    """Count a GET/PEEK reply's bytes, and the version it hands a worker (metrics on)."""
    counters = session.counters
    counters.verbs[request.command.verb].bytes_out += payload_len
    if items and items[-1].tag is not None:  # the version a worker holds
        counters.read(session.stats, request.bin, items[-1].tag)


# -- LIST, DELETE


@handles(LIST)
def listing(session, request) -> dict:
    return LIST.reply(request.id, bins=session.storage.listing())


@handles(DELETE)
def delete(session, request):
    if request.owner is not None and not session.state.ephemeral.owns(request.bin, session, request.owner):
        # Not (any more) the ephemeral bin of that client of this connection: nothing changes (§4.6).
        state = session.storage.state(request.bin)
        return DELETE.reply(request.id, n=state.n_items, seq=state.seq)

    def deleted(change: Change | None, error: RemoteError | None) -> dict:
        if error is not None:
            raise error
        session.state.ephemeral.forget(request.bin)
        return DELETE.reply(request.id, n=0, seq=change.seq)

    return later(lambda done: session.storage.delete(request.bin, done), deleted)


# -- LISTEN, UNLISTEN


@handles(LISTEN)
def listen(session, request) -> dict:
    name, limit = request.bin, session.config.max_listens
    if name not in session.listening and len(session.listening) >= limit:
        raise RemoteError(f"a connection may listen to {limit} bins", TOO_LARGE)
    session.listening.add(name)
    session.state.listeners.add(name, session, bool(request.first_append))
    state = session.storage.state(name)
    # Answered before any later notification: the snapshot and the stream are atomic.
    return LISTEN.reply(request.id, exists=state.exists, n=state.n_items, seq=state.seq, tag=state.tag)


@handles(UNLISTEN)
def unlisten(session, request) -> dict:
    session.listening.discard(request.bin)
    session.state.listeners.discard(request.bin, session)
    session.notifier.forget(request.bin)
    return UNLISTEN.reply(request.id)


# -- NOOP, AUTH


@handles(NOOP)
def noop(session, request) -> dict | bytes:
    if session.shared.devices is None:
        return NOOP.success.head(request.id)
    return devices.with_freed(session, NOOP.reply(request.id))


@handles(AUTH)
def auth_again(session, request):
    """AUTH once authenticated, or on a server without a token (PROTOCOL.md §4.3)."""
    if session.state.token is None:
        raise RemoteError("this server does not use authentication", BAD_SEQUENCE)
    raise RemoteError("already authenticated", BAD_SEQUENCE)
