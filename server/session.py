"""One client connection's protocol logic, without I/O (sans-IO).

A :class:`ServerSession` takes the bytes a connection received, decodes frames,
runs each request against the shared :class:`~.store.BinStore` and hands whole reply
frames (lists of ``bytes`` parts) to its :class:`Outbox`.  It also holds the
connection's policy: the connection limit, authentication (PROTOCOL.md §8.4) and the
idle and authentication time limits, which the adapter applies by calling
:meth:`ServerSession.tick` with the time.  The Twisted adapter in :mod:`.service`
only moves bytes and keeps the clock; tests can drive a session directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tensorshare import __version__, auth, protocol
from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.wire.description import check_description
from tensorshare.wire.frames import DiscardSink, Frame, FrameDecoder, FrameLimits, SegmentSink, frame_head

from .config import ServerConfig
from .notify import ListenerRegistry
from .store import BinStore, Item

log = logging.getLogger("tensorshare.server")
_DISCARD = DiscardSink(0)  # stateless: one serves every request that takes no payload
# Until a connection has authenticated, its frames may carry no payload and only a
# small header (an AUTH frame is about 150 bytes): an unauthenticated peer cannot
# make the server buffer anything sizeable.
PRE_AUTH_MAX_HEADER = 4096


class Outbox(Protocol):
    """Where a session's frames go, whole and in order."""

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None) -> None:
        """Queue one frame; ``on_abandon`` runs if the connection dies before it is written."""

    def close(self) -> None:
        """Close the connection once everything queued has been written."""


@dataclass
class ServerState:
    """What all sessions of one server share."""

    config: ServerConfig
    store: BinStore
    listeners: ListenerRegistry = field(default_factory=ListenerRegistry)
    token: bytes | None = field(default=None, repr=False)  # clients must AUTH with it; None: no authentication
    connections: int = 0  # connections admitted and still open (max_connections)

    @classmethod
    def create(cls, config: ServerConfig) -> "ServerState":
        return cls(config, BinStore(config.max_bins, config.max_items_per_bin), token=config.auth_token())


