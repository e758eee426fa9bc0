"""Lowering: one walk over an FX graph hands every node to the C core, which owns it from then on.

`lower(gm)` returns a `Lowered` callable wrapping an `aotfuse._C.Program`; it follows AOTAutograd's
boxed calling convention (one list argument, cleared by the callee).
"""
from __future__ import annotations

import math
import operator
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._prims_common import make_contiguous_strides_for
import torch.fx as fx

from . import _C, config, constfold
from .scatter import box_of

__all__ = ["lower", "missing_gradients", "build_graph", "GraphBuild", "Lowered", "UnsupportedError", "BackendUnavailable"]


class UnsupportedError(RuntimeError):
    """A graph node the C core cannot take (not an ATen op, or an argument it cannot encode)."""


class BackendUnavailable(UnsupportedError):
    """The kernels' backend cannot work here (no NVRTC or CUDA driver for CUDA tensors, no C
    compiler for CPU tensors). AOTFUSE_BACKEND=aten runs without generated kernels."""


_search_dirs_added = False


def _add_nvrtc_search_dirs() -> None:
    global _search_dirs_added
    if not _search_dirs_added:
        for d in config.nvrtc_dirs():
            _C.cuda_add_search_dir(d)
        _search_dirs_added = True


_DTYPE_NAMES = {getattr(torch, n): n for n in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "uint64")}  # uint64: CUDA attention's random state, extern calls' alone


def _meta(val: Any, device: tuple | None = None) -> tuple:
    if isinstance(val, torch.Tensor):
        dtype = _DTYPE_NAMES.get(val.dtype)
        if dtype is None:
            raise UnsupportedError(f"dtype {val.dtype} is not supported by aotfuse")
        if val.layout != torch.strided:
            raise UnsupportedError(f"layout {val.layout} is not supported by aotfuse")
        shape, stride = tuple(val.shape), val.stride()
        if torch.SymInt in map(type, shape) or torch.SymInt in map(type, stride):
            raise UnsupportedError("symbolic shapes are not supported: aotfuse compiles each shape on its own")
        dev = val.device
        where = device or (dev.type, -1 if dev.index is None else dev.index)
        return ("tensor", dtype, where[0], where[1], shape, stride, int(val.storage_offset()))
    return ("other",)


def _encode(a: Any, env: dict, where: str, device: tuple | None = None) -> tuple:
    if isinstance(a, fx.Node):
        vid = env.get(a)
        if not isinstance(vid, int):
            raise UnsupportedError(f"{where}: argument {a.name} is not a single value")
        return ("v", vid)
    if a is None:
        return ("none",)
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return ("int", a)
    if isinstance(a, float):
        return ("float", a)
    if isinstance(a, complex):  # ATen calls only: no kernel takes complex numbers
        return ("complex", a)
    if isinstance(a, str):
        return ("str", a)
    if isinstance(a, torch.dtype):
        name = _DTYPE_NAMES.get(a)
        if name is None:
            raise UnsupportedError(f"{where}: dtype {a} is not supported")
        return ("dtype", name)
    if isinstance(a, torch.device):
        return ("device",) + (device or (a.type, -1 if a.index is None else a.index))
    if isinstance(a, torch.layout):
        return ("layout", str(a).split(".")[-1])
    if isinstance(a, torch.memory_format):
        return ("memory_format", str(a).split(".")[-1])
    if isinstance(a, (list, tuple)):
        return ("list", [_encode(x, env, where, device) for x in a])
    raise UnsupportedError(f"{where}: cannot pass argument {a!r} of type {type(a).__name__} to the C core")


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name() if "." in target.name() else f"{target.name()}.{target._overloadname}"
    raise UnsupportedError(f"call to {getattr(target, '__name__', target)!r} is not an ATen op")


# Every Lowered alive (weakly held): aotfuse.testing sums the kernel fallbacks of those a model made.
LIVE: "weakref.WeakSet[Lowered]" = weakref.WeakSet()


