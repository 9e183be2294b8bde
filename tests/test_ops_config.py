"""Server logging (a line per connection event, --log-format json) and --config files (issue #21)."""

from __future__ import annotations

import json

import pytest

import tensorshare
from opsproc import OpsServer, http_get
from serverproc import ServerProcess
from tensorshare_server.cli import parse_args

TOKEN = "log-token-7a3c9e1f0b2d4c68"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return str(path)


def test_config_file_sets_options_and_command_line_wins(tmp_path):
    path = write(tmp_path, 'port = 9001\nmemory-limit = "1MiB"\nmax_bins = 3\nfsync = true\ndata-dir = "d"\n'
                           'no-zero-copy = true\nlog-format = "json"\nmetrics-port = 9100\nidle-timeout = 5\n')
    config, args = parse_args(["--config", path, "--port", "0", "--max-bins", "4"])
    assert config.port == 0 and config.max_bins == 4  # the command line wins
    assert config.memory_limit == 1 << 20 and config.fsync and config.data_dir == "d" and not config.zero_copy
    assert config.metrics_port == 9100 and config.idle_timeout == 5.0 and args.log_format == "json"
    config, _ = parse_args(["--config", write(tmp_path, "zero-copy = false\n")])
    assert not config.zero_copy
    config, _ = parse_args(["--config", write(tmp_path, "zero-copy = true\n")])
    assert config.zero_copy


@pytest.mark.parametrize("text, message", [
    ("max-binz = 3\n", "unknown option 'max-binz'"),
    ("fsync = 1\n", "fsync must be true or false"),
    ("memory-limit = \"lots\"\n", "not a size"),
    ("port = [1]\n", "must be a string or a number"),
    ("port = \n", "not valid TOML"),
])
def test_config_file_errors(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", write(tmp_path, text)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-frame", "inf", "not a size"),  # (an OverflowError's traceback before)
    ("--max-frame", "1e400", "not a size"),
    ("--memory-limit", "-5GB", "not negative"),  # (a server on which every put failed)
    ("--max-frame", "-1", "not negative"),
])
def test_size_flags_refuse_what_is_not_a_size(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        parse_args([f"{flag}={value}"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--fsync"], "--fsync needs --data-dir DIR"),
    (["--fsync", "--memory-limit", "1GiB"], "--fsync needs --data-dir DIR"),  # (spilled items are not durable)
    (["--worker-ports", "9100"], "--worker-ports needs --workers N with N > 1"),
    (["--worker-ports", "9100", "--workers", "1"], "--worker-ports needs --workers N with N > 1"),
    (["--follow-bins", "params*"], "--follow-bins needs --follow HOST:PORT"),
    (["--follow-token-file", "t"], "--follow-token-file needs --follow HOST:PORT"),
    (["--follow-tls"], "--follow-tls needs --follow HOST:PORT"),
    (["--follow-tls-ca", "ca.pem"], "--follow-tls-ca needs --follow HOST:PORT"),
    (["--follow-tls-fingerprint", "ab:cd"], "--follow-tls-fingerprint needs --follow HOST:PORT"),
    (["--follow-timeout", "5"], "--follow-timeout needs --follow HOST:PORT"),
    (["--spill-dir", "s"], "--spill-dir needs --memory-limit SIZE and no --data-dir"),
    (["--metrics-host", "0.0.0.0"], "--metrics-host needs --metrics-port PORT"),
    (["--spill-dir", "s", "--memory-limit", "1GiB", "--data-dir", "d"],
     "--spill-dir needs --memory-limit SIZE and no --data-dir"),  # (a durable server spills nothing)
])
def test_an_option_that_would_be_ignored_alone_is_refused(capsys, argv, words):
    """Each of these did nothing without the option it needs, and said nothing."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {words}" in err and "(add " in err, err


@pytest.mark.parametrize("flag, value", [("--shm-dir", "/tmp/elsewhere"), ("--zero-copy-min", "1MiB")])
def test_a_zero_copy_option_beside_no_zero_copy_is_refused(capsys, flag, value):
    """--no-zero-copy makes no shared-memory area: where it would be, and what it would take, mean nothing."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--no-zero-copy", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {flag} is for same-host zero-copy, which --no-zero-copy turns off" in err


def test_such_an_option_from_a_config_file_is_refused_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", write(tmp_path, "fsync = true\n")])
    assert exc.value.code == 2 and "--fsync needs --data-dir DIR" in capsys.readouterr().err


def test_the_options_with_what_they_need_are_taken(tmp_path):
    config, _ = parse_args(["--fsync", "--data-dir", str(tmp_path)])
    assert config.fsync and config.data_dir == str(tmp_path)
    config, _ = parse_args(["--workers", "2", "--worker-ports", "9100"])
    assert (config.workers, config.worker_ports) == (2, 9100)
    config, _ = parse_args(["--follow", "head:8000", "--follow-bins", "params*"])
    assert (config.follow, config.follow_bins) == ("head:8000", "params*")
    config, _ = parse_args(["--follow-bins", "*"])  # (the default: nothing is lost)
    assert config.follow is None
    config, _ = parse_args(["--follow", "head:8000", "--follow-timeout", "5", "--follow-tls"])
    assert (config.follow_timeout, config.follow_tls) == (5.0, True)
    config, _ = parse_args(["--memory-limit", "1GiB", "--spill-dir", str(tmp_path)])
    assert config.spill_dir == str(tmp_path)
    config, _ = parse_args(["--metrics-port", "0", "--metrics-host", "0.0.0.0"])
    assert (config.metrics_port, config.metrics_host) == (0, "0.0.0.0")
    config, _ = parse_args(["--shm-dir", str(tmp_path), "--zero-copy-min", "1MiB"])
    assert (config.shm_dir, config.zero_copy_min, config.zero_copy) == (str(tmp_path), 1 << 20, True)


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "none.toml")])
    assert "cannot read config file" in capsys.readouterr().err


