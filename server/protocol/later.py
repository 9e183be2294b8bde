"""A connection's request answered later: from its handler's :class:`~.outcome.Pending` to its reply.

When a handler returns a :class:`~.outcome.Pending` (:mod:`.outcome`), the session
hands it here (:meth:`LaterAnswers.answer`), which holds the connection until the
request is answered (:mod:`.holding`: the requests behind it wait, and so do its
notifications), lets it wait in its lane first if it has one (:mod:`.waits`), starts
what it waits for, carries out its outcome once that is done (through the session:
:meth:`~.session.ServerSession.answer`) and lets what it held go on.

While it waits in its lane the connection is still read (its later requests are
held in the backlog, which stops reading again), so a peer that closes is seen at
once and its request takes nothing (nor keeps a connection slot); once it goes on,
reading stops until it is answered (it may wait for the disk).  So is a connection
whose request waits elsewhere and can be called off (a :class:`~.outcome.Pending`
with ``cancel``: a relay's request held upstream), which is called off when the
peer closes.
"""

from __future__ import annotations

from tensorshare.errors import RemoteError

from .holding import Answering
from .outcome import Pending


class LaterAnswers:
    """The requests of one session answered later (see the module docstring);
    ``session``: the :class:`~.session.ServerSession` whose requests they are."""

    __slots__ = ("session",)

    def __init__(self, session):
        self.session = session

    def answer(self, rid: int, pending: Pending) -> None:
        """Answer request ``rid`` once ``pending`` is done, holding the connection (later
        requests, notifications) until then."""
        answering = Answering(rid, pending)
        session = self.session
        holding = session.holding
        if not session.closed:
            holding.answering = answering
        holding.holds += 1
        self._proceed(answering)

    def drop(self) -> None:
        """The connection is gone: a request waiting in its lane is dropped, unrun, and
        one waiting elsewhere that can be called off is."""
        session = self.session
        holding = session.holding
        answering = holding.answering
        if answering is None:
            return
        if answering.parked is not None:
            answering.closed = True
            session.state.waits.cancel(answering.parked)
            answering.parked = None
            holding.answering = None
        elif answering.pending.cancel is not None:
            answering.closed = True  # (what it waited for, when it ends, goes to nobody)
            holding.answering = None
            answering.pending.cancel()

    def _proceed(self, answering: Answering) -> None:
        """Start what ``answering`` waits for, or park it in its lane first (while it is
        parked the connection is read: see the module docstring)."""
        pending = answering.pending
        if pending.key is None:
            self._start(answering)
            return
        session = self.session
        waits = session.state.waits
        if answering.went:  # it waited in a lane before (a read, then for its bytes): that wait is over
            answering.went = False
            waits.settled(answering.key)
        answering.key = pending.key
        parked = waits.park(pending.key, pending.ready, lambda: self._went(answering),
                            pending.timeout, lambda: self._expired(answering), pending.ordered)
        if parked is not None:  # it waits: others' changes are told meanwhile
            answering.parked = parked
            answering.returned = True
            session.reads.resume("answering")  # (it may have waited for the disk before)
            session.release_notes()

    def _went(self, answering: Answering) -> None:
        """A request waiting in its lane may go on (its lane is told once it is answered)."""
        answering.went = True
        self._left_lane(answering)
        self._start(answering)

    def _expired(self, answering: Answering) -> None:
        self._left_lane(answering)
        self._start(answering, expired=True)

    def _left_lane(self, answering: Answering) -> None:
        if answering.parked is not None:  # it waited: hold notifications again until its reply
            answering.parked = None
            session = self.session
            session.holding.holds += 1
            session.reads.pause("answering")  # (until its reply: it may wait for the disk now)

    def _start(self, answering: Answering, expired: bool = False) -> None:
        pending = answering.pending
        start = pending.expire if expired else pending.start
        try:
            start(lambda *result: self._finished(answering, result))
        except Exception as exc:  # refused (or failed) before anything was started
            self._finished(answering, exc)
            return
        session = self.session
        if session.holding.answering is answering and not answering.returned:
            answering.returned = True
            if pending.cancel is None:  # (else read on: a peer that closes calls it off)
                session.reads.pause("answering")

    def _finished(self, answering: Answering, result) -> None:
        """What ``answering`` waited for is done: carry out its outcome."""
        if answering.closed:
            return
        session = self.session
        try:
            if isinstance(result, BaseException):
                raise result
            outcome = answering.pending.finish(*result)
            if type(outcome) is Pending:  # it waits again (a read that waited, now from the disk)
                answering.pending = outcome
                self._proceed(answering)
                return
            session.answer(answering.rid, outcome)
        except RemoteError as exc:
            session.refuse(answering.rid, exc)
        except Exception:  # a bug: this request fails, the connection and the server go on
            session._failed("a request", answering.rid)
        self._answered(answering)

    def _answered(self, answering: Answering) -> None:
        answering.closed = True
        session = self.session
        holding = session.holding
        if holding.answering is answering:
            holding.answering = None
        if answering.went:  # the requests behind it in its lane are tested with its result
            session.state.waits.settled(answering.key)
        session.release_notes()
        if answering.returned:  # answered later than its handler: what it held goes on
            session.reads.resume("answering")
            session.resume()