def _unreached_outputs(gm: fx.GraphModule, present: list) -> tuple:
    """The outputs of a backward graph that read none of the placeholders at positions `present` (the
    output gradients a call has): gradients of inputs reached only through outputs nobody
    differentiated, which eager leaves None (`h, y = m(x); h.sum().backward()`: the weights making y
    only). AOTAutograd's backward gave zeros (aot_eager does too), so AdamW's weight decay moved them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reached = {placeholders[i] for i in present}
    for node in gm.graph.nodes:
        if node.op != "placeholder" and any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return tuple(i for i, v in enumerate(values) if isinstance(v, fx.Node) and v not in reached)


def _unbuildable_message(message: str) -> bool:
    """Whether a C core error says this machine cannot build kernels (no C compiler, or no NVRTC)."""
    return "cannot be built here" in message or "C compiler" in message


class Lowered:
    """A lowered FX graph: call it with a list of inputs (boxed), get a list of outputs."""

    _boxed_call = True

    def __init__(self, program: Any, constants: tuple, out_template: list, n_user_inputs: int):
        self.program = program
        self._constants = constants
        self._template = out_template  # per graph output: None (from the program) or a constant
        self._plain = all(t is None for t in out_template)
        self.n_user_inputs = n_user_inputs
        self.graph_module: fx.GraphModule | None = None  # kept by a backward: see keep_graph_for_missing
        self.variants: dict[tuple, "Lowered"] = {}
        self._tangents: tuple = ()  # a backward: the positions of its output-gradient inputs
        self._tangent_layouts: tuple = ()  # (position, traced value) of each tensor tangent
        # torch.compile's backend, for a backward whose kernels compile at its first run: where they
        # cannot be built here, the graph runs as torch's own FX code (with a warning), as a forward
        # does whose kernels fail at lowering (dynamo._compile_or_fallback)
        self.uncompiled_if_unbuildable = False
        self._uncompiled: Callable | None = None
        self.unreached: tuple = ()  # a variant without some output gradients: outputs given as None
        LIVE.add(self)

    def keep_graph_for_missing(self, gm: fx.GraphModule) -> None:
        """A backward: keep its graph, so that a call without some output gradients (None, the
        tangents AOTAutograd puts last) runs a variant program (missing_gradients)."""
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.graph_module = gm
        # (not an effect token's input, `tangents_token`: None at run time, as traced by unwrap_effects)
        self._tangents = tuple(i for i, n in enumerate(places) if n.name.startswith("tangents")
                               and n.meta.get("val", 0) is not None)
        self._tangent_layouts = tuple((i, places[i].meta["val"]) for i in self._tangents
                                      if isinstance(places[i].meta.get("val"), torch.Tensor))

    def _tangents_in_traced_layouts(self, args: list) -> None:
        """Each output gradient in the layout the backward was traced for, copied where it comes in
        another: AOTAutograd hands some as they are (the gradient of an output that is an input
        transposed in place by `t_()`, strides [4, 1] where [1, 3] were traced), and the program's
        input check refused them (AF_ERR_INVALID) where eager gives the gradient (found by a random
        aliasing sweep)."""
        for i, val in self._tangent_layouts:
            t = args[i]
            if not isinstance(t, torch.Tensor) or t.shape != val.shape or t.numel() == 0:
                continue
            if any(sz > 1 and a != b for sz, a, b in zip(val.shape, t.stride(), val.stride())):
                args[i] = torch.empty_strided(val.shape, val.stride(), dtype=t.dtype, device=t.device).copy_(t)

    def __call__(self, args: list) -> list:
        if self._uncompiled is not None or (self.uncompiled_if_unbuildable and self._unbuildable()):
            return self._uncompiled(args)
        if self._tangents and any(args[i] is None for i in self._tangents):
            return self._without(args)
        if self._tangent_layouts:
            self._tangents_in_traced_layouts(args)
        # boxed convention: the program empties the list and drops each input after its last
        # use, so activations saved for backward die mid-run, not when the backward returns
        if self._constants:
            inputs = list(args) + list(self._constants)
            if isinstance(args, list):
                args.clear()
        else:
            inputs = args if isinstance(args, list) else list(args)
        outs = self.program.run(inputs)
        if self._plain:
            return list(outs)
        it = iter(outs)
        return [next(it) if t is None else t[0] for t in self._template]

    def _unbuildable(self) -> bool:
        """Builds the kernels now, before the first run would take the inputs; True (and the graph's
        FX code kept to run instead) where this machine cannot build them."""
        self.uncompiled_if_unbuildable = False
        try:
            self.program.load_kernels()
        except _C.Error as e:
            if not _unbuildable_message(str(e)) or self.graph_module is None:
                raise
            warnings.warn(f"aotfuse: a Dynamo graph's backward runs uncompiled: {e}", stacklevel=3)
            gm, tangents = self.graph_module, self._tangents
            metas = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
            unreached: dict[tuple, tuple] = {}  # as _without's variants: per set of missing gradients

            def uncompiled(args: list) -> list:
                args = list(args)
                missing = tuple(i for i in tangents if args[i] is None)
                for i in missing:  # gradients autograd did not make (outputs nobody differentiated)
                    if isinstance(metas[i], torch.Tensor):
                        args[i] = torch.zeros(metas[i].shape, dtype=metas[i].dtype, device=metas[i].device)
                outs = gm(*args)
                outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
                if missing:
                    if missing not in unreached:
                        unreached[missing] = _unreached_outputs(gm, [i for i in tangents if i not in missing])
                    for i in unreached[missing]:
                        outs[i] = None
                return outs

            self._uncompiled = uncompiled
            return True
        return False

    def _without(self, args: list) -> list:
        """A backward called without some output gradients (autograd did not make zeros for the
        outputs nobody differentiated, e.g. the logits beside the loss): runs a variant program
        in which they are zeros, folded away where they are only added."""
        missing = tuple(i for i in self._tangents if args[i] is None)
        variant = self.variants.get(missing)
        if variant is None:
            with config.lazy_graph_modules():
                variant = lower(missing_gradients(self.graph_module, missing))
            variant.program.set_plain_outputs(0)
            variant.unreached = _unreached_outputs(self.graph_module, [i for i in self._tangents if i not in missing])
            self.variants[missing] = variant
        gone = set(missing)
        rest = [a for i, a in enumerate(args) if i not in gone]
        if isinstance(args, list):
            args.clear()
        outs = variant(rest)
        for i in variant.unreached:  # no gradient in eager: None, not zeros (an optimizer's weight decay skips it)
            outs[i] = None
        return outs

    def __str__(self) -> str:
        return str(self.program)

    def program_outputs_before(self, k: int) -> int:
        """How many of the FX graph's first k outputs are program outputs (not constants)."""
        return sum(1 for t in self._template[:k] if t is None)

    def extern_counts(self) -> dict[str, int]:
        """ATen calls per op name (nodes that run outside fused kernels and are not views made
        without the dispatcher; see view_counts)."""
        return self._counts("aten")

    def view_counts(self) -> dict[str, int]:
        """Views per op name that make no ATen call: folded into the kernels reading them, or made
        by torch's _reinterpret_tensor (checked against ATen's view on their first run)."""
        folded, made, held = self._counts("folded"), self._counts("view"), self._counts("alias")
        return {op: folded.get(op, 0) + made.get(op, 0) + held.get(op, 0) for op in set(folded) | set(made) | set(held)}

    def _counts(self, how: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (op, _kind, _group), step in zip(self.program.node_groups(), self.program.node_steps()):
            if step == how:
                counts[op] = counts.get(op, 0) + 1
        return counts


class GraphBuild:
    """An FX graph handed to the C core: the graph, and how its values map back to FX."""

    def __init__(self) -> None:
        self.graph = _C.Graph()
        self.constants: list[torch.Tensor] = []  # get_attr tensors, inputs after the placeholders
        self.out_template: list = []             # per FX output: None (a graph output) or (constant,)
        self.value_nodes: list = []              # value id -> the FX node holding it (None: unread output)
        self.ir_nodes: list[fx.Node] = []        # IR node index -> FX node
        self.input_nodes: list[fx.Node] = []     # graph input index -> placeholder or get_attr node
        self.derived: dict[int, tuple] = {}      # value id no FX node holds -> (FX node, shape): that node's value reshaped

    def _values(self, ids: list[int], node: fx.Node | None) -> None:
        for vid in ids:
            while len(self.value_nodes) <= vid:
                self.value_nodes.append(None)
            self.value_nodes[vid] = node


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
_CONVERTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _contiguous_val(n: Any) -> Any:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.is_contiguous() else None


def _plain_conversion(n: Any) -> bool:
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CONVERTS and isinstance(n.args[0], fx.Node)):
        return False
    if n.target is torch.ops.aten._to_copy.default:  # a dtype change only
        src = n.args[0].meta.get("val")
        kw = n.kwargs
        return (len(n.args) == 1 and "dtype" in kw and set(kw) <= {"dtype", "layout", "device"}
                and kw.get("layout", torch.strided) == torch.strided and isinstance(src, torch.Tensor)
                and kw.get("device", src.device) == src.device)
    return True


def _swappable_reshapes(gm: fx.GraphModule) -> tuple[dict, dict]:
    """Reshapes to swap with a dtype conversion beside them, so the conversion joins the kernel on the
    other side (a view between two fused ops would split them; a reshape of a materialized tensor
    folds into the kernels reading it). All three tensors contiguous, the first node's only user the
    second:
      sink  {conversion: reshape}: `reshape(convert(x))` is emitted as `convert(reshape(x))` (Hugging
            Face's causal LM loss: `logits.float().view(-1, vocab)`);
      hoist {reshape: conversion}: `convert(reshape(y))` is emitted as `reshape(convert(y))` (that
            loss's gradient, converted back to the logits' dtype)."""
    sink, hoist, paired = {}, {}, set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        first = node.args[0]
        if first in paired or first.args and first.args[0] in paired:
            continue  # pairs are disjoint and read no swapped node (reshape, convert, reshape: one swap)
        if node.target in _RESHAPES and _plain_conversion(first) and len(first.users) == 1:
            pair, into = (first, node), sink
        elif _plain_conversion(node) and first.op == "call_function" and first.target in _RESHAPES \
                and len(first.users) == 1 and isinstance(first.args[0], fx.Node):
            pair, into = (first, node), hoist
        else:
            continue
        x, a, b = _contiguous_val(pair[0].args[0]), _contiguous_val(pair[0]), _contiguous_val(pair[1])
        if x is None or a is None or b is None or x.device != a.device or \
                not (x.shape == a.shape if into is sink else a.shape == b.shape):
            continue
        # only where it stores fewer bytes: a source that a kernel computes is stored in the narrower
        # of the two dtypes; one that exists anyway (an input, an extern's result) is read through the
        # reshape by the kernel that converts it
        src = pair[0].args[0]
        computed = src.op == "call_function" and isinstance(src.target, torch._ops.OpOverload) and \
            _C.op_kind(_op_name(src.target)) in ("pointwise", "reduction", "random")
        widens = (b if into is sink else a).dtype.itemsize > x.dtype.itemsize
        if (not computed or widens) if into is sink else (computed and not widens):
            into[pair[0]] = pair[1]
            paired.update(pair)
    return sink, hoist


_REDUCTIONS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim, torch.ops.aten.amax.default,
               torch.ops.aten.amin.default)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool)  # what fused kernels read (fuse.c)


