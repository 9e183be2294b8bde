"""``tensorshare``: look at and move bins from a shell.

    tensorshare ls [PATTERN]            bins and tables (marked) and their item counts; PATTERN: a glob
    tensorshare stat BIN                items, sequence number, last tag (bytes and tiers with --metrics-port);
                                        of a table: its settings, counters and rate limiter
    tensorshare peek BIN                shapes, dtypes and a few values of each item
    tensorshare save BIN DIR            the bin's items to DIR (memory-mappable files, no pickle)
    tensorshare load DIR BIN            what ``save`` (or ``save_memmap``) wrote, into BIN
    tensorshare rm BIN                  delete BIN
    tensorshare watch                   a live view of bins (and clients, with --metrics-port)
    tensorshare table ls|info|sample|save|load|drop   the server's tables (replay buffers): see cli_tables.py

Connection options are the server's: ``--host``, ``--port``, ``--token-file`` (else
``TENSORSHARE_TOKEN``), ``--tls``/``--tls-ca``/``--tls-fingerprint``, before or after
the command (a command added here takes them through :func:`add_command`).
``--json`` prints data for scripts.  Exit status: 0 done, 1 failed, 2 bad usage, 3 no server
there, 4 authentication failed, 5 no such bin.  Tables and live views use ``rich``
when it is installed (the ``cli`` extra: ``pip install rich``), plain text otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from . import cli_tables
from .argtypes import count, port_number, seconds
from . import __version__
from .cli_common import (
    AUTH_FAILED, FAILED, NO_BIN, NO_SERVER, OK, USAGE, CliError, Progress, cmd_save, describe, dir_bytes,
    info_if_table, plain_table, plural, print_table, rich_console, summary,
)
from .errors import (
    AuthenticationError, BadNameError, ConnectionLostError, NoSuchBinError, TensorShareError, UsageError,
    WrongServerError,
)
from .humanize import human_bytes, rl_roles

# -- talking to the server


def connect(args):
    from .client import Client
    from .protocol.auth import resolve_token

    try:
        token = resolve_token(None, args.token_file)
    except UsageError as exc:
        raise CliError(str(exc), USAGE) from None
    return Client(args.host, args.port, timeout=args.timeout, connect_timeout=args.timeout, reconnect=False,
                  token=token, tls=True if args.tls else None, tls_ca=args.tls_ca,
                  tls_fingerprint=args.tls_fingerprint, keepalive=None)


def status_json(args) -> dict | None:
    """The server's /status.json when ``--metrics-port`` is given, else None."""
    if args.metrics_port is None:
        return None
    import http.client
    import urllib.error
    import urllib.request

    from .protocol.auth import resolve_token

    headers = {}
    token = resolve_token(None, args.token_file)
    if token is not None:
        headers["Authorization"] = "Bearer " + token.decode()
    url = f"http://{args.host}:{args.metrics_port}/status.json"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=args.timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise CliError(f"{url}: {exc.code} {exc.reason}", AUTH_FAILED if exc.code == 401 else FAILED) from None
    except OSError as exc:
        raise CliError(f"cannot reach the status page at {url}: {exc}", NO_SERVER) from None
    except (http.client.HTTPException, ValueError) as exc:  # not HTTP, or not JSON
        raise CliError(f"no status page at {url} ({type(exc).__name__}): --metrics-port is the port the "
                       f"server printed for its status page", NO_SERVER) from None  # (what came: not text)


# -- subcommands


def cmd_ls(args, client, out) -> int:
    listing = client.list(args.pattern)
    tables = {name for name in listing if info_if_table(client, name) is not None}
    status = status_json(args)
    sizes = {b["name"]: b["bytes"] for b in status["bins"]} if status else {}
    if args.json:
        out.emit([{"bin": name, "items": n, "kind": "table" if name in tables else "bin",
                   **({"bytes": sizes.get(name)} if status else {})} for name, n in sorted(listing.items())])
        return OK
    headers = ["name", "kind", "items (rows)"] + (["bytes"] if status else [])
    rows = [[name, "table" if name in tables else "bin", n] + ([human_bytes(sizes.get(name))] if status else [])
            for name, n in sorted(listing.items())]
    matching = f" matching {args.pattern!r}" if args.pattern else ""
    print_table(f"{plural(len(rows) - len(tables), 'bin')} and {plural(len(tables), 'table')}{matching} on "
                f"{args.host}:{args.port}", headers, rows, out.console)
    return OK


