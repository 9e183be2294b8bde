"""Operating a server (issue #21): /metrics, /status.json and the status page,
against a real server process over HTTP; counters in memory."""

from __future__ import annotations

import json
import os
from html.parser import HTMLParser

import pytest
import torch

import tensorshare
from opsproc import TOKEN, OpsServer, http_get
from pairing import Pair
from tensorshare.protocol.messages import APPEND, GET, PEEK, PUT, TCREATE, TINSERT, TSAMPLE, Key, TableKey
from tensorshare_server.ops.counters import experiment_of, worker_of
from tensorshare_server.ops import page, prom
from tensorshare_server.bins.store import tier_of
from tensorshare_server.ops.status import Throughput, snapshot

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client is a test dependency")



@pytest.fixture(scope="module")
def ops_server():
    proc = OpsServer()
    yield proc
    proc.stop()


def metrics(server, headers=None) -> dict:
    """``{(name, labels...): value}`` of every sample of /metrics, parsed by prometheus_client."""
    status, _, body = http_get(server.url("/metrics"), headers)
    assert status == 200, body
    samples = {}
    for family in parser.text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return samples


def status_json(server, headers=None) -> dict:
    status, head, body = http_get(server.url("/status.json"), headers)
    assert status == 200, body
    assert head["Content-Type"] == "application/json"
    return json.loads(body)


