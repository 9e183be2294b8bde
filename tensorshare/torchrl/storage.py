"""TableStorage: a TorchRL storage whose elements are the rows of a tensorshare table.

Every process (and machine) that makes a ``ReplayBuffer`` over the same table
shares one buffer.  It behaves as TorchRL's ``LazyTensorStorage`` does for what
a remote storage can honour: tensors, TensorDicts (nested, lazy-stacked),
tensorclasses and pytrees of tensors (:mod:`.schema`); ``ndim > 1``; indices of
every kind (:mod:`.indexing`); TorchRL's own writers and samplers, which write
and read at the indices they count; new keys become new columns.

* ``len()`` costs no round trip: the storage knows the table's size from the
  replies to its own writes and, once asked, from the server's notifications of
  every other process's changes (a LISTEN on the table).
* Reads a ReplayBuffer makes to sample (``storage.get``) count as samples of the
  table (``read(..., sample=True)``): its rate limiter (``samples_per_insert``)
  paces learners and actors whichever TorchRL sampler picked the rows.  Reads by
  index (``rb[i]``, ``storage[i]``) count nothing.
* It pickles to the server's address, the table's name and where the token comes
  from (``TENSORSHARE_TOKEN``, or ``token_file``; never the token), and
  reconnects in the process that unpickles it (multiprocessing, Ray).
* ``state_dict`` carries the rows; ``dumps``/``loads`` write and read a table
  checkpoint (``Client.save`` / ``Client.load_table``).

The table is made on the first write (as ``LazyTensorStorage`` allocates), with
the batch's columns and ``create_table``'s settings given here, or exists
already: then its capacity, columns and sampler are its own.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.storages.tensor import _flip_list
from torchrl.data.replay_buffers.utils import _is_int

from ..table_copy import occupied, pieces, table_spec, write_rows
from ..errors import BadNameError, NoSuchBinError, UsageError
from ..protocol.auth import resolve_token
from . import indexing
from .schema import Schema

KEYS_KEPT = 1 << 16  # slot -> key pairs a storage remembers, for rb.update_priority by index
_CLIENTS: dict[tuple, Any] = {}  # (pid, address, options, token source) -> client, for unpickled storages
_CLIENTS_LOCK = threading.Lock()


class TableStorage(TensorStorage):
    """A TorchRL storage over table ``name`` of ``client``'s server (see the module docstring).

    ``max_size``: the capacity of a table made here (one already there keeps its
    own).  ``ndim``: the dimensions that index elements, as TorchRL's storages take
    it (default: the table's, else 1).  ``device``: where values come back.
    ``token_file``: where another process finds the token, when the client was
    given one that ``TENSORSHARE_TOKEN`` does not hold.  Other keywords are
    ``create_table``'s (``sampler``, ``remover``, ``samples_per_insert``...), for a
    table made here.
    """

    def __init__(self, name: str, client, max_size: int | None = None, *, ndim: int | None = None,
                 device: Any = "cpu", token_file: str | None = None, **table_settings):
        self.name = name
        self._client_obj = client
        self._token_file = token_file
        if client is not None:
            self._token_source = _token_source(client, token_file)
        self._settings = table_settings
        self._state_lock = threading.Lock()
        self._size, self._seq = 0, -1
        self._listening = None
        self._pending = None  # (index, value) of the table's last sample (TableSampler): get() gives it
        self._keys: dict[int, int] = {}  # slot -> key of rows written or drawn lately
        self._tracks_keys = False  # a TablePrioritizedSampler updates priorities by index
        self._schema: Schema | None = None
        self._adopt(max_size, ndim)
        if self._schema is None and max_size is None:
            raise UsageError(f"no table {name!r} on the server: give max_size to make it")
        TensorStorage.__init__(self, storage=None, max_size=self.max_size, device=device, ndim=self.ndim)

    # -- the table

    @property
    def client(self):
        """The client this storage talks through (made from its address in a process
        that unpickled it)."""
        client = self._client_obj
        if client is None:
            client = self._client_obj = _reconnect(self._address)
        return client

    def _adopt(self, max_size: int | None, ndim: int | None) -> None:
        """Take the table's capacity, schema and size if it exists."""
        try:
            info = self.client.table_info(self.name)
        except NoSuchBinError:
            self.max_size = max_size
            self.__dict__["ndim"] = ndim or 1
            return
        schema = Schema.of_table(info)
        if schema is None:
            raise UsageError(f"table {self.name!r} holds items (no columns): a TableStorage needs a table of columns")
        if ndim is not None and ndim != schema.ndim:
            raise UsageError(f"table {self.name!r} holds a storage of ndim {schema.ndim}, not {ndim}")
        self._schema = schema
        self.__dict__["ndim"] = schema.ndim
        self.max_size = int(info["capacity"])
        self._note_size(int(info["size"]), int(info["seq"]))

    def _make(self, schema: Schema) -> None:
        """Make the table for values of ``schema`` (or take the one another process made)."""
        if schema.inner:  # TorchRL's rule: a capacity of whole rows along the first dimension
            per_row = math.prod(schema.inner)
            self.max_size = -(self.max_size // -per_row) * per_row
        spec = dict(self._table_settings(), capacity=self.max_size, columns=schema.table_columns(),
                    meta=schema.meta())
        try:
            self.client.create_table(self.name, **spec)
        except BadNameError:  # there with other settings (made by another process meanwhile?)
            self._adopt(None, self.ndim)
            if self._schema is None:
                raise
            self._schema.check(schema)
            return
        self._schema = schema

    def _table_settings(self) -> dict:
        """``create_table``'s keywords: those given, and those a TableSampler of a
        buffer over this storage asks for (a prioritized table)."""
        settings = {}
        for entity in self._attached_entities:
            settings.update(getattr(getattr(entity, "_sampler", None), "table_settings", None) or {})
        settings.update(self._settings)
        return settings

    def _fit(self, schema: Schema) -> None:
        """Make the table, or check ``schema`` against it and add the columns it lacks."""
        if self._schema is None:
            self._make(schema)
            return
        added = self._schema.check(schema)
        if added:
            columns = {**self._schema.table_columns(), **{c.name: c.spec() for c in added}}
            info = self.client.table_info(self.name)
            self.client.create_table(self.name, **{**table_spec(info), "columns": columns}, add_columns=True)
            self._schema.columns.extend(added)

    def _require_schema(self) -> Schema:
        if self._schema is None:
            try:
                self._adopt(None, self.ndim)
            except UsageError:
                raise
            if self._schema is None:
                raise RuntimeError(f"Cannot get elements out of a non-initialized storage (table {self.name!r} "
                                   f"has not been written to)")
        return self._schema

    # -- the size, without a round trip

    def _note_size(self, size: int, seq: int, restarted: bool = False) -> None:
        """The table holds ``size`` rows as of its change ``seq`` (kept if no later one
        was seen; ``restarted``: the state found by a listen restored after a
        reconnection, taken as it is, since a restarted server counts its seqs anew)."""
        with self._state_lock:
            if restarted or seq >= self._seq:
                self._size, self._seq = size, seq

    def _listen(self) -> None:
        """Hear of every change of the table from now on (other processes' writes)."""
        if self._listening is not None:
            return
        ref = weakref.ref(self)

        def changed(note) -> None:
            storage = ref()
            if storage is not None:
                storage._note_size(note.n_items, note.seq, restarted=note.op == "LISTEN")

        self._listening = False  # (a failure below is not retried on every len())
        handle = self.client.listen(self.name, changed)
        self._listening = handle
        snapshot = handle.snapshot
        if snapshot is not None:
            self._note_size(snapshot.n_items if snapshot.exists else 0, snapshot.seq)

    @property
    def _len(self) -> int:
        if self._listening is None:
            self._listen()
        return self._size

    @_len.setter
    def _len(self, value) -> None:
        pass  # the table counts its rows (TorchRL's writers set this after they write)

    def close(self) -> None:
        """Stop hearing of the table's changes (the table and its rows stay)."""
        handle, self._listening = self._listening, None
        if handle:
            handle.stop()

    # -- what TorchRL's TensorStorage keeps locally

    @property
    def initialized(self) -> bool:
        return self._schema is not None

    @initialized.setter
    def initialized(self, value) -> None:
        pass  # the table exists or not

    @property
    def _storage(self):
        """A view of every slot, as ``LazyTensorStorage._storage`` is (shape and reads)."""
        return _TableView(self) if self._schema is not None else None

    @_storage.setter
    def _storage(self, value) -> None:
        if value is not None:
            raise UsageError("a TableStorage's rows are the table's: write them with set()")

    @property
    def _total_shape(self):
        if self._schema is None:
            return None
        inner = self._schema.inner
        return torch.Size([self.max_size // max(math.prod(inner), 1), *inner])

    def _grid(self, full: bool) -> tuple:
        """The element grid indices address: every slot (``full``), or those held."""
        shape = self._total_shape if full else self.shape
        return tuple(shape) if shape is not None else (self.max_size,)

    def _init(self, data) -> None:
        """Make the table for elements like ``data`` (one element), as TorchRL's
        lazy storages allocate on the first write."""
        self._fit(Schema.infer(data, self.ndim, batched=False))

    # -- writing

    def set(self, cursor, data, *, set_cursor: bool = True) -> None:
        """Write ``data`` at the elements ``cursor`` names (TorchRL's writers call it)."""
        if isinstance(data, list):
            try:
                data = _flip_list(data)
            except Exception as exc:
                raise RuntimeError(f"Stacking the elements of the list resulted in an error: {exc}") from exc
        single = _is_int(cursor)
        data = self._as_table_holds(data, self.ndim - 1 if single else self.ndim)
        schema = Schema.infer(data, self.ndim, batched=not single)
        self._fit(schema)
        slots, _ = indexing.slots(cursor, self._grid(full=True))
        rows = self._schema.rows(data, self.ndim - 1 if single else self.ndim)
        n = _count(rows)
        ends = self._row_ends(data, n) if not single else None
        if n != slots.numel():
            if n != 1:
                raise IndexError(f"{n} elements written at {slots.numel()} places of table {self.name!r}")
            rows = {k: v.expand(slots.numel(), *v.shape[1:]) for k, v in rows.items()}
            ends = None if ends is None else ends.expand(slots.numel())
        keep = indexing.last_wins(slots)  # a writer lapping the table: the last row wins
        if keep.numel() != slots.numel():
            slots, rows = slots[keep], {k: v[keep] for k, v in rows.items()}
            ends = None if ends is None else ends[keep]
        if set_cursor:
            self._set_last_cursor(cursor)
        self._call_retrying(lambda: self.client.write(self.name, slots, rows, self._row_priority(slots.numel()),
                                                      ends=ends, with_size=True))
        self._bump_mutation_revision()

    def insert(self, data) -> torch.Tensor:
        """Add the elements of ``data`` where the server chooses (:class:`TableWriter`);
        returns their slots.  A batch larger than the table keeps its newest
        ``max_size`` elements, as TorchRL's writers do (the index of an element left
        out is that of the one that took its place)."""
        if self.ndim != 1:
            raise UsageError("the server chooses the slots of inserted rows: a storage of ndim > 1 (a grid "
                             "of elements) needs TorchRL's RoundRobinWriter")
        if isinstance(data, list):
            data = _flip_list(data)
        data = self._as_table_holds(data, 1)
        schema = Schema.infer(data, 1, batched=True)
        self._fit(schema)
        rows = self._schema.rows(data, 1)
        n = _count(rows)
        ends = self._row_ends(data, n)
        kept = min(n, self.max_size)
        if kept < n:
            rows = {k: v[n - kept:] for k, v in rows.items()}
            ends = None if ends is None else ends[n - kept:]
        keys = self._call_retrying(lambda: self.client.insert(self.name, rows, self._row_priority(kept), ends=ends,
                                                              with_size=True))
        slots = keys % self.max_size
        self._set_last_cursor(slots)
        self._bump_mutation_revision()
        if kept < n:
            slots = slots[(torch.arange(n) - (n - kept)) % kept]
        return slots

    def _as_table_holds(self, data, lead: int):
        """A dict of tensors for a table of TensorDicts (one made by ``create_table``,
        say) as a TensorDict; anything else as it is."""
        if (isinstance(data, dict) and self._schema is not None and self._schema.kind == "tensordict"
                and all(isinstance(k, str) for k in data)):
            from tensordict import TensorDict

            return TensorDict(data, batch_size=Schema.lead_shape(data, lead))
        return data

    def _call_retrying(self, call):
        """``call()`` (a write or insert with its size), once more after making the
        table again if it was deleted meanwhile (``rb.empty()`` in another process)."""
        try:
            keys, size, seq = call()
        except NoSuchBinError:
            schema, self._schema = self._schema, None
            self._make(schema)
            keys, size, seq = call()
        self._note_size(size, seq)
        self._remember(keys % self.max_size, keys)
        return keys

    def _remember(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Note the keys of rows just written or drawn, for priority updates by index
        (only once a prioritized sampler asked: :attr:`_tracks_keys`)."""
        if self._tracks_keys:
            known = self._keys
            if len(known) > KEYS_KEPT:
                known.clear()
            known.update(zip(slots.tolist(), keys.tolist()))

    def _keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys of the rows at ``slots`` (-1: none there): remembered, else asked for."""
        known = self._keys
        keys = [known.get(slot, -1) for slot in slots.tolist()]
        if any(key < 0 for key in keys):
            state = occupied(self.client, self.name)
            found = dict(zip(state["indices"].tolist(), state["keys"].tolist()))
            keys = [key if key >= 0 else found.get(slot, -1) for key, slot in zip(keys, slots.tolist())]
            self._remember(state["indices"], state["keys"])
        return torch.tensor(keys, dtype=torch.int64)

    def _row_ends(self, data, n: int):
        """Which of the ``n`` rows of ``data`` end their episode, as a slice sampler of
        a buffer over this storage finds them (``TableSliceSampler.table_ends``);
        None without one."""
        for entity in self._attached_entities:
            find = getattr(getattr(entity, "_sampler", None), "table_ends", None)
            if find is not None:
                return find(data, n)
        return None

    def _row_priority(self, n: int):
        """New rows' priority: what a TablePrioritizedSampler of a buffer over this
        storage gives them (the highest it has seen), else the table's default."""
        for entity in self._attached_entities:
            priority = getattr(getattr(entity, "_sampler", None), "table_row_priority", None)
            if priority is not None:
                return float(priority)
        return None

    # -- reading

    def get(self, index) -> Any:
        """The elements at ``index``, read as a sample of the table (a ReplayBuffer
        calls this with the indices its sampler drew): counted by the table, paced
        by its rate limiter."""
        pending, self._pending = self._pending, None
        if pending is not None and _same_index(pending[0], index):
            return pending[1]
        return self._read(index, sample=True)

    def __getitem__(self, index) -> Any:
        """The elements at ``index`` (not a sample: counts nothing)."""
        return self._read(index, sample=False)

    def _read(self, index, *, sample: bool) -> Any:
        schema = self._require_schema()
        slots, shape = indexing.slots(index, self._grid(full=False))
        if slots.numel():
            values = self.client.read(self.name, slots, sample=sample)
            if isinstance(values, TensorDictBase):  # a table whose rows came as TensorDicts (a native insert)
                values = dict(values.items())
        else:
            values = {c.name: torch.empty((0, *c.shape), dtype=c.dtype) for c in schema.columns}
        return schema.value(values, shape, self._device())

    def _device(self):
        """Where values come back (None: as received, on the CPU)."""
        return None if self.device in (None, "auto") else self.device

    def _sampled(self, index, value) -> None:
        """The table's sampler drew ``value`` at ``index`` (TableSampler): the
        ReplayBuffer's ``get(index)`` that follows gives it, with no second round trip."""
        self._pending = (index, value)

    def __iter__(self):
        for i in range(self._len_along_dim0 or 0):
            yield self[i]

    # -- whole

    def _empty(self) -> None:
        """Empty the table: deleted and made again empty, with the same settings."""
        try:
            info = self.client.table_info(self.name)
            self.client.create_table(self.name, replace=True, **table_spec(info))
        except NoSuchBinError:
            pass
        self._keys.clear()
        self._note_size(0, self._seq + 1)
        self._bump_mutation_revision()

    def flatten(self):
        """A local ``TensorStorage`` of the elements held, their dimensions flattened."""
        if self.ndim == 1:
            return self
        values = self[:]
        if isinstance(values, torch.Tensor) or hasattr(values, "flatten"):
            return TensorStorage(values.flatten(0, self.ndim - 1))
        return TensorStorage(torch.utils._pytree.tree_map(lambda x: x.flatten(0, self.ndim - 1), values))

    def state_dict(self) -> dict[str, Any]:
        """The table's settings and rows (each at its slot, with its priority, episode
        mark and sample count): :meth:`load_state_dict` makes the table so again."""
        info = self.client.table_info(self.name)
        state = occupied(self.client, self.name, info["capacity"])
        row_bytes = sum(math.prod(c["shape"]) * torch.empty(0, dtype=getattr(torch, c["dtype"])).element_size()
                        for c in (info.get("columns") or {}).values())
        parts, kept = [], []
        for start, stop, values, same in pieces(self.client, self.name, state["indices"], state["keys"], row_bytes):
            parts.append(values)
            kept.append(same)
        held = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.bool)  # (rows that changed meanwhile: out)
        rows = {name: torch.cat([p[name] for p in parts]) for name in (info.get("columns") or {})} if parts else {}
        return {"table": self.name, "spec": table_spec(info), "indices": state["indices"][held],
                "keys": state["keys"][held], "priorities": state["priorities"][held], "ends": state["ends"][held],
                "times_sampled": state["times_sampled"][held], "rows": rows, "_len": int(held.sum())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the table what :meth:`state_dict` saw (its rows replace the table's)."""
        if "spec" not in state_dict:
            raise UsageError("not a TableStorage's state_dict (no table settings in it)")
        spec = state_dict["spec"]
        self.client.create_table(self.name, replace=True, **spec)  # (refused settings: the table stays as it was)
        self._keys.clear()  # (the rows get new keys)
        write_rows(self.client, self.name, state_dict["indices"], state_dict["rows"], state_dict["priorities"],
                   state_dict.get("ends"), state_dict.get("keys"), state_dict.get("times_sampled"))
        self._schema = None
        self._adopt(None, None)
        self._bump_mutation_revision()

    def dumps(self, path) -> None:
        """Write the table's checkpoint (settings and rows) to the directory ``path``."""
        self.client.save(self.name, path, overwrite=True)

    def loads(self, path) -> None:
        """Make the table what the checkpoint at ``path`` holds (:meth:`dumps`)."""
        self.client.load_table(path, self.name)
        self._keys.clear()
        self._schema = None
        self._adopt(None, None)
        self._bump_mutation_revision()

    # -- pickling: the address, never the connection or the token

    def __reduce__(self):
        return _unpickle, (type(self), self._pickled())

    def _pickled(self) -> dict:
        address = getattr(self, "_address", None) or _address_of(self._client_obj, self._token_source)
        return {"name": self.name, "address": address, "max_size": self.max_size, "ndim": self.ndim,
                "device": str(self.device), "settings": dict(self._settings), "token_file": self._token_file}

    def __getstate__(self):
        return self._pickled()

    def __repr__(self) -> str:
        columns = ", ".join(c.name for c in self._schema.columns) if self._schema else "<none yet>"
        return (f"{type(self).__name__}(table={self.name!r}, server={self.client.host}:{self.client.port}, "
                f"columns=[{columns}], shape={self.shape}, len={len(self)}, max_size={self.max_size})")


class _TableView:
    """What ``LazyTensorStorage._storage`` offers TorchRL code that looks inside a
    storage: the full shape, and reads (which go to the table)."""

    def __init__(self, storage: TableStorage):
        self._of = storage

    @property
    def shape(self) -> torch.Size:
        return torch.Size([*self._of._total_shape, *self._of._schema.item_shape])

    batch_size = shape

    def __getitem__(self, index):
        return self._of[index]

    def get(self, key, default=None):
        value = self._of[:] if len(self._of) else None
        if isinstance(value, TensorDictBase):
            return value.get(key, default)
        return default


def _count(rows: dict) -> int:
    return int(next(iter(rows.values())).shape[0]) if rows else 0


def _same_index(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_index(x, y) for x, y in zip(a, b))
    return False


_UNKNOWN = "unknown"


def _token_source(client, token_file: str | None):
    """Where another process finds ``client``'s token (looked at when the storage is
    made): None (no token), ``"env"`` or ``{"file": path}``; ``_UNKNOWN`` if neither holds it."""
    token = getattr(getattr(client, "settings", None), "token", None)  # (what the client proves, as resolved)
    if token is None:
        return None
    if token_file is not None and resolve_token(None, token_file) == token:
        return {"file": str(token_file)}
    if resolve_token(None) == token:
        return "env"
    return _UNKNOWN


def _address_of(client, source) -> dict:
    """How another process reaches ``client``'s server: address, TLS options, and
    where the token comes from (never the token)."""
    if source == _UNKNOWN:
        raise UsageError("this storage's client was given a token that TENSORSHARE_TOKEN did not hold: give "
                         "TableStorage token_file= so that another process can find it (a token is never pickled)")
    tls = getattr(getattr(client, "settings", None), "tls", None)
    options = {"timeout": client.timeout}
    if tls is not None:
        options.update(tls=True, tls_ca=tls.ca, tls_fingerprint=None if tls.fingerprint is None else tls.fingerprint.hex())
    return {"host": client.host, "port": client.port, "options": options, "token": source}


def _reconnect(address: dict):
    """A client for ``address`` in this process (one per address and process)."""
    import os

    from ..client import Client

    source = address["token"]
    key = (os.getpid(), address["host"], address["port"], repr(sorted(address["options"].items())), repr(source))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None or client.closed:
            token = None if source is None else resolve_token(None, source["file"] if isinstance(source, dict) else None)
            if source is not None and token is None:
                raise UsageError("the pickled storage's server needs a token: TENSORSHARE_TOKEN (or its token "
                                 "file) is not set in this process")
            client = _CLIENTS[key] = Client(address["host"], address["port"], token=token, **address["options"])
    return client


def _unpickle(cls, state: dict) -> TableStorage:
    storage = cls.__new__(cls)
    storage._address = state["address"]
    storage._client_obj = None
    TableStorage.__init__(storage, state["name"], None, state["max_size"], ndim=state["ndim"],
                          device=state["device"], token_file=state["token_file"], **state["settings"])
    return storage
