"""The ``tensorshare-server`` command: its options (and a ``--config`` file's) into a :class:`ServerConfig`, then a server.

Sizes take units (``512MiB``, ``8GB``), counts and ports are checked as the client
command's are (:mod:`tensorshare.argtypes`); a TOML ``--config`` file sets defaults
that the command line overrides.  The server itself starts in
:func:`.app.run_server`; what a failure to start exits with is :mod:`.failures`'.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from twisted.internet.error import CannotListenError

from tensorshare.argtypes import count, count_or_zero, listen_port, seconds, seconds_or_zero
from tensorshare.version import __version__
from tensorshare.errors import UsageError

from .app import run_server
from .config import ServerConfig
from .failures import EXIT_CANNOT_LISTEN, EXIT_FAILED, EXIT_STOPPED, EXIT_USAGE, listen_failure
from .net import busypoll


def _size(text: str) -> int:
    """Parse ``512MiB``, ``8GB``, ``1048576``... into bytes."""
    units = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1 << 10, "M": 1000**2, "MB": 1000**2,
             "MIB": 1 << 20, "G": 1000**3, "GB": 1000**3, "GIB": 1 << 30, "T": 1000**4,
             "TB": 1000**4, "TIB": 1 << 40}
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGTIB")
    unit = stripped[len(number):]
    try:
        size = int(float(number) * units[unit])
    except (KeyError, ValueError, OverflowError):  # (OverflowError: "inf", "1e400")
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 8GB)") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a size is not negative)")
    return size


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="tensorshare-server", description="Serve tensorshare bins over TCP.",
                                     usage="%(prog)s [OPTIONS]   (--help lists them)",
                                     epilog="Exit status: 0 stopped (SIGINT, SIGTERM), 1 failed, 2 bad usage or "
                                            "config file, 3 cannot listen (port taken, address not of this host).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--port", type=listen_port, default=8000, help="TCP port (0: pick a free one and print it)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    parser.add_argument("--max-frame", type=_size, default=ServerConfig.max_frame, help="largest payload of one request")
    parser.add_argument("--max-header", type=_size, default=ServerConfig.max_header, help="largest request header")
    parser.add_argument("--max-reply-header", type=_size, default=ServerConfig.max_reply_header,
                        help="largest GET/PEEK reply header (item descriptions)")
    parser.add_argument("--max-bins", type=count, default=ServerConfig.max_bins,
                        help="bins of the whole server (with --workers: divided among them)")
    parser.add_argument("--max-items-per-bin", type=count, default=ServerConfig.max_items_per_bin,
                        help="also bounds the header of a GET/PEEK reply")
    parser.add_argument("--max-bin-name", type=count, default=ServerConfig.max_bin_name, help="characters")
    parser.add_argument("--max-listens", type=count, default=ServerConfig.max_listens, help="per connection")
    parser.add_argument("--max-depth", type=count, default=ServerConfig.max_depth, help="nesting of a value")
    parser.add_argument("--max-table-rows", type=count, default=ServerConfig.max_table_rows,
                        help="rows of all tables together (each row keeps at most 24 bytes of state in memory; "
                             "default: as many as --memory-limit holds, else the machine's memory; with --workers: "
                             "divided among them, so one table has at most a worker's share)")
    parser.add_argument("--max-nodes", type=count, default=ServerConfig.max_nodes, help="nodes of a value's structure")
    disk = parser.add_argument_group("disk tier")
    disk.add_argument("--memory-limit", type=_size, default=None,
                      help="payload bytes to keep in RAM (e.g. 8GB, 512MiB); least recently used items "
                           "past it move to memory-mapped files")
    disk.add_argument("--spill-dir", default=None,
                      help="with --memory-limit and no --data-dir (refused otherwise): directory for spilled "
                           "items (default: a private temporary one, removed at exit)")
    disk.add_argument("--data-dir", default=None,
                      help="durable storage: every acknowledged put/append is on disk here, and a server "
                           "restarted on it serves the same bins")
    disk.add_argument("--fsync", action="store_true",
                      help="with --data-dir (refused without it): flush every change to stable storage before "
                           "acknowledging it (survives power loss, not only a crash of the server)")
    disk.add_argument("--disk-threads", type=count, default=ServerConfig.disk_threads)
    disk.add_argument("--no-sendfile", dest="sendfile", action="store_false",
                      help="copy spilled and durable items' bytes through the server instead of having the "
                           "kernel send them from their files (sendfile)")
    flow = parser.add_argument_group("flow control (a client that does not read its replies)")
    flow.add_argument("--max-outbound", type=_size, default=ServerConfig.max_outbound,
                      help="bytes of unsent replies and notifications one connection may keep alive before the "
                           "server stops reading its requests and coalesces its notifications (default 64MiB)")
    flow.add_argument("--outbound-stall-timeout", type=seconds, default=ServerConfig.outbound_stall_timeout,
                      metavar="SECONDS", help="disconnect a connection over --max-outbound that takes no byte "
                                              "for this long (default 60)")
    shm = parser.add_argument_group("same-host zero-copy")
    shm.add_argument("--no-zero-copy", dest="zero_copy", action="store_false",
                     help="never hand out shared-memory references: every value travels over TCP "
                          "(refused beside --shm-dir or --zero-copy-min)")
    shm.add_argument("--shm-dir", default=ServerConfig.shm_dir,
                     help="tmpfs directory for the server's shared-memory area (default /dev/shm)")
    shm.add_argument("--zero-copy-min", type=_size, default=ServerConfig.zero_copy_min,
                     help="smallest item (payload bytes, more for items of many arrays) passed by reference; "
                          "clients put values through shared memory from 4x this; smaller ones travel over TCP")
    parser.add_argument("--busy-poll", type=float, default=busypoll.DEFAULT_WINDOW, metavar="SECONDS",
                        help="keep polling this long after a request before sleeping, while one client alone "
                             "sends requests: a quicker answer to its next one, for CPU time (default "
                             "%(default)s; 0: sleep at once)")
    parser.add_argument("--recv-pool", type=_size, default=ServerConfig.recv_pool, metavar="SIZE",
                        help="memory that payloads of 64 KiB or more are received into and reused once their "
                             "items are gone (default 1GiB, at most a quarter of --memory-limit; 0: fresh memory "
                             "each time)")
    parser.add_argument("--recv-pool-idle", type=seconds, default=ServerConfig.recv_pool_idle, metavar="SECONDS",
                        help="give receive-pool memory back to the system once it has been free this long "
                             "(default %(default)s)")
    parser.add_argument("--workers", type=int, default=ServerConfig.workers, metavar="N",
                        help="serve with N processes that share nothing, each owning the bins whose names hash "
                             "to it; clients route each request to its owner.  --memory-limit, --recv-pool, "
                             "--max-connections, --max-bins and --max-table-rows stay the whole server's: each "
                             "worker gets 1/N (default %(default)s)")
    parser.add_argument("--worker-ports", type=int, default=None, metavar="PORT",
                        help="with --workers N, N > 1 (refused without): worker k also listens on PORT+k, which "
                             "clients connect to (default: free ports, named in the greeting)")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING... (INFO: a line per "
                                                                "connection opened and closed)")
    _add_relay_arguments(parser)
    _add_security_arguments(parser)
    _add_ops_arguments(parser)
    _read_config_file(parser, argv)
    args = parser.parse_args(argv)
    known = {f.name for f in fields(ServerConfig)}
    try:
        config = ServerConfig(**{k: v for k, v in vars(args).items() if k in known})
    except ValueError as exc:
        parser.error(str(exc))
    _refuse_ignored(parser, config)
    return config, args


def _refuse_ignored(parser: argparse.ArgumentParser, config: ServerConfig) -> None:
    """Refuse (exit status 2) an option that means nothing without another, which the
    server would otherwise ignore without a word (from the command line or --config)."""
    if config.fsync and not config.data_dir:
        parser.error("--fsync needs --data-dir DIR: only durable storage is flushed to disk "
                     "(add --data-dir DIR, or drop --fsync)")
    if config.worker_ports is not None and config.workers < 2:
        parser.error("--worker-ports needs --workers N with N > 1: one process listens on --port alone "
                     "(add --workers N, or drop --worker-ports)")
    given = _given(config, _RELAY_ONLY) if not config.follow else None
    if given:
        parser.error(f"{given} needs --follow HOST:PORT: a server that follows no upstream "
                     f"mirrors no bins (add --follow HOST:PORT, or drop {given})")
    if config.metrics_host != ServerConfig.metrics_host and config.metrics_port is None:
        parser.error("--metrics-host needs --metrics-port PORT: without it no operations page is served "
                     "(add --metrics-port PORT, or drop --metrics-host)")
    given = _given(config, _ZERO_COPY_ONLY) if not config.zero_copy else None
    if given:
        parser.error(f"{given} is for same-host zero-copy, which --no-zero-copy turns off (drop one of them)")
    if config.spill_dir is not None and (config.memory_limit is None or config.data_dir):
        parser.error("--spill-dir needs --memory-limit SIZE and no --data-dir: items spill only past the memory "
                     "limit, and a durable server keeps them in its data directory "
                     "(add --memory-limit SIZE, or drop --spill-dir)")


def _given(config: ServerConfig, options: tuple) -> str | None:
    """The first of ``options`` (``(flag, ServerConfig field)`` pairs) set to other than its default."""
    return next((flag for flag, name in options if getattr(config, name) != getattr(ServerConfig, name)), None)


# options (and their ServerConfig fields) that only a relay (--follow) reads, and only zero-copy
_RELAY_ONLY = (("--follow-bins", "follow_bins"), ("--follow-token-file", "follow_token_file"),
               ("--follow-tls", "follow_tls"), ("--follow-tls-ca", "follow_tls_ca"),
               ("--follow-tls-fingerprint", "follow_tls_fingerprint"), ("--follow-timeout", "follow_timeout"))
_ZERO_COPY_ONLY = (("--shm-dir", "shm_dir"), ("--zero-copy-min", "zero_copy_min"))


def _add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    """Issue #20's options: a relay of another server (server/relay/)."""
    group = parser.add_argument_group(
        "relay", "Mirror another server's bins: reads, listens and same-host zero-copy are served here, each "
                 "change crosses the network once; writes to followed bins are forwarded upstream.")
    group.add_argument("--follow", metavar="HOST:PORT", help="the upstream server (or relay) to mirror")
    group.add_argument("--follow-bins", default=ServerConfig.follow_bins, metavar="GLOB",
                       help="with --follow (refused without it): bins to mirror and forward writes to (default "
                            "%(default)s); others live here")
    group.add_argument("--follow-token-file", metavar="FILE",
                       help="token to prove upstream (default: this server's own token); this and the "
                            "options below are refused without --follow")
    group.add_argument("--follow-tls", action="store_true", help="TLS upstream, trusting the system's CAs")
    group.add_argument("--follow-tls-ca", metavar="PEM", help="TLS upstream, trusting this CA")
    group.add_argument("--follow-tls-fingerprint", metavar="SHA256", help="TLS upstream, pinning this certificate")
    group.add_argument("--follow-timeout", type=seconds, default=ServerConfig.follow_timeout, metavar="SECONDS",
                       help="how long a read or forwarded write waits for the upstream (default %(default)s)")


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Issue #7's options: authentication, TLS, connection and time limits."""
    group = parser.add_argument_group(
        "security", "Authentication proves clients know a shared token (HMAC challenge-response: the token "
                    "never crosses the wire, and the server proves it knows it too); TLS encrypts the traffic "
                    "and proves the server's identity. Use both on any network you do not trust.")
    group.add_argument("--token-file", metavar="FILE",
                       help="require clients to authenticate with the token in FILE (surrounding whitespace "
                            "ignored). Without it the TENSORSHARE_TOKEN environment variable is used if set; "
                            "else anyone who reaches the port is served. No --token option: command lines "
                            "are visible to every user of the host")
    group.add_argument("--tls-cert", metavar="PEM", help="serve TLS only, with this certificate (chain, leaf first)")
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (default: read from --tls-cert)")
    group.add_argument("--max-connections", type=count_or_zero, default=ServerConfig.max_connections, metavar="N",
                       help="connections open at once; more get 421 and are closed (default %(default)s; 0: no "
                            "limit; with --workers: divided among them, a client holding one to each worker it uses)")
    group.add_argument("--idle-timeout", type=seconds_or_zero, default=ServerConfig.idle_timeout, metavar="SECONDS",
                       help="close a connection silent this long with 421; one that listens gets a 110 "
                            "keepalive frame instead and stays (default %(default)s; 0: never)")
    group.add_argument("--auth-timeout", type=seconds_or_zero, default=ServerConfig.auth_timeout, metavar="SECONDS",
                       help="close a connection that has not authenticated by then with 530 "
                            "(default %(default)s; 0: no limit)")


