"""The values RL code sends, beyond tensors and plain containers: numpy scalars,
dicts with keys that are not str (an optimizer's state dict), dtypes, ``torch.Size``,
sets and complex numbers; where an unsendable value is; what a decoder that does
not know a kind does with it.

Each kind round-trips in memory (``wire.dumps``/``loads``) and through a real server
process (``put``/``get``), and comes back as the same type with the same bits.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import types

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pairing import Pair
from tensorshare import wire
from tensorshare.protocol.messages import GET, PUT
from tensorshare.errors import EncodeError, NoSuchBinError, PermanentError, ProtocolError
from tensorshare.wire import codec
from tensorshare.wire.codec import Encoded, NUMPY_DTYPES, TORCH_DTYPES

NUMPY_SCALARS = [np.dtype(name).type for name in NUMPY_DTYPES]


def assert_same(expected, actual, path="value"):
    """Type-exact, bitwise comparison, keys and their types included."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, path
        assert torch.equal(expected.view(-1).view(torch.uint8) if expected.numel() else expected,
                           actual.view(-1).view(torch.uint8) if actual.numel() else actual), path
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, path
        assert expected.tobytes() == actual.tobytes(), path
    elif isinstance(expected, np.generic):
        assert expected.dtype == actual.dtype and expected.tobytes() == actual.tobytes(), path
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), f"{path}: keys differ"
        assert [type(k) for k in expected] == [type(k) for k in actual], f"{path}: key types differ"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    elif isinstance(expected, (float, complex)):
        assert struct.pack("<dd", expected.real, expected.imag) == struct.pack("<dd", actual.real, actual.imag), path
    else:
        assert expected == actual, path
        if isinstance(expected, (set, frozenset)):
            assert sorted(map(repr, map(type, expected))) == sorted(map(repr, map(type, actual))), path


def roundtrip(value):
    return wire.loads(wire.dumps(value))


def adam_state(steps: int = 3, seed: int = 0):
    """A small model and an Adam optimizer after ``steps`` steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def rollout_info():
    """What a gymnasium vector env's ``info`` and a rollout around it look like."""
    return {
        "obs": np.zeros((4, 3), np.float32),
        "reward": np.float32(1.0),
        "terminated": np.bool_(False),
        "truncated": np.False_,
        "episode": {"r": np.float64(21.5), "l": np.int64(21), "t": np.float32(0.25)},
        "_episode": np.array([True, False, False, True]),
        "lives": np.array(3, np.int8),  # a 0-d array stays an array
        "final_info": {0: {"TimeLimit.truncated": np.bool_(True)}},
        "dtype": torch.float32,
        "np_dtype": np.dtype("uint8"),
        "shape": torch.Size([4, 3]),
        "seen": {1, 2, 3},
        "actions": frozenset({"left", "right"}),
        "phase": 1 - 0.5j,
    }


KINDS = {
    **{f"numpy.{t.__name__}": t(1) for t in NUMPY_SCALARS},
    "numpy.float16 nan bits": np.frombuffer(b"\x01\x7e", np.float16)[0],
    "numpy.float64 -0.0": np.float64(-0.0),
    "numpy.uint64 max": np.uint64(2**64 - 1),
    "numpy.int64 min": np.int64(-(2**63)),
    "numpy.complex128": np.complex128(1.5 - 2j),
    "numpy.str_ (becomes str)": "abc",
    "0-d array": np.array(2.5, np.float32),
    "int keys": {0: "a", 1: "b", -5: "c", 2**70: "big"},
    "mixed keys": {"a": 1, 2: "two", 2.5: None, None: [1], True: 0, b"k": 1, (1, ("x", None)): {}},
    "str keys then int": {"x": torch.ones(2), 3: torch.zeros(1)},
    "key types kept": {1: "int", 2.0: "float", False: "bool"},
    "tuple and frozenset keys": {(1, 2): 1, frozenset({1, 2}): 2, (): 3},
    "numpy and dtype keys": {np.int64(3): 1, torch.float16: 2, np.dtype("float32"): 3},
    "empty int-keyed dict nested": {"state": {}, "groups": [{"params": [0, 1]}]},
    "torch dtypes": [TORCH_DTYPES[name] for name in sorted(TORCH_DTYPES)],
    "numpy dtypes": [NUMPY_DTYPES[name] for name in sorted(NUMPY_DTYPES)],
    "torch.Size": torch.Size([3, 0, 5]),
    "empty torch.Size": torch.Size([]),
    "set": {1, "a", (2, 3), None, 2.5},
    "empty set": set(),
    "frozenset": frozenset({1, frozenset({2})}),
    "set of numpy scalars": {np.int32(1), np.int32(2)},
    "complex": complex(1.0, -0.0),
    "complex nan": complex(math.nan, math.inf),
    "rollout info": rollout_info(),
}


