"""The public compile API: aot_function, aot_module, memory_efficient_fusion.

Signature-compatible with functorch.compile's functions of the same names. Each distinct input
signature (see `_signature`) gets its own C programs; a call with a known signature goes straight
to them. A signature is captured by torch's AOTAutograd on its own, or, where it differs from an
earlier one only in sizes, joins a shape family (shapes.py): one capture with those sizes symbolic,
whose graphs are made concrete for each shape.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import operator
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_function as _torch_aot_function
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from . import checkpoint, config, ddp, decisions, draws, shapes
from ._pytree import _holds_tensor, tree_flatten, tree_unflatten
from .decompositions import LayoutRetry, conv_layout, default_decompositions, keep_layout, layout_class, upstream_fixes
from .lower import BackendUnavailable, Lowered, UnsupportedError, lower, self_overlapping, separate_aliased_gradients
from .partition import default_partition, min_cut_rematerialization_partition

__all__ = ["aot_function", "aot_module", "memory_efficient_fusion", "CaptureError", "HooksError", "ObjectInputError",
           "AOTModule", "AOTDataParallel"]


class CaptureError(RuntimeError):
    """The function could not be captured as one graph (data-dependent control flow, an op the
    tracer rejects, ...). The message names the cause and the ways out."""


_FALLBACKS = ("error", "eager", "dynamo")


class _Record:
    """What one signature's capture produced: output structure, lowered programs, graph facts."""

    def __init__(self) -> None:
        self.out_spec: Any = None
        # per output leaf: None (a graph output, in order), (value,) (a constant) or _InputOut (one of
        # the call's tensors, returned as itself)
        self.out_consts: list = []
        self.programs: dict[str, Lowered] = {}
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.num_fwd_outputs = 0
        self.saved_bytes = 0
        self.saved: list[tuple[str, tuple, str, int]] = []
        self.recomputed: list[str] = []
        self.partition_failed = False
        self.undecided_draws = 0  # draws.decided_draws: `torch.rand(...) < p` a trace could not answer
        # decisions.Decisions: what the trace read of its inputs' values (`.item()` of a mask), checked
        # before each run; a call that answers otherwise runs another entry (_Entry.alternatives)
        self.decisions: decisions.Decisions | None = None
        # draws.python_draws: the forward's Python and NumPy scalar draws, which each run makes again
        self.python_draws: list = []
        # the backward lowered at partition time: (its graph's _graph_key, the symbol values it was made
        # concrete at or None, the Lowered), for the backward compiler to take instead of lowering again
        self.early_backward: tuple | None = None
        # a DDP-synced signature's (ddp.Sync): its backward all-reduces the gradients bucket by bucket
        self.ddp: ddp.Sync | None = None
        self.ddp_checked = False  # a backward of it has the all-reduces
        # channels-last convolutions (decompositions.py): each output's layout in a pass that ran
        # without decompositions (eager's), and whether a pass of this capture changed a layout
        self.out_layouts: list | None = None
        self.layout_fired = False


def _graph_key(gm: torch.fx.GraphModule) -> tuple:
    """A graph's nodes and their metadata as one comparable value (the backward compiler's graph is the
    partitioner's, or a copy of it)."""
    def meta(v: Any) -> str:
        return f"{v.dtype}{list(v.shape)}{list(v.stride())}" if isinstance(v, torch.Tensor) else type(v).__name__

    return tuple((n.format_node(), meta(n.meta.get("val"))) for n in gm.graph.nodes)


def _early_backward(record: _Record, gm: torch.fx.GraphModule, symbolic: bool) -> tuple | None:
    """(symbol values or None, Lowered) of the backward lowered at partition time, when gm is that
    graph (taken once)."""
    early, record.early_backward = record.early_backward, None
    if early is None or (early[1] is not None) != symbolic or _graph_key(gm) != early[0]:
        return None
    return early[1], early[2]


def _compile_with_core(record: _Record, stage: str, gm: torch.fx.GraphModule, example_inputs: Any) -> Lowered:
    with config.compile_lock():  # torch compiles a backward lazily, at its first call, on any thread
        return _lower_stage(record, stage, gm, example_inputs)


def _lower_stage(record: _Record, stage: str, gm: torch.fx.GraphModule, example_inputs: Any) -> Lowered:
    if stage == "backward" and record.early_backward is not None:
        early = _early_backward(record, gm, False)
        if early is not None:  # the partitioner's graph, lowered there (and rewritten in place by lower)
            lowered = early[1]
            lowered.keep_graph_for_missing(gm)
            record.programs[stage] = lowered
            record.graphs[stage] = gm
            return lowered
    if stage == "backward" and record.ddp is not None:
        # before lowering: the variants below are made from gm too
        if ddp.insert_all_reduces(gm, record.ddp) or any(n.target is torch.ops.aotfuse.ddp_wait.default
                                                          for n in gm.graph.nodes):
            record.ddp_checked = True
        elif record.ddp_checked:  # a later shape's backward, lowered at its first backward: too late to say
            raise RuntimeError("aotfuse: a DistributedDataParallel backward of this shape gives a parameter no "
                               "gradient where the shapes before gave every one; set AOTFUSE_DDP_OVERLAP=0")
        else:
            # a parameter gets no gradient from this graph (lowered with its forward): its calls'
            # gradients are all-reduced after the backward (ddp.AfterBackward)
            record.ddp = None
    if stage == "backward":
        separate_aliased_gradients(gm)  # before lowering: the variants below are made from gm too
    # a backward's kernels compile at its first run: called without the gradients of outputs nobody
    # differentiates (the logits beside a loss), it runs a variant program instead (Lowered._without)
    lowered = lower(gm, example_inputs, saved_from=record.num_fwd_outputs if stage == "forward" else None,
                    lazy=stage == "backward")
    # the backward's outputs (gradients) and the forward's after the user-visible ones (saved for
    # backward) are plain values: views among them need not be ATen's (AOTAutograd tracks the
    # aliasing of user outputs only)
    if stage == "backward":
        lowered.program.set_plain_outputs(0)
        lowered.keep_graph_for_missing(gm)  # variants without some output gradients (_no_zero_gradients)
    elif stage == "forward":
        lowered.program.set_plain_outputs(lowered.program_outputs_before(record.num_fwd_outputs))
    record.programs[stage] = lowered
    record.graphs[stage] = gm
    return lowered


def _recording_partition(record: _Record, partition_fn: Callable, lower_backward: bool, num_params_buffers: int,
                         joint_module, joint_inputs, **kwargs):
    ours = getattr(partition_fn, "func", partition_fn)  # functools.partial(min_cut_rematerialization_partition, ...)
    if getattr(ours, "__module__", None) == "aotfuse.partition" and not kwargs.get("static_lifetime_input_indices"):
        # aot_function marks no static inputs: the first num_params_buffers are the parameters and
        # buffers (free to save, they live anyway); only our partitioners take the hint
        kwargs["aotfuse_static_inputs"] = range(num_params_buffers)
    try:
        fw, bw = partition_fn(joint_module, joint_inputs, **kwargs)
    except UnsupportedError:
        raise
    except Exception:
        record.partition_failed = True  # traced fine: the error is the partitioner's, not the model's
        raise
    if lower_backward:
        # torch compiles the backward lazily, at the first backward call; lowering it here too
        # makes an unsupported backward fail (or fall back) at the first forward call instead,
        # and lets explain() report it. The backward compiler takes this program where its graph
        # is this one (lower's rewrites changed it in place), else lowers its own.
        # (a shape family's, shapes.py: at the sizes it was traced at)
        vals = shapes.symbolic_values(bw) if shapes.is_symbolic(bw) else None
        if vals is not None:
            shapes.binders(bw)  # raises (here, in the family's trace, not at the first backward) where it cannot run
        low = _compile_with_core(record, "backward", bw if vals is None else shapes.concrete(bw, vals), None)
        record.early_backward = (_graph_key(bw), vals, low)
    num_fwd_outputs = kwargs.get("num_fwd_outputs", 0)
    record.num_fwd_outputs = num_fwd_outputs
    stats = fw.meta.get("aotfuse_partition")
    record.recomputed = list(stats.recomputed) if stats is not None else []
    (outs,) = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args
    record.saved, record.saved_bytes = [], 0
    for node in list(outs)[num_fwd_outputs:]:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            shape = tuple(map(shapes.hint, val.shape))  # a family's: at the sizes it was traced at
            nbytes = math.prod(shape) * val.element_size()
            record.saved.append((node.name, shape, str(val.dtype).replace("torch.", ""), nbytes))
            record.saved_bytes += nbytes
    return fw, bw


def _no_zero_gradients(outs: Any) -> None:
    """Outputs nobody differentiates (the logits beside the loss) get no gradient from autograd
    instead of a dense zeros tensor (memory the size of the logits, and an add in the backward): the
    backward then runs a variant program with those gradients folded away (Lowered._without)."""
    for o in outs:
        fn = o.grad_fn if isinstance(o, torch.Tensor) else None
        if fn is not None and type(fn).__name__ == "CompiledFunctionBackward":
            fn.materialize_grads = False
            return


def _compiled_code_traced_through() -> Any:
    """While a capture traces: torch.compile'd code it meets (a compiled submodule, or
    memory_efficient_fusion(torch.compile(model))) runs its original Python, so the capture gets its
    ops, as it does an aotfuse-compiled submodule's. Under Dynamo the capture's fake tensors reached
    the inner backend (aotfuse's: 'could not read a kernel operand'; inductor's: 'Cannot access data
    pointer')."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch before 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


@contextlib.contextmanager
def _tracing_flag():
    """Tells libraries that a compiler is tracing (torch.compiler.is_compiling() is True), as
    torch.export's non-strict tracing does: Hugging Face then skips data-dependent shortcuts
    (`if padding_mask.all(): mask = None`) and always builds the general mask, which is correct
    for every input."""
    compiler = torch.compiler
    if not hasattr(compiler, "_is_compiling_flag"):
        yield
        return
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = old


@contextlib.contextmanager
def _captures():
    """Marks this thread as capturing (_capturing.depth) for a signature's first run."""
    _capturing.depth += 1
    try:
        yield
    finally:
        _capturing.depth -= 1


def _leaf_key(x: Any, seen: dict) -> Any:
    if isinstance(x, torch.Tensor):
        first = seen.setdefault(id(x), len(seen))  # the same tensor passed twice is part of the key
        try:
            # a lazy negation or conjugation (`z.conj().imag`) is in the program (lower.resolve_lazy_views)
            layout = x.layout if not (x.is_neg() or x.is_conj()) else (x.layout, x.is_neg(), x.is_conj())
            return (x.dtype, x.device, x.shape, x.stride(), x.requires_grad, layout, first)
        except (RuntimeError, ValueError):  # no sizes or strides (sparse CSR, nested, a lazy module's
            # uninitialized parameter): its capture will say it is unsupported, or initialize it
            return (x.dtype, x.device, None, None, x.requires_grad, x.layout, x.is_nested, first)
    try:
        hash(x)
        return (type(x), x)
    except TypeError:
        return (type(x), id(x))


def _arg_name(path: tuple, skip: int = 0) -> str:
    """A pytree path into (args, kwargs) as a caller reads it: `input_ids`, `argument 0[1]`. `skip`:
    leading arguments the caller did not pass (a compiled module's parameters and buffers)."""
    rest = torch.utils._pytree.keystr(path[2:])
    if path[0].idx == 0:
        return f"argument {path[1].idx - skip}{rest}"
    return f"{path[1].key}{rest}"


def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether `stride` is a contiguous tensor's of sizes `shape` (size-1 dimensions included)."""
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if st != expected:
            return False
        expected *= max(n, 1)
    return True


