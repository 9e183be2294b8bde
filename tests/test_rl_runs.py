"""What a real actor-learner run needs of RLTrainer / RLWorker (issue #24): batches,
backpressure in the server, a bounded lag by default, publishing without waiting,
membership and control.  Against a server process."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import tensorshare
from tensorshare import RLTrainer, RLWorker
from tensorshare.errors import TimeoutError
from tensorshare.rl import DEFAULT_MAX_STALENESS, Rollout
from wiretools import wait_for


def test_get_data_returns_at_most_a_batch_in_order(server):
    with RLTrainer("127.0.0.1", server.port, experiment="batch") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="batch") as worker:
        for i in range(10):
            worker.add_data(i)
        worker.flush(10)
        assert trainer.get_data(max_items=4, timeout=10) == [0, 1, 2, 3]
        assert trainer.get_data(max_items=4) == [4, 5, 6, 7]
        assert trainer.get_data(max_items=4) == [8, 9]
        assert trainer.get_data(max_items=4) == []
        start = time.monotonic()
        assert trainer.get_data(max_items=4, timeout=0.2) == []  # waits, then nothing
        assert time.monotonic() - start >= 0.15


def test_stale_rollouts_are_replaced_from_those_waiting_and_carry_worker_and_version(server):
    with RLTrainer("127.0.0.1", server.port, experiment="fill", max_staleness=1) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="fill", worker_id="w7") as worker:
        for _ in range(3):
            trainer.publish_parameters({"x": torch.zeros(1)})
        assert wait_for(lambda: worker.await_new_parameters(0.05) is not None or worker.version == 2)
        worker.version = 0  # pretend an old policy made the first three
        for i in range(3):
            worker.add_data(f"old {i}")
        worker.version = 2
        for i in range(3):
            worker.add_data(f"new {i}")
        worker.flush(10)
        got = trainer.get_data(max_items=2, timeout=10, return_info=True)
        assert got == [Rollout("new 0", 2, "w7", 0), Rollout("new 1", 2, "w7", 0)]
        assert trainer.dropped == 3 and trainer.received == 5


def test_the_default_lag_is_bounded_and_most_work_lost_is_warned_of(server, caplog):
    assert DEFAULT_MAX_STALENESS == 4
    with RLTrainer("127.0.0.1", server.port, experiment="lag") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="lag") as worker:
        assert trainer.max_staleness == 4
        for _ in range(10):
            trainer.publish_parameters({"x": torch.zeros(1)})
        for version in range(10):
            worker.version = version
            for _ in range(12):
                worker.add_data(version)
        worker.flush(10)
        with caplog.at_level(logging.WARNING, logger="tensorshare.rl"):
            kept = trainer.get_data(timeout=10)
            while trainer.received < 120:
                kept += trainer.get_data(timeout=10)
        assert sorted(set(kept)) == [5, 6, 7, 8, 9]  # at most 4 behind version 9
        assert trainer.dropped == 60 and trainer.drop_rate == 0.5
        assert not [r for r in caplog.records if "dropped as made with" in r.message]  # half is not most
        worker.version = 0
        for _ in range(100):
            worker.add_data("stale")
        worker.flush(10)
        with caplog.at_level(logging.WARNING, logger="tensorshare.rl"):
            while trainer.received < 220:  # all dropped: each call waits out its timeout, kept nothing
                trainer.get_data(timeout=0.5)
        assert trainer.drop_rate > 0.5
        assert [r for r in caplog.records if "dropped as made with" in r.message]


def test_a_capped_experiment_makes_add_data_wait_in_the_server(server):
    with RLTrainer("127.0.0.1", server.port, experiment="cap", max_waiting=3, filter_version=False) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="cap", max_pending=2, timeout=1.5) as worker:
        probe = tensorshare.Client("127.0.0.1", server.port)
        for i in range(5):  # 3 stored, 2 in flight, waiting in the server
            worker.add_data(i)
        assert wait_for(lambda: probe.list().get("cap/rollouts") == 3)
        time.sleep(0.2)
        assert probe.list()["cap/rollouts"] == 3  # never more than the cap
        # Parameters still arrive while rollouts wait (they travel on another connection).
        trainer.publish_parameters({"x": torch.ones(1)})
        assert worker.await_new_parameters(timeout=5) is not None
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # the window is full and the server holds the rest
            worker.add_data(5)
        assert time.monotonic() - start >= 1.0
        # The two that waited in the server were refused after the timeout, storing nothing.
        with pytest.raises(TimeoutError, match="after waiting"):
            worker.flush(5)
        assert trainer.get_data(max_items=10, timeout=5) == [0, 1, 2]
        # Room made: the worker goes on, and rollouts that wait go in as the trainer takes.
        for i in range(6, 10):
            worker.add_data(i)
        got = []
        assert wait_for(lambda: got.extend(trainer.get_data()) or got == [6, 7, 8, 9], timeout=10), got
        worker.flush(5)
        probe.close()


def test_the_cap_can_be_lifted_while_workers_run(server):
    with RLTrainer("127.0.0.1", server.port, experiment="lift", max_waiting=2) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="lift", max_pending=4, timeout=10) as worker:
        for i in range(4):
            worker.add_data(i)
        probe = tensorshare.Client("127.0.0.1", server.port)
        assert wait_for(lambda: probe.list().get("lift/rollouts") == 2)
        assert worker.max_waiting == 2
        trainer.set_max_waiting(None)
        assert wait_for(lambda: worker.max_waiting is None)  # told through the control bin
        # Those already waiting keep their cap; new ones are not capped.
        assert trainer.get_data(timeout=5)[:2] == [0, 1]
        # The two that waited go in with the room made (uncapped ones sent before they
        # did would fill the bin past their cap: they would wait for the next take).
        worker.flush(5)
        for i in range(4, 20):
            worker.add_data(i)
        worker.flush(10)
        assert wait_for(lambda: probe.list().get("lift/rollouts", 0) >= 16)
        probe.close()


def test_publish_without_waiting_returns_at_once_with_a_snapshot(server):
    with RLTrainer("127.0.0.1", server.port, experiment="nowait") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="nowait") as worker:
        weights = torch.zeros(1 << 20)  # 4 MiB
        versions = []
        for step in range(5):
            weights.fill_(step)
            versions.append(trainer.publish_parameters({"w": weights}, wait=False))
        weights.fill_(-1)  # what was published was copied at each call
        assert versions == [0, 1, 2, 3, 4] and trainer.version == 4
        trainer.flush(10)
        assert wait_for(lambda: worker.await_new_parameters(0.05) is not None and worker.version == 4)
        params = worker.get_parameters()
        assert params["w"].unique().tolist() == [4.0]


def test_membership_versions_and_join_leave_callbacks(server):
    joined, left = [], []
    with RLTrainer("127.0.0.1", server.port, experiment="members", on_join=joined.append,
                   on_leave=left.append) as trainer:
        assert trainer.workers == {}
        trainer.publish_parameters({"x": torch.zeros(1)})
        with RLWorker("127.0.0.1", server.port, experiment="members", worker_id="a") as a:
            assert wait_for(lambda: "a" in trainer.workers)
            assert [w.id for w in joined] == ["a"]
            assert a.get_parameters() is not None
            assert wait_for(lambda: trainer.workers["a"].version == 0)
            for i in range(20):
                a.add_data(i)
            a.flush(10)
            got = trainer.get_data(timeout=10)
            assert wait_for(lambda: got.extend(trainer.get_data()) or len(got) >= 20)
            assert sorted(got) == list(range(20))
            info = trainer.workers["a"]
            assert info.rollouts == 20 and info.rate > 0
        assert wait_for(lambda: "a" not in trainer.workers)
        assert [w.id for w in left] == ["a"]


def test_a_trainer_started_after_its_workers_sees_them(server):
    with RLWorker("127.0.0.1", server.port, experiment="late", worker_id="early"):
        with RLTrainer("127.0.0.1", server.port, experiment="late") as trainer:
            assert "early" in trainer.workers


_WORKER = textwrap.dedent("""
    import sys, time
    from tensorshare import RLWorker
    with RLWorker("127.0.0.1", int(sys.argv[1]), experiment="kill", worker_id=sys.argv[2]) as w:
        print("up", flush=True)
        while not w.stop_requested:
            w.await_new_parameters(timeout=0.1)
        print("stopping", flush=True)
