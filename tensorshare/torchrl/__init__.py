"""TorchRL over tensorshare tables: one replay buffer for many processes and machines.

``TableStorage("replay", client)`` is a TorchRL storage whose elements are the
rows of a table of a tensorshare server (PROTOCOL.md §12), so every process that
makes a ``ReplayBuffer`` over the same table shares one buffer::

    from torchrl.data import ReplayBuffer
    from tensorshare.torchrl import TableSampler, TableStorage, TableWriter

    rb = ReplayBuffer(storage=TableStorage("replay", client, max_size=100_000),
                      sampler=TableSampler(), writer=TableWriter(), batch_size=256)
    rb.extend(transitions)        # actors, in any process: the server picks the slots
    batch = rb.sample()           # learners: drawn in the server, one round trip

TorchRL's own writers and samplers work too (they write and draw at the indices
they count); :class:`TablePrioritizedSampler` is prioritized replay done by the
table.  Modules, one job each:

* :mod:`.storage` -- :class:`TableStorage`: the storage, its size, pickling, checkpoints
* :mod:`.schema`  -- tensors, TensorDicts, tensorclasses and pytrees as columns, and back
* :mod:`.indexing` -- TorchRL's indices as the table's slots
* :mod:`.writer`  -- :class:`TableWriter`: inserts, the server choosing the slots
* :mod:`.sampler` -- :class:`TableSampler`, :class:`TablePrioritizedSampler`: the table draws
* :mod:`.slices`  -- :class:`TableSliceSampler`, :class:`TablePrioritizedSliceSampler`: sequences

Needs ``torchrl`` (the ``torchrl`` extra: ``pip install torchrl``).
"""

from .sampler import TablePrioritizedSampler, TableSampler
from .slices import TablePrioritizedSliceSampler, TableSliceSampler
from .storage import TableStorage
from .writer import TableWriter

__all__ = ["TableStorage", "TableWriter", "TableSampler", "TablePrioritizedSampler", "TableSliceSampler",
           "TablePrioritizedSliceSampler"]
