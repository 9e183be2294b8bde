"""TorchRL samplers that draw in the server with the table's own sampler, prioritized included.

``rb.sample()`` with a :class:`TableSampler` is one round trip: the server draws
the rows (uniform, prioritized, fifo or lifo: the table's sampler), counts them
with its rate limiter and sends them; the storage hands them to the buffer
without reading them again.  :class:`TablePrioritizedSampler` is TorchRL's
``PrioritizedSampler`` done by the table: it makes the table prioritized
(``priority ** alpha``), gives each sample its importance weights
(``priority_weight``, with ``beta``) and sends ``rb.update_priority`` to the
server without waiting for its reply (``Client.update_priorities_nowait``: the
learner goes on at once, the table applies it before the next sample, and a
refusal is raised by the next ``update_priority``), so prioritized replay works
through tensorshare whatever TorchRL's C++ extension does (it is an instance of
``PrioritizedSampler``, so TorchRL's TensorDict buffers update priorities through
it as through their own).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler

from ..errors import BadRequestError, UsageError
from .storage import TableStorage

class TableSampler(Sampler):
    """Draws with the table's own sampler, in the server (see the module docstring)."""

    table_settings: dict | None = None  # create_table's keywords this sampler needs (a table made for it)
    table_row_priority: float | None = None  # new rows' priority (None: the table's default)

    def sample(self, storage, batch_size: int) -> tuple[Any, dict]:
        storage = _table_storage(storage)
        schema = storage._require_schema()
        drawn = storage.client.sample(storage.name, batch_size)
        columns = drawn.value if isinstance(drawn.value, dict) else dict(drawn.value.items())
        value = schema.value(columns, (len(drawn),), storage._device())
        slots = drawn.indices
        storage._remember(slots, drawn.keys)
        index = slots if storage.ndim == 1 else torch.unravel_index(slots, tuple(storage._total_shape))
        storage._sampled(index, value)
        return index, self._info(storage, drawn)

    def _info(self, storage: TableStorage, drawn) -> dict:
        return {}

    def _empty(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def dumps(self, path) -> None:
        pass

    def loads(self, path) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TablePrioritizedSampler(TableSampler, PrioritizedSampler):
    """TorchRL's ``PrioritizedSampler``, drawn by a prioritized table.

    ``alpha``: the table's ``priority_exponent`` (a table made for this sampler
    gets it; one already there must be prioritized with it).  ``beta``: the
    importance weights' exponent, ``(N * P(i)) ** -beta``, divided by the batch's
    largest (TorchRL divides by the buffer's: the server would need a second
    sum).  ``eps`` is added to every priority sent.  New rows get the highest
    priority this sampler has seen (1.0 at first), as TorchRL's do, when written
    through a storage of a buffer using it; rows written by other processes get
    the priority their writer gives.  ``max_capacity`` (TorchRL's) is the table's.
    """

    def __init__(self, max_capacity: int | None = None, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max", max_priority_within_buffer: bool = False,
                 device=None) -> None:
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
        self._max_capacity = max_capacity
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.reduction, self.dtype = reduction, dtype
        self._max_priority_within_buffer = max_priority_within_buffer
        self._device = None
        self._max_seen: float | None = None
        self._checked: str | None = None  # the table whose sampler was found prioritized with alpha
        self._touched = False  # sampled or updated yet (see update_priority)

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if float(value) != self._alpha:
            raise UsageError("a prioritized table's priority_exponent (alpha) is fixed when it is made")

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def table_settings(self) -> dict:
        return {"sampler": "prioritized", "priority_exponent": self._alpha}

    @property
    def default_priority(self) -> float:
        return 1.0 if self._max_seen is None else self._max_seen

    @property
    def table_row_priority(self) -> float:
        return self.default_priority + self._eps

    def sample(self, storage, batch_size: int) -> tuple[Any, dict]:
        storage = _table_storage(storage)
        self._check_prioritized(storage)
        return super().sample(storage, batch_size)

    def _check_prioritized(self, storage: TableStorage) -> None:
        """The table is prioritized with this ``alpha`` (asked once per table)."""
        if self._checked != storage.name:
            info = storage.client.table_info(storage.name)
            if info["sampler"] != "prioritized" or abs((info["priority_exponent"] or 0) - self._alpha) > 1e-12:
                raise UsageError(f"table {storage.name!r} samples {info['sampler']!r} (exponent "
                                 f"{info['priority_exponent']}): a TablePrioritizedSampler(alpha={self._alpha}) "
                                 f"needs a table made prioritized with priority_exponent={self._alpha}")
            self._checked = storage.name
        self._touched = storage._tracks_keys = True

    def _info(self, storage: TableStorage, drawn) -> dict:
        weight = (drawn.probabilities * len(storage)).clamp_min(1e-300).pow(-self._beta)
        return {"priority_weight": (weight / weight.max()).to(torch.float32)}

    def add(self, index) -> None:
        pass  # new rows' priority is given with them (table_row_priority)

    def extend(self, index) -> None:
        pass

    @torch.no_grad()
    def update_priority(self, index, priority, *, storage=None) -> None:
        """Set the priorities of the elements ``index`` (as ``rb.update_priority`` and
        TorchRL's TensorDict buffers call it) in the table; indices < 0 are skipped.

        Sent without waiting for the reply where the client can (the blocking ones):
        a priority that is not a finite number >= 0 (a NaN TD error) is refused here
        at once, as the server would; what only the table can refuse (a weight past
        its largest) is raised by the next ``update_priority`` or ``client.flush()``."""
        storage = _table_storage(storage)
        storage._tracks_keys = True
        slots = _flat_slots(index, storage)
        priority = torch.as_tensor(priority, dtype=torch.float64).detach().cpu().reshape(-1)
        if priority.numel() == 1 and slots.numel() != 1:
            priority = priority.expand(slots.numel())
        if priority.numel() != slots.numel():
            raise RuntimeError(f"priority should be a number or an iterable of the same length as index: "
                               f"{priority.numel()} priorities for {slots.numel()} indices")
        valid = slots >= 0
        slots, priority = slots[valid], priority[valid]
        if not slots.numel():
            return
        if not self._touched and _is_initial_reset(slots, priority, storage, self.default_priority):
            # ReplayBuffer's first call for a storage that already holds rows: it gives
            # every row the default priority because TorchRL's trees start empty; the
            # table's rows have their priorities already.
            self._touched = True
            return
        self._touched = True
        sent = priority + self._eps
        bad = ~(torch.isfinite(sent) & (sent >= 0))
        if bool(bad.any()):
            raise BadRequestError(f"priority {sent[bad][0].item()!r} is not a finite number >= 0")
        top = float(priority.max())
        self._max_seen = top if self._max_seen is None else max(self._max_seen, top)
        client = storage.client
        send = getattr(client, "update_priorities_nowait", client.update_priorities)
        send(storage.name, storage._keys_of(slots), sent)

    def mark_update(self, index, *, storage=None) -> None:
        self.update_priority(index, self.default_priority, storage=storage)

    def _empty(self) -> None:
        self._max_seen = None

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps, "max_priority": self._max_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._beta, self._eps = state_dict["beta"], state_dict["eps"]
        self._max_seen = state_dict["max_priority"]

    def dumps(self, path) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sampler_metadata.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        from pathlib import Path

        self.load_state_dict(json.loads((Path(path) / "sampler_metadata.json").read_text()))

    def __getstate__(self):
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps})"


