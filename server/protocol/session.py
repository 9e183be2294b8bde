"""One client connection's protocol logic, without I/O (sans-IO).

A :class:`ServerSession` takes the bytes a connection received, decodes frames,
runs each request against the shared :class:`~.store.BinStore` and hands whole reply
frames (lists of parts: ``bytes``, views of stored chunks) to its :class:`Outbox`.  It also holds the
connection's policy: the connection limit, authentication (PROTOCOL.md §8.4) and the
idle and authentication time limits, which the adapter applies by calling
:meth:`ServerSession.tick` with the time.  The Twisted adapter in :mod:`.service`
only moves bytes and keeps the clock; tests can drive a session directly.

A session of a client on the same host (``same_host``) may also offer same-host
zero-copy (PROTOCOL.md §10): its greeting names the server's shared areas, GET and
PEEK may answer with references to item files instead of their bytes (the files
stay pinned until the client releases the reply), and PUT and APPEND may name an
item directory the client wrote into its incoming directory.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tensorshare import __version__
from tensorshare.protocol import auth
from tensorshare.protocol import messages as protocol
from tensorshare.disk.areas import new_token, worth_sharing
from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.wire.recycle import Recycler
from tensorshare.wire.description import check_description, parse_description
from tensorshare.wire.frames import DiscardSink, Frame, FrameDecoder, FrameLimits, SegmentSink, frame_head

from ..config import ServerConfig
from ..bins.durable import DataDir
from .notify import ListenerRegistry
from ..net.recvpool import CHUNK, PooledSink, chunk_pool
from ..bins.shm import ShmArea
from ..bins.spill import SpillArea
from ..bins.storage import InlineJobs, Jobs, Storage
from ..bins.store import BinStore, Change, Item

log = logging.getLogger("tensorshare.server")
_DISCARD = DiscardSink(0)  # stateless: one serves every request that takes no payload
_LASTING = frozenset({protocol.PUT, protocol.APPEND, protocol.DELETE})  # effects that outlive the connection
# Until a connection has authenticated, its frames may carry no payload and only a
# small header (an AUTH frame is about 150 bytes): an unauthenticated peer cannot
# make the server buffer anything sizeable.
PRE_AUTH_MAX_HEADER = 4096
_MAX_PINS = 256  # unreleased 226 replies with references per connection; older ones are let go


class Outbox(Protocol):
    """Where a session's frames go, whole and in order."""

    congested: bool  # too much is queued: take no more requests until it is not (server/net/flow.py)

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None) -> None:
        """Queue one frame; ``on_abandon`` runs if the connection dies before it is written."""

    def notify(self, name: str, frame: bytes) -> None:
        """Queue a notification about bin ``name`` (may replace an unsent one while congested)."""

    def close(self) -> None:
        """Close the connection once everything queued has been written."""


class Reads(Protocol):
    """The reading side of a connection: a session pauses it while it cannot take more."""

    def pause(self, reason: str) -> None: ...

    def resume(self, reason: str) -> None: ...


class _NoReads:
    def pause(self, reason: str) -> None:
        pass

    def resume(self, reason: str) -> None:
        pass


@dataclass
class ServerState:
    """What all sessions of one server share."""

    config: ServerConfig
    storage: Storage
    listeners: ListenerRegistry = field(default_factory=ListenerRegistry)
    token: bytes | None = field(default=None, repr=False)  # clients must AUTH with it; None: no authentication
    connections: int = 0  # connections admitted and still open (max_connections)
    recv_pool: Recycler | None = None  # memory large payloads are received into (None: fresh memory)

    @property
    def store(self) -> BinStore:
        return self.storage.store

    @classmethod
    def create(cls, config: ServerConfig, jobs: Jobs | None = None) -> "ServerState":
        """The state of a new server: its store and disk tier, the data directory loaded."""
        store = BinStore(config.max_bins, config.max_items_per_bin, config.memory_limit)
        data_dir = DataDir(config.data_dir, config.fsync, config.decode_limits) if config.data_dir else None
        spill = SpillArea(config.spill_dir) if config.memory_limit is not None and data_dir is None else None
        shm = None
        if config.zero_copy and data_dir is None:  # durable items are on disk: clients map those
            try:
                shm = ShmArea(config.shm_dir)
            except OSError as exc:
                log.warning("zero-copy: no shared-memory area in %s (%s); values travel over TCP",
                            config.shm_dir, exc)
        storage = Storage(store, jobs or InlineJobs(), data_dir=data_dir, spill=spill, shm=shm)
        if config.zero_copy:
            storage.share(new_token())
        if data_dir is not None:
            count = storage.load()
            log.info("data directory %s: %d items in %d bins", config.data_dir, count, len(store.listing()))
        pool = chunk_pool(config.recv_pool_bytes, config.recv_pool_idle)
        return cls(config, storage, token=config.auth_token(), recv_pool=pool)


