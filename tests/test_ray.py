"""tensorshare.ray on a simulated Ray cluster (ray.cluster_utils.Cluster: two nodes
on this machine): a head, one relay per node, workers find their node's relay, and a
killed relay actor is restarted by Ray while workers carry on."""

from __future__ import annotations

import os
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ray[default]')")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import tensorshare  # noqa: E402
import tensorshare.ray as tsray  # noqa: E402
from tensorshare.errors import UsageError  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]


TOKEN = "ray-deployment-token-2b7e90c4d1f35a68"


def test_a_deployment_without_a_token_beyond_loopback_is_refused(monkeypatch):
    """Issue #31, item 13: start() bound the head and the relays to the node's address
    with no token and no warning.  Refused before Ray is even started."""
    monkeypatch.delenv("TENSORSHARE_TOKEN", raising=False)
    with pytest.raises(UsageError, match="needs a token"):
        tsray.start("refused")
    with pytest.raises(UsageError, match="needs a token"):
        tsray.start("refused", host="10.1.2.3")
    assert tsray._token(None, "127.0.0.1", False) is None  # loopback only: a one-node cluster
    assert tsray._token(None, None, True) is None  # meant
    monkeypatch.setenv("TENSORSHARE_TOKEN", TOKEN)
    assert tsray._token(None, None, False) == TOKEN.encode()


@pytest.fixture(scope="module")
def cluster():
    # A loaded 2-core machine starts raylets slowly (Ray's default wait is 30 s).
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    # The servers and every worker's client (which inherit the environment) use it.
    os.environ["TENSORSHARE_TOKEN"] = TOKEN
    # Two nodes: each gets its relay and a worker reading locally (a third only added Ray
    # processes to a suite on 2 cores).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="tensorshare-tests")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    del os.environ["TENSORSHARE_TOKEN"]


@ray.remote(num_cpus=0)
def read_params(expect_version: int, deadline_s: float = 60.0) -> dict:
    """In a task on some node: the local relay's address, and the parameters read through it."""
    import tensorshare
    import tensorshare.ray as tsray

    address = tsray.local_address("t1")
    deadline = time.monotonic() + deadline_s
    with tensorshare.Client(*address, timeout=20, max_backoff=0.2) as client:
        while True:
            try:
                [state] = client.peek("params")
                if int(state["v"][0]) >= expect_version:
                    break
            except tensorshare.TensorShareError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no version {expect_version} at {address}")
            time.sleep(0.05)
        return {"node": ray.get_runtime_context().get_node_id(), "address": address,
                "version": int(state["v"][0]), "same_host": client.same_host,
                "whole": bool((state["w"] == state["v"][0]).all())}


@ray.remote(num_cpus=0)
class Reader:
    """A long-lived worker on one node, with one client to its node's relay."""

    def __init__(self, deployment: str):
        import tensorshare
        import tensorshare.ray as tsray

        self.client = tensorshare.Client(*tsray.local_address(deployment), timeout=20, max_backoff=0.2)

    def read(self, version: int, deadline_s: float = 60.0) -> int:
        import tensorshare

        deadline = time.monotonic() + deadline_s
        while True:
            try:
                [state] = self.client.peek("params")
                if int(state["v"][0]) >= version:
                    return int(state["v"][0])
            except tensorshare.TensorShareError:  # the relay restarting: the client reconnects by itself
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no version {version}")
            time.sleep(0.05)


def on(node_id: str):
    return read_params.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))


def test_one_relay_per_node_workers_read_locally_and_a_killed_relay_comes_back(cluster):
    deployment = tsray.start("t1")
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert sorted(deployment.relays) == sorted(nodes) and len(nodes) == 2
        with tensorshare.Client(*deployment.head, timeout=20) as head:
            head.put("params", {"v": torch.tensor([1]), "w": torch.full((1 << 18,), 1.0)}, tag=1)
            results = ray.get([on(node).remote(1) for node in nodes], timeout=120)
            for node, got in zip(nodes, results):
                assert got["node"] == node and got["whole"] and got["version"] == 1
                assert got["same_host"]  # the node's relay is on its host: zero-copy
                assert tuple(got["address"]) == deployment.relay_address(node)  # its own node's relay
                assert tuple(got["address"]) != tuple(deployment.head)
            victim = nodes[-1]
            placed = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=victim, soft=False)}
            reader = Reader.options(**placed).remote("t1")
            assert ray.get(reader.read.remote(1), timeout=60) == 1
            before = ray.get(deployment.relays[victim].info.remote())
            ray.kill(deployment.relays[victim], no_restart=False)  # Ray restarts it
            head.put("params", {"v": torch.tensor([2]), "w": torch.full((1 << 18,), 2.0)}, tag=2)
            deadline = time.monotonic() + 90
            while True:
                try:
                    after = ray.get(deployment.relays[victim].info.remote(), timeout=10)
                    if after["pid"] != before["pid"]:
                        break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass
                assert time.monotonic() < deadline, "the killed relay was not restarted"
                time.sleep(0.2)
            assert tuple(after["address"]) == tuple(before["address"])  # same port: clients reconnect
            assert ray.get(reader.read.remote(2), timeout=90) == 2  # the same worker carries on
            got = ray.get(on(victim).remote(2), timeout=120)
            assert got["version"] == 2 and got["whole"] and tuple(got["address"]) == tuple(before["address"])
    finally:
        deployment.stop()
