"""Section 1: the wire codec (``tensorshare.wire.dumps``/``loads``) on one large tensor,
on a state dict and on an RL checkpoint (Adam state, numpy scalars), beside one memcpy
and beside torch.save/torch.load to a BytesIO.

``loads`` is measured three ways: on ``bytes`` (read-only, so it copies the payload
once), on a writable buffer placed so the payload is 64-byte aligned (it should
build views without copying), and on a plain ``bytearray`` (aligned or not as
Python allocated it).
"""

from __future__ import annotations

import io

import numpy as np
import torch

from . import baselines
from .profiles import Profile
from .record import PASS, MISS, Recorder
from .stats import Sample, mib, time_runs
from tensorshare import wire
from tensorshare.wire.frames import PREFIX

ALIGN = 64


def aligned_copy(frame: bytes) -> tuple[np.ndarray, memoryview]:
    """A writable copy of ``frame`` whose payload starts on a 64-byte boundary."""
    *_, header_len, payload_len = PREFIX.unpack(frame[:PREFIX.size])
    payload_off = PREFIX.size + header_len
    store = np.empty(len(frame) + 2 * ALIGN, np.uint8)
    addr = store.ctypes.data
    shift = (-(addr + payload_off)) % ALIGN
    store[shift : shift + len(frame)] = np.frombuffer(frame, np.uint8)
    return store, memoryview(store)[shift : shift + len(frame)]


def _leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


def _views_buffer(value, store: np.ndarray) -> bool:
    """True if every tensor of ``value`` lies inside ``store`` (no copy was made)."""
    lo, hi = store.ctypes.data, store.ctypes.data + store.nbytes
    return all(lo <= t.data_ptr() < hi for t in _leaves(value))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)


