"""Constant folding: the part of a graph that no input reaches is computed once, when it is lowered.

Models build masks and tables from shapes alone: Bert's extended attention mask from `ones` when no
mask is given, Longformer's `new_ones(...).tril().flip(...)` band masks per layer, position tables
from `arange`. Eager and a traced graph recompute them every step, one ATen call each. fold()
evaluates every node that reads no graph input (ATen ops that are deterministic and write nothing)
and hands the C core the values other nodes read as constants (`get_attr`, bound by Lowered as
extra program inputs), so each step skips those calls.

What stays a node:
  - anything reading a graph input's data (a `_like` fill reads only its input's shape, dtype
    and layout: it folds), random ops (`nondeterministic_seeded`), ops that write an argument or
    return no tensor (asserts), uninitialized allocations (`empty*`);
  - graph outputs, and the bases of outputs that are views: a constant is one tensor shared by every
    call, which a caller could write to (a forward's outputs saved for its backward excepted: the
    backward only reads them);
  - contiguous `_like` fills and `full` read by other nodes: lowering makes them `aten.full` members
    that read nothing, cheaper than a constant read from memory (`zeros`, `ones`, `scalar_tensor`
    fold, and become such members below);
  - views: a constant is a fresh tensor, so a view stays a view of its (folded) base;
  - values above _MAX_BYTES: memory held for the program's life (fills in another layout, such as
    Longformer's `full_like` of a strided slice, excepted: they become fills, below).
A constant holding one value everywhere (float or bool, dense) becomes `aten.full`, a kernel member
that reads nothing, where it is contiguous or too big to keep (then permuted to its layout, a kernel
of its own): no memory is kept. Equal constants are kept once.
AOTFUSE_CONSTANT_FOLD=0 turns folding off.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from . import _C, config

__all__ = ["fold"]

aten = torch.ops.aten

# the largest constant kept (bytes); larger folded values stay computed from smaller ones
_MAX_BYTES = 1 << 20
# the largest value evaluated while folding (elements): bounds the compile-time work
_MAX_EVAL_NUMEL = 1 << 24

# ops that read only the shape, dtype, device and layout of their first argument, never its data
_META_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_zeros.default,
              aten.new_ones.default, aten.new_full.default}
_FILLS = _META_ONLY | {aten.zeros.default, aten.ones.default, aten.full.default, aten.scalar_tensor.default}
# the fills lowering makes `aten.full` members of where their layout is contiguous (lower._replacements)
_LOWERED_FILLS = _META_ONLY | {aten.full.default}
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                  aten.new_empty.default, aten.new_empty_strided.default}


def _deterministic_pure(node: fx.Node) -> bool:
    """An ATen op whose tensor result is a function of its arguments alone and that writes nothing."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t in _UNINITIALIZED:
        return False
    if t.namespace not in ("aten", "prims") or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments):
        return False
    return isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].layout == torch.strided


def _is_view(node: fx.Node) -> bool:
    """A view in the C core's op table (its value shares its input's memory)."""
    from .lower import _op_name  # lower imports this module

    return _C.op_kind(_op_name(node.target)) == "view"


