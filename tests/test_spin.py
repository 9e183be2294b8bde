"""Polling before sleeping: the client's ReplySpin and the server's BusyPoll."""

from __future__ import annotations

import pytest
import torch

import tensorshare_server.net.busypoll as busypoll
from tensorshare._client.spin import ReplySpin
import tensorshare.protocol.pacing as pacing
from tensorshare.protocol.pacing import BACKOFF, CROWDED, FIRST_PAUSE, LOOK, Contention
from tensorshare_server import ServerConfig
from tensorshare_server.net.busypoll import BusyPoll


_REAL_RUN_DELAY = pacing.thread_run_delay


class FakeClock:
    """A clock that moves only when told (``step`` per reading, if set)."""

    def __init__(self, step: float = 0.0):
        self.now = 100.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class FakeRunDelay:
    """What :func:`~tensorshare.protocol.pacing.thread_run_delay` reports: ``waited``
    nanoseconds for a CPU, on thread ``thread``."""

    def __init__(self):
        self.thread, self.waited = 1, 0
        self.per_read = 0  # nanoseconds more at each reading (a thread that keeps waiting for a CPU)

    def __call__(self) -> tuple:
        self.waited += self.per_read
        return self.thread, self.waited


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch) -> FakeRunDelay:
    """Pollers made in a test see a host whose CPUs nobody else wants (unless the
    test says otherwise): the machine running the tests is no part of them."""
    run_delay = FakeRunDelay()
    monkeypatch.setattr(pacing, "thread_run_delay", run_delay)
    return run_delay


def test_the_run_delay_of_this_thread_is_read_where_linux_keeps_it():
    import threading

    thread, waited = _REAL_RUN_DELAY()  # (Linux: /proc/thread-self/schedstat)
    assert thread == threading.get_ident() and waited >= 0
    seen: list = []
    other = threading.Thread(target=lambda: seen.append(_REAL_RUN_DELAY()))
    other.start()
    other.join()
    assert seen[0][0] != thread


def test_a_thread_asleep_on_a_lock_is_not_counted_as_waiting_for_a_cpu():
    # What Contention.check relies on to tell a lost CPU from a wait for the GIL: a
    # thread asleep on a lock is not runnable, so its run delay does not grow.
    import threading

    lock = threading.Lock()
    lock.acquire()
    threading.Timer(0.2, lock.release).start()
    before = _REAL_RUN_DELAY()
    lock.acquire()
    after = _REAL_RUN_DELAY()
    assert (after[1] - before[1]) * 1e-9 < 0.1  # of the 0.2 s it waited (some of it, runnable, for a CPU)


def test_contention_finds_a_crowded_host_by_how_long_the_poller_waited_for_a_cpu(quiet_host):
    c = Contention(lost=0.0002, backoff=0.5)
    assert c.calm(10.0)  # a first look: nothing to compare yet
    quiet_host.waited += int(0.05 * CROWDED * LOOK * 1e9)
    assert c.calm(10.0 + LOOK / 2) and c.calm(10.0 + LOOK)  # a quiet host: it hardly waited
    quiet_host.waited += int(2 * CROWDED * LOOK * 1e9)  # then waited for a CPU a fifth of the time
    assert c.calm(10.0 + 1.5 * LOOK)  # (not looked at again yet)
    assert not c.calm(10.0 + 2 * LOOK) and c.times == 1  # the next look: polling pauses
    assert not c.calm(10.0 + 2 * LOOK + FIRST_PAUSE * 0.9)
    assert c.calm(10.0 + 2 * LOOK + FIRST_PAUSE * 1.1)  # the pause over, a look at the time it lasted: quiet again
    quiet_host.waited += int(0.6 * 1e9)
    quiet_host.thread = 2  # another thread's figure: nothing to compare
    assert c.calm(11.0)
    quiet_host.waited += int(0.6 * 1e9)
    assert not c.calm(12.0) and c.times == 2  # that thread waited most of the second
    broken = Contention(run_delay=lambda: None)  # not known (not Linux): only the first sign
    assert broken.calm(1.0) and broken.calm(2.0)