def _add_ops_arguments(parser: argparse.ArgumentParser) -> None:
    """Issue #21's options: metrics, the status page, log format, config file."""
    from .ops.logs import FORMATS

    group = parser.add_argument_group("operations")
    group.add_argument("--metrics-port", type=listen_port, default=None, metavar="PORT",
                       help="serve Prometheus /metrics, /status.json and a status page at / on this HTTP port "
                            "(0: pick a free one and print it; default: off). Token protected when the server "
                            "has a token")
    group.add_argument("--metrics-host", default=ServerConfig.metrics_host,
                       help="with --metrics-port (refused without it): address the metrics port binds "
                            "(default %(default)s)")
    group.add_argument("--log-format", choices=FORMATS, default="text",
                       help="text (default) or json: one JSON object per line, for log shippers")
    group.add_argument("--config", metavar="TOML",
                       help="read options from this TOML file (keys are the long option names: "
                            "memory-limit = \"8GB\"); the command line wins")


def _read_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Make a ``--config`` file's options the parser's defaults (the command line wins)."""
    from .ops.configfile import defaults_from, read_toml

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            parser.set_defaults(**defaults_from(parser, read_toml(known.config), known.config))
        except argparse.ArgumentTypeError as exc:
            print(f"tensorshare-server: {exc}", file=sys.stderr)  # one line: the usage would not help
            raise SystemExit(EXIT_USAGE) from None


def main(argv: list[str] | None = None) -> int:
    """The ``tensorshare-server`` command."""
    from .ops.logs import configure

    config, args = parse_args(argv)
    try:
        configure(args.log_level, args.log_format)
    except ValueError:
        return _fail(f"unknown --log-level {args.log_level!r} (DEBUG, INFO, WARNING, ERROR)", EXIT_USAGE)
    settings = {f.name: getattr(config, f.name) for f in fields(ServerConfig) if f.name not in ("host", "port")}
    try:
        code = run_server(config.port, config.host, **settings)  # (a multi-worker server's parent returns one)
    except UsageError as exc:  # a data directory another server holds says so with its own status (75)
        return _fail(str(exc), getattr(exc, "exit_code", EXIT_USAGE))
    except CannotListenError as exc:
        return _fail(listen_failure(exc, config), EXIT_CANNOT_LISTEN)
    except OverflowError as exc:  # an address Twisted could not bind at all
        return _fail(f"cannot listen on {config.host}:{config.port}: {exc}", EXIT_CANNOT_LISTEN)
    except OSError as exc:  # a directory or file it was given cannot be used
        return _fail(f"cannot start: {exc}", EXIT_FAILED)
    return code or EXIT_STOPPED


def _fail(message: str, code: int) -> int:
    print(f"tensorshare-server: {message}", file=sys.stderr)
    return code
