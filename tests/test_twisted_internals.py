"""The Twisted internals the server relies on (server/net/twisted_internals.py) are
there in the installed Twisted: this fails loudly on a Twisted that changed them."""

from __future__ import annotations

import socket

import twisted
from twisted.internet import protocol
from twisted.internet.testing import MemoryReactor

from tensorshare_server.net import twisted_internals


def test_every_internal_the_server_uses_exists_on_a_real_connection():
    assert twisted_internals.check() == [], f"Twisted {twisted.__version__} lacks what the server uses"
    assert twisted_internals.COMPATIBLE
    a, b = socket.socketpair()
    # A reactor that never runs: nothing writes Twisted's buffer out behind the test's back.
    transport = twisted_internals.ReceivingServer(a, protocol.Protocol(), ("127.0.0.1", 1), None, 0,
                                                  MemoryReactor())
    try:
        assert twisted_internals.check(transport) == []
        assert twisted_internals.direct_socket(transport) is a
        assert twisted_internals.transport_idle(transport)
        transport.write(b"x" * 10)  # buffered by Twisted until the reactor writes it
        assert not twisted_internals.transport_idle(transport)
        buffered, _kernel = twisted_internals.unsent(transport)
        assert buffered == 10
        twisted_internals.set_send_limit(transport, 1 << 20)
        twisted_internals.set_read_size(transport, 1 << 20)
        assert (transport.SEND_LIMIT, transport.bufferSize) == (1 << 20, 1 << 20)
    finally:
        transport.stopReading()
        transport.stopWriting()
        a.close()
        b.close()


def test_other_transports_never_get_the_direct_path():
    from twisted.internet.testing import StringTransport

    assert twisted_internals.direct_socket(StringTransport()) is None


def test_the_servers_main_loop_runs_every_call_at_its_turn_and_sleeps_between():
    """The main loop that skips Twisted's timer bookkeeping when nothing is due still
    runs due, new and threads' calls and the shutdown, drops cancelled ones, and
    waits for I/O until the next call is due (a few turns, not a spin)."""
    import threading

    from twisted.internet.epollreactor import EPollReactor

    target = EPollReactor()  # (its own, never installed: the tests' reactor is left alone)
    assert twisted_internals.dispatch_directly(target)
    seen, turns = [], []
    iteration = target.doIteration

    def counted(timeout):
        turns.append(timeout)
        iteration(timeout)

    target.doIteration = counted
    target.callLater(0.2, seen.append, "later")
    target.callLater(0, seen.append, "now")
    target.callLater(0.05, seen.append, "cancelled").cancel()
    target.callLater(0.1, lambda: target.callLater(0.05, seen.append, "nested"))
    target.callLater(0.02, lambda: 1 / 0)  # logged by Twisted; the loop goes on
    target.callWhenRunning(lambda: threading.Thread(target=target.callFromThread,
                                                    args=(seen.append, "thread")).start())
    target.callLater(0.3, target.stop)
    target.addSystemEventTrigger("after", "shutdown", seen.append, "shutdown")
    try:
        target.run(installSignalHandlers=False)
    finally:
        target._poller.close()
    assert sorted(seen[:3]) == ["nested", "now", "thread"] and seen.index("now") < seen.index("nested")
    assert seen[3:] == ["later", "shutdown"]  # (nothing of the cancelled call)
    assert len(turns) < 30, f"{len(turns)} turns in 0.3 s: the loop spins"
    assert all(t is None or 0 <= t <= 0.3 for t in turns)
