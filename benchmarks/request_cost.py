"""Instructions a small request costs the server or the client, counted by callgrind (``python -m benchmarks.request_cost``).

``--side server`` (the default): the server (tensorshare-server with busy polling off, or the floor:
:mod:`benchmarks.floor_server`) runs under ``valgrind --tool=callgrind`` while one
real ``Client`` sends it a fixed number of mixed 1 KiB put/append/get requests,
one at a time (the floor section's load).  Callgrind counts only between two marks
(``callgrind_control -i on|off``, after a warm-up and after the counted requests):
the total over the count is what one request costs the server in user space,
repeatable to about 0.2%.  Instruction counts do not move with the machine's load
(CPU time per request moves by several per cent on a shared machine), so a step of
a change can be measured alone: run it on the tree before and after.

``--side client``: the client process runs under callgrind instead, against a
normal server, the same load through the same client code as the benchmark's
mixed workers (:func:`benchmarks.workers.mixed_ops`); then redis-py does the same
against a private redis-server, so the ratio to redis-py comes from one run.

    python -m benchmarks.request_cost [--side server|client] [--server ts|floor] [--counts 300,2400] [--size 1024]

(``--side server`` counts the second of ``--counts`` requests.)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

_LISTENING = re.compile(rb"listening on ([^\s:]+|\[[^\]]+\]):(\d+)")
_COLLECTED = re.compile(r"Collected : (\d+)")
# The server's time limits are checked on a clock (every 0.25 s): under valgrind, where a
# run takes minutes, that would count as per-request work by how long the run took.
_QUIET_CLOCK = ("import sys; from tensorshare_server.config import ServerConfig; "
                "ServerConfig.tick_interval = property(lambda self: 3600.0); "
                "from tensorshare_server.cli import main; sys.exit(main(sys.argv[1:]))")
_SERVERS = {"ts": ("-c", _QUIET_CLOCK, "--host", "127.0.0.1", "--port", "0", "--busy-poll", "0"),
            "floor": ("-m", "benchmarks.floor_server")}
_WARMUP = 150  # requests before the counted ones (caches, the first put of the bin)


def _drive(port: int, count: int, size: int, mark: Callable[[], None] | None = None) -> None:
    """``_WARMUP + count`` mixed requests (put, append, get in turn) through a real Client;
    ``mark()`` (if given) after the warm-up and again after the counted requests."""
    import torch

    from tensorshare import Client

    value = torch.ones(size // 4)
    with Client("127.0.0.1", port, timeout=600) as client:
        ops = (lambda: client.put("cost", value), lambda: client.append("cost", value), lambda: client.get("cost"))
        for i in range(_WARMUP + count):
            if i == _WARMUP and mark is not None:
                mark()
            ops[i % 3]()
        if mark is not None:
            mark()


def _callgrind(tmp: str, args: list, *options: str) -> list:
    return ["valgrind", "--tool=callgrind", *options, f"--callgrind-out-file={tmp}/out", sys.executable, *args]


def _collected(err) -> int:
    err.seek(0)
    found = _COLLECTED.findall(err.read())
    if not found:
        raise RuntimeError("callgrind reported no total")
    return int(found[-1])


def instructions(server: str, count: int, size: int) -> int:
    """The server's instructions over ``count`` requests, after a warm-up."""
    with tempfile.TemporaryDirectory(prefix="request-cost-") as tmp:
        cmd = _callgrind(tmp, list(_SERVERS[server]), "--instr-atstart=no")
        with open(os.path.join(tmp, "err"), "w+") as err:
            env = {**os.environ, "PYTHONHASHSEED": "0"}  # (the same dicts and sets, run after run)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
            marks = iter(("on", "off"))

            def mark() -> None:  # counting starts, then stops (valgrind runs as the same process)
                subprocess.run(["callgrind_control", "-i", next(marks), str(proc.pid)], stdout=subprocess.DEVNULL,
                               check=True, timeout=120)

            try:
                line = proc.stdout.readline()
                match = _LISTENING.search(line)
                if not match:
                    raise RuntimeError(f"the server did not start: {line!r}")
                _drive(int(match.group(2)), count, size, mark)
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=300)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            return _collected(err)


def client_instructions(peer: str, port: int, count: int, size: int) -> int:
    """The instructions of a client process of ``peer`` (``ts`` or ``redis``), start to
    end, around ``count`` mixed requests (and the warm-up) to the server at ``port``."""
    with tempfile.TemporaryDirectory(prefix="request-cost-") as tmp:
        cmd = _callgrind(tmp, ["-m", "benchmarks.request_cost", "--drive", peer, str(port), str(count), str(size)])
        with open(os.path.join(tmp, "err"), "w+") as err:
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env,
                           timeout=1800, check=True)
            return _collected(err)


def _drive_client(peer: str, port: int, count: int, size: int) -> None:
    """The client process of ``--side client``: ``_WARMUP + count`` mixed requests."""
    from .workers import mixed_ops

    ops = [fn for fn, _nbytes in mixed_ops(peer, port, size, "cost")]
    for i in range(_WARMUP + count):
        ops[i % 3]()


def client_side(low: int, high: int, size: int) -> dict[str, float]:
    """Client instructions per request of tensorshare's ``Client`` and of redis-py, each
    against its own server (not under valgrind), measured in this one run."""
    from .procs import RedisServer, Server

    per = {}
    with Server("--busy-poll", "0") as server:
        a, b = client_instructions("ts", server.port, low, size), client_instructions("ts", server.port, high, size)
        per["ts"] = (b - a) / (high - low)
    with RedisServer() as redis:
        a, b = (client_instructions("redis", redis.port, low, size),
                client_instructions("redis", redis.port, high, size))
        per["redis"] = (b - a) / (high - low)
    return per


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--drive"]:  # (the client process under callgrind)
        peer, port, count, size = argv[1:5]
        _drive_client(peer, int(port), int(count), int(size))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["server", "client"], default="server")
    parser.add_argument("--server", choices=sorted(_SERVERS), default="ts")
    parser.add_argument("--counts", default="300,2400", help="the two request counts (multiples of 3)")
    parser.add_argument("--size", type=int, default=1024, help="bytes of each value")
    args = parser.parse_args(argv)
    low, high = (int(n) for n in args.counts.split(","))
    began = time.monotonic()
    if args.side == "client":
        per = client_side(low, high, args.size)
        print(f"client instructions per request ({args.size} B mixed put/append/get; counts {low}, {high}): "
              f"tensorshare {per['ts']:,.0f}, redis-py {per['redis']:,.0f}, ratio {per['ts'] / per['redis']:.3f}x "
              f"({time.monotonic() - began:.0f}s)")
        return
    total = instructions(args.server, high, args.size)
    print(f"{args.server}: {total / high:,.0f} instructions per request "
          f"({args.size} B mixed put/append/get; {high} counted: {total:,}; {time.monotonic() - began:.0f}s)")


if __name__ == "__main__":
    main()
