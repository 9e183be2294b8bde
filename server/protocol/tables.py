"""What the server does for the table verbs (PROTOCOL.md §12): TCREATE, TINSERT,
TWRITE, TSAMPLE (rows, or sequences of rows), TREAD, TPRIORITY, TINFO, TLIMITS.

The tables are the storage's (``session.storage``: the table named, then its
operations, each publishing the change it made and returning it); the rows and their rules are the
pure engine's (``server/bins/tables/``).  Here: a request's fields into a storage
call, its result into a reply, and the waiting.  An insert or sample that the
table's rate limiter does not let through now (the engine's ``WouldBlockError``)
waits in its lane (``insert``, ``sample``: as its verb declares) for up to the
request's ``wait`` seconds: other connections are served meanwhile, each change of
the table tests it again, and a sample waiting for rows never holds back the
insert that would give them; a read counted as a sample (TREAD ``sample``) waits
as a sample does.  A sample's or read's reply is bounded before anything is drawn,
and its gathered rows count in the memory budget until it is written.  A sample may
carry a priority update, set before it draws.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tensorshare.errors import BadRequestError, BusyError, RemoteError
from tensorshare.protocol.messages import (
    TCREATE, TINFO, TINSERT, TLIMITS, TPRIORITY, TREAD, TSAMPLE, TWRITE, Key, TableKey,
)
from tensorshare.wire.frames import frame_head

from ..bins.tables import EmptyTableError, WouldBlockError
from ..bins.tables.blocks import is_run
from ..bins.tables.values import float64_array, float64_bytes, int64_array, int64_bytes
from .outcome import in_lane, later
from .registry import handles


_COUNTED_HEADER = 64 << 10  # a reply header past this many bytes counts in the memory budget until written


# -- TCREATE, TINFO, TLIMITS


@handles(TCREATE)
def create(session, request):
    storage, name = session.storage, request.bin

    def made(result, error: RemoteError | None) -> dict:
        if error is not None:
            raise error
        return TCREATE.reply(request.id, n=storage.count(name), seq=storage.seq(name))

    def make(done: Callable) -> None:
        storage.create_table(name, request.spec, done, bool(request.add_columns))

    if not (request.replace and storage.is_table(name)):
        return later(make, made)
    storage.check_table_replacement(name, request.spec)  # a refused table leaves the old one as it was

    def replace(done: Callable) -> None:
        def deleted(change, error: RemoteError | None) -> None:
            if error is not None:
                done(None, error)
                return
            try:
                make(done)
            except RemoteError as exc:  # (a bin took the name meanwhile)
                done(None, exc)

        storage.delete(name, deleted)

    return later(replace, made)


@handles(TINFO)
def info(session, request) -> dict:
    return TINFO.reply(request.id, info=_info(session, request.bin, session.storage.table(request.bin),
                                              request.slots))


@handles(TLIMITS)
def limits(session, request) -> dict:
    """Change the rate limits at once (requests waiting on the table are tested again)."""
    storage = session.storage
    table = storage.table(request.bin)
    storage.set_table_limits(table, request.limits)
    return TLIMITS.reply(request.id, info=_info(session, request.bin, table))


def _info(session, name: str, table, slots: int | None = None) -> dict:
    info = session.storage.table_info(table, slots)
    waits = session.state.waits
    info["waiting_inserts"] = waits.waiting((name, TINSERT.lane))
    info["waiting_samples"] = waits.waiting((name, TSAMPLE.lane))
    return info


# -- TINSERT, TWRITE


def _rows(session, table, request):
    return session.storage.table_rows(table, request.value, request.payload, request.payload_len,
                                      session.decode_limits)


def _said_tensordict(session, request, table, then: Callable):
    """``then()``'s outcome, once a table whose rows came as TensorDicts (``tensordict``)
    says so: at once, or, for a durable table not marked yet, once its files say so."""
    storage = session.storage
    if not request.tensordict or storage.says_tensordict(table):
        return then()
    return later(lambda done: storage.mark_tensordict(table, done), lambda: then())


def _priorities(request):
    blob = request.priorities
    return None if blob is None else float64_array(blob, "priorities")


def _ends(request):
    """The rows' episode ends: one byte a row, nonzero where a row ends its episode."""
    blob = request.ends
    return None if blob is None else np.frombuffer(blob, np.uint8)


