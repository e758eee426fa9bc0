"""Activation checkpointing (torch.utils.checkpoint) inside a compiled function.

Eager checkpointing keeps a region's inputs and recomputes the region in the backward; a user turns
it on (`model.gradient_checkpointing_enable()`, `checkpoint(block, x, use_reentrant=False)`) to trade
compute for memory. Traced as it is, a region leaves no trace in the joint graph (its backward
recompute reads the forward's values), and the partitioner would save whatever its cut prefers:
the memory the user asked to give back stays taken.

So, as torch.compile does (its `tag_activation_checkpoint`), each region is traced under
selective-checkpoint contexts that tag the region's nodes `recompute` (PREFER_RECOMPUTE, or the
user's own policy's choice) with the region's number (`ac_graph_id`), and the C partitioner never
saves a node to recompute: the backward runs it again from what is saved before it, a matmul too
(`node_policy`, partition.h).

- `regions()`: entered by each tracing pass of memory_efficient_fusion/aot_function (compile.py's
  flat_fn). While it is active, on the tracing thread, torch.utils.checkpoint's non-reentrant
  generator runs the region under the tagging contexts, and a reentrant checkpoint whose inputs
  need gradients is traced as a non-reentrant one (what torch.compile does too; a reentrant one
  whose inputs need none keeps eager's meaning: no gradients through it). Other threads, and calls
  outside a trace, see torch's own functions. Under torch.compile(backend="aotfuse") Dynamo makes
  the regions itself and the same tags arrive.
- `node_policies(graph)`: the tags as the C partitioner's per-node policy, after torch's clean-up:
  a region's output that a later region reads is saved (else each region would recompute all the
  ones before it), and an ATen random op is saved, not drawn again.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx

from . import config

__all__ = ["regions", "pre_dispatch", "node_policies", "replay_with_tags", "tagged", "UserPolicyError", "NONE",
           "RECOMPUTE", "SAVE"]

NONE, RECOMPUTE, SAVE = 0, 1, 2  # af_node_policy

_state = threading.local()  # .depth: regions() entered on this thread
_ids = itertools.count(1)
_patch_lock = threading.Lock()
_patched = {"count": 0, "originals": None}


class UserPolicyError(RuntimeError):
    """A selective-checkpoint policy met while tracing at the pre-dispatch level (attention.py)."""


def _active() -> bool:
    """regions() entered on this thread, and a trace under way (not an eager call of the function)."""
    if getattr(_state, "depth", 0) <= 0:
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def _policy_of(tag: Any) -> int:
    from torch.utils.checkpoint import CheckpointPolicy

    if tag in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        return RECOMPUTE
    if tag in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
        return SAVE
    return NONE


def _tagging_context_fn(user_context_fn: Any, region: int) -> Any:
    """The contexts a region's forward and recompute run under: torch's selective-checkpoint pair
    with every op preferring recompute, or the user's own pair (create_selective_checkpoint_contexts
    with a policy), numbered so that a later region's reads of an earlier one are told apart."""
    import torch.utils.checkpoint as ckpt

    def context_fn():
        if user_context_fn is ckpt.noop_context_fn:
            fwd, recompute = ckpt.create_selective_checkpoint_contexts(
                lambda ctx, op, *a, **k: ckpt.CheckpointPolicy.PREFER_RECOMPUTE)
        else:
            fwd, recompute = user_context_fn()
        if isinstance(fwd, ckpt._CachingTorchDispatchMode):
            fwd.ac_graph_id = region
        return fwd, recompute
    return context_fn


