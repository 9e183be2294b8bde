"""A server of several workers (``--workers N``): placement, routing, restarts, the data directory.

In memory: the worker map a greeting carries, a worker refusing another's bins
(paired session), the AsyncClient routing over workers paired in memory (and
mapping them again when the server's workers change), merged status snapshots,
and the data directory's worker directories.  With processes: the blocking
client against a real multi-worker server (every verb family routed, LIST
merged, listens, waits and tables per worker, the whole server's metrics), a
killed worker restarted with its durable bins, the data directory's lock and its
bins following the number of workers, and workers ending with their parent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from twisted.internet.task import Clock

import tensorshare
from tensorshare.errors import (
    ConnectionLostError, NoSuchBinError, ProtocolError, ServerUnavailableError, WrongWorkerError,
)
from tensorshare.protocol.messages import LIST, PUT, Key
from tensorshare.protocol.placement import WorkerMap, rendezvous, worker_keys
from tensorshare_server.bins.dirlock import DirLock, DirLockedError
from tensorshare_server.bins.durable import DataDir
from tensorshare_server.config import ServerConfig
from tensorshare_server.ops.merge import merge
from tensorshare_server.ops.status import snapshot
from tensorshare_server.root import build_state
from tensorshare_server.workers.layout import place, worker_dir

from pairing import Pair, PairedWorkers
from serverproc import ServerProcess

WAIT_S = 20.0


def wait_until(condition, timeout: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.02)


def owned_names(workers: WorkerMap, index: int, n: int, prefix: str = "b") -> list[str]:
    """``n`` bin names worker ``index`` owns."""
    names, i = [], 0
    while len(names) < n:
        name = f"{prefix}{i}"
        if workers.owner(name) == index:
            names.append(name)
        i += 1
    return names


# ------------------------------------------------------------------ the map


def test_the_map_spreads_bins_and_a_new_worker_takes_only_its_own():
    names = [f"bin-{i}" for i in range(4000)]
    four = WorkerMap([9001, 9002, 9003, 9004], 0, "x")
    placed = [four.owner(n) for n in names]
    assert all(800 < placed.count(k) < 1200 for k in range(4)), [placed.count(k) for k in range(4)]
    assert placed == [rendezvous(n, worker_keys(4)) for n in names]  # the same function both ends use
    five = WorkerMap([9001, 9002, 9003, 9004, 9005], 0, "x")
    moved = [(a, five.owner(n)) for a, n in zip(placed, names) if five.owner(n) != a]
    assert moved and all(b == 4 for _, b in moved)  # only to the new worker
    assert 0.12 < len(moved) / len(names) < 0.28


@pytest.mark.parametrize("field", [
    "x", {"ports": [], "index": 0, "id": "a"}, {"ports": [1, 70000], "index": 0, "id": "a"},
    {"ports": [1, 2], "index": 2, "id": "a"}, {"ports": [1, 2], "index": 0, "id": ""},
    {"ports": [1, True], "index": 0, "id": "a"}, {"ports": list(range(1, 300)), "index": 0, "id": "a"},
])
def test_a_malformed_worker_map_is_a_protocol_error(field):
    with pytest.raises(ProtocolError):
        WorkerMap.of({Key.WORKERS: field})
    assert WorkerMap.of({}) is None  # a one-process server names none


# ------------------------------------------------------------------ a worker's session, paired in memory


def test_a_worker_refuses_other_workers_bins_and_changes_nothing():
    workers = WorkerMap([9001, 9002], 1, "id")
    state = build_state(ServerConfig())
    state.workers = workers  # (as app.listen makes a worker's)
    pair = Pair(state=state)
    mine, theirs = owned_names(workers, 1, 1)[0], owned_names(workers, 0, 1)[0]
    assert pair.call(PUT, {Key.BIN: mine}, torch.ones(2)).header[Key.N] == 1
    with pytest.raises(WrongWorkerError, match="worker 0 of 2 owns"):
        pair.call(PUT, {Key.BIN: theirs}, torch.ones(2))
    assert pair.call(LIST).header[Key.BINS] == {mine: 1}  # nothing made of the refused one
    again = Pair(state=pair.state)  # the greeting names the workers, and which one this is
    assert WorkerMap.of(again.client.greeting).index == 1
    pair.close()


# ------------------------------------------------------------------ the AsyncClient over workers paired in memory


def _async_client(paired: PairedWorkers):
    return paired.client()


def test_async_client_routes_every_bin_to_its_owner_and_merges_list():
    paired = PairedWorkers(3, Clock())
    client = _async_client(paired)
    assert client.workers == 3 and client.connected
    names = [f"bin-{i}" for i in range(24)]
    heard = []
    listened = paired.run(client.listen(names[5], heard.append))
    for i, name in enumerate(names):
        paired.run(client.put(name, torch.full((2,), float(i))))
        paired.run(client.append(name, torch.ones(1)))
    for k, state in enumerate(paired.states):  # each bin is on its owner, and only there
        assert set(state.store.listing()) == {n for n in names if paired.workers.owner(n) == k}
    assert paired.run(client.list()) == {name: 2 for name in names}
    assert paired.run(client.list("bin-1*")) == {name: 2 for name in names if name.startswith("bin-1")}  # merged
    assert paired.run(client.peek(names[7]))[0].tolist() == [7.0, 7.0]
    assert [n.op for n in heard] == ["PUT", "APPEND"]
    paired.run(listened.stop())
    client.close()


def test_async_client_maps_the_workers_again_when_the_server_runs_others():
    paired = PairedWorkers(2, Clock())
    client = _async_client(paired)
    name = owned_names(paired.workers, 1, 1)[0]
    heard = []
    paired.run(client.listen(name, heard.append))
    paired.run(client.put(name, torch.ones(1)))
    for pump in paired.pumps:  # the server restarts with three workers on other ports
        pump.client.transport.loseConnection()
    paired.use(3, base=8101)
    paired.flush()
    for _ in range(40):  # members fail to reconnect to the old ports: the front maps the new workers
        paired.clock.advance(0.1)
        paired.flush()
        if client.workers == 3 and client.connected:
            break
    assert client.workers == 3 and client.router.map.ports == [8101, 8102, 8103]
    paired.run(client.put(name, torch.zeros(1)))
    owner = paired.workers.owner(name)
    assert name in paired.states[owner].store.listing()
    assert heard[-1].op == "PUT"  # the listen moved with its bin to its new owner
    client.close()


# ------------------------------------------------------------------ the whole server's status


def test_merged_status_adds_up_the_workers():
    from tensorshare_server.ops.status import limits_of
    from tensorshare_server.workers.supervisor import worker_config

    config = ServerConfig(workers=2, metrics_port=0, max_connections=50, max_bins=100, memory_limit=1 << 20)
    states = [build_state(worker_config(config, k)) for k in range(2)]
    for k, state in enumerate(states):
        pair = Pair(state=state)
        for i in range(k + 1):
            pair.call(PUT, {Key.BIN: f"w{k}-{i}"}, torch.ones(100))
        pair.close()
    parts = [snapshot(state) for state in states]
    whole = merge([*parts, None], {"pid": 1, "port": 8000}, limits_of(config))
    assert parts[0]["limits"]["max_bins"] == 50  # (a worker's share)
    assert whole["limits"]["max_bins"] == 100 and whole["limits"]["max_connections"] == 50  # the whole server's
    assert whole["totals"] == {"bins": 3, "items": 3, "bytes": parts[0]["totals"]["bytes"] * 3}
    assert {b["name"] for b in whole["bins"]} == {"w0-0", "w1-0", "w1-1"}
    assert whole["verbs"]["PUT"]["requests"] == 3 and whole["memory"]["memory_limit"] == 1 << 20
    assert [w["up"] for w in whole["workers"]] == [True, True, False]
    assert [w["bins"] for w in whole["workers"][:2]] == [1, 2]
    from tensorshare_server.ops import page

    assert 'id="workers"' in page.render(whole)


def test_each_worker_gets_its_share_and_its_own_directory(tmp_path):
    """Every limit of the whole server is divided (--max-connections, --max-bins and
    --max-table-rows once applied per worker: N times the setting)."""
    from tensorshare_server.workers.supervisor import worker_config

    whole = ServerConfig(workers=4, memory_limit=8 << 30, recv_pool=1 << 30, data_dir=str(tmp_path), metrics_port=9000,
                         token="t" * 40, worker_ports=9100, max_connections=102, max_bins=10, max_table_rows=1 << 20)
    parts = [worker_config(whole, k) for k in range(4)]
    assert [p.memory_limit for p in parts] == [2 << 30] * 4 and [p.recv_pool for p in parts] == [256 << 20] * 4
    assert [(p.max_connections, p.max_bins, p.max_table_rows) for p in parts] == [(26, 3, 1 << 18)] * 4  # rounded up
    assert worker_config(ServerConfig(workers=4, max_connections=0), 0).max_connections == 0  # no limit stays so
    assert [p.data_dir for p in parts] == [worker_dir(str(tmp_path), k) for k in range(4)]
    assert all(p.workers == 1 and p.metrics_port == 0 and p.metrics_host == "127.0.0.1" and p.token is None
               for p in parts)  # (the token travels apart, on the worker's standard input)
    with pytest.raises(ValueError, match="relay"):
        ServerConfig(workers=2, follow="127.0.0.1:1")


# ------------------------------------------------------------------ the data directory


def _durable_bins(root: str, names: list[str]) -> None:
    data = DataDir(root)
    numbers = iter(range(1, 1 << 30))
    for name in names:
        data.commit(name, lambda: next(numbers), True, *_encoded(name))


def _encoded(name: str):
    from tensorshare.wire.codec import encode

    enc = encode(torch.tensor([float(len(name))]))
    return enc.description, enc.buffers, enc.nbytes, None


def _found(root: str) -> dict[str, str]:
    """bin name -> the directory (relative to root) its bin is in."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if "bin.json" in filenames:
            with open(os.path.join(dirpath, "bin.json")) as f:
                found[json.load(f)["name"]] = os.path.relpath(os.path.dirname(os.path.dirname(dirpath)), root)
    return found


