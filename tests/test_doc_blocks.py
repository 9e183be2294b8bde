"""The user documentation, end to end: every bash, Python and TOML block of README.md,
the site's home page, quickstart and guides runs as written against real servers
started the documented way, or is marked as needing what a test cannot have
(tests/docblocks.py says which pages, how blocks are marked and what is replaced in
them).

A fragment that uses objects of the reader's own (a ``policy``, an ``env``, a
``batch``) runs after a few lines that make small ones (:data:`CHECKS`).  Python
blocks run in one child process, one after another, each in a namespace of its
own and a directory of its own; a line whose comment says ``# raises
NoSuchBinError`` must raise it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tensorshare
from docblocks import PATHS, ROOT, Block, all_blocks, expect_raises, localize
from serverproc import ServerProcess

pytestmark = pytest.mark.process
BIN = Path(sys.executable).parent  # the environment's tensorshare-server and tensorshare commands
LISTENING = re.compile(r"listening on [\d.]+:(\d+)")

# What a marked fragment needs before it (and after it, to end what it started),
# as Python: {SERVER}, {RELAY} are the test's ports.
CHECKS = {
    "rl": ("""
import threading, torch
from tensorshare import RLWorker
policy = torch.nn.Linear(4, 2)
rollout = {"obs": torch.randn(8, 4), "reward": torch.ones(8)}

def feed():  # the workers whose rollouts the trainer's get_data waits for
    feeder = RLWorker("127.0.0.1", {SERVER}, experiment="corridor", worker_id="feeder")
    feeder.await_new_parameters(timeout=60)
    for _ in range(80):
        feeder.add_data(rollout)
    feeder.flush(timeout=60)
    feeder.stop()

feeding = threading.Thread(target=feed)
feeding.start()
""", """
feeding.join(60)
assert len(batch) == 32, len(batch)
worker.stop(); trainer.stop()
"""),
    "rl-versions": ("""
import torch
from tensorshare import RLTrainer, RLWorker
policy, actor = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
trainer = RLTrainer("127.0.0.1", {SERVER}, experiment="versions")
worker = RLWorker("127.0.0.1", {SERVER}, experiment="versions")
""", """
assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(actor.state_dict().values(), params.values()))
worker.stop(); trainer.stop()
"""),
    "tables": ("""
import torch, tensorshare
client = tensorshare.Client("127.0.0.1", {SERVER}, timeout=60)
""", """
assert s.value["obs"].shape == (256, 4, 84, 84) and rows["reward"].shape == (3,)
assert client.table_info("replay-copy")["size"] == 64
client.delete("replay"); client.delete("replay-copy"); client.close()
"""),
    "torchrl": ("""
import torch, tensorshare
client = tensorshare.Client("127.0.0.1", {SERVER}, timeout=60)
""", """
assert data.batch_size == (256,) and sample["priority_weight"].shape == (64,)
assert client.table_info("per")["sampler"] == "prioritized"
client.delete("transitions"); client.delete("per"); client.close()
"""),
    "checkpoints": ("""
import torch, tensorshare
client = tensorshare.Client("127.0.0.1", {SERVER}, timeout=60)
client.put("params", {"w": torch.randn(64, 64)})
model = torch.nn.Linear(4, 2)
""", """
assert torch.equal(items[0]["w"], client.peek("params")[0]["w"])
assert torch.equal(state["weight"], model.state_dict()["weight"])
client.close()
"""),
    "zero-copy": ("""
import torch, tensorshare
state_dict = {"w": torch.randn(512, 512)}

class Env:
    def fill(self, obs):
        obs.fill_(1)

env = Env()
""", """
with tensorshare.Client("127.0.0.1", {SERVER}) as client:
    [stored] = client.peek("params")
    assert torch.equal(stored["w"], state_dict["w"])  # the += changed the copy only
    client.delete("rollouts")
"""),
    "relay": ("import tensorshare\n", """
assert relay.relay_status()["connected"]
relay.close()
"""),
    "shards": ("""
