"""CUDA IPC on one host, server side: items whose bytes stay in their publisher's GPU memory (PROTOCOL.md §13).

A client on the server's host may PUT a value by *reference* to a snapshot of it
in its GPU memory (``cuda``: the CUDA IPC handle and the device's UUID, the
reference's id and a digest per array).  The server stores the item with the
reference beside it and without its bytes.  A PEEK that lists the devices its
client can open (``cuda``: their UUIDs) gets the reference in place of the item's
bytes, and that client copies the item device to device.  The publisher then sends
the bytes (a PUT with ``fill``: the reference's id), which every other reader gets
as for any item (over TCP, or mapped on this host); until they arrive such a read
waits in the server (:data:`BYTES_WAIT`, or the read's ``wait``; then 451).

Lifetimes (§13.3).  The publisher keeps a snapshot until the server says nothing
holds its reference: the item has left its bin (replaced, taken, deleted) and
every reply that carried the reference was released (as shared-memory
references are, §10.3: the pins of :mod:`.shared` hold the item).  The server learns
that when the item object is freed (a weak reference's callback, on whatever
thread drops it last) and tells the publisher in the ``freed`` field of the next
reply to a PUT, APPEND or NOOP of its connection.  A publisher whose connection ends takes
its references with it: items that have their bytes keep them, the others cannot
be read any more (451), and reads held for them are answered so.

The server never opens a reference: it only stores it, hands it out and checks
its form; the items are the storage's (``Storage.add_reference``, ``fill``,
``fill_shared``).  As every handler, these return outcomes (:mod:`.outcome`).
Nothing here imports torch.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Callable

from tensorshare.errors import RemoteError, ServerLocalError
from tensorshare.protocol.messages import BAD_ARGS, PUT, ZERO_COPY_REFUSED, Key
from tensorshare.wire.description import parse_description

from ..bins.store import Item
from . import longpoll
from .outcome import Pending, later
from .shared import declared_size

BYTES_WAIT = 60.0  # seconds a read waits for the bytes of an item put by reference before 451
_MEMORY_HANDLE = 64 << 10  # bytes of torch's handle of a block: 64 (torch < 2.5), 66 (a version and a kind
# before the 64), more for an expandable segment (a few per 20 MiB of it)
_EVENT_HANDLE = 64  # bytes of a cudaIpcEventHandle_t
_COUNTER = 256  # bytes of the name of the publisher's reference counter
_MAX_DEVICES = 16  # UUIDs a PEEK may list
_MAX_DIGESTS = 1 << 20  # (and exactly one per array of the value)
_REFERENCE_OVERHEAD = 600  # bytes of the dicts, lists and ints a reference is held in
_DIGEST_BYTES = 40  # bytes of one digest (an int object and its place in the list)


def check_reference(ref: object) -> dict:
    """The device reference of a PUT, checked; 501 for anything else.

    ``{"id": int, "dev": str, "ipc": [device, handle, size, offset, counter,
    counter offset, event, event sync], "digest": [int, ...]}`` (PROTOCOL.md §13.1)."""
    def bad(why: str) -> RemoteError:
        return RemoteError(f"bad device reference: {why}", BAD_ARGS)

    if type(ref) is not dict:
        raise bad("not a map")
    ident, dev, ipc, digest = ref.get("id"), ref.get("dev"), ref.get("ipc"), ref.get("digest")
    if type(ident) is not int or not 0 < ident < (1 << 63):
        raise bad("id must be an integer in 1..2**63-1")
    if type(dev) is not str or not 0 < len(dev) <= 100:
        raise bad("dev must be a device UUID")
    kinds = (int, bytes, int, int, bytes, int, bytes, bool)
    limits = (None, _MEMORY_HANDLE, None, None, _COUNTER, None, _EVENT_HANDLE, None)
    if type(ipc) is not list or len(ipc) != len(kinds) or any(type(v) is not k for v, k in zip(ipc, kinds)):
        raise bad("ipc must be [int, bytes, int, int, bytes, int, bytes, bool]")
    if any(limit is not None and len(v) > limit for v, limit in zip(ipc, limits)) or \
            any(type(v) is int and v < 0 for v in ipc):
        raise bad("ipc fields out of range")
    if type(digest) is not list or len(digest) > _MAX_DIGESTS or \
            any(type(d) is not int or not -(1 << 63) <= d < (1 << 63) for d in digest):
        raise bad("digest must be a list of 64-bit integers")
    return {"id": ident, "dev": dev, "ipc": ipc, "digest": digest}


class DeviceItems:
    """One connection's items put by reference, and its references that nothing
    holds any more (told in its next reply).  Holds no session: the callbacks
    that feed :attr:`freed` may outlive it.  ``references`` is the server's
    ``(id, bin) -> DeviceItems`` of every publisher, where a fill finds its item
    whatever connection brings the bytes."""

    def __init__(self, storage, references: dict):
        self.storage, self.references = storage, references
        self.published: dict[tuple, weakref.ref] = {}  # (reference id, bin) -> weak item
        self.freed: deque = deque()  # ids of references no item holds any more

    def publish(self, item: Item, ident: int, name: str) -> None:
        """``item`` (stored by reference ``ident`` in bin ``name``) is this connection's."""
        key = (ident, name)
        handle = self.published[key] = weakref.ref(item)
        self.references[key] = self
        finalizer = weakref.finalize(item, _gone, self, key, handle)
        finalizer.atexit = False

    def item(self, key: tuple) -> Item | None:
        """The item put with reference ``key`` (``(id, bin)``; None if it is gone)."""
        handle = self.published.get(key)
        return None if handle is None else handle()

    def take_freed(self) -> list | None:
        if not self.freed:
            return None
        out = []
        while self.freed:
            out.append(self.freed.popleft())
        return out

    def connection_lost(self) -> None:
        """The publisher is gone: its items keep their bytes or become unreadable
        (reads held for those bytes are answered now: the storage says so)."""
        for key, handle in list(self.published.items()):
            if self.references.get(key) is self:
                del self.references[key]
            item = handle()
            if item is not None:
                self.storage.lose_reference(key[1], item)
        self.published.clear()