def cmd_stat(args, client, out) -> int:
    table = info_if_table(client, args.bin)
    if table is not None:  # capacity, sampler, rate limits...
        return cli_tables.show_info(args, client, out, args.bin, table)
    handle = client.listen(args.bin, lambda note: None)
    snap = handle.snapshot
    handle.stop()
    if not snap.exists:
        raise CliError(f"no bin named {args.bin!r}", NO_BIN)
    data = {"bin": args.bin, "items": snap.n_items, "seq": snap.seq, "tag": snap.tag}
    status = status_json(args)
    if status:
        row = next((b for b in status["bins"] if b["name"] == args.bin), None)
        if row is not None:
            data.update(bytes=row["bytes"], tiers=row["tiers"])
    if args.json:
        out.emit(data)
        return OK
    rows = [[k, human_bytes(v) if k == "bytes" else v] for k, v in data.items()]
    print_table(f"bin {args.bin}", ["", ""], rows, out.console)
    return OK


def cmd_peek(args, client, out) -> int:
    try:
        items = client.peek(args.bin)
    except BadNameError:
        if info_if_table(client, args.bin) is None:
            raise
        raise CliError(f"{args.bin!r} is a table: tensorshare table sample {args.bin} shows rows, "
                       f"tensorshare table info {args.bin} its settings", USAGE) from None
    if args.json:
        out.emit({"bin": args.bin, "items": [summary(v) for v in items]})
        return OK
    print(f"{args.bin}: {plural(len(items), 'item')}")
    for i, value in enumerate(items):
        lines = describe(value, "    ")
        print(f"  [{i}] {lines[0].strip()}")
        for line in lines[1:]:
            print("  " + line)
    return OK


def cmd_load(args, client, out) -> int:
    from .disk.layout import LayoutError
    from .disk.tables import is_checkpoint
    from .memmap import load_memmap

    if not os.path.isdir(args.dir):
        raise CliError(f"no directory {args.dir}")
    if is_checkpoint(args.dir):  # Client.save of a table: the table made again
        return cli_tables.load_checkpoint(args, client, out, args.bin)
    try:
        loaded = load_memmap(args.dir)
    except LayoutError as exc:
        raise CliError(f"{args.dir} holds no saved items: {exc}") from None
    from .memmap import RECORD

    items = [loaded] if os.path.exists(os.path.join(args.dir, RECORD)) else loaded  # ([]: a bin saved empty)
    total = dir_bytes(args.dir)
    progress = Progress(f"load {args.bin}", not args.json and not args.quiet, out.console)
    done = 0
    try:
        for i, value in enumerate(items):
            size = _nbytes(value)

            def report(sent, _total, base=done):
                progress(base + sent, total)

            if i == 0:
                client.put(args.bin, value, progress=report)
            else:
                client.append(args.bin, value, progress=report)
            done += size
            progress(min(done, total), total)
    finally:
        progress.close()
    if args.json:
        out.emit({"bin": args.bin, "dir": args.dir, "items": len(items), "bytes": total})
    else:
        print(f"loaded {plural(len(items), 'item')} ({human_bytes(total)}) from {args.dir} into {args.bin}")
    return OK


def cmd_rm(args, client, out) -> int:
    client.delete(args.bin)
    if args.json:
        out.emit({"bin": args.bin, "deleted": True})
    else:
        print(f"deleted {args.bin}")
    return OK