# -------------------------------------------------------------- ReplySpin


def test_reply_spin_polls_until_the_reply_is_there():
    clock = FakeClock(step=10e-6)
    checks = iter([False, False, False, True])
    s = ReplySpin(0.001, cpus=2)
    assert s.poll(lambda: next(checks), clock=clock) is None  # ready while polling: no sleep
    assert next(checks, "done") == "done"  # it stopped checking at the first True
    assert 0 < s.estimate < 0.001


def test_reply_spin_gives_up_at_its_limit_and_learns_from_the_sleep():
    clock = FakeClock(step=50e-6)
    s = ReplySpin(0.0005, cpus=2)
    calls = []
    start = s.poll(lambda: calls.append(1), clock=clock)  # never ready
    assert start is not None
    assert 9 <= len(calls) <= 12  # about limit / step checks, then it goes to sleep
    calls.clear()
    assert s.poll(lambda: calls.append(1), within=0.0001, clock=clock) is not None
    assert 1 <= len(calls) <= 3  # the caller's deadline comes first
    assert s.poll(lambda: calls.append(1), within=-1, clock=clock) is not None
    assert len(calls) <= 3  # past the deadline: straight to the wait, which raises
    clock.step = 0
    clock.now = start + 0.010  # the reply came 10 ms later
    s.waited(start, clock)
    assert s.estimate == pytest.approx(0.010 / 8)


def test_reply_spin_stops_polling_while_replies_are_slow_and_resumes_when_quick():
    clock = FakeClock(step=0.0001)
    s = ReplySpin(0.0005, cpus=2)
    for _ in range(20):  # replies take 5 ms: polling would only burn CPU
        start = s.poll(lambda: False, clock=clock)
        clock.now += 0.005
        s.waited(start, clock)
    assert not s.active
    calls = []
    start = s.poll(lambda: calls.append(1), clock=clock)
    assert calls == [] and start is not None  # straight to sleep
    for _ in range(40):  # replies are quick again (seen through sleeping waits)
        start = s.poll(lambda: False, clock=clock)
        if start is None:
            break
        clock.now += 0.0001
        s.waited(start, clock)
    assert s.active


def test_reply_spin_is_off_with_a_zero_limit_or_a_single_cpu():
    for s in (ReplySpin(0, cpus=8), ReplySpin(0.001, cpus=1)):
        assert not s.active
        calls = []
        assert s.poll(lambda: calls.append(1) or True) is not None
        assert calls == []
    with pytest.raises(ValueError):
        ReplySpin(-1)


def test_client_polls_for_its_replies_and_can_be_told_not_to(server, monkeypatch):
    import tensorshare

    with tensorshare.Client("127.0.0.1", server.port, timeout=10, spin=0.002) as c:
        c.router.home.spin = ReplySpin(0.002, cpus=2)  # whatever this machine has
        polled = []
        real = c.router.home.spin.poll
        monkeypatch.setattr(c.router.home.spin, "poll", lambda *args: polled.append(1) or real(*args))
        c.put("spin", torch.arange(4))
        assert torch.equal(c.peek("spin")[0], torch.arange(4))
        assert polled and c.router.home.spin.estimate > 0
    with tensorshare.Client("127.0.0.1", server.port, timeout=10, spin=0) as c:
        assert not c.router.home.spin.active
        assert torch.equal(c.get("spin")[0], torch.arange(4))


def test_reply_spin_stops_polling_for_a_while_once_it_loses_the_cpu(quiet_host):
    clock = FakeClock(step=10e-6)
    s = ReplySpin(0.005, cpus=2)
    assert s.poll(iter([False, True]).__next__, clock=clock) is None  # a quiet CPU: polls
    clock.step = 0.001  # each yield now comes back 1 ms later: another task had the CPU,
    quiet_host.waited += 1_000_000  # and this thread waited for it, runnable
    calls = []
    assert s.poll(lambda: calls.append(1), clock=clock) is not None
    assert len(calls) == 1 and s.contention.times == 1  # one check, then straight to sleep
    clock.step = 10e-6
    calls.clear()
    assert s.poll(lambda: calls.append(1), clock=clock) is not None
    assert calls == []  # backing off: not even one check
    clock.now += BACKOFF
    assert s.poll(iter([False, True]).__next__, clock=clock) is None  # polls again afterwards


