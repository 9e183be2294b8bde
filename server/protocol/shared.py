"""Same-host zero-copy, server side: the policy of one connection (PROTOCOL.md §10).

A client on the server's host is offered the shared areas (in the greeting, or in
the 230 reply when it must authenticate first: no offer before authentication).
Its GET/PEEK may then be answered with references to items' files instead of
their bytes (the files stay pinned until the client releases the reply), and its
PUT/APPEND may name an item directory it wrote into its own incoming directory.
What is decided here is *what* goes by reference; the files themselves are the
storage's (``server/bins/storage.py``, ``server/bins/shm.py``).
"""

from __future__ import annotations

import logging
from tensorshare.disk.areas import worth_sharing
from tensorshare.errors import RemoteError, TooLargeError
from tensorshare.protocol.messages import BAD_ARGS, ZERO_COPY_REFUSED, Key
from tensorshare.wire.description import parse_description

from ..bins.keptrows import KeptRows
from ..bins.store import Item
from .outcome import later

log = logging.getLogger("tensorshare.server")
_MAX_PINS = 256  # unreleased 226 replies with references per connection; older ones are let go
_MAX_AREAS = 8
# Bytes a reference read may copy into shared memory on the reactor thread (tmpfs: a
# memcpy into new pages, about 25 ms here); beyond, the copy is made in the background.
PROMOTE_NOW_MAX = 64 << 20