from tensorshare import RLTrainer, RLWorker
relay_host, relay_port = "127.0.0.1", {RELAY}
""", """
trainer.publish_parameters({"w": 1})
worker.await_new_parameters(timeout=30)
worker.add_data({"obs": 1}); worker.flush(timeout=30)
assert len(trainer.get_data(timeout=30)) == 1
worker.stop(); trainer.stop()
"""),
}
PLAIN_PYTHON = "import torch, tensorshare\n"  # what every block may take as imported


# -- the servers the blocks talk to


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A server started the documented way (the ``tensorshare-server`` command, with its
    status page), a relay following it, two shards beside it on other loopback
    addresses, and a directory to work in."""
    root = tmp_path_factory.mktemp("docs")
    paths = {readme: str(root / "paths" / readme.strip("/").replace("/", "-")) for readme in PATHS}
    os.makedirs(root / "paths")
    Path(paths["/etc/tensorshare/token"]).write_text("readme-token-4f0c9a7e1b2d3c5a\n")
    command = [str(BIN / "tensorshare-server")]
    server = ServerProcess("--metrics-port", "0", command=command)
    metrics = int(re.search(r":(\d+)/", server.proc.stdout.readline()).group(1))
    # The relay and the two shards start side by side (each start is mostly the
    # interpreter's imports); the relay stays second in ``started``.
    others = [("--follow", f"127.0.0.1:{server.port}"), ("--host", "127.0.0.2"), ("--host", "127.0.0.3")]
    with ThreadPoolExecutor(len(others)) as pool:
        starts = [pool.submit(ServerProcess, *args, port=0 if args[0] == "--follow" else server.port,
                              command=command) for args in others]
    started = [server] + [f.result() for f in starts if f.exception() is None]
    failed = next((f.exception() for f in starts if f.exception() is not None), None)
    if failed is not None:
        for proc in started:
            proc.stop()
        raise failed
    work = root / "work"
    work.mkdir()
    yield {"ports": {"server": server.port, "relay": started[1].port, "metrics": metrics}, "paths": paths,
           "cwd": work}
    for proc in started:
        proc.stop()


def _env(world) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSHARE_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", TENSORSHARE_PORT=str(world["ports"]["server"]),
               PYTHONUNBUFFERED="1")
    return env


def workdir(block: Block, world) -> Path:
    """A directory of the block's own to run in (its relative paths land there)."""
    path = world["cwd"] / f"{block.path.stem}-{block.line}"
    path.mkdir(exist_ok=True)
    return path


def first_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The first line ``proc`` prints, or "" if none comes within ``timeout`` seconds."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


# -- Python


def python_source(block: Block, world) -> str:
    """The program a Python block runs as: what its check supplies around it, the
    block with the test's addresses, and ``# raises`` lines checked."""
    before, after = CHECKS.get(block.check, (PLAIN_PYTHON, ""))
    ports = {"SERVER": world["ports"]["server"], "RELAY": world["ports"]["relay"]}
    fill = lambda text: text.replace("{SERVER}", str(ports["SERVER"])).replace("{RELAY}", str(ports["RELAY"]))
    body = expect_raises(localize(block.text, world["ports"], world["paths"]))
    return fill(before) + body + fill(after)