def watch_view(args, client, shown: bool = True) -> tuple[list, list, dict | None]:
    """(bin rows, client rows, status) for one refresh of ``watch``: as shown (byte
    counts readable, "-" for what is not known), or (``shown=False``) as data for
    scripts (counts in bytes, None for what is not known: bytes and tags need the
    status page)."""
    size = human_bytes if shown else (lambda n: n)
    unknown = "-" if shown else None
    status = status_json(args)
    if status:
        bins = [[b["name"], b["items"], size(b["bytes"]), unknown if b["tag"] is None else b["tag"]]
                for b in status["bins"]]
        clients = [[c["id"], c["peer"], rl_roles(c), size(c["bytes_in"]), size(c["bytes_out"]),
                    c["requests"]] for c in status["clients"]]
        return bins, clients, status
    return [[name, n, unknown, unknown] for name, n in sorted(client.list().items())], [], None


def cmd_watch(args, client, out) -> int:
    count = 0
    bin_headers = ["bin", "items", "bytes", "tag"]
    client_headers = ["conn", "address", "experiments", "in", "out", "requests"]

    def frames():
        nonlocal count
        while args.count is None or count < args.count:
            if count:
                time.sleep(args.interval)
            count += 1
            yield watch_view(args, client, shown=not args.json)

    if args.json:
        for bins, clients, status in frames():
            out.emit({"time": time.time(), "bins": [dict(zip(bin_headers, r)) for r in bins],
                      "clients": [dict(zip(client_headers, r)) for r in clients]})
        return OK
    # A live view updates in place on a terminal; into a pipe or a file each refresh is printed.
    console = out.console if sys.stdout.isatty() else None
    if console is None:
        for bins, clients, status in frames():
            if sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            print(time.strftime("%H:%M:%S"), f"{args.host}:{args.port}")
            print(plain_table(bin_headers, bins))
            if status:
                print()
                print(plain_table(client_headers, clients))
            print(flush=True)
        return OK
    from rich.console import Group
    from rich.live import Live
    from rich.table import Table

    def render(bins, clients, status):
        def table(title, headers, rows):
            t = Table(title=title)
            for h in headers:
                t.add_column(h)
            for r in rows[:100]:
                t.add_row(*(str(c) for c in r))
            return t
        parts = [table(f"bins on {args.host}:{args.port} at {time.strftime('%H:%M:%S')}", bin_headers, bins)]
        if status:
            parts.append(table("clients", client_headers, clients))
        return Group(*parts)

    with Live(console=console, auto_refresh=False) as live:
        for view in frames():
            live.update(render(*view), refresh=True)
    return OK


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class Output:
    def __init__(self, console):
        self.console = console

    def emit(self, data: Any) -> None:
        print(json.dumps(data, default=str), flush=True)


COMMANDS = {"ls": cmd_ls, "stat": cmd_stat, "peek": cmd_peek, "save": cmd_save, "load": cmd_load, "rm": cmd_rm,
            "watch": cmd_watch, "table": cli_tables.cmd_table}


# -- the command line


