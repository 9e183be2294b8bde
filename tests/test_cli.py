"""The ``tensorshare`` command line tool, end to end against real server processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import tensorshare
from tensorshare.cli import main as cli_main
from opsproc import OpsServer
from serverproc import ServerProcess

TOKEN = "cli-token-0c9f3b2e7d614a58"
pytestmark = pytest.mark.process


@dataclass
class Ran:
    """What a command printed and its exit status."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: dict | None = None) -> Ran:
    """``tensorshare ARGS``, run in this process as ``python -m tensorshare.cli`` runs it
    (``cli.main``), with ``env`` added to a copy of the environment without a token: a
    new process per command cost each test a second and a half of importing torch.
    The entry points themselves run as processes below (``--version``, ``watch | head``)."""
    environment = {k: v for k, v in os.environ.items() if k != "TENSORSHARE_TOKEN"}
    environment.update(env or {})
    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(environment)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(list(args))
            except SystemExit as exc:  # (argparse: a usage error, --help)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def ops_server():
    proc = OpsServer()
    with tensorshare.Client("127.0.0.1", proc.port, timeout=30) as c:
        c.put("cli/a", {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "name": "x"}, tag=7)
        c.append("cli/r", torch.ones(2))
        c.append("cli/r", torch.zeros(3, dtype=torch.int64))
    yield proc
    proc.stop()


