"""Lighter parameter versions (tensorshare/rl/versions.py): bf16 casts and deltas.

The pure logic (diff, patch, keyframe policy, chain replay) is tested in memory; the
trainer/worker path against a real server process: after every version, every
worker holds bit for bit what the trainer published, whether it followed each
version, missed some, joined late, or outlived its trainer or the chain."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorshare
from tensorshare import RLTrainer, RLWorker
from tensorshare.rl.versions import (APPEND, PUT, Encoder, Reader, cast_state, diff, flatten, patch, replay,
                                     same_value, unflatten)


def bitwise_equal(a, b) -> bool:
    """Nested dicts of tensors equal bit for bit (dtype and shape included)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            bitwise_equal(a[k], b[k]) for k in a)
    return same_value(a, b)


def expected(state, dtype=None):
    """What a worker must hold for ``state`` published with ``dtype``."""
    return cast_state(state, dtype)


# ------------------------------------------------------------------ pure logic, in memory


def test_same_value_is_bitwise():
    nan = torch.tensor([float("nan"), 1.0])
    assert same_value(nan, nan.clone())  # torch.equal says no: it would resend NaNs forever
    assert not same_value(torch.tensor([0.0]), torch.tensor([-0.0]))  # torch.equal says yes: the sign would be lost
    assert not same_value(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same_value(torch.zeros(2), torch.zeros(1, 2))
    assert same_value(torch.arange(3), torch.arange(3)) and not same_value(torch.arange(3), torch.arange(1, 4))
    assert same_value(3, 3) and not same_value(3, 3.0) and not same_value(torch.zeros(1), 0.0)
    assert not same_value([torch.zeros(2)], [torch.zeros(2)])  # no plain ==: counted as changed, never lost
    odd = torch.arange(12, dtype=torch.uint8)
    assert same_value(odd[1:4], odd[1:4].clone()) and not same_value(odd[1:4], odd[2:5])  # 3 bytes, unaligned
    wide = torch.randn(4, 6)
    assert same_value(wide.t(), wide.t().contiguous()) and not same_value(wide.t(), wide)  # strides, shapes
    half = torch.randn(5, dtype=torch.float16)
    assert same_value(half[1:], half[1:].clone())  # 8 bytes at an offset of 2
    flags = torch.tensor([True, False, True])
    assert same_value(flags, flags.clone()) and not same_value(flags, ~flags)
    assert same_value(torch.tensor(2.5), torch.tensor(2.5)) and not same_value(torch.tensor(2.5), torch.tensor(2.25))


def test_cast_touches_only_floating_point_tensors():
    state = {"w": torch.randn(4), "steps": torch.tensor(7), "mask": torch.tensor([True, False]),
             "half": torch.randn(2, dtype=torch.float16), "lr": 0.1, "inner": {"b": torch.randn(3, dtype=torch.float64)}}
    cast = cast_state(state, torch.bfloat16)
    assert cast["w"].dtype == cast["half"].dtype == cast["inner"]["b"].dtype == torch.bfloat16
    assert torch.equal(cast["w"], state["w"].to(torch.bfloat16))
    assert cast["steps"].dtype == torch.int64 and cast["mask"].dtype == torch.bool and cast["lr"] == 0.1
    assert cast_state(state, None)["w"] is not state["w"] and torch.equal(cast_state(state, None)["w"], state["w"])


def random_state(rng: random.Random, n: int) -> dict:
    state = {f"layer{i}.weight": torch.randn(rng.randint(1, 40)) for i in range(n)}
    state["bn.num_batches_tracked"] = torch.tensor(rng.randint(0, 9))
    state["nested"] = {"a": torch.randn(3), "b": {"c": torch.randint(0, 5, (4,))}, "empty": {}}
    state["note"] = "policy"
    return state


def mutate(rng: random.Random, state: dict, share: float = 0.3) -> dict:
    """A new state: a random share of the leaves changed, sometimes one added or removed."""
    leaves = flatten(state)
    for path in rng.sample(sorted(leaves, key=str), max(1, int(len(leaves) * share))):
        value = leaves[path]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves[path] = value + torch.randn_like(value)
        elif isinstance(value, torch.Tensor):
            leaves[path] = value + 1
        else:
            leaves[path] = f"{value}!"
    if rng.random() < 0.2:
        leaves[(f"extra{rng.randint(0, 3)}",)] = torch.randn(5)
    if rng.random() < 0.2 and len(leaves) > 3:
        del leaves[rng.choice(sorted(leaves, key=str))]
    return unflatten(leaves)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_patch_of_a_diff_gives_the_new_state_and_leaves_the_old_alone(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    old = random_state(rng, rng.randint(1, 8))
    new = mutate(rng, old)
    before = {path: (v.clone() if isinstance(v, torch.Tensor) else v) for path, v in flatten(old).items()}
    changed, removed = diff(flatten(old), flatten(new))
    patched = patch(old, changed, removed)
    assert bitwise_equal(patched, new)
    assert bitwise_equal(flatten(old), before) and flatten(old).keys() == before.keys()  # old untouched
    assert {p for p, _ in changed} <= set(flatten(new))
    unchanged = [p for p in flatten(new) if p in before and same_value(before[p], flatten(new)[p])]
    assert all(flatten(patched)[p] is flatten(old)[p] for p in unchanged)  # shared, not copied


class Bins:
    """The two bins as a server keeps them, for the pure logic (the end-to-end tests
    below use a real server)."""

    def __init__(self):
        self.bins: dict[str, list] = {}

    def apply(self, writes) -> None:
        for w in writes:
            if w.op is PUT:
                self.bins[w.bin] = [w.value]
            else:
                assert w.op is APPEND
                self.bins.setdefault(w.bin, []).append(w.value)
                assert len(self.bins[w.bin]) == w.expect


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_encoder_keyframes_and_replay(dtype):
    rng = random.Random(5)
    torch.manual_seed(5)
    encoder, bins = Encoder(keyframe_every=7, keyframe_fraction=0.6), Bins()
    state = random_state(rng, 10)
    follower, follower_version = None, -1
    reader = Reader()
    kinds = []
    for version in range(60):
        writes, stats = encoder.writes(state, version, dtype, True, "chain", "params")
        bins.apply(writes)
        kinds.append(stats.keyframe)
        [item] = bins.bins["params"]
        got = reader.resolve(item, follower_version, follower, lambda: list(bins.bins["chain"]))
        assert got is not None and got[0] == version
        follower_version, follower = got
        assert bitwise_equal(follower, expected(state, dtype))
        chain_version, chain_state = replay(bins.bins["chain"])  # a worker that missed any number of versions
        assert chain_version == version and bitwise_equal(chain_state, expected(state, dtype))
        assert len(bins.bins["chain"]) <= 7
        whole = sum(v.nbytes for v in flatten(expected(state, dtype)).values() if isinstance(v, torch.Tensor))
        deltas = sum(sum(v.nbytes for _, v in d["changed"] if isinstance(v, torch.Tensor)) for d in bins.bins["chain"][1:])
        assert deltas <= 0.6 * whole
        state = mutate(rng, state, share=0.15)
    assert kinds[0] == 0 and len(set(kinds)) > 5  # keyframes came again and again


def test_the_copy_kept_is_not_the_callers():
    encoder = Encoder()
    state = {"w": torch.zeros(3), "i": torch.zeros(2, dtype=torch.int64)}
    writes, _ = encoder.writes(state, 0, None, True, "chain", "params")
    state["w"].add_(1)
    state["i"].add_(1)  # training goes on in place
    keyframe = writes[0].value["parameters"]
    assert keyframe["w"].sum() == 0 and keyframe["i"].sum() == 0
    writes, stats = encoder.writes(state, 1, None, True, "chain", "params")
    assert stats.changed == 2  # seen as changed because the copy kept is the old values


def test_a_dtype_change_or_a_gap_starts_over_with_a_keyframe():
    encoder = Encoder()
    state = {"w": torch.randn(4)}
    assert encoder.writes(state, 0, None, True, "c", "p")[1].kind == "keyframe"
    assert encoder.writes(state, 1, None, True, "c", "p")[1].kind == "delta"
    assert encoder.writes(state, 2, torch.bfloat16, True, "c", "p")[1].kind == "keyframe"
    assert encoder.writes(state, 4, torch.bfloat16, True, "c", "p")[1].kind == "keyframe"  # 3 went elsewhere
    assert encoder.writes(state, 5, torch.bfloat16, False, "c", "p")[1].kind == "full"
    assert encoder.writes(state, 6, torch.bfloat16, True, "c", "p")[1].kind == "keyframe"


def test_a_broken_chain_is_not_replayed():
    assert replay([]) is None
    keyframe = {"version": 3, "parameters": {"w": torch.zeros(1)}}
    delta = {"version": 5, "base": 4, "changed": [(("w",), torch.ones(1))], "removed": []}
    assert replay([delta]) is None  # no keyframe first (a restarted server)
    assert replay([keyframe, delta]) is None  # a gap
    assert replay([keyframe])[0] == 3


def test_a_worker_takes_no_version_beyond_the_announced_one_nor_a_delta_of_another_run():
    encoder, bins = Encoder(keyframe_fraction=10), Bins()
    states = [{"w": torch.full((3,), float(v))} for v in range(4)]
    for version in range(3):
        bins.apply(encoder.writes(states[version], version, None, True, "chain", "params")[0])
    [announced] = bins.bins["params"]  # version 2
    writes, _ = encoder.writes(states[3], 3, None, True, "chain", "params")
    bins.apply(writes[:1])  # the chain got version 3, then the trainer died before announcing it
    reader = Reader()
    version, state = reader.resolve(announced, -1, None, lambda: bins.bins["chain"])
    assert version == 2 and bitwise_equal(state, states[2])
    assert replay(bins.bins["chain"])[0] == 3 and replay(bins.bins["chain"][:1], upto=2)[0] == 0
    assert replay([{"version": 3, "parameters": {}}], upto=2) is None  # a keyframe not announced yet
    # A restarted trainer publishes another version 3 (a new run: a keyframe)...
    other = Encoder(keyframe_fraction=10)
    bins.apply(other.writes({"w": torch.full((3,), 30.0), "u": torch.ones(1)}, 3, None, True, "chain", "params")[0])
    # ...and its version 4 is a delta with base 3: not the 3 of the old run, which
    # a reader that had taken it (without the rule above) would have patched.
    newest = {"w": torch.full((3,), 40.0), "u": torch.ones(1)}
    bins.apply(other.writes(newest, 4, None, True, "chain", "params")[0])
    [delta] = bins.bins["params"]
    assert delta["base"] == 3 and len(delta["changed"]) == 1
    stale = Reader()
    stale._made = (announced["lineage"], states[3])  # it holds the old run's 3 (which has no "u")
    version, state = stale.resolve(delta, 3, states[3], lambda: bins.bins["chain"])
    assert version == 4 and bitwise_equal(state, newest)  # from the chain, not a patch
    follower = Reader()
    three = {"w": torch.full((3,), 30.0), "u": torch.ones(1)}
    follower._made = (delta["lineage"], three)  # it holds the new run's 3: patches
    assert bitwise_equal(follower.resolve(delta, 3, three, lambda: pytest.fail("read the chain"))[1], newest)
    # The same numbers and lineage, but not the state this reader made: the chain.
    assert bitwise_equal(follower.resolve(delta, 3, dict(three), lambda: bins.bins["chain"])[1], newest)


def test_delta_needs_a_dict_and_dtype_a_floating_point_dtype(server):
    with RLTrainer("127.0.0.1", server.port, experiment="vbad") as trainer:
        with pytest.raises(ValueError, match="dict"):
            trainer.publish_parameters([torch.zeros(2)], delta=True)
        with pytest.raises(ValueError, match="floating-point"):
            trainer.publish_parameters({"w": torch.zeros(2)}, dtype=torch.int8)
        assert trainer.version == -1  # nothing was published
        assert trainer.publish_parameters({"w": torch.zeros(2)}, delta=True) == 0


# ------------------------------------------------------------------ end to end, real server process


def test_many_versions_followers_missers_and_late_joiners_hold_exactly_the_trainers(server):
    rng = random.Random(11)
    torch.manual_seed(11)
    state = random_state(rng, 24)
    with RLTrainer("127.0.0.1", server.port, experiment="vmany") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vmany") as follower, \
            RLWorker("127.0.0.1", server.port, experiment="vmany") as misser:
        trainer.set_keyframes(every=9, fraction=0.5)
        late = None
        kinds = set()
        for version in range(40):
            dtype = torch.bfloat16 if version >= 20 else None  # the switch to bf16 starts a keyframe
            assert trainer.publish_parameters(state, delta=True, dtype=dtype) == version
            kinds.add((trainer.last_publish.kind, trainer.last_publish.keyframe == version))
            params = follower.await_new_parameters(timeout=10)
            assert follower.version == version and bitwise_equal(params, expected(state, dtype))
            if rng.random() < 0.3:  # reads now and then: replays the chain
                while misser.version < version:
                    params = misser.await_new_parameters(timeout=10)
                assert misser.version == version and bitwise_equal(params, expected(state, dtype))
            if version == 27:
                late = RLWorker("127.0.0.1", server.port, experiment="vmany")
                assert bitwise_equal(late.get_parameters(), expected(state, dtype)) and late.version == version
            if late is not None and version % 3 == 0:
                while late.version < version:
                    late.await_new_parameters(timeout=10)
                assert bitwise_equal(late.get_parameters(), expected(state, dtype))
            state = mutate(rng, state, share=0.1)
        late.stop()
        assert {("keyframe", True), ("delta", False), ("delta", True)} <= kinds


def test_a_follower_reads_only_what_changed(server):
    state = {f"w{i}": torch.randn(1000) for i in range(10)}
    whole = sum(t.nbytes for t in state.values())
    with RLTrainer("127.0.0.1", server.port, experiment="vbytes") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vbytes") as worker:
        trainer.publish_parameters(state, delta=True)
        worker.await_new_parameters(timeout=10)
        assert worker.parameter_bytes == whole  # the keyframe, from the chain
        for version in range(1, 6):
            state[f"w{version}"] = torch.randn(1000)
            trainer.publish_parameters(state, delta=True, dtype=torch.bfloat16 if version > 2 else None)
            before = worker.parameter_bytes
            params = worker.await_new_parameters(timeout=10)
            assert bitwise_equal(params, expected(state, torch.bfloat16 if version > 2 else None))
            if version in (1, 2, 4, 5):  # a delta of one tensor (3: bf16 starts with a keyframe)
                assert worker.parameter_bytes - before == state["w0"].nbytes // (2 if version > 2 else 1)
        # Unchanged parameters: an empty delta, nothing to read.
        trainer.publish_parameters(state, delta=True, dtype=torch.bfloat16)
        assert trainer.last_publish.changed == 0 and trainer.last_publish.worker_bytes == 0


def test_bf16_round_trip_into_a_float32_model(server):
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    with torch.no_grad():
        net(torch.randn(4, 8))  # counts a batch
    with RLTrainer("127.0.0.1", server.port, experiment="vbf16") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vbf16") as worker:
        trainer.publish_parameters(net.state_dict(), dtype=torch.bfloat16)
        params = worker.await_new_parameters(timeout=10)
        assert params["0.weight"].dtype == torch.bfloat16
        assert params["1.num_batches_tracked"].dtype == torch.int64  # not cast
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        model.load_state_dict(params)  # cast back to float32 on load
        for name, value in model.state_dict().items():
            original = net.state_dict()[name]
            assert value.dtype == original.dtype
            rounded = original.to(torch.bfloat16).to(original.dtype) if original.is_floating_point() else original
            assert torch.equal(value, rounded), name  # the rounded values, exactly
        error = (model[0].weight - net[0].weight).abs().max() / net[0].weight.abs().max()
        assert 0 < error < 2 ** -8  # bf16 keeps 8 bits of mantissa


def test_delta_with_bf16_skips_changes_below_its_resolution(server):
    state = {"w": torch.ones(100), "v": torch.ones(100)}
    with RLTrainer("127.0.0.1", server.port, experiment="vsmall") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vsmall") as worker:
        trainer.publish_parameters(state, delta=True, dtype=torch.bfloat16)
        worker.await_new_parameters(timeout=10)
        state["w"] = state["w"] + 1e-4  # rounds back to 1.0 in bf16
        state["v"] = state["v"] + 0.5
        trainer.publish_parameters(state, delta=True, dtype=torch.bfloat16)
        assert trainer.last_publish.changed == 1
        params = worker.await_new_parameters(timeout=10)
        assert worker.version == 1 and bitwise_equal(params, expected(state, torch.bfloat16))


def test_a_worker_outlives_its_trainer(server):
    rng = random.Random(2)
    state = random_state(rng, 6)
    with RLWorker("127.0.0.1", server.port, experiment="vrestart") as worker:
        with RLTrainer("127.0.0.1", server.port, experiment="vrestart") as trainer:
            for _ in range(4):
                trainer.publish_parameters(state, delta=True)
                state = mutate(rng, state)
        assert worker.await_new_parameters(timeout=10) is not None and worker.version == 3
        with RLTrainer("127.0.0.1", server.port, experiment="vrestart") as trainer:  # restarted: no copy kept
            assert trainer.publish_parameters(state, delta=True) == 4  # continues the versions
            assert trainer.last_publish.kind == "keyframe"
            params = worker.await_new_parameters(timeout=10)
            assert worker.version == 4 and bitwise_equal(params, state)
            state = mutate(rng, state)
            trainer.publish_parameters(state, delta=True, wait=False)
            trainer.flush(timeout=10)
            assert bitwise_equal(worker.await_new_parameters(timeout=10), state)


def test_a_lost_chain_is_replaced_by_a_keyframe(server):
    rng = random.Random(4)
    state = random_state(rng, 6)
    with RLTrainer("127.0.0.1", server.port, experiment="vlost") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vlost") as worker, \
            tensorshare.Client("127.0.0.1", server.port, timeout=10) as other:
        for _ in range(3):
            trainer.publish_parameters(state, delta=True)
            state = mutate(rng, state)
        other.delete(trainer.chain_bin)  # as a restarted server would have lost it
        # The first delta after: its append finds no chain, so a keyframe replaces it at once.
        trainer.publish_parameters(state, delta=True)
        assert trainer.last_publish.keyframe == 3
        assert len(other.peek(trainer.chain_bin)) == 1
        params = worker.await_new_parameters(timeout=10)  # missed versions 0-2: replays the chain
        assert worker.version == 3 and bitwise_equal(params, state)
        # Not waited for, the loss is found by the reply: the publish after makes a keyframe.
        other.delete(trainer.chain_bin)
        state = mutate(rng, state)
        trainer.publish_parameters(state, delta=True, wait=False)
        trainer.flush(timeout=10)
        late = RLWorker("127.0.0.1", server.port, experiment="vlost")
        try:
            assert late.get_parameters() is None  # a chain of a lone delta: no whole version to make
            read = late.parameter_bytes
            assert late.await_new_parameters(timeout=0.3) is None  # waits for the next version...
            assert late.parameter_bytes == read  # ...instead of reading the broken chain again and again
            assert bitwise_equal(worker.await_new_parameters(timeout=10), state)  # held 3: patches
            state = mutate(rng, state)
            trainer.publish_parameters(state, delta=True)
            assert trainer.last_publish.keyframe == 5
            while late.version < 5:
                assert late.await_new_parameters(timeout=10) is not None
            assert bitwise_equal(late.get_parameters(), state)
        finally:
            late.stop()


def test_without_options_nothing_changes_on_the_wire(server):
    state = {"w": torch.randn(5), "n": torch.tensor(2)}
    with RLTrainer("127.0.0.1", server.port, experiment="vplain") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vplain") as worker, \
            tensorshare.Client("127.0.0.1", server.port, timeout=10) as other:
        trainer.publish_parameters(state, delta=True)  # a chain from before...
        assert trainer.publish_parameters(state) == 1  # ...then the original call
        [item] = other.peek(trainer.params_bin)
        assert set(item) == {"version", "parameters"} and item["version"] == 1
        assert item["parameters"]["w"].dtype == torch.float32 and bitwise_equal(item["parameters"], state)
        assert trainer.last_publish.kind == "full"
        params = worker.await_new_parameters(timeout=10)
        assert worker.version == 1 and bitwise_equal(params, state)
        # After a plain publish, a delta one starts with a keyframe (the copy kept was dropped).
        trainer.publish_parameters(state, delta=True)
        assert trainer.last_publish.kind == "keyframe"
        assert bitwise_equal(worker.await_new_parameters(timeout=10), state)


def test_a_worker_reading_while_versions_stream_in_never_holds_a_mix(server):
    """Versions published without waiting, as fast as the trainer can, while a worker
    reads concurrently: every version it ends up holding is one the trainer published."""
    rng = random.Random(8)
    torch.manual_seed(8)
    state = {f"w{i}": torch.randn(2000) for i in range(20)}
    published = {}
    with RLTrainer("127.0.0.1", server.port, experiment="vstream") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="vstream") as worker:
        trainer.set_keyframes(every=5, fraction=0.3)
        held = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                params = worker.await_new_parameters(timeout=0.5)
                if params is not None:
                    held.append((worker.version, params))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for version in range(60):
                for name in rng.sample(sorted(state), 3):
                    state[name] = torch.randn(2000)
                dtype = torch.bfloat16 if version % 20 >= 10 else None
                trainer.publish_parameters(state, delta=True, dtype=dtype, wait=False)
                published[version] = expected(state, dtype)
            trainer.flush(timeout=30)
            deadline = time.monotonic() + 30
            while (not held or held[-1][0] < 59) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            stop.set()
            reader.join(10)
    assert held and held[-1][0] == 59
    versions = [v for v, _ in held]
    assert versions == sorted(versions)
    for version, params in held:
        assert bitwise_equal(params, published[version]), version