def test_reply_spin_sleeps_on_a_crowded_host_and_polls_again_once_it_is_quiet(quiet_host):
    clock = FakeClock(step=10e-6)  # every yield comes straight back: the first sign stays away
    s = ReplySpin(0.005, cpus=2)
    assert s.poll(iter([False, True]).__next__, clock=clock) is None  # a first look: polls
    clock.now += LOOK
    quiet_host.waited += int(LOOK / 2 * 1e9)  # this thread waited for a CPU half the time
    calls = []
    assert s.poll(lambda: calls.append(1), clock=clock) is not None
    assert calls == [] and s.contention.times == 1  # straight to sleep
    clock.now += BACKOFF
    assert s.poll(iter([False, True]).__next__, clock=clock) is None  # quiet since: polls again


def test_contention_is_a_check_and_yield_that_lost_the_cpu(quiet_host):
    c = Contention(lost=0.0002, backoff=0.5)
    assert c.calm(0.0)
    assert not c.check(1.0, 1.0001)  # a yield that came straight back
    quiet_host.waited += 600_000  # the thread waited 0.6 ms for a CPU: most of the next check
    assert c.check(2.0, 2.001) and c.times == 1
    assert not c.calm(2.001 + FIRST_PAUSE * 0.9) and c.calm(2.001 + FIRST_PAUSE * 1.1)


def test_polling_pauses_briefly_for_one_lost_cpu_and_for_longer_while_it_keeps_losing_it(quiet_host):
    quiet_host.per_read = 1_000_000  # every slow check waited for a CPU
    c = Contention(lost=0.0002, backoff=0.5, first=0.02)
    assert c.calm(0.0)
    pauses = []
    now = 1.0
    for _ in range(7):  # each check after a pause loses the CPU again at once: a crowded host
        assert c.check(now, now + 0.001)
        pauses.append(round(c.pause, 3))
        now = c.until
    assert pauses == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]  # up to the longest pause, and there it stays
    now += 0.6  # more than the longest pause with no loss: the next loss is a first one again
    assert c.check(now, now + 0.001) and c.pause == 0.02
    now = c.until + 0.3  # (a loss within the longest pause of the last one's end: twice as long)
    assert c.check(now, now + 0.001) and c.pause == 0.04 and c.times == 9


def test_a_slow_check_spent_blocked_on_the_gil_is_no_lost_cpu(quiet_host):
    # Another thread of the process held the GIL: the check took 5 ms, and the thread
    # waited for no CPU meanwhile (it was asleep on the lock, not runnable).
    c = Contention(lost=0.0002, backoff=0.5)
    assert c.calm(0.0)
    assert not c.check(0.01, 0.015) and c.times == 0 and c.calm(0.016)
    quiet_host.waited += 2_000_000  # waited 2 ms of the next 5 for a CPU: under half, not lost
    assert not c.check(0.02, 0.025) and c.times == 0
    quiet_host.waited += 1_000_000  # 3 ms of 5 since the look: lost
    assert c.check(0.03, 0.035) and c.times == 1 and not c.calm(0.04)
    # where the wait is not known, a slow check counts as lost, as it always did
    assert Contention(run_delay=lambda: None).check(1.0, 1.001)
    first = Contention()
    assert first.check(1.0, 1.001)  # no look yet: nothing to compare
    other = Contention()
    assert other.calm(0.0)
    quiet_host.thread = 2  # the poller's thread changed since its look
    assert other.check(1.0, 1.001)


def test_reply_spin_polls_on_through_checks_blocked_on_the_gil(quiet_host):
    clock = FakeClock(step=10e-6)
    s = ReplySpin(0.005, cpus=2)
    assert s.poll(iter([False, True]).__next__, clock=clock) is None
    clock.step = 0.001  # each check comes back 1 ms later, the thread having waited for no CPU
    checks = iter([False, False, False, True])
    assert s.poll(lambda: next(checks), clock=clock) is None  # still polling when the reply comes
    assert s.contention.times == 0