def _family_key(key: tuple) -> tuple:
    """A _signature key without the sizes of its dense tensors (their rank stays): the signatures a
    shape family (shapes.py) may serve."""
    spec, leaves, *rest = key
    fam = tuple((k[0], k[1], len(k[2]), k[4], k[5], k[6]) if len(k) == 7 and isinstance(k[0], torch.dtype)
                and _dense(k[2], k[3]) else k for k in leaves)
    return (spec, fam, *rest)


def _storage_of(x: torch.Tensor) -> Any:
    """What x's elements live in: its storage's address, or x itself where it has none (an empty or
    storage-less tensor), so that views of one tensor are known for what they are."""
    try:
        ptr = x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        ptr = 0
    return ptr if ptr else ("tensor", id(x))


def _distinct_storages(tensors: list, skip: int = 0) -> bool:
    """Whether the tensors are distinct objects and those from position `skip` on (the call's own
    inputs, after a module's parameters and buffers, which alias nothing between calls) are views
    of no common storage. Bert-base's 204 parameters cost 10 us a call this way, 36 us with each
    storage looked up."""
    if len({id(t) for t in tensors}) != len(tensors):
        return False
    inputs = tensors[skip:]
    return len(inputs) < 2 or len({_storage_of(t) for t in inputs}) == len(inputs)


def _signature(leaves: list, spec: tuple, extra: tuple, skip: int = 0) -> tuple:
    seen: dict = {}
    keys = []
    try:
        for x in leaves:  # _leaf_key, inlined for tensors (a call per leaf is a tenth of a forward's host time)
            if isinstance(x, torch.Tensor):
                layout = x.layout if not (x.is_neg() or x.is_conj()) else (x.layout, x.is_neg(), x.is_conj())
                keys.append((x.dtype, x.device, x.shape, x.stride(), x.requires_grad, layout, seen.setdefault(id(x), len(seen))))
            else:
                keys.append(_leaf_key(x, seen))
    except (RuntimeError, ValueError):  # a tensor without strides or sizes (sparse CSR, nested, uninitialized)
        seen.clear()
        keys = [_leaf_key(x, seen) for x in leaves]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if len(tensors) > 1 and not _distinct_storages(tensors, skip):
        # inputs that are views of one storage (x and x[2:], say): AOTAutograd traces their aliasing
        # (a mutation of one is seen through the other), so which share and at what offset is part
        # of the key; a program traced for distinct tensors must not serve them
        groups: dict = {}
        extra = extra + (tuple((groups.setdefault(_storage_of(t), len(groups)), t.storage_offset()) for t in tensors),)
    return (spec, tuple(keys)) + _global_state() + extra


try:  # what Dynamo's guards check tensors with, in C++: dispatch keys, dtype, device, requires_grad, sizes, strides
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover (older or stripped torch builds)
    _TensorGuards = None


def _global_state() -> tuple:
    cpu, cuda = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")
    # the autocast dtype too: a program traced under bfloat16 autocast is not one for float16
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), cpu and torch.get_autocast_dtype("cpu"),
            cuda and torch.get_autocast_dtype("cuda"))


class _LastCall:
    """The last call's signature as a guard: a call whose leaves pass it has that signature, so
    it skips building and hashing the key (a tenth of a small model's forward host time). The
    tensor check (torch's C++ TensorGuards) is stricter than the key (it compares dispatch keys
    too); a call that fails it takes the key path, which is the reference."""
    __slots__ = ("entry", "spec", "extra", "state", "consts", "tensor_idx", "guards", "skip")

    def __init__(self, entry, leaves: list, spec: tuple, extra: tuple, skip: int = 0):
        self.entry, self.skip = entry, skip
        self.spec, self.extra, self.state = spec, extra, _global_state()
        self.consts = [(i, type(x), x if h else id(x), h) for i, x in enumerate(leaves)
                       if not isinstance(x, torch.Tensor) for h in (_hashable(x),)]
        self.tensor_idx = entry.tensor_idx
        self.guards = _TensorGuards(*[leaves[i] for i in self.tensor_idx], dynamic_dims_sizes=None,
                                    dynamic_dims_strides=None)

    @staticmethod
    def make(entry, leaves: list, spec: tuple, extra: tuple, skip: int = 0) -> "_LastCall | None":
        tensors = [leaves[i] for i in entry.tensor_idx]
        if _TensorGuards is None or not _distinct_storages(tensors, skip):
            return None  # tensors sharing a storage: their alias pattern is part of the key, left to it
        if any(t.layout is not torch.strided or t.is_nested for t in tensors):
            return None  # sparse and nested tensors have no strides: torch's check aborts the process
        try:
            return _LastCall(entry, leaves, spec, extra, skip)
        except Exception:  # a tensor torch's guard cannot describe: every call takes the key path
            return None

    def matches(self, leaves: list, spec: tuple, extra: tuple) -> bool:
        if spec != self.spec or extra != self.extra or _global_state() != self.state:
            return False
        for i, kind, value, hashable in self.consts:
            x = leaves[i]
            if type(x) is not kind or (x != value if hashable else id(x) != value):
                return False
        tensors = [leaves[i] for i in self.tensor_idx]
        return _distinct_storages(tensors, self.skip) and self.guards.check(*tensors)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


class _Entry:
    __slots__ = ("compiled", "tensor_idx", "record", "fallback", "fallback_target", "traced_fn", "module", "family",
                 "member", "ready", "alternatives")

    def __init__(self, compiled, tensor_idx, record, traced_fn=None, module=None):
        self.compiled = compiled
        self.tensor_idx = tensor_idx
        self.record = record
        # [the function AOTAutograd traces]: [flat_fn], or [its graph with attention rewritten, flat_fn]
        self.traced_fn = traced_fn
        self.module = module
        self.fallback: Callable | None = None  # set when this signature could not be captured
        self.fallback_target: Callable | None = None  # fallback without the skipped leading arguments
        self.family: shapes.Family | None = None  # the shape family this signature traces (or joined)
        self.member = False  # joined a family: runs its programs, traced nothing itself
        self.ready = False  # its first run (under the compile lock) returned: other threads may run it
        # decisions.check's outcome -> the entry traced for a call whose answers differ from this one's
        self.alternatives: dict[tuple, _Entry] | None = None


def _has_active_dropout(module: nn.Module | None) -> bool:
    return module is not None and any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
                                      for m in module.modules())


def _may_call_sdpa(module: nn.Module | None) -> bool:
    """Whether the module may call SDPA: not a transformers model configured with another attention
    implementation (eager attention, as the seed table runs them); any other module may."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return not isinstance(impl, str) or impl == "sdpa"


def _attention_mode(module: nn.Module | None, tensors: list, mode: str | None = None) -> str | None:
    """Whether eager attention becomes SDPA (attention.py) for these inputs: the mode, or None. On CPU
    tensors ATen's fast SDPA takes no dropout: a module with active dropout layers is not traced for
    it (unless forced), but for bf16 ones that may call SDPA, whose calls with dropout become aotfuse's
    kernels (attention.unfuse_attention; the trace costs a first step 0.25 s at Bert's reduced size)."""
    mode = mode or config.fuse_attention()
    if mode == "0":
        return None
    on_cuda = any(t.is_cuda for t in tensors)
    bf16_cpu = any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors)
    if not on_cuda and mode == "auto" and _has_active_dropout(module) and not (bf16_cpu and _may_call_sdpa(module)):
        return None
    return mode


def _fuse_attention_first(entry: _Entry, tensors: list, mode: str | None = None) -> None:
    """Eager attention as SDPA (attention.py): traces the function at the pre-dispatch level and, where
    attention chains matched, has AOTAutograd trace that graph instead."""
    mode = _attention_mode(entry.module, tensors, mode)
    if mode is None:
        return
    from .attention import fused_graph

    gm = fused_graph(entry.traced_fn[0], tensors, mode)
    if gm is not None:  # the function as it is stays behind it, for a trace of gm that fails
        entry.traced_fn[:] = [gm, entry.traced_fn[-1]]


def _without_leading(target: Callable, n: int, *args: Any, **kwargs: Any) -> Any:
    return target(*args[n:], **kwargs)


def _traced(x: Any) -> bool:
    """A tensor of a capture (fake or functional), not one a user's model may keep."""
    if not isinstance(x, torch.Tensor):
        return False
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(x, FunctionalTensor) or is_fake(x) or torch._is_functional_tensor(x)


def _traced_leaves(v: Any, depth: int = 4) -> list:
    """The traced tensors v is or holds in containers nested up to `depth` deep."""
    if _traced(v):
        return [v]
    if depth == 0 or isinstance(v, (str, bytes, torch.Tensor, nn.Module)):
        return []
    if isinstance(v, dict):
        v = v.values()
    elif not isinstance(v, (list, tuple, set, frozenset, collections.deque)):
        return []
    return [t for x in v for t in _traced_leaves(x, depth - 1)]


def _fixed_one_layer_lstm():
    """torch's LSTM decomposition, where it returns each layer's final states with their step
    dimension kept (torch < 2.13: `hx.squeeze(1)` for `squeeze(0)`, pytorch/pytorch#185716), so
    that h_n and c_n trace as [layers * directions, 1, batch, hidden]: a wrapper giving them the
    shape of the states it was given; else None. Probed on a batch of 2, at import (not while
    tracing: the probe's ops would be traced)."""
    from torch._decomp import decompositions as decomp
    orig = getattr(decomp, "one_layer_lstm", None)
    try:
        z = torch.zeros
        _, (h, _c) = orig(z(1, 2, 1), (z(2, 1), z(2, 1)), [z(4, 1), z(4, 1)], False)
    except Exception:  # gone, or another signature: leave torch's
        return None
    if h.shape == (2, 1):
        return None

    def fixed(inp, hidden, params, has_biases, reverse=False):
        out, (h, c) = orig(inp, hidden, params, has_biases, reverse)
        return out, (h.reshape(hidden[0].shape), c.reshape(hidden[1].shape))
    return fixed


_LSTM_FIX = _fixed_one_layer_lstm()


@contextlib.contextmanager
def _parametrizations_uncached():
    """torch.nn.utils.parametrize.cached() off for a tracing pass: its cache would keep the pass's
    traced weight (the next pass, in another fake mode, failed on it: 'Mixing fake modes', and the
    cache outlived the trace). The program computes the weight from its parameters at each call,
    which is what the cache holds."""
    from torch.nn.utils import parametrize

    was = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = was


@contextlib.contextmanager
def _lstm_decomposed_plainly():
    """torch's LSTM decomposition, for a tracing pass, without its oneDNN form (inference on the CPU
    recorded mkldnn_rnn_layer, whose workspace ATen returns as None at run time where the graph
    expects a tensor; traced plainly the LSTM is matmuls and pointwise ops) and with its final
    states' shape mended (_fixed_one_layer_lstm). oneDNN itself stays on: with it off (the process-wide
    flag, as this pass once set it) the fake convolution's layout came from another backend than the
    one that runs (a depthwise convolution of a channels-last input traced contiguous, so the run's
    channels-last results were copied into that layout and the next convolutions read it: ConvNeXt's
    step at 147% of eager's)."""
    from torch._decomp import decompositions as decomp

    fixed = _LSTM_FIX
    orig_layer, orig_select = getattr(decomp, "one_layer_lstm", None), getattr(decomp, "select_one_layer_lstm_function",
                                                                                None)
    if fixed is not None:
        decomp.one_layer_lstm = fixed
    if orig_select is not None:
        decomp.select_one_layer_lstm_function = lambda input, hx, params: decomp.one_layer_lstm
    try:
        yield
    finally:
        if fixed is not None:
            decomp.one_layer_lstm = orig_layer
        if orig_select is not None:
            decomp.select_one_layer_lstm_function = orig_select