def _gone(owner: DeviceItems, key: tuple, handle: weakref.ref) -> None:
    """An item put by reference was freed (on whatever thread dropped it last)."""
    owner.freed.append(key[0])  # (deque.append is safe from any thread)
    if owner.published.get(key) is handle:  # (not a newer item put with the same id to the same bin)
        del owner.published[key]
        if owner.references.get(key) is owner:
            del owner.references[key]


def has_payload(item: Item) -> bool:
    return item.segments is not None or item.files is not None


def items_of(session) -> DeviceItems:
    """The connection's :class:`DeviceItems` (made on first use)."""
    shared = session.shared
    if shared.devices is None:
        shared.devices = DeviceItems(session.storage, session.state.references)
    return shared.devices


def reference_bytes(ref: dict) -> int:
    """The memory a checked reference takes in the server (its parts, as Python holds them)."""
    ipc = ref["ipc"]
    return _REFERENCE_OVERHEAD + len(ref["dev"]) + len(ipc[1]) + len(ipc[4]) + len(ipc[6]) + \
        _DIGEST_BYTES * len(ref["digest"])


# -- PUT by reference, and its bytes


def store(session, request, check_value: Callable, stored: Callable):
    """A PUT with ``cuda`` (store the item by reference) or ``fill`` (its bytes): its
    outcome.  ``check_value(session, description, nbytes)`` refuses a bad value;
    ``stored(session, request, change)`` is the reply to a PUT stored."""
    storage = session.storage
    if not session.shared.same_host or storage.durable or request.ephemeral:
        raise RemoteError("device references are taken from clients on this host, by a server without a data "
                          "directory, for lasting bins", ZERO_COPY_REFUSED)
    if request.fill is not None:
        return _fill(session, request, check_value)
    if request.payload_len or request.shm is not None:
        raise RemoteError("a value put by device reference comes without bytes", BAD_ARGS)
    ref = check_reference(request.cuda)
    size = declared_size(request.size, session.config.max_frame)
    check_value(session, request.value, size)
    arrays = len(parse_description(request.value, size, session.decode_limits).arrays)
    if len(ref["digest"]) != arrays:
        raise RemoteError(f"bad device reference: {len(ref['digest'])} digests for {arrays} arrays", BAD_ARGS)
    readers = {"dev": ref["dev"], "ipc": ref["ipc"], "digest": ref["digest"]}  # (the id is the publisher's)
    item, change = storage.add_reference(request.bin, request.value, size, request.tag, readers,
                                         reference_bytes(ref))
    items_of(session).publish(item, ref["id"], request.bin)
    return stored(session, request, change)


