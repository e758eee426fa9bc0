"""Nested slice assignments as one window: `aotfuse::box_scatter(base, src, starts)`.

Eager writes `x[:, 0, 1:w, 1:w] = y` into x's memory. Functionalization makes it a scatter of a
scatter of a scatter: `select_scatter(x, slice_scatter(select(x, 1, 0), slice_scatter(slice(...),
copy(..., y), 2, 1, w), 1, 1, w), 1, 0)`, each level a copy of its whole base (Longformer's
sliding-window attention assigns four such regions per band, per layer, each way). box_of() reads
such a nest as one box: the base, the innermost source (a copy of y is y), and where the box
starts on each of the base's dims; lowering emits it as box_scatter, one window member of the C
core (fuse.h): src[i - starts] inside the box, base[i] elsewhere. The levels' bases (views of the
outer base) and the copies are then read by nothing and not made.

Lowering makes boxes only of float tensors on a device with generated kernels, where they are
kernel members; their own implementation (ATen's: a copy of base with src copied into the box, or
the value filled in) runs only when a kernel falls back to ATen calls (an input of another layout).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["box_scatter", "box_fill", "box_of"]

aten = torch.ops.aten


@torch.library.custom_op("aotfuse::box_scatter", mutates_args=())
def box_scatter(base: torch.Tensor, src: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """base with src written at [starts[d], starts[d] + src.shape[d]) on every dim d (a copy)."""
    if src.dim() != base.dim() or len(starts) != base.dim():
        raise ValueError(f"aotfuse::box_scatter: src{list(src.shape)} and starts {list(starts)} must have base's rank {base.dim()}")
    out = base.clone()
    region = out
    for d, (s, n) in enumerate(zip(starts, src.shape)):
        if s < 0 or s + n > base.shape[d]:
            raise ValueError(f"aotfuse::box_scatter: src{list(src.shape)} at {list(starts)} is outside base{list(base.shape)}")
        region = region.narrow(d, s, n)
    region.copy_(src)
    return out


@box_scatter.register_fake
def _(base: torch.Tensor, src: torch.Tensor, starts: list[int]) -> torch.Tensor:
    return torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device)


@torch.library.custom_op("aotfuse::box_fill", mutates_args=())
def box_fill(base: torch.Tensor, starts: list[int], sizes: list[int], value: float) -> torch.Tensor:
    """base with value at [starts[d], starts[d] + sizes[d]) on every dim d (a copy)."""
    if len(starts) != base.dim() or len(sizes) != base.dim():
        raise ValueError(f"aotfuse::box_fill: starts {list(starts)} and sizes {list(sizes)} must have base's rank {base.dim()}")
    out = base.clone()
    region = out
    for d, (s, n) in enumerate(zip(starts, sizes)):
        if s < 0 or n < 0 or s + n > base.shape[d]:
            raise ValueError(f"aotfuse::box_fill: the box {list(sizes)} at {list(starts)} is outside base{list(base.shape)}")
        region = region.narrow(d, s, n)
    region.fill_(value)
    return out


@box_fill.register_fake
def _(base: torch.Tensor, starts: list[int], sizes: list[int], value: float) -> torch.Tensor:
    return torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device)


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) and val.layout == torch.strided else None


def _call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _level(node: fx.Node) -> tuple | None:
    """One scatter: (base, source, dim, start, kept), kept False where the source lacks dim (a select),
    or None when node is none (step 1, no keywords, in bounds)."""
    if not _call(node, aten.slice_scatter.default, aten.select_scatter.default) or len(node.args) < 2:
        return None
    val = _val(node)
    if val is None or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return None
    base, src = node.args[0], node.args[1]
    sv = _val(src)
    if sv is None or _val(base) is None or sv.dtype != val.dtype or sv.device != val.device:
        return None
    if node.target is aten.slice_scatter.default:
        dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2:])[:4]
        if step != 1 or not isinstance(dim, int) or not all(isinstance(x, int) or x is None for x in (start, end)):
            return None
        dim %= val.dim()
        n = val.shape[dim]
        start = 0 if start is None else start + n if start < 0 else start
        start = min(max(start, 0), n)
        if sv.dim() != val.dim() or start + sv.shape[dim] > n:
            return None
        return base, src, dim, start, True
    if node.target is aten.select_scatter.default and len(node.args) == 4:
        dim, index = node.args[2], node.args[3]
        if not isinstance(dim, int) or not isinstance(index, int) or sv.dim() + 1 != val.dim():
            return None
        dim %= val.dim()
        index = index + val.shape[dim] if index < 0 else index
        if not 0 <= index < val.shape[dim]:
            return None
        return base, src, dim, index, False
    return None


def _is_region(view: Any, base: fx.Node, dim: int, start: int, kept: bool, size: int) -> bool:
    """view is base's region of one level: slice(base, dim, start, start + size) or select(base, dim, start)."""
    bv = _val(base)
    if not isinstance(view, fx.Node) or view.op != "call_function" or not view.args or view.args[0] is not base \
            or view.kwargs or bv is None:
        return False
    n = bv.shape[dim]
    if kept and view.target is aten.slice.Tensor:
        d, s, e, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1:])[:4]
        if step != 1 or not isinstance(d, int) or d % bv.dim() != dim:
            return False
        s = 0 if s is None else s + n if s < 0 else s
        e = n if e is None else e + n if e < 0 else e
        s, e = min(max(s, 0), n), min(max(e, 0), n)
        return s == start and e - s == size
    if not kept and view.target is aten.select.int and len(view.args) == 3:
        d, i = view.args[1], view.args[2]
        return isinstance(d, int) and isinstance(i, int) and d % bv.dim() == dim and (i + n if i < 0 else i) == start
    return False