def _call(node: fx.Node, env: dict, where: str, dev: tuple | None, first: tuple | None = None) -> tuple[str, list, list]:
    """The op name and encoded arguments of a call_function node (`first`: its first argument,
    encoded, in place of the node's own). A prims.convert_element_type that no kernel takes (from an
    integer or float64 tensor: the targets of a loss) becomes the same conversion as
    aten._to_copy(x, dtype=...): the prim is implemented in Python, 50 us a call on the CPU where
    ATen's takes 9."""
    args = [first if first is not None and i == 0 else _encode(a, env, where, dev) for i, a in enumerate(node.args)]
    if node.target is torch.ops.aten.as_strided.default and len(args) == 3 and "storage_offset" in node.kwargs:
        # positional: an as_strided whose offset comes by name is the sink's, relative to its base
        # as traced (runtime.c, relative_view); the graph's own keep ATen's meaning
        offset = node.kwargs["storage_offset"]
        args.append(_encode(0 if offset is None else offset, env, where, dev))
        return _op_name(node.target), args, [(k, _encode(v, env, where, dev)) for k, v in node.kwargs.items()
                                             if k != "storage_offset"]
    if node.target is torch.ops.prims.convert_element_type.default and len(args) == 2 and not node.kwargs:
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if isinstance(src, torch.Tensor) and src.dtype not in _KERNEL_DTYPES:
            return "aten::_to_copy.default", args[:1], [("dtype", args[1])]
    return _op_name(node.target), args, [(k, _encode(v, env, where, dev)) for k, v in node.kwargs.items()]


def _reduced_dims_through(xshape: tuple, vshape: tuple, vdims: set) -> list[int] | None:
    """The dims of x to reduce for the same reduction as reducing dims `vdims` of v = x.reshape(vshape),
    or None when a dim of x is split between reduced and kept dims of v. A reshape keeps the row-major
    element order, so each dim covers the stride range [stride, stride * size) of the flat index;
    a dim of x is reduced when the dims of v it overlaps are all reduced."""
    def ranges(shape: tuple) -> list[tuple[int, int]]:
        out, stride = [], 1
        for size in reversed(shape):
            out.append((stride, stride * size))
            stride *= size
        return out[::-1]

    if 0 in xshape or 0 in vshape:  # no elements: the stride ranges collapse and tell nothing
        return None
    xr, vr = ranges(xshape), ranges(vshape)
    dims = []
    for d, (lo, hi) in enumerate(xr):
        if hi == lo:
            continue  # a dim of size 1: kept, the final reshape drops it
        over = {e for e, (a, b) in enumerate(vr) if b > a and max(lo, a) < min(hi, b)}
        if over <= vdims:
            dims.append(d)
        elif over & vdims:
            return None
    return dims


# Up to how many elements a reduction joins the kernel computing the reshaped value it reduces on
# CUDA. On the CPU a joined bias gradient (leading dims reduced) runs as the column kernel, one step
# fewer and no slower per element than a pointwise kernel beside ATen's sum (1 thread, mul * mul + sum:
# 10.8 against 11.0 us at [4, 8, 64], 0.68 against 0.81 ms at [4, 512, 768], 3.3 against 3.6 ms at
# [4, 512, 3072]); CUDA's two-pass column kernels have not been timed against ATen's sum, so there
# only values small enough for the step's host time to dominate join.
_JOIN_REDUCTION_MAX_NUMEL = 1 << 16


def _mergeable_kept_dims(node: fx.Node, kept: list[int]) -> bool:
    """Do the kept dims of node's value merge into one for every tensor it reads (strides nesting,
    broadcast dims 0 throughout)? Else its kernel would reduce through strided columns."""
    shape = tuple(node.meta["val"].shape)
    for a in node.all_input_nodes:
        t = a.meta.get("val")
        if not isinstance(t, torch.Tensor):
            continue
        shift = len(shape) - t.dim()
        strides = [0 if d < shift or t.shape[d - shift] == 1 else t.stride(d - shift) for d in range(len(shape))]
        for d, e in zip(kept, kept[1:]):
            if shape[d] == 1 or shape[e] == 1:
                continue
            if strides[d] != strides[e] * shape[e]:
                return False
    return True


def _reductions_through_reshapes(gm: fx.GraphModule, device_type: str | None = None) -> dict:
    """Reductions of a reshaped value that a kernel computes, {source: [(reduction, source dims)]}:
    `sum(x.view(n, c), [0])` is emitted right after x as `sum(x, dims of x)`, reshaped to the
    reduction's shape where the reduction was. The reduction then joins the kernel computing x (a
    bias gradient summed in the kernel that makes the gradient) instead of running alone after the
    view: one step fewer, and x is not read again. Only where x's kept dims stay one run of columns
    for what x reads (_mergeable_kept_dims), and on CUDA (`device_type`, else x's device) only small
    values (_JOIN_REDUCTION_MAX_NUMEL)."""
    early: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _REDUCTIONS or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0]
        while src.op == "call_function" and src.target in _RESHAPES and isinstance(src.args[0], fx.Node):
            src = src.args[0]
        if src is node.args[0] or src.op != "call_function" or not isinstance(src.target, torch._ops.OpOverload) \
                or _C.op_kind(_op_name(src.target)) not in ("pointwise", "random"):
            continue
        x, v, r = src.meta.get("val"), node.args[0].meta.get("val"), node.meta.get("val")
        if not all(isinstance(t, torch.Tensor) for t in (x, v, r)) or x.device != v.device:
            continue
        args = dict(zip(("dims", "keepdim"), node.args[1:]), **node.kwargs)
        dims = args.get("dims", args.get("dim"))
        if not isinstance(dims, (list, tuple)) or not dims or set(args) - {"dims", "dim", "keepdim", "dtype"}:
            continue
        vdims = {d % v.dim() for d in dims}
        xdims = _reduced_dims_through(tuple(x.shape), tuple(v.shape), vdims)
        if xdims and ((device_type or x.device.type) == "cpu" or x.numel() <= _JOIN_REDUCTION_MAX_NUMEL) and \
                _mergeable_kept_dims(src, [d for d in range(x.dim()) if d not in xdims]):
            early.setdefault(src, []).append((node, xdims))
    return early


_EMPTIES = (torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
            torch.ops.aten.empty_strided.default, torch.ops.aten.empty.memory_format)


