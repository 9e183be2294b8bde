"""What the server does for the table verbs (PROTOCOL.md §12): TCREATE, TINSERT,
TWRITE, TSAMPLE, TREAD, TPRIORITY, TINFO, TLIMITS.

The tables are the storage's (:class:`~..bins.tablestore.TableStore`); the rows and
their rules are the pure engine's (:mod:`..bins.tables`).  Here: turning a request's
value into rows and rows into a reply's value (:mod:`..bins.tables.values`), and the
waiting.  An insert or sample that the table's rate limiter does not let through
now (the engine's :class:`~..bins.tables.WouldBlockError`) is parked with
:class:`~.waits.Waits` for up to the request's ``wait`` seconds: other connections
are served meanwhile, and each change of the table tests it again.  Inserts and
samples wait in two queues (:func:`wait_key`), each in arrival order, so a sample
waiting for rows never holds back the insert that would give them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tensorshare.errors import BadRequestError, BusyError, RemoteError
from tensorshare.protocol.messages import (
    TCREATE, TINFO, TINSERT, TLIMITS, TPRIORITY, TREAD, TSAMPLE, TWRITE, Key, TableKey,
)
from tensorshare.wire.frames import frame_head
from tensorshare.wire.recycle import Recycler

from ..bins.tables import EmptyTableError, TableError, WouldBlockError
from ..bins.tables.values import Gathered, columns_of, float64_array, float64_bytes, int64_array, int64_bytes
from ..bins.tablestore import LIMIT_KEYS, TableEntry
from ..bins.store import Item
from .handlers import _check_value, handles

# The Waits lanes of a table's inserts and samples (bin names hold no control
# characters: these keys are no bin's).
LANES = _QUEUES = ("\x00insert", "\x00sample")
# Reply buffers of samples and reads, used again once written (a learner samples the
# same size over and over): 64 MiB at most, let go after 10 s unused.
_GATHER_BUFFERS = Recycler(64 << 20, bytearray, idle=10.0)


def wait_key(name: str, sampling: bool) -> str:
    """The :class:`~.waits.Waits` key under which a table's inserts (or samples) wait."""
    return name + _QUEUES[sampling]


def _publish(session, entry: TableEntry, op: str) -> None:
    """Tell listeners (and, through the registry's watchers, waiting requests)."""
    session.state.listeners.publish(session.storage.tables.changed(entry, op))


def _wake(session, name: str) -> None:
    """A change only waiting requests care about (a sample moved the rate limiter)."""
    waits = session.state.waits
    waits.changed(name + _QUEUES[0])
    waits.changed(name + _QUEUES[1])


# -- TCREATE, TINFO, TLIMITS


@handles(TCREATE)
def create(session, request) -> None:
    entry, change = session.storage.tables.create(request.bin, request.spec)
    session.send_header(TCREATE.reply(request.id, n=entry.table.size, seq=entry.seq))
    session.state.listeners.publish(change)


@handles(TINFO)
def info(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    session.send_header(TINFO.reply(request.id, info=_info(session, entry)))


@handles(TLIMITS)
def limits(session, request) -> None:
    """Change the rate limits at once; requests waiting on the table are tested again."""
    entry = session.storage.tables.get(request.bin)
    unknown = [k for k in request.limits if k not in LIMIT_KEYS]
    if unknown:
        raise BadRequestError(f"unknown limit {unknown[0]!r:.60} (known: {', '.join(LIMIT_KEYS)})")
    given = dict(request.limits)
    if isinstance(given.get("error_buffer"), list):
        given["error_buffer"] = tuple(given["error_buffer"])
    try:
        entry.table.set_limits(**given)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"bad limits: {exc}") from None
    session.send_header(TLIMITS.reply(request.id, info=_info(session, entry)))
    _wake(session, entry.name)