@pytest.mark.parametrize("value", list(KINDS.values()), ids=list(KINDS))
def test_kind_roundtrips_in_memory(value):
    assert_same(value, roundtrip(value))


def test_numpy_scalars_keep_their_type():
    for t in NUMPY_SCALARS:
        out = roundtrip(t(1))
        assert type(out) is t and out == 1
    assert type(roundtrip(np.float64(0.5))) is np.float64  # a float subclass, not a float
    assert type(roundtrip(np.array(1.0))) is np.ndarray and roundtrip(np.array(1.0)).shape == ()


def test_str_keys_keep_the_plain_map_form():
    """Dicts with str keys travel as before (a msgpack map); only others use the extension."""
    assert b"\xc7" not in codec.encode({"a": 1, "b": {"c": 2}}).description
    doc = msgpack.unpackb(codec.encode({1: 2}).description, ext_hook=msgpack.ExtType)
    assert doc["v"] == msgpack.ExtType(codec.EXT_MAP, msgpack.packb([1, 2]))


def test_adam_state_dict_roundtrips_and_loads():
    model, opt = adam_state()
    state = opt.state_dict()
    assert isinstance(next(iter(state["state"])), int)
    out = roundtrip(state)
    assert_same(state, out)
    # A fresh optimizer resumes exactly where the first one was.
    model2, _ = adam_state(steps=0)
    model2.load_state_dict(roundtrip(model.state_dict()))
    opt2 = torch.optim.Adam(model2.parameters())
    opt2.load_state_dict(out)
    x = torch.randn(16, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_other_optimizers_and_schedulers_roundtrip():
    model, _ = adam_state(steps=0)
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                torch.optim.RMSprop(model.parameters()), torch.optim.AdamW(model.parameters())):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched = torch.optim.lr_scheduler.StepLR(opt, 3)
        sched.step()
        assert_same(opt.state_dict(), roundtrip(opt.state_dict()))
        assert_same(sched.state_dict(), roundtrip(sched.state_dict()))


# ------------------------------------------------------------------ errors name the path


# What an object of no wire form is told to send instead (a dataclass, a module: their own hints).
CARRIES = (": the wire carries tensors, arrays, numbers, strings, bytes, None and dicts, lists, tuples and sets of "
           "those, never classes (send the object's fields as a dict)")


@pytest.mark.parametrize("value, path, reason", [
    ({"info": {"terminal_observation": [0, 1, 2, np.array([object()])]}},
     ("info", "terminal_observation", 3), "numpy.ndarray of object dtype has no wire form"),
    ({"state": {0: {"step": object()}}}, ("state", 0, "step"), "cannot send a value of type object" + CARRIES),
    ([{"a": (1, {2: [types.SimpleNamespace()]})}], (0, "a", 1, 2, 0),
     "cannot send a value of type types.SimpleNamespace" + CARRIES),
    ({"k": {1: 2, (3, [4]).__class__: 5}}, ("k",),
     "dict key <class 'tuple'>: cannot send a value of type type" + CARRIES),
    ({"s": {1, (2, object())}}, ("s",), "cannot send a value of type object" + CARRIES),
    ({"s": {"x": np.datetime64(1, "s")}}, ("s", "x"), "numpy scalar of dtype datetime64[s] has no wire form"),
], ids=range(6))
def test_encode_error_names_the_path(value, path, reason):
    with pytest.raises(EncodeError) as info:
        wire.dumps(value)
    assert (info.value.path, info.value.reason) == (path, reason)
    assert str(info.value).startswith("value[" if path else reason)


def test_a_deep_failure_costs_no_more_than_the_depth_squared():
    """Finding the index at each level re-scans that level's subtree once."""
    value = object()
    for _ in range(60):
        value = [1] * 50 + [value]
    with pytest.raises(EncodeError) as info:
        wire.dumps(value)
    assert info.value.path == (50,) * 60


# ------------------------------------------------------------------ the decoder stays hardened


def desc(tree) -> bytes:
    return msgpack.packb({"v": tree, "t": [], "n": 0}, use_bin_type=True)


def ext(code: int, data) -> msgpack.ExtType:
    return msgpack.ExtType(code, data if isinstance(data, bytes) else msgpack.packb(data, use_bin_type=True))