def test_bins_move_to_the_directory_of_their_worker_whatever_the_count(tmp_path):
    root = str(tmp_path / "data")
    names = [f"b{i}" for i in range(40)]
    _durable_bins(root, names)
    assert place(root, 1) == 0  # one process, nothing elsewhere: nothing to do
    for count in (3, 2, 5, 1):
        place(root, count)
        found = _found(root)
        assert set(found) == set(names)
        keys = worker_keys(count)
        expected = {n: "." if count == 1 else f"worker-{rendezvous(n, keys)}" for n in names}
        assert found == expected, count
        assert sorted(e for e in os.listdir(root) if e.startswith("worker-")) == (
            [] if count == 1 else [f"worker-{k}" for k in range(count)])
    assert sorted(DataDir(root).load().bins) == sorted(names)  # and they load whole


def test_a_held_data_directory_names_its_holder(tmp_path):
    code = ("import sys, time; sys.path.insert(0, %r); from tensorshare_server.bins.dirlock import DirLock; "
            "DirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)") % os.getcwd()
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirLockedError, match=f"pid {holder.pid} "):
            DirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    with DirLock(str(tmp_path)) as lock, DirLock(str(tmp_path)) as same_process:  # one process: shared
        assert lock.held and same_process.held


# ------------------------------------------------------------------ a real multi-worker server


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _worker_pids(server: ServerProcess, count: int) -> list[int]:
    """The workers' pids, in worker order (from their ready lines in the log)."""
    pids: dict[int, int] = {}

    def seen() -> bool:
        for match in re.finditer(r"worker (\d+) ready \(pid (\d+)\)", server.log()):
            pids[int(match.group(1))] = int(match.group(2))
        return len(pids) == count and all(p in _children(server.proc.pid) for p in pids.values())

    wait_until(seen, what="every worker running")
    return [pids[k] for k in range(count)]


