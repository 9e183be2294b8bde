"""Relays and shards across hosts: network namespaces joined by shaped links (1 Gbit/s).

Each host is a network namespace with its own address and link to a switch
(benchmarks/netns.py); servers, relays and clients run in them as processes
(tests/multihost_procs.py).  Skipped where namespaces cannot be made (needs root).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.netns import Network, start_server, start_servers, unavailable

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

PROCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_procs.py")


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    why = unavailable()
    if why:
        pytest.skip(why)


def role(net: Network, host: int, *args) -> subprocess.Popen:
    return net.python(host, [PROCS, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 90) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def ask(proc: subprocess.Popen, command: str) -> dict:
    """One command to a ``commands`` process, and its answer (bounded by the test's timeout)."""
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"the commands process exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def test_a_relay_tree_across_hosts_survives_the_heads_kill_and_restart(tmp_path):
    with Network(4, rate="1gbit") as net:
        head, port = start_server(net, 0, "--data-dir", str(tmp_path / "data"))
        a = net.addresses
        follow = ("--follow", f"{a[0]}:{port}", "--follow-timeout", "10")
        (_, r1), (_, r2) = start_servers(net, [(1, follow), (2, follow)])
        _, r3 = start_server(net, 3, "--follow", f"{a[1]}:{r1}", "--follow-timeout", "10")  # a relay's relay
        floats = 1 << 18  # a 1 MiB state dict
        # One client in host 0 publishes every version (it reconnects across the head's
        # restart) and reads the tags at the end; all the processes start side by side.
        host0 = net.python(0, [PROCS, "commands", a[0], str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        readers = [role(net, h, "read", a[h], p, "params", 19, 120) for h, p in ((1, r1), (2, r2), (3, r3))]
        writer = role(net, 2, "append", a[2], r2, "rollouts", 0, 100, 0.02)
        ask(host0, f"publish params 0 0 {floats} 0")
        for reader in readers:  # each has version 0 before the next versions go out
            line = reader.stdout.readline()
            assert line and json.loads(line) == {"first": 0.0}, line
        ask(host0, f"publish params 1 9 {floats} 0.05")
        head.send_signal(signal.SIGKILL)  # kill -9 the head
        head.wait(10)
        time.sleep(0.3)
        start_server(net, 0, "--data-dir", str(tmp_path / "data"), port=port)
        ask(host0, f"publish params 10 19 {floats} 0.05")
        for reader in readers:
            seen = result(reader)
            assert not seen["problems"], seen["problems"][:5]
            assert seen["seen"][-1] == 19.0 and len(seen["seen"]) >= 3
        wrote = result(writer)
        stored = ask(host0, "tags rollouts")["tags"]
        assert len(stored) == len(set(stored)), "a forwarded write was stored twice"
        assert set(wrote["acked"]) <= set(stored), sorted(set(wrote["acked"]) - set(stored))
        assert stored == sorted(stored) and set(stored) <= set(wrote["acked"]) | set(wrote["uncertain"])
        assert len(wrote["acked"]) == 100  # (how many fell in the outage, uncertain, depends on the load)


SHARDED = """
import json, sys, torch, tensorshare
addresses = sys.argv[1:]
with tensorshare.ShardedClient(addresses, timeout=20) as c:
    for i in range(20):
        c.put(f"b{i}", torch.full((1 << 18,), float(i)), tag=i)
    homes = {f"b{i}": c.server_for(f"b{i}") for i in range(20)}
    ok = all(float(c.peek(f"b{i}")[0][-1]) == i for i in range(20))
    print(json.dumps({"homes": homes, "ok": ok, "listing": c.list()}))
"""


def test_sharded_bins_across_hosts():
    with Network(3, rate="1gbit") as net:
        ports = [start_server(net, h)[1] for h in (0, 1)]
        addresses = [f"{net.addresses[h]}:{p}" for h, p in zip((0, 1), ports)]
        proc = net.python(2, ["-c", SHARDED, *addresses], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = result(proc)
        assert got["ok"] and got["listing"] == {f"b{i}": 1 for i in range(20)}
        assert set(got["homes"].values()) == set(addresses)