def scalar_data(name: str, raw: bytes) -> bytes:
    return bytes([len(name)]) + name.encode() + raw


@pytest.mark.parametrize("tree, message", [
    (ext(codec.EXT_MAP, [1, 2, 3]), "map extension must hold key, value pairs"),
    (ext(codec.EXT_MAP, 5), "map extension must hold an array"),
    (ext(codec.EXT_MAP, [1, "a", 1, "b"]), "duplicate map key 1"),
    (ext(codec.EXT_MAP, [1, "a", True, "b"]), "duplicate map key True"),
    (ext(codec.EXT_MAP, [1.0, "a", 1, "b"]), "duplicate map key 1"),
    (ext(codec.EXT_MAP, [[1], "a"]), "a map key must be a scalar, tuple or frozenset, not a list"),
    (ext(codec.EXT_MAP, [{"a": 1}, "a"]), "not a dict"),
    (ext(codec.EXT_MAP, [ext(codec.EXT_ARRAY, b"\0\0\0\0"), 1]), "not an array"),
    (ext(codec.EXT_MAP, [ext(codec.EXT_TUPLE, [[1]]), 1]), "not a list"),
    (ext(codec.EXT_MAP, [ext(codec.EXT_SET, [1]), 1]), "not a set"),
    (ext(codec.EXT_SET, [1, 1]), "duplicate set member 1"),
    (ext(codec.EXT_SET, [[]]), "a set member must be"),
    (ext(codec.EXT_FROZENSET, {"a": 1}), "frozenset extension must hold an array"),
    (ext(codec.EXT_SIZE, [1, "2"]), "torch.Size extension must hold 64-bit integers"),
    (ext(codec.EXT_SIZE, [2**63]), "64-bit integers"),
    (ext(codec.EXT_SCALAR, b""), "numpy scalar extension"),
    (ext(codec.EXT_SCALAR, scalar_data("float32", b"\0\0\0")), "wrong length"),
    (ext(codec.EXT_SCALAR, scalar_data("float32", b"\0" * 5)), "wrong length"),
    (ext(codec.EXT_SCALAR, scalar_data("object", b"\0" * 8)), "unknown dtype 'object'"),
    (ext(codec.EXT_SCALAR, scalar_data("bfloat16", b"\0" * 2)), "unknown dtype 'bfloat16'"),
    (ext(codec.EXT_SCALAR, b"\xff" + b"float32" + b"\0" * 4), "numpy scalar extension"),
    (ext(codec.EXT_SCALAR, scalar_data("bool", b"\x02")), "a bool must be the byte 0 or 1"),
    (ext(codec.EXT_DTYPE, b""), "dtype extension: unknown dtype"),
    (ext(codec.EXT_DTYPE, b"\x02float32"), "unknown dtype 'float32' of kind 2"),
    (ext(codec.EXT_DTYPE, b"\x01bfloat16"), "unknown dtype 'bfloat16' of kind 1"),
    (ext(codec.EXT_DTYPE, b"\x00\xff\xfe"), "dtype extension"),
    (ext(codec.EXT_COMPLEX, b"\0" * 15), "complex extension must be 16 bytes"),
], ids=range(27))
def test_malformed_new_kinds(tree, message):
    with pytest.raises(ProtocolError, match=message):
        codec.parse_description(desc(tree), 0)


def test_equal_keys_the_checker_cannot_see_are_refused_when_built():
    """np.int64(1) and 1 are equal keys: the torch-free checker lets them through,
    the builder refuses the map rather than drop an entry."""
    blob = desc(ext(codec.EXT_MAP, [ext(codec.EXT_SCALAR, scalar_data("int64", (1).to_bytes(8, "little"))), "a",
                                    1, "b"]))
    with pytest.raises(ProtocolError, match="map extension holds equal keys"):
        codec.build(codec.parse_description(blob, 0), codec.empty_payload(0))


def test_new_kinds_count_against_the_container_budget():
    """A document of tiny extensions is refused like one of tiny maps: each fixed-size
    extension counts as a container (one per 8 bytes past the first 1024)."""
    one = ext(codec.EXT_DTYPE, b"\x00bool")  # 8 bytes, the smallest new kind
    ok = desc([one] * 1000)
    codec.parse_description(ok, 0)
    flood = desc([ext(codec.EXT_COMPLEX, bytes(16))] * 1000 + [ext(codec.EXT_DTYPE, b"\x00int8")] * 20_000)
    codec.parse_description(flood, 0)  # 1 per >= 8 bytes: within the rule
    dense = msgpack.packb({"v": [one] * 5000, "t": [], "n": 0})
    dense = dense.replace(msgpack.packb(one), b"\xd4\x08\x00")  # 3-byte extensions, each an object
    with pytest.raises(ProtocolError, match="holds more than .* maps and arrays|dtype extension"):
        codec.parse_description(dense, 0)