@pytest.mark.process
def test_a_client_of_a_multi_worker_server_routes_every_verb(tmp_path):
    server = ServerProcess("--workers", "3", "--metrics-port", "0", log_path=tmp_path / "log")
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=20) as client:
            assert client.workers == 3
            workers = client.router.map
            names = [f"bin-{i}" for i in range(18)]
            for i, name in enumerate(names):  # pipelined appends to bins of every worker keep each bin's order
                for j in range(5):
                    client.submit("APPEND", name, torch.tensor([i * 10 + j]))
            for i, name in enumerate(names):
                assert [t.item() for t in client.get(name)] == [i * 10 + j for j in range(5)]
            members = client.router.all()
            for k, member in enumerate(members):  # each worker lists its own bins only
                assert set(client._call(LIST, member=member)) == {n for n in names if workers.owner(n) == k}
            assert client.list() == {name: 0 for name in names}
            # a read that waits on one worker holds its connection, and nobody on another worker
            slow, quick = owned_names(workers, 0, 1, "slow")[0], owned_names(workers, 1, 1, "quick")[0]
            took = []
            waiter = threading.Thread(target=lambda: took.append(client.get(slow, wait=10)))
            waiter.start()
            client.put(quick, torch.ones(1))
            assert client.peek(quick)[0].item() == 1.0
            heard = []
            handle = client.listen(quick, heard.append)
            with tensorshare.Client("127.0.0.1", server.port, timeout=20) as other:
                other.put(slow, torch.tensor([5.0]))
            waiter.join(10)
            assert took and took[0][0].item() == 5.0
            client.append(quick, torch.ones(1))
            wait_until(lambda: heard, what="a notification")
            handle.stop()
            tables = []
            for k in range(2):  # tables live on their owners too
                table = owned_names(workers, k, 1, "table")[0]
                tables.append(table)
                client.create_table(table, 100, {"x": ((2,), "float32")})
                client.insert(table, {"x": torch.ones(4, 2)})
                assert client.sample(table, 3).value["x"].shape == (3, 2)
            shared = client.shared(torch.zeros(1 << 18))  # Client.shared's drafts go to any worker's put
            shared += 2
            big = owned_names(workers, (workers.index + 1) % 3, 1, "big")[0]
            client.put(big, shared)
            assert client.peek(big)[0].sum().item() == 2 * (1 << 18)
            match = re.search(r"status page http://[\d.]+:(\d+)/", server.proc.stdout.readline()
                              + server.proc.stdout.readline())
            status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/status.json",
                                                       timeout=10).read())
            assert {row["name"] for row in status["bins"]} == set(client.list()) - set(tables)
            assert [w["up"] for w in status["workers"]] == [True] * 3
            assert sum(w["bins"] for w in status["workers"]) == status["totals"]["bins"]
        pids = [w["pid"] for w in status["workers"]]
        assert sorted(pids) == sorted(_children(server.proc.pid))
        assert server.stop() == 0
        for pid in pids:
            assert not any(n.startswith(f"tensorshare-{pid}-") for n in os.listdir("/dev/shm"))
    finally:
        server.stop()


