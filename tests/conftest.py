"""Shared fixtures: a real server process on loopback."""

import os

import pytest

from serverproc import ServerProcess

# Servers and clients fall back to this variable for their token: a developer's
# own must not turn authentication on for every test (the tests that want it set it).
os.environ.pop("TENSORSHARE_TOKEN", None)


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


@pytest.fixture
def client(server):
    import tensorshare

    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        yield c