def _refuse_restrided_offset_inputs(tensors: Sequence[Any], before: list) -> None:
    """An input at a storage offset whose shape or strides the function changes in place (`t_()`,
    `as_strided_()`) and whose values it writes: AOTAutograd gives the caller's tensor the new
    shape, strides and storage offset of the graph's updated value (torch 2.13), which holds the
    input's offset only where ATen's scatter ops happen to keep it; a kernel's result starts at 0, so
    the values landed one element before the view of `b[..., 1:5]` (the caller's b corrupted; found
    by a random aliasing sweep). Refused, naming the input: the fallbacks run the function."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    for k, (t, (shape, stride, offset)) in enumerate(zip(tensors, before)):
        if not isinstance(t, FunctionalTensor) or offset == 0 or (t.shape == shape and t.stride() == stride):
            continue
        if torch._functionalize_has_data_mutation(t.elem):
            raise UnsupportedError(f"tensor input {k} (a view at storage offset {offset}) has its shape or strides "
                                   f"changed in place (t_, as_strided_, ...) and its values written: AOTAutograd cannot "
                                   f"give the caller's tensor both back")


class _ModuleStateGuard:
    """Capture runs the module's forward on fake tensors, once per AOTAutograd tracing pass; what the
    forward keeps in Python state would keep a traced tensor, which the next pass reads as a foreign
    constant (the capture failed) and every later call (a fallback, eager use of the module) fails on.
    After each pass, each submodule attribute that now holds a traced tensor (directly or in nested
    dicts, lists, tuples, sets or deques) gets back its value from before, a container its contents,
    so no traced tensor outlives the capture.

    A memo is then harmless: a dict that only gained keys (LeViT's eval-mode bias cache,
    `self.cache[device] = self.biases[:, idx]`; rotary caches of (cos, sin)) is recomputed in the
    graph on every call. Any other state the forward keeps (`self.prev = y.detach()`, an auxiliary
    loss kept for the training loop) cannot be replayed by a compiled graph: `kept` names it, and the
    caller fails the capture, so the fallbacks (Dynamo replays such side effects) run it instead.
    State that holds only the pass's inputs (an RNN's `_flat_weights`: the parameters
    functional_call swapped in) is restored without failing."""

    _SKIP = ("_parameters", "_buffers", "_modules")

    def __init__(self, mod: nn.Module | None, inputs: tuple = ()):
        self.mod, self.kept, self.inputs = mod, [], {id(t) for t in inputs}

    def __enter__(self) -> "_ModuleStateGuard":
        self.before = []
        for m in self.mod.modules() if self.mod is not None else ():
            state = {k: v for k, v in vars(m).items() if k not in self._SKIP}
            contents = {k: (dict(v) if isinstance(v, dict) else list(v))
                        for k, v in state.items() if isinstance(v, (dict, list, set, collections.deque))}
            self.before.append((m, state, contents))
        return self

    def __exit__(self, *exc: Any) -> None:
        for m, state, contents in self.before:
            for k, v in list(vars(m).items()):
                leaves = [] if k in self._SKIP else _traced_leaves(v)
                if not leaves:
                    continue
                memo = (isinstance(v, dict) and v is state.get(k) and k in contents
                        and all(key in v and v[key] is old for key, old in contents[k].items()))
                if not memo and not all(id(t) in self.inputs for t in leaves):
                    self.kept.append(f"{type(m).__name__}.{k}")
                if k not in state:
                    delattr(m, k)
                elif v is state[k] and k in contents:  # the same container, filled during the trace
                    v.clear()
                    v.update(contents[k]) if isinstance(v, (dict, set)) else v.extend(contents[k])
                else:
                    setattr(m, k, state[k])


try:  # the torch.func transforms (vmap, grad, jacrev, ...) active on this thread, or None
    from torch._C._functorch import peek_interpreter_stack as _peek_interpreter_stack
except ImportError:  # pragma: no cover - torch without functorch's C++ part
    def _peek_interpreter_stack() -> None:
        return None

_warned_transform: set = set()
# this thread's captures in progress (_first_run's tracing): a compiled function called meanwhile is
# traced through (torch.compiler.is_compiling() cannot tell: a process-wide flag, another thread's too)
class _Capturing(threading.local):
    depth = 0  # every thread's starting value


_capturing = _Capturing()


def _dense_only(tensors: list) -> None:
    """Programs take dense (strided) tensors: a sparse, nested or quantized argument is said as what
    it is (the trace failed on it with torch's internal errors, read as a global tensor or control
    flow), and so is a subclass that only overrides __torch_function__ (`x.as_subclass(S)`: traced,
    but its program's ATen calls then refuse it, as torch's aot_eager does). Parameters and subclasses
    with their own __torch_dispatch__ (wrapper subclasses, which AOTAutograd takes apart) pass."""
    for t in tensors:
        if t.layout is not torch.strided or t.is_nested or t.is_quantized:
            kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout).replace("torch.", "")
            raise UnsupportedError(f"an argument is a {kind} tensor: aotfuse compiles dense (strided) tensors "
                                   f"only; pass its .to_dense() (.to_padded_tensor(), .dequantize()), or let "
                                   f"fallback='eager' run the function eagerly")
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and \
                type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
            raise UnsupportedError(f"an argument is a {type(t).__name__}, a tensor subclass without "
                                   f"__torch_dispatch__ (`as_subclass`): pass it as .as_subclass(torch.Tensor), or "
                                   f"let fallback='eager' run the function eagerly")


def _reads_outside_tensor(e: BaseException) -> bool:
    """Did tracing meet a real tensor among the traced ones (FakeTensorMode's refusal)? That is a tensor
    the function reads without taking it: a global, a closure's, an unregistered module attribute."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "convert all Tensors to FakeTensors" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _warn_transform(name: str) -> None:
    """A compiled function called inside torch.func.vmap/grad/jacrev/...: its programs take plain
    tensors, so it runs as the original function (the transform's own rules), with one warning. Not
    while Dynamo traces it (torch.compile of a model holding it, where functorch's interpreter stack
    reads as set too): Dynamo traces the original, which its backend compiles."""
    if torch.compiler.is_compiling():
        return
    if name not in _warned_transform:
        _warned_transform.add(name)
        warnings.warn(f"aotfuse: {name} was called under a torch.func transform (vmap, grad, jacrev, ...); it runs "
                      f"uncompiled there, as the original function", stacklevel=4)


def _overlapping_view_of_intermediate(out: Any, inputs: Sequence[Any]) -> bool:
    """Whether out is a self-overlapping view of an intermediate (`(x * 2).unfold(0, 3, 1)`): AOTAutograd
    returns such an output as its base's view, made again outside the compiled function, and the
    input's gradient through it came out wrong, without an error (torch 2.13; torch.compile's Inductor
    and aot_eager too: 7.0 off on a 5 x 4 input). A view of an input keeps its aliasing (its gradient
    is right)."""
    return (isinstance(out, torch.Tensor) and out._base is not None and not any(out._base is t for t in inputs)
            and self_overlapping(out))


@dataclasses.dataclass(frozen=True)
class _InputOut:
    """An output leaf that is one of the call's tensors itself (`x.mul_(2); return x`)."""
    index: int


@dataclasses.dataclass(frozen=True)
class _InputView:
    """An output leaf that is a view of an input sharing its storage with another input: made by
    the call from the caller's tensor (`as_strided` at the traced place in their storage: `offset`
    elements past the input's own start, as traced; a tracing pass's inputs need not hold the
    caller's storage offsets, AOTAutograd's last pass held them at 0)."""
    index: int
    size: tuple
    stride: tuple
    offset: int

    def of(self, tensors: list) -> torch.Tensor:
        """The view, made from the input's root base where that spans the whole storage (a view
        made from the input itself gets no gradient for its elements outside the input's: a1's
        column of `b` through a0 = b[0] lost b[1]'s share), else from the input."""
        t = tensors[self.index]
        offset = t.storage_offset() + self.offset
        root = t._base
        if root is not None and root.dtype == t.dtype and root.storage_offset() == 0 and root.is_contiguous() \
                and root.numel() * root.element_size() == root.untyped_storage().nbytes():
            t = root
        return t.as_strided(self.size, self.stride, offset)


@dataclasses.dataclass(frozen=True)
class _BaseView:
    """An output leaf that is a self-overlapping view of an intermediate (`v.as_strided((2, 2), (1,
    1))`, `(x * 2).unfold(0, 3, 1)`): the graph returns its base, and the call makes the view of it
    (`as_strided`, `offset` elements past the base's start), so its gradient is eager's (AOTAutograd's
    view of its base gave a wrong one, compile._overlapping_view_of_intermediate) and so are its
    aliasing and the in-place ops a caller does on it."""
    size: tuple
    stride: tuple
    offset: int

    def of(self, base: torch.Tensor) -> torch.Tensor:
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


def _storage_groups(tensors: Sequence[Any], skip: int = 0) -> set:
    """The positions of the tensors from `skip` on (a module's parameters and buffers before it, as
    _distinct_storages) that share their storage with another of them (x and x.t(), or one tensor
    passed twice)."""
    by: dict = {}
    for k, t in enumerate(tensors[skip:], skip):
        by.setdefault(_storage_of(t), []).append(k)
    return {k for ks in by.values() if len(ks) > 1 for k in ks}


def _span(t: torch.Tensor) -> tuple:
    """The first and last storage elements t reaches (for an empty t, an empty span)."""
    if t.numel() == 0:
        return (t.storage_offset(), t.storage_offset() - 1)
    low = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    high = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    return (low, high)


def _shares_an_input_storage(x: torch.Tensor, tensors: Sequence[Any]) -> bool:
    """Whether x's elements live in one of the tensors' storages (True where that cannot be told)."""
    try:
        storage = x.untyped_storage()._cdata
        return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == storage for t in tensors)
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def _out_kind(x: Any, tensors: tuple, shared: set) -> Any:
    """record.out_consts' entry for the output leaf x.

    An input returned as itself is no graph output: the call returns the caller's tensor, as eager
    does, after AOTAutograd has written the input's updates into it (as a graph output, an updated
    input at a storage offset came back at offset 0 beside inputs AOTAutograd merged into one
    synthetic base: silently wrong values).

    A view of an input that shares its storage with another input is no graph output either: the
    call makes it from the caller's tensor (_InputView). AOTAutograd replays such a view's ops on the
    synthetic base it merges the inputs into where one is updated, as if on the input itself
    (torch 2.13: `a0.mul_(2); return a1.split(2)[1]` with a0 = b[0], a1 = b.t() failed an assert
    on a base that is a view, and crashed the process on one that is not). Only where the trace's
    sizes are numbers, and the view has its input's dtype, conj/neg bits and requires_grad; else
    AOTAutograd makes it as before (signatures with shared storages are traced without symbolic
    sizes, so that holds)."""
    if not isinstance(x, torch.Tensor):
        return (x,)
    same = next((_InputOut(k) for k, t in enumerate(tensors) if t is x), None)
    # (a view of an input, which a synthetic base makes look like an intermediate's: `_base` is the
    # synthetic base there and the input itself in AOTAutograd's other pass, which must agree)
    if same is None and _overlapping_view_of_intermediate(x, tensors) and not _shares_an_input_storage(x, tensors):
        meta = (tuple(x.shape), tuple(x.stride()), x.storage_offset() - x._base.storage_offset())
        if all(isinstance(v, int) for v in meta[0] + meta[1] + meta[2:]):
            return _BaseView(*meta)
        return None  # symbolic sizes (a shape family's): returned as a copy (_own_if_overlapping)
    if same is not None or not shared or not x._is_view():
        return same
    try:
        storage = x.untyped_storage()._cdata
        ks = [k for k in sorted(shared) if tensors[k].untyped_storage()._cdata == storage]
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    meta = (tuple(x.shape), tuple(x.stride()), x.storage_offset())
    if not ks or not all(isinstance(v, int) for t in ks for v in (meta[0] + meta[1] + meta[2:] + tuple(tensors[t].shape)
                                                                + tuple(tensors[t].stride()) + (tensors[t].storage_offset(),))):
        return None
    # preferably an input whose span holds the view's (the input a view is made from where the
    # input's root base does not span the storage: _InputView.of)
    k = next((k for k in ks if _span(tensors[k])[0] <= _span(x)[0] and _span(x)[1] <= _span(tensors[k])[1]), ks[0])
    t = tensors[k]
    if x.dtype != t.dtype or (x.is_conj(), x.is_neg(), x.requires_grad) != (t.is_conj(), t.is_neg(), t.requires_grad):
        return None
    return _InputView(k, meta[0], meta[1], meta[2] - t.storage_offset())


