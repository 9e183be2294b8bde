"""What a new user sees when something is wrong, end to end: each message of
README's table (tests/readme.py reads it) comes out of the real situation it names
(a TLS server met without TLS, a metrics port taken for the data port, a port
already taken...), word for word where README gives the words, and timeouts bound
what they name."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import tensorshare
from opsproc import OpsServer
from docblocks import message_pattern, messages
from serverproc import ServerProcess
from tensorshare.errors import ConnectionLostError, UsageError, WrongServerError

pytestmark = pytest.mark.process
SERVER = [sys.executable, "-m", "tensorshare_server"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from certs import make_certificates

    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(certs):
    proc = ServerProcess("--tls-cert", certs.cert, "--tls-key", certs.key)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def ops_server():
    proc = OpsServer()
    yield proc
    proc.stop()


def said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], cwd=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


# -- one function per README message: it makes the situation and returns what was said


def tls_without_tls(world) -> str:
    started = time.monotonic()
    with pytest.raises(WrongServerError) as caught:
        tensorshare.Client("127.0.0.1", world["tls"].port, timeout=30)
    assert time.monotonic() - started < 5  # told by the probe, not after the 10 s connect timeout
    assert caught.value.speaks == "TLS"
    return said(caught.value)


def http_port(world) -> str:
    started = time.monotonic()
    with pytest.raises(WrongServerError) as caught:
        tensorshare.Client("127.0.0.1", world["ops"].metrics_port, timeout=5)
    assert time.monotonic() - started < 4
    return said(caught.value)


def nothing_listens(world) -> str:
    from tensorshare import RLWorker

    started = time.monotonic()
    with pytest.raises(ConnectionLostError) as caught:
        RLWorker("127.0.0.1", free_port(), timeout=3)  # keeps trying for timeout, not connect_timeout's 30 s
    assert 2.5 < time.monotonic() - started < 6
    return said(caught.value)


def says_nothing(world) -> str:
    with socket.socket() as listener:  # accepts connections (the kernel does) and never speaks
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        started = time.monotonic()
        with pytest.raises(ConnectionLostError) as caught:
            tensorshare.Client("127.0.0.1", listener.getsockname()[1], timeout=3)
        assert 2.5 < time.monotonic() - started < 5
    return said(caught.value)


def bad_port(world) -> str:
    with pytest.raises(UsageError) as caught:
        tensorshare.Client("127.0.0.1", 70000)
    return said(caught.value)


def nested_tensor(world) -> str:
    with warnings.catch_warnings():  # torch: "nested tensors are a prototype"
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with tensorshare.Client("127.0.0.1", world["ops"].port, timeout=30) as client:
        with pytest.raises(tensorshare.errors.EncodeError) as caught:
            client.put("messages/nested", {"x": nested})
        assert "messages/nested" not in client.list()  # nothing was sent
    return said(caught.value)


NAMEDTUPLE = """
import collections, json, sys, warnings
import tensorshare
Point = collections.namedtuple("Point", "x y")
with tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=30) as client:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        client.put("messages/point", Point(1, 2))
    [back] = client.peek("messages/point")
print(json.dumps({"warnings": [f"{w.category.__name__}: {w.message}" for w in seen], "back": repr(back)}))
"""


def namedtuple(world) -> str:
    out = run([sys.executable, "-c", NAMEDTUPLE, str(world["ops"].port)])
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["back"] == "(1, 2)"  # a plain tuple, as the warning says
    [warning] = result["warnings"]
    return warning


def port_taken(world) -> str:
    out = run([*SERVER, "--port", str(world["ops"].port)])
    assert out.returncode == 3 and out.stdout == ""
    return out.stderr.strip()


def bad_config(world) -> str:
    Path(world["tmp"], "server.toml").write_text('port = 0\nmemry-limit = "8GB"\n')
    out = run([*SERVER, "--config", "server.toml"], cwd=world["tmp"])
    assert out.returncode == 2
    return out.stderr.strip()


def too_large(world) -> str:
    with tensorshare.Client("127.0.0.1", world["small"].port, timeout=30) as client:
        with pytest.raises(tensorshare.errors.TooLargeError) as caught:
            client.put("messages/large", torch.zeros(1 << 20, dtype=torch.uint8))
        assert "messages/large" not in client.list()  # nothing was sent
    return said(caught.value)


def data_dir_in_use(world) -> str:
    data = Path(world["tmp"], "data")
    first = ServerProcess("--data-dir", str(data))
    try:
        out = run([*SERVER, "--port", "0", "--data-dir", str(data)])
    finally:
        first.stop()
    assert out.returncode == 75 and out.stdout == ""
    return out.stderr.strip()


def cli_tls(world) -> str:
    out = run([sys.executable, "-m", "tensorshare.cli", "ls", "--port", str(world["tls"].port)])
    assert out.returncode == 3 and out.stdout == ""
    return out.stderr.strip()


WITHOUT_TLS_EXTRA = """
import sys
sys.modules["OpenSSL"] = None  # as where the tls extra is not installed (pyOpenSSL cannot be imported)
from tensorshare_server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def tls_without_the_extra(world) -> str:
    """``--tls-cert`` without pyOpenSSL: one line naming the extra (it was a traceback
    from Twisted's TLS, imported before the check), and no data directory made."""
    data = Path(world["tmp"], "tls-extra-data")
    out = run([sys.executable, "-c", WITHOUT_TLS_EXTRA, "--port", "0", "--data-dir", str(data),
               "--tls-cert", world["certs"].cert, "--tls-key", world["certs"].key])
    assert out.returncode == 2 and out.stdout == "" and not data.exists(), (out.returncode, out.stderr[-2000:])
    return out.stderr.strip()


