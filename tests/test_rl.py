"""RLTrainer / RLWorker: atomic versions, no races, staleness filtering, crash and rejoin."""

from __future__ import annotations

import os
import pytest
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import tensorshare
from tensorshare import RLTrainer, RLWorker

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "rl_procs.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen, lines: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    thread.start()
    return thread


def test_one_trainer_four_workers_twenty_versions_with_a_crash(fresh_server):
    port = str(fresh_server.port)
    workers = [spawn("worker", port) for _ in range(4)]
    outputs = [[] for _ in workers]
    readers = [collect(w, out) for w, out in zip(workers, outputs)]
    trainer = spawn("trainer", port, "20", "8")
    trainer_out: list = []
    collect(trainer, trainer_out)
    try:
        # Kill a worker mid-run, start a new one: nobody else may notice.
        deadline = time.monotonic() + 60
        while not any("version 5 done" in line for line in trainer_out) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        workers.append(spawn("worker", port))
        outputs.append([])
        readers.append(collect(workers[-1], outputs[-1]))
        assert trainer.wait(120) == 0, trainer.stderr.read()
        # Every live worker, the newcomer included, ends up holding the last version.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                any(line.strip() == "seen 19" for line in out) for out in outputs[1:]):
            time.sleep(0.05)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(10)
        trainer.kill()
    assert any("trainer finished" in line for line in trainer_out)
    for i, (w, out) in enumerate(zip(workers, outputs)):
        readers[i].join(5)
        errors = w.stderr.read()
        assert "torn" not in errors and "went back" not in errors and "AssertionError" not in errors, errors
        seen = [int(m.group(1)) for line in out if (m := re.match(r"seen (\d+)", line))]
        assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
        if i != 0:  # the survivors and the newcomer reached the last version
            assert seen and seen[-1] == 19, (i, seen[-5:])
    assert outputs[-1] and int(outputs[-1][0].split()[1]) >= 5  # the newcomer started from the latest


def test_publish_is_a_snapshot_and_versions_count_from_zero(server):
    with RLTrainer("127.0.0.1", server.port, experiment="snap") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="snap") as worker:
        assert worker.get_parameters() is None
        net = torch.nn.Linear(3, 2)
        assert trainer.publish_parameters(net.state_dict()) == 0
        before = {k: v.clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            net.weight.add_(100.0)  # training goes on after publishing
        params = worker.await_new_parameters(timeout=10)
        assert worker.version == 0
        assert torch.equal(params["weight"], before["weight"])
        assert trainer.publish_parameters(net.state_dict()) == 1
        assert torch.equal(worker.await_new_parameters(timeout=10)["weight"], net.weight.detach())


def test_worker_downloads_only_newer_versions(server):
    with RLTrainer("127.0.0.1", server.port, experiment="dl") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="dl") as worker:
        trainer.publish_parameters({"x": torch.zeros(4)})
        first = worker.await_new_parameters(timeout=10)
        peeks = []
        for client in (worker.client, worker._poller()):  # (the second: where it long-polls)
            client.peek = lambda *a, _original=client.peek, **k: peeks.append(a) or _original(*a, **k)
        for _ in range(20):
            assert worker.get_parameters() is first  # no new version: no download
        assert peeks == []
        trainer.publish_parameters({"x": torch.ones(4)})
        assert worker.await_new_parameters(timeout=10)["x"].sum() == 4
        assert len(peeks) == 1


def test_await_never_misses_a_publish_made_before_it(server):
    with RLTrainer("127.0.0.1", server.port, experiment="race") as trainer:
        trainer.publish_parameters({"x": torch.zeros(1)})
        with RLWorker("127.0.0.1", server.port, experiment="race") as worker:
            assert worker.await_new_parameters(timeout=5) is not None  # published before it started
            trainer.publish_parameters({"x": torch.ones(1)})
            time.sleep(0.3)  # the notification arrives before we wait
            assert worker.await_new_parameters(timeout=5)["x"].item() == 1
            assert worker.await_new_parameters(timeout=0.2) is None  # nothing newer: times out


def test_staleness_filter_counts_drops(server):
    with RLTrainer("127.0.0.1", server.port, experiment="stale", max_staleness=1) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="stale") as worker:
        assert trainer.get_data() == []  # returns at once when there is nothing
        for _ in range(3):
            trainer.publish_parameters({"x": torch.zeros(1)})
        while worker.version < 2:  # the announcements arrive within moments
            assert worker.await_new_parameters(timeout=10) is not None
        assert worker.version == 2
        worker.add_data("fresh")
        worker.version = 0  # pretend an old policy made these
        worker.add_data("old")
        worker.version = 1
        worker.add_data("one behind")
        got = list(zip(*trainer.get_data(return_versions=True, timeout=10)))
        while len(got) + trainer.dropped < 3:
            got += zip(*trainer.get_data(return_versions=True, timeout=10))
        assert sorted(got) == [("fresh", 2), ("one behind", 1)]
        assert trainer.dropped == 1


