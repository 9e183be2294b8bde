"""Processes the multi-host tests run inside network namespaces (test_multihost.py).

``python tests/multihost_procs.py ROLE HOST PORT ARGS...``; each prints one JSON
line with what it saw and exits.  Roles: publish (versions of a state dict whose
every element is its version), read (listens, peeks every announced version and
checks it is whole), append (numbered items, one request each, never retried),
tags (the tags of a bin's items).
"""

from __future__ import annotations

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
        if version >= until:
            break
        time.sleep(0.005)
    return {"seen": seen, "problems": problems}


def append(client, bin: str, first: int, count: int, pause: float) -> dict:
    acked, uncertain = [], []
    for i in range(first, first + count):
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
        if role == "publish":
            result = publish(client, args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]))
        elif role == "read":
            result = read(client, args[0], int(args[1]), float(args[2]))
        elif role == "append":
            result = append(client, args[0], int(args[1]), int(args[2]), float(args[3]))
        elif role == "tags":
            result = tags(client, args[0])
        else:
            raise SystemExit(f"unknown role {role!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