@pytest.mark.process
def test_a_killed_worker_comes_back_with_its_durable_bins(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess("--workers", "2", "--data-dir", str(data), "--log-level", "INFO",
                           log_path=tmp_path / "log")
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=20, max_backoff=0.2) as client:
            workers = client.router.map
            kept = owned_names(workers, 1, 4)
            other = owned_names(workers, 0, 1)[0]
            for i, name in enumerate(kept):
                client.put(name, torch.full((3,), float(i)), tag=i)
            client.put(other, torch.ones(1))
            for others in ((), ("--workers", "2")):  # the data directory is taken
                with pytest.raises(RuntimeError, match="in use by"):
                    ServerProcess(*others, "--data-dir", str(data), start_timeout=10)
            heard = []
            client.listen(kept[0], heard.append)
            old = _worker_pids(server, 2)
            os.kill(old[1], signal.SIGKILL)
            wait_until(lambda: "restarting it" in server.log(), what="a restart")
            assert client.peek(other)[0].item() == 1.0  # worker 0 serves meanwhile
            new = _worker_pids(server, 2)
            assert new[0] == old[0] and new[1] != old[1]
            deadline = time.monotonic() + WAIT_S
            while True:  # the first call on the dropped connection may fail; the next reconnects
                try:
                    items = client.peek(kept[2])
                    break
                except ConnectionLostError:
                    assert time.monotonic() < deadline
            assert items[0].tolist() == [2.0] * 3
            assert [client.peek(n, with_seq=True)[0][0][0].item() for n in kept] == [0.0, 1.0, 2.0, 3.0]
            wait_until(lambda: heard and heard[-1].op == "LISTEN", what="the listen restored")
    finally:
        server.stop()
    assert sorted(e for e in os.listdir(data) if e.startswith("worker-")) == ["worker-0", "worker-1"]
    single = ServerProcess("--data-dir", str(data))  # one process on the same data: every bin, in its root
    try:
        with tensorshare.Client("127.0.0.1", single.port, timeout=20) as client:
            assert client.workers == 1 and set(client.list()) == {*kept, other}
    finally:
        single.stop()