def run_json(server, *args: str) -> object:
    out = cli("--port", str(server.port), "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_ls_stat_peek(ops_server):
    listing = {row["bin"]: row["items"] for row in run_json(ops_server, "ls")}
    assert listing["cli/a"] == 1 and listing["cli/r"] == 2
    sized = run_json(ops_server, "--metrics-port", str(ops_server.metrics_port), "ls")
    assert next(r for r in sized if r["bin"] == "cli/r")["bytes"] == 128  # 2 items, each padded to 64 bytes
    stat = run_json(ops_server, "stat", "cli/a")
    assert stat["items"] == 1 and stat["tag"] == 7 and stat["seq"] > 0
    peek = run_json(ops_server, "peek", "cli/a")
    [item] = peek["items"]
    assert item["w"] == {"tensor": "float32", "shape": [3, 4], "bytes": 48, "first": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert item["name"] == "x"
    text = cli("--port", str(ops_server.port), "peek", "cli/r")
    assert text.returncode == 0, text.stderr
    assert "tensor float32 [2]" in text.stdout and "tensor int64 [3]" in text.stdout
    table = cli("--port", str(ops_server.port), "ls", env=TERMINAL)  # rich (installed with the tests)
    assert table.returncode == 0 and "cli/a" in table.stdout and "┃" in table.stdout
    piped = cli("--port", str(ops_server.port), "ls")  # not a terminal: plain text for other tools
    assert piped.stdout.splitlines()[1:4] == ["name   kind  items (rows)", "cli/a  bin   1", "cli/r  bin   2"]


# A terminal of 80 columns, as rich sees one.
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "80", "NO_COLOR": ""}


def test_names_are_never_cut_and_tables_are_marked(ops_server, tmp_path):
    """A long name shows whole in an 80-column terminal (rich cut it to "repla…"), ``ls``
    says which names are tables and takes a glob, key/value views have no empty header
    row, counts read "1 item", ``peek`` of a table says which command shows its rows,
    and both commands tell their version."""
    long = "replay/" + "x" * 45  # wider than what an 80-column terminal left it beside 8 other columns
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as c:
        c.create_table(long, 8, {"obs": ((2,), torch.float32)})
        try:
            for args in (("table", "ls"), ("ls",)):
                out = cli("--port", str(ops_server.port), *args, env=TERMINAL)
                assert out.returncode == 0 and long in out.stdout, out.stdout
            listing = {row["bin"]: row["kind"] for row in run_json(ops_server, "ls")}
            assert listing[long] == "table" and listing["cli/a"] == "bin"
            assert set(row["bin"] for row in run_json(ops_server, "ls", "replay/*")) == {long}
            info = cli("--port", str(ops_server.port), "table", "info", long, env=TERMINAL)
            assert info.returncode == 0 and "┃" not in info.stdout.split("rows")[0], info.stdout  # no header row
            peek = cli("--port", str(ops_server.port), "peek", long)
            assert peek.returncode == 2 and f"tensorshare table sample {long}" in peek.stderr, peek.stderr
            saved = cli("--port", str(ops_server.port), "save", "cli/a", str(tmp_path / "one"))
            assert saved.returncode == 0 and "saved 1 item of cli/a" in saved.stdout, saved.stdout
        finally:
            c.delete(long)
    for command in ([sys.executable, "-m", "tensorshare.cli"], [sys.executable, "-m", "tensorshare_server"]):
        out = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.split()[-1] == tensorshare.__version__, (out.stdout, out.stderr)


def test_save_load_rm(ops_server, tmp_path):
    value = torch.randn(300_000)
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as c:
        c.put("cli/big", value)
        saved = run_json(ops_server, "save", "cli/big", str(tmp_path / "big"))
        assert saved["items"] == 1 and saved["bytes"] >= value.numel() * 4
        again = cli("--port", str(ops_server.port), "save", "cli/big", str(tmp_path / "big"))
        assert again.returncode == 1 and "--overwrite" in again.stderr
        shown = cli("--port", str(ops_server.port), "load", str(tmp_path / "big"), "cli/copy")
        assert shown.returncode == 0, shown.stderr
        assert "load cli/copy" in shown.stderr  # the progress bar (on stderr)
        assert torch.equal(c.peek("cli/copy")[0], value)
        assert run_json(ops_server, "rm", "cli/copy") == {"bin": "cli/copy", "deleted": True}
        assert "cli/copy" not in c.list()
        c.get("cli/big")  # an empty bin: saved, and loaded as such (its load failed: "holds no saved items")
        assert run_json(ops_server, "save", "cli/big", str(tmp_path / "empty"))["items"] == 0
        assert run_json(ops_server, "load", str(tmp_path / "empty"), "cli/none-loaded")["items"] == 0
        # the data port is no status page: said so, without the bytes it sent (they are not text)
        wrong = cli("--port", str(ops_server.port), "ls", "--metrics-port", str(ops_server.port))
        assert wrong.returncode == 3 and "no status page" in wrong.stderr and "TSHR" not in wrong.stderr


def test_errors_and_exit_codes(ops_server, tmp_path):
    port = str(ops_server.port)
    missing = cli("--port", port, "peek", "cli/none")
    assert missing.returncode == 5 and "no bin named 'cli/none'" in missing.stderr
    assert cli("--port", port, "stat", "cli/none").returncode == 5
    assert cli("--port", port, "rm", "cli/none").returncode == 5
    assert cli("--port", port, "load", str(tmp_path / "nowhere"), "x").returncode == 1
    gone = ServerProcess()  # a port where nothing listens any more
    free = str(gone.port)
    gone.stop()
    down = cli("--port", free, "ls")
    assert down.returncode == 3 and "no tensorshare server" in down.stderr
    assert cli("--port", port, "frobnicate").returncode == 2


def test_token(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    server = ServerProcess("--token-file", str(path))
    try:
        port = str(server.port)
        wrong = cli("--port", port, "ls", env={"TENSORSHARE_TOKEN": "not-the-right-token-at-all"})
        assert wrong.returncode == 4 and "authentication failed" in wrong.stderr
        none = cli("--port", port, "ls")
        assert none.returncode == 4
        assert cli("--port", port, "ls", env={"TENSORSHARE_TOKEN": TOKEN}).returncode == 0
        assert cli("--port", port, "--token-file", str(path), "ls").returncode == 0
    finally:
        server.stop()


def test_watch(ops_server):
    lines = cli("--port", str(ops_server.port), "--metrics-port", str(ops_server.metrics_port), "--json", "watch",
                "--count", "2", "--interval", "0.1").stdout.splitlines()
    assert len(lines) == 2
    view = json.loads(lines[-1])
    assert {"bin": "cli/r", "items": 2, "bytes": 128, "tag": None} in view["bins"]  # (data: not "128 B", "-")
    assert {"bin": "cli/a", "items": 1, "tag": 7}.items() <= next(b for b in view["bins"] if b["bin"] == "cli/a").items()
    assert all(isinstance(c["in"], int) for c in view["clients"])
    bare = json.loads(cli("--port", str(ops_server.port), "--json", "watch", "--count", "1").stdout)
    assert {"bin": "cli/r", "items": 2, "bytes": None, "tag": None} in bare["bins"]  # (no status page: not known)
    # (the watching CLI's own connection: TCP, or the same-host Unix socket, named by its process)
    assert view["clients"] and all(c["address"].startswith(("127.0.0.1:", "local:pid")) for c in view["clients"])
    plain = cli("--port", str(ops_server.port), "watch", "--count", "1", env={"TENSORSHARE_PLAIN": "1"})
    assert plain.returncode == 0 and plain.stdout.splitlines()[1].split() == ["bin", "items", "bytes", "tag"]


def test_options_go_before_or_after_the_command(ops_server):
    port = str(ops_server.port)
    after = cli("ls", "--port", port, "--json")
    assert after.returncode == 0, after.stderr
    mixed = cli("--json", "stat", "cli/a", "--port", port)
    assert mixed.returncode == 0 and json.loads(mixed.stdout)["tag"] == 7
    # given on both sides, the one after the command wins, as it was said last
    both = cli("--port", "1", "ls", "--port", port, "--json")
    assert both.returncode == 0 and any(row["bin"] == "cli/a" for row in json.loads(both.stdout))
    env = cli("ls", "--json", env={"TENSORSHARE_PORT": port})
    assert env.returncode == 0


@pytest.mark.parametrize("args, words", [
    (["ls", "--port", "70000"], "argument --port: not a TCP port (1 to 65535): '70000'"),
    (["--port", "0", "ls"], "argument --port: not a TCP port (1 to 65535): '0'"),
    (["ls", "--timeout", "0"], "argument --timeout: not a positive number of seconds: '0'"),
    (["ls", "--metrics-port", "x"], "argument --metrics-port: not a TCP port (1 to 65535): 'x'"),
    (["watch", "--count", "0"], "argument --count: not a count of 1 or more: '0'"),
    (["watch", "--interval", "-1"], "argument --interval: not a positive number of seconds: '-1'"),
])
def test_bad_options_are_usage_errors(args, words):
    out = cli(*args)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    bad_env = cli("ls", env={"TENSORSHARE_PORT": "http"})
    assert bad_env.returncode == 2 and "TENSORSHARE_PORT: not a TCP port" in bad_env.stderr


def test_what_answers_is_named(ops_server):
    """The data port taken for the status page's, and the status page's for the data port."""
    swapped = cli("--port", str(ops_server.metrics_port), "ls")
    assert swapped.returncode == 3
    assert "is an HTTP server, not a tensorshare server: --port is the server's data port" in swapped.stderr
    status = cli("--port", str(ops_server.port), "--metrics-port", str(ops_server.port), "ls")
    assert status.returncode == 3 and "no status page at" in status.stderr, status.stderr


def test_watch_into_a_pipe_prints_each_refresh_and_stops_quietly_when_the_reader_goes(ops_server):
    shown = subprocess.run(f"{sys.executable} -m tensorshare.cli --port {ops_server.port} watch --interval 0.05 "
                           f"| head -3", shell=True, capture_output=True, text=True, timeout=60)
    assert shown.stdout.splitlines()[1].split() == ["bin", "items", "bytes", "tag"]
    assert shown.stderr == ""


def test_table_commands(ops_server, tmp_path):
    port = str(ops_server.port)
    with tensorshare.Client("127.0.0.1", ops_server.port, timeout=30) as c:
        c.create_table("cli/replay", 16, {"obs": ((2,), torch.float32), "step": ((), torch.int64)},
                       sampler="prioritized", samples_per_insert=2.0, error_buffer=8.0)
        c.insert("cli/replay", {"obs": torch.arange(10.0).view(5, 2), "step": torch.arange(5)},
                 priorities=[1, 2, 3, 4, 5])
        [row] = [r for r in run_json(ops_server, "table", "ls") if r["table"] == "cli/replay"]
        assert row["rows"] == 5 and row["capacity"] == 16 and row["sampler"] == "prioritized" and row["bytes"] == 256
        info = cli("--port", port, "stat", "cli/replay")  # stat of a table: what `table info` shows
        assert info.returncode == 0, info.stderr
        assert "5 of 16" in info.stdout and "prioritized" in info.stdout and "obs" in info.stdout
        drawn = run_json(ops_server, "table", "sample", "cli/replay", "-n", "2")
        assert len(drawn["slots"]) == 2 and drawn["rows"]["obs"]["shape"] == [2, 2]
        assert c.table_info("cli/replay")["samples"] == 0  # shown, not sampled
        saved = run_json(ops_server, "save", "cli/replay", str(tmp_path / "replay"))  # save knows tables
        assert saved["items"] == 5
        assert cli("--port", port, "table", "drop", "cli/replay").returncode == 0
        assert "cli/replay" not in c.list()
        loaded = run_json(ops_server, "table", "load", str(tmp_path / "replay"))
        assert loaded == {"dir": str(tmp_path / "replay"), "table": "cli/replay", "rows": 5}
        again = c.table_info("cli/replay", slots=0)
        assert again["sampler"] == "prioritized" and again["rate_limiter"]["samples_per_insert"] == 2.0
        assert again["slots"]["priorities"].tolist() == [1, 2, 3, 4, 5]
        assert c.read("cli/replay", [4])["step"].tolist() == [4]