def _returns_alias(node: fx.Node) -> bool:
    """A view (_is_view), or an op whose schema returns an alias of an argument (`unbind`, `split`:
    their items, taken by operator.getitem, share the argument's memory)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    return _is_view(node) or any(r.alias_info is not None and not r.alias_info.is_write
                                 for r in node.target._schema.returns)


def _fill(node: fx.Node) -> bool:
    """A fill whose value becomes an `aten.full` member (float or bool, a dense layout)."""
    val = node.meta["val"]
    return node.target in _FILLS and (val.dtype.is_floating_point or val.dtype == torch.bool) and dense(val)


def dense(val: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill its memory exactly once (a permuted contiguous
    layout), so a fresh tensor can have its strides."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(val.shape, val.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _uniform_value(v: torch.Tensor) -> float | bool | None:
    """The one value a dense float or bool tensor holds in every element, bit for bit (as
    `aten.full` takes it), else None."""
    if not (v.dtype.is_floating_point or v.dtype == torch.bool) or not dense(v) or v.numel() == 0:
        return None
    bits = v.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[v.element_size()])
    flat = bits.reshape(-1)
    return v.reshape(-1)[0].item() if bool((flat == flat[0]).all()) else None  # bitwise: -0.0 and NaNs too


def _nbytes(val: torch.Tensor) -> int:
    return val.numel() * val.element_size()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def fold(gm: fx.GraphModule, saved_from: int | None = None) -> fx.GraphModule:
    """gm with its input-independent values computed (a new GraphModule), or gm itself when there
    is nothing worth folding. `saved_from`: the graph's outputs from that position on are saved
    for a backward, which only reads them, so they may be constants (a forward saving a mask)."""
    if not config.constant_fold():
        return gm
    nodes = list(gm.graph.nodes)
    visible: set = set()  # nodes some caller may write to: graph outputs before saved_from
    for node in nodes:
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            cut = len(outs) if saved_from is None else saved_from
            visible.update(o for o in outs[:cut] if isinstance(o, fx.Node))
    # a visible view makes its base visible: the output shares the base's memory, so a folded base
    # would be one tensor under every call's output (a caller's in-place update of one call's
    # `ones_like(x)[1:2]` showed in the next call's)
    stack = list(visible)
    while stack:
        node = stack.pop()
        if node.op == "call_function" and (node.target is operator.getitem or _returns_alias(node)):
            for base in node.all_input_nodes:
                if base not in visible:
                    visible.add(base)
                    stack.append(base)
    computable: set = set()  # reads no graph input's data
    for node in nodes:
        if node.op == "get_attr":
            if isinstance(getattr(gm, node.target, None), torch.Tensor):
                computable.add(node)
        elif _deterministic_pure(node) and node.meta["val"].numel() <= _MAX_EVAL_NUMEL:
            if all(r in computable for r in _data_reads(node)):
                computable.add(node)
    # Which computable nodes stay nodes (graph outputs, views and fills that something else reads,
    # values too big to keep), until stable: a node that stays reads its inputs at run time.
    stays: set = set()

    def constant(node: fx.Node) -> bool:
        return node.op != "get_attr" and node in computable and node not in stays and \
            any(u not in computable or u in stays for u in node.users)

    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):
            if not constant(node):
                continue
            val = node.meta["val"]
            fill = _fill(node)
            if node in visible or _is_view(node) or (node.target in _LOWERED_FILLS and fill and val.is_contiguous()) \
                    or (_nbytes(val) > _MAX_BYTES and not fill) or val.storage_offset() != 0 or not dense(val):
                stays.add(node)
                changed = True
    constants = [n for n in nodes if constant(n)]
    if not constants:
        return gm
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # Dynamo lowers under its fake mode; these are real tensors
        values = _evaluate(gm, nodes, computable, set(constants))
        if values is None:
            return gm
        return _rebuild(gm, nodes, computable - stays, constants, values)


def _data_reads(node: fx.Node) -> list:
    """The nodes whose data node reads (a `_like` fill reads only its first argument's layout)."""
    return node.all_input_nodes[1:] if node.target in _META_ONLY else node.all_input_nodes


def _evaluate(gm: fx.GraphModule, nodes: list, computable: set, wanted: set) -> dict | None:
    """The real values of the folded nodes the constants need; None when an op fails or disagrees
    with the traced layout (then nothing is folded)."""
    need: set = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(r for r in _data_reads(n) if r in computable)
    env: dict = {}

    def value(a: Any) -> Any:
        return env[a] if isinstance(a, fx.Node) else a

    try:
        with torch.no_grad():
            for node in nodes:
                if node not in need:
                    continue
                if node.op == "get_attr":
                    env[node] = getattr(gm, node.target)
                    continue
                args, kwargs = node.args, node.kwargs
                if node.target in _META_ONLY:  # a stand-in with the argument's layout; its data is never read
                    like = node.args[0].meta["val"]
                    stand_in = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
                    args = (stand_in,) + tuple(fx.node.map_arg(args[1:], value))
                else:
                    args = fx.node.map_arg(args, value)
                out = node.target(*args, **fx.node.map_arg(kwargs, value))
                val = node.meta["val"]
                if not isinstance(out, torch.Tensor) or out.shape != val.shape or out.dtype != val.dtype \
                        or out.device != val.device:
                    return None
                if node in wanted and not _same_layout(out, val):
                    if out.stride() != val.stride():
                        out = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).copy_(out)
                    if not _same_layout(out, val):
                        return None
                env[node] = out
    except Exception as e:  # noqa: BLE001 - any failure leaves the graph as traced
        config.emit("lowering", f"constant folding skipped: {type(e).__name__}: {e}")
        return None
    return env


