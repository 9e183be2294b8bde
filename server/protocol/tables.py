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

from tensorshare.errors import BusyError, RemoteError
from tensorshare.protocol.messages import (
    TCREATE, TINFO, TINSERT, TLIMITS, TPRIORITY, TREAD, TSAMPLE, TWRITE, Key, TableKey,
)
from tensorshare.wire.frames import frame_head

from ..bins.tables import EmptyTableError, WouldBlockError
from ..bins.tables.values import float64_array, float64_bytes, int64_array, int64_bytes
from .handlers import handles

# The Waits lanes of a table's inserts and samples (bin names hold no control
# characters: these keys are no bin's).
LANES = _QUEUES = ("\x00insert", "\x00sample")


def wait_key(name: str, sampling: bool) -> str:
    """The :class:`~.waits.Waits` key under which a table's inserts (or samples) wait."""
    return name + _QUEUES[sampling]


def _wake(session, name: str) -> None:
    """A change only waiting requests care about (a sample moved the rate limiter)."""
    waits = session.state.waits
    waits.changed(name + _QUEUES[0])
    waits.changed(name + _QUEUES[1])


# -- TCREATE, TINFO, TLIMITS


@handles(TCREATE)
def create(session, request) -> None:
    def finish(made, error) -> None:
        if error is not None:
            session.refuse(request.id, error)
            return
        table, change = made
        session.send_header(TCREATE.reply(request.id, n=session.storage.count(request.bin),
                                          seq=session.storage.seq(request.bin)))
        session.state.listeners.publish(change)

    session.wait_for(lambda done: session.storage.create_table(request.bin, request.spec, done), finish)


@handles(TINFO)
def info(session, request) -> None:
    table = session.storage.table(request.bin)
    session.send_header(TINFO.reply(request.id, info=_info(session, request.bin, table)))


@handles(TLIMITS)
def limits(session, request) -> None:
    """Change the rate limits at once; requests waiting on the table are tested again."""
    storage = session.storage
    table = storage.table(request.bin)
    storage.set_table_limits(table, request.limits)
    session.send_header(TLIMITS.reply(request.id, info=_info(session, request.bin, table)))
    _wake(session, request.bin)


def _info(session, name: str, table) -> dict:
    info = session.storage.table_info(table)
    info["waiting_inserts"] = session.state.waits.waiting(wait_key(name, False))
    info["waiting_samples"] = session.state.waits.waiting(wait_key(name, True))
    return info


# -- TINSERT, TWRITE


def _rows(session, table, request):
    return session.storage.table_rows(table, request.value, request.payload, request.payload_len,
                                      session.decode_limits, bool(request.tensordict))


def _priorities(request):
    blob = request.priorities
    return None if blob is None else float64_array(blob, "priorities")


def _changed(session, request, result) -> None:
    """The reply of an insert or write, and its notification."""
    keys, change = result
    session.state.listeners.publish(change)
    session.send_header(request.command.reply(request.id, n=change.n_items, seq=change.seq, keys=int64_bytes(keys)))


@handles(TINSERT)
def insert(session, request) -> None:
    storage = session.storage
    table = storage.table(request.bin)
    rows, priorities = _rows(session, table, request), _priorities(request)
    _run_or_wait(session, request, table, False, lambda: storage.insert_rows(table, rows, priorities),
                 lambda result: _changed(session, request, result), lambda: storage.can_insert(table, rows))


@handles(TWRITE)
def write(session, request) -> None:
    storage = session.storage
    table = storage.table(request.bin)
    indices = int64_array(request.indices, "indices")
    _changed(session, request, storage.write_rows(table, indices, _rows(session, table, request), _priorities(request)))


# -- TSAMPLE, TREAD, TPRIORITY


@handles(TSAMPLE)
def sample(session, request) -> None:
    storage, n = session.storage, request.n
    table = storage.table(request.bin)

    def reply(result) -> None:
        drawn, change = result
        if change is not None:  # rows that reached max_times_sampled left
            session.state.listeners.publish(change)
        else:
            _wake(session, request.bin)
        _send_rows(session, request, drawn)

    _run_or_wait(session, request, table, True, lambda: storage.sample_rows(table, n), reply,
                 lambda: storage.can_sample(table, n))


@handles(TREAD)
def read(session, request) -> None:
    storage = session.storage
    table = storage.table(request.bin)
    _send_rows(session, request, storage.read_rows(table, int64_array(request.indices, "indices")))


def _send_rows(session, request, drawn) -> None:
    """A 226 reply: one value of stacked columns, or the items one by one.  A
    same-host client that asked for references (``ref``) may get the stacked columns
    as a reference to a copy in the shared-memory area instead (PROTOCOL.md §10.3)."""
    header = request.command.reply(request.id)
    header[Key.SEQ] = drawn.seq
    header[TableKey.KEYS] = int64_bytes(drawn.keys)
    header[TableKey.INDICES] = int64_bytes(drawn.indices)
    if drawn.probabilities is not None:
        header[TableKey.PROBABILITIES] = float64_bytes(drawn.probabilities)
    gathered = drawn.gathered
    if gathered is not None:
        header[Key.ITEMS], header[Key.SIZES] = [gathered.description], [gathered.nbytes]
        header[TableKey.COLUMNS] = True
        if drawn.tensordict:
            header[TableKey.TENSORDICT] = True
        files = session.shared.rows_ref(request.ref, gathered)  # same host: through shared memory (§10.3)
        if files is not None:
            header[Key.REFS] = [files.ref()]
            session.shared.pin(request.id, [None], [files])
            parts, payload_len = [], 0
        else:
            parts = [memoryview(gathered.buffer)] if gathered.nbytes else []
            payload_len = gathered.nbytes
    else:
        items = drawn.items
        header[Key.ITEMS] = [item.description for item in items]
        header[Key.SIZES] = [item.nbytes for item in items]
        parts = [segment for item in items for segment in item.segments]
        payload_len = sum(item.nbytes for item in items)
    parts.insert(0, frame_head(header, payload_len))
    session.send(parts)


@handles(TPRIORITY)
def update_priorities(session, request) -> None:
    storage = session.storage
    table = storage.table(request.bin)
    keys = int64_array(request.keys, "keys")
    updated = storage.update_priorities(table, keys, float64_array(request.priorities, "priorities"))
    session.send_header(TPRIORITY.reply(request.id, n=updated))
    if updated:
        _wake(session, request.bin)


# -- waiting for the rate limiter


def _run_or_wait(session, request, table, sampling: bool, run: Callable, reply: Callable, ready: Callable[[], bool]) -> None:
    """``reply(run())`` now, or once ``ready()`` (the rate limiter lets it through),
    waiting up to ``request.wait`` seconds behind the requests of its queue that came
    first; 450 (:class:`~tensorshare.errors.BusyError`, a TimeoutError) when the wait ends."""
    waits, name = session.state.waits, request.bin
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
        def go() -> None:
            try:  # (an EmptyTableError now is a table emptied by a DELETE and a new table: said as is)
                result = run()
            except RemoteError as exc:
                done(None, exc)
            else:
                done(result, None)
            finally:
                waits.settled(key)

        def expire() -> None:
            what = "sample" if sampling else "insert"
            info = session.storage.table_info(table)
            done(None, BusyError(f"table {name!r}: the {what} was not let through within {wait:g}s "
                                 f"(size {info['size']}, inserts {info['inserts']}, "
                                 f"samples {info['samples']}); nothing changed"))

        session.park(key, ready, go, wait, expire)

    session.wait_for(start, finish)