def _own_if_overlapping(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """out, or a tensor of its own where it is a self-overlapping view of an intermediate."""
    return out.clone() if _overlapping_view_of_intermediate(out, inputs) else out


def _pass_layouts(record: Any, outs: tuple, fired: bool, bases: Any = ()) -> tuple:
    """The outputs of one tracing pass of the user's function. A pass where no convolution changed a
    layout (AOTAutograd's metadata pass runs without decompositions) gives eager's: recorded in
    record.out_layouts. In a pass whose convolutions ran channels-last each output is copied back into
    the layout eager gave it: the same tensor returned twice is one copy; one that is a view in this
    pass cannot be copied without losing what it aliases, nor can the base of a view the call makes
    from it (`bases`: positions; its strides were read off this pass's layout): LayoutRetry."""
    if not fired:
        record.out_layouts = [layout_class(x) for x in outs]
        return outs
    eager = record.out_layouts
    if eager is None or len(eager) != len(outs):
        raise LayoutRetry("no pass without decompositions gave eager's output layouts")
    copies: dict[int, Any] = {}
    res = []
    for x, want in zip(outs, eager):
        if isinstance(x, torch.Tensor) and layout_class(x) != want:
            if id(x) not in copies:
                if x._is_view() or len(res) in bases:
                    raise LayoutRetry("an output that is a view, in another layout than eager's")
                copies[id(x)] = keep_layout(x, want)
            x = copies[id(x)]
        res.append(x)
    return tuple(res)


class CompiledFunction:
    """What aot_function returns: call it like the original function."""

    def __init__(self, fn: Callable, fw_compiler, bw_compiler, partition_fn, decompositions,
                 num_params_buffers: int, keep_inference_input_mutations: bool, inference_compiler,
                 fallback: str, max_cache_size: int | None, name: str | None = None, dynamic: bool | None = None):
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
        # as given (decompositions None where defaulted): what a copy or an unpickled one is made from
        self._init_args = (fn, fw_compiler, bw_compiler, partition_fn, decompositions, num_params_buffers,
                           keep_inference_input_mutations, inference_compiler, fallback, max_cache_size, name, dynamic)
        self.fn = fn
        # what a signature that cannot be captured runs (eagerly or under Dynamo): fn itself, or what
        # aot_module sets: the module itself, called without the fallback_skip leading arguments (its
        # tensors), so no call pays functional_call's swapping of every tensor in and out
        self.fallback_fn: Callable = fn
        self.fallback_skip = 0
        # aot_module's shortcut past the tensor walk and the lookup: (the user arguments' signature,
        # what runs them) after a call of a module fell back; cleared with the cache
        self.module_fallback: tuple | None = None
        self.last_entry: _Entry | None = None  # the entry the latest call ran (None: eagerly, cache full)
        self.fw_compiler = fw_compiler
        self.bw_compiler = bw_compiler
        self.inference_compiler = inference_compiler
        self.partition_fn = partition_fn or default_partition
        self.decompositions = default_decompositions() if decompositions is None else decompositions
        self.num_params_buffers = num_params_buffers
        self.keep_inference_input_mutations = keep_inference_input_mutations
        self.fallback = fallback
        self.max_cache_size = max_cache_size
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self._cache: dict[tuple, _Entry] = {}
        # shape families (shapes.py): by _family_key; and the sizes of the first signature of each key
        self.dynamic = dynamic
        self._families: dict[tuple, shapes.Family] = {}
        self._first_shapes: dict[tuple, list[tuple]] = {}
        self._uncaptured: set[tuple] = set()  # family keys of signatures that fell back: no family tried
        self._warned: set[str] = set()  # which of _warn_once's warnings were given (cache_clear() clears them)
        self._dynamo_fn: Callable | None = None
        self._decided = 0  # alternatives traced for other answers of decisions (_decide), against the limit
        self._last: _LastCall | None = None
        self.compile_count = 0
        # bumped as a first run (a trace) starts and ends, under the compile lock: functional_call swaps
        # the module's parameters for the trace's fake ones meanwhile, so AOTModule.forward on another
        # thread reads them again under the lock when this was odd or moved during its read
        self.trace_gen = 0
        self.fuse_attention: str | None = None  # "auto", "1" or "0" over AOTFUSE_FUSE_ATTENTION (benchmarks)
        self._layout_off = False  # a capture of it was traced again without channels-last convolutions
        functools.update_wrapper(self, fn, updated=())

    def __reduce_ex__(self, protocol: int) -> tuple:
        # copy.deepcopy and pickle: the same function and options, compiled afresh (C programs are
        # process-local); pickling needs a function pickle can name
        return (CompiledFunction, self._init_args)

    # -- the call path: flatten, look up, run, rebuild --
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if config.disabled():
            return self.fn(*args, **kwargs)
        if _peek_interpreter_stack() is not None:
            _warn_transform(self.name)
            return self.fn(*args, **kwargs)
        if _capturing.depth:  # called by a function aotfuse captures: traced through into its graph
            return self.fn(*args, **kwargs)
        return self._call((args, kwargs), ())[0]

    def _call(self, tree: Any, extra: tuple) -> tuple[Any, _Entry | None]:
        """(the outputs, the entry that ran them: None when the cache was full). Thread-safe: a
        signature is compiled and first run under config.compile_lock(), and a thread finding an entry
        another is still compiling waits for it there."""
        leaves, spec = tree_flatten(tree)
        decided = None  # the entry (or alternative) whose decisions this call answered alike
        last = self._last
        if last is not None and last.matches(leaves, spec, extra):
            entry = last.entry
        else:
            key = _signature(leaves, spec, extra, self.num_params_buffers)
            entry = self._cache.get(key)
            if entry is not None and entry.ready:
                self._last = _LastCall.make(entry, leaves, spec, extra, self.num_params_buffers)
        if entry is None or not entry.ready:
            with config.compile_lock():
                entry = self._cache.get(key)  # compiled meanwhile by another thread
                if entry is None and any(isinstance(x, nn.parameter.UninitializedTensorMixin) for x in leaves):
                    return self._initialize_lazy(tree), None
                if entry is None:
                    self._check_call(tree)
                    entry = self._compile(key, leaves, spec, tree)
                    if entry is None:  # cache full: this signature runs eagerly
                        args, kwargs = tree
                        self.last_entry = None
                        return self.fn(*args, **kwargs), None
                if not entry.ready:
                    self.last_entry = entry
                    if not entry.member or entry.record.decisions is None:
                        return self._first_run(entry, leaves, tree, extra, key)
                    # a new shape of a family whose trace answered questions about its inputs' values:
                    # the family's programs only where this call answers alike (nothing traced it)
                    decided = self._decide(entry, leaves, spec, tree, extra)
                    if decided is entry:
                        return self._first_run(entry, leaves, tree, extra, key)
                    if isinstance(decided, tuple):  # traced for this call's answers just now
                        return decided
                    # else traced for another answer at an earlier call of this shape (checked: below)
        self.last_entry = entry
        if decided is None and entry.fallback is None and entry.record.decisions is not None:
            decided = self._decide(entry, leaves, spec, tree, extra)
            if isinstance(decided, tuple):  # traced for this call's answers (or run eagerly) just now
                return decided
        if decided is not None and decided is not entry:
            if decided.fallback is not None:
                args, kwargs = tree  # (no entry: AOTModule's shortcut would send every call of the signature there)
                self.last_entry = None
                return decided.fallback(*args, **kwargs), None
            entry = self.last_entry = decided
        if entry.fallback is not None:
            args, kwargs = tree
            return entry.fallback(*args, **kwargs), entry
        tensors = [leaves[i] for i in entry.tensor_idx]
        outs = entry.compiled(*tensors)
        if entry.record.python_draws:
            draws.replay(entry.record.python_draws)
        if self.bw_compiler is None:
            _no_zero_gradients(outs)
        return self._rebuild(entry.record, outs, tensors), entry

    def _decide(self, entry: _Entry, leaves: list, spec: tuple, tree: Any, extra: tuple) -> _Entry | tuple:
        """The entry whose recorded decisions (decisions.py: `.item()` of a mask, say) this call's
        tensors answer alike: `entry` or one of its alternatives; or (outputs, entry) of the first run
        of a new alternative, traced for this call's answers ((outputs, None) where it fell back, or
        where the alternatives reached the cache limit and the call ran eagerly)."""
        tensors = [leaves[i] for i in entry.tensor_idx]
        while entry.fallback is None and entry.record.decisions is not None:
            outcome = decisions.check(entry.record.decisions, tensors)
            if outcome is None:
                return entry
            alt = entry.alternatives.get(outcome) if entry.alternatives else None
            if alt is None and self.fallback in ("eager", "dynamo") and \
                    decisions.is_count(entry.record.decisions, outcome) and \
                    sum(k[0] == outcome[0] for k in entry.alternatives or ()) >= decisions.COUNT_TRACES:
                # a mask whose count keeps changing (padding): every other count runs the fallback,
                # where Dynamo breaks the graph at the data-dependent shape
                outcome = ("count", outcome[0])
                alt = entry.alternatives.get(outcome)
            if alt is None or not alt.ready:
                with config.compile_lock():
                    alt = entry.alternatives.get(outcome) if entry.alternatives else None
                    if alt is None:
                        return self._first_alternative(entry, outcome, leaves, spec, tree, extra)
            entry = alt
        return entry

    def _first_alternative(self, entry: _Entry, outcome: tuple, leaves: list, spec: tuple, tree: Any,
                           extra: tuple) -> tuple:
        """_decide's new alternative (under the compile lock): traced and run for this call; a count
        past those traced runs the fallback (_decide)."""
        if outcome[0] == "count":
            alt = _Entry(None, entry.tensor_idx, entry.record)
            self._fall_back(alt)
            alt.ready = True
            entry.alternatives[outcome] = alt
            how = "eagerly" if self.fallback == "eager" else "through torch.compile(backend='aotfuse')"
            config.emit("cache", f"{self.name}: {decisions.describe(entry.record.decisions, outcome)}: other counts run {how}")
            self._warn_once("counts", f"{self.name} indexes with a mask of its inputs whose count of nonzero elements "
                                      f"has changed {decisions.COUNT_TRACES + 1} times (padding?); calls with other "
                                      f"counts run {how} (decisions.py)", 5)
            args, kwargs = tree
            self.last_entry = None
            return alt.fallback(*args, **kwargs), None
        limit = self.max_cache_size or config.cache_size()
        if self._decided >= limit:
            self._warn_once("decided", f"{self.name} has been traced for {limit} other answers of what it reads of "
                                       f"its inputs' values (decisions.py; the limit, AOTFUSE_CACHE_SIZE or "
                                       f"max_cache_size); calls answering otherwise again run eagerly", 5)
            args, kwargs = tree
            self.last_entry = None
            return self.fn(*args, **kwargs), None
        config.emit("cache", f"{self.name}: {decisions.describe(entry.record.decisions, outcome)}: traced again for "
                             f"this answer")
        sync = extra[-1] if extra and isinstance(extra[-1], ddp.Sync) else None
        shared = _storage_groups([leaves[i] for i in entry.tensor_idx], self.num_params_buffers)
        alt = self._build_entry(sync, leaves, spec, entry.tensor_idx, entry.module, shared)
        entry.alternatives = entry.alternatives or {}
        entry.alternatives[outcome] = alt
        self._decided += 1
        self.compile_count += 1
        self.last_entry = alt
        try:
            outs, ran = self._first_run(alt, leaves, tree, extra)
        except BaseException:
            del entry.alternatives[outcome]  # the next such call tries (and explains) again
            self._decided -= 1
            raise
        return outs, (None if ran is not None and ran.fallback is not None else ran)

    def _warn_once(self, what: str, message: str, stacklevel: int) -> None:
        """warnings.warn("aotfuse: " + message) the first time `what` happens to this function (stacklevel:
        as the caller's own warnings.warn would give it)."""
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"aotfuse: {message}", stacklevel=stacklevel + 1)

    def _initialize_lazy(self, tree: Any) -> Any:
        """A call over a lazy module's uninitialized parameters (LazyLinear sizes them at its first call;
        the signature keys them without sizes): runs eagerly, which initializes them, with one warning.
        Only on a cache miss: the next call's signature has their sizes."""
        self._warn_once("lazy", f"{self.name} holds lazy modules whose parameters are not initialized yet: this "
                                f"call runs eagerly and initializes them; later calls are compiled", 5)
        args, kwargs = tree
        self.last_entry = None
        return self.fn(*args, **kwargs)

    @staticmethod
    def _rebuild(record: _Record, outs: Any, tensors: list) -> Any:
        it = iter(outs)
        return tree_unflatten([next(it) if c is None else c.of(next(it)) if isinstance(c, _BaseView) else
                               tensors[c.index] if isinstance(c, _InputOut) else
                               c.of(tensors) if isinstance(c, _InputView) else c[0] for c in record.out_consts],
                              record.out_spec)

    def _varying_shapes(self, key: tuple, tree: Any) -> str:
        """For the cache-full warning: the inputs whose shapes differ between the compiled signatures
        and this call's, by their place in the arguments, and what to do about it."""
        keys = [k for k in self._cache if k[0] == key[0]] + [key]  # same argument structure
        varying = []
        for i, leaf in enumerate(key[1]):
            shapes = {k[1][i][2] for k in keys if isinstance(k[1][i], tuple) and len(k[1][i]) == 7}
            if len(shapes) > 1 and isinstance(leaf, tuple) and len(leaf) == 7:
                varying.append((i, sorted(shapes)))
        if not varying:
            return ""
        try:
            paths = [_arg_name(p, self.fallback_skip) for p, _ in torch.utils._pytree.tree_flatten_with_path(tree)[0]]
        except Exception:  # a pytree torch's paths do not cover: name leaves by position
            paths = []
        names = []
        for i, shapes in varying[:3]:
            where = paths[i] if len(paths) == len(key[1]) else f"input leaf {i}"
            shown = ", ".join("x".join(map(str, sh)) for sh in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
            names.append(f"{where} ({shown})")
        return (f" Shapes that vary: {'; '.join(names)}. Each shape compiles once: padding batches to a few "
                f"fixed lengths (a data collator's pad_to_multiple_of, say) keeps them compiled, or raise the "
                f"limit.")

    def _dynamic_mode(self) -> str:
        """"auto", "1" or "0": shape families (shapes.py) for this function. Only with aotfuse's own
        compilers (custom ones would get symbolic graphs)."""
        if self.fw_compiler is not None or self.bw_compiler is not None or self.inference_compiler is not None \
                or getattr(self.partition_fn, "__module__", None) != "aotfuse.partition":
            return "0"
        return config.dynamic() if self.dynamic is None else "1" if self.dynamic else "0"

    def _family_dims(self, fkey: tuple, family: shapes.Family | None, tensors: list) -> dict | None:
        """The dimensions a new family for this call would make symbolic (tensor position -> dims),
        or None: this call's signature is traced on its own."""
        mode = self._dynamic_mode()
        if mode == "0" or (family is not None and family.failed) or fkey in self._uncaptured:
            return None  # (a shape whose function could not be captured whole: neither can a family)
        if any(t.is_nested or t.layout != torch.strided for t in tensors):
            return None  # sizes that are not a shape (nested, sparse): the trace on its own says what it cannot take
        if mode == "1" and family is None:  # every size of the inputs that are not parameters or buffers
            dims = {i: frozenset(range(t.dim())) for i, t in enumerate(tensors)
                    if i >= self.num_params_buffers and t.dim()}
            return dims or None
        first = self._first_shapes.setdefault(fkey, [tuple(t.shape) for t in tensors])
        dims = {}
        for i, (t, shape) in enumerate(zip(tensors, first)):
            d = frozenset(k for k, (a, b) in enumerate(zip(t.shape, shape)) if a != b)
            if family is not None:
                d |= family.dims.get(i, frozenset())
            if d:
                dims[i] = d
        if not dims or (family is not None and dims == family.dims):
            return None  # the first shape, or the family's guards refused this one
        return dims

    def _compile(self, key: tuple, leaves: list, spec: tuple, tree: Any) -> _Entry | None:
        tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        module = self.fallback_fn if isinstance(self.fallback_fn, nn.Module) else None  # its Python state is kept
        if self.fallback in ("eager", "dynamo") and _family_key(key) in self._uncaptured:
            # another shape of a signature that could not be captured whole: straight to its fallback
            # (Dynamo guards and recompiles shapes itself), no capture tried again, no warning again,
            # not counted against the signature limit
            entry = _Entry(None, tensor_idx, _Record(), None, module)
            self._fall_back(entry)
            entry.member, entry.ready = True, True
            self._cache[key] = entry
            config.emit("cache", f"{self.name}: a new shape of a signature that falls back ({self.fallback})")
            return entry
        dims, fkey = None, None
        shared = _storage_groups([leaves[i] for i in tensor_idx], self.num_params_buffers)  # see _out_kind
        if self._dynamic_mode() != "0" and not shared:
            tensors = [leaves[i] for i in tensor_idx]
            fkey = _family_key(key)
            family = self._families.get(fkey)
            if family is not None and family.admits(tensors):  # a shape of a family: no trace
                entry = _Entry(family.compiled, tensor_idx, family.record, None, module)
                entry.family, entry.member = family, True
                self._cache[key] = entry
                config.emit("cache", f"{self.name}: a new shape of a traced family")
                return entry
            dims = self._family_dims(fkey, family, tensors)
        limit = self.max_cache_size or config.cache_size()
        if sum(1 for e in self._cache.values() if not e.member) >= limit:
            if "full" not in self._warned:
                self._warn_once("full", f"{self.name} has been compiled for {limit} input signatures (the limit, "
                                        f"AOTFUSE_CACHE_SIZE or max_cache_size); new signatures run eagerly."
                                        f"{self._varying_shapes(key, tree)}", 4)
            return None
        config.memory_budget()  # a bad AOTFUSE_MEMORY_BUDGET is said before tracing, as what it is
        entry = self._build_entry(key[-1] if key and isinstance(key[-1], ddp.Sync) else None, leaves, spec,
                                  tensor_idx, module, shared)
        if dims:  # (custom compilers make no families: traced_fn is [flat_fn])
            record, compiled, traced_fn = entry.record, entry.compiled, entry.traced_fn
            flat_fn = traced_fn[-1]
            family = entry.family = shapes.Family(dims, [tuple(leaves[i].shape) for i in tensor_idx])
            family.record = record
            self._families[fkey] = family
            entry.traced_fn = None  # the family's trace fuses attention itself
            entry.compiled = functools.partial(self._trace_family, entry, compiled, traced_fn, flat_fn)
        self._cache[key] = entry
        self.compile_count += 1
        config.emit("cache", f"{self.name}: compiling signature #{len(self._cache)}"
                    + (f", a shape family with sizes symbolic in {dims}" if dims else ""))
        return entry

    def _build_entry(self, sync: ddp.Sync | None, leaves: list, spec: tuple, tensor_idx: list, module: nn.Module | None,
                     shared: Any) -> _Entry:
        """A new entry for this call's signature (or for another answer of its decisions): the function
        AOTAutograd traces at its first run, with aotfuse's compilers and partitioner."""
        record = _Record()
        # the DDP sync AOTModule.forward put last in the key (its extra): this signature's alone, never a
        # function compiled during its call; only where the backward is lowered here
        record.ddp = sync if self.bw_compiler is None else None
        template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        fn = self.fn

        held = [type(x).__name__ for x in template if x is not None and _holds_tensor(x, 0, set())]

        def flat_fn(*tensors):  # AOTAutograd calls it once per tracing pass
            if held:
                raise ObjectInputError(f"{self.name} takes {', '.join(held)} holding tensors (not a tuple, list, dict "
                                       f"or dataclass of them): a program cannot take its tensors, nor replay what "
                                       f"the call does to it (a KV cache it appends to)")
            vals = list(template)
            for i, t in zip(tensor_idx, tensors):
                vals[i] = t
            args, kwargs = tree_unflatten(vals, spec)
            before = [(t.shape, t.stride(), t.storage_offset()) for t in tensors]
            rng, drew = draws.python_rng_state(), False
            drawn, python_drawn = draws.decided_draws(), draws.python_draws()
            decided = decisions.input_decisions(tensors, decisions.current_real() if config.decisions() else None)
            record.decisions = None
            try:
                with _ModuleStateGuard(module, tensors) as guard, _lstm_decomposed_plainly(), \
                        _parametrizations_uncached(), upstream_fixes(), _HookProbe(self.name, module) as hooks, \
                        checkpoint.regions(), drawn, python_drawn, decided:
                    out = fn(*args, **kwargs)
            finally:  # a pass that fails for another reason gives the generators back too
                record.undecided_draws = drawn.undecided
                if draws.python_rng_state() != rng:
                    draws.restore_python_rng_state(rng)
                    drew = True
            if drew:
                raise RandomStateError("the forward draws Python or NumPy random numbers (random.*, numpy.random.*), "
                                       "which a compiled graph would keep from this first call for every later one")
            record.python_draws = python_drawn.calls  # each pass makes the same; each run makes them again
            record.decisions = decided.finish()  # answers from the inputs' values, checked at each call
            _refuse_restrided_offset_inputs(tensors, before)
            hooks.check()
            if guard.kept:
                raise KeptStateError(f"the forward keeps tensors in Python state ({', '.join(guard.kept)}), which a "
                                     f"compiled graph cannot replay")
            out_leaves, out_spec = tree_flatten(out, objects=True)
            record.out_spec = out_spec
            record.out_consts = [_out_kind(x, tensors, shared) for x in out_leaves]
            return tuple(x._base if isinstance(c, _BaseView) else _own_if_overlapping(x, tensors)
                         for x, c in zip(out_leaves, record.out_consts) if c is None or isinstance(c, _BaseView))

        ours = functools.partial(_compile_with_core, record)
        traced_fn = [flat_fn]  # the first run may swap in a graph of it with attention fused

        def traced(*tensors):
            with conv_layout(not self._layout_off) as layout:
                try:
                    outs = traced_fn[0](*tensors)
                finally:  # a view the layout cannot take raises here: _traced_first traces again
                    record.layout_fired |= layout.fired
            made = [c for c in record.out_consts if c is None or isinstance(c, _BaseView)]  # flat_fn's outputs
            return _pass_layouts(record, outs, layout.fired, {i for i, c in enumerate(made) if c is not None})

        compiled = _torch_aot_function(
            traced if self.fw_compiler is None else flat_fn,
            fw_compiler=self.fw_compiler or functools.partial(ours, "forward"),
            bw_compiler=self.bw_compiler or functools.partial(ours, "backward"),
            partition_fn=functools.partial(_recording_partition, record, self.partition_fn,
                                           self.bw_compiler is None, self.num_params_buffers),
            decompositions=self.decompositions,
            num_params_buffers=self.num_params_buffers,
            keep_inference_input_mutations=self.keep_inference_input_mutations,
            inference_compiler=self.inference_compiler or (
                functools.partial(ours, "inference") if self.fw_compiler is None else None),
        )
        return _Entry(compiled, tensor_idx, record, traced_fn if self.fw_compiler is None else None, module)

    def _trace_family(self, entry: _Entry, static: Callable, traced_fn: list, flat_fn: Callable, *tensors) -> Any:
        """The first call of a family (entry.compiled until it returns): traces flat_fn with the
        family's sizes symbolic and runs it. Where that fails (or pins every symbolic size), this
        signature is traced on its own (`static`, as without families) and no shape joins."""
        family, record = entry.family, entry.record
        def per_shape(stage: str) -> Callable:
            def compile_stage(gm: torch.fx.GraphModule, _inputs: Any) -> shapes.PerShape:
                ps = family.stages[stage] = shapes.PerShape(gm, lambda g: _compile_with_core(record, stage, g, None))
                early = _early_backward(record, gm, True) if stage == "backward" else None
                if early is not None:  # the program the partitioner lowered, at the traced sizes
                    ps.seed(early[0], early[1])
                return ps
            return compile_stage

        try:
            compiled = shapes.trace(
                family, flat_fn, tensors, fw=per_shape("forward"), bw=per_shape("backward"),
                inference=per_shape("inference"),
                partition=functools.partial(_recording_partition, record, self.partition_fn, True,
                                            self.num_params_buffers),
                decompositions=self.decompositions, keep_inference_input_mutations=self.keep_inference_input_mutations,
                fuse_attention=_attention_mode(entry.module, list(tensors), self.fuse_attention))
            sealed = family.seal()
            outs = compiled(*tensors)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - traced on its own below, which raises what a user must see
            family.failed = True
            config.emit("cache", f"{self.name}: no symbolic trace ({type(e).__name__}: {e}); this signature is "
                                 f"traced on its own")
            record.programs.clear()
            record.graphs.clear()
            entry.compiled, entry.traced_fn = static, traced_fn
            _fuse_attention_first(entry, list(tensors), self.fuse_attention)
            return static(*tensors)
        entry.compiled = compiled
        if sealed:
            family.compiled = compiled
        else:
            config.emit("cache", f"{self.name}: the symbolic trace pinned every symbolic size; other shapes are "
                                 f"traced on their own")
        return outs

    def _check_call(self, tree: Any) -> None:
        """A call the function's own signature refuses (a missing, extra or unknown argument) raises
        the TypeError an eager call would, before anything is traced (it used to surface as a
        CaptureError blaming control flow, which `except TypeError` missed). A new signature only."""
        args, kwargs = tree
        fn = self.fallback_fn.forward if isinstance(self.fallback_fn, nn.Module) else self.fallback_fn
        try:  # the callable's own signature: a decorator's (*args, **kwargs) binds anything, as it should
            sig = inspect.signature(fn, follow_wrapped=False)
        except (TypeError, ValueError):  # a builtin or C function without one: the trace will say
            return
        try:
            sig.bind(*args[self.fallback_skip:], **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}: {e}") from None

    def _first_run(self, entry: _Entry, leaves: list, tree: Any, extra: tuple = (), key: tuple = ()) -> tuple:
        """The first call of a signature traces, partitions, lowers (forward and backward) and runs:
        (its outputs, the entry that ran them), as _call. Under config.compile_lock(); the entry is
        ready (other threads run it without the lock) once this returns."""
        tensors = [leaves[i] for i in entry.tensor_idx]
        try:
            _dense_only(tensors)
            self.trace_gen += 1  # odd while tracing: the module's tensors are swapped for traced ones
            try:
                with _tracing_flag(), _captures(), config.lazy_graph_modules(), _compiled_code_traced_through(), \
                        decisions.real_inputs(tensors):
                    if entry.traced_fn is not None:
                        _fuse_attention_first(entry, tensors, self.fuse_attention)
                    outs = self._traced_first(entry, tensors)
            finally:
                self.trace_gen += 1
        except config.ConfigError:
            self._forget(entry)
            raise
        except Exception as e:
            if entry.member and not isinstance(e, torch.OutOfMemoryError):
                # the family's graphs made no program for these sizes: traced on their own instead
                config.emit("cache", f"{self.name}: a family's program failed for a shape ({type(e).__name__}: {e}); "
                                     f"traced on its own")
                entry.family.refused.add(tuple(tuple(t.shape) for t in tensors))
                self._forget(entry)
                return self._call(tree, extra)
            if "inference" in entry.record.programs or "forward" in entry.record.programs or isinstance(
                    e, torch.OutOfMemoryError):
                raise  # captured and lowered: this is a failure of the run itself
            reason = f"{type(e).__name__}: {e}".strip()
            if self.fallback in ("eager", "dynamo"):
                if key:
                    self._uncaptured.add(_family_key(key))
                how = "eagerly" if self.fallback == "eager" else "through torch.compile(backend='aotfuse')"
                warnings.warn(f"aotfuse: could not capture {self.name} as one graph, running it {how}. Cause: "
                              f"{reason.splitlines()[0] if reason else type(e).__name__}", stacklevel=4)
                self._fall_back(entry)
                args, kwargs = tree
                entry.ready = True
                return entry.fallback(*args, **kwargs), entry
            self._forget(entry)  # the next call of this signature tries (and explains) again
            hint = ("an argument is an object holding tensors; inference with a KV cache runs with fallback='eager' "
                    "(generate() runs the original module)" if isinstance(e, ObjectInputError) else
                    "the forward keeps tensors in Python state (an attribute set to a tensor, as old-style "
                    "spectral_norm, weight_norm and pruning do): fallback='dynamo' replays such side effects, or use "
                    "torch.nn.utils.parametrizations" if isinstance(e, KeptStateError) else
                    "the forward draws Python or NumPy random numbers: fallback='dynamo' runs that Python at every "
                    "call (torch.rand and torch's other random ops are captured and draw anew each call)"
                    if isinstance(e, (RandomStateError, draws.UndecidedDrawError)) or "PythonDraw" in reason else
                    "Python hooks: register them on the compiled module instead (its own hooks run around each "
                    "compiled call), or let fallback='eager' run them as they are (fallback='dynamo' traces them as "
                    "torch.compile does)" if isinstance(e, HooksError) else
                    "its kernels cannot be built on this machine; AOTFUSE_BACKEND=aten runs without them"
                    if isinstance(e, BackendUnavailable) else "an op or argument the C core cannot take"
                    if isinstance(e, UnsupportedError) else "it reads a tensor that is not one of its inputs: a global "
                    "or closed-over tensor, or a module attribute that is neither a parameter nor a buffer; pass it as "
                    "an argument or register it with register_buffer (a compiled module passes its parameters and "
                    "buffers itself); or a custom autograd.Function whose backward runs a module (reversible "
                    "layers, Reformer's: by then its parameters are the real ones), which fallback='dynamo' "
                    "runs" if _reads_outside_tensor(e)
                    else "the graph was traced, but partitioning it failed: an aotfuse "
                    "bug, please report it with this message" if entry.record.partition_failed
                    else "it tests a random draw against a probability that does not decide it (LayerDrop's "
                    "`torch.rand([]) < p` with 0 < p < 1), so each call may take another branch: fallback='dynamo' "
                    "draws and branches at every call, or a probability of 0 (no LayerDrop) makes it one graph"
                    if entry.record.undecided_draws and "DataDependent" in reason
                    else "data-dependent control flow (on values that require grad: questions about inputs "
                         "that do not, masks and ids, are answered and guarded), an op AOTAutograd cannot trace, or "
                         "an error the function raises uncompiled too: AOTFUSE_DISABLE=1 runs it uncompiled")
            raise CaptureError(
                f"aotfuse could not capture {self.name} ({hint}).\nCause: {reason}\nWays out: "
                f"torch.compile(model, backend='aotfuse') splits the graph around what cannot be captured; "
                f"memory_efficient_fusion(model, fallback='dynamo') does that automatically for such functions; "
                f"fallback='eager' runs them eagerly (each with one warning); AOTFUSE_DISABLE=1 turns aotfuse "
                f"off.") from e
        entry.ready = True
        draws.replay(entry.record.python_draws)
        if self.bw_compiler is None:
            _no_zero_gradients(outs)
        return self._rebuild(entry.record, outs, tensors), entry

    def _traced_first(self, entry: _Entry, tensors: list) -> Any:
        """entry.compiled's first call (the trace); a trace that failed where convolutions ran
        channels-last (a view that layout cannot take, decompositions.LayoutRetry) is done again
        without, for this signature and the later ones."""
        try:
            return entry.compiled(*tensors)
        except Exception as e:
            record = entry.record
            if isinstance(e, torch.OutOfMemoryError) or "inference" in record.programs or "forward" in record.programs:
                raise
            why = f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            if record.layout_fired and not self._layout_off:
                config.emit("cache", f"{self.name}: traced again without channels-last convolutions {why}")
                self._layout_off = True
                record.layout_fired = False
            elif entry.traced_fn is not None and len(entry.traced_fn) > 1:
                # a rewrite of its attention the code behind it cannot take (a layout it relied on): as it is
                config.emit("cache", f"{self.name}: traced again without its attention rewritten {why}")
                del entry.traced_fn[0]
            else:
                raise
            record.programs.clear()
            record.graphs.clear()
            return self._traced_first(entry, tensors)

    def _forget(self, entry: _Entry) -> None:
        for k, e in list(self._cache.items()):
            if e is entry:
                del self._cache[k]
        self._last = None

    def _fall_back(self, entry: _Entry) -> None:
        """Makes `entry` run this function's fallback (eagerly, or under Dynamo with aotfuse's backend)."""
        target = self.fallback_fn if self.fallback == "eager" else self._dynamo()
        entry.fallback_target = target
        entry.fallback = functools.partial(_without_leading, target, self.fallback_skip) if self.fallback_skip else target

    def _dynamo(self) -> Callable:
        """The function under Dynamo with aotfuse as its backend: Dynamo splits the graph where
        Python must run (a data-dependent branch) and guards it; aotfuse compiles each piece."""
        if self._dynamo_fn is None:
            from .dynamo import aotfuse_backend

            # Dynamo's automatic dynamic shapes unless shape families are off: a size that changes makes
            # one symbolic graph (dynamic=False recompiled per sequence length and, past Dynamo's
            # recompile_limit of 8, ran the model eagerly without a word but a log line)
            mode = self._dynamic_mode()
            compiled = torch.compile(self.fallback_fn, backend=aotfuse_backend,
                                     dynamic=False if mode == "0" else True if mode == "1" else None)
            # NumPy draws (SpecAugment's masks) run as NumPy, so the fallback draws eager's numbers; by
            # default Dynamo traces them into torch's generator, whose numbers are others
            self._dynamo_fn = torch._dynamo.config.patch(use_numpy_random_stream=True)(compiled)
        return self._dynamo_fn

    def cache_clear(self) -> None:
        self._cache.clear()
        self._families.clear()
        self._first_shapes.clear()
        self._uncaptured.clear()
        self._last = None
        self.module_fallback = None
        self._warned.clear()
        self._decided = 0

    @property
    def records(self) -> list[_Record]:
        entries, seen = list(self._cache.values()), {}
        while entries:  # with the alternatives traced for other answers of their decisions
            e = entries.pop(0)
            if e.fallback is None:
                seen.setdefault(id(e.record), e.record)
            entries.extend((e.alternatives or {}).values())
        return list(seen.values())


def aot_function(fn: Callable, fw_compiler: Callable | None = None, bw_compiler: Callable | None = None,
                 partition_fn: Callable | None = None, decompositions: dict | None = None,
                 num_params_buffers: int = 0, keep_inference_input_mutations: bool = False,
                 inference_compiler: Callable | None = None, *, dynamic: bool | None = None,
                 enable_log: bool = True, fallback: str = "error",
                 max_cache_size: int | None = None) -> CompiledFunction:
    """Compiles `fn` (tensors, or pytrees of them, in and out) into C programs for its forward and
    backward, as functorch.compile.aot_function does. fw_compiler/bw_compiler default to aotfuse's
    C core; pass your own (gm, example_inputs) -> callable to use another.

    fallback: what a signature that cannot be captured as one graph (data-dependent Python control
    flow) does: "error" (raise CaptureError), "eager" (run eagerly, one warning) or "dynamo" (run
    under torch.compile with aotfuse's backend, which splits the graph there, one warning).

    dynamic: shape families (shapes.py). None (default): AOTFUSE_DYNAMIC, `auto` unless set: a
    signature's second shape is traced with the sizes that differ symbolic, once for the shapes that
    follow (each still gets a C program of its own, from that trace); True: from the first call,
    every size of the inputs after the num_params_buffers first; False: each shape traced on its own.

    Example:
        >>> f = aot_function(lambda x, y: (x * y).sin().sum())
        >>> f(torch.randn(3, requires_grad=True), torch.randn(3)).backward()
    """
    return CompiledFunction(fn, fw_compiler, bw_compiler, partition_fn, decompositions, num_params_buffers,
                            keep_inference_input_mutations, inference_compiler, fallback, max_cache_size,
                            dynamic=dynamic)


# Bumped whenever a module some AOTModule reads (_watched_modules) registers (or reassigns) a
# parameter, buffer or submodule, through torch's global registration hooks: an AOTModule's list of
# where its tensors live stays valid until then, so a call reads ~200 dict entries instead of
# walking the module tree twice (3 ms a step on a 12-layer model). Modules outside every compiled
# tree (a loss module a forward builds per call, as Hugging Face's models do; another model) do not
# bump it: at the host regime's Bert size they made every compiled forward walk again, 0.8 ms.
_structure_version = [0]
# a module tree (its modules' ids, in modules() order) -> a small number for signatures to hold
_tree_ids: dict[tuple, int] = {}
_training = operator.attrgetter("training")
_dropout_p = operator.attrgetter("p")
_structure_hooks: list = []
_watched_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _structure_changed(module: Any = None, *_args: Any) -> None:
    # not while Dynamo traces a forward that registers something (an nn.ModuleList sliced, as in
    # Hugging Face's Phi and Gemma): it would guard that graph on the WeakSet's contents, so any model
    # compiled or collected later recompiled it (eagerly past the recompile limit), and a collection
    # during its compile crashed Dynamo's guard building (IndexError), whatever its backend
    if torch.compiler.is_dynamo_compiling():
        return
    if module is None or module in _watched_modules:
        _structure_version[0] += 1


def _watch_module_structure() -> None:
    if not _structure_hooks:
        from torch.nn.modules import module as torch_module

        for register in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
                         "register_module_module_registration_hook"):
            _structure_hooks.append(getattr(torch_module, register)(_structure_changed))


