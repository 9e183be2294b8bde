"""Python bytecodes a small request costs the server, per function (``python -m benchmarks.request_bytecodes``).

The server (tensorshare-server with busy polling off, or the floor:
:mod:`benchmarks.floor_server`) runs with a tracer that counts every bytecode it
executes (``sys.settrace`` with ``f_trace_opcodes``) while one real ``Client``
sends it a fixed number of mixed 1 KiB put/append/get requests, one at a time
(the load of :mod:`benchmarks.request_cost`).  The tracer counts only between two
signals, after a warm-up, so start-up is left out.  Bytecodes and Python calls
per request, per function and per file, are exact and do not move with the
machine's load: where :mod:`benchmarks.request_cost` says how many instructions a
request costs, this says which Python they come from.  (The tracer slows the
server a hundredfold: the counts, not the time, are the measurement.)

    python -m benchmarks.request_bytecodes [--server ts|floor] [--count 600] [--top 40] [--lines 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from .request_cost import _LISTENING, _drive


# Run in the server's process: the server, with a tracer that SIGUSR1 starts and, the
# second time, stops, writing its counts to the file named by the environment.
_TRACED = """
import collections, json, os, signal, sys
counts, calls, lines, on = collections.Counter(), collections.Counter(), collections.Counter(), []

def tracer(frame, event, arg):
    code = frame.f_code
    where = (code.co_filename, code.co_firstlineno, code.co_name)
    if event == "call":
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        calls[where] += 1
    elif event == "opcode":
        counts[where] += 1
        lines[code.co_filename, frame.f_lineno] += 1
    return tracer

def toggle(signum, frame):
    if not on:
        on.append(True)
        sys.settrace(tracer)
        return
    sys.settrace(None)
    with open(os.environ["TS_BYTECODES_OUT"], "w") as out:
        json.dump({"ops": [[*k, v] for k, v in counts.items()], "calls": [[*k, v] for k, v in calls.items()],
                   "lines": [[*k, v] for k, v in lines.items()]}, out)

signal.signal(signal.SIGUSR1, toggle)
"""
_SERVERS = {
    "ts": _TRACED + ("from tensorshare_server.config import ServerConfig\n"
                     "ServerConfig.tick_interval = property(lambda self: 3600.0)\n"
                     "from tensorshare_server.cli import main\n"
                     "main(['--host', '127.0.0.1', '--port', '0', '--busy-poll', '0'])\n"),
    "floor": _TRACED + "sys.argv = ['floor']\nfrom benchmarks.floor_server import main\nmain()\n",
}


def counts(server: str, count: int, size: int = 1024) -> tuple[dict, dict, dict]:
    """``(bytecodes, calls)`` per function ``(file, line, name)``, and bytecodes per
    source line ``(file, line)``, over ``count`` mixed requests after a warm-up
    (:func:`benchmarks.request_cost._drive`'s)."""

    def mark() -> None:  # the tracer starts, and then stops and writes its counts
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)

    with tempfile.TemporaryDirectory(prefix="request-bytecodes-") as tmp:
        out = os.path.join(tmp, "counts.json")
        env = {**os.environ, "TS_BYTECODES_OUT": out, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen([sys.executable, "-c", _SERVERS[server]], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            match = _LISTENING.search(proc.stdout.readline())
            if not match:
                raise RuntimeError("the server did not start")
            _drive(int(match.group(2)), count, size, mark)
            for _ in range(600):
                if os.path.exists(out) and os.path.getsize(out):
                    break
                time.sleep(0.1)
            time.sleep(0.5)  # (the file is complete once the server has closed it)
            with open(out) as f:
                found = json.load(f)
        finally:
            proc.kill()
            proc.wait()
    return ({tuple(k): v for *k, v in found["ops"]}, {tuple(k): v for *k, v in found["calls"]},
            {tuple(k): v for *k, v in found["lines"]})


def _short(path: str) -> str:
    path = path.split("site-packages/")[-1]
    return os.path.relpath(path) if path.startswith(os.getcwd()) else path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=sorted(_SERVERS), default="ts")
    parser.add_argument("--count", type=int, default=600, help="requests counted (a multiple of 3)")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    parser.add_argument("--lines", type=int, default=0, help="also list this many source lines, costliest first")
    args = parser.parse_args(argv)
    ops, calls, lines = counts(args.server, args.count)
    n = args.count
    print(f"{args.server}: {sum(ops.values()) / n:,.0f} bytecodes and {sum(calls.values()) / n:.1f} Python calls "
          f"per mixed 1 KiB request ({n} requests)")
    by_file: collections.Counter = collections.Counter()
    for (path, _, _), v in ops.items():
        by_file[_short(path)] += v
    print("\nper file (bytecodes per request):")
    for path, v in by_file.most_common(20):
        print(f"  {v / n:8.1f}  {path}")
    print("\nper function (bytecodes, calls per request):")
    for where, v in sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]:
        path, line, name = where
        print(f"  {v / n:8.1f} {calls.get(where, 0) / n:6.2f}  {_short(path)}:{line} {name}")
    if args.lines:
        print("\nper source line (bytecodes per request):")
        for (path, line), v in sorted(lines.items(), key=lambda kv: -kv[1])[: args.lines]:
            print(f"  {v / n:8.1f}  {_short(path)}:{line}")


if __name__ == "__main__":
    main()