def _full_node(graph: fx.Graph, node: fx.Node, fill: float | bool) -> fx.Node:
    """`aten.full` of node's value: in its memory order, then permuted to its dims when its layout
    is not contiguous (so that ATen's full and permute, where they run, give the traced layout)."""
    val = node.meta["val"]
    order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))  # dims from outermost in memory
    shape = [val.shape[d] for d in order]
    full = graph.call_function(aten.full.default, (shape, fill), {"dtype": val.dtype, "layout": torch.strided,
                                                                   "device": val.device, "pin_memory": False})
    if order == list(range(val.dim())):
        full.meta = dict(node.meta)
        return full
    full.meta = {"val": val.new_empty(shape)}
    perm = graph.call_function(aten.permute.default, (full, [order.index(d) for d in range(val.dim())]))
    perm.meta = dict(node.meta)
    return perm


def _rebuild(gm: fx.GraphModule, nodes: list, folded: set, constants: list, values: dict) -> fx.GraphModule:
    """A copy of gm's graph in which each constant is a `get_attr` (after the placeholders) and the
    other folded nodes are gone (only folded nodes read them)."""
    graph = fx.Graph()
    attrs: dict[str, Any] = {}
    env: dict = {}
    for p in nodes:
        if p.op == "placeholder":
            env[p] = graph.node_copy(p, lambda n: env[n])
    kept_values: list[tuple[torch.Tensor, fx.Node]] = []  # one get_attr per distinct value
    fills: dict = {}  # one node per distinct fill
    for node in constants:
        v = values[node]
        fill = _uniform_value(v)
        if fill is not None and (v.is_contiguous() or _nbytes(v) > _MAX_BYTES):
            # a kernel member that reads nothing, no memory kept (permuted, it is a kernel of its
            # own that the readers read through the permute: small ones are kept as constants)
            key = (tuple(v.shape), v.stride(), v.dtype, v.device, repr(fill))  # repr: -0.0 is not 0.0
            if key not in fills:
                fills[key] = _full_node(graph, node, fill)
            env[node] = fills[key]
            continue
        c = next((c for other, c in kept_values if _same_layout(other, v) and torch.equal(other, v)), None)
        if c is None:
            name = f"_aotfuse_constant{len(kept_values)}"
            attrs[name] = v
            c = graph.get_attr(name)
            c.meta = dict(node.meta)
            kept_values.append((v, c))
        env[node] = c
    for node in nodes:
        if node.op == "placeholder" or node in env:
            continue
        if node.op == "get_attr":
            if all(u in folded for u in node.users):
                continue  # read only while folding
            attrs[node.target] = getattr(gm, node.target)
        elif node in folded:
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.eliminate_dead_code()  # what only folded nodes read (the argument of a folded `_like` fill)
    graph.lint()
    out = config.graph_module(attrs, graph, class_name=gm.__class__.__name__)
    out.meta.update(getattr(gm, "meta", {}))
    config.emit("lowering", f"constant folding: {len(constants)} values computed once: {len(fills)} fills, "
                f"{len(kept_values)} distinct constants of {sum(_nbytes(v) for v, _n in kept_values)} bytes")
    return out