def _tensor_refs(mod: nn.Module, kind: str) -> list:
    """(name, owning dict, key, index of the first name of the same tensor or -1) for every named
    parameter or buffer, in named_parameters()/named_buffers() order, tied tensors included."""
    refs, first = [], {}
    for prefix, m in mod.named_modules():
        d = getattr(m, kind)
        for k, v in d.items():
            if v is None:
                continue
            refs.append((f"{prefix}.{k}" if prefix else k, d, k, first.get(id(v), -1)))
            first.setdefault(id(v), len(refs) - 1)
    return refs


def _read_refs(refs: list) -> dict | None:
    """{name: tensor} for the refs' first names; None when the ties or the names changed behind the
    registration hooks (a deleted attribute, a dict written directly)."""
    values, out = [], {}
    for name, d, k, alias in refs:
        v = d.get(k)
        if v is None or (alias >= 0 and v is not values[alias]):
            return None
        values.append(v)
        if alias < 0:
            out[name] = v
    if len(out) != len({id(v) for v in out.values()}):  # two first names now share a tensor: re-tie
        return None
    return out


# Module hooks a capture runs: forward, forward pre, backward and backward pre (each module's own
# dict and torch's global one; a with_kwargs or always_called hook is in these dicts too).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class ObjectInputError(RuntimeError):
    """An argument is a Python object holding tensors (transformers' DynamicCache): its tensors would
    be constants of the trace, and what the call does to the object (a cache's update) would happen
    once, while tracing. The signature is not captured: CaptureError, or the function's fallback."""