def _changed(session, request, result, mapped: bool = False) -> dict:
    """The reply of an insert or write (its change published by the storage): the
    rows' keys as runs where the request accepts them and they make few, else as
    int64 bytes; ``mapped`` (an insert's: §10.4) where the writer's large batches
    are best sent through shared memory."""
    keys, change = result
    runs = key_runs(keys) if request.key_runs else None
    if runs is not None:
        reply = request.command.reply(request.id, n=change.n_items, seq=change.seq, key_runs=runs)
    else:
        reply = request.command.reply(request.id, n=change.n_items, seq=change.seq, keys=int64_bytes(keys))
    if mapped:
        reply[Key.MAPPED] = True
    return reply


MAX_KEY_RUNS = 8  # runs a reply gives keys in; keys that need more go as bytes
_FEW_KEYS = 64  # up to this many, Python's ints find the runs faster than numpy's calls


def key_runs(keys: np.ndarray) -> list[int] | None:
    """``keys`` as runs ``[first, step, count, ...]`` (run ``r`` holds ``first + step * i``
    for ``i < count``), all of one step, or None if that takes more than
    :data:`MAX_KEY_RUNS`.  An insert's keys are one run (a run of slots, each one seq
    on), or two where it wraps around a ring: a few numbers instead of 8 bytes a row
    that the server packs and the client copies."""
    n = int(keys.size)
    if n < 2:
        return [int(keys[0]), 1, 1] if n else []
    if n <= _FEW_KEYS:  # (an actor's few rows: numpy's per-call cost was most of an insert's reply)
        keys = keys.tolist()
        steps = [b - a for a, b in zip(keys, keys[1:])]
        step = steps[len(steps) // 2]  # (a short run before a wrap does not set it)
        cuts = [i for i, s in enumerate(steps) if s != step]
    else:
        step = int(keys[1] - keys[0])
        if is_run(keys, step):  # (a ring's insert that does not wrap: one pass, no temporaries)
            return [int(keys[0]), step, n]
        steps = np.diff(keys)
        step = int(steps[steps.size // 2])
        cuts = np.flatnonzero(steps != step)[:MAX_KEY_RUNS].tolist()  # (enough to tell)
    if len(cuts) >= MAX_KEY_RUNS:
        return None
    bounds = [0, *(cut + 1 for cut in cuts), n]
    runs: list[int] = []
    for first, end in zip(bounds, bounds[1:]):
        runs += (int(keys[first]), step, end - first)
    return runs


@handles(TINSERT)
def insert(session, request):
    """Add rows: from the payload, or (``shm``) from the item directory a same-host
    client wrote (PROTOCOL.md §10.4), copied from its files into the table's."""
    storage = session.storage
    table = storage.table(request.bin)
    priorities, ends = _priorities(request), _ends(request)
    mapped = session.shared.maps_rows(table)

    def add(rows):
        return _said_tensordict(session, request, table, lambda: _run_or_wait(
            session, request, table, lambda: storage.insert_rows(table, rows, priorities, ends),
            lambda result: _changed(session, request, result, mapped), lambda: storage.can_insert(table, rows)))

    if request.shm is None:
        return add(_rows(session, table, request))
    incoming, item_name, size = session.shared.adoption(request)
    return add(storage.shared_table_rows(table, incoming, item_name, request.value, size, session.decode_limits,
                                         session.shared.kept_rows))


@handles(TWRITE)
def write(session, request):
    storage = session.storage
    table = storage.table(request.bin)
    indices = int64_array(request.indices, "indices")
    counts = None if request.times_sampled is None else int64_array(request.times_sampled, "times_sampled")
    rows, priorities, ends = _rows(session, table, request), _priorities(request), _ends(request)
    return _said_tensordict(session, request, table, lambda: _changed(
        session, request, storage.write_rows(table, indices, rows, priorities, ends, counts)))


# -- TSAMPLE, TREAD, TPRIORITY


@handles(TSAMPLE)
def sample(session, request):
    """Draw rows; a request that carries ``keys`` and ``priorities`` (a learner's last
    update, riding on its next sample) has them set first, as a TPRIORITY just before
    would: refused (nothing changed, nothing drawn) if they are, and kept if the
    sample then waits and gives up."""
    storage, n, length, pad = session.storage, request.n, request.length, bool(request.pad)
    table = storage.table(request.bin)
    rows = n * (length or 1)  # (n sequences of length rows)
    storage.check_rows_reply(table, rows)  # bounded and counted before anything is drawn
    if request.keys is not None or request.priorities is not None:
        if request.keys is None or request.priorities is None:
            raise BadRequestError("a sample that updates priorities needs both keys and priorities")
        _reprioritize(storage, table, request)
    return _run_or_wait(session, request, table, lambda: storage.sample_rows(table, n, length, pad),
                        lambda result: _sampled(session, request, result), lambda: storage.can_sample(table, rows))


@handles(TREAD)
def read(session, request):
    storage = session.storage
    table = storage.table(request.bin)
    indices = int64_array(request.indices, "indices")
    if request.sample and request.empty:
        raise BadRequestError("a read counted as a sample takes rows, not empty slots: sample or empty, not both")
    storage.check_rows_reply(table, indices.size)  # bounded and counted before anything is gathered
    if not request.sample:
        return _rows_reply(session, request, storage.read_rows(table, indices, empty=bool(request.empty))[0])
    # rows the reader drew itself (TorchRL's samplers), counted as a sample
    return _run_or_wait(session, request, table, lambda: storage.read_rows(table, indices, True),
                        lambda result: _sampled(session, request, result),
                        lambda: storage.can_read_rows(table, indices.size))


def _sampled(session, request, result):
    """The reply of rows counted as a sample (the storage told of what it changed)."""
    return _rows_reply(session, request, result[0])


def _rows_reply(session, request, drawn):
    """A 226 reply: one value of stacked columns, or the items one by one.  A
    same-host client that asked for references (``ref``) may get the stacked columns
    as a reference to a copy in the shared-memory area instead (PROTOCOL.md §10.3).
    Stacked columns sent as the payload, and a large header of items, count in the
    memory budget until written."""
    header = request.command.reply(request.id)
    release = None
    header[Key.SEQ] = drawn.seq
    header[TableKey.KEYS] = int64_bytes(drawn.keys)
    header[TableKey.INDICES] = int64_bytes(drawn.indices)
    if drawn.probabilities is not None:
        header[TableKey.PROBABILITIES] = float64_bytes(drawn.probabilities)
    if drawn.lengths is not None:
        header[TableKey.LENGTHS] = int64_bytes(drawn.lengths)
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
            if payload_len:
                release = session.storage.hold_reply(payload_len)
    else:
        items = drawn.items
        header[Key.ITEMS] = [item.description for item in items]
        header[Key.SIZES] = [item.nbytes for item in items]
        parts = [segment for item in items for segment in item.segments]
        payload_len = sum(item.nbytes for item in items)
    head = frame_head(header, payload_len)
    parts.insert(0, head)
    if gathered is None and len(head) > _COUNTED_HEADER:  # a table of items' many rows: its header counts too
        release = session.storage.hold_reply(len(head))
    return parts if release is None else (parts, release, release)


@handles(TPRIORITY)
def update_priorities(session, request) -> dict:
    storage = session.storage
    return TPRIORITY.reply(request.id, n=_reprioritize(storage, storage.table(request.bin), request))


def _reprioritize(storage, table, request) -> int:
    """The request's ``keys`` get its ``priorities`` (TPRIORITY's, or a TSAMPLE's); how many rows."""
    keys = int64_array(request.keys, "keys")
    return storage.update_priorities(table, keys, float64_array(request.priorities, "priorities"))


# -- waiting for the rate limiter


def _run_or_wait(session, request, table, run: Callable, reply: Callable, ready: Callable[[], bool]):
    """``reply(run())`` now, or once ``ready()`` (the rate limiter lets it through),
    waiting up to ``request.wait`` seconds behind the requests of its lane that came
    first; 450 (:class:`~tensorshare.errors.BusyError`, a TimeoutError) when the wait ends."""
    name, lane = request.bin, request.command.lane
    if not session.state.waits.waiting((name, lane)):
        try:
            return reply(run())
        except (WouldBlockError, EmptyTableError) as exc:
            if not request.wait:
                raise BusyError(f"table {name!r}: {exc.message} (asked to wait 0s)") from None
    wait = request.wait or 0
    clock = session.state.waits.clock
    began = clock.seconds()

    def blocked() -> None:  # the table's rate-limiter wait figure (ops)
        session.storage.note_blocked(table, lane, clock.seconds() - began)

    def go(done: Callable) -> None:
        blocked()
        # (an EmptyTableError now is a table emptied by a DELETE and a new table: said as is)
        done(run(), None)

    def expire(done: Callable) -> None:
        blocked()
        info = session.storage.table_info(table)
        done(None, BusyError(f"table {name!r}: the {lane} was not let through within {wait:g}s "
                             f"(size {info['size']}, inserts {info['inserts']}, "
                             f"samples {info['samples']}); nothing changed"))

    def finish(result, error: RemoteError | None):
        if error is not None:
            raise error
        return reply(result)

    return in_lane(name, request.command, ready, go, finish, wait, expire)
