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
from .errors import (
    AuthenticationError, BadNameError, ConnectionLostError, NoSuchBinError, TensorShareError, UsageError,
    WrongServerError,
)
from .humanize import human_bytes, rl_roles

OK, FAILED, USAGE, NO_SERVER, AUTH_FAILED, NO_BIN = 0, 1, 2, 3, 4, 5
PEEK_VALUES = 6  # values shown per tensor


class CliError(Exception):
    def __init__(self, message: str, code: int = FAILED):
        super().__init__(message)
        self.code = code


def _rich():
    """rich's console, or None for plain text (not installed, or TENSORSHARE_PLAIN set)."""
    if os.environ.get("TENSORSHARE_PLAIN"):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()


# -- output


def print_table(title: str, headers: list[str], rows: list[list], console=None) -> None:
    """``title``, then the rows under their headers (none: no header row), if any.
    Nothing is cut: names (the first column) keep up to two thirds of the terminal's
    width, and what does not fit folds onto more lines.  Plain text where the output
    is not a terminal (a pipe, a file)."""
    if console is not None and console.is_terminal:
        from rich.table import Table

        console.print(title)
        if not rows:
            return
        table = Table(show_header=any(headers))
        for i, h in enumerate(headers):
            widest = max(len(str(row[i])) for row in rows)
            table.add_column(h, overflow="fold", min_width=min(widest, console.width * 2 // 3) if i == 0 else None)
        for row in rows:
            table.add_row(*(str(c) for c in row))
        console.print(table)
        return
    print(title)
    if rows:
        print(plain_table(headers, rows))


def plain_table(headers: list[str], rows: list[list]) -> str:
    cells = [*([headers] if any(headers) else []), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))] if cells else []
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def describe(value: Any, indent: str = "") -> list[str]:
    """Lines describing a value: structure, shapes, dtypes and a few values, never a wall of numbers."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)
        shown = flat[:PEEK_VALUES].tolist()
        more = ", ..." if flat.numel() > PEEK_VALUES else ""
        values = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in shown)
        return [f"{indent}tensor {str(value.dtype).replace('torch.', '')} {list(value.shape)} "
                f"({human_bytes(value.numel() * value.element_size())}) [{values}{more}]"]
    if isinstance(value, dict):
        lines = [f"{indent}dict ({len(value)} keys)"]
        for i, (k, v) in enumerate(value.items()):
            if i == 20:
                lines.append(f"{indent}  ... {len(value) - 20} more keys")
                break
            sub = describe(v, indent + "    ")
            lines.append(f"{indent}  {k!r}: {sub[0].strip()}")
            lines.extend(sub[1:])
        return lines
    if isinstance(value, (list, tuple)):
        lines = [f"{indent}{type(value).__name__} ({len(value)} items)"]
        for i, v in enumerate(value[:10]):
            sub = describe(v, indent + "    ")
            lines.append(f"{indent}  [{i}] {sub[0].strip()}")
            lines.extend(sub[1:])
        if len(value) > 10:
            lines.append(f"{indent}  ... {len(value) - 10} more")
        return lines
    text = repr(value)
    return [f"{indent}{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"]


def summary(value: Any) -> Any:
    """A JSON-ready description of a value (for ``peek --json``)."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)
        return {"tensor": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
                "bytes": value.numel() * value.element_size(), "first": flat[:PEEK_VALUES].tolist()}
    if isinstance(value, dict):
        return {str(k): summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summary(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)[:200]


class Progress:
    """Progress of one transfer on stderr: a rich bar with rate and ETA, or plain lines."""

    def __init__(self, description: str, enabled: bool, console=None):
        self.description, self.enabled = description, enabled
        self._rich = self._task = None
        self._started = time.monotonic()
        self._last_print = 0.0
        if enabled and console is not None:
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TimeRemainingColumn,
                                       TransferSpeedColumn)
            from rich.console import Console

            self._rich = RichProgress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                      transient=False)
            self._rich.start()
            self._task = self._rich.add_task(description, total=None)

    def __call__(self, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=done, total=total)
            return
        now = time.monotonic()
        if now - self._last_print < 0.5 and done != total:
            return
        self._last_print = now
        rate = done / max(now - self._started, 1e-6)
        eta = f", {(total - done) / rate:.0f}s left" if total and rate > 0 else ""
        of = f" of {human_bytes(total)}" if total else ""
        print(f"{self.description}: {human_bytes(done)}{of} ({human_bytes(rate)}/s{eta})", file=sys.stderr)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


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
        raise CliError(f"no status page at {url} ({type(exc).__name__}: {exc}): --metrics-port is the port "
                       f"the server printed for its status page", NO_SERVER) from None


# -- subcommands


def cmd_ls(args, client, out) -> int:
    listing = client.list(args.pattern)
    tables = {name for name in listing if cli_tables.info_if_table(client, name) is not None}
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


def plural(n: int, noun: str) -> str:
    """``1 item``, ``2 items``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def cmd_stat(args, client, out) -> int:
    table = cli_tables.info_if_table(client, args.bin)
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
        if cli_tables.info_if_table(client, args.bin) is None:
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


def cmd_save(args, client, out) -> int:
    progress = Progress(f"save {args.bin}", not args.json and not args.quiet, out.console)
    started = time.monotonic()
    try:
        count = client.save(args.bin, args.dir, overwrite=args.overwrite, progress=progress)
    except FileExistsError:
        raise CliError(f"{args.dir} exists (--overwrite replaces it)") from None
    finally:
        progress.close()
    nbytes = _dir_bytes(args.dir)
    if args.json:
        out.emit({"bin": args.bin, "dir": args.dir, "items": count, "bytes": nbytes})
    else:
        noun = "row" if cli_tables.info_if_table(client, args.bin) is not None else "item"
        print(f"saved {plural(count, noun)} of {args.bin} ({human_bytes(nbytes)}) to {args.dir} "
              f"in {time.monotonic() - started:.2f}s")
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

    items = [loaded] if os.path.exists(os.path.join(args.dir, RECORD)) else loaded
    if not items:
        raise CliError(f"{args.dir} holds no saved items")
    total = _dir_bytes(args.dir)
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


def watch_view(args, client) -> tuple[list, list, dict | None]:
    """(bin rows, client rows, status) for one refresh of ``watch``."""
    status = status_json(args)
    if status:
        bins = [[b["name"], b["items"], human_bytes(b["bytes"]), "-" if b["tag"] is None else b["tag"]]
                for b in status["bins"]]
        clients = [[c["id"], c["peer"], rl_roles(c), human_bytes(c["bytes_in"]), human_bytes(c["bytes_out"]),
                    c["requests"]] for c in status["clients"]]
        return bins, clients, status
    return [[name, n, "-", "-"] for name, n in sorted(client.list().items())], [], None


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
            yield watch_view(args, client)

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


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(".memmap"):
                total += os.path.getsize(os.path.join(root, f))
    return total


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
    out = Output(None if args.json else _rich())
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