class _Refused(Exception):
    """A request that gets an error reply (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ServerSession:
    """Request dispatch for one connection."""

    def __init__(self, state: ServerState, outbox: Outbox, peer: str = "?", reads: Reads | None = None,
                 same_host: bool = False):
        self.state = state
        self.outbox = outbox
        self.peer = peer
        self.reads = reads or _NoReads()
        self.same_host = same_host  # the peer is on this host: zero-copy may be offered
        self._incoming: str | None = None  # this connection's incoming directory in the shared-memory area
        self._pins: dict[int, list] = {}  # id of a 226 with references -> [(item, files)] until released
        self.listening: set[str] = set()
        self.closed = False
        # Whole requests not handled yet, because the outbox is congested (flow
        # control) or an earlier request waits for the disk (replies stay in order);
        # reading stops while there are any.  Then the framing error to report once
        # they are handled.
        self._backlog: deque[Frame] = deque()
        self._busy = False  # a request waits for the disk
        self._broken: tuple[int, str] | None = None  # (code, message)
        self.authenticated = state.token is None
        self._nonce = None if self.authenticated else auth.new_nonce()  # the challenge of our greeting
        self._admitted = False  # counted in state.connections
        self._heard = False  # bytes arrived since the last tick()
        self._opened_at: float | None = None  # times as tick() gives them
        self._quiet_since: float | None = None
        self._pinged_at: float | None = None
        limits = state.config.frame_limits
        if not self.authenticated:
            limits = FrameLimits(max_header=min(PRE_AUTH_MAX_HEADER, limits.max_header), max_payload=0)
        self._decoder: FrameDecoder | None = FrameDecoder(self._payload_sink, limits)
        # The config's limits are properties that build a new object per access.
        self._decode_limits = state.config.decode_limits
        self._max_bin_name = state.config.max_bin_name

    # -- events from the transport

    def connection_made(self) -> None:
        limit = self.state.config.max_connections
        if limit and self.state.connections >= limit:
            log.warning("refusing %s: %d connections open (max_connections)", self.peer, self.state.connections)
            self._close_with(protocol.UNAVAILABLE, "too many connections; try again later")
            return
        self.state.connections += 1
        self._admitted = True
        greeting = {"code": protocol.GREETING, "id": 0, "msg": "tensorshare ready",
                    "server": f"tensorshare/{__version__}", "version": protocol.PROTOCOL_VERSION}
        if not self.authenticated:
            greeting.update(msg="tensorshare ready; authenticate", auth=auth.MECHANISM, nonce=self._nonce)
        else:
            self._offer_shared(greeting)
        self._send(greeting)

    def _offer_shared(self, reply: dict) -> None:
        """Add the ``shm`` offer to the greeting, or to the 230 reply when the client had
        to authenticate first (PROTOCOL.md §10.1): no offer before authentication."""
        offer = self._shared_offer()
        if offer is not None:
            reply[protocol.SHM] = offer

    def _shared_offer(self) -> dict | None:
        """The ``shm`` offer (PROTOCOL.md §10.1), for a client on this host."""
        storage = self.state.storage
        if not (self.same_host and storage.areas):
            return None
        offer = {"token": storage.token, "areas": [area.root for area in storage.areas],
                 "min_bytes": self.state.config.zero_copy_min}
        if storage.shm_area is not None and storage.data_dir is None:
            try:
                self._incoming = storage.shm.open_connection()
                offer["incoming"] = self._incoming
            except OSError as exc:
                log.warning("zero-copy: no incoming directory for %s: %s", self.peer, exc)
        return offer

    def data_received(self, data: bytes) -> None:
        if self.closed or self._broken is not None:
            return
        self._heard = True
        authenticated = self.authenticated  # the limits these bytes were decoded with
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            frames = getattr(exc, "frames", [])  # whole requests before the bad bytes
            if authenticated:
                self._broken = (protocol.BAD_FRAME, str(exc))
            else:
                log.warning("refused %s: a frame before authentication: %s", self.peer, exc)
                self._broken = (protocol.NOT_AUTHENTICATED, f"authentication required (frame refused: {exc})")
        self._take(frames)

    def receive_buffer(self) -> memoryview | None:
        """Memory to read the next bytes straight into (a large payload arriving into
        the receive pool lends it: server/net/recvpool.py), or None: read as usual and
        call :meth:`data_received`."""
        if self.closed or self._broken is not None:
            return None
        return self._decoder.lent_buffer()

    def received_into(self, n: int) -> None:
        """``n`` bytes were read into the buffer :meth:`receive_buffer` returned."""
        self._heard = True
        self._take(self._decoder.buffer_updated(n))

    def _take(self, frames: list[Frame]) -> None:
        """Handle whole requests, in order, or queue them while the outbox or the disk
        makes them wait."""
        if not self._backlog:
            outbox = self.outbox
            for i, frame in enumerate(frames):
                if self.closed:  # refused: nothing after it is served
                    return
                if outbox.congested or self._busy:  # hold the rest back
                    frames = frames[i:]
                    break
                self._handle(frame)
            else:
                frames = ()
        self._backlog.extend(frames)
        self._work()

    @property
    def receiving_payload(self) -> int:
        """Bytes of payload still to come for the frame being received (0 if none)."""
        return self._decoder.payload_remaining if self._decoder is not None else 0

    @property
    def backlogged(self) -> bool:
        """True while whole requests wait (for the outbox to drain, or the disk)."""
        return bool(self._backlog)

    def resume(self) -> None:
        """Handle the requests held back while the outbox was congested."""
        if not self.closed:
            self._work()

    def connection_lost(self) -> None:
        # A request that arrived whole takes effect even if its reply cannot be sent
        # (PROTOCOL.md §8.3): of those held back, run the ones whose effect outlives
        # the connection (the others would only have produced their reply).
        backlog, self._backlog = self._backlog, deque()
        self.closed = True
        if self._admitted:
            self._admitted = False
            self.state.connections -= 1
        for frame in backlog:
            if frame.header.get("op") in _LASTING:
                self._handle(frame)
        # The decoder refers back to this session (its sink factory): drop it now, so
        # that a payload cut off mid-frame (up to max_frame bytes) is freed at once,
        # not whenever the cyclic garbage collector next runs.
        self._decoder = None
        for name in self.listening:
            self.state.listeners.discard(name, self)
        self.listening.clear()
        self._pins.clear()  # the client's mappings outlive the files' names
        if self._incoming is not None:  # whatever its client wrote and did not send goes too
            self.state.storage.close_connection(self._incoming)
            self._incoming = None

    def _work(self) -> None:
        """Handle waiting requests while the outbox and the disk let us; read only
        while none waits."""
        backlog, outbox = self._backlog, self.outbox
        while backlog and not outbox.congested and not self._busy and not self.closed:
            self._handle(backlog.popleft())
        if not backlog and not self._busy and self._broken is not None:
            self._fail()
        if backlog:
            self.reads.pause("backlog")
        else:
            self.reads.resume("backlog")

    def _fail(self) -> None:
        """Report the framing error (after every request before it) and close."""
        (code, message), self._broken = self._broken, None
        log.info("closing %s: %s", self.peer, message)
        self._close_with(code, message)

    def tick(self, now: float, sending: bool = False) -> None:
        """Apply the time limits; the adapter calls this every ``tick_interval``
        seconds with the time and whether frames are still waiting to be written.

        A connection that has received nothing, with no reply waiting to be
        written, for ``idle_timeout`` seconds is closed with 421, unless it listens: then the
        server sends it a 110 keepalive frame (again every ``idle_timeout`` of
        silence) and keeps it.  One that has not authenticated within
        ``auth_timeout`` seconds is closed with 530.
        """
        if self.closed:
            return
        config = self.state.config
        if self._opened_at is None:
            self._opened_at = now
        if self._heard or sending or self._quiet_since is None:
            self._heard = False
            self._quiet_since = now
            self._pinged_at = None
        if not self.authenticated and config.auth_timeout and now - self._opened_at >= config.auth_timeout:
            log.warning("closing %s: not authenticated within %gs", self.peer, config.auth_timeout)
            self._close_with(protocol.NOT_AUTHENTICATED, "authentication timed out")
            return
        if not config.idle_timeout or now - self._quiet_since < config.idle_timeout:
            return
        if self.listening:
            if self._pinged_at is None or now - self._pinged_at >= config.idle_timeout:
                self._pinged_at = now
                self._send({"code": protocol.KEEPALIVE, "id": 0, "msg": "keepalive"})
            return
        log.info("closing %s: idle for %gs", self.peer, config.idle_timeout)
        self._close_with(protocol.UNAVAILABLE, f"idle for {config.idle_timeout:g}s; closing")

    def _wait_for_disk(self) -> None:
        self._busy = True
        self.reads.pause("disk")

    def _disk_done(self) -> None:
        self._busy = False
        self.reads.resume("disk")
        if not self.closed:
            self._work()

    # -- the Listener interface (notifications from any session)

    def notify(self, name: str, frame: bytes) -> None:
        if not self.closed:
            self.outbox.notify(name, frame)

    # -- dispatch

    def _payload_sink(self, header: dict, nbytes: int):
        op = header.get("op")
        if type(op) is str and op in protocol.VERBS_WITH_VALUE:
            if nbytes and not self.state.storage.room():
                # Memory is over budget and the disk is catching up: read no more
                # payload from this client until it has.
                self.reads.pause("memory")
                self.state.storage.wait_for_room(lambda: self.reads.resume("memory"))
            pool = self.state.recv_pool
            if pool is not None and nbytes >= CHUNK:
                return PooledSink(nbytes, pool)
            return SegmentSink(nbytes)
        return _DISCARD

    def _handle(self, frame: Frame) -> None:
        header = frame.header
        if protocol.RELEASE in header:
            self._release(header[protocol.RELEASE])
        rid = header.get("id")
        if type(rid) is not int or not 0 < rid < 1 << 64:
            rid = 0
        if not self.authenticated:
            self._authenticate(rid, header)
            return
        try:
            op = header.get("op")
            if type(op) is not str or op not in protocol.VERBS:
                raise _Refused(protocol.UNKNOWN_VERB, f"unknown verb {op!r:.60}")
            if rid == 0:
                raise _Refused(protocol.BAD_ARGS, "request id must be an integer in 1..2**64-1")
            if frame.payload_len and op not in protocol.VERBS_WITH_VALUE:
                raise _Refused(protocol.BAD_ARGS, f"{op} takes no payload")
            name = header.get("bin")
            if op in protocol.VERBS_WITH_BIN:
                problem = protocol.check_bin_name(name, self._max_bin_name)
                if problem:
                    raise _Refused(protocol.BAD_NAME, problem)
            _HANDLERS[op](self, rid, name, frame)
        except _Refused as exc:
            self._send({"code": exc.code, "id": rid, "msg": exc.message})
        except RemoteError as exc:  # raised by the store: no such bin, limits
            self._send({"code": exc.code, "id": rid, "msg": exc.message})

    def _authenticate(self, rid: int, header: dict) -> None:
        """Check an AUTH request (PROTOCOL.md §8.4); anything else before it gets 530 and
        the connection closes, as it does after a wrong proof."""
        op = header.get("op")
        if op != protocol.AUTH or rid == 0:
            log.warning("refused %s: %.40r before authenticating", self.peer, op)
            self._close_with(protocol.NOT_AUTHENTICATED, "authentication required", rid)
            return
        client_nonce = header.get("nonce")
        if header.get("mech") != auth.MECHANISM or not auth.is_nonce(client_nonce):
            log.warning("authentication failed for %s: malformed AUTH", self.peer)
            self._close_with(protocol.NOT_AUTHENTICATED, f"AUTH needs mech {auth.MECHANISM!r} and a "
                                                         f"{auth.NONCE_SIZE}-byte nonce", rid)
            return
        client_proof, server_proof = auth.proofs(self.state.token, self._nonce, client_nonce)
        if not auth.proof_matches(client_proof, header.get("proof")):
            log.warning("authentication failed for %s: wrong proof", self.peer)
            self._close_with(protocol.NOT_AUTHENTICATED, "authentication failed", rid)
            return
        self.authenticated = True
        self._nonce = None
        self._decoder.limits = self.state.config.frame_limits
        log.info("%s authenticated", self.peer)
        reply = {"code": protocol.AUTHENTICATED, "id": rid, "proof": server_proof}
        self._offer_shared(reply)
        self._send(reply)

    def _do_auth(self, rid: int, name: None, frame: Frame) -> None:
        if self.state.token is None:
            raise _Refused(protocol.BAD_SEQUENCE, "this server does not use authentication")
        raise _Refused(protocol.BAD_SEQUENCE, "already authenticated")

    def _item(self, frame: Frame) -> Item:
        blob, tag = self._value(frame.header, frame.payload_len)
        return Item(blob, tuple(frame.payload), frame.payload_len, tag)

    def _value(self, header: dict, nbytes: int) -> tuple[bytes, int | None]:
        """The checked description and tag of a PUT/APPEND whose payload has ``nbytes``."""
        blob = header.get("value")
        if not isinstance(blob, bytes):
            raise _Refused(protocol.BAD_ARGS, "missing value description")
        try:  # cheap for a description seen before (the codec remembers them)
            check_description(blob, nbytes, self._decode_limits)
        except ProtocolError as exc:
            raise _Refused(protocol.BAD_ARGS, f"bad value: {exc}") from None
        tag = header.get("tag")
        problem = protocol.check_tag(tag)
        if problem:
            raise _Refused(protocol.BAD_ARGS, problem)
        return blob, tag

    def _do_put(self, rid: int, name: str, frame: Frame) -> None:
        if protocol.SHM in frame.header:
            self._adopt(rid, name, frame, True)
        else:
            self._store(rid, name, self._item(frame), True)

    def _do_append(self, rid: int, name: str, frame: Frame) -> None:
        if protocol.SHM in frame.header:
            self._adopt(rid, name, frame, False)
        else:
            self._store(rid, name, self._item(frame), False)

    def _store(self, rid: int, name: str, item: Item, replace: bool) -> None:
        self._through_storage(lambda done: self.state.storage.add(name, item, replace, done), self._stored(rid))

    def _stored(self, rid: int) -> Callable:
        """The reply to a PUT/APPEND once the storage is done with it."""
        def reply(change: Change | None, error: RemoteError | None) -> None:
            if error is not None:
                self._send({"code": error.code, "id": rid, "msg": error.message})
            else:
                self._send({"code": protocol.DONE, "id": rid, "n": change.n_items, "seq": change.seq})
                self.state.listeners.publish(change)

        return reply

    def _adopt(self, rid: int, name: str, frame: Frame, replace: bool) -> None:
        """PUT/APPEND of a value the client wrote into its incoming directory (§10.3)."""
        header = frame.header
        if self._incoming is None:
            raise _Refused(protocol.ZERO_COPY_REFUSED, "this connection has no shared-memory incoming directory")
        if frame.payload_len:
            raise _Refused(protocol.BAD_ARGS, "a value in shared memory travels without payload")
        size = header.get("size")
        if type(size) is not int or not 0 <= size <= self.state.config.max_frame:
            raise _Refused(protocol.BAD_ARGS, f"size must be an integer in 0..{self.state.config.max_frame}")
        blob, tag = self._value(header, size)
        incoming, shm_name, limits = self._incoming, header[protocol.SHM], self._decode_limits
        arrays = len(parse_description(blob, size, limits).arrays)  # remembered by _value's check
        self._through_storage(lambda done: self.state.storage.adopt(
            name, incoming, shm_name, blob, size, tag, replace, done, limits, arrays), self._stored(rid))

    def _through_storage(self, start: Callable, reply: Callable) -> None:
        """Run ``start(done)``, a :class:`Storage` call, and ``reply`` when it is done.

        Storage calls complete at once in memory; one that waits for the disk holds
        this connection's later requests (and stops reading it) until it is done."""
        call = _StorageCall(self, reply)
        start(call.done)
        call.started()

    def _do_get(self, rid: int, name: str, frame: Frame) -> None:
        storage, store, listeners = self.state.storage, self.state.store, self.state.listeners
        peeked = store.peek(name)
        refs = self._refs(frame.header, peeked, taking=True)
        parts = self._item_parts(peeked, refs)
        items, change = store.get(name)
        storage.taken(name, items)

        def undelivered() -> None:
            listeners.publish(store.restore(name, items))
            storage.restored(name, items)

        self._send_items(rid, items, parts, change.seq, undelivered, refs)
        self._pin(rid, items, refs)
        listeners.publish(change)

    def _do_peek(self, rid: int, name: str, frame: Frame) -> None:
        items = self.state.store.peek(name)
        refs = self._refs(frame.header, items)
        self._send_items(rid, items, self._item_parts(items, refs), self.state.store.state(name)[2], refs=refs)
        self._pin(rid, items, refs)
        self._promote(frame.header, items, refs)

    def _do_list(self, rid: int, name: None, frame: Frame) -> None:
        self._send({"code": protocol.LIST_OK, "id": rid, "bins": self.state.store.listing()})

    def _do_delete(self, rid: int, name: str, frame: Frame) -> None:
        def reply(change: Change, error: RemoteError | None) -> None:
            if error is not None:
                self._send({"code": error.code, "id": rid, "msg": error.message})
            else:
                self._send({"code": protocol.DONE, "id": rid, "n": 0, "seq": change.seq})
            self.state.listeners.publish(change)

        self._through_storage(lambda done: self.state.storage.delete(name, done), reply)

    def _do_listen(self, rid: int, name: str, frame: Frame) -> None:
        if name not in self.listening and len(self.listening) >= self.state.config.max_listens:
            raise _Refused(protocol.TOO_LARGE, f"a connection may listen to {self.state.config.max_listens} bins")
        self.listening.add(name)
        self.state.listeners.add(name, self)
        exists, n_items, seq, tag = self.state.store.state(name)
        # Sent before any later notification: the snapshot and the stream are atomic.
        self._send({"code": protocol.OK, "id": rid, "exists": exists, "n": n_items, "seq": seq, "tag": tag})

    def _do_unlisten(self, rid: int, name: str, frame: Frame) -> None:
        self.listening.discard(name)
        self.state.listeners.discard(name, self)
        self._send({"code": protocol.OK, "id": rid})

    def _do_noop(self, rid: int, name: None, frame: Frame) -> None:
        self._send({"code": protocol.OK, "id": rid})

    # -- output

    def send(self, parts: list, on_abandon=None) -> None:
        """Queue a reply (or the greeting), unless the connection is closed."""
        if not self.closed:
            self.outbox.send(parts, on_abandon)

    def _send(self, header: dict) -> None:
        self.send([frame_head(header, 0)])

    def _close_with(self, code: int, message: str, rid: int = 0) -> None:
        """Send a last error reply, then close; nothing more is read or served."""
        self._send({"code": code, "id": rid, "msg": message})
        self.closed = True
        self.outbox.close()

    def _item_parts(self, items: list[Item], refs: list | None = None) -> list:
        """The payload parts of a GET/PEEK reply carrying ``items`` (those without a
        reference in ``refs``).

        Refuses (552) a reply whose header, holding every item's description, would
        be larger than max_reply_header, and (451) one whose files cannot be opened;
        either way nothing is taken from the bin."""
        limit = self.state.config.max_reply_header
        size = sum(len(item.description) for item in items)
        if size > limit:
            raise _Refused(protocol.TOO_LARGE, f"the bin's {len(items)} item descriptions take {size} bytes, "
                                               f"over the {limit} one reply may carry")
        parts = []
        try:
            for i, item in enumerate(items):
                if refs is None or refs[i] is None:
                    parts.extend(item.parts())
        except OSError as exc:
            log.error("cannot read a stored item's files: %s", exc)
            raise _Refused(protocol.LOCAL_ERROR, f"cannot read the stored item: {exc.strerror or exc}") from None
        return parts

    def _send_items(self, rid: int, items: list[Item], parts: list, seq: int, on_abandon=None,
                    refs: list | None = None) -> None:
        header = {"code": protocol.ITEMS, "id": rid, "seq": seq,
                  "items": [item.description for item in items],
                  "sizes": [item.nbytes for item in items]}
        if refs is None:
            payload_len = sum(item.nbytes for item in items)
        else:
            header[protocol.REFS] = [None if files is None else files.ref() for files in refs]
            payload_len = sum(item.nbytes for item, files in zip(items, refs) if files is None)
        parts.insert(0, frame_head(header, payload_len))
        self.send(parts, on_abandon)

    # -- same-host zero-copy (PROTOCOL.md §10)

    def _refs(self, header: dict, items: list[Item], taking: bool = False) -> list | None:
        """For a GET/PEEK asking for references: per item, the files to refer to (in
        an area the client can map, and not too small to be worth it) or None (its
        bytes go in the payload).  None when no item gets a reference.

        A GET (``taking``) gets no references into the data directory, where a
        DELETE of the bin removes every file at once, pinned or not (PROTOCOL.md
        Appendix B): the taken items would be lost; a PEEK can be repeated."""
        wanted = header.get(protocol.REF)
        if not wanted or not self.same_host or type(wanted) is not list or len(wanted) > 8:
            return None
        minimum = self.state.config.zero_copy_min
        durable = self.state.storage.data_area if taking else None
        refs = []
        for item in items:
            files = item.files
            if (files is not None and files.area is not None and files.area.index in wanted
                    and files.area is not durable and worth_sharing(item.nbytes, len(files.spans), minimum)):
                refs.append(files)
            else:
                refs.append(None)
        return refs if any(refs) else None

    def _promote(self, header: dict, items: list[Item], refs: list | None) -> None:
        """After a PEEK asking for references: copy the items it had to send inline
        (received over TCP, still in memory) into shared memory, for the next read."""
        area = self.state.storage.shm_area
        wanted = header.get(protocol.REF)
        if not (self.same_host and area is not None and type(wanted) is list and area.index in wanted):
            return
        minimum = self.state.config.zero_copy_min
        for i, item in enumerate(items):
            if (refs is None or refs[i] is None) and item.segments is not None and item.nbytes >= minimum:
                arrays = len(parse_description(item.description, item.nbytes, self._decode_limits).arrays)
                if worth_sharing(item.nbytes, arrays, minimum):
                    self.state.storage.promote(item)

    def _pin(self, rid: int, items: list[Item], refs: list | None) -> None:
        """Keep the files a reply referred to until the client releases it (or leaves)."""
        if refs is None:
            return
        pinned = [(item, files) for item, files in zip(items, refs) if files is not None]
        if pinned:
            pins = self._pins
            pins[rid] = pinned
            if len(pins) > _MAX_PINS:  # a client that never releases: let the oldest go
                del pins[next(iter(pins))]

    def _release(self, ids: object) -> None:
        if type(ids) is list:
            pins = self._pins
            for rid in ids:
                if type(rid) is int:
                    pins.pop(rid, None)


class _StorageCall:
    """One storage call of a session: replies when done, holding the session if that is later."""

    __slots__ = ("session", "reply", "returned", "finished")

    def __init__(self, session: ServerSession, reply: Callable):
        self.session, self.reply = session, reply
        self.returned = self.finished = False

    def done(self, change, error) -> None:
        self.finished = True
        self.reply(change, error)
        if self.returned:
            self.session._disk_done()

    def started(self) -> None:
        self.returned = True
        if not self.finished:
            self.session._wait_for_disk()


# Verb -> handler, looked up once per request instead of getattr("_do_" + op.lower()).
_HANDLERS = {verb: getattr(ServerSession, "_do_" + verb.lower(), None) for verb in protocol.VERBS}