def bench_value(rec: Recorder, p: Profile, tag: str, title: str, value, nbytes: int) -> None:
    """dumps/loads of ``value`` and its baselines; figures in ms, keys ``wire.TAG.*``."""
    reps, warm = p.wire_reps, p.warmup
    ms = lambda s: s * 1e3  # noqa: E731
    chart = lambda series: {"name": "wire", "series": series, "x": title}  # noqa: E731
    k = f"wire.{tag}"

    rec.figure(f"{k}.memcpy", f"memcpy {title} (warm dst)", Sample.of(baselines.memcpy_seconds(nbytes, reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, baseline=True, chart=chart("memcpy"))
    for suffix, into, what in (("fresh", "bytes", "new bytes"), ("fresh_torch", "torch", "new torch.empty"),
                               ("fresh_numpy", "numpy", "new np.empty")):
        rec.figure(f"{k}.{suffix}", f"copy {title} into {what}", Sample.of(
            baselines.fresh_copy_seconds(nbytes, reps, warm, into)).map(ms), "ms", better="lower", nbytes=nbytes,
            baseline=True, chart=chart(f"copy into {what}"))

    def save():
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf

    rec.figure(f"{k}.save", f"torch.save {title} to BytesIO", Sample.of(time_runs(save, reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, baseline=True, chart=chart("torch.save"))
    saved = save().getvalue()
    rec.figure(f"{k}.load", f"torch.load {title} from BytesIO",
               Sample.of(time_runs(lambda: torch.load(io.BytesIO(saved)), reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, baseline=True, chart=chart("torch.load"))
    saved = None  # free it before the next measurement

    rec.figure(f"{k}.dumps", f"wire.dumps {title}", Sample.of(time_runs(lambda: wire.dumps(value), reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, vs=[f"{k}.fresh", f"{k}.memcpy", f"{k}.save"], chart=chart("dumps"))
    frame = wire.dumps(value)
    if not _equal(value, wire.loads(frame)):
        rec.note(f"wire.loads(wire.dumps({title})) does not equal the original")

    rec.figure(f"{k}.loads_bytes", f"wire.loads {title} from bytes (copies once)",
               Sample.of(time_runs(lambda: wire.loads(frame), reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, vs=[f"{k}.fresh_torch", f"{k}.load", f"{k}.memcpy"],
               chart=chart("loads (bytes)"))

    store, view = aligned_copy(frame)
    zero_copy = _views_buffer(wire.loads(view), store)
    rec.figure(f"{k}.loads_aligned", f"wire.loads {title} from aligned writable buffer",
               Sample.of(time_runs(lambda: wire.loads(view), reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, vs=[f"{k}.load", f"{k}.memcpy"], chart=chart("loads (aligned)"),
               note=None if zero_copy else "the result does NOT view the buffer: loads copied")
    store = view = None

    ba = bytearray(frame)
    *_, header_len, _payload_len = PREFIX.unpack(frame[:PREFIX.size])
    addr = np.frombuffer(ba, np.uint8).ctypes.data
    aligned = (addr + PREFIX.size + header_len) % ALIGN == 0
    rec.figure(f"{k}.loads_bytearray", f"wire.loads {title} from bytearray",
               Sample.of(time_runs(lambda: wire.loads(ba), reps, warm)).map(ms),
               "ms", better="lower", nbytes=nbytes, vs=[f"{k}.load"], chart=chart("loads (bytearray)"),
               note=f"payload {'is' if aligned else 'is not'} 64-byte aligned in this bytearray"
                    + ("" if aligned else ": loads copies"))
    ba = frame = None  # noqa: F841 (frees them)


def adam_checkpoint() -> dict:
    """What an RL learner checkpoints: an 18.4 KB policy (4-64-64-2 MLP), its Adam
    state after a few steps (int-keyed), and a gymnasium-style info dict of numpy
    scalars."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                 torch.nn.Linear(64, 2))
    opt = torch.optim.Adam(policy.parameters())
    for _ in range(3):
        opt.zero_grad()
        policy(torch.randn(32, 4)).pow(2).mean().backward()
        opt.step()
    info = {"episode": {"r": np.float64(21.0), "l": np.int64(21), "t": np.float32(0.5)},
            "_episode": np.array([True, False]), "TimeLimit.truncated": np.bool_(False)}
    return {"policy": policy.state_dict(), "optim": opt.state_dict(), "version": np.int64(30), "info": info}


def bench_rl_values(rec: Recorder, p: Profile) -> None:
    """wire.dumps + loads of an RL checkpoint (numpy scalars, int keys) beside
    torch.save + torch.load of the same value, in the same run."""
    value, reps = adam_checkpoint(), max(20, 20 * p.wire_reps)
    us = lambda s: s * 1e6  # noqa: E731

    def torch_roundtrip():
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    rec.figure("wire.rl.torch", "torch.save + torch.load of an Adam checkpoint (BytesIO)",
               Sample.of(time_runs(torch_roundtrip, reps, p.warmup)).map(us), "us", better="lower", baseline=True)
    rec.figure("wire.rl.wire", "wire.dumps + wire.loads of an Adam checkpoint",
               Sample.of(time_runs(lambda: wire.loads(wire.dumps(value)), reps, p.warmup)).map(us), "us",
               better="lower", vs=["wire.rl.torch"])
    rec.goal_ratio("wire round trip of an Adam checkpoint (int keys, numpy scalars) faster than torch.save + load",
                   "wire.rl.wire", "wire.rl.torch", "<", 1.0)


def run(rec: Recorder, p: Profile) -> None:
    rec.begin("1. Wire codec")
    n = p.wire_tensor_bytes
    tensor = torch.ones(n // 4, dtype=torch.float32)
    big = f"tensor {mib(n)}"
    bench_value(rec, p, "tensor", big, tensor, n)
    del tensor

    h, w = p.statedict_shape
    sd = {f"layer{i}.weight": torch.randn(h, w) for i in range(p.statedict_tensors)}
    sd_bytes = sum(t.nbytes for t in sd.values())
    small = f"state dict {p.statedict_tensors}x{h}x{w}"
    bench_value(rec, p, "sd", small, sd, sd_bytes)

    bench_rl_values(rec, p)

    rec.goal_value(f"wire.loads {big} from an aligned writable buffer < 1 ms", "wire.tensor.loads_aligned", "<", 1.0)
    aligned = rec.get("wire.tensor.loads_aligned")
    if aligned is not None and aligned.get("note"):
        rec.goal(f"wire.loads {big} from an aligned writable buffer makes no copy", MISS, aligned["note"])
    elif aligned is not None:
        rec.goal(f"wire.loads {big} from an aligned writable buffer makes no copy", PASS,
                 "every tensor of the result views the input buffer")
    # dumps makes new bytes and loads (from bytes) new tensors: each must fill fresh
    # memory once, and the limit is that fill (a memcpy into a warm buffer never
    # touches new pages; torch.save/torch.load are shown beside them, not goals).
    for tag, title in (("tensor", big), ("sd", small)):
        rec.goal_ratio(f"wire.dumps {title} within 1.2x of copying it into new bytes", f"wire.{tag}.dumps",
                       f"wire.{tag}.fresh", "<=", 1.2)
        rec.goal_ratio(f"wire.loads {title} (bytes) within 1.2x of copying it into a new torch.empty",
                       f"wire.{tag}.loads_bytes", f"wire.{tag}.fresh_torch", "<=", 1.2)
