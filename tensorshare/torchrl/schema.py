"""How TorchRL's values become a table's columns and come back: tensors, TensorDicts, tensorclasses, pytrees.

A TorchRL storage holds *elements*: a batch of shape ``[B, *inner]`` (``inner``:
the storage's dimensions past the first when ``ndim > 1``) holds
``B * prod(inner)`` of them, and each is one row of the table.  Every tensor leaf
of the value becomes a column whose row shape is the leaf's shape past those
dimensions.  A :class:`Schema` says how: the kind of value, its columns and their
key paths, and what is needed to give the same kind back (the tensorclass, the
pytree's structure, a TensorDict's batch dimensions within an element, a
lazy stack's members).  It travels with the table as its ``meta``
(``TableStorage`` puts it there when it makes the table), so that every process
reading the table gives back what was written.

Column names are the key paths, readable and reversible: nested keys joined by
``__`` (``("next", "obs")`` -> ``next__obs``); a key that is not a plain
identifier part (``[A-Za-z][A-Za-z0-9]*`` joined by single ``_``) is written as
``_x`` and its UTF-8 bytes in hex.  So a column a TorchRL buffer adds later (a new
key) names its own path, and a table made by ``client.create_table`` reads as a
TensorDict of its columns.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass
from torch.utils import _pytree

from ..errors import UsageError

KINDS = ("tensor", "tensordict", "tensorclass", "pytree")
META_KEY = "torchrl"  # the table's meta entry this module writes and reads
TENSOR_COLUMN = "data"  # the one column of a storage of plain tensors
MEMBER = "_m"  # a path part naming member i of a lazy stack within an element: "_m0", "_m1"...
_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*")
_HEX = "_x"
MAX_NAME = 128  # as the server's column names


def column_name(path: tuple) -> str:
    """The column name of key path ``path`` (a tuple of str)."""
    name = "__".join(part if _PLAIN.fullmatch(part) or part.startswith(MEMBER) and part[2:].isdigit()
                     else _HEX + part.encode("utf-8").hex() for part in path)
    if len(name) > MAX_NAME:
        raise UsageError(f"key {path!r} is too long for a column name ({len(name)} characters of at most {MAX_NAME})")
    return name


def column_path(name: str) -> tuple:
    """The key path a column name stands for (the inverse of :func:`column_name`)."""
    parts = []
    for part in name.split("__"):
        if part.startswith(_HEX):
            try:
                part = bytes.fromhex(part[len(_HEX):]).decode("utf-8")
            except ValueError:
                pass  # a name no schema wrote: taken as it is
        parts.append(part)
    return tuple(parts)


@dataclass(frozen=True)
class Column:
    name: str
    path: tuple  # key path in the value (a TensorDict's nested key; a pytree leaf's position)
    shape: tuple  # one row's
    dtype: torch.dtype

    def spec(self) -> tuple:
        return self.shape, self.dtype


@dataclass
class Schema:
    """How one storage's values map to columns (see the module docstring)."""

    kind: str
    columns: list[Column]
    ndim: int = 1
    inner: tuple = ()  # the storage's dimensions past the first (ndim > 1), from the first batch
    item_shape: tuple = ()  # a TensorDict's batch dimensions within one element
    tensorclass: str | None = None  # "module:qualname"
    treespec: str | None = None  # a pytree's structure (torch.utils._pytree.treespec_dumps)
    lazy: dict | None = None  # {"stack_dim": within an element, "members": k}: a lazy stack of unlike members
    _spec: Any = field(default=None, repr=False, compare=False)  # the treespec, loaded
    _class: Any = field(default=None, repr=False, compare=False)  # the tensorclass, where known here

    # -- meta: what the table keeps of it

    def meta(self) -> dict:
        entry = {"kind": self.kind, "ndim": self.ndim, "inner": list(self.inner), "item_shape": list(self.item_shape)}
        if self.tensorclass:
            entry["tensorclass"] = self.tensorclass
        if self.treespec:
            entry["treespec"] = self.treespec
            entry["leaves"] = [c.name for c in self.columns]
        if self.lazy:
            entry["lazy"] = dict(self.lazy)
        return {META_KEY: entry}

    def table_columns(self) -> dict:
        return {c.name: c.spec() for c in self.columns}

    @classmethod
    def of_table(cls, info: dict) -> "Schema | None":
        """The schema of a table from its :meth:`~tensorshare.Client.table_info`: its
        meta's, or (a table made otherwise) a TensorDict of its columns."""
        specs = info.get("columns")
        if not specs:
            return None
        columns = {name: Column(name, column_path(name), tuple(spec["shape"]), _torch_dtype(spec["dtype"]))
                   for name, spec in specs.items()}
        entry = (info.get("meta") or {}).get(META_KEY)
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
            return cls("tensordict", list(columns.values()))
        if entry.get("leaves"):
            ordered = [columns[name] for name in entry["leaves"] if name in columns]
            ordered = [Column(c.name, (i,), c.shape, c.dtype) for i, c in enumerate(ordered)]
        else:
            ordered = list(columns.values())
        return cls(entry["kind"], ordered, int(entry.get("ndim", 1)), tuple(entry.get("inner", ())),
                   tuple(entry.get("item_shape", ())), entry.get("tensorclass"), entry.get("treespec"),
                   entry.get("lazy"))

    # -- values in

    @classmethod
    def infer(cls, data: Any, ndim: int, batched: bool) -> "Schema":
        """The schema of ``data``: a batch of elements (``batched``) or one element."""
        lead = ndim if batched else ndim - 1
        inner = tuple(_shape(data)[1:lead] if batched else _shape(data)[:lead])
        if isinstance(data, torch.Tensor):
            return cls("tensor", [Column(TENSOR_COLUMN, (), tuple(data.shape[lead:]), data.dtype)], ndim, inner)
        if is_tensorclass(data):
            schema = cls._of_tensordict(_tensorclass_td(data), lead, ndim, inner)
            schema.kind = "tensorclass"
            schema.tensorclass = f"{type(data).__module__}:{type(data).__qualname__}"
            schema._class = type(data)
            return schema
        if is_tensor_collection(data):
            return cls._of_tensordict(data, lead, ndim, inner)
        if isinstance(data, (dict, list, tuple)):
            leaves, spec = _pytree.tree_flatten_with_path(data)
            columns, names = [], set()
            for i, (path, leaf) in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    raise UsageError(f"the value at {_pytree.keystr(path)} is a {type(leaf).__name__}: "
                                     f"a table stores tensors")
                name = _unique(column_name(tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path))
                               or "leaf", names)
                columns.append(Column(name, (i,), tuple(leaf.shape[lead:]), leaf.dtype))
            try:
                treespec = _pytree.treespec_dumps(spec)
            except Exception as exc:  # a container pytree cannot describe as JSON
                raise UsageError(f"this pytree's structure cannot be kept with the table: {exc}") from None
            return cls("pytree", columns, ndim, inner, treespec=treespec, _spec=spec)
        raise UsageError(f"a TableStorage stores tensors, TensorDicts, tensorclasses and pytrees of tensors, "
                         f"not {type(data).__name__}")

    @staticmethod
    def lead_shape(data: Any, lead: int) -> tuple:
        """The first ``lead`` dimensions of ``data`` (those that index elements)."""
        return tuple(_shape(data)[:lead])

    @classmethod
    def _of_tensordict(cls, td: TensorDictBase, lead: int, ndim: int, inner: tuple) -> "Schema":
        item_shape = tuple(td.batch_size[lead:])
        lazy = None
        if isinstance(td, LazyStackedTensorDict) and td.stack_dim >= lead and not _alike(td):
            lazy = {"stack_dim": td.stack_dim - lead, "members": len(td.tensordicts)}
            columns = [c for i, member in enumerate(td.tensordicts)
                       for c in _leaf_columns(member, lead, (f"{MEMBER}{i}",))]
        else:
            columns = _leaf_columns(td, lead, ())
        return cls("tensordict", columns, ndim, inner, item_shape, lazy=lazy)

    def check(self, other: "Schema") -> list[Column]:
        """Can values of schema ``other`` go into this one's table?  Returns the
        columns ``other`` adds (a TensorDict's new keys); UsageError, naming the key,
        for anything else that differs."""
        if other.kind != self.kind or other.tensorclass != self.tensorclass:
            raise UsageError(f"the table holds {self._kind_name()}, not {other._kind_name()}")
        if tuple(other.inner) != tuple(self.inner) and other.inner:
            raise UsageError(f"the table's elements are batches of {list(self.inner)} (ndim {self.ndim}), "
                             f"not {list(other.inner)}")
        if other.treespec != self.treespec:
            raise UsageError("this pytree's structure is not the table's (its keys or containers differ)")
        mine = {c.name: c for c in self.columns}
        added = []
        for column in other.columns:
            known = mine.get(column.name)
            if known is None:
                if self.kind == "pytree" or self.lazy or other.lazy:
                    raise UsageError(f"key {_key(column.path)} is not one of the table's columns")
                added.append(column)
            elif known.shape != column.shape or known.dtype != column.dtype:
                raise UsageError(f"key {_key(column.path)} holds {list(column.shape)} {column.dtype} per element, "
                                 f"the table's column {column.name!r} {list(known.shape)} {known.dtype}")
        missing = [c for c in self.columns if c.name not in {o.name for o in other.columns}]
        if missing:
            raise UsageError(f"key {_key(missing[0].path)} of the table is missing from the value written")
        return added

    def _kind_name(self) -> str:
        return {"tensor": "tensors", "tensordict": "TensorDicts", "pytree": "pytrees"}.get(
            self.kind, f"tensorclass {self.tensorclass}")

    def rows(self, data: Any, lead: int) -> dict[str, torch.Tensor]:
        """``{column: tensor [rows, *shape]}`` of ``data`` whose first ``lead``
        dimensions index elements (CPU, contiguous: ready to send)."""
        if self.kind == "tensor":
            values = {TENSOR_COLUMN: data}
        elif self.kind == "pytree":
            leaves = _pytree.tree_leaves(data)
            values = {c.name: leaves[c.path[0]] for c in self.columns}
        else:
            td = _tensorclass_td(data) if self.kind == "tensorclass" else data
            if self.lazy and isinstance(td, LazyStackedTensorDict):
                values = {}
                for i, member in enumerate(td.tensordicts):
                    values.update({column_name((f"{MEMBER}{i}", *path)): leaf for path, leaf in _leaves(member)})
            else:
                values = {column_name(path): leaf for path, leaf in _leaves(td)}
        out = {}
        for column in self.columns:
            value = values[column.name]
            out[column.name] = value.detach().reshape(-1, *value.shape[lead:]).cpu().contiguous()
        return out

    # -- values out

    def value(self, columns: dict[str, torch.Tensor], shape: tuple, device=None) -> Any:
        """The value of rows ``columns`` (``{column: tensor [n, *shape]}``) with
        leading dimensions ``shape`` (``()``: one element)."""
        n = math.prod(shape)
        if device is not None and str(device) != "cpu":
            columns = {k: v.to(device) for k, v in columns.items()}
        if self.kind == "tensor":
            return _shaped(columns[TENSOR_COLUMN], shape)
        if self.kind == "pytree":
            spec = self._spec if self._spec is not None else _pytree.treespec_loads(self.treespec)
            self._spec = spec
            leaves = [_shaped(columns[c.name], shape) for c in self.columns]
            return _pytree.tree_unflatten(leaves, spec)
        if self.lazy:
            members = []
            for i in range(self.lazy["members"]):
                prefix = f"{MEMBER}{i}"
                mine = [c for c in self.columns if c.path[:1] == (prefix,)]
                item = list(self.item_shape)
                del item[self.lazy["stack_dim"]]
                members.append(_tensordict({c.path[1:]: columns[c.name] for c in mine}, [n, *item], device))
            td = LazyStackedTensorDict(*members, stack_dim=1 + self.lazy["stack_dim"])
        else:
            td = _tensordict({c.path: columns[c.name] for c in self.columns}, [n, *self.item_shape], device)
        td = td[0] if shape == () else td.unflatten(0, shape) if len(shape) > 1 else td
        if self.kind == "tensorclass":
            cls = self._class = self._class or _find_class(self.tensorclass)
            if cls is not None:
                return cls._from_tensordict(td)
        return td


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"the table has a column of dtype {name!r}, which torch lacks")
    return dtype