def test_sizes_of_maps_and_sets_are_bounded_by_max_nodes():
    limits = codec.DecodeLimits(max_nodes=100)
    codec.parse_description(codec.encode({i: i for i in range(49)}).description, 0, limits)
    for value in ({i: i for i in range(60)}, set(range(120))):
        with pytest.raises(ProtocolError, match="more than 100 nodes"):
            codec.parse_description(codec.encode(value).description, 0, limits)


def test_new_kinds_obey_max_depth():
    value = 1
    for i in range(70):
        value = {i: value} if i % 2 else [value]
    with pytest.raises(EncodeError, match="nested deeper than 64"):
        wire.dumps(value)
    tree = ext(codec.EXT_SET, [])
    for _ in range(70):
        tree = ext(codec.EXT_FROZENSET, [tree])
    with pytest.raises(ProtocolError, match="nested deeper than 64"):
        codec.parse_description(desc(tree), 0)


_keys = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=4), st.binary(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple), st.frozensets(inner, max_size=3)),
    max_leaves=4,
)
_numpy_scalars = st.builds(lambda t, raw: np.frombuffer(raw[: np.dtype(t).itemsize], t)[0],
                           st.sampled_from([t for t in NUMPY_SCALARS if t is not np.bool_]),
                           st.binary(min_size=16, max_size=16)) | st.booleans().map(np.bool_)
_leaves = st.one_of(
    _keys, _numpy_scalars, st.sampled_from(list(TORCH_DTYPES.values()) + list(NUMPY_DTYPES.values())),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size), st.complex_numbers(allow_nan=False),
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
)
NEW_VALUES = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.dictionaries(_keys, children, max_size=4), st.sets(_keys, max_size=4),
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children, max_size=3),
    ),
    max_leaves=12,
)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@FAST
@given(NEW_VALUES)
def test_hypothesis_new_kinds_roundtrip(value):
    assert_same(value, roundtrip(value))


