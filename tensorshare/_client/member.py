"""The blocking client's driver of the engine: one connection, a plain socket, read by whichever thread waits.

A :class:`Member` is one connection of a :class:`tensorshare.Client` (of the worker
its :class:`~tensorshare.protocol.router.Router` made it for).  Its
:class:`~tensorshare.protocol.engine.Engine` knows the protocol (calls in flight,
replies checked, notifications, listens restored, keepalive, backoff); the member
moves the bytes:

* **writing**: a request's frame goes out whole under the send lock, behind the
  small requests the :class:`~.coalesce.Coalescer` held while earlier ones awaited
  their replies, or bucket by bucket as the device engine stages it; what the engine
  wants sent (a keepalive probe) goes first;
* **reading** ("leader/follower"): a thread waiting for its reply becomes the reader
  when no other thread reads, reads once at a time (polling a little before sleeping
  while that pays, :mod:`.spin`) and hands each event on: a waiting thread is woken,
  an inline callback runs on the reading thread, every other callback and every
  notification goes to the front's dispatcher thread, in order;
* **staying connected**: a call connects when it finds no connection (at once); a
  background reader (:mod:`.reader`) keeps the socket drained while listens or
  non-blocking calls wait, and reconnects with the engine's backoff.

A round trip on the fast path is two system calls on the caller's thread: no thread
hand-off.  What the member needs of its client it is handed at birth: the front's
hooks (completing a callback call, the dispatcher, whether a greeting fits the map,
what to do when the worker cannot be reached).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from ..disk.areas import local_socket
from ..errors import ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UsageError
from ..protocol.engine import DEAD, Notice, Restored
from ..protocol.messages import Key
from .coalesce import Coalescer
from .express import Express
from .listens import notification, tell_restored
from .progress import Progress
from .reader import BackgroundReader
from .sockets import IDLE_CHECK, SMALL_FRAME, Link, open_link, open_local
from .spin import ReplySpin
from .zerocopy import SharedAreas

log = logging.getLogger("tensorshare.client")


class StaleMapError(ConnectionLostError):
    """A member could not reach its worker, or found other workers there, and the
    front mapped the workers again: the request was not sent (the front sends it
    once more, to its bin's owner in the new map)."""


class Member:
    """One connection of a blocking client (see the module docstring).  ``front`` is the
    client's side of it (:class:`tensorshare.Client`): its settings, dispatcher and
    hooks; ``index``: the worker (None: a server of one process); ``opened``: a
    :class:`~.sockets.Link` already open to that worker, taken over."""

    def __init__(self, front, index: int | None, port: int, opened: Link | None = None):
        self.front = front
        self.settings = settings = front.settings
        self.index, self.port = index, port
        self.where = f"{settings.host}:{port}"
        self.map = front.router.map  # the map it was made by
        self.engine = opened.engine if opened is not None else settings.engine(port)
        self.engine.use_sinks(front.values.sinks(self.engine))
        # ``lock`` guards the engine's calls and listens, and who reads; ``cond`` (over
        # the same lock) is for waiting: plain ``with lock`` costs half of ``with cond``.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.send_lock = threading.Lock()
        self.connect_lock = threading.Lock()
        self.coalescer = Coalescer(SMALL_FRAME)  # requests in flight, small ones held back meanwhile (send lock)
        self.spin = ReplySpin(settings.spin)  # used by the thread reading for its own reply
        self.next_check = 0.0  # the keepalive's next look (monotonic), as it said last
        self.link: Link | None = None
        self.local: str | None = None  # the worker's Unix socket, once a greeting named one we trust
        self.areas: SharedAreas | None = None  # the current connection's verified same-host areas
        self.reading = False  # a thread is the leader: it reads the socket
        self.waiting = 0  # threads asleep on cond (a lone caller wakes nobody: no notify to pay for)
        self.callbacks = 0  # non-blocking calls in flight: they need someone to read their replies
        self.closed = False
        self.reader = BackgroundReader(self)  # keeps the socket drained while callbacks wait
        self.express = Express(self, front)  # lone small calls on an idle connection
        if opened is not None:
            self.take(self._local_instead(opened, settings.connect_timeout))

    def __repr__(self) -> str:
        return f"<Member {self.where} worker {self.index}>"

    # -- connecting

    def connect(self, deadline: float | None) -> Link:
        """The current connection, opened first if there is none (within the settings'
        connect timeout and ``deadline``)."""
        link = self.link
        if link is not None:
            return link
        if self.closed:
            if not self.front._closed:  # replaced by a new map's member: the front sends it there
                raise StaleMapError(f"{self.where} serves other bins now: the server runs other workers")
            raise UsageError("the client is closed")
        engine = self.engine
        if engine.failure is not None:
            raise engine.failure.with_traceback(None)
        if not self.settings.reconnect and engine.ever_ready:
            raise ConnectionLostError(f"connection to {self.where} lost (reconnect=False)")
        with self.connect_lock:
            if self.link is not None:
                return self.link
            if engine.failure is not None:
                raise engine.failure.with_traceback(None)
            within = self.settings.connect_timeout
            if deadline is not None:
                within = max(min(within, deadline - time.monotonic()), 0.001)
            try:
                link = self._open(within)
            except ConnectionLostError as exc:
                if self.front.unreachable(self, exc):  # the server moved its workers: not sent here
                    raise StaleMapError(str(exc)) from None
                raise
            return self.take(link)

    def _open(self, within: float) -> Link:
        """A new connection to the worker: through its Unix socket when it is on this
        host and zero-copy is on (the socket its last greeting named, else the one
        this TCP connection's greeting names: PROTOCOL.md §10.1), else over TCP."""
        if self.local is not None:
            try:
                return open_local(self.local, within, self.engine, self.where)
            except ConnectionLostError as exc:  # gone (the server restarted, say): TCP tells where now
                log.info("%s: its Unix socket is gone (%s); connecting over TCP", self.where, exc)
                self.local = None
        return self._local_instead(self._open_tcp(within), within)

    def _open_tcp(self, within: float) -> Link:
        """A new TCP (or TLS) connection to the worker, its opening done."""
        settings = self.settings
        return open_link(settings.host, self.port, within, settings.tls, settings.ssl_context, self.engine)

    def _local_instead(self, link: Link, within: float) -> Link:
        """``link``, just opened over TCP, or in its place a connection through the Unix
        socket its greeting names, if this client trusts it (zero-copy on, the socket in
        a verified area of the server: :func:`~tensorshare.disk.areas.local_socket`)."""
        engine = self.engine
        path = local_socket(engine.greeting.get(Key.SHM)) if self.settings.zero_copy and not link.tls else None
        if path is None:
            return link
        link.close()
        engine.lost(ConnectionLostError("moved to the same-host socket"))  # (listens it restored: never answered)
        try:
            local = open_local(path, within, engine, self.where)
        except ConnectionLostError as exc:
            log.info("%s: not using its Unix socket %s (%s); connecting over TCP", self.where, path, exc)
            return self._open_tcp(within)
        self.local = path
        return local

    def take(self, link: Link) -> Link:
        """Make the opened ``link`` current (if its greeting is what this member expects)."""
        greeting = self.engine.greeting
        if not self.front.fits(self, greeting):
            link.close()
            raise StaleMapError(f"{self.where} now runs other workers than this client mapped")
        try:
            areas = SharedAreas.of(greeting) if self.settings.zero_copy else None
        except BaseException:
            link.close()
            raise
        with self.lock:
            if self.closed:  # closed while we connected: do not leave a socket behind
                link.close()
                raise UsageError("the client is closed")
            self.link, self.areas = link, areas
            self.next_check = 0.0  # (a new connection's keepalive starts afresh)
        if self.engine.outbox:  # (listens moved here before this connection was taken)
            with self.send_lock:
                self.send_locked(link, [], None)
        if self.engine.listens:
            self.reader.ensure()
        return link

    def shared_areas(self, deadline: float | None) -> SharedAreas | None:
        """The current connection's areas (connecting first if need be)."""
        if self.link is None:
            try:
                self.connect(deadline)
            except TensorShareError:
                return None  # the request itself will say what is wrong
        return self.areas

    @property
    def connected(self) -> bool:
        return self.link is not None

    # -- calls

    def _link_for(self, now: float, deadline: float | None) -> Link:
        """The connection a request goes on now: on one quiet for a while, what the
        server sent meanwhile is read first (:meth:`_before_request`); connected if need be."""
        link = self.link
        engine = self.engine
        if link is not None and now - engine.last_heard > IDLE_CHECK and now - engine.last_sent > IDLE_CHECK:
            self._before_request(now)
            link = self.link
        return link if link is not None else self.connect(deadline)

    def call(self, call, parts: list, deadline: float | None, progress: Progress | None = None) -> None:
        """Send ``call`` and wait for its reply (``call.frame``) or its error (``call.error``).
        A caller who leaves early abandons it: the connection is reset if the server
        could otherwise deliver to nobody (a call it may hold, or one that takes items)
        and after any interrupt (KeyboardInterrupt...), which may leave a frame half sent.
        A caller who finds nobody reading becomes the reader before it sends: its reply
        is read by no one else, and no thread is woken for it."""
        engine = self.engine
        now = time.monotonic()
        link = self.link
        if link is None or (now - engine.last_heard > IDLE_CHECK and now - engine.last_sent > IDLE_CHECK):
            link = self._link_for(now, deadline)  # (a call only where there is something to do)
        lock = self.lock
        with lock:
            engine.track(call, now)
            leading = not self.reading
            if leading:
                self.reading = True
        try:
            try:
                if progress is None:
                    self._send(link, parts, deadline, call.rid)
                else:
                    self._send(link, progress.sending(parts), deadline, call.rid, progress=progress)
            except BaseException:
                if leading:  # (_await, which would have let go of the reader's role, does not run)
                    self.stop_reading()
                raise
            self._await(call, deadline, progress, leading)
        except BaseException as exc:
            self.gave_up(call, link, exc)
            if isinstance(exc, TensorShareError):
                call.error = exc
                return
            raise  # (KeyboardInterrupt...: its frame may be half sent, the connection was reset)

    def send(self, call, parts: list, deadline: float | None) -> None:
        """Send ``call`` and return without its reply: :meth:`wait_for` reads it later,
        unless a call made meanwhile read it first (replies come in request order, so
        the next call on this connection does).  No thread is started for it.

        A small frame on plain TCP is held back by the kernel until the next request
        goes (at most 0.2 s): the two leave in one segment, so the server wakes once
        for both and answers both with one send."""
        now = time.monotonic()
        link = self._link_for(now, deadline)
        with self.lock:
            self.engine.track(call, now)
        try:
            if (link.tls or len(parts) != 1 or len(parts[0]) > SMALL_FRAME
                    or not self._send_more(link, parts[0], deadline, call.rid)):
                self._send(link, parts, deadline, call.rid)
        except BaseException as exc:
            self.gave_up(call, link, exc)
            raise

    def _send_more(self, link: Link, data: bytes, deadline: float | None, rid: int) -> bool:
        """Send request ``rid``'s frame ``data`` held back (:meth:`Link.send_held`) if
        nothing waits to go before it; False if it went no way (send it as usual then)."""
        with self.send_lock:
            if link is not self.link or self.coalescer.frames or self.engine.outbox:
                return False
            self.coalescer.take(link, rid)  # (in flight from here)
            try:
                sent = link.send_held(data)
            except OSError as exc:
                raise self.lost(link, exc) from None
            if sent < len(data):  # the socket is full: the rest as usual (the kernel keeps the order)
                self.send_locked(link, [memoryview(data)[sent:]], deadline)
            return True

    def wait_for(self, call, deadline: float | None) -> None:
        """Wait for the outcome of a call :meth:`send` sent (``call.frame`` or
        ``call.error``), reading the socket if nobody else is."""
        if call.frame is not None or call.error is not None:
            return
        link = self.link
        try:
            if link is not None and not link.tls:
                link.push()  # (it may be held back still: nothing was sent after it)
            self._await(call, deadline)
        except BaseException as exc:
            self.gave_up(call, link, exc)
            raise

    def resume(self, call, n: int, deadline: float | None) -> None:
        """Go on with a call the express lane (:mod:`.express`) handed over: sent, tracked,
        this thread the reader, the first ``n`` bytes of what came back in the engine's
        buffer.  Returns as :meth:`call` does."""
        link = self.link
        try:
            try:
                if n:
                    self._take_in(link, n)
            except BaseException:
                self.stop_reading()
                raise
            self._await(call, deadline, None, leading=True)
        except BaseException as exc:
            self.gave_up(call, link, exc)
            if isinstance(exc, TensorShareError):
                call.error = exc
                return
            raise

    def gave_up(self, call, link, exc: BaseException) -> None:
        """The caller of ``call`` leaves early with ``exc``: reset the connection if the
        server could otherwise deliver to nobody, or if ``exc`` is an interrupt
        (KeyboardInterrupt...), which may leave a frame half sent."""
        interrupted = not isinstance(exc, TensorShareError)
        with self.lock:
            in_flight = call.rid in self.engine.calls
            reset = self.engine.abandon(call) or (interrupted and in_flight)
        if reset:
            self.drop(link, ConnectionLostError(f"connection to {self.where} reset: a call on it was given up "
                                                f"while the server could still answer it"))

    def submit(self, call, parts: list, deadline: float | None) -> None:
        """Send a non-blocking call; the front's ``complete(call)`` (or its inline
        completion) hears of it."""
        link = self.link
        if link is not None:
            now = time.monotonic()
            engine = self.engine
            if now - engine.last_heard > IDLE_CHECK and now - engine.last_sent > IDLE_CHECK:
                self._before_request(now)
        try:
            link = self.link or self.connect(deadline)
        except StaleMapError:
            raise  # (the front sends it to its owner in the new map)
        except TensorShareError as exc:
            call.error = exc
            self.front.callbacks().submit(self.front.complete, call)
            return
        try:
            with self.lock:
                self.engine.track(call, time.monotonic())
                self.callbacks += 1
            self._send(link, parts, deadline, call.rid, may_hold=True)
        except TensorShareError as exc:
            with self.lock:
                mine = self.engine.calls.pop(call.rid, None) is not None  # else the lost connection failed it already
                if mine:
                    self.callbacks -= 1
            if mine:
                call.error = exc
                self.front.callbacks().submit(self.front.complete, call)
            return
        self.reader.ensure()

    def hold(self, wait: float) -> None:
        """A request that asks the server to hold it ``wait`` seconds is about to go."""
        self.engine.hold(time.monotonic() + wait + 1.0)

    # -- writing

    def _send(self, link: Link, parts, deadline: float | None, rid: int, may_hold: bool = False,
              progress: Progress | None = None) -> None:
        """Send request ``rid``'s frame; ``may_hold``: a small one may wait in the
        coalescer while an earlier request awaits its reply."""
        coalescer = self.coalescer
        with self.send_lock:
            if type(parts) is not list:  # StagedParts: device arrays, staged bucket by bucket as they go
                self._send_staged(link, parts, deadline, rid, progress)
                return
            if not (may_hold and not link.tls and coalescer.awaiting(link)
                    and sum(map(len, parts)) <= SMALL_FRAME and coalescer.hold(link, rid, b"".join(parts))):
                if progress is None:
                    self.send_locked(link, parts, deadline, rid)
                else:  # piece by piece, reporting each
                    for i, piece in enumerate(progress.pieces(parts)):
                        self.send_locked(link, piece, deadline, rid if i == 0 else None)
                        progress.sent(piece)
                return
        # Held.  The replies it waits for may all have come while we held the lock,
        # and a reader that then found the lock taken did not send what is held: do.
        if not coalescer.awaiting(link):
            with self.send_lock:
                if coalescer.frames and link is self.link:
                    self.send_locked(link, [], deadline)

    def _send_staged(self, link: Link, parts, deadline: float | None, rid: int, progress: Progress | None) -> None:
        """Send a frame holding device arrays: each bucket the engine stages goes out
        before the next is asked for (its buffer is then reused)."""
        pending, first = [], True
        for view, staged in parts.engine.pieces(parts):
            pending.append(view)
            if staged:
                self.send_locked(link, pending, deadline, rid if first else None)
                if progress is not None:
                    progress.sent(pending)
                pending, first = [], False
        if pending or first:
            self.send_locked(link, pending, deadline, rid if first else None)
            if progress is not None:
                progress.sent(pending)

    def _send_held(self, link: Link) -> None:
        """Send what the coalescer holds, as far as the socket takes it now (a reader:
        never waits for the socket, nor for a sender, which sends it first anyway)."""
        if not self.send_lock.acquire(blocking=False):
            return
        try:
            if link is not self.link or not self.coalescer.frames:
                return
            frames = self.coalescer.take(link)
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            try:
                sent = link.send_now(data)
            except OSError as exc:
                raise self.lost(link, exc) from None
            if sent < len(data):
                self.coalescer.keep_rest(memoryview(data)[sent:])
        finally:
            self.send_lock.release()

    def send_locked(self, link: Link, parts: list, deadline: float | None, rid: int | None = None) -> None:
        """Write what the engine wants sent and what the coalescer holds, then request
        ``rid``'s whole frame (the caller holds the send lock).  With keepalive on, a
        server that takes no byte for twice ``keepalive`` seconds is presumed dead."""
        if link is not self.link:
            # Replaced since the caller picked it up: what the coalescer holds now is
            # the new connection's, and must not be taken for this one.
            raise ConnectionLostError(f"connection to {self.where} lost")
        held = self.coalescer.take(link, rid)
        engine = self.engine
        if engine.outbox:
            held = engine.take_outbox() + held
        if held:  # many small frames: one part (one iovec) for all of them
            parts = [held[0] if len(held) == 1 else b"".join(held), *parts]
        keepalive = self.settings.keepalive
        try:
            link.send_all(parts, deadline, None if keepalive is None else 2 * keepalive)
        except TimeoutError:
            # A partly sent frame leaves the stream unusable: start afresh.
            self.drop(link, ConnectionLostError("send timed out; connection reset"))
            raise
        except (OSError, ValueError, AttributeError) as exc:  # ValueError/AttributeError: closed by another thread
            raise self.lost(link, exc) from None

    def _before_request(self, now: float) -> None:
        """On a connection quiet for a while, first read what the server sent meanwhile
        (late replies, or the 421 it sends before closing an idle connection), so that
        a connection it has closed is replaced by the request instead of failing it."""
        self.engine.last_sent = now
        link = self.link
        with self.lock:
            if self.reading or link is not self.link:
                return  # another thread reads: it will notice a close itself
            self.reading = True
        try:
            while self.link is link and link.data_waiting():
                self.read_some(time.monotonic() + 0.1)
        except (TimeoutError, ConnectionLostError):
            pass  # half a TLS record (read on later), or the connection is gone (the request reconnects)
        finally:
            with self.lock:
                self.reading = False
                self.cond.notify_all()

    # -- reading

    def _await(self, call, deadline: float | None, progress: Progress | None = None, leading: bool = False) -> None:
        """Wait for ``call``'s outcome, reading the socket ourselves when nobody else is
        (``leading``: this thread is the reader already)."""
        lock = self.lock
        if not leading:
            with lock:
                while True:
                    if call.frame is not None or call.error is not None:
                        return
                    if not self.reading:
                        self.reading = True
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no reply from {self.where} in time")
                    self.waiting += 1
                    try:
                        self.cond.wait(remaining)
                    finally:
                        self.waiting -= 1
        try:
            while call.frame is None and call.error is None:
                self.read_some(deadline, spin=progress is None)
                if progress is not None and call.frame is None:
                    progress.received(self.engine.decoder.receiving)
            if progress is not None:
                progress.finished(call.frame)
        finally:
            self.stop_reading()

    def stop_reading(self) -> None:
        """This thread is the reader no more: a waiting thread may take the role."""
        with self.lock:
            self.reading = False
            if self.waiting:
                self.cond.notify_all()

    def read_some(self, deadline: float | None, spin: bool = False) -> None:
        """Read once from the socket and hand on the events it completes (leader only;
        ``spin``: a caller waiting for its own reply, who may poll before sleeping)."""
        link = self.link
        if link is None:
            raise ConnectionLostError(f"not connected to {self.where}")
        poller = link.readable
        coalescer = self.coalescer
        if coalescer.frames:  # requests held while earlier ones awaited the replies we read
            self._send_held(link)
            if coalescer.partial:  # the socket is full: wake when it takes more, too
                poller, spin = link.readwrite, False
        engine = self.engine
        until = deadline
        if engine.keepalive is not None:
            wake = self.next_check  # (not due yet, the usual case: no call to find that out)
            if time.monotonic() >= wake:
                wake = self._keepalive(link)
            if wake is not None and (deadline is None or wake < deadline):
                until = wake
        try:
            if spin and self.spin.limit and not link.tls:
                self.spin.wait(link.ready_now if poller is link.readable else partial(poller.poll, 0), poller, until)
                n = link.recv_ready(engine.buffer())
            else:
                n = link.recv_into(engine.buffer(), until, poller)
            if n == 0:
                raise ConnectionResetError("server closed the connection")
        except BlockingIOError:
            return
        except TimeoutError:  # our TimeoutError is an OSError too: the connection is fine
            if until is deadline:
                raise
            return  # time for the next keepalive check, not the caller's deadline
        except (OSError, ValueError) as exc:
            raise self.lost(link, exc) from None
        self._take_in(link, n)

    def _take_in(self, link: Link, n: int) -> None:
        """Hand on the events of ``n`` bytes read into the engine's buffer."""
        try:
            events = self.engine.received(n, time.monotonic())
        except ProtocolError as exc:  # the server sent nonsense: nothing it says can be trusted
            err = ConnectionLostError(f"bad reply from {self.where}: {exc}")
            self.drop(link, err)
            raise err from None
        except (OSError, ValueError) as exc:  # (a sink that could not take the bytes, say)
            raise self.lost(link, exc) from None
        if events:
            self._dispatch(events)

    def _dispatch(self, events: list) -> None:
        """Hand each event of a read on: wake the threads waiting for theirs, queue the
        callbacks for the dispatcher (one hand-off for the read), run inline ones here."""
        front = self.front
        jobs: list = []
        inline: list = []
        woken = False
        coalescer = self.coalescer
        with self.lock:
            for event in events:
                kind = type(event)
                if kind is Notice:
                    jobs.extend(_told(event))
                    continue
                if kind is Restored:
                    jobs.append((tell_restored, (event, self.where)))
                    continue
                if kind is str:  # READY (an opening is over: nothing to hand on)
                    continue
                coalescer.answered(event.rid)
                if event.callback is None:
                    woken = True
                    continue
                self.callbacks -= 1
                if event.inline:
                    inline.append(event)
                else:
                    jobs.append((front.complete, (event,)))
            if woken and self.waiting:
                self.cond.notify_all()
        if jobs:
            front.callbacks().submit_all(jobs)
        for call in inline:
            front.complete_inline(call)

    def _keepalive(self, link: Link) -> float | None:
        """Do what the engine's keepalive asks: a probe, or dropping a connection that
        stays silent (ConnectionLostError).  Returns when to check next (None: off)."""
        engine = self.engine
        now = time.monotonic()
        if now < self.next_check:
            return self.next_check
        action, wake = engine.tick(now)
        self.next_check = now if wake is None else wake
        if action == DEAD:
            err = engine.dead_error()
            self.drop(link, err)
            raise err
        if engine.outbox:
            if not self.send_lock.acquire(blocking=False):
                return now + 0.5  # a request is going out: the probe goes with it
            try:
                self.send_locked(link, [], None)  # no deadline: a probe that cannot go out trips the stall limit
            finally:
                self.send_lock.release()
        return wake

    # -- losing the connection

    def lost(self, link: Link, exc: BaseException) -> ConnectionLostError:
        """Drop ``link``, which failed with ``exc``; the error to raise."""
        err = ConnectionLostError(f"connection to {self.where} lost: {exc}")
        self.drop(link, err)
        return err

    def drop(self, link: Link | None, error: BaseException) -> None:
        """Close ``link`` (if still current) and fail every call in flight on it."""
        with self.lock:
            if link is None or link is not self.link:
                return
            self.link = self.areas = None
            failed = [call for call in self.engine.lost(error) if call.callback is not None]
            self.callbacks = 0
            self.cond.notify_all()
        link.close()
        self.front.connection_lost(self)
        if failed:
            front = self.front
            front.callbacks().submit_all([(front.complete, (call,)) for call in failed])

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()  # an idle reader ends now
        self.drop(self.link, ConnectionLostError("client closed"))
        with self.lock:
            self.engine.close()

    def stop_listening(self, handle):
        """``(command, fields)`` of the call that ends ``handle`` (:meth:`Engine.stop_listening`)."""
        with self.lock:
            return self.engine.stop_listening(handle)

    def forget_listen(self, handle) -> None:
        """``handle`` hears nothing more here (its stopping call failed)."""
        with self.lock:
            self.engine.listens.remove(handle)

    def join(self, timeout: float) -> None:
        thread = self.reader.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def adopt(self, handle) -> None:
        """Listen with ``handle`` (moved here from another member) from now on (the
        engine decides whether a LISTEN goes out now; this sends what it asks)."""
        with self.lock:
            self.engine.adopt(handle)
        handle.client = self.front
        link = self.link
        if link is not None and self.engine.outbox:
            with self.send_lock:
                if link is self.link and self.engine.outbox:
                    self.send_locked(link, [], None)
        self.reader.ensure()


__all__ = ["Member", "StaleMapError"]


def _told(event: Notice) -> list:
    """The callbacks a notification goes to, each with it.  (Apart from
    :meth:`Member._dispatch`: a generator there made a cell on every read.)"""
    note = notification(event)
    return [(handle.callback, (note,)) for handle in event.handles]
