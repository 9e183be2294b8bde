"""The Deferred client, driven by a real reactor in a child process (one reactor per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from twisted.internet import defer, task
    from tensorshare import AsyncClient, NoSuchBinError

    @defer.inlineCallbacks
    def main(reactor, port):
        client = yield AsyncClient.connect("127.0.0.1", int(port), reactor=reactor)
        seen = []
        handle = yield client.listen("a-bin", seen.append)
        assert handle.snapshot.n_items == 0, handle.snapshot
        # Pipelined: many requests in flight at once on one connection.
        counts = yield defer.gatherResults([client.append("a-bin", torch.full((3,), float(i))) for i in range(200)])
        assert sorted(counts) == list(range(1, 201)), counts
        items = yield client.peek("a-bin")
        assert [int(t[0]) for t in items] == list(range(200))
        yield client.put("a-bin", {"x": torch.arange(4)})
        [item] = yield client.get("a-bin")
        assert torch.equal(item["x"], torch.arange(4))
        bins = yield client.list()
        assert bins["a-bin"] == 0
        try:
            yield client.peek("a-missing")
        except NoSuchBinError:
            pass
        else:
            raise AssertionError("no error for a missing bin")
        yield client.unlisten("a-bin")
        yield client.delete("a-bin")
        ops = [n.op for n in seen]
        assert ops == ["APPEND"] * 200 + ["PUT", "GET"], ops[-5:]
        client.close()
        print("async ok")

    task.react(main, sys.argv[1:])
""")


def test_async_client_end_to_end(server):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(server.port)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "async ok" in result.stdout


SILENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from twisted.internet import defer, task
    from tensorshare import AsyncClient, TimeoutError

    @defer.inlineCallbacks
    def main(reactor, port):
        client = yield AsyncClient.connect("127.0.0.1", int(port), reactor=reactor, timeout=0.3)
        start = time.monotonic()
        results = yield defer.DeferredList([client.ping() for _ in range(3)], consumeErrors=True)
        elapsed = time.monotonic() - start
        assert all(not ok and r.check(TimeoutError) for ok, r in results), results
        assert 0.25 < elapsed < 3, elapsed
        client.close()
        print("timeouts ok")

    task.react(main, sys.argv[1:])
""")


def test_async_client_times_out_a_silent_server():
    """A server that greets and then never answers: every pending call fails in time."""
    from serverproc import FakeServer

    with FakeServer() as fake:
        result = subprocess.run([sys.executable, "-c", SILENT_SCRIPT, str(fake.port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "timeouts ok" in result.stdout