def _replacements(gm: fx.GraphModule) -> tuple[dict, set]:
    """Nodes emitted as another, cheaper call of the same value, {node: (op name, args, kwargs)}, and
    the nodes nobody reads then (not emitted at all). The calls:
      - `aten.copy(a, b)` (what functionalization makes of `a.copy_(b)` and slice assignments) where b
        has a's shape: a copy of b alone into a's layout (`clone(b)`, or `_to_copy` to a's dtype), a
        pointwise op that fuses with b's kernel; ATen's copy reads a too, and runs alone;
      - `aten.cat` of tensors some of which are empty (a Hugging Face cache's first update,
        `cat([empty, key])`): the cat of the others, or a copy of the only one;
      - `aten.split` into equal chunks: one slice view per chunk, which the kernels reading them
        fold (ATen's split is one call making every chunk);
      - a fill of a fresh contiguous tensor (`zeros_like`, `ones_like`, `full_like`, `new_zeros`,
        `new_ones`, `new_full`) is `aten.full(shape, value)`, a pointwise member that reads no
        tensor (the tensor the `_like` copies its shape from is not read, so it may go unmade);
      - `aten.select_scatter(base, x, dim, i)` is `slice_scatter(base, unsqueeze(x, dim), dim, i, i + 1)`
        and `aten.select_backward(g, sizes, dim, i)` is `constant_pad_nd(unsqueeze(g, dim), ...)`:
        windows too (the unsqueeze is a view the kernel folds);
      - a nest of slice/select scatters that write into the region of their base they are scattered
        back to (nested slice assignments), or a scatter of a copy or a fill, is one
        `aotfuse::box_scatter` / `aotfuse::box_fill` window (scatter.box_of), for float tensors on a
        device with generated kernels (the window is a kernel member there);
      - `aten.slice_backward` (step 1: the gradient of a slice, zeros around it) is the same
        `aten.constant_pad_nd`, a window member of the kernels (fuse.h); a pad of a pad that only
        pads (never crops) with the same fill value is one pad of the inner one's source (Longformer's
        chained slices), so the inner one is not made.
    Unread: side-effect-free nodes whose every reader is replaced by a call that does not read them
    (the uninitialized `new_empty_strided` a copy fills, the slice assigned to, a cache's empty
    constant), and nodes only they read, in turn."""
    replace: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target in (torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default) \
                and isinstance(val, torch.Tensor) and val.dtype.is_floating_point and config.kernels_for(val.device):
            box = box_of(node)  # a kernel member, never an ATen call (its own implementation is Python's)
            if box is not None:
                replace[node] = ("box", list(box), {})
                continue
        if node.target is torch.ops.aten.copy.default and len(node.args) == 2 and not set(node.kwargs) - {"non_blocking"} \
                and all(isinstance(a, fx.Node) for a in node.args) and node.args[0] is not node.args[1]:
            a, b = (x.meta.get("val") for x in node.args)
            if all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in (a, b, val)) \
                    and a.shape == b.shape and a.device == b.device:
                replace[node] = _copy_of(node.args[1], val)
        elif node.target is torch.ops.aten.cat.default and isinstance(val, torch.Tensor) and not node.kwargs:
            parts = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else 0
            if not all(isinstance(p, fx.Node) and isinstance(p.meta.get("val"), torch.Tensor) for p in parts):
                continue
            kept = [p for p in parts if p.meta["val"].numel() > 0]
            if len(kept) == len(parts) or not kept:
                continue
            if len(kept) == 1 and tuple(kept[0].meta["val"].shape) == tuple(val.shape):
                replace[node] = _copy_of(kept[0], val)
            elif len(kept) > 1 and all(p.meta["val"].dtype == val.dtype for p in kept):
                replace[node] = ("aten::cat.default", [kept, dim], {})
        elif node.target is torch.ops.aten.split.Tensor and isinstance(val, (list, tuple)) and not node.kwargs \
                and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], int):
            x = node.args[0].meta.get("val")
            dim = node.args[2] if len(node.args) > 2 else 0
            if isinstance(x, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in val):
                dim %= max(x.dim(), 1)
                starts = [i * node.args[1] for i in range(len(val))]
                replace[node] = ("split", [(node.args[0], dim, st, st + t.shape[dim]) for st, t in zip(starts, val)], {})
        elif node.target in _FILLS and isinstance(val, torch.Tensor) and val.layout == torch.strided \
                and val.is_contiguous() and (val.dtype.is_floating_point or val.dtype == torch.bool):
            value = _fill_value(node)
            if value is not None:
                replace[node] = ("aten::full.default", [list(val.shape), value],
                                 {"dtype": val.dtype, "layout": torch.strided, "device": val.device, "pin_memory": False})
        elif node.target in (torch.ops.aten.select_scatter.default, torch.ops.aten.select_backward.default) \
                and len(node.args) == 4 and not node.kwargs and isinstance(val, torch.Tensor):
            scatter = node.target is torch.ops.aten.select_scatter.default
            src = node.args[1] if scatter else node.args[0]
            x = src.meta.get("val") if isinstance(src, fx.Node) else None
            dim, index = node.args[2], node.args[3]
            if isinstance(x, torch.Tensor) and isinstance(dim, int) and isinstance(index, int) and x.layout == torch.strided \
                    and x.dtype == val.dtype and x.dtype.is_floating_point and x.dim() + 1 == val.dim() and x.device == val.device:
                dim %= val.dim()
                index = index + val.shape[dim] if index < 0 else index
                if 0 <= index < val.shape[dim]:
                    replace[node] = ("select_window", [node.args[0] if scatter else None, src, dim, index], {})
        elif node.target in (torch.ops.aten.slice_backward.default, torch.ops.aten.constant_pad_nd.default):
            pad = _pad_of(node)
            if pad is None:
                continue
            src, lr, value = pad
            composed = False
            inner = _pad_of(src)
            while inner is not None and (inner[2], math.copysign(1.0, inner[2])) == (value, math.copysign(1.0, value)) \
                    and all(a >= 0 and b >= 0 for a, b in inner[1]):
                src, lr = inner[0], [(a + c, b + d) for (a, b), (c, d) in zip(lr, inner[1])]
                composed = True
                inner = _pad_of(src)
            if composed or node.target is torch.ops.aten.slice_backward.default:
                flat = [x for a, b in reversed(lr) for x in (a, b)]
                replace[node] = ("aten::constant_pad_nd.default", [src, flat, value], {})
    readers: dict = {n: 0 for n in gm.graph.nodes}

    def reads(node: fx.Node) -> list:
        if node in replace:
            _op, args, kwargs = replace[node]
            found: list = []
            fx.node.map_arg((args, kwargs), found.append)
            return found
        return list(node.all_input_nodes)

    for node in gm.graph.nodes:
        for src in set(reads(node)):
            readers[src] += 1
    unread: set = set()
    for node in reversed(gm.graph.nodes):
        if readers[node] == 0 and node.users and _pure(node):
            unread.add(node)
            for src in set(reads(node)):
                readers[src] -= 1
    return replace, unread


_FILLS = {torch.ops.aten.zeros_like.default: 0, torch.ops.aten.ones_like.default: 1, torch.ops.aten.full_like.default: None,
          torch.ops.aten.new_zeros.default: 0, torch.ops.aten.new_ones.default: 1, torch.ops.aten.new_full.default: None}


def _fill_value(node: fx.Node) -> float | int | bool | None:
    """The value a fill node writes everywhere, or None when it is not a plain number."""
    value = _FILLS[node.target]
    if value is None:  # full_like(x, value, ...), new_full(x, size, value, ...)
        at = 1 if node.target is torch.ops.aten.full_like.default else 2
        value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
    if not isinstance(value, (int, float, bool)):
        return None
    return value


def _pad_of(node: Any) -> tuple | None:
    """(source, [(left, right) per dim], fill value) when node is a padding of one strided float
    tensor of the same dtype and rank: `constant_pad_nd`, or `slice_backward` with step 1 (zeros
    around the gradient). Negative pads crop."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.kwargs or not node.args:
        return None
    src, val = node.args[0], node.meta.get("val")
    x = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not (isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor) and x.layout == val.layout == torch.strided
            and x.dtype == val.dtype and x.dtype.is_floating_point and x.dim() == val.dim() and x.device == val.device):
        return None
    lr = [(0, 0)] * x.dim()
    if node.target is torch.ops.aten.slice_backward.default and len(node.args) == 6:
        _g, sizes, dim, start, _end, step = node.args
        if step != 1 or not isinstance(dim, int) or not isinstance(start, int) or list(sizes) != list(val.shape):
            return None
        dim %= x.dim()
        n = val.shape[dim]
        start = min(max(start + n if start < 0 else start, 0), n)
        right = n - start - x.shape[dim]
        if right < 0:
            return None
        lr[dim] = (start, right)
        value = 0.0
    elif node.target is torch.ops.aten.constant_pad_nd.default and len(node.args) in (2, 3):
        pad = node.args[1]
        value = node.args[2] if len(node.args) == 3 else 0.0
        if not isinstance(value, (int, float)) or isinstance(value, bool) or len(pad) % 2 or len(pad) > 2 * x.dim() \
                or not all(isinstance(p, int) for p in pad):
            return None
        for j in range(len(pad) // 2):
            lr[x.dim() - 1 - j] = (pad[2 * j], pad[2 * j + 1])
        value = float(value)
    else:
        return None
    if any(x.shape[d] + a + b != val.shape[d] for d, (a, b) in enumerate(lr)):
        return None
    return src, lr, value


def _copy_of(src: fx.Node, val: torch.Tensor) -> tuple:
    """A copy of src's value in val's dtype (its layout is val's: the node's meta)."""
    if src.meta["val"].dtype == val.dtype:
        return "aten::clone.default", [src], {}
    return "aten::_to_copy.default", [src], {"dtype": val.dtype}


_PURE_EXTERNS = _EMPTIES + (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.new_zeros.default,
                             torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default, torch.ops.aten.zeros.default,
                             torch.ops.aten.ones.default, torch.ops.aten.full.default, torch.ops.aten.slice_backward.default,
                             torch.ops.aten.full_like.default, torch.ops.aten.select_backward.default,
                             torch.ops.aten.select_scatter.default, torch.ops.aten.slice_scatter.default,
                             torch.ops.aten.copy.default, torch.ops.aten.fill.Scalar, torch.ops.aten.fill.Tensor)


def _pure(node: fx.Node) -> bool:
    """No effect but its value: a view, an uninitialized or copied constant, or a pointwise or
    reduction op (not random: its numbers are drawn, and not an assert)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target in _PURE_EXTERNS or _C.op_kind(_op_name(node.target)) in ("view", "pointwise", "reduction")