def _table_storage(storage) -> TableStorage:
    if not isinstance(storage, TableStorage):
        raise UsageError(f"a table sampler draws from a TableStorage, not {type(storage).__name__}")
    return storage


def _flat_slots(index, storage: TableStorage) -> torch.Tensor:
    """TorchRL's element indices (an int, a tensor, a tuple of per-dimension tensors,
    or stacked coordinates) as flat slots."""
    if isinstance(index, tuple):
        index = torch.stack([torch.as_tensor(i) for i in index], -1)
    index = torch.as_tensor(index, dtype=torch.int64)
    if storage.ndim > 1 and index.ndim > 1 and index.shape[-1] == storage.ndim:
        shape = torch.tensor(storage._total_shape)
        strides = torch.ones(storage.ndim, dtype=torch.int64)
        for dim in range(storage.ndim - 2, -1, -1):
            strides[dim] = strides[dim + 1] * shape[dim + 1]
        flat = (index * strides).sum(-1)
        return torch.where((index >= 0).all(-1), flat, torch.full_like(flat, -1)).reshape(-1)
    return index.reshape(-1)


def _is_initial_reset(slots: torch.Tensor, priority: torch.Tensor, storage: TableStorage, default: float) -> bool:
    n = len(storage)
    return (slots.numel() == n and bool((slots == torch.arange(n)).all())
            and bool((priority == default).all()))