@FAST
@given(NEW_VALUES, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_hypothesis_mutated_descriptions_fail_cleanly(value, edits):
    """Bytes of a description of the new kinds changed anywhere: the decoder gives
    a value or a ProtocolError, never another exception."""
    enc = codec.encode(value)
    blob = bytearray(enc.description)
    for pos, byte in edits:
        blob[pos % len(blob)] = byte
    payload = codec.as_payload_tensor(enc.payload_bytes())
    try:
        desc_ = codec.parse_description(bytes(blob), enc.nbytes)
        codec.build(desc_, payload)
    except ProtocolError:
        pass


# ------------------------------------------------------------------ decoders that do not know a kind


OLD_COMMIT = "206f28696c2ec3a34174ce14a5adf5c32d0c3436"  # the last commit before these kinds existed


def old_description_module():
    """The description parser as it was before the new kinds, from the repository's history."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        source = subprocess.run(["git", "-C", root, "show", f"{OLD_COMMIT}:tensorshare/wire/description.py"],
                                capture_output=True, check=True, timeout=30).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"commit {OLD_COMMIT} is not in this checkout's history (a shallow clone)")
    name = "tensorshare.wire._old_description"
    module = types.ModuleType(name)
    module.__package__ = "tensorshare.wire"
    sys.modules[name] = module  # its dataclasses look their module up there
    try:
        exec(compile(source, "old description.py", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.parametrize("name, code", [
    ("int keys", codec.EXT_MAP), ("set", codec.EXT_SET), ("frozenset", codec.EXT_FROZENSET),
    ("numpy.float32", codec.EXT_SCALAR), ("torch dtypes", codec.EXT_DTYPE), ("torch.Size", codec.EXT_SIZE),
    ("complex", codec.EXT_COMPLEX), ("rollout info", None),
])
def test_an_old_decoder_refuses_new_kinds_by_name(name, code):
    old = old_description_module()
    enc = codec.encode(KINDS[name])
    with pytest.raises(ProtocolError, match=f"unknown msgpack extension type {code or ''}"):
        old.parse_description(enc.description, enc.nbytes)
    old.parse_description(codec.encode({"plain": [1, (2.0, "x")], "t": torch.ones(3)}).description, 64)


@pytest.mark.parametrize("code", [12, 42, 127])
def test_this_decoder_refuses_kinds_it_does_not_know(code):
    with pytest.raises(ProtocolError, match=f"^unknown msgpack extension type {code}$"):
        codec.parse_description(desc({"x": [ext(code, b"data")]}), 0)


# ------------------------------------------------------------------ through a real server


@pytest.mark.parametrize("name", list(KINDS))
def test_kind_roundtrips_through_the_server(client, name):
    value = KINDS[name]
    client.put(f"values/{name}", value)
    assert_same([value], client.get(f"values/{name}"))


def test_adam_checkpoint_through_the_server(client):
    model, opt = adam_state(steps=4)
    client.put("values/ckpt", {"model": model.state_dict(), "optim": opt.state_dict(), "version": np.int64(7)})
    [got] = client.get("values/ckpt")
    assert_same(opt.state_dict(), got["optim"])
    assert type(got["version"]) is np.int64
    opt2 = torch.optim.Adam(adam_state(steps=0)[0].parameters())
    opt2.load_state_dict(got["optim"])
    assert_same(opt.state_dict(), opt2.state_dict())


def test_appended_rollouts_with_info_dicts(client):
    for i in range(3):
        info = rollout_info()
        info["step"] = np.int64(i)
        client.append("values/rollouts", info)
    items = client.get("values/rollouts")
    assert [type(x["step"]) for x in items] == [np.int64] * 3
    assert_same(rollout_info()["final_info"], items[2]["final_info"])


def test_a_kind_the_server_does_not_know_is_refused_and_the_session_goes_on():
    """What an older server does with a new kind (the same code path): a 5xx reply
    naming the extension; nothing stored; the session serves the next request."""
    pair = Pair()
    try:
        tree = msgpack.packb({"v": {"x": msgpack.ExtType(99, b"future")}, "t": [], "n": 0}, use_bin_type=True)
        with pytest.raises(PermanentError, match="unknown msgpack extension type 99") as info:
            pair.call(PUT, {"bin": "future"}, Encoded(tree, [], 0))
        assert info.value.code == 501
        with pytest.raises(NoSuchBinError):
            pair.call(GET, {"bin": "future"})
        pair.call(PUT, {"bin": "after"}, {1: np.float32(2)})
        assert_same([{1: np.float32(2)}], pair.call(GET, {"bin": "after"}).values)
    finally:
        pair.close()


def test_encode_error_in_put_names_the_path_and_sends_nothing(client):
    with pytest.raises(EncodeError, match=r"^value\['info'\]\[0\]: cannot send a value of type object: the wire "
                                          r"carries .*never classes \(send the object's fields as a dict\)$"):
        client.put("values/bad", {"info": [object()]})
    client.put("values/bad", 1)
    assert client.get("values/bad") == [1]


def test_torch_size_at_the_depth_limit():
    """A torch.Size's sizes count one level deeper, as the decoder counts them."""
    value = torch.Size([2])
    for _ in range(63):
        value = (value,)
    assert roundtrip(value) == value
    with pytest.raises(EncodeError, match="nested deeper than 64"):
        wire.dumps((value,))
    assert roundtrip((((torch.Size([]),) * 1,),)) == (((torch.Size([]),),),)


def test_named_tuple_keys_hold_only_key_nodes():
    import collections

    Key = collections.namedtuple("Key", "a b")
    assert roundtrip({Key(1, "x"): 2}) == {(1, "x"): 2}
    with pytest.raises(EncodeError, match="dict key Key.*: dict key of type torch.Tensor cannot be sent"):
        wire.dumps({Key(1, torch.ones(1)): 2})


def test_a_reply_the_client_cannot_decode_fails_that_call_only():
    """What an older client meets when it GETs a kind it does not know: the decoder
    refuses the reply (here a value deeper than the client's limit, which a server
    with a higher limit stored: the same path) and the call raises ProtocolError;
    the connection serves the next call."""
    pair = Pair(max_depth=100)
    try:
        tree: object = 1
        for _ in range(80):
            tree = [tree]
        pair.call(PUT, {"bin": "deep"}, Encoded(msgpack.packb({"v": tree, "t": [], "n": 0}), [], 0))
        with pytest.raises(ProtocolError, match="nested deeper than 64"):
            pair.call(GET, {"bin": "deep"})
        pair.call(PUT, {"bin": "next"}, {1: np.int8(3)})
        assert_same([{1: np.int8(3)}], pair.call(GET, {"bin": "next"}).values)
    finally:
        pair.close()
