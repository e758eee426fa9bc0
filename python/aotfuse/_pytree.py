"""Flattening of call arguments and results: tuples, namedtuples, lists, dicts, dataclasses and
Hugging Face ModelOutput (a dict that is also a dataclass). Everything else is a leaf.

A spec is a hashable tree of (kind, type, keys, child specs) so that it can be part of a cache key.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["tree_flatten", "tree_unflatten", "LEAF"]

LEAF = ("leaf",)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def tree_flatten(tree: Any, objects: bool = False) -> tuple[list[Any], tuple]:
    """Returns (leaves, spec). Example: tree_flatten(((x, 1), {"a": y})) -> ([x, 1, y], spec).

    objects=True (for results) also opens plain objects whose attributes hold tensors, such as
    Hugging Face's DynamicCache, so that each call returns its own object around its own tensors.
    """
    leaves: list[Any] = []
    spec = _flatten(tree, leaves, objects, set())
    return leaves, spec


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _holds_tensor(x: Any, depth: int, seen: set) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return True
    if depth > 6 or id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type)):
        return False
    seen.add(id(x))
    if isinstance(x, dict):
        return any(_holds_tensor(v, depth + 1, seen) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v, depth + 1, seen) for v in x)
    d = getattr(x, "__dict__", None)
    return isinstance(d, dict) and not isinstance(x, torch.nn.Module) and \
        any(_holds_tensor(v, depth + 1, seen) for v in d.values())


def _flatten(x: Any, leaves: list[Any], objects: bool, seen: set) -> tuple:
    t = type(x)
    if t is tuple or t is list:
        return ("seq", t, None, tuple(_flatten(v, leaves, objects, seen) for v in x))
    if t is dict:  # a plain dict of tensors (a module's parameters): no recursion per entry
        values, tensor = tuple(x.values()), _tensor_type()
        if all(isinstance(v, tensor) for v in values):
            leaves.extend(values)
            return ("dict", t, tuple(x.keys()), (LEAF,) * len(values))
    if isinstance(x, dict):
        keys = tuple(x.keys())
        # ModelOutput and other dict dataclasses are rebuilt from keywords; plain dicts from pairs
        kind = "dictdc" if dataclasses.is_dataclass(x) else "dict"
        return (kind, t, keys, tuple(_flatten(x[k], leaves, objects, seen) for k in keys))
    if _is_namedtuple(x):
        return ("namedtuple", t, None, tuple(_flatten(v, leaves, objects, seen) for v in x))
    if isinstance(x, (tuple, list)):
        return ("seq", t, None, tuple(_flatten(v, leaves, objects, seen) for v in x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x))
        return ("dataclass", t, names, tuple(_flatten(getattr(x, n), leaves, objects, seen) for n in names))
    if objects and not _is_tensor(x) and id(x) not in seen and _holds_tensor(x, 0, set()):
        seen.add(id(x))
        names = tuple(vars(x).keys())
        return ("object", t, names, tuple(_flatten(vars(x)[n], leaves, objects, seen) for n in names))
    leaves.append(x)
    return LEAF


def tree_unflatten(leaves: list[Any], spec: tuple) -> Any:
    """Inverse of tree_flatten: rebuilds the same structure and types around new leaves."""
    it = iter(leaves)
    return _unflatten(it, spec)


def _unflatten(it, spec: tuple) -> Any:
    if spec is LEAF or spec[0] == "leaf":
        return next(it)
    kind, t, keys, children = spec
    values = [_unflatten(it, c) for c in children]
    if kind == "seq":
        if t is tuple or t is list:
            return t(values)
        try:
            return t(values)
        except TypeError:
            return list(values) if issubclass(t, list) else tuple(values)
    if kind == "namedtuple":
        return t(*values)
    if kind == "dictdc":
        return t(**dict(zip(keys, values)))
    if kind == "dict":
        if t is dict:
            return dict(zip(keys, values))
        try:
            out = t()
        except TypeError:
            return dict(zip(keys, values))
        out.update(zip(keys, values))
        return out
    if kind == "object":
        out = object.__new__(t)
        out.__dict__.update(zip(keys, values))
        return out
    if kind == "dataclass":
        out = object.__new__(t)  # no __init__/__post_init__: the fields are set as they were
        for name, v in zip(keys, values):
            object.__setattr__(out, name, v)
        return out
    raise ValueError(f"bad spec kind {kind!r}")