# -------------------------------------------------------------- BusyPoll


class FakeReactor:
    """Records doIteration calls; ``on_poll`` runs on each zero-timeout one (what
    the reactor would handle then)."""

    def __init__(self):
        self.threadCallQueue: list = []
        self.calls: list = []
        self.on_poll = None

    def doIteration(self, timeout):
        self.calls.append(timeout)
        if timeout == 0 and self.on_poll is not None:
            self.on_poll()


def _busy(bp: BusyPoll, clock: FakeClock, n: int = 30) -> None:
    """Requests 100 us apart, as from a client in a loop."""
    for _ in range(n):
        clock.now += 0.0001
        bp.note_request()


def test_busy_poll_sleeps_at_once_when_no_request_came_lately():
    clock = FakeClock()
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.0005, clock)
    bp.do_iteration(2.0)
    assert reactor.calls == [2.0]
    _busy(bp, clock)
    clock.now += 0.001  # the window has passed
    bp.do_iteration(None)
    assert reactor.calls == [2.0, None]


def test_busy_poll_polls_through_the_window_then_sleeps_for_the_rest_of_the_timeout():
    clock = FakeClock(step=0.0001)
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.0005, clock)
    _busy(bp, clock)
    bp.do_iteration(1.0)
    polls = reactor.calls[:-1]
    assert polls and set(polls) == {0} and 3 <= len(polls) <= 6
    assert 1.0 - 0.001 <= reactor.calls[-1] < 1.0  # then sleeps, minus the time spent polling
    reactor.calls.clear()
    bp.note_request()
    bp.do_iteration(None)  # no timed call: sleeps without a limit after polling
    assert reactor.calls[-1] is None and set(reactor.calls[:-1]) == {0}


def test_busy_poll_returns_to_the_reactor_when_a_request_or_thread_work_arrives():
    clock = FakeClock(step=0.00001)
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.0005, clock)
    _busy(bp, clock)
    reactor.on_poll = lambda: len(reactor.calls) == 3 and bp.note_request()
    bp.do_iteration(None)
    assert reactor.calls == [0, 0, 0]  # the third poll read a request: no sleep
    reactor.calls.clear()
    reactor.on_poll = lambda: reactor.threadCallQueue.append(print)  # a disk job finished
    bp.do_iteration(None)
    assert reactor.calls == [0]


def test_busy_poll_only_polls_while_requests_come_close_together():
    clock = FakeClock()
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.0005, clock)
    bp.note_request()  # the first request after a pause: no polling yet
    bp.do_iteration(None)
    assert reactor.calls == [None]
    _busy(bp, clock)
    clock.step = 0.0001
    bp.do_iteration(None)
    assert reactor.calls[-1] is None and len(reactor.calls) > 2  # polled, then slept
    clock.step = 0
    for _ in range(20):  # now a request every 2 ms: polling 0.5 ms after each would be wasted
        clock.now += 0.002
        bp.note_request()
    reactor.calls.clear()
    bp.do_iteration(None)
    assert reactor.calls == [None]


def test_busy_poll_polls_for_a_lone_client_only():
    """Requests from several connections at once wake the reactor anyway: polling
    would only take CPU from the clients; one connection alone gets it back."""
    clock = FakeClock(step=0.0001)
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.0005, clock)
    first, second = object(), object()
    for i in range(40):  # two clients in turns, 100 us apart
        clock.now += 0.0001
        bp.note_request(first if i % 2 else second)
    assert not bp.lone
    bp.do_iteration(None)
    assert reactor.calls == [None]  # slept at once
    for _ in range(int(busypoll.LONE / 0.0001) + 5):  # then the first alone, for longer than LONE
        clock.now += 0.0001
        bp.note_request(first)
    assert bp.lone
    reactor.calls.clear()
    bp.do_iteration(None)
    assert reactor.calls[-1] is None and set(reactor.calls[:-1]) == {0} and len(reactor.calls) > 2  # polled