def _shape(data: Any) -> torch.Size:
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return data.shape
    leaves = _pytree.tree_leaves(data)
    if not leaves or not isinstance(leaves[0], torch.Tensor):
        raise UsageError("a TableStorage stores values with at least one tensor")
    return leaves[0].shape


def _shaped(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    return tensor[0] if shape == () else tensor.reshape(*shape, *tensor.shape[1:])


def _tensorclass_td(data: Any) -> TensorDictBase:
    td = data._tensordict
    if any(True for _ in _non_tensors(td)):
        path = next(_non_tensors(td))
        raise UsageError(f"field {_key(path)} of {type(data).__name__} is not a tensor: a table stores tensors")
    return td


def _leaves(td: TensorDictBase, prefix: tuple = ()):
    """``(key path, tensor)`` of every tensor leaf; UsageError naming a key that holds
    something else (a string, say)."""
    for key, value in td.items():
        path = (*prefix, key)
        if isinstance(value, torch.Tensor):
            yield path, value
        elif is_tensor_collection(value) and not _is_non_tensor(value):
            yield from _leaves(value, path)
        else:
            raise UsageError(f"key {_key(path)} holds {type(value).__name__}: a table stores tensors")


def _non_tensors(td: TensorDictBase, prefix: tuple = ()):
    for key, value in td.items():
        path = (*prefix, key)
        if _is_non_tensor(value):
            yield path
        elif is_tensor_collection(value) and not isinstance(value, torch.Tensor):
            yield from _non_tensors(value, path)


def _is_non_tensor(value: Any) -> bool:
    from tensordict import is_non_tensor

    return is_non_tensor(value)


def _leaf_columns(td: TensorDictBase, lead: int, prefix: tuple) -> list[Column]:
    return [Column(column_name((*prefix, *path)), (*prefix, *path), tuple(leaf.shape[lead:]), leaf.dtype)
            for path, leaf in _leaves(td)]


def _alike(td: LazyStackedTensorDict) -> bool:
    """Do a lazy stack's members hold the same keys with the same shapes (so it can be made dense)?"""
    first = {path: (leaf.shape, leaf.dtype) for path, leaf in _leaves(td.tensordicts[0])}
    return all({path: (leaf.shape, leaf.dtype) for path, leaf in _leaves(member)} == first
               for member in td.tensordicts[1:])


def _tensordict(leaves: dict, batch_size: list, device) -> TensorDict:
    td = TensorDict(batch_size=batch_size, device=device if device is not None and str(device) != "cpu" else None)
    for path, value in leaves.items():
        td.set(path if len(path) > 1 else path[0], value)
    return td


def _key(path: tuple) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def _unique(name: str, taken: set) -> str:
    base, i = name, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _find_class(reference: str):
    """The tensorclass ``"module:qualname"`` if its module is loaded here (a table's
    meta never makes this process import anything), else None."""
    module_name, _, qualname = reference.partition(":")
    module = sys.modules.get(module_name)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not None and is_tensorclass(obj):
        return obj
    return None


__all__ = ["Schema", "Column", "column_name", "column_path", "KINDS"]
