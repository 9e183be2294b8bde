"""The benchmark's measuring tools that are not sections: they run against real servers."""

from benchmarks import request_bytecodes


def test_request_bytecodes_counts_the_server_and_the_floor_per_request():
    n = 30
    for server, where in (("ts", ("session.py", "_serve")), ("floor", ("floor_server.py", "_answer"))):
        ops, calls, lines = request_bytecodes.counts(server, n)
        handled = sum(v for (path, _, name), v in calls.items() if (path.rsplit("/", 1)[-1], name) == where)
        assert handled == n, (server, handled)  # every counted request, and only those (no warm-up)
        assert sum(ops.values()) > 100 * n
        assert sum(lines.values()) == sum(ops.values())  # every bytecode on a line of its function
