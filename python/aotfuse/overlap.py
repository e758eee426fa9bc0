"""The gradient of an overlapping `as_strided` as a sum of windows, not an `index_add`.

Longformer cuts its sequence into overlapping chunks with `as_strided` (chunk stride half a chunk).
ATen's backward of such a view scatters the gradient back with an index: `index_add(zeros(N), 0,
flat(arange(N).as_strided(S, T, off)), flat(g))`, one zero fill and one ATen `index_add` each
(36 of each in a Longformer training step, 12 layers), atomics on a GPU. Here the index is built
from shapes alone, so its geometry (sizes S, strides T, offset off) is known when the graph is
lowered, and the scatter is a sum of plain windows:

  - the dims of S sorted by stride, inner to outer, must tile the storage: each stride is the
    extent of the dims inside it, except one overlapping pair, a dim `a` whose stride is a
    multiple q >= 1 of the stride of the dim `b` just inside it but smaller than b's extent (chunks
    of b's length starting every q steps: position p = q * i_a + i_b on one axis of length
    L = q * (S_a - 1) + S_b);
  - chunks k, k + m, k + 2m, ... (m = ceil(S_b / q)) do not overlap: for each class k, the slice of
    g holding them, permuted to storage order, padded to chunks of q * m, viewed as one axis and
    padded (or cropped) by q * k on the left to the axis' length L, is that class' share of the
    storage, zeros elsewhere;
  - the result is the sum of the m classes (a pad of the flat sum where the offset or the tiled
    extent leave storage uncovered).

Every step is a view, a `constant_pad_nd` (a window member of the kernels, fuse.h) or an add, so
the C core fuses the whole sum into one kernel, which reads g where it lies: no fill, no index, no
ATen call, no atomics. Positions covered by at most two chunks get eager's value to the bit (a sum
of one or two numbers does not depend on its order); more overlap sums in another order than
index_add's (rounding). Rewritten only for float tensors on a device with generated kernels;
AOTFUSE_OVERLAP_SUMS=0 keeps the index_add.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from . import config
from .lower import _FILLS as _LIKE_FILLS, _fill_value

__all__ = ["overlap_plan", "rewrite_overlap_sums"]

aten = torch.ops.aten

_FLATTENS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# nodes a rewritten index_add may leave unread: removed when nothing else reads them
_PURE = _FLATTENS | set(_LIKE_FILLS) | {aten.zeros.default, aten.full.default, aten.clone.default, aten.as_strided.default,
                                        aten.arange.default, aten.arange.start, aten.arange.start_step}


def overlap_plan(sizes: list[int], strides: list[int], offset: int, numel: int) -> dict | None:
    """How a scatter-add of a tensor of `sizes` onto `numel` zeros at the as_strided geometry
    (strides, offset) is a sum of windows, or None where the geometry does not tile as the module
    docstring says. Returns: order (the dims of extent > 1, outer to inner in storage), pair (a, b,
    q: the overlapping dims and their stride ratio) or None, classes m, extent (the elements the
    tiled axes span) and axes (per dim in order, its length in storage: L for b, absent for a)."""
    if len(sizes) != len(strides) or offset < 0 or numel <= 0:
        return None
    dims = [d for d in range(len(sizes)) if sizes[d] != 1]
    if any(sizes[d] <= 0 or strides[d] <= 0 for d in dims):
        return None
    order = sorted(dims, key=lambda d: (-strides[d], d))  # equal strides: windows every row (q = 1)
    block, pair, top, top_single = 1, None, None, False  # top: the outermost axis so far
    axes: dict[int, int] = {}
    for d in reversed(order):
        t = strides[d]
        if t == block:
            axes[d] = sizes[d]
            block *= sizes[d]
            top, top_single = d, True
        elif pair is None and top_single and t < block and t % strides[top] == 0:
            q = t // strides[top]
            length = q * (sizes[d] - 1) + sizes[top]
            block = block // sizes[top] * length
            axes[top] = length
            pair = (d, top, q)
            top_single = False
        else:
            return None
    if offset + block > numel:
        return None
    m = math.ceil(sizes[pair[1]] / pair[2]) if pair else 1
    return {"order": order, "pair": pair, "classes": m, "extent": block, "axes": axes}


def _fill_is_zero(node: Any, numel: int, dtype: torch.dtype) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() == 1 and val.numel() == numel and val.dtype == dtype):
        return False
    if node.target is aten.zeros.default:
        return True
    if node.target is aten.full.default:  # full(size, value)
        value = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
    elif node.target in _LIKE_FILLS:  # zeros_like, new_full, ...: lowering's reading of them
        value = _fill_value(node)
    else:
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _geometry(index: Any) -> tuple | None:
    """(sizes, strides, offset) where index is flat(arange(n).as_strided(sizes, strides, offset)):
    flattenings and copies of the as_strided (each keeps the row-major order of its elements)."""
    x = index
    while isinstance(x, fx.Node) and x.op == "call_function" and (x.target in _FLATTENS or x.target is aten.clone.default):
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is aten.as_strided.default):
        return None
    base, sizes, strides = x.args[:3]
    offset = x.args[3] if len(x.args) > 3 else x.kwargs.get("storage_offset", 0)
    if offset is None:
        offset = 0
    if not (isinstance(base, fx.Node) and base.op == "call_function"):
        return None
    if base.target is aten.arange.default:
        start, step = 0, 1
    elif base.target is aten.arange.start:
        start, step = base.args[0], 1
    elif base.target is aten.arange.start_step:
        start, step = base.args[0], base.args[2]
    else:
        return None
    bval = base.meta.get("val")
    if start != 0 or step != 1 or not (isinstance(bval, torch.Tensor) and bval.dim() == 1 and bval.dtype == torch.int64):
        return None
    if not all(isinstance(v, int) for v in list(sizes) + list(strides) + [offset]):
        return None
    return list(sizes), list(strides), offset


def _emit(graph: fx.Graph, g: fx.Node, sizes: list[int], plan: dict, offset: int, numel: int) -> fx.Node:
    """The sum of windows for plan (see overlap_plan), inserted at graph's insertion point. Each
    node's value is computed from its inputs' (fake) values, so a layout that does not allow a view
    raises before anything reads the new nodes; the caller erases them then."""
    made: list[fx.Node] = []

    def _call(graph: fx.Graph, target: Any, args: tuple, val: torch.Tensor, kwargs: dict | None = None) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        made.append(node)
        node.meta["val"] = val
        return node

    try:
        return _sum_of_windows(graph, _call, g, sizes, plan, offset, numel)
    except Exception:
        for node in reversed(made):
            graph.erase_node(node)
        return None


def _sum_of_windows(graph: fx.Graph, _call: Any, g: fx.Node, sizes: list[int], plan: dict, offset: int,
                    numel: int) -> fx.Node:
    gval = g.meta["val"]
    order, pair, m, axes = plan["order"], plan["pair"], plan["classes"], plan["axes"]
    # g over the dims that take room (size-1 dims dropped), renumbered
    kept = sorted(order)
    sizes = [sizes[d] for d in kept]
    order = [kept.index(d) for d in order]
    axes = {kept.index(d): n for d, n in axes.items()}
    if pair:
        pair = (kept.index(pair[0]), kept.index(pair[1]), pair[2])
    x = _call(graph, aten.view.default, (g, sizes), aten.view.default(gval, sizes))
    perm = order
    total = None
    for k in range(min(m, sizes[pair[0]]) if pair else 1):  # a class past the last chunk holds nothing
        y = x
        if pair:
            a, b, q = pair
            y = _call(graph, aten.slice.Tensor, (y, a, k, sizes[a], m), aten.slice.Tensor(y.meta["val"], a, k, sizes[a], m))
        if perm != list(range(len(sizes))):  # in storage order; a copy, so the pads' layouts are row-major
            y = _call(graph, aten.permute.default, (y, perm), aten.permute.default(y.meta["val"], perm))
            contiguous = {"memory_format": torch.contiguous_format}
            y = _call(graph, aten.clone.default, (y,), aten.clone.default(y.meta["val"], **contiguous), contiguous)
        shape = list(y.meta["val"].shape)
        pads = [0] * (2 * len(shape))
        if pair:  # chunks of q * m along b (zeros after each chunk's S_b), then one axis
            jb = perm.index(b)
            pads[2 * (len(shape) - 1 - jb) + 1] = q * m - sizes[b]
        y = _call(graph, aten.constant_pad_nd.default, (y, pads, 0.0), aten.constant_pad_nd.default(y.meta["val"], pads, 0.0))
        if pair:
            ja = perm.index(a)
            shape = list(y.meta["val"].shape)
            merged = shape[:ja] + [shape[ja] * shape[ja + 1]] + shape[ja + 2:]
            y = _call(graph, aten.view.default, (y, merged), aten.view.default(y.meta["val"], merged))
            pads = [0] * (2 * len(merged))
            left = q * k
            pads[2 * (len(merged) - 1 - ja)] = left
            pads[2 * (len(merged) - 1 - ja) + 1] = axes[b] - left - merged[ja]
            y = _call(graph, aten.constant_pad_nd.default, (y, pads, 0.0),
                      aten.constant_pad_nd.default(y.meta["val"], pads, 0.0))
        total = y if total is None else _call(graph, aten.add.Tensor, (total, y), aten.add.Tensor(total.meta["val"], y.meta["val"]))
    extent = plan["extent"]
    flat = _call(graph, aten.view.default, (total, [extent]), aten.view.default(total.meta["val"], [extent]))
    if offset or extent != numel:
        pads = [offset, numel - offset - extent]
        flat = _call(graph, aten.constant_pad_nd.default, (flat, pads, 0.0),
                     aten.constant_pad_nd.default(flat.meta["val"], pads, 0.0))
    return flat


def rewrite_overlap_sums(gm: fx.GraphModule) -> int:
    """Rewrites, in place, each `index_add(zeros(N), 0, flat(arange.as_strided(...)), g)` of a float
    tensor on a device with generated kernels whose geometry tiles (overlap_plan) into its sum of
    windows; returns how many. Nodes only the index_adds read go."""
    if not config.overlap_sums():
        return 0
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_add.default or len(node.args) != 4:
            continue
        if set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
            continue
        zeros, dim, index, g = node.args
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() == 1 and val.dtype.is_floating_point and dim in (0, -1)
                and config.kernels_for(val.device) and isinstance(g, fx.Node)):
            continue
        gval = g.meta.get("val")
        numel = val.shape[0]
        if not (isinstance(gval, torch.Tensor) and gval.dim() == 1 and gval.dtype == val.dtype and gval.device == val.device
                and _fill_is_zero(zeros, numel, val.dtype)):
            continue
        geometry = _geometry(index)
        if geometry is None:
            continue
        sizes, strides, offset = geometry
        if math.prod(sizes) != gval.shape[0]:
            continue
        plan = overlap_plan(sizes, strides, offset, numel)
        if plan is None:
            continue
        with graph.inserting_before(node):
            out = _emit(graph, g, sizes, plan, offset, numel)
        if out is None or tuple(out.meta["val"].shape) != tuple(val.shape) or out.meta["val"].stride() != val.stride():
            continue
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        _erase_unread([zeros, index])
        done += 1
    if done:
        gm.recompile()
    return done


def _erase_unread(nodes: list) -> None:
    """Erases nodes nobody reads any more (views, copies, fills, aranges), and then their inputs."""
    work, erased = [n for n in nodes if isinstance(n, fx.Node)], set()
    while work:
        n = work.pop()
        if n in erased or n.users or n.op != "call_function" or n.target not in _PURE:
            continue
        inputs = list(n.all_input_nodes)
        n.graph.erase_node(n)
        erased.add(n)
        work.extend(inputs)
