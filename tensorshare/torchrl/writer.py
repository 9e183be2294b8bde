"""TableWriter: a TorchRL writer whose rows go where the table's server puts them.

TorchRL's writers count the next index themselves, which only one process can
do.  A :class:`TableWriter` inserts instead: the server picks free slots, and
its remover (fifo by default) makes room when the table is full, so writers in
any number of processes share one table.  A batch larger than the table keeps
its newest rows, as TorchRL's writers do.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import is_tensor_collection
from torch.utils._pytree import tree_map
from torchrl.data.replay_buffers.writers import Writer

from ..errors import UsageError
from .storage import TableStorage


class TableWriter(Writer):
    """A TorchRL ``Writer`` that inserts into a :class:`TableStorage` (see the module docstring)."""

    def register_storage(self, storage) -> None:
        if not isinstance(storage, TableStorage):
            raise UsageError(f"a TableWriter writes to a TableStorage, not {type(storage).__name__}")
        super().register_storage(storage)

    def add(self, data: Any) -> int:
        return int(self._storage.insert(_one_row(data))[0])

    def extend(self, data: Any) -> torch.Tensor:
        return self._storage.insert(data)

    def _empty(self, empty_write_count: bool = True) -> None:
        pass  # the table's slots are the server's to choose

    def dumps(self, path) -> None:
        pass

    def loads(self, path) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _one_row(data: Any) -> Any:
    """One element as a batch of one."""
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return data.unsqueeze(0)
    return tree_map(lambda leaf: leaf.unsqueeze(0), data)
