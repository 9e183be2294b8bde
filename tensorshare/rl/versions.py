"""Lighter parameter versions: a cast copy (``dtype``) and deltas against the last
published version (``delta``), with a keyframe chain for workers that missed some.

What travels, in the bins of an experiment (``<experiment>/`` prefixes both):

* ``parameters`` (one item, put with the version as tag, as without these options):
  either the whole state, ``{"version": v, "parameters": state}`` (no ``delta``),
  or a *delta* ``{"version": v, "base": v - 1, "changed": [(path, value), ...],
  "removed": [path, ...]}`` (the leaves that differ from version ``v - 1``, a path
  being the tuple of keys down nested dicts), or a *marker* ``{"version": v,
  "keyframe": v}`` when there is no previous version to diff against (the first
  publish of a trainer).
* ``parameter-chain``: a *keyframe* (the whole state of version ``k``,
  ``{"version": k, "parameters": state}``) followed by the deltas of versions
  ``k + 1 ... v``.  A delta publish appends to it; every ``keyframe_every``
  versions, or once the deltas appended since the keyframe weigh more than
  ``keyframe_fraction`` of the whole state, it is replaced by a new keyframe.  So a
  worker that missed versions (or just joined) reads at most ``1 + keyframe_fraction``
  times the state, however far behind it was.

The trainer writes the chain before the ``parameters`` item of the same version (on
one connection, so the server stores them in that order): a worker told of version
``v`` finds ``v`` in the chain too.  A worker that holds exactly ``v - 1`` patches
its copy with the delta (it reads only the changed tensors); any other reads the
chain in one PEEK, which is atomic, and rebuilds the state from its keyframe.
Each read is whole and self-consistent, so a worker never holds a mix of two
versions: at worst (the chain lost with a restarted server, or behind on a relay)
it keeps what it holds, or takes an older whole version, until the next one.
Every item carries a ``lineage``, a random number drawn at each fresh start of the
chain: a version number alone may name two states (a trainer restarted, or one
whose failed publish had been stored), so a delta patches only a state of its own
lineage, and a chain is replayed only up to the version announced.

Exactness: a leaf counts as unchanged only if it is *bitwise* equal to the one
last published (same dtype, shape and bytes: NaNs compare equal to themselves,
``0.0`` and ``-0.0`` differ), so a patched copy is bit for bit the trainer's.  The
cost, on the trainer: it keeps a copy of the last published state (at the
published dtype) and compares the whole state with it at every publish (one pass
over both; docs/design.md has figures).  With ``dtype``, floating-point tensors are
cast before being compared and sent, so the worker holds exactly the rounded
values; integer and bool tensors and non-tensor values go as they are.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any, Callable, NamedTuple

import torch

from ..errors import NoSuchBinError, TensorShareError
from ..protocol.messages import APPEND, PUT
from ..wire.codec import encode
from .peer import prefix, snapshot_state
from .staging import snapshot

CHAIN = "parameter-chain"  # the chain bin's name in the experiment
DEFAULT_KEYFRAME_EVERY = 100  # versions between keyframes, at most
DEFAULT_KEYFRAME_FRACTION = 0.5  # deltas since the keyframe, as a share of the whole state, before a new one

Path = tuple


def chain_bin(experiment: str | None) -> str:
    """The name of an experiment's chain bin (keyframe and deltas since)."""
    return prefix(experiment) + CHAIN


# ------------------------------------------------------------------ pure logic


def cast_state(state: Any, dtype: torch.dtype | None) -> Any:
    """``state`` with its floating-point tensors cast to ``dtype`` (new tensors); other
    tensors detached, other values as they are.  ``dtype=None``: only detached."""
    if dtype is None:
        return snapshot_state(state)
    if isinstance(state, torch.Tensor):
        state = state.detach()
        return state.to(dtype) if state.is_floating_point() else state
    if isinstance(state, dict):
        return {k: cast_state(v, dtype) for k, v in state.items()}
    return state