RUNNER = """
import json, os, sys, traceback
results = {}
for name, source, cwd in json.load(sys.stdin):
    try:
        os.chdir(cwd)
        exec(compile(source, name, "exec"), {"__name__": "__docs__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-3000:]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def python_results(world):
    """Every Python block that runs as it is or with a check, run once, in order, in
    one child process: {block name: None, or the traceback}."""
    runnable = [b for b in BLOCKS if b.lang == "python" and (b.check is None or b.check in CHECKS)]
    sources = [(b.name, python_source(b, world), str(workdir(b, world))) for b in runnable]
    out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(sources), capture_output=True,
                         text=True, timeout=360, cwd=world["cwd"], env=_env(world))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_twisted(block: Block, world) -> None:
    """A block of Deferred code (``yield``) runs as an inlineCallbacks function under react."""
    body = textwrap.indent(localize(block.text, world["ports"], world["paths"]), "    ")
    source = ("import torch\nfrom twisted.internet import defer, task\n\n@defer.inlineCallbacks\n"
              f"def main(reactor):\n{body}    client.close()\n\ntask.react(main)\n")
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60,
                         cwd=workdir(block, world), env=_env(world))
    assert out.returncode == 0, out.stderr[-3000:]


def run_until_stopped(block: Block, world) -> None:
    """A block that serves until stopped, on a port of its own: it must print what its
    marker says, then stop on SIGINT or SIGTERM."""
    ports = {"server": free_port()}
    source = PLAIN_PYTHON + localize(block.text, ports, world["paths"])
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=workdir(block, world), env=_env(world))
    try:
        line = first_line(proc)
        assert block.prints in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert proc.poll() is None, "it stopped by itself"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- shell


def run_shell(block: Block, world) -> None:
    """Run a shell block's commands: servers serve until they say they listen and stop
    cleanly (one after another: a block's servers are alternatives); ``tensorshare ...
    watch`` shows a view and is stopped; other ``tensorshare`` commands must
    succeed, in order.  Anything else has no check here and fails."""
    cwd = workdir(block, world)
    if block.check == "tls":  # the files the block's server is given
        from certs import make_certificates

        (cwd / "certs").mkdir(exist_ok=True)
        made = make_certificates(cwd / "certs")
        for name, path in (("cert.pem", made.cert), ("key.pem", made.key)):
            (cwd / name).write_text(Path(path).read_text())
    if block.check == "cli":  # the bins the block's commands look at
        with tensorshare.Client("127.0.0.1", world["ports"]["server"], timeout=30) as client:
            client.put("cartpole/parameters", {"weight": torch.randn(4, 2), "step": 7}, tag=7)
            client.put("replay/buffer", {"obs": torch.randn(64, 4)})
            client.create_table("replay", 64, {"obs": ((4,), torch.float32)})
            client.insert("replay", {"obs": torch.randn(8, 4)})
    servers, commands = [], []
    for line in block.lines():
        if line.startswith("pip install"):
            continue  # tests/test_install.py runs these
        if line.startswith(("tensorshare-server", "python -m tensorshare_server")):
            # one at a time: a block's server lines are alternatives (two may name one data directory)
            stop(*start(server_line(line, world), world, cwd), LISTENING)
        elif line.startswith("tensorshare ") and line.endswith(" watch"):
            servers.append(start(localize(line, world["ports"], world["paths"]), world, cwd))
        elif line.startswith("tensorshare "):
            commands.append(localize(line, world["ports"], world["paths"]))
        elif line.startswith("python -c "):
            out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60, cwd=cwd,
                                 env=_env(world))
            assert out.returncode == 0, (line, out.stderr[-2000:])
        else:
            pytest.fail(f"no check for this documented command: {line}")
    if commands:  # in one process: the same main() the command runs, torch imported once
        out = subprocess.run([sys.executable, "-c", CLI_RUNNER], input=json.dumps(commands), capture_output=True,
                             text=True, timeout=120, cwd=cwd, env=_env(world))
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    for proc, line in servers:
        stop(proc, line, re.compile(r"\S"))


CLI_RUNNER = """
import json, shlex, sys
from tensorshare.cli import main
for line in json.load(sys.stdin):
    code = main(shlex.split(line)[1:])
    if code:
        sys.exit(f"{line}: exit status {code}")
"""


def server_line(line: str, world) -> str:
    """A documented server command on ports of its own (those it names of others stay the test's)."""
    line = re.sub(r"--(port|metrics-port) \d+", r"--\1 0", line)
    if "--port" not in line and "--config" not in line:
        line += " --port 0"
    return localize(line, world["ports"], world["paths"])


def start(line: str, world, cwd: Path) -> tuple[subprocess.Popen, str]:
    return subprocess.Popen(["bash", "-c", f"exec {line}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env=_env(world)), line


def stop(proc: subprocess.Popen, line: str, ready: re.Pattern) -> None:
    """Once ``proc`` printed what shows it is ready, stop it; a server must stop cleanly."""
    try:
        first = first_line(proc)
        assert ready.search(first), (line, first, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.terminate()
        code = proc.wait(30)
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    if ready is LISTENING:
        assert code == 0, (line, code, stderr[-2000:])  # a server stops cleanly on SIGTERM


def run_toml(block: Block, world) -> None:
    """A config file: a server started with it (on ports of its own) must listen."""
    text = re.sub(r"^(port|metrics-port) = \d+$", r"\1 = 0", block.text, flags=re.M)
    cwd = workdir(block, world)
    (cwd / "server.toml").write_text(localize(text, world["ports"], world["paths"]))
    stop(*start("tensorshare-server --config server.toml", world, cwd), LISTENING)


# -- the tests


BLOCKS = all_blocks()


def test_every_block_is_checked_or_says_why_not():
    known = {*CHECKS, "twisted", "tls", "cli", "install"}
    for block in BLOCKS:
        assert block.check is None or block.check in known or block.needs or block.prints, \
            f"{block.path.relative_to(ROOT)} line {block.line}: unknown check {block.check!r}"
    used = {block.check for block in BLOCKS}
    assert known <= used, f"checks no documented block uses any more: {known - used}"


def test_every_page_with_code_is_checked():
    """A page of the site that shows code to run is one of the checked documents (a
    new guide is picked up by its folder; a page elsewhere must be added)."""
    from docblocks import DOCS, blocks, documents

    unchecked = [path.relative_to(ROOT) for path in sorted(DOCS.rglob("*.md"))
                 if path not in documents() and path.name not in ("design.md", "reliability.md") and blocks(path)]
    assert not unchecked, f"pages with code blocks no test runs: {unchecked}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.check != "install"], ids=lambda b: b.name)
def test_doc_block(block, world, python_results):
    if block.needs:
        pytest.skip(f"needs {block.needs}")
    if block.lang == "python":
        if block.prints:
            run_until_stopped(block, world)
        elif block.check == "twisted":
            run_twisted(block, world)
        else:
            assert python_results[block.name] is None, python_results[block.name]
    elif block.lang == "bash":
        run_shell(block, world)
    else:
        run_toml(block, world)
