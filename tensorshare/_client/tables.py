"""The table verbs of both clients (PROTOCOL.md §12), written once.

A table is a bin of rows with fixed-shape columns (or of opaque items) that the
server samples, prioritizes and rate-limits: a replay buffer, or a dataset read and
written at indices.  :class:`TableMethods` is a base of
:class:`~.methods.ClientMethods` and sends through its ``_call`` (and its
``_server_wait`` for requests that wait in the server), so
:class:`tensorshare.Client` answers with the result and
:class:`tensorshare.AsyncClient` with a Deferred of it.

Keys, indices, priorities and probabilities travel as little-endian int64/float64
bytes and come back as torch tensors.  A ``tensordict.TensorDict`` batch is sent
as its dict of columns (tensordict stays optional).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ProtocolError, UsageError
from ..protocol.messages import TCREATE, TINFO, TINSERT, TLIMITS, TPRIORITY, TREAD, TSAMPLE, TWRITE, Key, TableKey
from .options import DEFAULT, Timeout
from .verb import verb


@dataclass
class TableSample:
    """What :meth:`TableMethods.sample` returns.

    ``value``: for a table of columns ``{column: tensor [n, *shape]}`` (one gather in
    the server, one reply), for a table of items the list of the ``n`` items.
    ``keys`` (int64, for :meth:`~TableMethods.update_priorities`), ``indices`` (the
    rows' slots, for :meth:`~TableMethods.read`/``write``) and ``probabilities``
    (float64, each row's chance of being drawn, for importance weights) are ``[n]``
    tensors.

    A sample of ``n`` sequences of ``length`` rows (``sample(..., length=)``) has
    ``[n, length, *shape]`` columns and ``[n, length]`` keys and indices, one
    probability per sequence (its first row's) and ``lengths``, each sequence's real
    length (shorter ones are padded with their last row when ``pad=True``)."""

    value: Any
    keys: torch.Tensor
    indices: torch.Tensor
    probabilities: torch.Tensor
    lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.keys.numel())


_NUMPY_FLOATS = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


def _int64_bytes(values, what: str) -> bytes:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
        if array.dtype.kind not in "iu" and array.size:
            raise UsageError(f"{what} must be integers, not {array.dtype}")
        return np.ascontiguousarray(array.reshape(-1), "<i8").tobytes()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what} must be integers: {exc}") from None


def _float64_bytes(values, what: str) -> bytes:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        # numpy widens to float64 below (a torch .to() cost more than the rest of a learner's
        # update on 256 priorities); dtypes numpy lacks (bfloat16) are widened by torch
        values = values.numpy() if values.dtype in _NUMPY_FLOATS else values.to(torch.float64).numpy()
    try:
        return np.ascontiguousarray(np.asarray(values, np.float64).reshape(-1), "<f8").tobytes()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what} must be numbers: {exc}") from None


def _tensor(blob: bytes | None, dtype: str) -> torch.Tensor:
    if not blob:
        return torch.zeros(0, dtype=torch.int64 if dtype == "<i8" else torch.float64)
    return torch.from_numpy(np.frombuffer(blob, dtype).copy())


def _column_spec(name: str, spec) -> dict:
    if isinstance(spec, dict):
        shape, dtype = spec.get("shape"), spec.get("dtype")
    else:
        try:
            shape, dtype = spec
        except (TypeError, ValueError):
            raise UsageError(f"column {name!r}: expected (shape, dtype), got {spec!r:.60}") from None
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        dtype = np.dtype(dtype).name
    shape = [shape] if isinstance(shape, int) else [int(d) for d in shape]
    return {"shape": shape, "dtype": dtype}


def _keys(with_size: bool, most: int):
    """The result of an insert or a write of at most ``most`` rows: the keys, or
    ``(keys, size, seq)``."""
    if with_size:
        return lambda reply: (_changed_keys(reply.header, most), reply.header[Key.N], reply.header[Key.SEQ])
    return lambda reply: _changed_keys(reply.header, most)


def _changed_keys(header: dict, most: int) -> torch.Tensor:
    """The keys an insert or write reply gives: as runs ``[first, step, count, ...]``
    (the request accepts them: ``key_runs``), or as int64 bytes; no more than ``most``."""
    runs = header.get(TableKey.KEY_RUNS)
    if runs is None:
        blob = header.get(TableKey.KEYS)
        if blob is None:
            raise ProtocolError(f"a table's change reply without its keys: {header!r:.200}")
        return _tensor(blob, "<i8")
    counts = runs[2::3]
    if len(runs) % 3 or min(counts, default=0) < 0 or sum(counts) > most:
        raise ProtocolError(f"key runs that do not fit {most} rows: {runs!r:.200}")
    parts = [np.arange(first, first + step * count, step, np.int64) if step else np.full(count, first, np.int64)
             for first, step, count in zip(runs[0::3], runs[1::3], counts)]
    return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64))


def _most_rows(batch: Any) -> int:
    """The most rows a batch can hold: its columns' longest first dimension (one for an item)."""
    if not isinstance(batch, dict):
        return 1
    return max((len(column) for column in batch.values() if getattr(column, "ndim", 0)), default=1)


def _with_slots(info: dict) -> dict:
    """TINFO's map with its page of slots as tensors."""
    page = info["slots"]
    info["slots"] = {"indices": _tensor(page["indices"], "<i8"), "keys": _tensor(page["keys"], "<i8"),
                     "priorities": _tensor(page["priorities"], "<f8"),
                     "times_sampled": _tensor(page["times_sampled"], "<i8"), "next": page["next"]}
    if "ends" in page:
        info["slots"]["ends"] = torch.from_numpy(np.frombuffer(page["ends"], np.uint8) != 0)
    return info


def priority_fields(name: str, keys: Any, priorities: Any) -> dict:
    """The fields of a TPRIORITY of table ``name``."""
    return {Key.BIN: name, TableKey.KEYS: _int64_bytes(keys, "keys"),
            TableKey.PRIORITIES: _float64_bytes(priorities, "priorities")}


def _ends_bytes(ends) -> bytes:
    if isinstance(ends, torch.Tensor):
        ends = ends.detach().cpu().numpy()
    if isinstance(ends, np.ndarray) and ends.dtype == np.bool_:  # flags as they go: a byte each, 0 or 1
        return ends.reshape(-1).view(np.uint8).tobytes()
    try:
        return np.ascontiguousarray(np.asarray(ends).reshape(-1) != 0, np.uint8).tobytes()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"ends must be one flag per row: {exc}") from None


def _sequences(sample: TableSample, n: int, length: int) -> TableSample:
    """A sample of ``n * length`` rows as ``n`` sequences: each tensor ``[n, length, ...]``."""
    value = sample.value
    if isinstance(value, dict):
        value = {k: v.reshape(n, length, *v.shape[1:]) for k, v in value.items()}
    elif hasattr(value, "batch_size"):  # a TensorDict
        value = value.reshape(n, length)
    return TableSample(value, sample.keys.reshape(n, length), sample.indices.reshape(n, length),
                       sample.probabilities, sample.lengths)


def _is_tensordict(batch: Any) -> bool:
    return type(batch).__module__.startswith("tensordict") and hasattr(batch, "batch_size")


def _as_batch(batch: Any, fields: dict) -> Any:
    """A TensorDict's columns as a plain dict (rows first), the request marked so that
    rows come back as a TensorDict; anything else as it is."""
    if _is_tensordict(batch):
        fields[TableKey.TENSORDICT] = True
        return {key: value for key, value in batch.items()}
    return batch


def _rows_value(reply) -> Any:
    """The value of a 226 rows reply: the stacked columns (a TensorDict of batch size
    ``[n]`` if the table's rows came as TensorDicts), or the list of items."""
    values = reply.values
    if not reply.header.get(TableKey.COLUMNS):
        return values
    if reply.header.get(TableKey.TENSORDICT):
        from tensordict import TensorDict

        n = len(reply.header[TableKey.KEYS]) // 8
        return TensorDict(values[0], batch_size=[n])
    return values[0]


class TableMethods:
    """Replay buffers and datasets held by the server (see the module docstring)."""

    _unawaited: Any = ()  # requests sent without waiting (the blocking Client's: _client/unawaited.py)

    def _settle_unawaited(self, timeout: Timeout) -> None:
        pass

    @verb
    def create_table(self, name: str, capacity: int, columns: dict[str, Any] | None = None, *,
                     sampler: str = "uniform",
                     priority_exponent: float = 1.0, remover: str | None = "fifo", max_times_sampled: int = 0,
                     min_size_to_sample: int = 1, samples_per_insert: float | None = None,
                     error_buffer: float | tuple[float, float] | None = None, meta: dict | None = None,
                     add_columns: bool = False, replace: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Make table ``name`` of ``capacity`` rows; returns its row count (0, or more if
        a table with the same settings is there already: it is kept as it is).

        ``columns``: ``{column: (shape, dtype)}``, fixed-shape columns preallocated in
        the server (a sample is one gather per column); None: a table of items (any
        value, one per insert; samples return lists).  ``sampler``: ``"uniform"``,
        ``"prioritized"`` (proportional to ``priority ** priority_exponent``),
        ``"fifo"`` or ``"lifo"``; ``remover`` (which row goes when an insert finds the
        table full): ``"fifo"``, ``"lowest_priority"`` or None (the insert waits for a
        row to leave, with ``max_times_sampled``, or is refused).  A row sampled
        ``max_times_sampled`` times leaves (0: never).  Rate limits (Reverb's):
        samples wait until the table holds ``min_size_to_sample`` rows; with
        ``samples_per_insert`` inserts and samples keep that ratio within
        ``error_buffer``, each waiting for the other (see :meth:`set_table_limits`).
        ``meta``: a JSON-able map the server keeps with the table and gives back in
        :meth:`table_info` (``tensorshare.torchrl`` notes there how values map to
        columns).  ``add_columns=True``: a table there whose settings differ only by
        lacking some of ``columns`` gains them (zeros in the rows it holds).
        ``replace=True``: a table there is replaced by the new, empty one, once the
        server has accepted the new settings (a refused one leaves it as it was).
        """
        spec: dict = {"capacity": capacity, "sampler": sampler, "priority_exponent": priority_exponent,
                      "remover": remover, "max_times_sampled": max_times_sampled,
                      "min_size_to_sample": min_size_to_sample, "samples_per_insert": samples_per_insert,
                      "error_buffer": list(error_buffer) if isinstance(error_buffer, tuple) else error_buffer}
        if columns is not None:
            spec["columns"] = {str(k): _column_spec(k, v) for k, v in dict(columns).items()}
        if meta is not None:
            spec["meta"] = meta
        for key in ("priority_exponent", "samples_per_insert"):
            if isinstance(spec[key], int) and not isinstance(spec[key], bool):
                spec[key] = float(spec[key])
        fields = {Key.BIN: name, TableKey.SPEC: spec}
        if add_columns:
            fields[TableKey.ADD_COLUMNS] = True
        if replace:
            fields[TableKey.REPLACE] = True
        return self._call(TCREATE, fields, timeout=timeout)

    @verb
    def insert(self, name: str, batch: Any, priorities: Any = None, *, ends: Any = None,
               timeout: Timeout = DEFAULT, with_size: bool = False, shared: bool | None = None) -> Any:
        """Add rows to table ``name``; returns their keys (an int64 tensor).

        ``batch``: for a table of columns a dict (or TensorDict) of tensors with the
        rows along the first dimension; for a table of items, one item.
        ``priorities``: one per row, one for all, or None (1.0).  When the rate limiter
        holds inserts back, the server keeps the request (serving others) until it
        may proceed or ``timeout`` seconds (the client's by default) have passed:
        then :class:`~tensorshare.errors.BusyError`, a ``TimeoutError``, and nothing
        was inserted.  ``with_size``: returns ``(keys, rows in the table, its seq)``.
        ``ends``: one flag per row, true where the row ends its episode (no sequence
        :meth:`sample` draws runs past it).  A batch larger than a table with the fifo
        remover keeps its newest rows, as a ring buffer does.

        ``shared``, on the server's host: a large batch of columns (512 KiB or more
        by default) goes through the server's shared memory instead of the socket:
        written into files (the same files again for the next batch) that the server
        copies the rows from.  ``None`` (the default): where the server answers
        inserts into this table with ``mapped`` (a table in files, not durable, which
        takes the rows from those files as they are: PROTOCOL.md §10.4), so from the
        second large batch on; ``True``: for any table; ``False``: never."""
        fields = {Key.BIN: name, TableKey.KEY_RUNS: True}
        if priorities is not None:
            fields[TableKey.PRIORITIES] = _float64_bytes(priorities, "priorities")
        if ends is not None:
            fields[TableKey.ENDS] = _ends_bytes(ends)
        call_timeout = self._server_wait(fields, timeout)
        batch = _as_batch(batch, fields)
        return self._call(TINSERT, fields, batch, timeout=call_timeout, then=_keys(with_size, _most_rows(batch)),
                          zero_copy=shared)

    @verb
    def sample(self, name: str, n: int, *, length: int | None = None, pad: bool = False,
               timeout: Timeout = DEFAULT, shared: bool = False, device: Any = None,
               update: tuple[Any, Any] | None = None) -> TableSample:
        """Draw ``n`` rows from table ``name`` with its sampler; returns a
        :class:`TableSample`.  Waits in the server as :meth:`insert` does (an empty
        table, ``min_size_to_sample``, the rate limiter), up to ``timeout``.

        ``shared=True``, on the server's host: large rows come through the server's
        shared memory (written there, mapped here) instead of the socket.  Off by
        default: writing a new file per sample costs the server more than the send
        it saves on a quiet machine (docs/design.md, "Tables").

        ``device`` (``"cuda"``): the batch arrives there (a large one is copied to
        the device as it arrives, through the client's transfer engine); keys,
        indices and probabilities stay CPU tensors.

        ``length``: ``n`` sequences of ``length`` rows that follow each other within
        one episode (see ``insert``'s ``ends``), each drawn by its first row with
        the table's sampler (uniform, or by the first row's priority: a sequence's
        priority is set by its first key); ``pad=True`` draws those cut short by an
        episode's end too, padded with their last row (:class:`TableSample`).

        ``update=(keys, priorities)``: set those priorities first, in the same request
        (a learner's loop: the last batch's new priorities ride on the next sample,
        one round trip and one request a step).  As :meth:`update_priorities` just
        before would: bad priorities are refused with nothing changed and nothing
        drawn, and the update stays if the sample then waits and gives up."""
        fields = {Key.BIN: name, Key.N: n}
        if update is not None:
            try:
                keys, priorities = update
            except (TypeError, ValueError):
                raise UsageError("update must be a pair (keys, priorities)") from None
            fields.update(priority_fields(name, keys, priorities))
        if length is not None:
            fields[TableKey.LENGTH] = length
            if pad:
                fields[TableKey.PAD] = True
        call_timeout = self._server_wait(fields, timeout)

        def then(reply) -> TableSample:
            header = reply.header
            drawn = TableSample(_rows_value(reply), _tensor(header[TableKey.KEYS], "<i8"),
                                _tensor(header[TableKey.INDICES], "<i8"),
                                _tensor(header.get(TableKey.PROBABILITIES), "<f8"))
            if length is None:
                return drawn
            drawn.lengths = _tensor(header.get(TableKey.LENGTHS), "<i8")
            return _sequences(drawn, n, length)

        return self._call(TSAMPLE, fields, timeout=call_timeout, then=then, zero_copy=shared,
                          **({} if device is None else {"device": device}))

    @verb
    def update_priorities(self, name: str, keys: Any, priorities: Any, *, timeout: Timeout = DEFAULT) -> int:
        """Set the priorities of the rows ``keys`` (from :meth:`insert` or a sample);
        rows that left meanwhile are skipped.  Returns how many were updated.
        (The blocking client's ``update_priorities_nowait`` does not wait for that.)"""
        if self._unawaited:  # the outcome of those sent without waiting, first
            self._settle_unawaited(timeout)
        return self._call(TPRIORITY, priority_fields(name, keys, priorities), timeout=timeout)

    @verb
    def write(self, name: str, indices: Any, batch: Any, priorities: Any = None, *, ends: Any = None,
              times_sampled: Any = None, timeout: Timeout = DEFAULT, with_size: bool = False) -> Any:
        """Put rows at the slot ``indices`` (distinct, in ``[0, capacity)``) of table
        ``name``, replacing what was there (a dataset written at indices); returns
        the new rows' keys (``with_size``, ``ends``: as :meth:`insert`).
        ``times_sampled``: how many times each row was sampled already (integers,
        each below the table's ``max_times_sampled`` if it has one; a table made
        again from a checkpoint); by default none."""
        fields = {Key.BIN: name, TableKey.INDICES: _int64_bytes(indices, "indices"), TableKey.KEY_RUNS: True}
        if priorities is not None:
            fields[TableKey.PRIORITIES] = _float64_bytes(priorities, "priorities")
        if ends is not None:
            fields[TableKey.ENDS] = _ends_bytes(ends)
        if times_sampled is not None:
            fields[TableKey.TIMES_SAMPLED] = _int64_bytes(times_sampled, "times_sampled")
        most = len(fields[TableKey.INDICES]) // 8
        return self._call(TWRITE, fields, _as_batch(batch, fields), timeout=timeout, then=_keys(with_size, most))

    @verb
    def read(self, name: str, indices: Any, *, sample: bool = False, timeout: Timeout = DEFAULT,
             shared: bool = False, device: Any = None, with_keys: bool = False, empty: bool = False) -> Any:
        """The rows at slot ``indices`` (any, repeats allowed) of table ``name``:
        ``{column: tensor [len(indices), *shape]}``, or a list of items.  Counts as no
        sample, unless ``sample=True``: rows the caller drew itself (a sampler of its
        own, TorchRL's), counted as a sample of that many rows by the table (its rate
        limiter, each row's count, ``max_times_sampled``) and waiting in the server
        for the rate limiter as :meth:`sample` does.  ``shared``, ``device``: as for
        :meth:`sample`.  ``with_keys``: returns ``(rows, keys)``, the keys (int64) of
        the rows read, which tell whether a slot still holds the row one expects.
        ``empty=True`` (not with ``sample``): a slot that holds no row reads as zeros
        (None for an item) with key -1, instead of a :class:`BadRequestError`."""
        fields = {Key.BIN: name, TableKey.INDICES: _int64_bytes(indices, "indices")}
        if empty:
            fields[TableKey.EMPTY] = True
        call_timeout = timeout
        if sample:
            fields[TableKey.SAMPLE] = True
            call_timeout = self._server_wait(fields, timeout)
        then = (lambda reply: (_rows_value(reply), _tensor(reply.header[TableKey.KEYS], "<i8"))) if with_keys \
            else _rows_value
        return self._call(TREAD, fields, timeout=call_timeout, then=then, zero_copy=shared,
                          **({} if device is None else {"device": device}))

    @verb
    def table_info(self, name: str, *, slots: int | None = None, timeout: Timeout = DEFAULT) -> dict[str, Any]:
        """Table ``name``'s settings and counters: size, capacity, inserts, samples,
        removals, the rate limiter's state, requests waiting, seconds requests waited
        for it (``blocked_seconds``), ``meta``...  With ``slots=i``, also
        ``info["slots"]``: the occupied slots from index ``i`` on (at most 2**18 of
        them), as int64/float64 tensors ``indices``, ``keys``, ``priorities`` and
        ``times_sampled``, and ``next``, the index to ask from for the rest (None: no
        more)."""
        fields = {Key.BIN: name}
        if slots is None:
            return self._call(TINFO, fields, timeout=timeout)
        fields[TableKey.SLOTS] = slots
        return self._call(TINFO, fields, timeout=timeout, then=lambda reply: _with_slots(reply.header[TableKey.INFO]))

    @verb
    def set_table_limits(self, name: str, *, timeout: Timeout = DEFAULT, **limits: Any) -> dict[str, Any]:
        """Change table ``name``'s rate limits now (``min_size_to_sample``,
        ``samples_per_insert``, ``error_buffer``; those not given stay); requests
        waiting on it are tested again at once.  Returns :meth:`table_info`."""
        if isinstance(limits.get("error_buffer"), tuple):
            limits["error_buffer"] = list(limits["error_buffer"])
        if isinstance(limits.get("samples_per_insert"), int):
            limits["samples_per_insert"] = float(limits["samples_per_insert"])
        return self._call(TLIMITS, {Key.BIN: name, TableKey.LIMITS: limits}, timeout=timeout)
