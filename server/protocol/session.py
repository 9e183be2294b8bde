"""One client connection's protocol logic, without I/O (sans-IO).

A :class:`ServerSession` takes the bytes a connection received, decodes frames,
authenticates the peer, applies the limits and hands each request, checked and
typed by its :class:`~tensorshare.protocol.messages.Command`, to its handler
(:mod:`.handlers`).  Replies go to an :class:`~.notify.Outbox` as whole frames.
The Twisted adapter (``server/net/service.py``) only moves bytes and keeps the
clock (:meth:`ServerSession.tick`); tests drive a session directly.

The session is a state machine (:class:`Phase`, with the legal moves in
``_MOVES``).  Apart from its phase, a session in ``READY`` may be *held*: requests
wait in order while the outbox is congested (flow control) or while an earlier
request waits for the disk (replies stay in request order); reading stops while any
wait.
"""

from __future__ import annotations

import enum
import logging
import time
from bisect import bisect_left
from time import perf_counter
from collections import deque
from dataclasses import replace
from typing import Callable, Protocol

from tensorshare import __version__
from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.protocol import auth
from tensorshare.protocol.messages import (
    AUTH, BAD_ARGS, BAD_FRAME, COMMANDS, DELETE, GREETING_MESSAGE, ID_MAX, KEEPALIVE_MESSAGE, LOCAL_ERROR,
    NOT_AUTHENTICATED, PROTOCOL_VERSION, UNAVAILABLE, UNKNOWN_VERB, APPEND, PUT, Key, error_reply,
)
from tensorshare.wire.frames import DiscardSink, Frame, FrameDecoder, SegmentSink, frame_head

from ..net.recvpool import CHUNK, PooledSink
from ..ops.counters import LATENCY_BUCKETS, ConnStats
from .handlers import HANDLERS
from .notify import Notifier, Outbox
from .shared import SharedMemory

log = logging.getLogger("tensorshare.server")
_DISCARD = DiscardSink(0)  # stateless: one serves every request that takes no payload
_LASTING = frozenset({PUT.verb, APPEND.verb, DELETE.verb})  # effects that outlive the connection
# Until a connection has authenticated, its frames may carry no payload and only a
# small header (an AUTH frame is about 150 bytes): an unauthenticated peer cannot
# make the server buffer anything sizeable.
PRE_AUTH_MAX_HEADER = 4096


class Phase(enum.Enum):
    """Where a connection is in its life."""

    OPENING = "opening"  # accepted; the greeting is not out yet
    AUTHENTICATING = "authenticating"  # greeted with a challenge: only AUTH is served
    READY = "ready"  # serving requests
    FAILING = "failing"  # a framing error came: serve the requests before it, then report it and close
    CLOSING = "closing"  # a last reply is out; nothing more is read or served
    CLOSED = "closed"  # the connection is gone


_MOVES = {
    Phase.OPENING: {Phase.AUTHENTICATING, Phase.READY, Phase.CLOSING, Phase.CLOSED},
    Phase.AUTHENTICATING: {Phase.READY, Phase.CLOSING, Phase.CLOSED},
    Phase.READY: {Phase.FAILING, Phase.CLOSING, Phase.CLOSED},
    Phase.FAILING: {Phase.CLOSING, Phase.CLOSED},
    Phase.CLOSING: {Phase.CLOSED},
    Phase.CLOSED: set(),
}
_SERVING = frozenset({Phase.AUTHENTICATING, Phase.READY, Phase.FAILING})  # phases that handle requests


class Reads(Protocol):
    """The reading side of a connection: a session pauses it while it cannot take more."""

    def pause(self, reason: str) -> None: ...

    def resume(self, reason: str) -> None: ...


class _NoReads:
    def pause(self, reason: str) -> None:
        pass

    def resume(self, reason: str) -> None:
        pass