class KeptStateError(RuntimeError):
    """A capture's forward left a traced tensor in a module attribute (`self.prev = y.detach()`, the
    old spectral_norm and pruning hooks' weights): a compiled graph cannot replay it. The signature
    is not captured: CaptureError, or the function's fallback."""


class RandomStateError(RuntimeError):
    """A capture's forward drew Python or NumPy random numbers other than the scalar draws
    draws.python_draws answers (Wav2Vec2's SpecAugment masks, ``from random import random``): tracing
    runs that Python once, so the graph would keep the first call's numbers for every call (draws.py).
    The signature is not captured: CaptureError, or the function's fallback."""


class HooksError(RuntimeError):
    """A capture met Python hooks (module hooks, or hooks the forward registers on tensors): a
    captured graph would run them once, while tracing, with traced tensors, never at run time, so
    their side effects (recording activations, counting calls) would be lost. The signature is not
    captured: CaptureError, or the function's fallback."""


def _pure_hook(fn: Any) -> bool:
    """Hooks known to act only through the values of the forward they run in, which a trace keeps:
    torch's own (quantization observers: buffers updated in place; weight_norm's old-style hook keeps
    its weight in module state, which fails the capture by name) and transformers' (its recording of
    output_hidden_states and output_attentions: the hook appends to a list the same forward returns;
    gradient checkpointing's hook making the input embeddings require grad)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    where = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", None) or ""
    if where == "torch" or where.startswith("torch.") or where == "transformers.utils.output_capturing":
        return True
    # transformers' gradient_checkpointing_enable() installs it on the input embeddings of every model
    # taking input_ids: `output.requires_grad_(True)`, on the forward's own value
    return where == "transformers.modeling_utils" and getattr(fn, "__name__", "") == "make_inputs_require_grads"


def _global_hooks() -> list:
    from torch.nn.modules import module as torch_module

    return [("torch.nn.modules.module._global" + k, getattr(torch_module, "_global" + k)) for k in _HOOK_DICTS
            if isinstance(getattr(torch_module, "_global" + k, None), dict)]


def _is_probe(fn: Any) -> bool:
    return isinstance(getattr(fn, "__self__", None), _HookProbe)


def _hook_dicts(mod: nn.Module) -> list:
    """(where, hook dict) for every non-empty hook dict a call of `mod` runs. A global dict holding
    only _HookProbe's hook (another thread tracing meanwhile) counts as empty."""
    found = [(where, d) for where, d in _global_hooks() if d and not all(map(_is_probe, list(d.values())))]
    for prefix, m in mod.named_modules():
        for k in _HOOK_DICTS:
            d = m.__dict__.get(k)
            if d:
                found.append((f"{prefix or type(mod).__name__}.{k.lstrip('_')}", d))
    return found