def check_dtype(dtype: Any) -> None:
    """Refuse a ``dtype`` that is not a floating-point torch dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype (torch.bfloat16...), not {dtype!r}")


def flatten(state: dict, path: Path = ()) -> dict[Path, Any]:
    """The leaves of a nested dict by path (the tuple of keys down to them); an empty
    dict below the top is a leaf."""
    leaves: dict[Path, Any] = {}
    for key, value in state.items():
        here = (*path, key)
        if isinstance(value, dict) and value:
            leaves.update(flatten(value, here))
        else:
            leaves[here] = value
    return leaves


def unflatten(leaves: dict[Path, Any]) -> dict:
    """The nested dict of :func:`flatten`'s leaves."""
    state: dict = {}
    for path, value in leaves.items():
        node = state
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return state


def same_value(a: Any, b: Any) -> bool:
    """Whether ``b`` may stand for ``a``: tensors bitwise equal (dtype, shape, bytes),
    other values of one type and ``==`` (values that do not compare plainly: no)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return _same_bytes(a, b)  # bitwise: NaN == NaN, 0.0 != -0.0
    if type(a) is not type(b):
        return False
    try:
        return (a == b) is True
    except Exception:  # values whose == raises or is not a bool: treat as changed
        return False


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes, compared as the
    widest integers that tile both (int64s compare about 4x faster than uint8s, and
    2x faster than float32s, whose == also has to test for NaN)."""
    return torch.equal(*_words(a, b))


def _words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of ``a`` and ``b`` (one dtype and shape) as the widest integers that tile both."""
    a, b = a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if a.numel() % width == 0:
            try:
                return a.view(dtype), b.view(dtype)
            except RuntimeError:  # a storage offset not aligned for it
                continue
    return a, b


def differing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Whether the tensors of each pair (one dtype, shape and device) differ bitwise:
    compared where they are, with one wait for all the answers of each device (a
    state spread over several GPUs cannot be stacked on one)."""
    flags = [torch.ne(*_words(a, b)).any() for a, b in pairs]
    by_device: dict = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    answers = [False] * len(flags)
    for where in by_device.values():
        for i, answer in zip(where, torch.stack([flags[i] for i in where]).tolist()):
            answers[i] = answer
    return answers


def diff(old: dict[Path, Any], new: dict[Path, Any]) -> tuple[list[tuple[Path, Any]], list[Path]]:
    """``(changed, removed)``: the leaves of ``new`` that are not the same in ``old``
    (:func:`same_value`) and the paths of ``old`` that ``new`` lacks.

    Tensors in device memory are compared there, all of them before the host waits
    once for the answers (a wait per tensor would cost more than the compares)."""
    changed, on_device = [], []
    for path, value in new.items():
        if path not in old:
            changed.append((path, value))
            continue
        before = old[path]
        if (isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and value.is_cuda
                and before.device == value.device and before.dtype == value.dtype and before.shape == value.shape):
            on_device.append((path, value, before))
        elif not same_value(before, value):
            changed.append((path, value))
    if on_device:  # in the order of ``new``, as without them
        flags = differing([(before, value) for _path, value, before in on_device])
        differ = {path for path, _value in changed}
        differ.update(path for (path, _v, _b), flag in zip(on_device, flags) if flag)
        changed = [(path, value) for path, value in new.items() if path in differ]
    removed = [path for path in old if path not in new]
    return changed, removed


def patch(state: dict, changed: list, removed: list) -> dict:
    """A new state: ``state`` with the ``changed`` leaves set and the ``removed`` paths
    deleted.  Only the dicts on those paths are copied (the leaves are shared with
    ``state``, which is left as it was: a version handed out earlier never changes)."""
    copied: dict[Path, dict] = {(): dict(state)}

    def node(path: Path) -> dict:
        if path not in copied:
            parent = node(path[:-1])
            child = parent.get(path[-1])
            parent[path[-1]] = copied[path] = dict(child) if isinstance(child, dict) else {}
        return copied[path]

    for path in removed:
        path = tuple(path)
        node(path[:-1]).pop(path[-1], None)
        while len(path) > 1 and not node(path[:-1]):  # a dict left empty goes too (flatten had no leaf for it)
            path = path[:-1]
            node(path[:-1]).pop(path[-1], None)
    for path, value in changed:
        path = tuple(path)
        node(path[:-1])[path[-1]] = value
    return copied[()]


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _own(value: Any, source: Any) -> Any:
    """A tensor the caller cannot change afterwards (a copy unless a cast made one)."""
    if isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and value.data_ptr() == source.data_ptr():
        return value.clone()
    return value


