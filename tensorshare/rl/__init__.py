"""RLTrainer and RLWorker: versioned parameters out, rollouts in, workers come and go.

The bins of an experiment (``<experiment>/`` prefixes every name):

* ``parameters`` holds one item, ``{"version": v, "parameters": state}``, put with
  tag ``v``.  A put is atomic (one item, stored whole before it is announced), so a
  worker never sees a mix of two versions.  The notification of a put carries the
  tag, so a worker learns of a new version without downloading it, and downloads
  only when it asks for parameters newer than those it holds.
* ``rollouts`` collects ``{"version": v, "worker": id, "data": obj}`` items appended
  by workers.  With a cap (``max_waiting``), an append waits *in the server* while
  the bin holds that many (PROTOCOL.md §4.5): producers slow down to the learner's
  pace instead of filling memory with work that will be stale when it is read.
  Notifications tell the trainer that rollouts wait; it takes at most a batch.
* ``parameter-chain`` (only with ``publish_parameters(delta=True)``): a keyframe and
  the deltas since, for workers that missed versions; the ``parameters`` item is then
  the delta from the version before (see :mod:`tensorshare.rl.versions`).
* ``control`` holds one item the trainer puts, ``{"stop": bool, "max_waiting": n}``;
  workers listen to it.
* ``workers/<id>`` (ephemeral: the server deletes it when the worker's connection
  ends) and ``roster``: membership, see :mod:`tensorshare.rl.members`.

Nothing is polled, and no worker is waited for: a worker that dies leaves nothing
behind but a DELETE notification, a new worker starts from the latest version
(learnt atomically with its listen), and a trainer restarted against a server that
kept its bins continues the version numbers found there.
"""

from .members import WorkerInfo
from .peer import bin_names, snapshot_state
from .trainer import DEFAULT_MAX_STALENESS, DEFAULT_MAX_WAITING, Rollout, RLTrainer
from .versions import PublishStats
from .worker import CAPPED_PENDING, RLWorker

__all__ = ["RLTrainer", "RLWorker", "Rollout", "WorkerInfo", "bin_names", "snapshot_state",
           "DEFAULT_MAX_STALENESS", "DEFAULT_MAX_WAITING", "CAPPED_PENDING", "PublishStats"]
