"""Processes the multi-host tests run inside network namespaces (test_multihost.py).

``python tests/multihost_procs.py ROLE HOST PORT ARGS...``; each prints one JSON
line with what it saw and exits.  Roles: read (peeks the bin until it holds a
given version, checks that each version it sees is whole, and says the first one
it sees at once), append (numbered items, one request each, never retried, until a
given number are acknowledged or a minute has passed), and
commands: one client that, for each line on stdin, ``publish BIN FIRST LAST FLOATS
PAUSE`` (versions of a state dict whose every element is its version) or ``tags
BIN`` (the tags of a bin's items), prints one JSON line, until stdin closes (one
process, one import of torch, for every publish of a test).
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch

import tensorshare
from tensorshare.errors import TensorShareError
from tensorshare.protocol.messages import PEEK, Key


def state(version: int, floats: int) -> dict:
    return {f"w{i}": torch.full((floats // 4,), float(version)) for i in range(4)}


def publish(client, bin: str, first: int, last: int, floats: int, pause: float) -> dict:
    for version in range(first, last + 1):
        deadline = time.monotonic() + 30
        while True:
            try:
                client.put(bin, state(version, floats), tag=version)
                break
            except TensorShareError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        time.sleep(pause)
    return {"published": last}


def read(client, bin: str, until: int, limit_s: float) -> dict:
    seen, problems = [], []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            [item] = client.peek(bin)
        except TensorShareError:
            time.sleep(0.01)
            continue
        values = {float(t[0]) for t in item.values()} | {float(t[-1]) for t in item.values()}
        if len(values) != 1:
            problems.append(f"torn {sorted(values)}")
            continue
        version = values.pop()
        if seen and version < seen[-1]:
            problems.append(f"back from {seen[-1]} to {version}")
        if not seen or version != seen[-1]:
            seen.append(version)
            if len(seen) == 1:
                print(json.dumps({"first": version}), flush=True)  # this reader is under way
        if version >= until:
            break
        time.sleep(0.005)
    return {"seen": seen, "problems": problems}


def append(client, bin: str, first: int, count: int, pause: float) -> dict:
    """Append items tagged first, first + 1, ... until ``count`` are acknowledged (a failed one
    is uncertain and the next gets a new tag), so how many fall in an outage does not decide
    how many land; bounded by a minute."""
    acked, uncertain = [], []
    deadline = time.monotonic() + 60
    for i in itertools.count(first):
        if len(acked) == count or time.monotonic() > deadline:
            break
        try:
            client.append(bin, torch.tensor([i]), tag=i)
            acked.append(i)
        except TensorShareError:
            uncertain.append(i)
        time.sleep(pause)
    return {"acked": acked, "uncertain": uncertain}


def tags(client, bin: str) -> dict:
    return {"tags": client._call(PEEK, {Key.BIN: bin, Key.TAGS: True}, then=lambda r: r.header.get(Key.TAGS))}


def main(argv: list[str]) -> None:
    role, host, port, *args = argv
    with tensorshare.Client(host, int(port), timeout=20, max_backoff=0.2) as client:
        if role == "commands":
            for line in sys.stdin:
                command, bin, *more = line.split()
                if command == "publish":
                    answer = publish(client, bin, int(more[0]), int(more[1]), int(more[2]), float(more[3]))
                elif command == "tags":
                    answer = tags(client, bin)
                else:
                    raise SystemExit(f"unknown command {command!r}")
                print(json.dumps(answer), flush=True)
            return
        if role == "read":
            result = read(client, args[0], int(args[1]), float(args[2]))
        elif role == "append":
            result = append(client, args[0], int(args[1]), int(args[2]), float(args[3]))
        else:
            raise SystemExit(f"unknown role {role!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