def _unsqueezed(b: GraphBuild, src: fx.Node, dims: list[int], node: fx.Node, vid: int, dev: tuple | None) -> int:
    """Value vid (src's) with a size-1 dim inserted at each of dims (ascending): unsqueeze views,
    which the kernels reading them fold; each maps back to `node`."""
    x = src.meta["val"]
    sizes, strides = list(x.shape), list(x.stride())
    for d in dims:
        strides.insert(d, strides[d] * sizes[d] if d < len(sizes) else 1)
        sizes.insert(d, 1)
        meta = _meta(x, dev)[:4] + (tuple(sizes), tuple(strides), int(x.storage_offset()))
        (vid,) = b.graph.add_node("aten::unsqueeze.default", [("v", vid), ("int", d)], [], [meta])
        b._values([vid], None)
        b.derived[vid] = (src, tuple(sizes))
        b.ir_nodes.append(node)
    return vid


_aten = torch.ops.aten
# ATen's CPU norms, given a float16/bfloat16 input and a float32 weight or bias (what autocast
# makes), keep their saved mean and rstd in float32, while torch's meta functions, which the traced
# metadata comes from, say the input's dtype. Per op: (weight and bias argument positions, the
# statistics' output positions) of a forward; (input, weight, bias, statistics argument positions)
# of a backward reading them.
_MIXED_NORM_FORWARDS = {
    _aten.native_layer_norm.default: ((2, 3), (1, 2)),
    _aten.native_group_norm.default: ((1, 2), (1, 2)),
    _aten.native_batch_norm.default: ((1, 2), (1, 2)),
    _aten._native_batch_norm_legit_functional.default: ((1, 2), (1, 2)),
    _aten._native_batch_norm_legit.default: ((1, 2), (1, 2)),
    _aten._native_batch_norm_legit.no_stats: ((1, 2), (1, 2)),
}
_MIXED_NORM_BACKWARDS = {
    _aten.native_layer_norm_backward.default: (1, (5, 6), (3, 4)),
    _aten.native_group_norm_backward.default: (1, (4,), (2, 3)),
    _aten.native_batch_norm_backward.default: (1, (2,), (5, 6)),
}


def _mixed_norm(x: Any, params: Sequence[Any]) -> bool:
    """Whether a CPU norm of input x with these weight/bias arguments runs in ATen's mixed-type mode."""
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) and \
        any(isinstance(w, torch.Tensor) and w.dtype != x.dtype for w in params)


# A fix of _real_dtypes: the output is None at run time.
_NONE = "none"


def _real_dtypes(gm: fx.GraphModule, cpu: bool = True) -> dict:
    """{node: {output index (a placeholder: 0): dtype, or _NONE}} where a value at run time is not
    what was traced. On any device: `native_batch_norm_backward`'s outputs that its output_mask turns
    off are None (ATen's kernels), where the meta function gives a tensor (a frozen convolution's
    batch norm needs no input gradient). On the CPU (cpu=False: a graph lowered for another device
    than it was traced on): the float32 statistics of mixed-type norms (_MIXED_NORM_FORWARDS), in the
    forward that computes them and, as placeholders, in the backward that reads them; and the new
    running statistics of a batch norm in float16/bfloat16 (`_native_batch_norm_legit_functional`'s
    outputs 3 and 4), which ATen keeps in the running statistics' dtype where the meta function says
    float32."""
    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else None

    fixes: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _aten.native_batch_norm_backward.default:
            mask = node.args[9] if len(node.args) > 9 else node.kwargs.get("output_mask")
            if isinstance(mask, (list, tuple)) and isinstance(node.meta.get("val"), (list, tuple)):
                off = {k: _NONE for k, m in enumerate(mask) if not m and node.meta["val"][k] is not None}
                if off:
                    fixes.setdefault(node, {}).update(off)
        if not cpu:
            continue
        if node.target in _MIXED_NORM_FORWARDS:
            params, stats = _MIXED_NORM_FORWARDS[node.target]
            outs, x = node.meta.get("val"), val(node.args[0])
            if _mixed_norm(x, [val(node.args[i]) for i in params if i < len(node.args)]) and isinstance(outs, (list, tuple)):
                fixes.setdefault(node, {}).update(
                    {k: torch.float32 for k in stats if k < len(outs) and outs[k].dtype != torch.float32})
            if node.target is _aten._native_batch_norm_legit_functional.default and isinstance(x, torch.Tensor) and \
                    x.device.type == "cpu" and isinstance(outs, (list, tuple)) and len(outs) == 5:
                for k in (3, 4):  # new running mean and variance: the dtype of the running ones (args 3, 4)
                    running = val(node.args[k]) if k < len(node.args) else None
                    if isinstance(running, torch.Tensor) and isinstance(outs[k], torch.Tensor) and \
                            outs[k].dtype != running.dtype:
                        fixes.setdefault(node, {})[k] = running.dtype
        elif node.target in _MIXED_NORM_BACKWARDS:
            x, params, stats = _MIXED_NORM_BACKWARDS[node.target]
            if _mixed_norm(val(node.args[x]), [val(node.args[i]) for i in params if i < len(node.args)]):
                for i in stats:
                    a = node.args[i] if i < len(node.args) else None
                    if isinstance(a, fx.Node) and a.op == "placeholder" and isinstance(val(a), torch.Tensor) and \
                            val(a).dtype != torch.float32:
                        fixes[a] = {0: torch.float32}
    return {n: f for n, f in fixes.items() if f}


def _retyped(val: Any, dtype: Any = None, strides: tuple | None = None) -> Any:
    """A traced value like val (a fake tensor: same sizes and device) in another dtype and/or with
    other strides (each kept where not given), or None for _NONE."""
    if dtype == _NONE:
        return None
    if not isinstance(val, torch.Tensor) or ((dtype is None or val.dtype == dtype) and strides is None):
        return val
    dtype, strides = dtype or val.dtype, val.stride() if strides is None else strides
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty_strided(val.shape, strides, dtype=dtype, device="meta")
    with mode:
        return torch.empty_strided(val.shape, strides, dtype=dtype, device=val.device)


def _real_layouts(gm: fx.GraphModule) -> dict:
    """{node: {output index: strides}} where a CPU value's strides at run time are not the traced
    ones: `native_batch_norm_backward`'s input gradient, which ATen's CPU kernel makes in its input's
    memory format, where the meta function follows the output gradient's (a channels-last batch norm
    after a convolution, read back by a contiguous gradient: the kernel reading it met other strides
    than its plan's and ran its nodes as ATen calls at every step)."""
    from torch._prims_common import suggest_memory_format

    fixes: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _aten.native_batch_norm_backward.default:
            continue
        vals, x = node.meta.get("val"), node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        if not (isinstance(vals, (list, tuple)) and vals and isinstance(vals[0], torch.Tensor)
                and isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() in (4, 5)):
            continue
        want = torch.empty(x.shape, dtype=x.dtype, device="meta", memory_format=suggest_memory_format(x)).stride()
        if tuple(vals[0].shape) == tuple(x.shape) and tuple(vals[0].stride()) != tuple(want):
            fixes[node] = {0: want}
    return fixes


