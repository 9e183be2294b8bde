"""``tensorshare table ...``: list, inspect, sample, save, load and drop the server's tables.

    tensorshare table ls                  tables: rows, capacity, sampler, rows inserted and sampled
    tensorshare table info NAME           settings, counters, rate limiter, columns
    tensorshare table sample NAME [-n N]  N rows at random, shapes and a few values (counts as no sample;
                                          --draw: drawn by the table's own sampler, counted)
    tensorshare table save NAME DIR       a table checkpoint (rows and settings; ``save`` does the same)
    tensorshare table load DIR [NAME]     make the table again from a checkpoint (``load`` does the same)
    tensorshare table drop NAME           delete the table and its rows

The connection options are ``tensorshare``'s (:mod:`.cli`), its exit statuses and
output :mod:`.cli_common`'s.
"""

from __future__ import annotations

from .cli_common import NO_BIN, OK, USAGE, CliError, cmd_save, describe, print_table, summary
from .errors import BadNameError, NoSuchBinError
from .humanize import human_bytes


def add_parser(sub, add_command) -> None:
    """The ``table`` command and its subcommands, on ``tensorshare``'s parser
    (``add_command``: :func:`.cli.add_command`, so the connection options may follow
    any of them)."""
    from .argtypes import count

    table = add_command(sub, "table", "list, inspect, sample, save, load and drop tables (replay buffers)")
    tsub = table.add_subparsers(dest="table_command", required=True, metavar="TABLE_COMMAND")
    add_command(tsub, "ls", "tables: rows, capacity, sampler, rows inserted and sampled")
    add_command(tsub, "info", "a table's settings, counters, rate limiter and columns").add_argument("name")
    sample = add_command(tsub, "sample", "rows at random: shapes, dtypes and a few values")
    sample.add_argument("name")
    sample.add_argument("-n", type=count, default=4, help="rows (default 4)")
    sample.add_argument("--draw", action="store_true",
                        help="draw with the table's own sampler (counted as a sample, waits for its rate limiter)")
    save = add_command(tsub, "save", "write a table checkpoint (rows and settings) to a directory")
    save.add_argument("name")
    save.add_argument("dir")
    save.add_argument("--overwrite", action="store_true")
    load = add_command(tsub, "load", "make a table again from a checkpoint (replacing one of that name)")
    load.add_argument("dir")
    load.add_argument("name", nargs="?", help="default: the saved table's name")
    add_command(tsub, "drop", "delete a table and its rows").add_argument("name")


def cmd_table(args, client, out) -> int:
    return _COMMANDS[args.table_command](args, client, out)


def _info(client, name: str) -> dict:
    """A table's info; exit status 5 (no such bin) for a bin or a missing name."""
    try:
        return client.table_info(name)
    except BadNameError:
        raise CliError(f"{name!r} is a bin, not a table", NO_BIN) from None


def table_rows(client) -> list[dict]:
    """One summary per table on the server."""
    rows = []
    for name in sorted(client.list()):
        try:
            info = client.table_info(name)
        except (BadNameError, NoSuchBinError):
            continue  # a bin, or gone meanwhile
        rows.append({"table": name, "rows": info["size"], "capacity": info["capacity"], "sampler": info["sampler"],
                     "remover": info["remover"], "inserts": info["inserts"], "samples": info["samples"],
                     "bytes": info.get("bytes"), "kind": _kind(info)})
    return rows


def _ls(args, client, out) -> int:
    rows = table_rows(client)
    if args.json:
        out.emit(rows)
        return OK
    print_table(f"{len(rows)} table{'' if len(rows) == 1 else 's'} on {args.host}:{args.port}",
                ["table", "rows", "capacity", "sampler", "remover", "inserted", "sampled", "bytes", "holds"],
                [[r["table"], r["rows"], r["capacity"], r["sampler"], r["remover"] or "-", r["inserts"], r["samples"],
                  human_bytes(r["bytes"]), r["kind"]] for r in rows], out.console)
    return OK


def _show_info(args, client, out) -> int:
    return show_info(args, client, out, args.name)