""")


def test_a_killed_worker_leaves_and_stop_workers_reaches_the_others(server):
    left = threading.Event()
    with RLTrainer("127.0.0.1", server.port, experiment="kill",
                   on_leave=lambda info: info.id == "victim" and left.set()) as trainer:
        procs = {name: subprocess.Popen([sys.executable, "-c", _WORKER, str(server.port), name],
                                        stdout=subprocess.PIPE, text=True) for name in ("victim", "other")}
        try:
            for proc in procs.values():
                assert proc.stdout.readline().strip() == "up"
            assert wait_for(lambda: set(trainer.workers) == {"victim", "other"})
            procs["victim"].kill()
            assert left.wait(10), "a killed worker was not seen to leave"
            assert set(trainer.workers) == {"other"}
            trainer.stop_workers()
            assert procs["other"].stdout.readline().strip() == "stopping"
            assert procs["other"].wait(20) == 0
            assert wait_for(lambda: trainer.workers == {})
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(10)


def test_an_experiment_name_too_long_for_membership_is_refused_clearly(server):
    with pytest.raises(ValueError, match="shorten the experiment name"):
        RLWorker("127.0.0.1", server.port, experiment="x" * 240, worker_id="w" * 20)


@pytest.mark.process
def test_the_failover_example_resumes_a_killed_learner_with_the_same_workers():
    """examples/rl_failover.py: checkpoint (policy and Adam state, int-keyed) into a
    server with --data-dir, SIGKILL the learner, resume; the workers never restart."""
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "rl_failover.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[learner 1] checkpoint at version 10" in out
    assert "killed with SIGKILL" in out
    resumed = [line for line in out.splitlines() if "resumed from the checkpoint of version" in line]
    assert resumed and "version 10;" in resumed[0]
    latest = int(resumed[0].rsplit(" ", 1)[1])
    assert latest in (11, 12)  # the last publish (wait=False) may not have left before the kill
    versions = [int(line.split()[3]) for line in out.splitlines() if line.startswith("[learner 2] version ")]
    assert versions[0] == latest + 2  # it published latest + 1 on starting: the version numbers go on
    assert "[learner 2] checkpoint at version 30" in out
    assert "workers stopped, never restarted: exit codes [0, 0]" in out


def test_rollouts_spread_over_several_servers(server):
    from serverproc import ServerProcess
    from tensorshare.sharded import rendezvous

    other = ServerProcess()
    try:
        servers = [f"127.0.0.1:{server.port}", f"127.0.0.1:{other.port}"]
        # Ids enough that each server has two (12 once left one server a single worker
        # in about 1 run of 300: the ports, and so the hashing, differ every run).
        ids = [f"w{i}" for i in range(64)]
        by_server = {0: [], 1: []}
        for worker_id in ids:
            by_server[rendezvous(worker_id, servers)].append(worker_id)
        chosen = by_server[0][:2] + by_server[1][:2]  # two workers on each server
        assert len(chosen) == 4
        with RLTrainer("127.0.0.1", server.port, experiment="spread", servers=servers,
                       filter_version=False) as trainer:
            workers = [RLWorker("127.0.0.1", server.port, experiment="spread", worker_id=w, servers=servers)
                       for w in chosen]
            try:
                for worker in workers:
                    for i in range(5):
                        worker.add_data((worker.worker_id, i))
                    worker.flush(10)
                with tensorshare.Client("127.0.0.1", other.port) as probe:
                    assert probe.list()["spread/rollouts"] == 10  # the second server's two workers
                got = trainer.get_data(timeout=10, return_info=True)
                assert wait_for(lambda: got.extend(trainer.get_data(return_info=True)) or len(got) >= 20)
                assert sorted(r.data for r in got) == sorted((w, i) for w in chosen for i in range(5))
                assert {r.worker for r in got} == set(chosen)
                assert set(trainer.workers) == set(chosen)  # membership stays on the first server
            finally:
                for worker in workers:
                    worker.stop()
    finally:
        other.stop()


def test_a_quiet_run_makes_no_traffic(server):
    """Nothing happens while nothing happens: the trainer's own take of the roster
    once re-triggered its roster listener (a GET notifies), which took again, forever.
    A worker's version reports come at most every 0.2 s, however fast versions come."""
    with RLTrainer("127.0.0.1", server.port, experiment="quiet") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="quiet", worker_id="w") as worker, \
            tensorshare.Client("127.0.0.1", server.port) as probe:
        assert wait_for(lambda: "w" in trainer.workers)
        time.sleep(0.3)
        changes = {"quiet/roster": [], "quiet/workers/w": []}
        for name, seen in changes.items():
            probe.listen(name, seen.append)
        for _ in range(30):  # 30 versions as fast as they go
            trainer.publish_parameters({"x": torch.zeros(1)})
            worker.await_new_parameters(timeout=5)
        assert wait_for(lambda: trainer.workers["w"].version == 29)  # the last report follows
        time.sleep(0.5)
        assert changes["quiet/roster"] == []
        assert 1 <= len(changes["quiet/workers/w"]) <= 12, changes