def _generator(original: Any, signature: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
    """torch.utils.checkpoint's non-reentrant generator (`_generator_name`), tagging the region while a
    trace is active on this thread. Its arguments are bound by name (fn, preserve_rng_state,
    context_fn, determinism_check, debug, and early_stop where this torch has it, then the
    function's own), so another torch's order of them is read right."""
    import torch.fx.traceback as fx_traceback
    import torch.utils.checkpoint as ckpt

    if not _active():
        yield from original(*args, **kwargs)
        return
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    context_fn = bound.arguments.get("context_fn", ckpt.noop_context_fn)
    if getattr(_state, "pre_dispatch", 0) and context_fn is not ckpt.noop_context_fn:
        # attention.py's pre-dispatch graph would keep the region but not the policy's choice per op
        raise UserPolicyError("a checkpoint with its own context_fn (a selective policy)")
    region = next(_ids)
    # The recompute reads the values cached by the forward's contexts: nothing random is drawn
    # again (no RNG state to keep), and all of them (no early stop), torch.compile's settings.
    bound.arguments["preserve_rng_state"] = False
    bound.arguments["context_fn"] = _tagging_context_fn(context_fn, region)
    if "early_stop" in bound.arguments:
        bound.arguments["early_stop"] = False
    # every node the region makes carries its tags, at any tracing level (the SAC contexts tag the
    # ATen nodes of AOTAutograd's trace; attention.py's pre-dispatch graph has its own nodes, whose
    # tags its replay hands on)
    with fx_traceback.preserve_node_meta():
        meta = fx_traceback.get_current_meta()
        meta["recompute"], meta["ac_graph_id"] = ckpt.CheckpointPolicy.PREFER_RECOMPUTE, region
        yield from original(*bound.args, **bound.kwargs)


class _ReentrantFunction:
    """torch.utils.checkpoint.CheckpointFunction while a trace is active: `apply` traces the region as
    a non-reentrant checkpoint where an input needs gradients (a reentrant backward cannot be traced:
    it calls autograd inside the backward), else as eager would (no gradients through it)."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def apply(self, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        import torch.utils.checkpoint as ckpt

        needs_grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if not _active() or not needs_grad:
            return self.original.apply(function, preserve_rng_state, *args)
        return ckpt.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


def _generator_name(ckpt: Any) -> str:
    """The generator torch.utils.checkpoint.checkpoint(use_reentrant=False) runs: from torch 2.14
    `_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state, ...)`, which
    checkpoint calls directly and the older name (kept for other callers) calls too; before 2.14
    `_checkpoint_without_reentrant_generator(fn, preserve_rng_state, ..., *args, **kwargs)`."""
    impl = "_checkpoint_without_reentrant_generator_impl"
    return impl if hasattr(ckpt, impl) else "_checkpoint_without_reentrant_generator"


def _install() -> None:
    import torch.utils.checkpoint as ckpt

    with _patch_lock:
        if _patched["count"] == 0:
            name = _generator_name(ckpt)
            gen, func = getattr(ckpt, name), ckpt.CheckpointFunction
            _patched["originals"] = (name, gen, func)
            setattr(ckpt, name, functools.partial(_generator, gen, inspect.signature(gen)))
            ckpt.CheckpointFunction = _ReentrantFunction(func)
        _patched["count"] += 1


def _uninstall() -> None:
    import torch.utils.checkpoint as ckpt

    with _patch_lock:
        _patched["count"] -= 1
        if _patched["count"] == 0:
            name, gen, ckpt.CheckpointFunction = _patched["originals"]
            setattr(ckpt, name, gen)
            _patched["originals"] = None


def _supported() -> bool:
    import torch.utils.checkpoint as ckpt

    return all(hasattr(ckpt, name) for name in (_generator_name(ckpt), "CheckpointFunction",
                                                 "create_selective_checkpoint_contexts", "_CachingTorchDispatchMode",
                                                 "CheckpointPolicy", "noop_context_fn"))


@contextlib.contextmanager
def regions() -> Iterator[None]:
    """While active on this thread, torch.utils.checkpoint regions tag their traced nodes."""
    if not config.checkpoint_regions() or not _supported():  # off, or another torch: traced through
        yield
        return
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        _uninstall()


@contextlib.contextmanager
def pre_dispatch() -> Iterator[None]:
    """While active, a region with a selective policy raises UserPolicyError (attention.py's trace)."""
    _state.pre_dispatch = getattr(_state, "pre_dispatch", 0) + 1
    try:
        yield
    finally:
        _state.pre_dispatch -= 1


def tagged(gm: fx.GraphModule) -> bool:
    """Whether gm has nodes of checkpointed regions."""
    return any("ac_graph_id" in n.meta for n in gm.graph.nodes)


def replay_with_tags(gm: fx.GraphModule) -> fx.GraphModule:
    """gm, called through an fx Interpreter that hands each node's tags to the nodes a trace of the call
    makes (attention.py's pre-dispatch graph, traced again by AOTAutograd: its regions stay regions)."""
    import torch.fx.traceback as fx_traceback

    def forward(*args: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm).run(*args)
    gm.forward = forward
    return gm


def _region(node: fx.Node) -> Any:
    return node.meta.get("ac_graph_id")


def _draws(node: fx.Node) -> bool:
    """Whether running node again would draw other random numbers: an ATen op tagged
    nondeterministic_seeded, except an attention kernel called with dropout_p=0."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


def mutated_placeholders(graph: fx.Graph) -> set:
    """The graph's inputs that the step updates after the forward: AOTAutograd's joint graph names
    each forward output that is an input's new value (its output `desc`, InputMutationAOTOutput,
    holding the input's own desc)."""
    output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    descs = output.meta.get("desc") if output is not None else None
    mutated = [getattr(d, "mutated_input", None) for d in (descs or ())]
    mutated = [m for m in mutated if m is not None]
    if not mutated:
        return set()
    return {n for n in graph.nodes if n.op == "placeholder" and n.meta.get("desc") in mutated}


def _reads_mutated_input(graph: fx.Graph) -> set[str]:
    """Nodes reading (directly or through views) a graph input that the step updates after the
    forward (AOTAutograd's InputMutationAOTOutput: a batch norm's running statistics). Run again in
    the backward, such a node would read the input after its update (autograd's version check
    refuses a saved input modified in place)."""
    held = mutated_placeholders(graph)
    if not held:
        return set()
    readers = set()
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in held for a in node.all_input_nodes):
            continue
        if getattr(node.target, "is_view", False):
            held.add(node)
        else:
            readers.add(node.name)
    return readers


def _never_rerun(node: fx.Node) -> bool:
    """Whether running node again in the backward would be wrong: it draws random numbers (_draws)
    or mutates an argument."""
    schema = getattr(node.target, "_schema", None)
    return _draws(node) or (schema is not None and schema.is_mutable)


def node_policies(graph: fx.Graph, budget: bool = False) -> dict[str, int]:
    """Per node name, the C partitioner's policy (RECOMPUTE, SAVE; absent: NONE) from the graph's
    checkpoint tags; empty where nothing is tagged and budget is False. budget: a memory budget
    below 1 may have the partitioner recompute matmuls too, so every node that must not run again
    is SAVE."""
    policy = {n.name: _policy_of(n.meta.get("recompute")) for n in graph.nodes if n.op == "call_function"}
    policy = {k: v for k, v in policy.items() if v != NONE} if config.checkpoint_regions() else {}
    if not policy and not budget:
        return {}
    readers = _reads_mutated_input(graph)
    never = {}
    if budget:
        never = {n.name: SAVE for n in graph.nodes if n.op == "call_function" and _never_rerun(n)}
        never.update(dict.fromkeys(readers, SAVE))
    if not policy:
        return never
    for name in readers:
        if policy.get(name) == RECOMPUTE:
            policy[name] = SAVE  # a batch norm in a region: its running statistics are updated after the forward
    tagged = dict(policy)  # the tags as traced (the loop below changes policy)
    tagged_save = {name for name, v in policy.items() if v == SAVE}
    for node in graph.nodes:
        forward_users = [u for u in node.users if u.meta.get("partitioner_tag") != "is_backward"]
        if node.name in tagged_save and forward_users and all(
                u.name in tagged_save and _region(u) == _region(node) for u in forward_users):
            # inside an op a policy saves that was decomposed while tracing (a GELU's erf): its output
            # is saved, and what leads up to it is the partitioner's to decide
            del policy[node.name]
            continue
        if policy.get(node.name) != RECOMPUTE:
            continue
        if _draws(node):
            policy[node.name] = SAVE  # an ATen draw would draw other numbers in the backward
            continue
        # a region's output (read in the forward by a node outside the region: a later region, a
        # residual add or a norm between regions) is saved: the backward's recompute of the regions
        # after it starts there, not from the model's input (a residual stream through every
        # region would otherwise be recomputable from the input alone, and nothing be saved)
        if any(u.meta.get("partitioner_tag") != "is_backward" and not (
                u.name in tagged and _region(u) == _region(node)) for u in node.users):
            policy[node.name] = SAVE
    return {**policy, **never}