def _fill(session, request, check_value: Callable):
    """The bytes of an item put by reference: given to it if it is still there and
    has none (else dropped; the reply says the same either way).  They may come on
    any connection from the server's host that names the reference (its id is
    known only to its publisher, who sends them on a connection of their own)."""
    storage, name = session.storage, request.bin
    key = (request.fill, name)
    owner = session.state.references.get(key)
    item = None if owner is None else owner.item(key)
    size = request.size if request.shm is not None else request.payload_len
    if item is not None and (request.value != item.description or size != item.nbytes):
        raise RemoteError("fill does not match the item put by that reference", BAD_ARGS)
    if item is None or has_payload(item) or not item.stored:
        return _reply(session, request)
    check_value(session, request.value, size)
    if request.shm is None:
        storage.fill(name, item, tuple(request.payload))  # (reads waiting for the bytes are tested again)
        return _reply(session, request)
    incoming, item_name, _size = session.shared.adoption(request)

    def filled(error: RemoteError | None) -> dict:
        if error is not None:
            raise error
        return _reply(session, request)

    return later(lambda done: storage.fill_shared(name, item, incoming, item_name, done, session.decode_limits),
                 filled)


def _reply(session, request) -> dict:
    """A fill's 250: the bin's count and seq, ``mapped`` when same-host readers map
    the bin (the next bytes are best sent through shared memory, §10.4)."""
    state = session.storage.state(request.bin)
    header = session.shared.stored_reply(PUT.reply(request.id, n=state.n_items, seq=state.seq), request.bin)
    return with_freed(session, header)


def with_freed(session, header: dict) -> dict:
    """``header`` with the connection's references nothing holds any more (§13.3)."""
    devices = session.shared.devices
    if devices is not None and devices.freed:
        header[Key.FREED] = devices.take_freed()
    return header


# -- reads


def refs(session, wanted: object, items: list[Item]) -> list | None:
    """For a PEEK listing the devices its client opens (``wanted``): per item, its device
    reference if it has one on such a device, else None; None when none has."""
    if not wanted or not session.shared.same_host:
        return None
    if type(wanted) is not list or len(wanted) > _MAX_DEVICES or any(type(u) is not str for u in wanted):
        raise RemoteError(f"cuda must list at most {_MAX_DEVICES} device UUIDs", BAD_ARGS)
    out = [None if item.device is None or item.device.value is None or item.device.value["dev"] not in wanted
           else item.device.value for item in items]
    return out if any(out) else None


def unready(items: list[Item], cuda: list | None) -> bool:
    """Whether a read of ``items`` must wait for bytes still in a publisher's device
    memory (items it gets a reference to need none); 451 for an item whose
    publisher left before sending them."""
    for i, item in enumerate(items):
        if item.device is not None and item.segments is None and item.files is None:
            if item.device.lost:
                raise ServerLocalError("the item's publisher went away before its bytes came: it cannot be read")
            if cuda is None or cuda[i] is None:
                return True
    return False


def hold_for_bytes(session, request, answer: Callable) -> Pending:
    """Answered with ``answer(session, request)`` once its bin's items have their
    bytes (or are gone), up to :data:`BYTES_WAIT` seconds, or the request's own
    ``wait`` if it gives one (0: not at all); then 451.  (A relay asks with 0: a
    read held here holds every later request of its connection.)"""
    def ready(session, request) -> bool:
        items = session.storage.items_of(request.bin)
        try:
            return not unready(items, refs(session, getattr(request, "cuda", None), items))
        except RemoteError:  # lost: answering refuses it
            return True

    bound = BYTES_WAIT if request.wait is None else min(request.wait, BYTES_WAIT)

    def refusal() -> ServerLocalError:
        return ServerLocalError(f"the bytes of an item put by device reference did not come within {bound:g}s")

    if bound <= 0:
        raise refusal()
    return longpoll.hold(session, request, ready, answer, timeout=bound, refusal=refusal)


def besides(refs: list | None, cuda: list | None) -> list | None:
    """File references ``refs`` for the items that get no device reference (one
    reference per item: the device's, where the reader can open it)."""
    if refs is None or cuda is None:
        return refs
    refs = [None if c is not None else r for r, c in zip(refs, cuda)]
    return refs if any(refs) else None


def merged(refs: list | None, cuda: list | None) -> list | None:
    """Per item, what stands for its bytes in a reply (a file reference or a device
    reference), None where the payload carries them."""
    if cuda is None:
        return refs
    if refs is None:
        return cuda
    return [r if r is not None else c for r, c in zip(refs, cuda)]
