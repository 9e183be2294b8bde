"""One client connection's protocol logic, without I/O (sans-IO).

A :class:`ServerSession` takes the bytes a connection received, decodes frames,
runs each request against the shared :class:`~.store.BinStore` and hands whole reply
frames (lists of ``bytes`` parts) to its :class:`Outbox`.  The Twisted adapter in
:mod:`.service` only moves bytes; tests can drive a session directly.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tensorshare import __version__, protocol
from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.wire.description import check_description
from tensorshare.wire.frames import DiscardSink, Frame, FrameDecoder, SegmentSink, frame_head

from .config import ServerConfig
from .notify import ListenerRegistry
from .store import BinStore, Item

log = logging.getLogger("tensorshare.server")
_DISCARD = DiscardSink(0)  # stateless: one serves every request that takes no payload
_LASTING = frozenset({protocol.PUT, protocol.APPEND, protocol.DELETE})  # effects that outlive the connection


class Outbox(Protocol):
    """Where a session's frames go, whole and in order."""

    congested: bool  # too much is queued: take no more requests until it is not (server/flow.py)

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None) -> None:
        """Queue one frame; ``on_abandon`` runs if the connection dies before it is written."""

    def notify(self, name: str, frame: bytes) -> None:
        """Queue a notification about bin ``name`` (may replace an unsent one while congested)."""

    def close(self) -> None:
        """Close the connection once everything queued has been written."""


@dataclass
class ServerState:
    """What all sessions of one server share."""

    config: ServerConfig
    store: BinStore
    listeners: ListenerRegistry = field(default_factory=ListenerRegistry)

    @classmethod
    def create(cls, config: ServerConfig) -> "ServerState":
        return cls(config, BinStore(config.max_bins, config.max_items_per_bin))


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
        # Whole requests not handled yet because the outbox is congested (flow
        # control: the adapter stops reading while there are any), and the framing
        # error to report once they are handled.
        self._backlog: deque[Frame] = deque()
        self._broken: str | None = None
        self._decoder: FrameDecoder | None = FrameDecoder(self._payload_sink, state.config.frame_limits)
        # The config's limits are properties that build a new object per access.
        self._decode_limits = state.config.decode_limits
        self._max_bin_name = state.config.max_bin_name

    # -- events from the transport

    def connection_made(self) -> None:
        self._send({"code": protocol.GREETING, "id": 0, "msg": "tensorshare ready",
                    "server": f"tensorshare/{__version__}", "version": protocol.PROTOCOL_VERSION})

    def data_received(self, data: bytes) -> None:
        if self.closed or self._broken is not None:
            return
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            frames = getattr(exc, "frames", [])  # whole requests before the bad bytes
            self._broken = str(exc)
        if self._backlog:
            self._backlog.extend(frames)
            self._work()
            return
        outbox = self.outbox
        for i, frame in enumerate(frames):
            if outbox.congested:  # the peer is not reading its replies: hold the rest back
                self._backlog.extend(frames[i:])
                return
            self._handle(frame)
        if self._broken is not None:
            self._fail()

    @property
    def receiving_payload(self) -> int:
        """Bytes of payload still to come for the frame being received (0 if none)."""
        return self._decoder.payload_remaining if self._decoder is not None else 0

    @property
    def backlogged(self) -> bool:
        """True while whole requests wait for the outbox to drain: read no more."""
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
        for frame in backlog:
            if frame.header.get("op") in _LASTING:
                self._handle(frame)
        self.closed = True
        # The decoder refers back to this session (its sink factory): drop it now, so
        # that a payload cut off mid-frame (up to max_frame bytes) is freed at once,
        # not whenever the cyclic garbage collector next runs.
        self._decoder = None
        for name in self.listening:
            self.state.listeners.discard(name, self)
        self.listening.clear()

    def _work(self) -> None:
        backlog, outbox = self._backlog, self.outbox
        while backlog and not outbox.congested:
            self._handle(backlog.popleft())
        if not backlog and self._broken is not None:
            self._fail()

    def _fail(self) -> None:
        """Report the framing error (after every request before it) and close."""
        message, self._broken = self._broken, None
        log.info("closing %s: %s", self.peer, message)
        self._send({"code": protocol.BAD_FRAME, "id": 0, "msg": message})
        self.closed = True
        self.outbox.close()

    # -- the Listener interface (notifications from any session)

    def notify(self, name: str, frame: bytes) -> None:
        if not self.closed:
            self.outbox.notify(name, frame)

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

    def send(self, parts: list, on_abandon=None) -> None:
        """Queue a reply (or the greeting), unless the connection is closed."""
        if not self.closed:
            self.outbox.send(parts, on_abandon)

    def _send(self, header: dict) -> None:
        self.send([frame_head(header, 0)])

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