class Tables(HTMLParser):
    """The page's tables: ``{id: [[cell, ...], ...]}`` (header rows included)."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table = self._row = self._cell = None
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id", "?"), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "a":
            self.links.append(attrs.get("href", ""))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.mark.process
def test_metrics_count_known_activity(ops_server):
    before = metrics(ops_server)
    value = torch.arange(1024, dtype=torch.float32)  # 4096 payload bytes
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30, zero_copy=False) as c:
        c.put("m/a", value)
        for _ in range(3):
            c.append("m/b", value)
        c.peek("m/a")
        assert len(c.get("m/b")) == 3
        with pytest.raises(tensorshare.NoSuchBinError):
            c.get("m/none")
        after = metrics(ops_server)
    def delta(*key):
        return after.get(key, 0) - before.get(key, 0)
    assert delta("tensorshare_requests_total", ("verb", "PUT")) == 1
    assert delta("tensorshare_requests_total", ("verb", "APPEND")) == 3
    assert delta("tensorshare_requests_total", ("verb", "GET")) == 1  # the refused one counts as refused only
    assert delta("tensorshare_refusals_total", ("code", "550")) == 1
    assert delta("tensorshare_request_payload_bytes_total", ("verb", "APPEND")) == 3 * 4096
    assert delta("tensorshare_reply_payload_bytes_total", ("verb", "PEEK")) == 4096
    assert delta("tensorshare_reply_payload_bytes_total", ("verb", "GET")) == 3 * 4096
    assert delta("tensorshare_request_latency_seconds_count", ("verb", "APPEND")) == 3
    assert after[("tensorshare_request_latency_seconds_bucket", ("le", "+Inf"), ("verb", "APPEND"))] == \
        after[("tensorshare_request_latency_seconds_count", ("verb", "APPEND"))]
    assert delta("tensorshare_connections_accepted_total") == 1
    assert delta("tensorshare_received_bytes_total") > 4 * 4096
    assert delta("tensorshare_sent_bytes_total") > 4 * 4096
    assert after[("tensorshare_item_bytes", ("tier", "memory"))] >= 4096  # m/a is still there
    assert after[("tensorshare_connections",)] >= 1
    assert after[("tensorshare_process_resident_memory_bytes",)] > 1 << 20


@pytest.mark.process
def test_status_json_bins_clients_and_experiments(ops_server):
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as trainer, \
            tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as worker:
        trainer.put("exp1/parameters", {"version": 5, "parameters": torch.ones(4)}, tag=5)
        worker.peek("exp1/parameters")  # holds version 5
        worker.append("exp1/rollouts", {"version": 5, "data": torch.ones(2)}, tag=5)
        worker.append("exp1/rollouts", {"version": 4, "data": torch.ones(2)}, tag=4)  # stale
        trainer.put("exp1/parameters", {"version": 6, "parameters": torch.ones(4)}, tag=6)
        data = status_json(ops_server)
    bins = {b["name"]: b for b in data["bins"]}
    assert bins["exp1/rollouts"]["items"] == 2 and bins["exp1/parameters"]["tag"] == 6
    assert sum(bins["exp1/parameters"]["tiers"].values()) == bins["exp1/parameters"]["bytes"] > 0
    experiment = data["experiments"]["exp1"]
    assert experiment["latest"] == 6 and experiment["rollouts"] == 2 and experiment["stale"] == 1
    clients = {c["id"]: c for c in data["clients"]}
    assert len(clients) >= 2
    versions = sorted(c["versions"].get("exp1") for c in clients.values() if "exp1" in c["versions"])
    assert versions == [4, 6]  # the worker last stamped a rollout with 4; the trainer published 6
    lags = sorted(c["lag"]["exp1"] for c in clients.values() if "exp1" in c["lag"])
    assert lags == [0, 2]
    assert data["connections"]["open"] >= 2
    assert data["verbs"]["PUT"]["requests"] >= 2
    assert data["server"]["port"] == ops_server.port


@pytest.mark.process
def test_status_page_tables(ops_server):
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as c:
        c.put("page/<b>bold</b>", torch.zeros(16))  # a bin name is shown escaped
        status, head, body = http_get(ops_server.url("/"))
    assert status == 200 and head["Content-Type"].startswith("text/html")
    html = body.decode()
    assert "<b>bold</b>" not in html and "&lt;b&gt;bold&lt;/b&gt;" in html
    assert '<meta http-equiv="refresh"' in html and "<svg" in html
    page = Tables()
    page.feed(html)
    assert {"bins", "clients", "summary", "limits", "experiments"} <= set(page.tables)
    bins = page.tables["bins"]
    assert bins[0][:3] == ["bin", "items", "bytes"]
    row = next(r for r in bins[1:] if r[0] == "page/<b>bold</b>")
    assert row[1] == "1" and row[2] == "64 B"
    clients = page.tables["clients"]
    # (this process's client, on the same-host Unix socket: named by its process)
    assert clients[0][:2] == ["conn", "address"] and any(r[1] == f"local:pid{os.getpid()}" for r in clients[1:])
    assert http_get(ops_server.url("/nothing"))[0] == 404


@pytest.mark.process
def test_status_page_says_what_its_figures_count():
    """``--memory-limit 64MB`` is 64,000,000 bytes: the page shows it in bytes beside its
    61.0 MiB (which read as a wrong limit); the RL column counts rollouts older than
    the latest version, which is not what a trainer drops as stale, and says so."""
    server = OpsServer("--memory-limit", "64MB")
    try:
        page = Tables()
        page.feed(http_get(server.url("/"))[2].decode())
    finally:
        server.stop()
    limits = {row[0]: row[1] for row in page.tables["limits"] if len(row) == 2}
    assert limits["memory limit"] == "61.0 MiB = 64,000,000 bytes", limits
    assert page.tables["experiments"][0][3] == "older than latest"


@pytest.mark.process
def test_auth_failures_are_counted(token_server):
    ok = {"Authorization": f"Bearer {TOKEN}"}
    before = metrics(token_server, ok)[("tensorshare_auth_failures_total",)]
    with pytest.raises(tensorshare.AuthenticationError):
        tensorshare.Client("127.0.0.1", token_server.port, token="not-the-token-at-all-xx", timeout=10,
                           reconnect=False)
    assert metrics(token_server, ok)[("tensorshare_auth_failures_total",)] == before + 1


@pytest.mark.process
@pytest.mark.parametrize("path", ["/", "/metrics", "/status.json"])
def test_token_protects_every_path(token_server, path):
    url = token_server.url(path)
    assert http_get(url)[0] == 401
    status, head, _ = http_get(url, {"Authorization": "Bearer wrong-token"})
    assert status == 401 and head["WWW-Authenticate"].startswith("Bearer")
    assert http_get(url + "?token=wrong")[0] == 401
    assert http_get(url, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    status, _, body = http_get(url + f"?token={TOKEN}")
    assert status == 200
    if path == "/":  # the page's links keep the token
        page = Tables()
        page.feed(body.decode())
        assert f"status.json?token={TOKEN}" in page.links


# -- in memory


def test_experiment_names():
    assert experiment_of("parameters", "parameters") == ""
    assert experiment_of("a/b/parameters", "parameters") == "a/b"
    assert experiment_of("xparameters", "parameters") is None
    assert experiment_of("a/rollouts", "parameters") is None
    assert worker_of("workers/w1") == ("", "w1") and worker_of("a/b/workers/w1") == ("a/b", "w1")
    assert worker_of("a/workersx/w1") is None and worker_of("/workers/x") is None


def test_counters_and_tiers_in_memory(tmp_path):
    pair = Pair(metrics_port=0, memory_limit=64 << 10, spill_dir=str(tmp_path), zero_copy=False)
    try:
        for i in range(4):  # 4 x 40 KB over a 64 KiB budget: the oldest spill
            pair.call(APPEND, {"bin": "t"}, torch.zeros(10_000))
        pair.call(PUT, {"bin": "rollouts", "tag": 2}, torch.ones(3))  # the default experiment's bins
        pair.call(PEEK, {"bin": "t"})
        with pytest.raises(tensorshare.NoSuchBinError):
            pair.call(GET, {"bin": "missing"})
        data = snapshot(pair.state)
        tiers = data["tiers"]
        assert tiers["memory"]["items"] + tiers["spilled"]["items"] == 5
        assert tiers["spilled"]["items"] >= 1 and tiers["spilled"]["bytes"] >= 40_000
        assert data["verbs"]["APPEND"]["requests"] == 4 and data["verbs"]["PEEK"]["bytes_out"] == 160_000
        assert data["refused"] == {"550": 1}
        assert data["clients"][0]["requests"] == 6
        pair.call(APPEND, {"bin": "rollouts", "tag": 1}, torch.ones(3))
        assert pair.session.stats.versions == {"": 1}
        pair.call(PUT, {"bin": "exp/workers/w-1", "tag": 4}, {"id": "w-1"})  # an RLWorker's presence
        assert pair.session.stats.versions == {"": 1, "exp": 4}
    finally:
        pair.close()


def _walked(state) -> dict:
    """Every bin's ``{tier: (items, bytes)}`` found by looking at each item: what the
    store's running counts must say."""
    out = {}
    for name in state.storage.view.names():
        tiers: dict = {}
        for item in state.storage.store.items_of(name):
            n, nbytes = tiers.get(tier_of(item), (0, 0))
            tiers[tier_of(item)] = (n + 1, nbytes + item.nbytes)
        out[name] = tiers
    return out