class _Refused(Exception):
    """A request that gets an error reply (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ServerSession:
    """Request dispatch for one connection."""

    def __init__(self, state: ServerState, outbox: Outbox, peer: str = "?"):
        self.state = state
        self.outbox = outbox
        self.peer = peer
        self.listening: set[str] = set()
        self.closed = False
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
        self._decoder = FrameDecoder(self._payload_sink, limits)
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
        self._send(greeting)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._heard = True
        authenticated = self.authenticated  # the limits these bytes were decoded with
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            for frame in getattr(exc, "frames", ()):  # whole requests before the bad bytes
                if self.closed:
                    return
                self._handle(frame)
            if self.closed:
                return
            log.info("closing %s: %s", self.peer, exc)
            if authenticated:
                self._close_with(protocol.BAD_FRAME, str(exc))
            else:
                log.warning("refused %s: a frame before authentication: %s", self.peer, exc)
                self._close_with(protocol.NOT_AUTHENTICATED, f"authentication required (frame refused: {exc})")
            return
        for frame in frames:
            if self.closed:  # refused: nothing after it is served
                return
            self._handle(frame)

    @property
    def receiving_payload(self) -> int:
        """Bytes of payload still to come for the frame being received (0 if none)."""
        return self._decoder.payload_remaining

    def connection_lost(self) -> None:
        self.closed = True
        if self._admitted:
            self._admitted = False
            self.state.connections -= 1
        for name in self.listening:
            self.state.listeners.discard(name, self)
        self.listening.clear()

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

    # -- the Listener interface (notifications from other sessions)

    def send(self, parts: list, on_abandon=None) -> None:
        if not self.closed:
            self.outbox.send(parts, on_abandon)

    # -- dispatch

    def _payload_sink(self, header: dict, nbytes: int):
        op = header.get("op")
        if type(op) is str and op in protocol.VERBS_WITH_VALUE:
            return SegmentSink(nbytes)
        return _DISCARD

    def _handle(self, frame: Frame) -> None:
        header = frame.header
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
        self._send({"code": protocol.AUTHENTICATED, "id": rid, "proof": server_proof})

    def _do_auth(self, rid: int, name: None, frame: Frame) -> None:
        if self.state.token is None:
            raise _Refused(protocol.BAD_SEQUENCE, "this server does not use authentication")
        raise _Refused(protocol.BAD_SEQUENCE, "already authenticated")

    def _item(self, frame: Frame) -> Item:
        blob = frame.header.get("value")
        if not isinstance(blob, bytes):
            raise _Refused(protocol.BAD_ARGS, "missing value description")
        try:  # cheap for a description seen before (the codec remembers them)
            check_description(blob, frame.payload_len, self._decode_limits)
        except ProtocolError as exc:
            raise _Refused(protocol.BAD_ARGS, f"bad value: {exc}") from None
        tag = frame.header.get("tag")
        problem = protocol.check_tag(tag)
        if problem:
            raise _Refused(protocol.BAD_ARGS, problem)
        return Item(blob, tuple(frame.payload), frame.payload_len, tag)

    def _do_put(self, rid: int, name: str, frame: Frame) -> None:
        self._stored(rid, self.state.store.put(name, self._item(frame)))

    def _do_append(self, rid: int, name: str, frame: Frame) -> None:
        self._stored(rid, self.state.store.append(name, self._item(frame)))

    def _stored(self, rid: int, change) -> None:
        self._send({"code": protocol.DONE, "id": rid, "n": change.n_items, "seq": change.seq})
        self.state.listeners.publish(change)

    def _do_get(self, rid: int, name: str, frame: Frame) -> None:
        store, listeners = self.state.store, self.state.listeners
        self._check_reply_size(store.peek(name))
        items, change = store.get(name)

        def undelivered() -> None:
            listeners.publish(store.restore(name, items))

        self._send_items(rid, items, change.seq, undelivered)
        listeners.publish(change)

    def _do_peek(self, rid: int, name: str, frame: Frame) -> None:
        items = self.state.store.peek(name)
        self._check_reply_size(items)
        self._send_items(rid, items, self.state.store.state(name)[2])

    def _do_list(self, rid: int, name: None, frame: Frame) -> None:
        self._send({"code": protocol.LIST_OK, "id": rid, "bins": self.state.store.listing()})

    def _do_delete(self, rid: int, name: str, frame: Frame) -> None:
        change = self.state.store.delete(name)
        self._send({"code": protocol.DONE, "id": rid, "n": 0, "seq": change.seq})
        self.state.listeners.publish(change)

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

    def _send(self, header: dict) -> None:
        self.send([frame_head(header, 0)])

    def _close_with(self, code: int, message: str, rid: int = 0) -> None:
        """Send a last error reply, then close; nothing more is read or served."""
        self._send({"code": code, "id": rid, "msg": message})
        self.closed = True
        self.outbox.close()

    def _check_reply_size(self, items: list[Item]) -> None:
        """Refuse (552) a reply whose header, holding every item's description, would
        be larger than max_reply_header; nothing is taken from the bin."""
        limit = self.state.config.max_reply_header
        size = sum(len(item.description) for item in items)
        if size > limit:
            raise _Refused(protocol.TOO_LARGE, f"the bin's {len(items)} item descriptions take {size} bytes, "
                                               f"over the {limit} one reply may carry")

    def _send_items(self, rid: int, items: list[Item], seq: int, on_abandon=None) -> None:
        header = {"code": protocol.ITEMS, "id": rid, "seq": seq,
                  "items": [item.description for item in items],
                  "sizes": [item.nbytes for item in items]}
        parts = [frame_head(header, sum(item.nbytes for item in items))]
        for item in items:
            parts.extend(item.segments)
        self.send(parts, on_abandon)


# Verb -> handler, looked up once per request instead of getattr("_do_" + op.lower()).
_HANDLERS = {verb: getattr(ServerSession, "_do_" + verb.lower(), None) for verb in protocol.VERBS}