@pytest.mark.process
def test_workers_end_with_their_parent(tmp_path):
    server = ServerProcess("--workers", "2", "--log-level", "INFO", log_path=tmp_path / "log")
    pids = _worker_pids(server, 2)
    server.proc.kill()
    server.proc.wait()

    def gone() -> bool:
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] != "Z":
                        return False
            except FileNotFoundError:
                continue
        return True

    wait_until(gone, what="the workers ended")
    server.proc = None


@pytest.mark.process
def test_a_worker_that_cannot_start_stops_the_server(tmp_path):
    with pytest.raises(RuntimeError, match=r"worker \d failed to start"):  # (whichever fails first)
        ServerProcess("--workers", "2", "--tls-cert", str(tmp_path / "missing.pem"), start_timeout=20)


def _accepted(call, *args, **kwargs) -> bool:
    """Whether ``call`` was made (False: the server was unavailable, 421)."""
    try:
        call(*args, **kwargs)
    except ServerUnavailableError:
        return False
    return True


@pytest.mark.process
def test_a_relay_follows_a_multi_worker_server(tmp_path):
    head = ServerProcess("--workers", "2")
    relay = ServerProcess("--follow", f"127.0.0.1:{head.port}", "--follow-timeout", "10", "--log-level", "INFO",
                          log_path=tmp_path / "relay.log")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=20) as upstream, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=20) as client:
            workers = upstream.router.map
            names = [owned_names(workers, k, 1, "params")[0] for k in range(2)]
            heard = {name: [] for name in names}
            for name in names:
                client.listen(name, heard[name].append)
            for version in range(3):
                for name in names:  # written through the relay (forwarded to the owner), read back there
                    client.put(name, torch.full((4,), float(version)), tag=version)
                    assert client.peek(name)[0].tolist() == [float(version)] * 4
            for name in names:
                upstream.put(name, torch.full((4,), 9.0), tag=9)  # changes upstream reach the relay's copy
                wait_until(lambda: heard[name] and heard[name][-1].tag == 9, what=f"{name} mirrored")
                assert client.peek(name)[0].tolist() == [9.0] * 4
            head.stop()  # the head comes back with three workers on other ports: the relay maps them again
            head = ServerProcess("--workers", "3", port=head.port)
            for name in names:  # (421 until the relay is connected again: the client decides to try again)
                wait_until(lambda: _accepted(client.put, name, torch.full((2,), 5.0), tag=5), what="put")
                wait_until(lambda: heard[name] and heard[name][-1].tag == 5, what=f"{name} listened to again")
                assert client.peek(name)[0].tolist() == [5.0, 5.0]
            assert set(client.list()) >= set(names)
        assert "runs other workers now" in relay.log()
    finally:
        relay.stop()
        head.stop()


@pytest.mark.process
def test_a_fanned_out_call_after_the_server_restarts_maps_the_workers_again():
    """LIST and NOOP go to every worker: the first after a restart (new worker ports)
    met a member of the old map and raised StaleMapError to the caller."""
    server = ServerProcess("--workers", "2")
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=20) as client:
            for verb in (client.list, client.ping):
                client.put("x", torch.ones(1))
                assert "x" in client.list()
                port = server.port
                server.stop()
                server = ServerProcess("--workers", "2", port=port)
                wait_until(lambda: _reachable(verb), what=f"{verb.__name__} after the restart")
    finally:
        server.stop()


def _reachable(call) -> bool:
    """Whether ``call()`` was answered (False: the connection was lost, as the first
    call after a server restart may find it; never a stale map)."""
    from tensorshare._client.member import StaleMapError

    try:
        call()
    except ConnectionLostError as exc:
        if isinstance(exc, StaleMapError):
            raise
        return False
    return True