class SharedMemory:
    """The zero-copy state of one session: its incoming directory and its pins."""

    def __init__(self, storage, config, same_host: bool, peer: str = "?", mapped: set | None = None):
        # Not the session itself: a reference back would make a cycle that keeps a
        # closed connection's memory until the cyclic garbage collector runs.
        self.storage, self.config, self.peer = storage, config, peer
        # The server's bins that same-host readers asked references to (ServerState.mapped): a
        # same-host writer is told so, and puts their next values through shared memory.
        self.mapped = set() if mapped is None else mapped
        self.same_host = same_host  # the peer is on this host: zero-copy may be offered
        self.incoming: str | None = None  # this connection's incoming directory in the shared-memory area
        self._pins: dict[int, list] = {}  # id of a 226 with references -> [(item, files)] until released
        self.devices = None  # devices.DeviceItems: what this connection put by device reference (§13)
        self._kept_rows: KeptRows | None = None

    # -- the offer (§10.1)

    def offer(self, reply: dict, session):
        """``reply`` (the greeting, or the 230 of AUTH) as the outcome to send, with the
        ``shm`` offer when the peer is on this host; making its incoming directory
        waits for the disk (a :class:`~.outcome.Pending`)."""
        storage = self.storage
        if not (self.same_host and storage.areas):
            return reply
        offer = {"token": storage.token, "areas": [area.root for area in storage.areas],
                 "min_bytes": self.config.zero_copy_min, "cuda": not storage.durable}  # device references (§13)
        if storage.sharing.socket is not None:  # (in the shared-memory area: the token check covers it)
            offer["socket"] = storage.sharing.socket
        reply[Key.SHM] = offer
        if not storage.takes_rows:
            return reply
        if not storage.takes_incoming:  # a data directory: values are written to disk from the payload
            offer["values"] = False

        def opened(incoming: str | None, error: BaseException | None) -> dict:
            if error is not None:
                log.warning("zero-copy: no incoming directory for %s: %s", self.peer, error)
            elif session.closed:
                storage.close_incoming(incoming)
            else:
                self.incoming = offer["incoming"] = incoming
            return reply

        return later(storage.open_incoming, opened)

    @property
    def kept_rows(self) -> KeptRows:
        """The item directories this connection's client writes table rows into again
        and again (§10.4), kept open after the first insert naming each."""
        if self._kept_rows is None:
            self._kept_rows = KeptRows()
        return self._kept_rows

    def connection_lost(self) -> None:
        self._pins.clear()  # the client's mappings outlive the files' names
        if self._kept_rows is not None:
            self._kept_rows.close()
            self._kept_rows = None
        if self.devices is not None:  # its device references go with it (§13.3)
            self.devices.connection_lost()
        if self.incoming is not None:  # whatever its client wrote and did not send goes too
            self.storage.close_incoming(self.incoming)
            self.incoming = None

    # -- GET and PEEK by reference (§10.3)

    def refs(self, name: str, wanted, items: list[Item], taking: bool = False) -> list | None:
        """For a GET/PEEK asking for references (``wanted``: the areas it can map):
        per item, the files to refer to (in an area the client can map, and not too
        small to be worth it) or None (its bytes go in the payload).  None when no
        item gets a reference.

        A GET (``taking``) gets no references into the data directory, where a
        DELETE of the bin removes every file at once, pinned or not (PROTOCOL.md
        Appendix B): the taken items would be lost; a PEEK can be repeated."""
        if not wanted or not self.same_host or len(wanted) > _MAX_AREAS:
            return None
        minimum = self.config.zero_copy_min
        for item in items:  # (a loop: a generator here made a cell for minimum on every call)
            if item.nbytes >= minimum:
                break
        else:
            return None  # (none is worth sharing: small items go in the payload)
        self._read_by_reference(name)
        self._promote_now(wanted, items)
        durable = self.storage.data_area if taking else None
        refs = []
        for item in items:
            files = item.files
            if (files is not None and files.area is not None and files.area.index in wanted
                    and files.area is not durable and worth_sharing(item.nbytes, len(files.spans), minimum)):
                refs.append(files)
            else:
                refs.append(None)
        return refs if any(refs) else None

    def _read_by_reference(self, name: str) -> None:
        mapped = self.mapped
        if name not in mapped:
            if len(mapped) >= self.config.max_bins:  # (bounded: names of bins long gone go too)
                mapped.clear()
            mapped.add(name)

    def maps(self, name: str) -> bool:
        """Whether a PUT/APPEND to bin ``name`` on this connection is told that readers
        map it (:meth:`stored_reply`)."""
        return self.same_host and name in self.mapped

    def stored_reply(self, reply: dict, name: str) -> dict:
        """A PUT/APPEND's ``reply``, telling a same-host writer when readers map the bin
        (``mapped``, PROTOCOL.md §10.4): its next value is best put through shared
        memory, where those readers map it at once (over TCP it would reach them
        inline, before its copy into shared memory)."""
        if self.maps(name):
            reply[Key.MAPPED] = True
        return reply

    def maps_rows(self, table) -> bool:
        """Whether a TINSERT into ``table`` is answered with ``mapped`` (§10.4): its
        same-host writer's large batches are best sent through shared memory, since
        the table takes them from the writer's files as they are (a table in files,
        not durable: :attr:`~..bins.tables.Table.takes_mapped_rows`), sparing both
        sides the socket's copies."""
        return self.incoming is not None and self.storage.takes_rows and table.table.takes_mapped_rows

    def _promote_now(self, wanted, items: list[Item]) -> None:
        """Before a same-host reader's first reference read: copy the items that came
        over TCP (still in memory) into shared memory now, up to ``PROMOTE_NOW_MAX``
        bytes, so that this reader maps them too.  Same-host writers put ordinary
        values over TCP (faster than writing new shared-memory pages); the copy into
        tmpfs is then made once, here, and the bin's next values come through shared
        memory (``stored_reply``).  Larger items go in the background (:meth:`promote`)."""
        area = self.storage.shm_area
        if area is None or area.index not in wanted:
            return
        minimum, left = self.config.zero_copy_min, PROMOTE_NOW_MAX
        for item in items:
            if item.segments is not None and item.files is None and minimum <= item.nbytes <= left:
                if self.storage.promote_now(item):
                    left -= item.nbytes

    def promote(self, wanted, items: list[Item], refs: list | None, limits) -> None:
        """After a PEEK asking for references: copy the items it had to send inline
        (received over TCP, still in memory) into shared memory, for the next read."""
        area = self.storage.shm_area
        if not (self.same_host and area is not None and wanted and area.index in wanted):
            return
        minimum = self.config.zero_copy_min
        for i, item in enumerate(items):
            if (refs is None or refs[i] is None) and item.segments is not None and item.nbytes >= minimum:
                arrays = len(parse_description(item.description, item.nbytes, limits).arrays)
                if worth_sharing(item.nbytes, arrays, minimum):
                    self.storage.promote(item)

    def rows_ref(self, wanted, gathered):
        """For a TSAMPLE/TREAD asking for references (``wanted``): the stacked rows
        ``gathered`` (:class:`~..bins.tables.values.Gathered`) written as one item into
        the shared-memory area, its :class:`~..bins.spill.ItemFiles` to refer to; None
        when they go in the payload (a remote peer, an area the client cannot map,
        rows too small to gain, or shared memory full)."""
        area = self.storage.shm_area
        if not (wanted and self.same_host and area is not None and len(wanted) <= _MAX_AREAS
                and area.index in wanted
                and worth_sharing(gathered.nbytes, len(gathered.out), self.config.zero_copy_min)):
            return None
        return self.storage.share_rows(gathered.description, gathered.buffer, gathered.nbytes)

    def pin(self, rid: int, items: list[Item], refs: list | None) -> None:
        """Keep the files a reply referred to until the client releases it (or leaves)."""
        if refs is None:
            return
        pinned = [(item, files) for item, files in zip(items, refs) if files is not None]
        if pinned:
            pins = self._pins
            pins[rid] = pinned
            if len(pins) > _MAX_PINS:  # a client that never releases: let the oldest go
                del pins[next(iter(pins))]

    def release(self, ids: object) -> None:
        """The client no longer needs the references of replies ``ids``."""
        if type(ids) is list:
            pins = self._pins
            for rid in ids:
                if type(rid) is int:
                    pins.pop(rid, None)

    # -- PUT and APPEND through shared memory (§10.4)

    def adoption(self, request) -> tuple[str, str, int]:
        """``(incoming directory, item name, size)`` of a PUT/APPEND/TINSERT naming a
        value in shared memory; the :class:`RemoteError` to answer with if it cannot be."""
        if self.incoming is None:
            raise RemoteError("this connection has no shared-memory incoming directory", ZERO_COPY_REFUSED)
        if request.payload_len:
            raise RemoteError("a value in shared memory travels without payload", BAD_ARGS)
        return self.incoming, request.shm, declared_size(request.size, self.config.max_frame)


def declared_size(size: object, max_frame: int) -> int:
    """The payload size a value sent without its bytes declares (in shared memory,
    §10.4, or by device reference, §13.1): 501 unless an int >= 0, 552 past
    ``max_frame``, as the same value over TCP would be (§7)."""
    if type(size) is not int or size < 0:
        raise RemoteError(f"size must be an integer in 0..{max_frame}", BAD_ARGS)
    if size > max_frame:
        raise TooLargeError(f"a value of {size} bytes is more than the {max_frame} bytes the server takes in "
                            f"one request (its --max-frame)")
    return size