def _plain_source(src: Any, dtype: torch.dtype) -> tuple[Any, bool]:
    """The value a scatter's source copies (`clone(y)`, `copy(region, y)` with y of the region's
    shape and dtype), and whether it was one."""
    if _call(src, aten.clone.default) and isinstance(src.args[0], fx.Node) and set(src.kwargs) <= {"memory_format"}:
        y = _val(src.args[0])
        if y is not None and y.dtype == dtype:
            return src.args[0], True
    if _call(src, aten.copy.default) and len(src.args) == 2 and isinstance(src.args[1], fx.Node) \
            and set(src.kwargs) <= {"non_blocking"}:
        a, y = _val(src.args[0]), _val(src.args[1])
        if a is not None and y is not None and y.dtype == dtype and a.shape == y.shape and a.device == y.device:
            return src.args[1], True
    return src, False


_FILL_CONST = {aten.zeros.default: 0.0, aten.ones.default: 1.0}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _fill_value(node: Any) -> float | None:
    """The number a fill node (`full`, `zeros`, a `_like` fill, `fill`) writes everywhere, or None."""
    from .lower import _FILLS, _fill_value as like_value  # lower imports this module

    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in _FILL_CONST:
        return _FILL_CONST[node.target]
    if node.target in _FILLS:
        return _number(like_value(node))
    if node.target is aten.full.default and len(node.args) >= 2:
        return _number(node.args[1])
    if node.target is aten.fill.Scalar and len(node.args) == 2:
        return _number(node.args[1])
    if node.target is aten.fill.Tensor and len(node.args) == 2:  # fill(x, value tensor): a 0-dim full
        v = node.args[1]
        if isinstance(v, fx.Node) and v.target is aten.full.default and list(v.args[0]) == []:
            return _fill_value(v)
    return None


def box_of(node: fx.Node) -> tuple | None:
    """(base, source, starts, shape, fill, missing) when node is a scatter worth one box: nested (a
    scatter into the region of its base that it scatters back), with a copied source, or with a
    fill as source. starts and shape: the box, per dim of base; source: the box's elements, with
    the box's dims less `missing` (base's dims selected away, ascending); fill: the number a fill
    source writes (source is then None). None otherwise."""
    top = _level(node)
    if top is None:
        return None
    base, src, dim, start, kept = top
    val = _val(node)
    # walk into the nest: coordinates of each inner level map to base's through `dims`
    dims = list(range(val.dim()))  # this level's dims -> base's dims
    starts = [0] * val.dim()
    missing: list[int] = []
    depth, level_base = 0, base
    while True:
        starts[dims[dim]] += start
        if not kept:
            missing.append(dims[dim])
            dims = dims[:dim] + dims[dim + 1:]
        inner = _level(src)
        if inner is None or len(src.users) != 1 \
                or not _is_region(inner[0], level_base, dim, start, kept, _val(src).shape[dim] if kept else 1):
            break
        level_base, src, dim, start, kept = inner
        depth += 1
    src, copied = _plain_source(src, val.dtype)
    fill = _fill_value(src)
    if depth == 0 and not copied and fill is None:
        return None
    shape = list(_val(src).shape)
    for d in sorted(missing):
        shape.insert(d, 1)
    if len(shape) != val.dim() or any(s + n > b for s, n, b in zip(starts, shape, val.shape)):
        return None
    return base, None if fill is not None else src, starts, shape, fill, sorted(missing)