def tls_at_plain(world) -> str:
    with pytest.raises(WrongServerError) as caught:
        tensorshare.Client("127.0.0.1", world["ops"].port, tls=True, timeout=10)
    return said(caught.value)


def wrong_token(world) -> str:
    with pytest.raises(tensorshare.errors.NotAuthenticatedError) as caught:
        tensorshare.Client("127.0.0.1", world["token"].port, token="not-the-token-0123456789", timeout=10)
    return said(caught.value)


def port_as_str(world) -> str:
    with pytest.raises(UsageError) as caught:
        tensorshare.Client("127.0.0.1", "8000")  # refused before it connects
    return said(caught.value)


def unsendable(value):
    def situation(world) -> str:
        with tensorshare.Client("127.0.0.1", world["ops"].port, timeout=30) as client:
            with pytest.raises(tensorshare.errors.EncodeError) as caught:
                client.put("messages/object", value())
        return said(caught.value)

    situation.__name__ = f"unsendable_{value.__name__}"
    return situation


@dataclasses.dataclass
class Config:
    lr: float = 0.1


def a_dataclass():
    return {"config": Config()}


def a_module():
    return torch.nn.Linear(2, 2)


SITUATIONS = {"is a TLS server: connect": tls_without_tls, "is an HTTP server": http_port,
              "cannot connect to": nothing_listens, "no tensorshare greeting": says_nothing,
              "port must be a TCP port": bad_port, "nested tensors": nested_tensor, "(a namedtuple)": namedtuple,
              "the port is taken": port_taken, "unknown option": bad_config, "add --tls": cli_tls,
              "its --max-frame": too_large, "is in use by": data_dir_in_use,
              "a tensorshare server without TLS": tls_at_plain, "is not the server's": wrong_token,
              "port must be an int": port_as_str, "TLS needs pyOpenSSL": tls_without_the_extra, "dataclasses.asdict": unsendable(a_dataclass),
              "module.state_dict()": unsendable(a_module)}


@pytest.fixture(scope="module")
def small_frames():
    proc = ServerProcess("--max-frame", "64KiB")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def world(tls_server, ops_server, small_frames, token_server, certs, tmp_path_factory):
    return {"tls": tls_server, "ops": ops_server, "small": small_frames, "token": token_server, "certs": certs,
            "tmp": tmp_path_factory.mktemp("messages")}


def situation_of(message: str):
    [key] = [key for key in SITUATIONS if key in message]
    return SITUATIONS[key]


def test_every_message_has_its_situation():
    rows = messages()
    assert sorted(situation_of(message).__name__ for message, _ in rows) == sorted(f.__name__ for f in
                                                                                   SITUATIONS.values())


@pytest.mark.parametrize("message", [message for message, _ in messages()], ids=lambda m: m[:50])
def test_readme_message(message, world):
    actual = situation_of(message)(world)
    assert "\n" not in actual, actual  # one line
    assert message_pattern(message).fullmatch(actual), f"the documentation says:\n{message}\nthe run said:\n{actual}"


# -- more of the same kind, not in README's table