# ------------------------------------------------------------------ the trainer's side


class Write(NamedTuple):
    """One request of a publish: ``op`` (PUT or APPEND) of ``value`` to ``bin``
    (``"parameters"`` or the chain), tagged with the version; for an APPEND, the
    chain's item count it must leave (else the chain is not what the trainer thinks)."""

    op: Any
    bin: str
    value: Any
    expect: int | None = None


class PublishStats(NamedTuple):
    """What the last publish sent (:attr:`RLTrainer.last_publish`)."""

    version: int
    kind: str  # "full" (the whole state), "delta", or "keyframe" (the first delta publish: whole, in the chain)
    changed: int  # leaves sent (delta: the changed ones)
    worker_bytes: int  # tensor bytes a worker holding the previous version reads (delta) or any worker reads (else)
    uploaded_bytes: int  # tensor bytes the trainer sent (with a new keyframe's)
    keyframe: int | None  # the version of the chain's keyframe (None: no chain)


class Encoder:
    """The trainer's memory of what it published: the last version's leaves (at the
    published dtype) and the chain's keyframe, and the writes of the next publish."""

    def __init__(self, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 keyframe_fraction: float = DEFAULT_KEYFRAME_FRACTION):
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be at least 1")
        if not keyframe_fraction >= 0:
            raise ValueError("keyframe_fraction must be at least 0")
        self.keyframe_every, self.keyframe_fraction = keyframe_every, keyframe_fraction
        self._lock = threading.Lock()
        self.forget()

    def forget(self) -> None:
        """Start over: the next delta publish sends a keyframe (after a full publish,
        a failed write, or a chain found broken)."""
        with self._lock:
            self._last: dict[Path, Any] | None = None  # leaves of the last version published with delta
            self._version = None
            self._dtype = None
            self._keyframe: int | None = None
            self._since = 0  # deltas in the chain after its keyframe
            self._chain_bytes = 0  # their tensor bytes
            self._broken = False  # a write not waited for failed: the next delta publish makes a keyframe
            self._lineage: int | None = None  # names this unbroken run of versions (new at each fresh start)

    def writes(self, state: Any, version: int, dtype: torch.dtype | None, delta: bool, chain_bin: str,
               params_bin: str) -> tuple[list[Write], PublishStats]:
        """The requests that publish ``state`` as ``version``, in order, and what they send."""
        cast = cast_state(state, dtype)
        if not delta:
            self.forget()
            nbytes = tensor_bytes(cast)
            return ([Write(PUT, params_bin, {"version": version, "parameters": cast})],
                    PublishStats(version, "full", len(flatten(cast)) if isinstance(cast, dict) else 1, nbytes, nbytes,
                                 None))
        if not isinstance(state, dict):
            raise ValueError(f"delta=True needs a dict of parameters (a state dict), not {type(state).__name__}")
        originals, leaves = flatten(state), flatten(cast)  # leaves not copied yet: only the changed ones will be
        with self._lock:
            fresh = self._broken or self._last is None or self._version != version - 1 or self._dtype != dtype
            last, self._broken = self._last, False
        total = tensor_bytes(list(leaves.values()))
        if fresh:
            leaves = {path: _own(value, originals[path]) for path, value in leaves.items()}
            with self._lock:
                self._lineage = lineage = secrets.randbits(62)
            self._remember(leaves, version, dtype, keyframe=version)
            return ([Write(PUT, chain_bin, {"version": version, "lineage": lineage, "parameters": unflatten(leaves)}),
                     Write(PUT, params_bin, {"version": version, "lineage": lineage, "keyframe": version})],
                    PublishStats(version, "keyframe", len(leaves), total, total, version))
        changed, removed = diff(last, leaves)
        changed = [(path, _own(value, originals[path])) for path, value in changed]
        lineage = self._lineage
        delta_item = {"version": version, "base": version - 1, "lineage": lineage, "changed": changed,
                      "removed": removed}
        changed_bytes = tensor_bytes([value for _, value in changed])
        updated = dict(last)
        for path in removed:
            del updated[path]
        updated.update(changed)
        with self._lock:
            since, chain_bytes, keyframe = self._since + 1, self._chain_bytes + changed_bytes, self._keyframe
        if since >= self.keyframe_every or chain_bytes > self.keyframe_fraction * total:
            chain = Write(PUT, chain_bin, {"version": version, "lineage": lineage, "parameters": unflatten(updated)})
            self._remember(updated, version, dtype, keyframe=version)
            uploaded, keyframe = changed_bytes + total, version
        else:
            chain = Write(APPEND, chain_bin, delta_item, expect=since + 1)
            self._remember(updated, version, dtype, keyframe=keyframe, since=since, chain_bytes=chain_bytes)
            uploaded = 2 * changed_bytes
        return ([chain, Write(PUT, params_bin, delta_item)],
                PublishStats(version, "delta", len(changed), changed_bytes, uploaded, keyframe))

    def _remember(self, leaves: dict, version: int, dtype, keyframe: int | None, since: int = 0,
                  chain_bytes: int = 0) -> None:
        with self._lock:
            self._last, self._version, self._dtype = leaves, version, dtype
            self._keyframe, self._since, self._chain_bytes = keyframe, since, chain_bytes

    def rekey(self, chain_bin: str) -> Write:
        """A keyframe of the last version published, to put in place of a chain found
        broken (an APPEND that did not leave the count expected: the server lost it)."""
        with self._lock:
            version, leaves, lineage = self._version, self._last, self._lineage
            self._keyframe, self._since, self._chain_bytes = version, 0, 0
        return Write(PUT, chain_bin, {"version": version, "lineage": lineage, "parameters": unflatten(leaves)})

    def broken(self) -> None:
        """A write not waited for failed, or an append left another count: the next
        delta publish makes a keyframe (a flag, so that a publish being encoded on
        another thread meanwhile cannot lose it)."""
        with self._lock:
            self._broken = True