def test_get_data_waits_for_arrival(server):
    with RLTrainer("127.0.0.1", server.port, experiment="wait", filter_version=False) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="wait") as worker:
        threading.Timer(0.3, worker.add_data, args=(torch.ones(2),)).start()
        start = time.monotonic()
        data = trainer.get_data(timeout=10)
        assert len(data) == 1 and torch.equal(data[0], torch.ones(2))
        assert 0.2 < time.monotonic() - start < 5


def test_trainer_restart_continues_versions(server):
    with RLTrainer("127.0.0.1", server.port, experiment="restart") as trainer:
        for _ in range(3):
            trainer.publish_parameters({"x": torch.zeros(1)})
    with RLTrainer("127.0.0.1", server.port, experiment="restart") as trainer:
        assert trainer.version == 2
        assert trainer.publish_parameters({"x": torch.zeros(1)}) == 3


def test_experiments_do_not_mix(server):
    with RLTrainer("127.0.0.1", server.port, experiment="a") as ta, \
            RLTrainer("127.0.0.1", server.port, experiment="b") as tb:
        ta.publish_parameters({"x": torch.zeros(1)})
        assert tb.version == -1
        bins = tensorshare.Client("127.0.0.1", server.port).list()
        assert "a/parameters" in bins and "b/parameters" not in bins


