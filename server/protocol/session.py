"""One client connection's protocol logic, without I/O (sans-IO).

A :class:`ServerSession` takes the bytes a connection received, decodes frames,
has the peer authenticate (:mod:`.login`), applies the limits and hands each
request, checked and typed by its :class:`~tensorshare.protocol.messages.Command`,
to its handler (:mod:`.handlers`), then carries out what the handler returns
(:mod:`.outcome`: a reply now, a refusal, or an answer later, which :mod:`.later`
sees through).  Replies go to an
:class:`~.notify.Outbox` as whole frames.  The Twisted adapter
(``server/net/service.py``) only moves bytes and keeps the clock
(:meth:`ServerSession.tick`); tests drive a session directly.

The session is a state machine (:class:`Phase`, with the legal moves in
``_MOVES``).  Apart from its phase, a session in ``READY`` may be *held*
(:mod:`.holding`): requests wait in order while the outbox is congested (flow
control) or while an earlier request is answered later (replies stay in request
order); reading stops while any wait.  A relay may stream a frame to it as the
frame's payload arrives (:mod:`.gate`).
"""

from __future__ import annotations

import enum
import logging
import time
from bisect import bisect_left
from time import perf_counter
from typing import Callable

from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.protocol.messages import (
    AUTH, BAD_ARGS, BAD_FRAME, COMMANDS, GREETING_MESSAGE, ID_MAX, KEEPALIVE_MESSAGE, LOCAL_ERROR, MAX_BIN_NAME,
    NOT_AUTHENTICATED, PROTOCOL_VERSION, UNAVAILABLE, UNKNOWN_VERB, Key, Route, error_reply,
)
from tensorshare.version import __version__
from tensorshare.wire.frames import DiscardSink, Frame, FrameDecoder, frame_head, whole_frames
from tensorshare.wire.heads import ID_ENTRY, ID_ENTRY_AT

from ..ops.counters import LATENCY_BUCKETS, ConnStats
from ..workers.ownership import check_owner
from . import handlers, login, tables  # noqa: F401 - the handler modules register their verbs
from .holding import Holding, NoReads, Reads
from .known import KnownRequests
from .later import LaterAnswers
from .notify import Notifier, Outbox
from .outcome import Pending
from .recvpool import payload_sink
from .registry import HANDLERS
from .shared import SharedMemory
from .timelimits import AUTH_EXPIRED, KEEPALIVE, TimeLimits