def set_real_dtypes(gm: fx.GraphModule) -> None:
    """Writes the run-time dtype of the values _real_dtypes finds into gm's traced metadata, in
    place: the node's own value and the getitem nodes reading it. Run on a joint graph before it is
    cut, so that the forward and backward graphs cut from it agree with what runs: a saved value's
    backward placeholder copies its node's metadata (a bf16 batch norm's new running mean, saved
    for the backward's `native_batch_norm_backward`, is bf16 at run time, float32 in the trace; the
    backward program refused it); and the run-time strides of the values _real_layouts finds."""
    for node, fixes in _real_dtypes(gm).items():
        val = node.meta.get("val")
        if node.op == "placeholder":
            node.meta["val"] = _retyped(val, fixes[0])
            continue
        if not isinstance(val, (list, tuple)):
            continue
        _set_outputs(node, [_retyped(v, fixes[k]) if k in fixes else v for k, v in enumerate(val)], fixes)
    for node, fixes in _real_layouts(gm).items():  # and their strides
        _set_outputs(node, [_retyped(v, strides=fixes[k]) if k in fixes else v
                            for k, v in enumerate(node.meta["val"])], fixes)


def _set_outputs(node: fx.Node, vals: list, fixed: dict) -> None:
    """A multi-output node's traced values, and those of the getitem nodes reading the fixed ones."""
    node.meta["val"] = type(node.meta["val"])(vals)
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] in fixed:
            user.meta["val"] = vals[user.args[1]]


def _with_dtype(meta: tuple, dtype: Any) -> tuple:
    if dtype == _NONE:
        return ("other",)
    return meta if dtype is None or meta[0] != "tensor" else (meta[0], _DTYPE_NAMES[dtype]) + meta[2:]


def separate_aliased_gradients(gm: fx.GraphModule) -> int:
    """A backward graph's outputs (gradients) that are views of one value: at batch size 1 ViT's
    position-embedding gradient G and its class token's, a slice of G (no sum over the batch
    separates them). Autograd keeps each as its parameter's .grad, so an in-place change of one
    (a second backward accumulating, clip_grad_norm_) changed the other; eager's are separate
    tensors. Every output whose elements overlap an earlier one's over the same value becomes a copy
    (slices of one flat buffer side by side, DDP's bucket views, stay views). Returns how many."""
    (outs,) = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args
    if not isinstance(outs, (list, tuple)):
        return 0

    def base(n: Any) -> Any:
        while isinstance(n, fx.Node) and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target.is_view and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        return n

    def span(v: torch.Tensor) -> tuple[int, int]:  # the storage elements v's view may touch
        off = v.storage_offset()
        return off, off + 1 + sum((n - 1) * abs(st) for n, st in zip(v.shape, v.stride()))

    kept: dict = {}  # base -> the spans of the outputs over it, as they are
    new, copied = list(outs), 0
    for i, o in enumerate(outs):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.numel() == 0:
            continue
        lo, hi = span(v)
        if not isinstance(lo, int) or not isinstance(hi, int):  # symbolic sizes: taken as the whole value
            lo, hi = 0, None
        spans = kept.setdefault(base(o), [])
        if not any(hi is None or h is None or (lo < h and l < hi) for l, h in spans):
            spans.append((lo, hi))
            continue
        with gm.graph.inserting_after(o):
            c = gm.graph.call_function(torch.ops.aten.clone.default, (o,))
        c.meta = dict(o.meta)
        new[i] = c
        copied += 1
    if copied:
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        out.args = (type(outs)(new),)
        gm.recompile()
    return copied


_LAZY_VIEWS = {torch.ops.aten._neg_view.default: torch.ops.aten.neg.default,
               torch.ops.aten._conj.default: torch.ops.aten.conj_physical.default}