class _HookProbe:
    """Around one tracing pass of the user's function: a global forward pre-hook that, on the tracing
    thread, looks at each module about to run (the root too) before its own hooks do. An impure hook
    stops the pass there (HooksError, naming it); the pure ones' handle ids are noted, so that
    check(), after the pass, refuses any other hook handle made meanwhile (Tensor.register_hook, a
    hook on a grad_fn) before the backward is traced."""

    def __init__(self, name: str, root: nn.Module | None = None) -> None:
        self.name = name
        self.root = root  # names the modules by their path in it, where they are in it
        self.thread = threading.get_ident()
        self.pure_ids: set[int] = set()

    def _note(self, where: Callable[[], str], hooks: dict) -> None:
        impure = []
        for hid, fn in hooks.items():
            if _pure_hook(fn):
                self.pure_ids.add(hid)
            else:
                impure.append(f"{where()}: {getattr(fn, '__qualname__', type(fn).__name__)}")
        if impure:
            raise HooksError(f"{self.name} runs Python hooks a captured graph would run once, while tracing, not at "
                             f"each call: {'; '.join(impure[:4])}{' ...' if len(impure) > 4 else ''}")

    def _where(self, module: nn.Module, kind: str) -> str:
        names = {id(m): n for n, m in self.root.named_modules()} if self.root is not None else {}
        return f"{names.get(id(module)) or type(module).__name__}.{kind.lstrip('_')}"

    def _pre_hook(self, module: nn.Module, _args: Any) -> None:
        if threading.get_ident() == self.thread:  # not another thread's eager modules
            for k in _HOOK_DICTS:
                hooks = module.__dict__.get(k)
                if hooks:
                    self._note(functools.partial(self._where, module, k), hooks)

    def __enter__(self) -> "_HookProbe":
        from torch.nn.modules.module import register_module_forward_pre_hook

        for where, hooks in _global_hooks():
            self._note(lambda where=where: where, hooks)
        self.start = RemovableHandle.next_id
        self.handle = register_module_forward_pre_hook(self._pre_hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()
        self.end = RemovableHandle.next_id

    def check(self) -> None:
        if set(range(self.start, self.end)) - self.pure_ids - {self.handle.id}:
            raise HooksError(f"{self.name} registers hooks (Tensor.register_hook, a module hook, ...) a captured "
                             f"graph would run once, while tracing, not at each call")


class AOTModule(nn.Module):
    """A compiled view of a module: it shares the original's parameters, buffers and submodules
    (so state_dict keys, optimizers and .to() see the same tensors) and runs through aotfuse."""

    def __init__(self, mod: nn.Module, compiled: CompiledFunction, options: tuple = ((), {})):
        super().__init__()
        _watch_module_structure()
        object.__setattr__(self, "_aotfuse_options", options)  # aot_module's arguments after the module
        object.__setattr__(self, "_aotfuse_refs", None)
        object.__setattr__(self, "_aotfuse_hooks", None)
        # (structure version, modules, the tree's number, dropouts, their submodule dicts, the dicts' lengths)
        object.__setattr__(self, "_aotfuse_tree", None)
        object.__setattr__(self, "_aotfuse_ddp", None)  # the ddp.Sync of the synced call in progress (ddp.Calls)
        object.__setattr__(self, "_aotfuse_ddp_ran", False)  # whether that call ran a program that syncs
        object.__setattr__(self, "orig_module", mod)  # not a submodule: keys stay unprefixed
        self._parameters = mod._parameters
        self._buffers = mod._buffers
        self._modules = mod._modules
        self._non_persistent_buffers_set = mod._non_persistent_buffers_set
        object.__setattr__(self, "_aotfuse_compiled", compiled)
        self.training = mod.training

    def train(self, mode: bool = True) -> "AOTModule":
        self.orig_module.train(mode)
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mod = self.orig_module
        compiled = self._aotfuse_compiled
        if config.disabled():
            return mod(*args, **kwargs)
        if _peek_interpreter_stack() is not None:  # also while Dynamo traces a model holding this view
            _warn_transform(compiled.name)
            return mod(*args, **kwargs)
        if _capturing.depth:
            # called by a function aotfuse captures (a compiled block in a model compiled again): traced
            # through, so the enclosing graph (and its program) gets its ops
            return mod(*args, **kwargs)
        sync = self._aotfuse_ddp
        if sync is None:
            # DDP(memory_efficient_fusion(model)): the first call inside a DDP's forward hooks the DDP so
            # that its later synced calls all-reduce in the compiled backward (ddp.watch); this one, already
            # prepared by DDP's reducer, runs eagerly if it is such a call
            active = getattr(DistributedDataParallel, "_active_ddp_module", None)
            if active is not None and active._modules.get("module") is self and active not in ddp.MANAGED:
                if ddp.watch(active, self):
                    return mod(*args, **kwargs)
        extra = (self._state_key(), self._hooks_key(), sync)
        shortcut = compiled.module_fallback
        if shortcut is not None:  # these arguments fell back before: no tensor walk, no lookup
            leaves, spec = tree_flatten((args, kwargs))
            if _signature(leaves, spec, extra) == shortcut[0]:
                return shortcut[1](*args, **kwargs)
        # each tensor once: functional_call re-ties tied weights (HF embeddings and LM heads)
        gen = compiled.trace_gen
        params, buffers = self._tensors()
        if gen & 1 or compiled.trace_gen != gen:  # another thread's trace had swapped in its fake tensors
            with config.compile_lock():
                params, buffers = self._tensors()
        out, entry = compiled._call(((params, buffers) + args, kwargs), extra)
        if sync is not None:
            object.__setattr__(self, "_aotfuse_ddp_ran", entry is not None and entry.fallback is None
                               and entry.record is not None and entry.record.ddp == sync)
        if entry is not None and entry.fallback is not None:
            leaves, spec = tree_flatten((args, kwargs))
            compiled.module_fallback = (_signature(leaves, spec, extra), entry.fallback_target)
        return out

    def _state_key(self) -> tuple:
        """The module tree's part of each signature: which modules it holds (a submodule replaced or
        added makes another signature: the programs traced the old one), their training flags (one
        bool while all agree; each module's where they differ: a batch norm frozen by .eval() in a model
        training) and the dropout modules' p (a dropout schedule). The tree is walked again only when a
        module registered anything anywhere (_structure_version) or a submodule dict's length changed
        behind the hooks; flags, p and the lengths are read at each call (23 us for Bert-base's 233
        modules). Other Python attributes a forward reads are constants of the programs traced
        (README, Troubleshooting)."""
        cached = self._aotfuse_tree
        if cached is not None and cached[0] == _structure_version[0] and tuple(map(len, cached[4])) != cached[5]:
            # a submodule dict written directly, past the registration hooks (Sequential.insert,
            # ModuleList.pop, del model[i]): the tree, and every cache keyed by the version, are stale
            _structure_version[0] += 1
        if cached is None or cached[0] != _structure_version[0]:
            mods = list(self.orig_module.modules())
            tree = _tree_ids.setdefault(tuple(map(id, mods)), len(_tree_ids))
            dropouts = [m for m in mods if isinstance(m, nn.modules.dropout._DropoutNd)]
            dicts = [m._modules for m in mods]
            cached = (_structure_version[0], mods, tree, dropouts, dicts, tuple(map(len, dicts)))
            object.__setattr__(self, "_aotfuse_tree", cached)
        flags = tuple(map(_training, cached[1]))
        return (cached[2], flags[0] if flags.count(flags[0]) == len(flags) else flags,
                tuple(map(_dropout_p, cached[3])))

    def _hooks_key(self) -> tuple:
        """The module hooks a call would run (where, and their ids): part of each signature, so a hook
        registered or removed after a signature was compiled makes another (HooksError refuses the
        impure ones). Rebuilt only when a hook handle was made anywhere (RemovableHandle.next_id), a
        hook dict that had hooks changed size, or the module tree changed (_structure_version)."""
        cached = self._aotfuse_hooks
        if (cached is not None and cached[0] == RemovableHandle.next_id and cached[1] == _structure_version[0]
                and all(len(d) == n for d, n in cached[3])):
            return cached[2]
        next_id, version = RemovableHandle.next_id, _structure_version[0]
        found = _hook_dicts(self.orig_module)
        # not the probe of a trace running on another thread: its hook id would make a signature
        # that no later call has (each thread's first call compiled again; test_threads)
        key = tuple((where, tuple(h for h, fn in list(d.items()) if not _is_probe(fn))) for where, d in found)
        object.__setattr__(self, "_aotfuse_hooks", (next_id, version, key, [(d, len(d)) for _, d in found]))
        return key

    def _tensors(self) -> tuple[dict, dict]:
        """dict(named_parameters()), dict(named_buffers()) of the module, without walking it while
        its structure is unchanged (_structure_version)."""
        cached = self._aotfuse_refs
        if cached is not None and cached[0] == _structure_version[0]:
            params, buffers = _read_refs(cached[1]), _read_refs(cached[2])
            if params is not None and buffers is not None:
                return params, buffers
        mod = self.orig_module
        version = _structure_version[0]
        _watched_modules.add(self)  # shares mod's dicts: registering on it changes mod
        for m in mod.modules():
            _watched_modules.add(m)
        refs = (version, _tensor_refs(mod, "_parameters"), _tensor_refs(mod, "_buffers"))
        object.__setattr__(self, "_aotfuse_refs", refs)
        return dict(mod.named_parameters()), dict(mod.named_buffers())

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "orig_module":
                raise
            return getattr(self.orig_module, name)  # config, generation helpers, ...

    # what the original module shares with this view; the rest of __dict__ (its own hooks, training) is its own
    _SHARED = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "orig_module",
                         "_aotfuse_compiled", "_aotfuse_refs", "_aotfuse_hooks", "_aotfuse_tree", "_aotfuse_options", "compiled_module",
                         "_aotfuse_lock", "_aotfuse_calls"})

    def __reduce_ex__(self, protocol: int) -> tuple:
        """copy.deepcopy and pickle (torch.save of the whole model): the original module, copied or
        pickled as itself, compiled again with the same options when rebuilt (the C programs are not
        copied: the copy compiles its own at its first call, from the kernel cache on disk)."""
        args, kwargs = self._aotfuse_options
        own = {k: v for k, v in self.__dict__.items() if k not in self._SHARED}
        return (_rebuild_aot_module, (self.orig_module, args, kwargs), own)

    def _replicate_for_data_parallel(self) -> nn.Module:
        # DataParallel's replicas would each get copies of the parameters, while the compiled view
        # reads the original module's: every replica would compute with the first device's weights
        raise RuntimeError("aotfuse: DataParallel over several devices cannot replicate a compiled module; "
                           "use DistributedDataParallel (one process per device) around it, or compile the "
                           "DistributedDataParallel itself")