def _counted(state) -> dict:
    return {b.name: {t: (b.tier_items[t], b.tiers[t]) for t in b.tiers} for b in state.storage.view.bins()}


def test_tier_counts_follow_items_as_they_come_move_and_go(tmp_path):
    """The status page's counts by tier are kept as items change, not walked at each
    scrape: after each step (spills, a partial GET, a copy into shared memory, a
    put by reference filled later, a durable server's items) they match a walk."""
    pair = Pair(metrics_port=0, memory_limit=96 << 10, spill_dir=str(tmp_path / "spill"), same_host=True)
    try:
        state = pair.state
        steps = [lambda i=i: pair.call(APPEND, {"bin": "a"}, torch.full((5_000,), float(i))) for i in range(6)]
        steps += [lambda: pair.call(PUT, {"bin": "b"}, torch.ones(100)),
                  lambda: pair.call(GET, {"bin": "a", "max": 2}),  # the oldest two (spilled) leave
                  lambda: state.storage.sharing.promote_now(state.storage.store.items_of("b")[0]),
                  lambda: pair.call(APPEND, {"bin": "b"}, torch.ones(100)),
                  lambda: pair.call(GET, {"bin": "b", "max": 1}),  # the one in shared memory leaves
                  lambda: pair.call(APPEND, {"bin": "a"}, torch.ones(30_000)),  # more spills
                  lambda: pair.call(GET, {"bin": "a"})]
        seen = set()
        for step in steps:
            step()
            assert _counted(state) == _walked(state)
            seen |= {tier for tiers in _walked(state).values() for tier in tiers}
        assert seen == {"memory", "spilled", "shm"}
    finally:
        pair.close()
    durable = Pair(data_dir=str(tmp_path / "data"), metrics_port=0)
    try:
        for i in range(3):
            durable.call(APPEND, {"bin": "d"}, torch.ones(10))
        durable.call(GET, {"bin": "d", "max": 1})
        assert _counted(durable.state) == _walked(durable.state)
        assert list(_walked(durable.state)["d"]) == ["durable"] and _walked(durable.state)["d"]["durable"][0] == 2
    finally:
        durable.close()