class TimeLimits:
    """The idle and authentication time limits of one connection (PROTOCOL.md §8.4-8.5),
    as times given by :meth:`ServerSession.tick`."""

    __slots__ = ("opened_at", "quiet_since", "pinged_at", "heard")

    def __init__(self):
        self.opened_at: float | None = None
        self.quiet_since: float | None = None
        self.pinged_at: float | None = None  # when the last keepalive went to a quiet listener
        self.heard = False  # bytes arrived since the last tick

    def observe(self, now: float, busy: bool) -> None:
        """Start the quiet period afresh if bytes came or went since the last look."""
        if self.opened_at is None:
            self.opened_at = now
        if self.heard or busy or self.quiet_since is None:
            self.heard = False
            self.quiet_since = now
            self.pinged_at = None


class ServerSession:
    """Request dispatch for one connection (see the module docstring)."""

    def __init__(self, state, outbox: Outbox, peer: str = "?", reads: Reads | None = None,
                 same_host: bool = False):
        self.state = state  # root.ServerState
        self.storage = state.storage
        self.config = state.config
        self.outbox = outbox
        self.notifier = Notifier(outbox)
        self.peer = peer
        self.stats = ConnStats(peer)  # its id (in every log line about it), bytes, versions seen
        self.counters = state.counters  # the server's totals (server/ops/counters.py); None: metrics off
        self.reads = reads or _NoReads()
        self.shared = SharedMemory(state.storage, state.config, same_host, peer, state.mapped)
        self.listening: set[str] = set()
        self.owned: set[str] = set()  # the ephemeral bins this connection put last (.ephemeral)
        self.phase = Phase.OPENING
        self.closed = False  # nothing more is served (closing or closed): kept with the phase
        self._serving = False  # the phase handles requests (_SERVING): kept with the phase
        self._admitted = False  # counted in state.connections
        self._nonce = None if state.token is None else auth.new_nonce()  # the challenge of our greeting
        self._failure: tuple[int, str] | None = None  # FAILING: the framing error to report
        self._backlog: deque[Frame] = deque()  # whole requests held back (see the module docstring)
        self._waiting = False  # a request waits for the disk
        self._held_notes: dict[str, bytes] | None = None  # notifications held while waiting, per bin
        self._parked = None  # this connection's request waiting for a bin to change (waits.py)
        # A frame streamed in pieces as its payload arrives (a relay's, server/relay/stream.py):
        # until it is whole, other frames wait here (and notifications, latest per bin).
        self._gate: list | None = None
        self._gate_notes: dict[str, bytes] = {}
        self.timing = TimeLimits()
        frame_limits = state.config.frame_limits
        if self._nonce is not None:
            frame_limits = replace(frame_limits, max_header=min(PRE_AUTH_MAX_HEADER, frame_limits.max_header), max_payload=0)
        self._decoder: FrameDecoder | None = FrameDecoder(self._payload_sink, frame_limits)
        # The config's limits are properties that build a new object per access.
        self.decode_limits = state.config.decode_limits
        self._max_bin_name = state.config.max_bin_name

    @property
    def authenticated(self) -> bool:
        return self._nonce is None

    def _move(self, phase: Phase) -> None:
        if phase not in _MOVES[self.phase]:
            raise AssertionError(f"session {self.peer}: {self.phase.value} -> {phase.value} is not a legal move")
        self.phase = phase
        self.closed = phase is Phase.CLOSING or phase is Phase.CLOSED
        self._serving = phase in _SERVING

    # -- events from the transport

    def connection_made(self) -> None:
        limit = self.config.max_connections
        if limit and self.state.connections >= limit:
            log.warning("conn %d refused %s: %d connections open (max_connections)", self.stats.id, self.peer,
                        self.state.connections, extra={"conn": self.stats.id, "event": "refused"})
            if self.counters is not None:
                self.counters.turned_away += 1
            self._close_with(UNAVAILABLE, "too many connections; try again later")
            return
        self.state.connections += 1
        self._admitted = True
        log.info("conn %d open from %s", self.stats.id, self.peer, extra={"conn": self.stats.id, "event": "open"})
        if self.counters is not None:
            self.counters.opened(self)
        greeting = GREETING_MESSAGE.build(msg="tensorshare ready", server=f"tensorshare/{__version__}",
                                          version=PROTOCOL_VERSION, max_frame=self.config.max_frame)
        if self.state.workers is not None:  # one worker of several: the map clients route by (§14)
            greeting[Key.WORKERS] = self.state.workers.field()
        if not self.authenticated:
            self._move(Phase.AUTHENTICATING)
            greeting.update({Key.MSG: "tensorshare ready; authenticate", Key.AUTH: auth.MECHANISM,
                             Key.NONCE: self._nonce})
            self.send_header(greeting)
            return
        self._move(Phase.READY)
        self.shared.offer(greeting, self)  # the same-host offer (may wait for the disk)

    def data_received(self, data: bytes) -> None:
        if not self._serving or self._failure is not None:
            return
        self.timing.heard = True
        self.stats.bytes_in += len(data)
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            frames = getattr(exc, "frames", [])  # whole requests before the bad bytes
            if self.authenticated:
                self._failure = (BAD_FRAME, str(exc))
            else:
                self._auth_failed(f"a frame before authentication: {exc}")
                self._failure = (NOT_AUTHENTICATED, f"authentication required (frame refused: {exc})")
        self._take(frames)

    def receive_buffer(self) -> memoryview | None:
        """Memory to read the next bytes straight into (a large payload arriving into
        the receive pool lends it: ``server/net/recvpool.py``), or None: read as
        usual and call :meth:`data_received`."""
        if not self._serving or self._failure is not None:
            return None
        return self._decoder.lent_buffer()

    def received_into(self, n: int) -> None:
        """``n`` bytes were read into the buffer :meth:`receive_buffer` returned."""
        self.timing.heard = True
        self.stats.bytes_in += n
        self._take(self._decoder.buffer_updated(n))

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
        self._move(Phase.CLOSED)
        self._drop_gate()
        if self._admitted:
            self._admitted = False
            self.state.connections -= 1
            stats = self.stats
            log.info("conn %d closed (%s): %.1fs, %d bytes in, %d bytes out", stats.id, self.peer,
                     time.time() - stats.opened, stats.bytes_in, getattr(self.outbox, "written", 0),
                     extra={"conn": stats.id, "event": "close"})
            if self.counters is not None:
                self.counters.closed(self)
        if self.authenticated:
            for frame in backlog:
                if frame.header.get(Key.OP) in _LASTING:
                    self._handle(frame)
        # The decoder refers back to this session (its sink factory): drop it now, so
        # that a payload cut off mid-frame (up to max_frame bytes) is freed at once,
        # not whenever the cyclic garbage collector next runs.
        self._decoder = None
        for name in self.listening:
            self.state.listeners.discard(name, self)
        self.listening.clear()
        parked, self._parked = self._parked, None
        self.state.waits.cancel(parked)  # a request waiting for its bin to change is dropped
        if self.owned:  # its ephemeral bins end with it
            self.state.ephemeral.release(self, self._delete_ended)
        self.shared.connection_lost()

    def _delete_ended(self, name: str, owner: bytes | None) -> None:
        """Delete an ephemeral bin whose connection ended; its listeners are told."""
        relay = self.state.relay
        if relay is not None and relay.follows(name):  # a relay's: the bin lives upstream, for this client
            relay.delete_upstream(name, owner)
            return
        def deleted(change, error) -> None:
            if error is None:
                self.state.listeners.publish(change)

        try:
            self.storage.delete(name, deleted)
        except RemoteError:  # already gone
            pass

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
        config, timing = self.config, self.timing
        timing.observe(now, sending)
        if not self.authenticated and config.auth_timeout and now - timing.opened_at >= config.auth_timeout:
            self._auth_failed(f"not authenticated within {config.auth_timeout:g}s")
            self._close_with(NOT_AUTHENTICATED, "authentication timed out")
            return
        if not config.idle_timeout or now - timing.quiet_since < config.idle_timeout:
            return
        if self.listening:
            if timing.pinged_at is None or now - timing.pinged_at >= config.idle_timeout:
                timing.pinged_at = now
                self.send_header(KEEPALIVE_MESSAGE.build(msg="keepalive"))
            return
        log.info("conn %d closing (%s): idle for %gs", self.stats.id, self.peer, config.idle_timeout,
                 extra={"conn": self.stats.id, "event": "idle"})
        self._close_with(UNAVAILABLE, f"idle for {config.idle_timeout:g}s; closing")

    # -- the Listener interface (notifications from any session)

    def notify(self, name: str, frame: bytes) -> None:
        if self.closed:
            return
        held = self._held_notes
        if held is None and self._gate is not None:
            held = self._gate_notes  # after the frame being streamed
        if held is not None:  # after the reply of the request that waits (see wait_for)
            held.pop(name, None)  # the latest per bin, in the order of their last change
            held[name] = frame
            return
        self.notifier.notify(name, frame)

    # -- requests

    def _payload_sink(self, header: dict, nbytes: int):
        command = COMMANDS.get(header.get(Key.OP)) if type(header.get(Key.OP)) is str else None
        if command is None or not command.payload:
            return _DISCARD
        storage = self.storage
        if nbytes and not storage.room():
            # Memory is over budget and the disk is catching up: read no more
            # payload from this client until it has.
            self.reads.pause("memory")
            storage.wait_for_room(lambda: self.reads.resume("memory"))
        pool = self.state.recv_pool
        if pool is not None and nbytes >= CHUNK:
            return PooledSink(nbytes, pool)
        return SegmentSink(nbytes)

    def _take(self, frames: list[Frame]) -> None:
        """Handle whole requests, in order, or queue them while the outbox or the disk
        makes them wait."""
        if not self._backlog:
            outbox = self.outbox
            for i, frame in enumerate(frames):
                if self.closed:  # refused: nothing after it is served
                    return
                if outbox.congested or self._waiting:  # hold the rest back
                    frames = frames[i:]
                    break
                self._handle(frame)
            else:
                frames = ()
        if frames or self._waiting or self._failure is not None or self._backlog:
            self._backlog.extend(frames)
            self._work()

    def _work(self) -> None:
        """Handle waiting requests while the outbox and the disk let us; read only
        while none waits."""
        backlog, outbox = self._backlog, self.outbox
        while backlog and not outbox.congested and not self._waiting and not self.closed:
            self._handle(backlog.popleft())
        if not backlog and not self._waiting and self._failure is not None and not self.closed:
            (code, message), self._failure = self._failure, None
            log.info("conn %d closing (%s): %s", self.stats.id, self.peer, message,
                     extra={"conn": self.stats.id, "event": "failing"})
            if self.phase is Phase.READY:
                self._move(Phase.FAILING)
            self._close_with(code, message)
        if backlog:
            self.reads.pause("backlog")
        else:
            self.reads.resume("backlog")

    def _handle(self, frame: Frame) -> None:
        """Check one request (PROTOCOL.md §4.2) and run its handler."""
        header = frame.header
        if Key.RELEASE in header:
            self.shared.release(header[Key.RELEASE])
        rid = header.get(Key.ID)
        if type(rid) is not int or not 0 < rid <= ID_MAX:
            rid = 0
        if self._nonce is not None:  # not authenticated yet
            self._authenticate(rid, frame)
            return
        op = header.get(Key.OP)
        command = COMMANDS.get(op) if type(op) is str else None
        try:
            if frame.refused is not None:  # a header over a limit of what it may decode to
                raise RemoteError(frame.refused, BAD_ARGS)
            if command is None:
                raise RemoteError(f"unknown verb {op!r:.60}", UNKNOWN_VERB)
            if rid == 0:
                raise RemoteError("request id must be an integer in 1..2**64-1", BAD_ARGS)
            # AUTH when none is due is answered 503 whatever its fields (§4.3): its handler says so
            request = None if command is AUTH else \
                command.parse_request(header, rid, frame.payload, frame.payload_len, self._max_bin_name)
            handle = self.state.handlers.get(command) or HANDLERS[command]
            counters = self.counters
            if counters is None:
                handle(self, request)
            else:  # counted inline: this is the request path (server/ops/counters.py)
                began = perf_counter()
                handle(self, request)
                elapsed = perf_counter() - began
                verb = counters.verbs[op]
                verb.requests += 1
                verb.bytes_in += frame.payload_len
                verb.seconds += elapsed
                verb.buckets[bisect_left(LATENCY_BUCKETS, elapsed)] += 1
                self.stats.requests += 1
        except RemoteError as exc:
            if self.counters is not None:
                self.counters.refusal(exc.code)
            self.send_header(error_reply(exc.code, exc.message, rid))
        except Exception:  # a bug: this request fails, the connection and the server go on
            log.exception("%s from %s failed", op, self.peer)
            self.send_header(error_reply(LOCAL_ERROR, "internal server error", rid))

    def _authenticate(self, rid: int, frame: Frame) -> None:
        """Check an AUTH request (PROTOCOL.md §8.4); anything else before it gets 530 and
        the connection closes, as it does after a wrong proof."""
        header = frame.header
        if header.get(Key.OP) != AUTH.verb or rid == 0:
            self._auth_failed(f"{header.get(Key.OP)!r:.40} before authenticating")
            self._close_with(NOT_AUTHENTICATED, "authentication required", rid)
            return
        try:
            request = AUTH.parse_request(header, rid, None, 0)
            if request.mech != auth.MECHANISM or not auth.is_nonce(request.nonce):
                raise RemoteError("malformed AUTH")
        except RemoteError:
            self._auth_failed("malformed AUTH")
            self._close_with(NOT_AUTHENTICATED, f"AUTH needs mech {auth.MECHANISM!r} and a "
                                                f"{auth.NONCE_SIZE}-byte nonce", rid)
            return
        client_proof, server_proof = auth.proofs(self.state.token, self._nonce, request.nonce)
        if not auth.proof_matches(client_proof, request.proof):
            self._auth_failed("wrong proof")
            self._close_with(NOT_AUTHENTICATED, "authentication failed", rid)
            return
        self._nonce = None
        self._decoder.limits = self.config.frame_limits
        self._move(Phase.READY)
        self.stats.authenticated = True
        log.info("conn %d authenticated (%s)", self.stats.id, self.peer, extra={"conn": self.stats.id, "event": "auth"})
        self.shared.offer(AUTH.reply(rid, **{Key.PROOF: server_proof}), self)

    def _auth_failed(self, reason: str) -> None:
        log.warning("conn %d authentication failed (%s): %s", self.stats.id, self.peer, reason,
                    extra={"conn": self.stats.id, "event": "auth_failed"})
        if self.counters is not None:
            self.counters.auth_failures += 1

    # -- waiting for the disk

    def wait_for(self, start: Callable[[Callable], None], finish: Callable) -> None:
        """Run ``start(done)``, a storage call, and ``finish(*result)`` once it calls
        ``done(*result)``.

        Storage calls in memory complete at once.  One that waits for the disk holds
        this connection's later requests (and stops reading it) until it is done, so
        replies keep request order.  Notifications for this connection that come
        meanwhile (from ``start`` itself too) are held and follow the reply."""
        call = _StorageCall(self, finish)
        if self._held_notes is None:
            self._held_notes = {}
        try:
            start(call.done)
        except BaseException:
            if not call.finished:  # refused before anything was started
                self._release_notes()
            raise
        call.started()

    def park(self, name: str, ready: Callable[[], bool], go: Callable[[], None], timeout: float,
             expire: Callable[[], None], ordered: bool = True) -> None:
        """Run ``go()`` once ``ready()`` holds for bin ``name``, or ``expire()`` after
        ``timeout`` seconds (:class:`~.waits.Waits`; ``ordered``: see there).  Call it from the ``start`` of
        :meth:`wait_for`: this connection's later requests wait meanwhile, its
        notifications do not; a connection that closes drops its parked request.

        While it is parked the connection is still read (its later requests are held
        in the backlog, which stops reading again), so a peer that closes is seen at
        once and its request takes nothing (nor keeps a connection slot)."""
        def went() -> None:
            if self._parked is not None:  # it waited: hold notifications again until its reply
                self._parked = None
                self._held_notes = {}
                self.reads.pause("disk")  # (until its reply: it may wait for the disk now)
            go()

        def expired() -> None:
            self._parked = None
            expire()

        self._parked = self.state.waits.park(name, ready, went, timeout, expired, ordered)
        if self._parked is not None:
            # While it waits, notifications of others' changes go out as usual (a worker
            # whose rollout waits for room still hears of new parameters).
            self._release_notes()

    def _wait_began(self) -> None:
        self._waiting = True
        if self._parked is None:  # a parked request keeps reading: see park()
            self.reads.pause("disk")

    def _wait_ended(self) -> None:
        self._waiting = False
        self._release_notes()
        self.reads.resume("disk")
        if not self.closed:
            self._work()

    def _release_notes(self) -> None:
        held, self._held_notes = self._held_notes, None
        if held:
            for name, frame in held.items():
                self.notify(name, frame)

    # -- output

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None,
             on_written: Callable[[], None] | None = None) -> None:
        """Queue a frame (a list of parts), unless the connection is closed (then
        ``on_abandon`` runs at once); while a frame is being streamed, after it."""
        if self._gate is not None and not self.closed:
            self._gate.append((parts, on_abandon, on_written))
        elif not self.closed:
            self.outbox.send(parts, on_abandon, on_written)
        elif on_abandon is not None:
            on_abandon()

    def send_header(self, header: dict) -> None:
        """Queue a frame that is only a header."""
        self.send([frame_head(header, 0)])

    def refuse(self, rid: int, error: RemoteError) -> None:
        """Answer request ``rid`` with the error reply ``error`` stands for."""
        if self.counters is not None:
            self.counters.refusal(error.code)
        self.send_header(error_reply(error.code, error.message, rid))

    def open_stream(self) -> bool:
        """Begin a frame whose pieces come with :meth:`stream_piece` as its payload
        arrives; until :meth:`close_stream`, every other frame of this connection waits
        (and its requests are not read).  False if one is already going out (or the
        connection is closed): then none is begun."""
        if self.closed or self._gate is not None:
            return False
        self._gate = []
        self.reads.pause("stream")
        return True

    def stream_piece(self, parts: list) -> None:
        """Queue the next piece of the frame being streamed."""
        if not self.closed:
            self.outbox.send(parts)

    def close_stream(self) -> None:
        """The streamed frame is whole: what waited goes out after it."""
        gate, self._gate = self._gate, None
        notes, self._gate_notes = self._gate_notes, {}
        self.reads.resume("stream")
        for parts, on_abandon, on_written in gate or ():
            self.send(parts, on_abandon, on_written)
        for name, frame in notes.items():
            self.notify(name, frame)

    def cut_off(self, reason: str) -> None:
        """Close after what is queued, with no last reply: a frame streamed as its payload
        arrived (a relay's, server/relay/stream.py) cannot be finished, and the peer must
        see it cut short, never completed by other bytes."""
        if self.closed:
            return
        log.info("conn %d cut off (%s): %s", self.stats.id, self.peer, reason,
                 extra={"conn": self.stats.id, "event": "cut_off"})
        self._move(Phase.CLOSING)
        self.reads.pause("closing")
        self._drop_gate()
        self.outbox.close()

    def _drop_gate(self) -> None:
        """The frames waiting behind a streamed one will never go: run their abandon hooks."""
        gate, self._gate = self._gate, None
        for _parts, on_abandon, _written in gate or ():
            if on_abandon is not None:
                on_abandon()

    def _close_with(self, code: int, message: str, rid: int = 0) -> None:
        """Send a last error reply, then close; nothing more is read or served."""
        if self._gate is not None:  # a frame is being streamed: it cannot be followed by another
            self.cut_off(message)
            return
        self.send_header(error_reply(code, message, rid))
        self._move(Phase.CLOSING)
        self.reads.pause("closing")  # whatever the peer sends now would only be read and dropped
        self.outbox.close()


class _StorageCall:
    """One storage call of a session: replies when done, holding the session if that is later."""

    __slots__ = ("session", "finish", "returned", "finished")

    def __init__(self, session: ServerSession, finish: Callable):
        self.session, self.finish = session, finish
        self.returned = self.finished = False

    def done(self, *result) -> None:
        self.finished = True
        self.finish(*result)
        if self.returned:
            self.session._wait_ended()

    def started(self) -> None:
        self.returned = True
        if self.finished:
            self.session._release_notes()
        else:
            self.session._wait_began()