def common_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every command takes: where the server is, how to reach it, how to print."""
    parser.add_argument("--host", help="the server's address (default $TENSORSHARE_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=port_number, help="the server's port (default $TENSORSHARE_PORT, else 8000)")
    parser.add_argument("--token-file", metavar="FILE", help="the server's token (default: $TENSORSHARE_TOKEN)")
    parser.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    parser.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA")
    parser.add_argument("--tls-fingerprint", metavar="SHA256", help="TLS, pinning the server certificate")
    parser.add_argument("--metrics-port", type=port_number, metavar="PORT",
                        help="the server's --metrics-port: ls, stat and watch then show bytes and clients too")
    parser.add_argument("--timeout", type=seconds, metavar="SECONDS", help="for each request (default 30)")
    parser.add_argument("--json", action="store_true", help="print JSON (one document per line) for scripts")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


DEFAULTS = {"host": None, "port": None, "token_file": None, "tls": False, "tls_ca": None, "tls_fingerprint": None,
            "metrics_port": None, "timeout": 30.0, "json": False, "quiet": False}


def add_command(commands, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand's parser, taking the common options too, so that they may come
    before or after the command (``tensorshare ls --port 8001``)."""
    # argument_default=SUPPRESS: an option not given after the command leaves what
    # was given before it (or the default) in place.
    common = common_options(argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS))
    return commands.add_parser(name, help=text, description=text, parents=[common])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorshare", description="Look at and move tensorshare bins.",
                                epilog="Options may come before or after the command. Exit status: 0 done, "
                                       "1 failed, 2 bad usage, 3 no server, 4 authentication failed, "
                                       "5 no such bin.")
    common_options(p)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.set_defaults(**DEFAULTS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_command(sub, "ls", "bins and tables, with their item (row) counts").add_argument(
        "pattern", nargs="?", help="only names matching this glob ('replay*'; quote it for the shell)")
    for name, text in (("stat", "a bin's items, sequence number and last tag"),
                       ("peek", "shapes, dtypes and a few values of a bin's items"), ("rm", "delete a bin")):
        add_command(sub, name, text).add_argument("bin")
    save = add_command(sub, "save", "write a bin's items to a directory (memory-mappable, no pickle)")
    save.add_argument("bin")
    save.add_argument("dir")
    save.add_argument("--overwrite", action="store_true")
    load = add_command(sub, "load", "put what save wrote into a bin (replacing its items)")
    load.add_argument("dir")
    load.add_argument("bin")
    watch = add_command(sub, "watch", "a live view of bins (and clients, with --metrics-port)")
    watch.add_argument("--interval", type=seconds, default=1.0, metavar="SECONDS")
    watch.add_argument("--count", type=count, default=None, help="stop after this many refreshes")
    cli_tables.add_parser(sub, add_command)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the address taken from the environment where it does not say."""
    p = parser()
    args = p.parse_args(argv)
    if args.host is None:
        args.host = os.environ.get("TENSORSHARE_HOST") or "127.0.0.1"
    if args.port is None:
        try:
            args.port = port_number(os.environ.get("TENSORSHARE_PORT") or "8000")
        except argparse.ArgumentTypeError as exc:
            p.error(f"TENSORSHARE_PORT: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Output(None if args.json else rich_console())
    client = None
    where = f"{args.host}:{args.port}"
    try:
        client = connect(args)
        return COMMANDS[args.command](args, client, out)
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except NoSuchBinError as exc:
        return _fail(exc.message if hasattr(exc, "message") else str(exc), NO_BIN)
    except AuthenticationError as exc:
        return _fail(f"authentication failed: {exc} (check --token-file or TENSORSHARE_TOKEN)", AUTH_FAILED)
    except WrongServerError as exc:
        return _fail(wrong_server_message(where, exc), NO_SERVER)
    except ConnectionLostError as exc:
        if client is not None:  # it was there, and went away
            return _fail(str(exc), FAILED)
        return _fail(f"{exc} (no tensorshare server there? --host and --port, or TENSORSHARE_HOST and "
                     f"TENSORSHARE_PORT, say where it is)", NO_SERVER)
    except UsageError as exc:
        return _fail(str(exc), USAGE)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except (TensorShareError, OSError) as exc:
        return _fail(str(exc), FAILED)
    except KeyboardInterrupt:
        return 130
    finally:
        if client is not None:
            client.close()


def wrong_server_message(where: str, exc: WrongServerError) -> str:
    """What to tell a user whose --host/--port reached something other than a tensorshare server."""
    if exc.speaks == "TLS":
        return f"{where} is a TLS server: add --tls (or --tls-ca PEM, or --tls-fingerprint SHA256 to pin it)"
    if exc.speaks == "HTTP":
        return (f"{where} is an HTTP server, not a tensorshare server: --port is the server's data port "
                f"(its status page's port goes in --metrics-port)")
    return str(exc)


def _fail(message: str, code: int) -> int:
    print(f"tensorshare: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