@pytest.mark.process
def test_a_relay_serves_the_bins_of_the_workers_that_stay_up(tmp_path):
    """One upstream worker killed (and restarted by its server): the relay took the
    whole upstream for gone meanwhile, so a change of another worker's bin was noted
    and never fetched (the mirror stale, its listeners told nothing, until the next
    change), writes to that bin were refused with 421, and an ephemeral bin whose
    client left stayed upstream for good."""
    head = ServerProcess("--workers", "2", "--log-level", "INFO", log_path=tmp_path / "head.log")
    relay = ServerProcess("--follow", f"127.0.0.1:{head.port}", "--follow-timeout", "10")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=20) as upstream, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=20) as client:
            workers = upstream.router.map
            kept, gone = owned_names(workers, 0, 2, "kept"), owned_names(workers, 1, 1, "gone")[0]
            upstream.put(kept[0], torch.tensor([1]))
            upstream.put(gone, torch.tensor([1]))
            heard: list = []
            client.listen(kept[0], heard.append)
            client.listen(gone, lambda note: None)
            member = tensorshare.Client("127.0.0.1", relay.port, timeout=20)
            member.put(kept[1], {"host": "h"}, ephemeral=True)
            os.kill(_worker_pids(head, 2)[1], signal.SIGKILL)
            wait_until(lambda: not _accepted(client.relay_status) or not client.relay_status()["connected"],
                       what="the relay without worker 1")  # (a LIST forwarded as the connection drops: 421)
            upstream.put(kept[0], torch.tensor([2]))  # worker 0 is up all along
            client.put(kept[0], torch.tensor([3]))  # through the relay: not refused
            member.close()  # its ephemeral bin, on worker 0, ends with it
            wait_until(lambda: client.peek(kept[0])[0].tolist() == [3], what="the relay's copy")
            wait_until(lambda: [note.tag for note in heard if note.op == "PUT"] and
                       upstream.peek(kept[0])[0].tolist() == [3], what="the change heard")

            def deleted() -> bool:  # (asked of worker 0 alone: the connection to 1 dropped)
                try:
                    upstream.peek(kept[1])
                except NoSuchBinError:
                    return True
                return False

            wait_until(deleted, what="the ephemeral bin deleted upstream")
    finally:
        relay.stop()
        head.stop()


@pytest.mark.process
def test_rl_wrappers_and_the_callback_api_over_workers():
    from tensorshare import RLTrainer, RLWorker, TensorShare

    server = ServerProcess("--workers", "3")
    try:
        with RLTrainer("127.0.0.1", server.port, experiment="multi") as trainer, \
                RLWorker("127.0.0.1", server.port, experiment="multi") as worker:
            state = {f"w{i}": torch.zeros(64) for i in range(4)}
            for version in range(4):  # deltas that do not wait: the chain is in place before the announcement
                state = {k: v + (1.0 if i == version else 0.0) for i, (k, v) in enumerate(state.items())}
                assert trainer.publish_parameters(state, wait=False, delta=True) == version
                got = worker.await_new_parameters(timeout=10)
                assert all(torch.equal(got[k], state[k]) for k in state)
            for i in range(5):
                worker.add_data({"step": torch.tensor([i])})
            data = trainer.get_data(max_items=5, min_items=5, timeout=10)
            assert sorted(int(d["step"]) for d in data) == list(range(5))
        ts = TensorShare("127.0.0.1", server.port)
        try:
            replies = []
            done = threading.Event()

            def heard(reply) -> None:
                replies.append(reply)
                if len(replies) == 7:
                    done.set()

            names = [f"cb-{i}" for i in range(6)]  # on every worker
            for name in names:
                ts.put(name, torch.ones(2), callback=heard)
            ts.list(callback=heard)  # after the puts, on one connection each: it sees them all
            assert done.wait(10) and all(r["status"] == "OK" for r in replies)
            [listing] = [r["data"] for r in replies if "data" in r]
            assert set(names) <= set(listing)
        finally:
            ts.stop()
    finally:
        server.stop()


@pytest.mark.process
def test_workers_with_a_token_and_tls(tmp_path):
    from certs import make_certificates

    certs = make_certificates(tmp_path)
    token = "w" * 40
    (tmp_path / "token").write_text(token)
    server = ServerProcess("--workers", "2", "--token-file", str(tmp_path / "token"), "--tls-cert", certs.cert,
                           "--tls-key", certs.key)
    try:
        with tensorshare.Client("127.0.0.1", server.port, token=token, tls_ca=certs.ca, timeout=20) as client:
            assert client.workers == 2
            names = [owned_names(client.router.map, k, 1)[0] for k in range(2)]
            for name in names:  # every member authenticates, over TLS
                client.put(name, torch.ones(3))
                assert client.peek(name)[0].tolist() == [1.0] * 3
            assert set(names) <= set(client.list())
        with pytest.raises(tensorshare.errors.AuthenticationError):
            tensorshare.Client("127.0.0.1", server.port, token="x" * 40, tls_ca=certs.ca, connect_timeout=10)
    finally:
        server.stop()