def show_info(args, client, out, name: str, info: dict | None = None) -> int:
    """A table's settings, counters, rate limiter and columns (``table info``, and
    ``stat`` of a table)."""
    info = _info(client, name) if info is None else info
    if args.json:
        out.emit({"table": name, **info})
        return OK
    limiter = info["rate_limiter"]
    rows = [["rows", f"{info['size']} of {info['capacity']}"], ["bytes", human_bytes(info.get("bytes"))],
            ["holds", _kind(info)], ["sampler", info["sampler"] + (f" (exponent {info['priority_exponent']:g})"
                                                                   if info["priority_exponent"] is not None else "")],
            ["remover", info["remover"] or "-"], ["max times sampled", info["max_times_sampled"] or "no limit"],
            ["inserted / sampled / removed", f"{info['inserts']} / {info['samples']} / {info['removals']}"],
            ["min size to sample", limiter["min_size_to_sample"]],
            ["samples per insert", "-" if limiter["samples_per_insert"] is None
             else f"{limiter['samples_per_insert']:g} (error buffer {limiter['error_buffer']})"],
            ["inserts / samples allowed now", f"{_allowed(info['inserts_allowed'])} / "
                                              f"{_allowed(info['samples_allowed'])}"],
            ["waiting inserts / samples", f"{info['waiting_inserts']} / {info['waiting_samples']}"],
            ["rate limiter waited (inserts / samples)",
             " / ".join(f"{s:.1f}s" for s in info.get("blocked_seconds", {}).values()) or "-"]]
    print_table(f"table {name}", ["", ""], rows, out.console)
    columns = [[name, list(spec["shape"]), spec["dtype"]] for name, spec in (info["columns"] or {}).items()]
    if columns:
        print_table("columns", ["column", "shape of a row", "dtype"], columns, out.console)
    return OK


def _sample(args, client, out) -> int:
    import torch

    from .table_copy import occupied

    if args.n < 1:
        raise CliError("-n must be at least 1", USAGE)
    info = _info(client, args.name)
    if args.draw:
        drawn = client.sample(args.name, args.n)
        value, slots = drawn.value, drawn.indices
    else:
        held = occupied(client, args.name)["indices"]
        if not held.numel():
            raise CliError(f"table {args.name!r} holds no rows")
        slots = held[torch.randperm(held.numel())[:args.n]].sort().values
        value = client.read(args.name, slots)
    if args.json:
        out.emit({"table": args.name, "slots": slots.tolist(), "rows": summary(value)})
        return OK
    print(f"{args.name}: {slots.numel()} of {info['size']} rows, at slots {slots.tolist()}"
          + (" (drawn by the table's sampler)" if args.draw else ""))
    for line in describe(value, "  "):
        print(line)
    return OK


def _save(args, client, out) -> int:
    _info(client, args.name)  # a table, not a bin
    args.bin = args.name
    return cmd_save(args, client, out)


def load_checkpoint(args, client, out, name: str | None) -> int:
    """Make a table from the checkpoint ``args.dir`` (``table load``, and ``load`` of one)."""
    from .disk.layout import LayoutError
    from .disk.tables import read_checkpoint

    try:
        name = name or read_checkpoint(args.dir).name
        rows = client.load_table(args.dir, name)
    except LayoutError as exc:
        raise CliError(f"{args.dir}: {exc}") from None
    if args.json:
        out.emit({"dir": args.dir, "table": name, "rows": rows})
    else:
        print(f"loaded {rows} row{'' if rows == 1 else 's'} from {args.dir} into table {name}")
    return OK


def _load(args, client, out) -> int:
    return load_checkpoint(args, client, out, args.name)


def _drop(args, client, out) -> int:
    _info(client, args.name)
    client.delete(args.name)
    if args.json:
        out.emit({"table": args.name, "deleted": True})
    else:
        print(f"deleted table {args.name}")
    return OK


def _kind(info: dict) -> str:
    if not info.get("columns"):
        return "items"
    kind = ((info.get("meta") or {}).get("torchrl") or {}).get("kind")
    n = len(info["columns"])
    return f"{n} column{'' if n == 1 else 's'}" + (f" (TorchRL {kind}s)" if kind else "")


def _allowed(n) -> str:
    return "no limit" if n is None else str(n)


_COMMANDS = {"ls": _ls, "info": _show_info, "sample": _sample, "save": _save, "load": _load, "drop": _drop}