def _chromium() -> str | None:
    import shutil

    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.process
def test_page_renders_in_headless_chromium(ops_server, tmp_path):
    """The page as a browser builds it (scripts/status_screenshot.py makes docs/status-page.png the same way)."""
    import subprocess

    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium here (apt-get install chromium)")
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as c:
        c.put("browser/bin", torch.ones(8))
        flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"]
        dom = subprocess.run([*flags, "--dump-dom", ops_server.url("/")], capture_output=True, text=True,
                             timeout=90)
        shot = tmp_path / "page.png"
        subprocess.run([*flags, f"--screenshot={shot}", ops_server.url("/")], capture_output=True, timeout=90)
    page = Tables()
    page.feed(dom.stdout)
    assert any(row[0] == "browser/bin" for row in page.tables["bins"][1:]), dom.stderr[-2000:]
    assert "<svg" in dom.stdout
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@pytest.mark.process
def test_rl_experiment_seen_through_the_wrappers(ops_server):
    """A real RLTrainer and RLWorker: the status shows the latest version, the rollouts
    received and the version the worker holds, and /metrics the same."""
    from tensorshare import RLTrainer, RLWorker

    trainer = RLTrainer("127.0.0.1", ops_server.port, experiment="rlview")
    worker = RLWorker("127.0.0.1", ops_server.port, experiment="rlview")
    try:
        trainer.publish_parameters({"w": torch.ones(4)})  # version 0
        assert worker.await_new_parameters(timeout=30) is not None and worker.version == 0
        for _ in range(3):
            worker.add_data({"obs": torch.ones(2)})
        worker.flush(timeout=30)
        trainer.publish_parameters({"w": torch.zeros(4)})  # version 1: the worker now lags by one
        data = status_json(ops_server)
        experiment = data["experiments"]["rlview"]
        assert experiment["latest"] == 1 and experiment["rollouts"] == 3 and experiment["stale"] == 0
        assert 0 in experiment["workers"].values()  # the worker's connection holds version 0
        lags = [c["lag"].get("rlview") for c in data["clients"]]
        assert 1 in lags
        # each client is named by what it is in the experiment: the trainer, or the worker by its id
        roles = sorted(c["roles"]["rlview"] for c in data["clients"] if "rlview" in c.get("roles", {}))
        assert roles == sorted(["trainer", worker.worker_id])
        assert sorted(experiment["roles"].values()) == roles
        page = Tables()
        page.feed(http_get(ops_server.url("/"))[2].decode())
        cells = [row[3] for row in page.tables["clients"][1:]]
        assert f"rlview: worker {worker.worker_id} at v0 (1 behind)" in cells and "rlview: trainer at v1" in cells
        samples = metrics(ops_server)
        assert samples[("tensorshare_rl_latest_version", ("experiment", "rlview"))] == 1
        assert samples[("tensorshare_rl_rollouts_total", ("experiment", "rlview"))] == 3
        versions = [v for k, v in samples.items() if k[0] == "tensorshare_rl_worker_version"
                    and ("experiment", "rlview") in k]
        assert 0 in versions
    finally:
        worker.stop()
        trainer.stop()


@pytest.mark.process
def test_a_dropped_slow_reader_is_counted():
    from wiretools import RawConnection, raw_frame, wait_for

    server = OpsServer("--max-outbound", "1MiB", "--outbound-stall-timeout", "1")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            client.put("slow/item", torch.arange(1 << 20, dtype=torch.int32))  # 4 MiB
            stuck = RawConnection(server.port, rcvbuf=4096)
            stuck.send(raw_frame(1, "PEEK", "slow/item"))  # and never reads the reply

            def dropped() -> float:
                return metrics(server)[("tensorshare_slow_readers_dropped_total",)]

            assert wait_for(lambda: dropped() == 1, timeout=15)
            assert stuck.closed_by_peer(timeout=5)
            assert client.ping() < 5
    finally:
        server.stop()