def publish(encoder: Encoder, client, params_bin: str, chain_bin: str, state: Any, version: int,
            dtype: torch.dtype | None, delta: bool, wait: bool,
            failed: Callable[[Any, BaseException | None], Any], sender: Callable | None = None) -> PublishStats:
    """Publish ``state`` as ``version`` through ``client`` (see the module).  With
    ``wait``, a failure raises (and the next delta publish starts with a keyframe);
    without, ``failed(result, error)`` hears of it, and writes holding device
    tensors go through ``sender()`` (a :class:`~.staging.Sender`: they are the
    encoder's own copies, which training does not change)."""
    writes, stats = encoder.writes(state, version, dtype, delta, chain_bin, params_bin)
    if wait:
        try:
            for write in writes:
                if write.op is APPEND:
                    n = client.append(write.bin, write.value, tag=version)
                    if n != write.expect:  # the chain is not ours (a restarted server): a keyframe instead
                        rekey = encoder.rekey(chain_bin)
                        client.put(rekey.bin, rekey.value, tag=version)
                        stats = stats._replace(keyframe=version,
                                               uploaded_bytes=stats.uploaded_bytes + tensor_bytes(rekey.value))
                else:
                    client.put(write.bin, write.value, tag=version)
        except BaseException:
            encoder.forget()
            raise
        return stats

    def done(result: Any, error: BaseException | None, expect: int | None = None) -> None:
        if error is not None or (expect is not None and result != expect):
            encoder.broken()
        failed(result, error)

    # inline: the callbacks run in reply order on the reading thread, so a flush()
    # (a ping after them) returns only once the encoder heard of a broken chain.
    # Bins on two workers of one server travel on two connections, whose order is not
    # kept: the chain is then stored before the parameters announce it (one round trip).
    apart = len({client.worker_of(write.bin) for write in writes}) > 1
    try:
        encoded = [encode(write.value) for write in writes]
        send = sender().send if sender is not None and any(enc.engine is not None for enc in encoded) else None
        if send is not None and stats.kind == "full":
            # A cast leaves integer tensors, and tensors already of the dtype, as the
            # caller's own: the sender thread reads them later, after training changed
            # them.  (A delta's leaves, and a keyframe's, are the encoder's copies.)
            encoded = [snapshot(enc) if enc.engine is not None else enc for enc in encoded]
        for write, enc in zip(writes, encoded):
            callback = (lambda r, e, x=write.expect: done(r, e, x)) if write.op is APPEND else done
            if send is not None:
                send(write.op, write.bin, enc, version, callback)
            elif write.op is APPEND and apart:  # stored before the parameters announce it
                try:
                    result, error = client.append(write.bin, enc, tag=version), None
                except TensorShareError as exc:
                    result, error = None, exc
                callback(result, error)
            else:
                client.submit(write.op, write.bin, enc, callback, tag=version, inline=True)
    except BaseException:
        encoder.forget()
        raise
    return stats