log = logging.getLogger("tensorshare.server")
_DISCARD = DiscardSink(0)  # stateless: one serves every request that takes no payload
_LASTING = frozenset(c.verb for c in COMMANDS.values() if c.lasting)  # effects that outlive the connection
_OP, _ID, _RELEASE = Key.OP, Key.ID, Key.RELEASE  # (module constants: read per request)
_ID_ENTRY_END = ID_ENTRY_AT + len(ID_ENTRY)  # (a read whose first frame is laid out as a prepared head has it here)


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
        self.reads = reads or NoReads()
        self._workers = state.workers  # the WorkerMap of one worker of several (None: it serves every bin)
        self.shared = SharedMemory(state.storage, state.config, same_host, peer, state.mapped)
        self.listening: set[str] = set()
        self.owned: set[str] = set()  # the ephemeral bins this connection put last (.ephemeral)
        self.phase = Phase.OPENING
        self.closed = False  # nothing more is served (closing or closed): kept with the phase
        self._serving = False  # the phase handles requests (_SERVING): kept with the phase
        self._admitted = False  # counted in state.connections
        self.login = None if state.token is None else login.Login(state.token)  # until authenticated
        self._failure: tuple[int, str] | None = None  # FAILING: the framing error to report
        self.holding = Holding()  # requests held back, the one answered later, notifications held
        self.later = LaterAnswers(self)  # carries out a handler's Pending: the request answered later
        self.stream = None  # a frame streamed as its payload arrives (.gate), while one is
        self.timing = TimeLimits()
        frame_limits = state.config.frame_limits
        if self.login is not None:
            frame_limits = login.Login.frame_limits(frame_limits)
        self._decoder: FrameDecoder | None = FrameDecoder(self._payload_sink, frame_limits)
        # The config's limits are properties that build a new object per access.
        self.decode_limits = state.config.decode_limits
        self._max_bin_name = state.config.max_bin_name
        # verb -> (command, handler, compiled parser or None): what _request looks up per
        # request, made once (a relay's handlers replace the usual ones before any
        # connection opens; the compiled parsers assume the default bin name limit).
        default_names = self._max_bin_name == MAX_BIN_NAME
        self._verbs = {verb: (command, state.handlers.get(command) or HANDLERS[command],
                              command.parse_right if default_names and command is not AUTH else None)
                       for verb, command in COMMANDS.items()}
        # the requests of a head seen before, made without decoding it (_take_known)
        self._heads = KnownRequests(self._verbs, state.config.frame_limits, self._max_bin_name)

    @property
    def authenticated(self) -> bool:
        return self.login is None

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
        if self._workers is not None:  # one worker of several: the map clients route by (§14)
            greeting[Key.WORKERS] = self._workers.field()
        if self.login is not None:
            self._move(Phase.AUTHENTICATING)
            self.send_header(self.login.greeting(greeting))
            return
        self._move(Phase.READY)
        self.answer(0, self.shared.offer(greeting, self))  # the same-host offer (may wait for the disk)

    def data_received(self, data: bytes) -> int:
        """Handle the bytes of a read; returns how many bytes of a frame's payload are
        still to come (0 between frames): the adapter reads them in larger gulps."""
        if not self._serving or self._failure is not None:
            return 0
        self.timing.heard = True
        self.stats.bytes_in += len(data)
        decoder = self._decoder
        start = 0
        rest = decoder.payload_remaining
        if 0 < rest < len(data) and self.login is None and self.stream is None:
            # Pipelined requests split across reads: the decoder ends the one an
            # earlier read began, and those after it are taken as below (else every
            # later read of the stream went through the decoder).
            self._take(decoder.feed(memoryview(data)[:rest]))
            if not self._serving or self._failure is not None:
                return 0
            start = rest
        if self.login is None and decoder.idle and self.stream is None and self.storage.room():
            # The usual read: whole small requests, each parsed in one step here
            # (a head known before, else frames.whole_frames); the decoder takes
            # whatever follows them.
            at = start + ID_ENTRY_AT
            known = self._take_known(data, start) if data[at:at + _ID_ENTRY_END - ID_ENTRY_AT] == ID_ENTRY else start
            if known > start and (known == len(data) or not self._serving):
                return 0
            whole, end = whole_frames(data, decoder.limits, known)
            if whole:
                self._take_whole(whole)
                if end == len(data) or not self._serving:
                    return 0
            if end:
                data = memoryview(data)[end:]
        try:
            frames = decoder.feed(data)
        except ProtocolError as exc:
            frames = getattr(exc, "frames", [])  # whole requests before the bad bytes
            if self.authenticated:
                self._failure = (BAD_FRAME, str(exc))
            else:
                login.failed(self, f"a frame before authentication: {exc}")
                self._failure = (NOT_AUTHENTICATED, f"authentication required (frame refused: {exc})")
        self._take(frames)
        return self._receiving_payload()

    def receive_buffer(self) -> memoryview | None:
        """Memory to read the next bytes straight into (a large payload arriving into
        the receive pool lends it: :mod:`.recvpool`), or None: read as usual and
        call :meth:`data_received`."""
        if not self._serving or self._failure is not None:
            return None
        return self._decoder.lent_buffer()

    def received_into(self, n: int) -> int:
        """``n`` bytes were read into the buffer :meth:`receive_buffer` returned; as
        :meth:`data_received`."""
        self.timing.heard = True
        self.stats.bytes_in += n
        self._take(self._decoder.buffer_updated(n))
        return self._receiving_payload()

    def _receiving_payload(self) -> int:
        """Bytes of payload still to come for the frame being received (0 if none)."""
        return self._decoder.payload_remaining if self._decoder is not None else 0

    @property
    def backlogged(self) -> bool:
        """True while whole requests wait (for the outbox to drain, or an earlier answer)."""
        return bool(self.holding.backlog)

    def resume(self) -> None:
        """Handle the requests held back (while the outbox was congested, or an earlier
        request was answered later)."""
        if not self.closed:
            self._work()

    def connection_lost(self) -> None:
        # A request that arrived whole takes effect even if its reply cannot be sent
        # (PROTOCOL.md §8.3): of those held back, run the ones whose effect outlives
        # the connection (the others would only have produced their reply).
        holding = self.holding
        backlog, holding.backlog = holding.backlog, type(holding.backlog)()
        self._move(Phase.CLOSED)
        if self.stream is not None:
            self.stream.abandon()
            self.stream = None
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
        self.later.drop()  # a request waiting in its lane is dropped
        if self.owned:  # its ephemeral bins end with it
            self.state.ephemeral.release(self, self.state)
        self.shared.connection_lost()

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
        config = self.config
        due = self.timing.due(now, sending, config, self.authenticated, bool(self.listening))
        if due is None:
            return
        if due == AUTH_EXPIRED:
            login.failed(self, f"not authenticated within {config.auth_timeout:g}s")
            self._close_with(NOT_AUTHENTICATED, "authentication timed out")
            return
        if due == KEEPALIVE:
            self.send_header(KEEPALIVE_MESSAGE.build(msg="keepalive"))
            return
        log.info("conn %d closing (%s): idle for %gs", self.stats.id, self.peer, config.idle_timeout,
                 extra={"conn": self.stats.id, "event": "idle"})
        self._close_with(UNAVAILABLE, f"idle for {config.idle_timeout:g}s; closing")

    # -- the Listener interface (notifications from any session)

    def notify(self, name: str, frame: bytes) -> None:
        if self.closed:
            return
        if self.holding.holds:  # after the reply (or streamed frame) that holds them
            self.holding.hold(name, frame)
            return
        self.notifier.notify(name, frame)

    def release_notes(self) -> None:
        """One reason to hold this connection's notifications is gone: if it was the
        last, they go out."""
        holding = self.holding
        holding.holds -= 1
        if not holding.holds and holding.notes:
            self._send_notes()

    def _send_notes(self) -> None:
        for name, frame in self.holding.take_notes().items():
            self.notify(name, frame)

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
        return payload_sink(command.payload, nbytes, self.state.recv_pool)

    def _take_whole(self, whole: list[tuple[dict, bytes, int]]) -> None:
        """:meth:`_take` for the frames of :func:`~tensorshare.wire.frames.whole_frames`:
        each payload as the decoder's sink would have kept it (:meth:`_payload_sink`)."""
        holding, outbox, verbs = self.holding, self.outbox, self._verbs
        for header, payload, payload_len in whole:
            if self.closed:  # refused: nothing after it is served
                return
            op = header.get(_OP)
            entry = verbs.get(op) if type(op) is str else None
            payload = None if entry is None or not entry[0].payload else [payload] if payload_len else []
            if outbox.congested or holding.answering is not None or holding.backlog:  # hold the rest back
                holding.backlog.append(Frame(header, payload, payload_len))
                continue
            self._request(header, payload, payload_len, None, entry)
        if holding.answering is not None or holding.backlog:
            self._work()

    def _take_known(self, data: bytes, pos: int = 0) -> int:
        """Serve the whole requests from ``pos`` of ``data`` on whose heads are known
        (:mod:`.known`: the same bytes but for the id as a request accepted before),
        while nothing holds requests back; returns where the first other one starts."""
        heads, holding, outbox = self._heads, self.holding, self.outbox
        while not (self.closed or outbox.congested or holding.answering is not None or holding.backlog):
            known = heads.read(data, pos)
            if known is None:
                return pos
            entry, request, stop = known
            self._serve(request.id, entry, request, request.payload_len)
            pos = stop
        return pos

    def _take(self, frames: list[Frame]) -> None:
        """Handle whole requests, in order, or queue them while the outbox or an
        earlier request makes them wait."""
        holding = self.holding
        if not holding.backlog:
            outbox = self.outbox
            for i, frame in enumerate(frames):
                if self.closed:  # refused: nothing after it is served
                    return
                if outbox.congested or holding.answering is not None:  # hold the rest back
                    frames = frames[i:]
                    break
                self._handle(frame)
            else:
                frames = ()
        if frames or holding.answering is not None or self._failure is not None or holding.backlog:
            holding.backlog.extend(frames)
            self._work()

    def _work(self) -> None:
        """Handle waiting requests while the outbox and earlier answers let us; read
        only while none waits."""
        holding, outbox = self.holding, self.outbox
        backlog = holding.backlog
        while backlog and not outbox.congested and holding.answering is None and not self.closed:
            self._handle(backlog.popleft())
        if not backlog and holding.answering is None and self._failure is not None and not self.closed:
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
        self._request(frame.header, frame.payload, frame.payload_len, frame.refused)

    def _request(self, header: dict, payload, payload_len: int, refused: str | None = None,
                 entry: tuple | None = False) -> None:
        """Check one request (PROTOCOL.md §4.2), run its handler and carry out its outcome.
        ``entry``: its verb's ``(command, handler, parser)`` if the caller looked it up already."""
        if _RELEASE in header:
            self.shared.release(header[_RELEASE])
        rid = header.get(_ID)
        if type(rid) is not int or not 0 < rid <= ID_MAX:
            rid = 0
        if self.login is not None:  # not authenticated yet
            self._authenticate(rid, header)
            return
        if entry is False:
            op = header.get(_OP)
            entry = self._verbs.get(op) if type(op) is str else None
        try:
            if refused is not None:  # a header over a limit of what it may decode to
                raise RemoteError(refused, BAD_ARGS)
            if entry is None:
                raise RemoteError(f"unknown verb {header.get(_OP)!r:.60}", UNKNOWN_VERB)
            if rid == 0:
                raise RemoteError("request id must be an integer in 1..2**64-1", BAD_ARGS)
            command, handle, parse = entry
            request = None if parse is None else parse(header, rid, payload, payload_len)
            # AUTH when none is due is answered 503 whatever its fields (§4.3): its handler says so
            if request is None and command is not AUTH:
                request = command.parse_request(header, rid, payload, payload_len, self._max_bin_name)
        except RemoteError as exc:
            self.refuse(rid, exc)
            return
        except Exception:  # a bug: as in _serve
            self._failed(header.get(_OP), rid)
            return
        self._serve(rid, entry, request, payload_len)

    def _serve(self, rid: int, entry: tuple, request, payload_len: int) -> None:
        """Run the handler of a checked request and carry out its outcome (``entry``:
        its verb's ``(command, handler, parser)``)."""
        command, handle = entry[0], entry[1]
        holding = self.holding
        holding.holds += 1  # notifications of what the handler changes follow its reply
        try:
            if self._workers is not None and command.route is Route.OWNER:  # one worker of several (§14.3)
                check_owner(self._workers, request.bin)
            counters = self.counters
            began = 0.0 if counters is None else perf_counter()
            outcome = handle(self, request)
            if self.closed or self.stream is not None:
                self.answer(rid, outcome)
            elif type(outcome) is bytes:  # (the usual case)
                self.outbox.reply(outcome)
            elif type(outcome) is tuple:  # (a GET's: answer() and send(), inline)
                self.outbox.send_reply(*outcome)
            else:
                self.answer(rid, outcome)
            if counters is not None:  # counted inline: this is the request path (server/ops/counters.py)
                elapsed = perf_counter() - began
                verb = counters.verbs[command.verb]
                verb.requests += 1
                verb.bytes_in += payload_len
                verb.seconds += elapsed
                verb.buckets[bisect_left(LATENCY_BUCKETS, elapsed)] += 1
                self.stats.requests += 1
        except RemoteError as exc:
            self.refuse(rid, exc)
        except Exception:  # a bug: this request fails, the connection and the server go on
            self._failed(command.verb, rid)
        holds = holding.holds = holding.holds - 1  # (release_notes(), inline)
        if not holds and holding.notes:
            self._send_notes()

    def _failed(self, verb, rid: int) -> None:
        """Answer request ``rid`` (of ``verb``) 500 after a bug, logged with its traceback."""
        log.exception("%s from %s failed", verb, self.peer)
        self.send_header(error_reply(LOCAL_ERROR, "internal server error", rid))

    def _authenticate(self, rid: int, header: dict) -> None:
        """Check the AUTH request of a connection that must authenticate (PROTOCOL.md
        §8.4); anything else, or a wrong AUTH, gets 530 and the connection closes."""
        try:
            reply = self.login.check(rid, header)
        except login.Refused as exc:
            login.failed(self, exc.reason)
            self._close_with(NOT_AUTHENTICATED, exc.message, rid)
            return
        self.login = None
        self._decoder.limits = self.config.frame_limits
        self._move(Phase.READY)
        self.stats.authenticated = True
        log.info("conn %d authenticated (%s)", self.stats.id, self.peer, extra={"conn": self.stats.id, "event": "auth"})
        self.answer(rid, self.shared.offer(reply, self))

    # -- outcomes (.outcome)

    def answer(self, rid: int, outcome) -> None:
        """Carry out a handler's ``outcome`` for request ``rid`` (see :mod:`.outcome`)."""
        kind = type(outcome)
        if kind is bytes:
            self.send([outcome])
        elif kind is dict:
            self.send([frame_head(outcome, 0)])
        elif kind is list:
            self.send(outcome)
        elif kind is tuple:
            self.send(*outcome)
        elif kind is Pending:
            self.later.answer(rid, outcome)
        elif outcome is not None:
            raise TypeError(f"a handler returned {outcome!r:.80}, not an outcome")

    # -- output

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None,
             on_written: Callable[[], None] | None = None) -> None:
        """Queue a frame (a list of parts), unless the connection is closed (then
        ``on_abandon`` runs at once); while a frame is being streamed, after it."""
        if self.closed:
            if on_abandon is not None:
                on_abandon()
        elif self.stream is not None:
            self.stream.behind.append((parts, on_abandon, on_written))
        else:
            self.outbox.send_reply(parts, on_abandon, on_written)

    def send_header(self, header: dict) -> None:
        """Queue a frame that is only a header."""
        self.send([frame_head(header, 0)])

    def refuse(self, rid: int, error: RemoteError) -> None:
        """Answer request ``rid`` with the error reply ``error`` stands for."""
        if self.counters is not None:
            self.counters.refusal(error.code)
        self.send_header(error_reply(error.code, error.message, rid))

    def cut_off(self, reason: str) -> None:
        """Close after what is queued, with no last reply: a frame streamed as its payload
        arrived (:mod:`.gate`) cannot be finished, and the peer must see it cut short,
        never completed by other bytes."""
        if self.closed:
            return
        log.info("conn %d cut off (%s): %s", self.stats.id, self.peer, reason,
                 extra={"conn": self.stats.id, "event": "cut_off"})
        self._move(Phase.CLOSING)
        self.reads.pause("closing")
        if self.stream is not None:
            self.stream.abandon()
            self.stream = None
        self.outbox.close()

    def _close_with(self, code: int, message: str, rid: int = 0) -> None:
        """Send a last error reply, then close; nothing more is read or served."""
        if self.stream is not None:  # a frame is being streamed: it cannot be followed by another
            self.cut_off(message)
            return
        self.send_header(error_reply(code, message, rid))
        self._move(Phase.CLOSING)
        self.reads.pause("closing")  # whatever the peer sends now would only be read and dropped
        self.outbox.close()