def resolve_lazy_views(gm: fx.GraphModule) -> None:
    """`_neg_view` and `_conj` (what `z.conj().imag` traces to) are views whose values are the
    negation or conjugate of their data (a bit torch keeps on the tensor): kernels and reinterpreted
    views read data, so these become the copies `neg` and `conj_physical`, the same values. The
    graphs are functional: no node depends on them aliasing their input. An input with such a bit
    (the signature holds it) is read through `resolve_conj`/`resolve_neg`, ATen calls making its
    values plain; the input itself stays the caller's (a mutation of it is copied back into it)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _LAZY_VIEWS and n.args and isinstance(n.args[0], fx.Node):
            n.target = _LAZY_VIEWS[n.target]
            changed = True
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in places:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not (val.is_neg() or val.is_conj()):
            continue
        readers = [r for r in n.users if r.op != "output"]  # an output (saved for backward) stays the input
        if not readers:
            continue
        src = n
        with gm.graph.inserting_after(places[-1]):
            for op, flagged in ((torch.ops.aten.resolve_conj.default, val.is_conj()),
                                (torch.ops.aten.resolve_neg.default, val.is_neg())):
                if flagged:
                    src = gm.graph.call_function(op, (src,))
                    val = op(val)
                    src.meta["val"] = val
        for r in readers:
            r.replace_input_with(n, src)
        changed = True
    if changed:
        gm.recompile()


def detaches_as_aliases(gm: fx.GraphModule) -> int:
    """`aten.detach` nodes that are no graph output become `aten.alias` (the same storage, shape and
    strides: the C core's identity view, which a pointwise chain reads through). Done on traced
    graphs, never by the decomposition table: decomposed while AOTAutograd collects its metadata, a
    detach traced as a differentiable view. A detach the graph returns stays one (ATen's, at run
    time): an alias output is a view, which autograd.Function keeps differentiable, and a detached
    output beside a view of the same value came back with requires_grad=True (both found by a random
    aliasing sweep). Returns how many it rewrote."""
    done = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default \
                and all(u.op != "output" for u in node.users):
            node.target = torch.ops.aten.alias.default
            done += 1
    if done:
        gm.recompile()
    return done


def unwrap_effects(gm: fx.GraphModule) -> int:
    """AOTAutograd threads an effect token through ops that only check or report (linalg's
    `_linalg_check_errors`, which raises for a singular matrix): `with_effects(token, op, *args)`
    returns (new token, op's result). Where op returns nothing, the call becomes op(*args) itself (a
    step the program keeps, in order, as it keeps `_assert_async`) and the token goes through unchanged.
    Returns how many calls it unwrapped."""
    hop = getattr(torch.ops.higher_order, "with_effects", None)
    if hop is None:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not hop or len(node.args) < 2:
            continue
        token, op, *args = node.args
        if not isinstance(op, torch._ops.OpOverload) or op._schema.returns:
            continue  # an op with results: left as it is (the C core refuses it, naming it)
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
            continue
        with gm.graph.inserting_before(node):
            gm.graph.call_function(op, tuple(args), dict(node.kwargs))
        if isinstance(token, fx.Node) and token.op == "placeholder":
            token.meta["val"] = None  # AOTAutograd's runtime passes None for a token input
        for user in list(node.users):
            user.replace_all_uses_with(token)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done


def build_graph(gm: fx.GraphModule, device: str | None = None, exact: bool = False) -> GraphBuild:
    """One walk over an ATen-level FX graph (as AOTAutograd produces) into the C IR. Each node becomes
    one IR node, except (unless exact=True, which the partitioner needs to map its node order back
    onto the FX graph): identity views (`aten.alias`, what a detach decomposes to) that are no graph
    output make no value, their users read their input; and a contiguous reshape beside a dtype
    conversion is swapped with it (_swappable_reshapes).

    `device` ("cuda:0", say) relabels every tensor and device argument, which lets a graph traced
    on the CPU be planned and code-generated for CUDA on a machine without a GPU (for checks; such
    a graph is never run)."""
    dev = None
    if device is not None:
        d = torch.device(device)
        dev = (d.type, 0 if d.index is None and d.type == "cuda" else (-1 if d.index is None else d.index))
    b = GraphBuild()
    g = b.graph
    env: dict[fx.Node, Any] = {}
    out_ids: list[int] = []
    sink, hoist = ({}, {}) if exact else _swappable_reshapes(gm)
    early = {} if exact else _reductions_through_reshapes(gm, dev[0] if dev else None)
    reduced_early: dict[fx.Node, int] = {}  # reduction -> the value of its early form
    replace, unread = ({}, set()) if exact else _replacements(gm)
    real = _real_dtypes(gm, cpu=dev is None or dev[0] == "cpu")
    for node in gm.graph.nodes:
        where = f"node {node.name} ({node.target})"
        if node.op == "placeholder":
            if b.constants:
                raise UnsupportedError(f"{where}: a placeholder after a constant")
            env[node] = g.add_input(node.name, _with_dtype(_meta(node.meta.get("val"), dev), real.get(node, {}).get(0)))
            b._values([env[node]], node)
            b.input_nodes.append(node)
        elif node.op == "get_attr":
            # a tensor constant: an extra input after the placeholders, bound by Lowered
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedError(f"get_attr {node.target} is a {type(value).__name__}, not a tensor")
            env[node] = g.add_input(node.name, _meta(value, dev))
            b._values([env[node]], node)
            b.input_nodes.append(node)
            b.constants.append(value)
        elif node.op == "call_function":
            if node.target is operator.getitem:
                src, idx = node.args
                ids = env.get(src)
                if not isinstance(ids, list):
                    raise UnsupportedError(f"{where}: getitem on a single value")
                env[node] = ids[idx]
                b._values([ids[idx]], node)
                continue
            if node in sink or node in hoist:
                continue  # emitted with the node after it, swapped
            first = node.args[0] if node.args else None
            if first in sink or first in hoist:
                # sink: `first` is the conversion, emitted after the reshape (`node`) of its source;
                # hoist: `first` is the reshape, emitted after the conversion (`node`) of its source
                inner, src, val = node, first.args[0], node.meta["val"]
                src_meta = _meta(src.meta["val"], dev)
                mid_meta = (src_meta[:4] + (tuple(val.shape), val.stride(), src_meta[6]) if first in sink
                            else _meta(val, dev)[:4] + src_meta[4:])
                (mid,) = g.add_node(*_call(inner, env, where, dev, _encode(src, env, where, dev)), [mid_meta])
                (out,) = g.add_node(*_call(first, env, where, dev, ("v", mid)), [_meta(val, dev)])
                b._values([mid], None)
                b.derived[mid] = (src, tuple(val.shape)) if first in sink else (node, tuple(src.meta["val"].shape))
                b._values([out], node)
                b.ir_nodes += [inner, first]
                env[node] = out
                continue
            if not exact and node.target is torch.ops.aten.alias.default and isinstance(env.get(node.args[0]), int) \
                    and all(u.op != "output" for u in node.users):
                # an identity view (a decomposed detach) makes no value of its own: its users read
                # its input, so a pointwise chain through it stays one kernel
                env[node] = env[node.args[0]]
                continue
            val = node.meta.get("val")
            if node in reduced_early:  # reduced right after its source: reshape the result here
                (out,) = g.add_node("aten::view.default", [("v", reduced_early[node]), ("list", [("int", s) for s in val.shape])],
                                    [], [_meta(val, dev)])
                b._values([out], node)
                b.ir_nodes.append(node)
                env[node] = out
                continue
            if node in unread:
                continue  # read only by replaced calls that do not read it
            if node in replace and replace[node][0] == "split":  # one slice view per chunk
                ids = []
                for (src, dim, lo, hi), part in zip(replace[node][1], val):
                    x = src.meta["val"]  # the chunk's layout from its source's (traced chunks may say offset 0)
                    meta = _meta(part, dev)[:5] + (x.stride(), int(x.storage_offset()) + lo * x.stride(dim))
                    ids += g.add_node("aten::slice.Tensor", [_encode(a, env, where, dev) for a in (src, dim, lo, hi)],
                                      [], [meta])
                env[node] = ids
                b._values(ids, None)
                b.ir_nodes += [node] * len(ids)
                continue
            if node in replace and replace[node][0] == "select_window":  # an unsqueeze view, then the window
                base, src, dim, index = replace[node][1]
                u = _unsqueezed(b, src, [dim], node, env[src], dev)
                if base is None:
                    pads = [0, 0] * (val.dim() - 1 - dim) + [index, val.shape[dim] - index - 1]
                    op, args = "aten::constant_pad_nd.default", [("v", u), _encode(pads, env, where, dev), ("float", 0.0)]
                else:
                    op = "aten::slice_scatter.default"
                    args = [_encode(base, env, where, dev), ("v", u)] + [("int", k) for k in (dim, index, index + 1)]
                (out,) = g.add_node(op, args, [], [_meta(val, dev)])
                env[node] = out
                b._values([out], node)
                b.ir_nodes.append(node)
                continue
            if node in replace and replace[node][0] == "box":  # unsqueeze views where the source lacks dims, then the box
                base, src, starts, shape, fill, missing = replace[node][1]
                box = ("list", [("int", k) for k in starts])
                if src is None:
                    op, args = "aotfuse::box_fill.default", [_encode(base, env, where, dev), box,
                                                             ("list", [("int", k) for k in shape]), ("float", fill)]
                else:
                    sid = _unsqueezed(b, src, missing, node, env[src], dev)
                    op, args = "aotfuse::box_scatter.default", [_encode(base, env, where, dev), ("v", sid), box]
                (out,) = g.add_node(op, args, [], [_meta(val, dev)])
                env[node] = out
                b._values([out], node)
                b.ir_nodes.append(node)
                continue
            if node in replace:
                op, fx_args, fx_kwargs = replace[node]
                args = [_encode(a, env, where, dev) for a in fx_args]
                kwargs = [(k, _encode(v, env, where, dev)) for k, v in fx_kwargs.items()]
            else:
                op, args, kwargs = _call(node, env, where, dev)
            multi = isinstance(val, (list, tuple))
            fix = real.get(node, {})
            metas = [_with_dtype(_meta(v, dev), fix.get(k)) for k, v in enumerate(val)] if multi else [_meta(val, dev)]
            ids = g.add_node(op, args, kwargs, metas)
            env[node] = ids if multi else ids[0]
            b._values(ids, None if multi else node)
            b.ir_nodes.append(node)
            for red, xdims in early.get(node, ()):
                shape = tuple(s for d, s in enumerate(val.shape) if d not in xdims)
                meta = _meta(red.meta["val"], dev)[:4] + (shape, tuple(make_contiguous_strides_for(shape)), 0)
                extra = [(k, _encode(v, env, where, dev)) for k, v in red.kwargs.items()]
                (rid,) = g.add_node(_op_name(red.target), [("v", ids[0]), ("list", [("int", d) for d in xdims]),
                                                           ("bool", False)], extra, [meta])
                b._values([rid], None)
                b.derived[rid] = (red, shape)
                b.ir_nodes.append(red)
                reduced_early[red] = rid
        elif node.op == "output":
            (outs,) = node.args
            for o in (outs if isinstance(outs, (list, tuple)) else (outs,)):
                if isinstance(o, fx.Node):
                    vid = env.get(o)
                    if not isinstance(vid, int):
                        raise UnsupportedError(f"graph output {o.name} is not a single value")
                    out_ids.append(vid)
                    b.out_template.append(None)
                else:
                    b.out_template.append((o,))  # None gradients and constants pass through
        else:
            raise UnsupportedError(f"{where}: FX op kind {node.op!r} is not supported")
    g.set_outputs(out_ids)
    return b


def missing_gradients(gm: fx.GraphModule, missing: tuple) -> fx.GraphModule:
    """A copy of a backward graph without the placeholders at positions `missing` (gradients that
    are zero; views of them that only adds read, such as slices, count as them): `add(g, x)` with such a g becomes x where x has the sum's shape, dtype and strides, a
    contiguous copy of x where only the strides differ (the nodes after it were traced with the sum's
    layout: views of x itself would not have the layouts their metadata gives, and every kernel
    reading them would fall back to ATen on each run); any other use reads one zeros tensor of g's
    shape."""
    aten = torch.ops.aten
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    zero: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gone = {placeholders[i] for i in missing}

    def zeros_for(p: fx.Node) -> fx.Node:
        if p not in zero:
            val = p.meta["val"]
            z = graph.call_function(aten.zeros.default, (list(val.shape),),
                                    {"dtype": val.dtype, "device": val.device, "pin_memory": False})
            z.meta["val"] = val.new_zeros(val.shape)
            zero[p] = z
        return zero[p]

    def same_kind(a: Any, b: Any) -> bool:
        va, vb = getattr(a, "meta", {}).get("val"), getattr(b, "meta", {}).get("val")
        return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and va.dtype == vb.dtype

    def same_strides(a: fx.Node, b: fx.Node) -> bool:
        va, vb = a.meta["val"], b.meta["val"]
        return all(n == 1 or s == t for n, s, t in zip(va.shape, va.stride(), vb.stride()))

    # a view of a missing gradient that only adds (or such views) read is missing too (lm_grads.py's
    # chunks add the gradient's column slices); one read otherwise is that view of the (contiguous)
    # zeros tensor made for the gradient
    views = (aten.slice.Tensor, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default)
    droppable: dict[fx.Node, bool] = {}

    def only_added(n: fx.Node) -> bool:
        if n not in droppable:
            droppable[n] = bool(n.users) and all(
                u.op == "call_function" and ((u.target is aten.add.Tensor and not u.kwargs and len(u.args) == 2)
                                             or (u.target in views and u.args[0] is n and only_added(u)))
                for u in n.users)
        return droppable[n]

    for node in gm.graph.nodes:
        if node in gone:
            continue
        if (node.op == "call_function" and node.target in views and node.args and node.args[0] in gone
                and only_added(node)):
            gone.add(node)
            continue
        if node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2:
            a, b = node.args
            other = b if a in gone else a if b in gone else None
            if isinstance(other, fx.Node) and other not in gone and same_kind(other, node):
                if same_strides(other, node):
                    env[node] = env[other]
                    continue
                if node.meta["val"].is_contiguous():
                    dense = graph.call_function(aten.clone.default, (env[other],), {"memory_format": torch.contiguous_format})
                    dense.meta = dict(node.meta)
                    env[node] = dense
                    continue
        if any(isinstance(x, fx.Node) and x in gone for x in node.all_input_nodes):
            for p in node.all_input_nodes:
                if p in gone:
                    env[p] = zeros_for(p)
        env[node] = graph.node_copy(node, lambda n: env[n])
    return config.graph_module(gm, graph)


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of t share memory (an unfold's windows), from its sizes and strides; False
    where they are symbolic (a shape family's trace). Expanded (stride 0) dimensions aside: AOTAutograd's
    gradient through an expanded view is right, and cloning it would cost its whole size."""
    sizes, strides = tuple(t.shape), t.stride()
    if not all(type(v) is int for v in sizes + tuple(strides)):  # int() of a SymInt would pin the family's size
        return False
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1 and st != 0)
    extent = 1  # elements the inner dimensions span
    for stride, size in dims:
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _refuse_overlapping_results(gm: fx.GraphModule) -> None:
    """A node that is not a view but makes a tensor whose elements share memory: ATen's scatters
    over an input that overlaps itself (`a[:, 2] = -1.5` on `b.as_strided((3, 4), (2, 1))`, as
    functionalization writes it) keep the overlap in a storage of their own, so a write to one element
    shows in the others, as in eager. Kernels compute each element on its own: the written column
    was lost from the rows that share it, and the input came back partly unwritten (found by a random
    aliasing sweep). Such graphs are refused (the fallbacks run them)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target.is_view or \
                _C.op_kind(_op_name(node.target)) == "view":
            continue  # views share memory by design: their base is what was written
        if self_overlapping(val):
            raise UnsupportedError(f"{node.name} ({_op_name(node.target)}) makes a tensor whose elements share "
                                   f"memory (sizes {list(val.shape)}, strides {list(val.stride())}): a mutation of an "
                                   f"input that overlaps itself")


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, saved_from: int | None = None,
          lazy: bool = False) -> Lowered:
    """Lowers an ATen-level FX graph (as AOTAutograd produces) into a C program. `saved_from`: a
    forward's outputs from that position on are saved for its backward, never written (they may
    be constants, constfold.fold). `lazy`: the kernels are generated now and compiled at the
    program's first run (a backward: the variant without some output gradients may be the one
    that runs, Lowered._without)."""
    from .embedding_grads import rewrite_embedding_grad_sums
    from .erf1p import rewrite_erf1p
    from .lm_grads import rewrite_head_chunks, rewrite_lm_grad_chunks
    from .overlap import rewrite_overlap_sums
    from .picks import rewrite_one_hot_picks
    from .rng import share_seeds

    unwrap_effects(gm)  # an inference graph's (a training graph's were unwrapped in its joint graph)
    detaches_as_aliases(gm)  # likewise
    _refuse_overlapping_results(gm)
    share_seeds(gm)  # an inference graph's dropouts (a training graph's were shared in its joint graph)
    resolve_lazy_views(gm)
    rewrite_overlap_sums(gm)  # before folding, which would make the scatters' indices opaque constants
    rewrite_embedding_grad_sums(gm)
    rewrite_lm_grad_chunks(gm)
    rewrite_head_chunks(gm)
    rewrite_one_hot_picks(gm)
    rewrite_erf1p(gm)
    gm = constfold.fold(gm, saved_from)
    b = build_graph(gm)
    fuse = config.fusion()
    if fuse:
        _add_nvrtc_search_dirs()
    # kernel templates (templates.h): a lifted reduction may add in another order than its own
    # shape's constants would, so under deterministic algorithms each program compiles its own
    try:
        program = _C.Program(b.graph, fuse=fuse, devices=config.kernel_devices(), reuse=config.reuse_buffers(),
                             sink=config.sink_copies(), sink_reads=config.sink_reads(),
                             sink_broadcasts=config.sink_broadcasts(),
                             window_sources=config.window_sources(), merge=config.merge_kernels(), lazy_jit=lazy,
                             huge_pages=config.huge_pages(),
                             templates=config.kernel_templates() and not torch.are_deterministic_algorithms_enabled())
    except _C.Error as e:
        if _unbuildable_message(str(e)):
            raise BackendUnavailable(str(e)) from e
        raise
    program.check_inputs = config.check_inputs()
    lowered = Lowered(program, tuple(b.constants), b.out_template, len(b.input_nodes) - len(b.constants))
    config.emit("lowering", f"{gm.__class__.__name__}: {program.num_nodes} nodes\n{program}")
    if program.num_kernels:
        groups: dict[int, list[str]] = {}
        for op, _kind, group in program.node_groups():
            if group >= 0:
                groups.setdefault(group, []).append(op)
        config.emit("fusion", f"{program.num_kernels} kernels, {program.num_steps} steps for {program.num_nodes} nodes; "
                    f"{program.buffer_reuses} results take dead tensors ({program.reused_bytes / 1e6:.1f} MB a run, "
                    f"{program.fresh_bytes / 1e6:.1f} MB of intermediates allocated); C kernel bodies: "
                    f"{program.bodies_reused} called from earlier programs, {program.bodies_lifted} compiled with "
                    "sizes as arguments"
                    + "".join(f"\n  kernel {k}: {', '.join(v)}" for k, v in sorted(groups.items())))
        for src in (program.source, program.cuda_source):
            if src:
                how = "compiled at its first run" if lazy else f"cache {'hit' if program.cache_hit else 'miss'}"
                config.emit("codegen", f"({how})\n{src}")
    return lowered