# ------------------------------------------------------------------ the worker's side


class Reader:
    """How a worker turns what it reads into a whole version: a full item as it is,
    a delta onto the version it holds, anything else from the chain."""

    def __init__(self):
        self.bytes_read = 0  # tensor bytes of the parameters items and chains read
        self._lock = threading.Lock()
        # (lineage, state) of the last state this reader made: a delta patches only that
        # very object (the worker's, checked by identity), so the lineage is the held state's.
        self._made: tuple[int | None, Any] = (None, None)

    def resolve(self, item: dict, held_version: int, held: Any,
                read_chain: Callable[[], list]) -> tuple[int, Any] | None:
        """``(version, state)`` for the ``parameters`` item ``item`` when the worker holds
        ``held`` (version ``held_version``), reading the chain if needed; None when no
        whole version newer than the one held can be made (keep what is held)."""
        self.count(item)
        version, lineage = item["version"], item.get("lineage")
        if "parameters" in item:
            self._made = (None, item["parameters"])
            return version, item["parameters"]
        # A delta applies to the state it was made from: the same version of the same
        # run of versions (a trainer that failed or restarted may reuse a number).
        made_lineage, made = self._made
        if ("changed" in item and item.get("base") == held_version and isinstance(held, dict)
                and made is held and made_lineage == lineage):
            state = patch(held, item["changed"], item["removed"])
            self._made = (lineage, state)
            return version, state
        try:
            chain = read_chain()
        except NoSuchBinError:  # no chain (yet, or any more): nothing to build from
            return None
        self.count(chain)
        got = replay(chain, upto=version, lineage=lineage)
        if got is None or got[0] <= held_version:
            return None
        self._made = (lineage, got[1])
        return got

    def count(self, value: Any) -> None:
        """Add the tensor bytes of ``value``, read from the server, to :attr:`bytes_read`."""
        n = tensor_bytes(value)
        with self._lock:
            self.bytes_read += n


def replay(chain: list, upto: int | None = None, lineage: int | None = None) -> tuple[int, dict] | None:
    """The version a chain ends at (or ``upto``, if it gets there: later versions may
    not be announced yet, and a trainer that died before announcing them may never
    do so) and its state: keyframe, then the deltas in order.  None if the chain is
    not one (empty, no keyframe first, a gap) or not of run ``lineage`` (if given)."""
    if not chain or not isinstance(chain[0], dict) or "parameters" not in chain[0]:
        return None
    version, state = chain[0]["version"], chain[0]["parameters"]
    if (lineage is not None and chain[0].get("lineage") != lineage) or (upto is not None and version > upto):
        return None
    for item in chain[1:]:
        if upto is not None and version >= upto:
            break
        if (not isinstance(item, dict) or item.get("base") != version or "changed" not in item
                or item.get("lineage") != chain[0].get("lineage")):
            return None
        version, state = item["version"], patch(state, item["changed"], item["removed"])
    return version, state