def test_busy_poll_never_polls_past_a_due_timed_call():
    clock = FakeClock(step=0.0001)
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.5, clock)
    _busy(bp, clock)
    bp.do_iteration(0.0003)  # a timed call is due in 0.3 ms
    assert 2 <= len(reactor.calls) - 1 <= 4
    assert reactor.calls[-1] == 0.0  # nothing left to wait


def test_busy_poll_sleeps_once_its_polling_loses_the_cpu_and_polls_again_later(quiet_host):
    clock = FakeClock(step=0.001)  # each poll-and-yield takes 1 ms: another task had the CPU
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.005, clock)
    _busy(bp, clock)
    quiet_host.per_read = 1_000_000  # (and the reactor's thread waited for it, runnable)
    bp.do_iteration(None)
    assert reactor.calls == [0, None] and bp.contention.times == 1  # one poll, then sleeps
    reactor.calls.clear()
    clock.step = 0.00001
    bp.note_request()
    bp.do_iteration(None)
    assert reactor.calls == [None]  # backing off: sleeps at once
    clock.now += BACKOFF
    _busy(bp, clock)
    reactor.calls.clear()
    bp.do_iteration(None)
    assert len(reactor.calls) > 2 and set(reactor.calls[:-1]) == {0}  # a calm CPU again: polls


def test_busy_poll_polls_on_through_polls_blocked_on_the_gil(quiet_host):
    clock = FakeClock(step=0.00001)
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.005, clock)
    _busy(bp, clock)  # (a first look)
    clock.step = 0.001  # each poll-and-yield takes 1 ms: a disk job's thread held the GIL
    bp.do_iteration(None)
    assert len(reactor.calls) > 2 and set(reactor.calls[:-1]) == {0} and bp.contention.times == 0


def test_busy_poll_sleeps_on_a_crowded_host_whose_yields_come_straight_back(quiet_host):
    clock = FakeClock(step=0.00001)  # the scheduler hands the CPU straight back: the first sign stays away
    reactor = FakeReactor()
    bp = BusyPoll(reactor, 0.005, clock)
    _busy(bp, clock)
    bp.do_iteration(None)
    assert len(reactor.calls) > 2 and set(reactor.calls[:-1]) == {0}  # a first look: polls
    clock.now += LOOK
    quiet_host.waited += int(LOOK / 2 * 1e9)  # the reactor thread waited for a CPU half the time
    _busy(bp, clock)
    reactor.calls.clear()
    bp.do_iteration(None)
    assert reactor.calls == [None] and bp.contention.times == 1  # sleeps at once
    clock.now += BACKOFF
    _busy(bp, clock)
    reactor.calls.clear()
    bp.do_iteration(None)
    assert len(reactor.calls) > 2 and set(reactor.calls[:-1]) == {0}  # quiet since: polls again


def test_busy_poll_acquire_and_release_restore_the_reactor(monkeypatch):
    reactor = FakeReactor()
    original = reactor.doIteration
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 2)
    assert busypoll.acquire(reactor, 0) is None
    first = busypoll.acquire(reactor, 0.0005)
    second = busypoll.acquire(reactor, 0.001)
    assert first is second and first.window == 0.001
    assert reactor.doIteration == first.do_iteration
    busypoll.release(first)
    assert reactor.doIteration == first.do_iteration  # one server still uses it
    busypoll.release(second)
    assert reactor.doIteration == original
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 1)
    assert busypoll.acquire(reactor, 0.0005) is None  # polling would starve the client


def test_busy_poll_settings():
    from tensorshare_server.cli import parse_args

    config, _ = parse_args([])
    assert config.busy_poll == busypoll.DEFAULT_WINDOW  # the command serves and does nothing else
    assert ServerConfig().busy_poll == 0  # embedded: off
    config, _ = parse_args(["--busy-poll", "0"])
    assert config.busy_poll == 0
    for bad in (-0.001, 1.0):
        with pytest.raises(ValueError):
            ServerConfig(busy_poll=bad)