@pytest.mark.process
def test_seed_readme_rl_scripts_run_unchanged(tmp_path):
    import socket

    with socket.socket() as probe:  # find a free port, then hand it to the seed trainer
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # (the original's 8000 else; a tenth of the scripts' own pauses: the same calls, in order, sooner)
    scripts = {name: [sys.executable, str(EXAMPLES / name), "--port", str(port), "--pauses", "0.1"]
               for name in ("original_rl_trainer.py", "original_rl_worker.py")}
    trainer = subprocess.Popen(scripts["original_rl_trainer.py"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    workers = [subprocess.Popen(scripts["original_rl_worker.py"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for _ in range(3)]
    try:
        out, err = trainer.communicate(timeout=180)
        assert trainer.returncode == 0, err
        assert "Iteration 9 Loss:" in out
    finally:
        for w in workers:
            w.kill()
            w.wait(10)
        trainer.kill()


def test_get_data_waits_again_after_draining(server):
    """After a take empties the bin, the next get_data(timeout) waits for a new rollout."""
    with RLTrainer("127.0.0.1", server.port, experiment="drain", filter_version=False) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="drain") as worker:
        worker.add_data(1)
        assert trainer.get_data(timeout=10) == [1]
        for _ in range(5):
            start = time.monotonic()
            assert trainer.get_data(timeout=0.2) == []
            assert time.monotonic() - start >= 0.15
        worker.add_data(2)
        assert trainer.get_data(timeout=10) == [2]


def test_a_batch_short_at_its_timeout_raises_and_loses_nothing(server):
    """``get_data(min_items=N, timeout=T)`` asks for exactly a batch: short of N at T it
    raises TimeoutError saying how many came and how many workers there are (it
    returned them, or ``[]``, without a word), and the next call gets those first."""
    with RLTrainer("127.0.0.1", server.port, experiment="short-batch", filter_version=False) as trainer:
        started = time.monotonic()
        with pytest.raises(tensorshare.errors.TimeoutError, match=r"get_data: 0 of min_items=4 rollouts within "
                           r"0.5s \(kept for the next call\): no worker of experiment 'short-batch' is connected"):
            trainer.get_data(max_items=4, min_items=4, timeout=0.5)
        assert time.monotonic() - started < 5
        with RLWorker("127.0.0.1", server.port, experiment="short-batch") as worker:
            for step in range(3):
                worker.add_data({"step": step})
            worker.flush(timeout=30)
            with pytest.raises(tensorshare.errors.TimeoutError, match=r"3 of min_items=4 .*1 worker\(s\) connected"):
                trainer.get_data(max_items=4, min_items=4, timeout=1)
            worker.add_data({"step": 3})
            worker.flush(timeout=30)
            batch = trainer.get_data(max_items=4, min_items=4, timeout=30)
        assert [item["step"] for item in batch] == [0, 1, 2, 3]  # the three kept, then the fourth
        assert trainer.get_data(timeout=0.2) == []  # without min_items: a wait that may come back empty


def test_a_worker_started_after_stop_workers_says_why_it_stops(server, caplog):
    """The stop request outlives its trainer (workers restarted later stop too); such a
    worker says so once, instead of dropping every rollout without a word."""
    import logging

    with RLTrainer("127.0.0.1", server.port, experiment="stopped") as trainer:
        trainer.publish_parameters({"w": torch.zeros(1)})
        trainer.stop_workers()
    with caplog.at_level(logging.WARNING, logger="tensorshare.rl"), \
            RLWorker("127.0.0.1", server.port, experiment="stopped") as late:
        assert late.stop_requested and late.await_new_parameters(timeout=5) is None
        for _ in range(3):
            late.add_data({"obs": 1})
        told = [r.getMessage() for r in caplog.records if "asked its workers to stop" in r.getMessage()]
        assert len(told) == 1 and "until a new RLTrainer of the experiment starts" in told[0], told
    with RLTrainer("127.0.0.1", server.port, experiment="stopped"), \
            RLWorker("127.0.0.1", server.port, experiment="stopped") as fresh:
        assert not fresh.stop_requested  # a new trainer lifted the request


def test_a_worker_waiting_for_its_server_says_so(caplog):
    """A worker started before its server waits (30 s by default) with a warning after
    the first refusal, naming the command that starts one; it was silent."""
    import logging
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="tensorshare.client"):
        with pytest.raises(tensorshare.errors.ConnectionLostError, match="tried for 1s"):
            RLWorker("127.0.0.1", port, connect_timeout=1)
    [told] = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert f"no server listens there (start one: tensorshare-server --port {port})" in told


@pytest.mark.process
def test_add_data_timeout_names_the_rollouts_in_flight():
    """A capped experiment keeps two rollouts in flight, not ``max_pending`` (64): past
    its timeout with the server silent (stopped here), add_data names the two
    actually unacknowledged (it named 64)."""
    from serverproc import ServerProcess

    server = ServerProcess()
    try:
        with RLTrainer("127.0.0.1", server.port, experiment="full", max_waiting=16), \
                RLWorker("127.0.0.1", server.port, experiment="full", timeout=1) as worker:
            assert worker.max_waiting == 16
            worker.add_data({"obs": 0})  # (capped, rollouts take a connection of their own: open it)
            worker.flush(timeout=30)
            os.kill(server.proc.pid, signal.SIGSTOP)  # nothing is acknowledged from now on
            try:
                with pytest.raises(tensorshare.errors.TimeoutError) as caught:
                    for _ in range(3):
                        worker.add_data({"obs": 1})
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert str(caught.value).startswith("2 rollouts still unacknowledged after 1s (the trainer holds at "
                                                "most 16 waiting, and takes none"), str(caught.value)
    finally:
        server.stop()


def _until(condition, timeout: float = 20.0, what: str = "the condition"):
    """``condition()``'s first true result within ``timeout`` s (calls that fail while
    the server restarts are tried again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = condition()
        except tensorshare.errors.ConnectionLostError:
            result = None
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_a_server_restart_leaves_the_trainer_its_workers_and_their_rollouts(fresh_server):
    """A restarted server counts its bins' seqs anew: the trainer took every later
    notification of waiting rollouts for an old one (get_data without a timeout gave
    nothing, for good, and capped workers waited), and, having listened again to a
    worker's bin before the worker put it back, took the worker for gone for good."""
    from gateproxy import GateProxy

    server = fresh_server
    gate = GateProxy(server.port)  # the worker's way to the server (TCP only: no same-host socket around it)
    with RLTrainer("127.0.0.1", server.port, experiment="rs") as trainer, \
            RLWorker("127.0.0.1", gate.port, experiment="rs", worker_id="w0", zero_copy=False) as worker:
        trainer.publish_parameters({"x": torch.zeros(2)})
        got: list = []
        for i in range(30):  # the rollouts bin's seq climbs past what a new server starts from
            worker.add_data(torch.tensor([i]))
            worker.flush()
            got += trainer.get_data()
        _until(lambda: got.extend(trainer.get_data()) or len(got) == 30, what="the first rollouts")
        assert "w0" in trainer.workers
        gate.hold_after(0)  # the restarted server's greeting waits at the gate: the worker reconnects last
        server.stop(signal.SIGKILL)
        server.start()
        # the trainer listens again first, and finds the worker's bin gone (its connection
        # ended with the old server): the worker is gone until it registers again
        _until(lambda: (trainer.client.ping(), "w0" not in trainer.workers)[1],
               what="the trainer hearing the worker's bin gone")
        gate.release()

        def add(i: int) -> bool:  # (a rollout sent as the connection broke: sent again)
            worker.add_data(torch.tensor([i]))
            worker.flush()
            return True

        for i in range(100, 104):
            _until(lambda: add(i), what="a rollout after the restart")
        again: set = set()
        _until(lambda: again.update(int(r) for r in trainer.get_data()) or again >= {100, 101, 102, 103},
               what="the rollouts after the restart")
        _until(lambda: "w0" in trainer.workers, what="the worker in the trainer's list")
    gate.close()