def test_a_call_timeout_bounds_the_connect_and_the_server_is_told_apart_from_its_probe(world):
    """A silent peer that is a tensorshare server after all (one too busy to greet in
    time) is not taken for TLS or HTTP: the probe found its greeting."""
    from tensorshare.protocol import peers

    assert peers.probe("127.0.0.1", world["ops"].port, 5)[0] == peers.TENSORSHARE
    assert peers.probe("127.0.0.1", world["tls"].port, 5)[0] == peers.TLS
    assert peers.probe("127.0.0.1", world["ops"].metrics_port, 5)[0] == peers.HTTP
    with pytest.raises(UsageError, match="timeout must be a positive number"):
        tensorshare.Client("127.0.0.1", world["ops"].port, timeout=-1)
    with pytest.raises(UsageError, match="connect_timeout must be a positive number"):
        tensorshare.Client("127.0.0.1", world["ops"].port, connect_timeout=0)


ASYNC = """
import sys
from twisted.internet import task
from tensorshare import AsyncClient

def main(reactor):
    d = AsyncClient.connect("127.0.0.1", int(sys.argv[1]), reactor=reactor, timeout=5)
    d.addCallbacks(lambda client: print("connected"), lambda f: print(f"{type(f.value).__name__}: {f.value}"))
    return d

task.react(main)
"""


def test_the_async_client_tells_an_http_port_too(world):
    started = time.monotonic()
    out = run([sys.executable, "-c", ASYNC, str(world["ops"].metrics_port)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("WrongServerError: ") and "is an HTTP server" in out.stdout, out.stdout
    assert time.monotonic() - started < 15  # the probe, at 1 s (the rest is starting Python and torch)


def test_a_server_says_in_one_line_why_it_cannot_listen(world):
    out = run([*SERVER, "--host", "10.255.255.1", "--port", "0"])  # not an address of this host
    assert out.returncode == 3 and out.stderr.strip() == (
        "tensorshare-server: cannot listen on 10.255.255.1:0: 10.255.255.1 is not an address of this host "
        "(--host, or --metrics-host)")
    taken = run([*SERVER, "--port", "0", "--metrics-port", str(world["ops"].metrics_port)])
    assert taken.returncode == 3 and len(taken.stderr.strip().splitlines()) == 1
    assert "taken by an HTTP server" in taken.stderr and "--metrics-port" in taken.stderr
    for argv, words in ((["--port", "70000"], "not a TCP port (0 to 65535): '70000'"),
                        (["--metrics-port", "x"], "not a TCP port"),
                        (["--log-level", "LOUD"], "unknown --log-level 'LOUD'")):
        usage = run([*SERVER, *argv])
        assert usage.returncode == 2 and words in usage.stderr and len(usage.stderr.splitlines()) <= 2, usage.stderr


@pytest.mark.parametrize("toml, words", [
    ('memory-limit = "8XB"', "server.toml: memory-limit = '8XB': not a size: '8XB' (try 512MiB or 8GB)"),
    ('log-format = "xml"', "server.toml: log-format = 'xml': one of text, json"),
    ("port = 70000", "server.toml: port = 70000: not a TCP port (0 to 65535): '70000'"),
    ("port = ", "config file server.toml is not valid TOML: "),
])
def test_a_bad_config_file_is_one_line(toml, words, tmp_path):
    (tmp_path / "server.toml").write_text(toml + "\n")
    out = run([*SERVER, "--config", "server.toml"], cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith(f"tensorshare-server: {words}"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_wrong_server_is_not_tried_again(world):
    """connect() and the RL peers retry a server that is not up yet, never one that
    answered as something else: that would only meet it again until the timeout."""
    from tensorshare import RLWorker

    started = time.monotonic()
    with pytest.raises(WrongServerError, match="is a TLS server"):
        RLWorker("127.0.0.1", world["tls"].port, timeout=30)
    assert time.monotonic() - started < 5


IN_PROCESS_ON_A_TAKEN_PORT = """
import sys
from tensorshare import run_server
from tensorshare.errors import UsageError
try:
    run_server(int(sys.argv[1]), start_reactor=False, data_dir=sys.argv[2])
except UsageError as exc:
    print(exc)
"""


def test_a_server_that_cannot_start_says_so_in_one_line_and_makes_nothing(world):
    """``run_server(port, start_reactor=False)`` on a taken port raises UsageError with
    tensorshare-server's one line (it was 30 lines of Twisted traceback), and neither
    it nor the command leaves the ``--data-dir`` it would have made."""
    data = Path(world["tmp"], "never-made")
    out = run([sys.executable, "-c", IN_PROCESS_ON_A_TAKEN_PORT, str(world["ops"].port), str(data)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"cannot listen on 127.0.0.1:{world['ops'].port}: the port is taken by a "
                                 f"tensorshare server"), out.stdout
    assert not data.exists()
    command = run([*SERVER, "--port", str(world["ops"].port), "--data-dir", str(data)])
    assert command.returncode == 3 and not data.exists(), command.stderr
