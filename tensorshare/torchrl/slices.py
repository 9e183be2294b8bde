"""TorchRL's slice samplers, drawn by the table: sequences of steps from episodes.

``SliceSampler(slice_len=32)`` over a ``LazyTensorStorage`` looks for every
trajectory's start and stop in the whole storage at each sample (1.65 s per sample
at 346 M transitions, pytorch/rl#2669).  :class:`TableSliceSampler` asks the
server instead: the rows' episode ends are marked as they are written (from the
sampler's ``end_key``/``end_keys``, or where ``traj_key`` changes), and
``rb.sample()`` is one TSAMPLE of ``num_slices`` sequences of ``slice_len`` rows
(PROTOCOL.md §12.6), whatever the table's size.  It fills TorchRL's info as
``SliceSampler`` does (``truncated``, ``done``, ``terminated``, ``is_init``, the
``("collector", "mask")`` of padded steps), from the rows it brought.
:class:`TablePrioritizedSliceSampler` is ``PrioritizedSliceSampler`` done by a
prioritized table: a sequence is drawn in proportion to its first step's priority.

What differs from TorchRL's: sequences are uniform over the *sequences* the table
holds (each step that starts a whole one equally likely), where TorchRL picks a
trajectory first; a ``traj_key`` ends an episode at the end of each batch written
(the next batch may come from another writer); storages of ``ndim`` 1 only.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import SliceSampler

from ..errors import UsageError
from .sampler import TablePrioritizedSampler, TableSampler, _table_storage

_DEFAULT_ENDS = (("next", "done"), ("next", "truncated"), ("next", "terminated"))
_UNSUPPORTED = ("fragmented", "ends", "trajectories", "cache_values", "compile", "span", "use_gpu")


class TableSliceSampler(TableSampler, SliceSampler):
    """TorchRL's ``SliceSampler`` (``num_slices`` or ``slice_len``, ``end_key`` or
    ``end_keys`` or ``traj_key``, ``strict_length``, ``pad_output``,
    ``truncated_key``, ``init_key``), drawn in the server (see the module docstring)."""

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None, end_key=None,
                 end_keys=None, traj_key=None, truncated_key=("next", "truncated"), init_key="is_init",
                 strict_length: bool = True, pad_output: bool = False, **others) -> None:
        given = [k for k in _UNSUPPORTED if others.get(k)]
        unknown = [k for k in others if k not in _UNSUPPORTED]
        if given or unknown:
            raise UsageError(f"a table's slice sampler does not take {', '.join(given + unknown)} (the table "
                             f"finds its sequences itself)")
        SliceSampler.__init__(self, num_slices=num_slices, slice_len=slice_len, end_key=end_key, end_keys=end_keys,
                              traj_key=traj_key, truncated_key=truncated_key, init_key=init_key,
                              strict_length=strict_length, pad_output=pad_output)
        # the end keys the caller named (TorchRL's __init__ fills end_key in when none is,
        # which must not hide traj_key nor the default ends)
        self._named_ends = tuple(end_keys) if end_keys is not None else (end_key,) if end_key is not None else None

    # -- written rows: their episode ends

    def table_ends(self, data: Any, n: int) -> torch.Tensor | None:
        """Which of the ``n`` rows of ``data`` (a batch being written) end their
        episode: the sampler's end keys OR-ed, or where ``traj_key`` changes (and the
        batch's last row); None for a value that has none of them."""
        get = getattr(data, "get", None)
        if get is None:
            return None
        if self.traj_key is not None and self._named_ends is None:
            traj = get(self.traj_key, None)
            if traj is None:
                return None
            traj = traj.reshape(n, -1)[:, 0]
            return torch.cat([traj[1:] != traj[:-1], torch.ones(1, dtype=torch.bool)])
        keys = self._named_ends or _DEFAULT_ENDS
        ends = None
        for key in keys:
            flag = get(key, None)
            if flag is not None:
                flag = flag.reshape(n, -1).any(-1)
                ends = flag if ends is None else ends | flag
        return ends

    def extend(self, index) -> None:
        pass

    def add(self, index) -> None:
        pass

    def _sampleable_count(self, storage, batch_size: int) -> int:
        return len(storage)

    # -- drawing

    def sample(self, storage, batch_size: int) -> tuple[Any, dict]:
        storage = _table_storage(storage)
        if storage.ndim != 1:
            raise UsageError("a table's slice sampler draws from a storage of ndim 1")
        seq_length, num_slices = self._adjusted_batch_size(batch_size * (self._batch_size_multiplier or 1))
        schema = storage._require_schema()
        self._before_sample(storage)
        drawn = storage.client.sample(storage.name, num_slices, length=seq_length, pad=not self.strict_length)
        columns = drawn.value if isinstance(drawn.value, dict) else dict(drawn.value.items())
        columns = {k: v.reshape(-1, *v.shape[2:]) for k, v in columns.items()}
        slots, keys = drawn.indices.reshape(-1), drawn.keys.reshape(-1)
        real = (torch.arange(seq_length) < drawn.lengths[:, None]).reshape(-1)
        lengths = drawn.lengths
        if not self.strict_length and not self.pad_output:  # the ragged batch TorchRL gives
            slots, keys = slots[real], keys[real]
            columns = {k: v[real] for k, v in columns.items()}
        value = schema.value(columns, (slots.numel(),), storage._device())
        storage._remember(slots, keys)
        storage._sampled(slots, value)
        return slots, self._slice_info(storage, drawn, value, seq_length, lengths, real)

    def _before_sample(self, storage) -> None:
        pass

    def _slice_info(self, storage, drawn, value, seq_length: int, lengths: torch.Tensor, real: torch.Tensor) -> dict:
        """TorchRL's info for these slices (``SliceSampler._finalize_index``'s), from their rows."""
        padded = self.pad_output and not self.strict_length
        ragged = not self.strict_length and not self.pad_output
        count = int(lengths.sum()) if ragged else lengths.numel() * seq_length
        offsets = torch.zeros(lengths.numel(), dtype=torch.int64)  # where each slice starts in the batch
        offsets[1:] = (lengths if ragged else torch.full_like(lengths, seq_length)).cumsum(0)[:-1]
        info: dict = {}
        get = getattr(value, "get", None)
        if self.truncated_key is not None:
            truncated = torch.zeros((count, 1), dtype=torch.bool)
            truncated[offsets + lengths - 1] = True
            done_key = self.truncated_key[:-1] + ("done",) if isinstance(self.truncated_key, tuple) else "done"
            terminated_key = (self.truncated_key[:-1] + ("terminated",) if isinstance(self.truncated_key, tuple)
                              else "terminated")
            stored = None if get is None else get(done_key, None)
            info[self.truncated_key] = truncated
            info[done_key] = truncated.clone() if stored is None else stored.reshape(count, -1)[:, :1] | truncated
            stored = None if get is None else get(terminated_key, None)
            info[terminated_key] = torch.zeros_like(truncated) if stored is None else stored.reshape(count, -1)[:, :1]
        if padded:
            info[("collector", "mask")] = real
        if self.init_key is not None and get is not None:
            stored = get(self.init_key, None)
            if stored is not None:
                marker = torch.zeros_like(stored)
                marker[offsets] = True
                info[self.init_key] = marker | stored
        info.update(self._info(storage, drawn))
        weight = info.get("priority_weight")
        if weight is not None:  # one per slice: each of its steps gets it
            info["priority_weight"] = weight.repeat_interleave(lengths if ragged else seq_length)
        return info

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}, "
                f"strict_length={self.strict_length}, pad_output={self.pad_output})")


class TablePrioritizedSliceSampler(TableSliceSampler, TablePrioritizedSampler):
    """TorchRL's ``PrioritizedSliceSampler``, drawn by a prioritized table: a
    sequence comes with its first step's priority (``alpha``: the table's
    ``priority_exponent``), ``priority_weight`` for every step of it, and
    ``rb.update_priority`` sets the steps' priorities in the table (the first step's
    is the sequence's: aggregate over a sequence there, as with TorchRL's)."""

    def __init__(self, max_capacity: int | None = None, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max", **slices) -> None:
        TablePrioritizedSampler.__init__(self, max_capacity, alpha, beta, eps, dtype, reduction)
        TableSliceSampler.__init__(self, **slices)

    def _before_sample(self, storage) -> None:
        self._check_prioritized(storage)

    def sample(self, storage, batch_size: int) -> tuple[Any, dict]:
        return TableSliceSampler.sample(self, storage, batch_size)

    state_dict = TablePrioritizedSampler.state_dict
    load_state_dict = TablePrioritizedSampler.load_state_dict
    __repr__ = TablePrioritizedSampler.__repr__
