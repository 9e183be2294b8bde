"""What the ``tensorshare`` command's modules share (:mod:`.cli`, :mod:`.cli_tables`):
exit statuses, the error that carries one, tables, value descriptions, transfer
progress and saving a bin (``save``, and ``table save`` of a table)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .errors import BadNameError, NoSuchBinError
from .humanize import human_bytes

OK, FAILED, USAGE, NO_SERVER, AUTH_FAILED, NO_BIN = 0, 1, 2, 3, 4, 5
PEEK_VALUES = 6  # values shown per tensor


class CliError(Exception):
    def __init__(self, message: str, code: int = FAILED):
        super().__init__(message)
        self.code = code


def rich_console():
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


def plural(n: int, noun: str) -> str:
    """``1 item``, ``2 items``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def info_if_table(client, name: str) -> dict | None:
    """Table ``name``'s info, or None if ``name`` is a bin (or nothing)."""
    try:
        return client.table_info(name)
    except (BadNameError, NoSuchBinError):
        return None


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


def cmd_save(args, client, out) -> int:
    progress = Progress(f"save {args.bin}", not args.json and not args.quiet, out.console)
    started = time.monotonic()
    try:
        count = client.save(args.bin, args.dir, overwrite=args.overwrite, progress=progress)
    except FileExistsError:
        raise CliError(f"{args.dir} exists (--overwrite replaces it)") from None
    finally:
        progress.close()
    nbytes = dir_bytes(args.dir)
    if args.json:
        out.emit({"bin": args.bin, "dir": args.dir, "items": count, "bytes": nbytes})
    else:
        noun = "row" if info_if_table(client, args.bin) is not None else "item"
        print(f"saved {plural(count, noun)} of {args.bin} ({human_bytes(nbytes)}) to {args.dir} "
              f"in {time.monotonic() - started:.2f}s")
    return OK


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(".memmap"):
                total += os.path.getsize(os.path.join(root, f))
    return total
