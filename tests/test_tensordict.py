"""TensorDicts on the wire and on disk: a TensorDict comes back as one, with its batch
size; ``Client.save`` writes a directory ``TensorDict.load_memmap`` opens; and
``tensorshare.load_memmap`` refuses directories it did not write.

Uses the real tensordict package (an optional dependency the CI installs).
"""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import torch

import tensorshare
from tensorshare import wire
from tensorshare.disk.layout import BIN_RECORD, LayoutError
from tensorshare.errors import EncodeError, ProtocolError
from tensorshare.wire import codec

tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed (pip install tensordict)")
TensorDict = tensordict.TensorDict


def rollout_td() -> TensorDict:
    torch.manual_seed(0)
    return TensorDict({
        "obs": torch.randn(4, 3),
        "action": torch.randint(0, 2, (4,)),
        "next": TensorDict({"reward": torch.randn(4, 1), "done": torch.zeros(4, 1, dtype=torch.bool)}, [4]),
        "policy": "v3",
    }, batch_size=[4])


def assert_same_td(expected: TensorDict, actual) -> None:
    assert type(actual) is TensorDict, type(actual)
    assert actual.batch_size == expected.batch_size
    assert sorted(actual.keys()) == sorted(expected.keys())
    for key in expected.keys():
        e, a = expected[key], actual[key]
        if isinstance(e, TensorDict):
            assert_same_td(e, a)
        elif isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(torch.as_tensor(a), e), key
        else:
            assert a == e, key


def test_tensordict_roundtrips_in_memory_with_its_batch_size():
    td = rollout_td()
    out = wire.loads(wire.dumps({"batch": td, "step": np.int64(3)}))
    assert_same_td(td, out["batch"])
    assert out["batch"]["next"].batch_size == torch.Size([4])
    empty = wire.loads(wire.dumps(TensorDict({}, batch_size=[2, 5])))
    assert type(empty) is TensorDict and empty.batch_size == torch.Size([2, 5])


def test_other_tensordict_kinds_are_refused_by_name():
    lazy = tensordict.LazyStackedTensorDict.lazy_stack([rollout_td(), rollout_td()])
    with pytest.raises(EncodeError, match=r"^value\['x'\]: cannot send a value of type .*LazyStackedTensorDict "
                                          r"\(a TensorDict can be sent: convert it with .to_tensordict\(\)\)"):
        wire.dumps({"x": lazy})
    assert_same_td(lazy.to_tensordict(), wire.loads(wire.dumps(lazy.to_tensordict())))


def test_error_inside_a_tensordict_names_the_path():
    td = TensorDict({"info": TensorDict({}, [])}, [])
    td.set_non_tensor(("info", "bad"), object())
    with pytest.raises(EncodeError) as info:
        wire.dumps(td)
    assert info.value.path == ("info", "bad")


@pytest.mark.parametrize("inner, message", [
    ([[4], {"x": msgpack.ExtType(codec.EXT_ARRAY, b"\0\0\0\0")}], "TensorDict extension: .*batch"),
    ([[-1], {}], "must hold \\[batch size"),
    ([[1] * 33, {}], "must hold \\[batch size"),
    ([[4], {"x": 1}, 3], "must hold \\[batch size"),
    ([[4], {b"k": 1}], "TensorDict keys must be str"),
    ("x", "TensorDict extension must hold an array"),
])
def test_malformed_tensordicts_are_protocol_errors(inner, message):
    table = [[0, "float32", [3], 0, 12]] if "EXT_ARRAY" in repr(inner) or "ExtType" in repr(inner) else []
    blob = msgpack.packb({"v": msgpack.ExtType(codec.EXT_TENSORDICT, msgpack.packb(inner, use_bin_type=True)),
                          "t": table, "n": 64 if table else 0}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=message):
        desc = codec.parse_description(blob, 64 if table else 0)
        codec.build(desc, codec.empty_payload(64 if table else 0))


def test_save_memmap_of_a_tensordict_keeps_its_batch_size(tmp_path):
    td = rollout_td()
    tensorshare.save_memmap(td, tmp_path / "td")
    back = TensorDict.load_memmap(tmp_path / "td")
    assert back.batch_size == torch.Size([4]) and back["next"].batch_size == torch.Size([4])
    assert_same_td(td, back)
    assert_same_td(td, tensorshare.load_memmap(tmp_path / "td"))


# ------------------------------------------------------------------ load_memmap refuses what it did not write


def test_load_memmap_refuses_a_directory_tensordict_wrote(tmp_path):
    rollout_td().memmap(tmp_path / "foreign")
    with pytest.raises(LayoutError, match="not written by save_memmap or Client.save"):
        tensorshare.load_memmap(tmp_path / "foreign")


def test_load_memmap_refuses_an_empty_or_unrelated_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    for name in ("empty", "other"):
        with pytest.raises(LayoutError):
            tensorshare.load_memmap(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        tensorshare.load_memmap(tmp_path / "missing")


# ------------------------------------------------------------------ through a real server


def test_tensordict_through_the_server(client):
    td = rollout_td()
    client.append("td/rollouts", td)
    client.append("td/rollouts", td[:2].clone())
    first, second = client.get("td/rollouts")
    assert_same_td(td, first)
    assert second.batch_size == torch.Size([2])


def test_client_save_writes_a_root_tensordict_opens(client, tmp_path):
    td = rollout_td()
    items = [td, {"policy": {"w": torch.ones(2, 2)}, "version": 7}, torch.arange(5.0), "note", [1, (2, 3)]]
    for item in items:
        client.append("td/save", item)
    assert client.save("td/save", tmp_path / "root") == len(items)

    root = TensorDict.load_memmap(tmp_path / "root")
    assert sorted(root.keys()) == ["00000000", "00000001", "00000002", "00000003"]  # a list has no tensordict form
    assert_same_td(td, root["00000000"])
    assert torch.equal(root["00000001", "policy", "w"], torch.ones(2, 2))
    assert torch.equal(torch.as_tensor(root["00000002"]), torch.arange(5.0))
    assert root["00000003"] == "note"

    back = tensorshare.load_memmap(tmp_path / "root")
    assert len(back) == len(items)
    assert_same_td(td, back[0])
    assert back[4] == [1, (2, 3)]


def test_an_empty_bin_saves_a_root_that_loads_empty(client, tmp_path):
    client.put("td/empty", 1)
    client.get("td/empty")
    assert client.save("td/empty", tmp_path / "root") == 0
    assert tensorshare.load_memmap(tmp_path / "root") == []
    assert len(TensorDict.load_memmap(tmp_path / "root").keys()) == 0


def test_a_root_saved_before_root_metadata_still_loads(client, tmp_path):
    """Roots written before the root's meta.json and record existed held only the
    numbered item directories: they still load."""
    client.put("td/old", {"x": torch.ones(3)})
    client.save("td/old", tmp_path / "root")
    os.remove(tmp_path / "root" / "meta.json")
    os.remove(tmp_path / "root" / BIN_RECORD)
    [value] = tensorshare.load_memmap(tmp_path / "root")
    assert torch.equal(value["x"], torch.ones(3))
