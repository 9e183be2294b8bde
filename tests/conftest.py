"""Shared fixtures: a real server process on loopback."""

import glob
import os
import shutil
import signal
import tempfile

import pytest

from serverproc import STARTED, ServerProcess


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """After the whole run, no server the tests started has left anything in /dev/shm.

    Servers killed with SIGKILL leave their area to the next server that starts, so
    one more server starts (and stops) before the check."""
    yield
    if not STARTED or not os.path.isdir("/dev/shm"):
        return
    ServerProcess().stop()
    left = [path for pid in STARTED for path in glob.glob(f"/dev/shm/tensorshare-{pid}-*")]
    assert not left, f"shared memory left behind: {left}"

# Where writing bytecode is turned off (PYTHONDONTWRITEBYTECODE), each of the hundreds
# of processes the tests start (servers, clients, examples) would compile the package
# again: ~0.15 s of CPU per server start.  They share a bytecode cache of this run's
# own instead (removed at the end), so nothing is written beside the sources.
PYCACHE = None
if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
    PYCACHE = tempfile.mkdtemp(prefix="tensorshare-tests-pycache-")
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = PYCACHE


def pytest_unconfigure(config):
    if PYCACHE is not None:
        shutil.rmtree(PYCACHE, ignore_errors=True)

# Servers and clients fall back to this variable for their token: a developer's
# own must not turn authentication on for every test (the tests that want it set it).
os.environ.pop("TENSORSHARE_TOKEN", None)

# A run started in the background of a non-interactive shell inherits SIGINT ignored,
# and so would every process the tests start: the tests of Ctrl-C (a server's clean
# stop, an interrupted wait) then wait out their time limits and fail.  Python's own
# handler here means a default one in every child after exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Fixtures that start server processes: tests using them are marked ``process``
# (``pytest -m "not process"`` runs the in-memory tests alone, in seconds).
PROCESS_FIXTURES = {"server", "fresh_server", "client", "auth_server", "tls_server", "every_item", "fuzz_server",
                    "token_server"}


# The modules that take longest (seconds of a whole run on 2 cores), run first: run in
# parallel processes a module at a time (scripts/dev.py test), a long one started last
# would keep one process busy after the others ran out of modules.
LONGEST_FIRST = ("test_bench_smoke", "test_install", "test_hardening", "test_examples", "test_doc_blocks",
                 "test_security", "test_messages", "test_disk", "test_rl_runs", "test_hardening_three",
                 "test_ray", "test_relay", "test_load", "test_rl", "test_hardening_four", "test_workers",
                 "test_multihost", "test_zerocopy", "test_fuzz", "test_flow", "test_original")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))


@pytest.fixture(scope="module")
def server():
    """One server process for a test module (tests use distinct bin names)."""
    proc = ServerProcess()
    yield proc
    proc.stop()


@pytest.fixture
def fresh_server():
    """A server process of the test's own (for restarts and kills)."""
    proc = ServerProcess()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """A server process that asks for ``opsproc.TOKEN`` (from a token file), with its
    operations pages."""
    from opsproc import TOKEN, OpsServer

    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    proc = OpsServer("--token-file", str(path))
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    import tensorshare

    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        yield c