def _info(session, entry: TableEntry) -> dict:
    info = entry.table.info()
    info["waiting_inserts"] = session.state.waits.waiting(wait_key(entry.name, False))
    info["waiting_samples"] = session.state.waits.waiting(wait_key(entry.name, True))
    info["seq"] = entry.seq
    return _plain(info)


def _plain(value):
    """``value`` with numpy scalars and tuples made msgpack's plain types; inf as None."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


# -- TINSERT, TWRITE


def _rows(session, entry: TableEntry, request):
    """The request's value as rows: ``{column: RawArray}``, or a list of one item
    for a table of items (each insert adds one)."""
    if entry.table.columns:
        return columns_of(request.value, request.payload, request.payload_len, session.decode_limits)
    _check_value(session, request.value, request.payload_len)
    session.storage.tables.check_room(request.payload_len + len(request.value))  # items are held in memory
    return [Item(request.value, tuple(request.payload), request.payload_len)]


def _priorities(request):
    blob = request.priorities
    return None if blob is None else float64_array(blob, "priorities")


@handles(TINSERT)
def insert(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    if request.tensordict and entry.table.columns:
        session.storage.tables.mark_tensordict(entry)
    batch, priorities = _rows(session, entry, request), _priorities(request)

    def run():
        written = entry.table.insert(batch, priorities)
        return written

    def reply(written) -> None:
        _publish(session, entry, "INSERT")
        session.send_header(TINSERT.reply(request.id, n=entry.table.size, seq=entry.seq,
                                          keys=int64_bytes(written.keys)))

    _run_or_wait(session, request, entry, False, run, reply, lambda: entry.table.can_insert(_count(batch)))


@handles(TWRITE)
def write(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    if request.tensordict and entry.table.columns:
        session.storage.tables.mark_tensordict(entry)
    indices = int64_array(request.indices, "indices")
    written = entry.table.write(indices, _rows(session, entry, request), _priorities(request))
    _publish(session, entry, "WRITE")
    session.send_header(TWRITE.reply(request.id, n=entry.table.size, seq=entry.seq, keys=int64_bytes(written.keys)))


def _count(batch) -> int:
    if isinstance(batch, list):
        return len(batch)
    first = next(iter(batch.values()), None)
    return 0 if first is None or not first.shape else int(first.shape[0])


# -- TSAMPLE, TREAD, TPRIORITY


@handles(TSAMPLE)
def sample(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    table, n = entry.table, request.n
    session.storage.tables.check_reply(entry, n)  # bounded and counted before anything is drawn

    def run():
        gathered = Gathered(table.columns, n, _GATHER_BUFFERS.take) if table.columns else None
        drawn = table.sample(n, out=None if gathered is None else gathered.out)
        return drawn, gathered

    def reply(result) -> None:
        drawn, gathered = result
        if drawn.removed.keys.size:  # rows that reached max_times_sampled left
            _publish(session, entry, "SAMPLE")
        else:
            _wake(session, entry.name)
        _send_rows(session, request, entry, drawn, gathered, drawn.probabilities)

    def ready() -> bool:
        return table.size > 0 and table.can_sample(n)

    _run_or_wait(session, request, entry, True, run, reply, ready)


@handles(TREAD)
def read(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    table = entry.table
    indices = int64_array(request.indices, "indices")
    session.storage.tables.check_reply(entry, indices.size)  # bounded and counted before anything is gathered
    gathered = Gathered(table.columns, indices.size, _GATHER_BUFFERS.take) if table.columns else None
    rows = table.read(indices, out=None if gathered is None else gathered.out)
    _send_rows(session, request, entry, rows, gathered, None)


def _send_rows(session, request, entry: TableEntry, rows, gathered: Gathered | None, probabilities) -> None:
    """A 226 reply: one value of stacked columns, or the items one by one.  A
    same-host client that asked for references (``ref``) may get the stacked columns
    as a reference to a copy in the shared-memory area instead (PROTOCOL.md §10.3)."""
    header = request.command.reply(request.id)
    release = None
    header[Key.SEQ] = entry.seq
    header[TableKey.KEYS] = int64_bytes(rows.keys)
    header[TableKey.INDICES] = int64_bytes(rows.indices)
    if probabilities is not None:
        header[TableKey.PROBABILITIES] = float64_bytes(probabilities)
    if gathered is not None:
        header[Key.ITEMS], header[Key.SIZES] = [gathered.description], [gathered.nbytes]
        header[TableKey.COLUMNS] = True
        if entry.tensordict:
            header[TableKey.TENSORDICT] = True
        files = session.shared.rows_ref(request.ref, gathered)  # same host: through shared memory (§10.3)
        if files is not None:
            header[Key.REFS] = [files.ref()]
            session.shared.pin(request.id, [None], [files])
            parts, payload_len = [], 0
        else:
            parts = [memoryview(gathered.buffer)] if gathered.nbytes else []
            payload_len = gathered.nbytes
            if payload_len:  # counted in the memory budget until written
                release = session.storage.tables.hold_reply(payload_len)
    else:
        items = rows.items
        header[Key.ITEMS] = [item.description for item in items]
        header[Key.SIZES] = [item.nbytes for item in items]
        parts = [segment for item in items for segment in item.segments]
        payload_len = sum(item.nbytes for item in items)
    parts.insert(0, frame_head(header, payload_len))
    session.send(parts, on_abandon=release, on_written=release)
    _GATHER_BUFFERS.maybe_trim()


@handles(TPRIORITY)
def update_priorities(session, request) -> None:
    entry = session.storage.tables.get(request.bin)
    keys = int64_array(request.keys, "keys")
    updated = entry.table.update_priorities(keys, float64_array(request.priorities, "priorities"))
    session.send_header(TPRIORITY.reply(request.id, n=updated))
    if updated:
        _wake(session, entry.name)


# -- waiting for the rate limiter


def _run_or_wait(session, request, entry: TableEntry, sampling: bool, run: Callable, reply: Callable,
                 ready: Callable[[], bool]) -> None:
    """``reply(run())`` now, or once ``ready()`` (the rate limiter lets it through),
    waiting up to ``request.wait`` seconds behind the requests of its queue that came
    first; 450 (:class:`~tensorshare.errors.BusyError`, a TimeoutError) when the wait ends."""
    waits, tables, name = session.state.waits, session.storage.tables, entry.name
    key = wait_key(name, sampling)
    if not waits.waiting(key):
        try:
            result = run()
        except (WouldBlockError, EmptyTableError) as exc:
            if not request.wait:
                raise BusyError(f"table {name!r}: {exc.message} (asked to wait 0s)") from None
        else:
            reply(result)
            return
    wait = request.wait or 0

    def finish(result, error: RemoteError | None) -> None:
        if error is not None:
            session.refuse(request.id, error)
        else:
            reply(result)

    def start(done: Callable) -> None:
        def still_ready() -> bool:
            if tables.current(name) is not entry:
                return True  # deleted (or made anew): go() says so
            try:
                return ready()
            except TableError:
                return True  # it never could: go() says why

        def go() -> None:
            try:  # (an EmptyTableError now is a table emptied by a DELETE and a new table: said as is)
                if tables.current(name) is not entry:
                    raise RemoteError(f"table {name!r} was deleted while this request waited", 550)
                result = run()
            except RemoteError as exc:
                done(None, exc)
            else:
                done(result, None)
            finally:
                waits.settled(key)

        def expire() -> None:
            what = "sample" if sampling else "insert"
            done(None, BusyError(f"table {name!r}: the {what} was not let through within {wait:g}s "
                                 f"(size {entry.table.size}, inserts {entry.table.inserts}, "
                                 f"samples {entry.table.samples}); nothing changed"))

        session.park(key, still_ready, go, wait, expire)

    session.wait_for(start, finish)
