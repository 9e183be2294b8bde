"""TorchRL storage backed by a tensorshare table: one replay buffer for many processes.

``TableStorage("replay", client)`` is a ``torchrl.data.Storage`` whose rows live in
a table of a tensorshare server (PROTOCOL.md §12), so every process (and machine)
that makes a ``ReplayBuffer`` over the same table shares one buffer::

    from torchrl.data import ReplayBuffer
    from torchrl.data.replay_buffers import RandomSampler
    from tensorshare.torchrl import TableStorage, TableWriter

    rb = ReplayBuffer(storage=TableStorage("replay", client, max_size=100_000),
                      sampler=RandomSampler(), writer=TableWriter(), batch_size=256)
    rb.extend(transitions)        # actors, in any process: the server picks the slots
    batch = rb.sample()           # learners: a TensorDict of 256 rows

:class:`TableWriter` inserts (the server chooses the slots, so writers in several
processes never overwrite each other's rows); TorchRL's own ``RoundRobinWriter``
works too, for one writing process (it writes at the indices it counts).  Nested
keys become columns named ``outer__inner``.  The table is made on the first write
from the batch's shapes and dtypes (as ``LazyTensorStorage`` does), or may exist
already (``client.create_table``: then its own sampler, remover and rate limits
serve ``client.sample``, which draws in the server in one round trip).

Needs ``torchrl`` (the ``torchrl`` extra: ``pip install torchrl``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage
from torchrl.data.replay_buffers.storages.store import StoreStorage
from torchrl.data.replay_buffers.writers import Writer

from .errors import NoSuchBinError, UsageError

__all__ = ["TableStorage", "TableWriter"]

SEPARATOR = "__"  # nested keys (("next", "obs")) are the column "next__obs"


def _flat(data: Any) -> dict:
    """A batch's columns: a TensorDict's leaves under flat names, or a dict as is."""
    if isinstance(data, TensorDictBase):
        return {key: value for key, value in data.flatten_keys(SEPARATOR).items()}
    if isinstance(data, dict):
        return data
    raise UsageError(f"a TableStorage stores TensorDicts (or dicts of tensors), not {type(data).__name__}")


def _indices(index: Any, size: int | None = None) -> tuple[torch.Tensor, bool]:
    """``index`` as a flat int64 tensor, and whether it named a single row."""
    if isinstance(index, int):
        return torch.tensor([index]), True
    if isinstance(index, slice):
        if size is None:
            raise UsageError("a slice of a TableStorage needs its size")
        return torch.arange(*index.indices(size)), False
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        index = index.nonzero().squeeze(-1)
    return index.reshape(-1).to(torch.int64), index.ndim == 0


class TableStorage(StoreStorage):
    """A TorchRL ``Storage`` whose rows are a tensorshare table's (see the module docstring).

    ``name``: the table; ``client``: a :class:`tensorshare.Client`; ``max_size``: the
    capacity of a table made on the first write (an existing table keeps its own).
    ``len()`` asks the server, so every process sees the rows all of them wrote.

    (A ``StoreStorage`` -- TorchRL's storage in a remote key-value store -- only so
    that ``ReplayBuffer`` picks its collate function: batches come back whole; none
    of ``StoreStorage``'s own code runs.)"""

    def __init__(self, name: str, client, max_size: int | None = None, **table_settings):
        self.name = name
        self.client = client
        self._settings = table_settings  # create_table's keywords, for a table made here
        try:
            capacity, self._made = client.table_info(name)["capacity"], True
        except NoSuchBinError:
            if max_size is None:
                raise UsageError(f"no table {name!r} on the server: give max_size to make it") from None
            capacity, self._made = max_size, False
        Storage.__init__(self, max_size=capacity)

    def _make(self, columns: dict) -> None:
        if self._made:
            return
        spec = {key: (tuple(value.shape[1:]), value.dtype) for key, value in columns.items()}
        self.client.create_table(self.name, self.max_size, spec, **self._settings)
        self._made = True

    # -- writing

    def set(self, cursor, data, *, set_cursor: bool = True) -> None:
        """Write the rows of ``data`` at the slots ``cursor`` (TorchRL's writers call it)."""
        columns = _flat(data)
        indices, single = _indices(cursor, self.max_size)
        if single:
            columns = {key: value.unsqueeze(0) for key, value in columns.items()}
        if indices.numel() > 1:  # a slot named twice (a writer lapping the table): the last row wins
            unique, inverse = torch.unique(indices, return_inverse=True)
            if unique.numel() != indices.numel():
                last = torch.full((unique.numel(),), -1, dtype=torch.int64)
                last.scatter_reduce_(0, inverse, torch.arange(indices.numel()), "amax")
                indices, columns = indices[last], {key: value[last] for key, value in columns.items()}
        self._make(columns)
        self.client.write(self.name, indices, columns)
        if set_cursor:
            self._set_last_cursor(cursor)

    def insert(self, data) -> torch.Tensor:
        """Add the rows of ``data`` where the server chooses; returns their slots."""
        columns = _flat(data)
        self._make(columns)
        keys = self.client.insert(self.name, columns)
        return keys % self.max_size

    # -- reading

    def get(self, index) -> TensorDict:
        """The rows at ``index`` (an int, a slice, a tensor of indices) as a TensorDict."""
        indices, single = _indices(index, len(self))
        value = self.client.read(self.name, indices)
        td = TensorDict(value, batch_size=[indices.numel()]).unflatten_keys(SEPARATOR)
        return td[0] if single else td

    def __len__(self) -> int:
        try:
            return int(self.client.table_info(self.name)["size"])
        except NoSuchBinError:
            return 0

    # -- what TorchRL asks of every storage

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.name}  # the rows are the server's

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("table") not in (None, self.name):
            raise UsageError(f"state of table {state_dict.get('table')!r} loaded into storage of {self.name!r}")

    def _empty(self) -> None:
        """Empty the table: it is deleted, and made again on the next write."""
        try:
            self.client.delete(self.name)
        except NoSuchBinError:
            pass
        self._made = False

    def __getstate__(self):
        raise UsageError("a TableStorage holds a connection: make one per process with its own client")


class TableWriter(Writer):
    """A TorchRL ``Writer`` that inserts into a :class:`TableStorage`: the server picks
    the slots (its remover makes room), so writers in many processes share one table."""

    def add(self, data) -> int:
        return int(self._storage.insert(_unsqueezed(data))[0])

    def extend(self, data) -> torch.Tensor:
        return self._storage.insert(data)

    def _empty(self, empty_write_count: bool = True) -> None:
        pass

    def dumps(self, path) -> None:
        pass

    def loads(self, path) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _unsqueezed(data):
    if isinstance(data, TensorDictBase):
        return data.unsqueeze(0)
    return {key: value.unsqueeze(0) for key, value in data.items()}