@pytest.mark.process
def test_config_file_runs_a_server(tmp_path):
    path = write(tmp_path, 'max-bins = 2\nmemory-limit = "4MiB"\nport = 1\n')
    server = OpsServer("--config", path)  # --port 0 (on its command line) wins over port = 1
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
            c.put("one", 1)
            c.put("two", 2)
            with pytest.raises(tensorshare.errors.TooLargeError):
                c.put("three", 3)
        status, _, body = http_get(server.url("/status.json"))
        assert status == 200 and json.loads(body)["limits"]["memory_limit"] == 4 << 20
    finally:
        server.stop()


@pytest.mark.process
def test_json_log_lines_per_connection(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    log_path = tmp_path / "server.log"
    server = ServerProcess("--log-level", "INFO", "--log-format", "json", "--token-file", str(token_file),
                           log_path=str(log_path))
    try:
        with tensorshare.Client("127.0.0.1", server.port, token=TOKEN, timeout=30) as c:
            c.put("b", 1)
        with pytest.raises(tensorshare.AuthenticationError):
            tensorshare.Client("127.0.0.1", server.port, token="wrong-token-wrong-token-x", timeout=10,
                               reconnect=False)
    finally:
        server.stop()
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    events = [(e["event"], e["conn"]) for e in entries if "event" in e]
    opened = [conn for event, conn in events if event == "open"]
    closed = [conn for event, conn in events if event == "close"]
    failed = [conn for event, conn in events if event == "auth_failed"]
    # The first client: TCP, then the same-host Unix socket its greeting named (both
    # authenticated); the second: TCP, refused before anything is named.
    assert len(opened) == 3 and sorted(closed) == sorted(opened)
    assert failed == [opened[2]]  # the last connection's wrong proof
    assert ("auth", opened[0]) in events and ("auth", opened[1]) in events
    fail_line = next(e for e in entries if e.get("event") == "auth_failed")
    assert fail_line["level"] == "WARNING" and "wrong proof" in fail_line["message"]
    close_line = next(e for e in entries if e.get("event") == "close")
    assert f"conn {close_line['conn']} closed" in close_line["message"] and "bytes in" in close_line["message"]


@pytest.mark.process
def test_text_log_lines_carry_the_connection_id(tmp_path):
    log_path = tmp_path / "server.log"
    server = ServerProcess("--log-level", "info", log_path=str(log_path))
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
            c.ping()
    finally:
        server.stop()
    lines = log_path.read_text().splitlines()
    opened = [line for line in lines if " open from 127.0.0.1:" in line]
    assert len(opened) == 1 and "INFO" in opened[0]
    conn = opened[0].split("conn ")[1].split()[0]
    assert any(f"conn {conn} closed" in line for line in lines)


def test_bad_log_level(capsys):
    from tensorshare_server.cli import main

    assert main(["--log-level", "LOUD", "--port", "0"]) == 2
    assert "unknown --log-level" in capsys.readouterr().err