class AOTDataParallel(AOTModule):
    """The compiled view of a DistributedDataParallel (or a single-device DataParallel).

    The wrapper's own forward runs, with everything it does around its module: DDP's buffer broadcast,
    its reducer's bookkeeping for the backward's gradient all-reduce, find_unused_parameters' walk of the
    autograd graph from the outputs. Only its call of `module` goes to the compiled inner module
    (`compiled_module`, an AOTModule): during each call the wrapper's `module` entry is that view. It shares
    the wrapper's parameters, buffers and submodules (state_dict keys keep their `module.` prefix), and
    every other attribute (`no_sync`, `join`, `module`) is the wrapper's.
    """

    def __init__(self, wrapper: nn.Module, inner: AOTModule, options: tuple | None = None):
        super().__init__(wrapper, inner._aotfuse_compiled, options or inner._aotfuse_options)
        object.__setattr__(self, "compiled_module", inner)
        object.__setattr__(self, "_aotfuse_lock", threading.RLock())
        object.__setattr__(self, "_aotfuse_calls", ddp.Calls())  # the synced calls' bookkeeping
        ddp.MANAGED[wrapper] = self._aotfuse_calls  # its module, the inner view during a call, never watches it

    def train(self, mode: bool = True) -> "AOTDataParallel":
        self.orig_module.train(mode)  # the wrapper's train() sets its module's
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        wrapper, inner = self.orig_module, self.compiled_module
        with self._aotfuse_lock:
            mod = wrapper._modules["module"]
            if mod is not inner.orig_module:
                raise RuntimeError(f"aotfuse: the {type(wrapper).__name__}'s module was replaced after it was "
                                   f"compiled; compile the wrapper again")
            # a call DDP would sync: its reducer stands by (as under no_sync) and the compiled backward
            # all-reduces the gradients bucket by bucket as it makes them (ddp.py)
            calls = self._aotfuse_calls
            calls.begin(wrapper, inner)
            wrapper._modules["module"] = inner  # a plain dict write: no registration hooks, no recompile
            returned = False
            try:
                out = wrapper(*args, **kwargs)
                returned = True
            finally:
                wrapper._modules["module"] = mod
                calls.end(wrapper, returned)
            return out


def _data_parallel_wrapper(mod: nn.Module) -> str | None:
    """"ddp" or "dp" for a wrapper aot_module compiles through its inner module; None for any other
    module; raises for the sharded wrappers and sharded parameters it cannot compile."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(mod, DistributedDataParallel):
        return "ddp"
    if isinstance(mod, DataParallel):
        if len(mod.device_ids) > 1:
            raise NotImplementedError(
                f"aotfuse cannot compile a DataParallel over {len(mod.device_ids)} devices (each replica would need "
                f"its own program over its own weights); use DistributedDataParallel, one process per device, "
                f"and compile it or the module inside it")
        return "dp"
    sharded = None  # neither can exist before its module is imported: no import here
    fsdp, dtensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in mod.modules()):
        sharded = "a FullyShardedDataParallel"
    elif dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in (*mod.parameters(), *mod.buffers())):
        sharded = "DTensor parameters (fully_shard, tensor parallel)"
    if sharded is not None:
        raise NotImplementedError(
            f"aotfuse cannot compile a module holding {sharded}: its programs take whole, local tensors; "
            f"DistributedDataParallel is supported (DDP(memory_efficient_fusion(model)) or "
            f"memory_efficient_fusion(DDP(model)))")
    return None


def aot_module(mod: nn.Module, *args: Any, **kwargs: Any) -> AOTModule:
    """Compiles an nn.Module: aot_function over the module's functional form, with its parameters
    and buffers as inputs. Takes aot_function's keyword arguments."""
    if not isinstance(mod, nn.Module):
        raise TypeError(f"aot_module takes an nn.Module, got {type(mod).__name__}")
    if _data_parallel_wrapper(mod) is not None:  # traced, the wrapper's gradient sync would be lost
        return AOTDataParallel(mod, aot_module(mod.module, *args, **kwargs))

    def functional_call(params: dict, buffers: dict, *a: Any, **k: Any) -> Any:
        return torch.func.functional_call(mod, {**params, **buffers}, a, k)

    functional_call.__qualname__ = type(mod).__name__
    n = len(list(mod.named_parameters())) + len(list(mod.named_buffers()))
    compiled = aot_function(functional_call, *args, num_params_buffers=n, **kwargs)
    # AOTModule passes the module's own tensors: a fallback calls the module itself (functional_call
    # would swap each of them in and out on every call: 2 ms of a host-size Longformer step)
    compiled.fallback_fn, compiled.fallback_skip = mod, 2
    return AOTModule(mod, compiled, (args, kwargs))


def _rebuild_aot_module(mod: nn.Module, args: tuple, kwargs: dict) -> AOTModule:
    """AOTModule.__reduce_ex__'s constructor: aot_module again, over the copied or unpickled module."""
    return aot_module(mod, *args, **kwargs)


def memory_efficient_fusion(fn: Callable | nn.Module, **kwargs: Any) -> Callable | AOTModule:
    """Compiles a function or module for training with aotfuse's C core.

    Example:
        >>> model = memory_efficient_fusion(model)
        >>> model(input_ids=ids, labels=labels).loss.backward()

    Keyword arguments override aot_function's (fw_compiler, partition_fn, fallback="eager", ...).
    The partition is aotfuse's min-cut rematerialization unless partition_fn is given.
    """
    kwargs.setdefault("partition_fn", min_cut_rematerialization_partition)
    if isinstance(fn, nn.Module):
        return aot_module(fn, **kwargs)
    return aot_function(fn, **kwargs)