@pytest.mark.process
def test_disk_full_refusals_are_counted(tmp_path):
    import resource
    import signal

    def file_size_limit() -> None:  # no file may pass 2 MiB: writes past it fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))

    server = OpsServer("--data-dir", str(tmp_path / "d"), preexec_fn=file_size_limit)
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
            refused = 0
            for _ in range(2):
                with pytest.raises(tensorshare.errors.StorageFullError):
                    c.append("full/big", torch.ones(1 << 20))  # 4 MiB: cannot be written
                refused += 1
        samples = metrics(server)
        assert samples[("tensorshare_storage_full_refusals_total",)] == refused
        assert samples[("tensorshare_refusals_total", ("code", "452"))] == refused
    finally:
        server.stop()


def test_tables_in_status_json_metrics_and_the_page_in_memory():
    """Rows, capacity, bytes, rows inserted and sampled and their rates, the seconds
    requests waited for the rate limiter: in the snapshot, /metrics and the page."""
    pair = Pair(metrics_port=0)
    learner = Pair(state=pair.state)
    now = [100.0]
    throughput = Throughput(pair.state.counters, state=pair.state, clock=lambda: now[0])
    try:
        spec = {"capacity": 64, "columns": {"x": {"shape": [4], "dtype": "float32"}}, "min_size_to_sample": 8,
                "samples_per_insert": 1.0, "error_buffer": 16.0}
        pair.call(TCREATE, {Key.BIN: "replay/<i>", TableKey.SPEC: spec})
        throughput.sample()
        pair.call(TINSERT, {Key.BIN: "replay/<i>"}, {"x": torch.zeros(4, 4)})
        rid = learner.send_request(TSAMPLE, {Key.BIN: "replay/<i>", Key.N: 2, Key.WAIT: 5.0})
        learner.clock.advance(2.5)  # waits for min_size_to_sample
        pair.call(TINSERT, {Key.BIN: "replay/<i>"}, {"x": torch.zeros(6, 4)})
        learner.clock.advance(0)
        assert [f.header["code"] for f in learner.receive() if f.header["id"] == rid] == [226]
        now[0] += 2.0
        throughput.sample()
        [row] = snapshot(pair.state, throughput)["tables"]
        assert row["name"] == "replay/<i>" and row["size"] == 10 and row["capacity"] == 64
        assert row["bytes"] == 64 * 16 and row["where"] == "memory" and row["sampler"] == "uniform"
        assert row["inserts"] == 10 and row["samples"] == 2 and row["removals"] == 0
        assert row["inserts_per_s"] == 5.0 and row["samples_per_s"] == 1.0
        assert row["blocked_seconds"] == {"insert": 0.0, "sample": 2.5}
        assert row["waiting"] == {"insert": 0, "sample": 0} and row["samples_per_insert"] == 1.0
        data = snapshot(pair.state, throughput)
        body, _ = prom.exposition(data)
        samples = {(s.name, *sorted(s.labels.items())): s.value
                   for family in parser.text_string_to_metric_families(body.decode()) for s in family.samples}
        label = ("table", "replay/<i>")
        assert samples[("tensorshare_table_rows", label)] == 10
        assert samples[("tensorshare_table_capacity_rows", label)] == 64
        assert samples[("tensorshare_table_bytes", label, ("where", "memory"))] == 1024
        assert samples[("tensorshare_table_inserted_rows_total", label)] == 10
        assert samples[("tensorshare_table_sampled_rows_total", label)] == 2
        assert samples[("tensorshare_table_rate_limiter_blocked_seconds_total", ("op", "sample"), label)] == 2.5
        assert samples[("tensorshare_table_waiting_requests", ("op", "insert"), label)] == 0
        html = page.render(data)
        assert "replay/<i>" not in html  # a name from a client is escaped
        tables = Tables()
        tables.feed(html)
        head, table_row = tables.tables["tables"]
        assert head[:4] == ["table", "rows", "bytes", "where"]
        assert table_row[:4] == ["replay/<i>", "10 / 64", "1.0 KiB", "memory"]
        assert table_row[8:10] == ["5", "1"] and table_row[11] == "0.0s / 2.5s"
        # made again under its name: its counts start from 0 (a negative rate before)
        pair.call(TCREATE, {Key.BIN: "replay/<i>", TableKey.SPEC: {**spec, "capacity": 32}, TableKey.REPLACE: True})
        pair.call(TINSERT, {Key.BIN: "replay/<i>"}, {"x": torch.zeros(2, 4)})
        now[0] += 2.0
        throughput.sample()
        assert "replay/<i>" not in throughput.table_rates()
    finally:
        learner.close()
        pair.close()
