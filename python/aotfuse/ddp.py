"""DistributedDataParallel's gradient all-reduce inside the compiled backward, bucket by bucket.

`memory_efficient_fusion(DDP(model))` runs DDP's own forward around the compiled module
(compile.AOTDataParallel). Left to DDP's reducer, the all-reduce of the gradients would start only when
the compiled backward (one autograd node) returns them all at once. Instead, for a call DDP would sync,
the reducer is told to stand by (as under `no_sync()`) and the backward program all-reduces the
gradients itself: in DDP's first buckets (the parameters in reverse order, a first bucket of 1 MiB, then
`bucket_cap_mb`), each flattened, divided by the world size and handed to torch's functional all-reduce
(`_c10d_functional.all_reduce_`, in place, asynchronous: gloo's thread, NCCL's stream) right after its
last gradient is computed (and after the bucket ahead's), every bucket waited for at the end of the
backward, its gradients returned as views of it. So the communication runs while the rest of the
backward computes, as in eager DDP. A call that ran outside such a program (a fallback, a full cache)
all-reduces the same buckets in the same order when its backward ends (AfterBackward), so ranks that
took different paths issue matching collectives.

Calls where DDP does something this does not (find_unused_parameters, static_graph, join(), comm hooks,
mixed precision, ignored parameters, hooks on parameters' gradients, a module across devices), or with
AOTFUSE_DDP_OVERLAP=0, keep DDP's reducer: the all-reduce after the backward. The synced call after
grad-enabled calls under `no_sync()` (gradient accumulation) adds each parameter's accumulated .grad to
its bucket before the all-reduce, as DDP all-reduces the accumulated sums. Everything that decides is
the same on every rank.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
import weakref

import torch
import torch.fx as fx

from . import config

__all__ = ["Sync", "plan", "layout", "insert_all_reduces", "AfterBackward", "Calls", "watch"]

aten = torch.ops.aten

_lib = torch.library.Library("aotfuse", "FRAGMENT")
_lib.define("ddp_wait(Tensor(a) bucket) -> Tensor(a)")


def _ddp_wait(bucket: torch.Tensor) -> torch.Tensor:
    """Waits for the functional all-reduce that made `bucket`; returns a view of it (the schema's alias:
    the runtime keeps the bucket's storage for its readers and never hands it to another value)."""
    torch.ops._c10d_functional.wait_tensor(bucket)
    return bucket.view(bucket.shape)


_lib.impl("ddp_wait", _ddp_wait, "CompositeExplicitAutograd")
_lib.define("ddp_add_accumulated(Tensor flat, int token, int[] params) -> Tensor")

# Sync.token -> the parameters (module.parameters() order) of the wrapper whose synced call follows
# no_sync() accumulation; dropped with the wrapper
_ACCUMULATED: dict[int, list] = {}
_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_token_numbers = itertools.count(1)


def _ddp_add_accumulated(flat: torch.Tensor, token: int, params: list[int]) -> torch.Tensor:
    """A bucket's new gradients (`flat`, flattened) plus what its parameters accumulated under no_sync()
    on this rank alone, which it takes from them (.grad set to None: autograd's accumulation then gives
    each parameter its slice of the all-reduced bucket as it is). So the all-reduce averages the
    accumulated sums, as DDP's reducer does at the synced call after no_sync() (it all-reduces .grad)."""
    ps = _ACCUMULATED[token]
    parts = [ps[i].grad.reshape(-1) if ps[i].grad is not None else flat.new_zeros(ps[i].numel()) for i in params]
    out = flat + torch.cat(parts).to(flat.dtype)
    for i in params:
        ps[i].grad = None
    return out


_lib.impl("ddp_add_accumulated", _ddp_add_accumulated, "CompositeExplicitAutograd")
_lib.impl("ddp_add_accumulated", lambda flat, token, params: torch.empty_like(flat), "Meta")


@dataclasses.dataclass(frozen=True)
class Sync:
    """How a synced call's gradients are all-reduced: the process group's registered name, its size,
    how many of the backward's first outputs are the module's parameters' gradients (the inner module's
    parameters come first, in named_parameters order), and the buckets (parameter indices). The buckets
    depend on the parameters alone, never on a program, so every rank all-reduces the same buckets in
    the same order whether a call ran its compiled backward or not (a fallback, a full cache). `token`
    (the synced call after no_sync() accumulation): the parameters' accumulated gradients are added to
    each bucket before its all-reduce (ddp_add_accumulated), so such calls have programs of their own."""
    group_name: str
    world: int
    num_params: int
    buckets: tuple[tuple[int, ...], ...]
    token: int = 0  # not 0: the synced call after no_sync() accumulation (each bucket adds the .grads)


def layout(params: list, first: int, cap: int) -> tuple[tuple[int, ...], ...]:
    """DDP's own first assignment: the parameters that require grad in reverse order (about the order
    the backward makes their gradients), one dtype a bucket, a bucket closed once it holds `first` bytes
    (the first one) or `cap` (the others)."""
    buckets: list[tuple[int, ...]] = []
    open_: dict[torch.dtype, list[int]] = {}
    size: dict[torch.dtype, int] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        if not p.requires_grad:
            continue
        open_.setdefault(p.dtype, []).append(i)
        size[p.dtype] = size.get(p.dtype, 0) + p.numel() * p.element_size()
        if size[p.dtype] >= (first if not buckets else cap):
            buckets.append(tuple(open_.pop(p.dtype)))
            size[p.dtype] = 0
    buckets += [tuple(b) for b in open_.values() if b]
    return tuple(buckets)


def plan(wrapper: torch.nn.Module) -> Sync | None:
    """The Sync for a call of a DistributedDataParallel that DDP would sync (grad mode, outside no_sync(),
    none since the last synced call: AOTDataParallel checks), or None where its reducer must (options
    this does not reproduce). The same on every rank: it reads DDP's options and the parameters' own
    hooks and devices, never per-rank state such as whether gradients are there (gradients left by an
    earlier synced step are the same on every rank, and the all-reduced ones add to them as in DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not config.ddp_overlap() or not isinstance(wrapper, DistributedDataParallel):
        return None
    if not (torch.is_grad_enabled() and wrapper.require_backward_grad_sync):
        return None  # under no_sync() or no_grad: nothing to all-reduce
    join = getattr(wrapper, "_join_config", None)
    if join is not None and join.enable:  # uneven inputs: DDP matches the joined ranks' all-reduces itself
        return None
    if (wrapper.find_unused_parameters or getattr(wrapper, "static_graph", False)
            or getattr(wrapper, "_comm_hooks", None) or getattr(wrapper, "mixed_precision", None) is not None
            or getattr(wrapper, "parameters_to_ignore", None) or getattr(wrapper, "_delay_all_reduce_all_params", False)
            or getattr(wrapper, "_use_python_reducer", False)):
        return None
    try:  # a comm hook, Python's (register_comm_hook) or a built-in one (fp16 compression): 7 us
        if wrapper._get_ddp_logging_data().get("comm_hook"):
            return None
    except Exception:  # noqa: BLE001 - a torch without the logger's data: the Python hooks were checked
        pass
    return _parameters_plan(wrapper)


# wrapper -> (stamp, parameters, their (requires_grad, dtype), the Sync or None): the walk of the
# parameters, their hooks and devices (0.6 ms a call on Bert's 202) done again only when a hook handle
# was made anywhere or a compiled module's tree changed (the stamp), or a requires_grad or dtype changed
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _parameters_plan(wrapper: torch.nn.Module) -> Sync | None:
    from torch.utils.hooks import RemovableHandle

    from .compile import _structure_version

    stamp = (RemovableHandle.next_id, _structure_version[0])
    cached = _PLANS.get(wrapper)
    if cached is not None and cached[0] == stamp:
        if tuple((p.requires_grad, p.dtype) for p in cached[1]) == cached[2]:
            return cached[3]
    params = list(wrapper.module.parameters())
    _PLANS[wrapper] = (stamp, params, tuple((p.requires_grad, p.dtype) for p in params), None)
    devices = set()
    for p in params:
        # a hook on a parameter's gradient sees the local gradient in DDP (its reducer reads the hooked
        # one), the all-reduced one here
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            return None
        devices.add(p.device)
    if len(devices) > 1:  # a module across devices: one bucket per device (DDP's)
        return None
    pg = wrapper.process_group
    name = getattr(pg, "group_name", None)
    if not name:
        return None
    first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)
    cap = int(getattr(wrapper, "bucket_bytes_cap", 25 * 1024 * 1024))
    buckets = layout(params, min(first, cap), cap)
    if not buckets or any(not params[i].is_floating_point() for b in buckets for i in b):
        return None
    sync = Sync(str(name), pg.size(), len(params), buckets)
    _PLANS[wrapper] = _PLANS[wrapper][:3] + (sync,)
    return sync


def _val(node: fx.Node):
    return node.meta.get("val")


def _call(graph: fx.Graph, op, args: tuple, val) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = val
    return node


def insert_all_reduces(gm: fx.GraphModule, sync: Sync) -> int:
    """Rewrites a backward graph (outputs: the gradients of the forward's inputs, the parameters' first)
    so it all-reduces the parameters' gradients itself: each of sync.buckets, in order, right after its
    last gradient is made and not before the bucket ahead of it (so every rank issues them in one
    order); returns the number of buckets. 0: the graph has them already, or a parameter that requires
    grad gets none from it (DDP's reducer errors on that without find_unused_parameters): unchanged."""
    graph = gm.graph
    if any(n.target is torch.ops.aotfuse.ddp_wait.default for n in graph.nodes):
        return 0
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    for bucket in sync.buckets:
        for i in bucket:
            g = outs[i] if i < len(outs) else None
            if not isinstance(g, fx.Node) or not isinstance(_val(g), torch.Tensor):
                return 0
    order = {n: k for k, n in enumerate(graph.nodes)}
    world = sync.world
    done = []
    prev: fx.Node | None = None  # the bucket ahead's all-reduce
    for bucket in sync.buckets:
        grads = [outs[i] for i in bucket]
        last = max(grads, key=lambda n: order.get(n, -1))
        if prev is not None and order.get(prev, -1) > order.get(last, -1):
            last = prev
        # before the node after `last` (after the placeholders, where every gradient is an input)
        after = last.next if last.op != "placeholder" else next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(after):
            flats = [_call(graph, aten.reshape.default, (g, [-1]), _val(g).reshape(-1)) for g in grads]
            cat_val = torch.cat([f.meta["val"] for f in flats])
            flat = _call(graph, aten.cat.default, (flats,), cat_val)
            if sync.token:  # after no_sync() accumulation: plus the .grads, taken from the parameters
                flat = _call(graph, torch.ops.aotfuse.ddp_add_accumulated.default, (flat, sync.token, list(bucket)),
                             torch.empty_like(cat_val))
            scaled = _call(graph, aten.div.Tensor, (flat, world), cat_val / world)
            # in place: the bucket is this kernel's fresh output, read by nothing else (no clone of it)
            reduced = _call(graph, torch.ops._c10d_functional.all_reduce_.default, (scaled, "sum", sync.group_name),
                            scaled.meta["val"])
        order = {n: k for k, n in enumerate(graph.nodes)}
        prev = reduced
        done.append((bucket, reduced))
    with graph.inserting_before(out_node):
        for bucket, reduced in done:
            rv = _val(reduced)
            waited = _call(graph, torch.ops.aotfuse.ddp_wait.default, (reduced,), rv.view(rv.shape))
            off = 0
            for i in bucket:
                gv = _val(outs[i])
                n = math.prod(gv.shape)
                part = _call(graph, aten.slice.Tensor, (waited, 0, off, off + n), rv[off:off + n])
                outs[i] = _call(graph, aten.view.default, (part, list(gv.shape)), rv[off:off + n].view(gv.shape))
                off += n
    out_node.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return len(done)


class AfterBackward:
    """For a synced call that ran outside the compiled programs (a fallback, a full cache, a program
    without the all-reduces): the gradients all-reduced when its backward ends, in sync.buckets, in
    order, as the programs do, so ranks that ran different paths still issue matching collectives.
    Hooks on the parameters' gradient accumulation queue one callback at the end of the backward;
    `cancel` drops them (the next forward does, where no backward came)."""

    def __init__(self, params: list, sync: Sync, group) -> None:
        self.params, self.sync, self.group = params, sync, group
        self.queued = False
        self.handles = [params[i].register_post_accumulate_grad_hook(self._ready)
                        for b in sync.buckets for i in b]

    def cancel(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _ready(self, _param) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce)

    def _all_reduce(self) -> None:
        self.cancel()
        for bucket in self.sync.buckets:
            grads = [self.params[i].grad for i in bucket]
            missing = [i for i, g in zip(bucket, grads) if g is None]
            if missing:
                raise RuntimeError(
                    f"aotfuse: under DistributedDataParallel, parameter(s) {missing} (in module.parameters() order) "
                    f"got no gradient in this backward; every rank must all-reduce every parameter's gradient: pass "
                    f"find_unused_parameters=True to DistributedDataParallel where some are unused")
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.sync.world)
            torch.distributed.all_reduce(flat, group=self.group)
            off = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[off:off + n].view_as(g))
                off += n


class Calls:
    """The calls of one DDP wrapper around a compiled module (an AOTModule, `inner`): `begin` before the
    wrapper's forward, `end` after it. For a call DDP would sync, `begin` finds the Sync (plan), tells the
    reducer to stand by (require_backward_grad_sync off, as under no_sync(), so DDP's forward neither
    prepares the reducer nor marks its buckets) and hands the Sync to `inner`, whose backward program
    all-reduces; `end` restores the flags to what DDP's synced forward leaves and, where the call ran
    outside such a program, all-reduces the gradients when its backward ends (AfterBackward).
    AOTDataParallel keeps one; `watch` hooks one onto a DDP that wraps a compiled module."""

    def __init__(self) -> None:
        self.after: AfterBackward | None = None  # waiting for the backward of a call that fell back
        # a grad-enabled call under no_sync() since the last synced one: gradients accumulated on each rank
        # alone, which DDP's reducer all-reduces at the next synced call (the same on every rank)
        self.unsynced = False
        self.sync: Sync | None = None  # the call in progress
        self.inner = None

    def begin(self, wrapper: torch.nn.Module, inner) -> Sync | None:
        if self.after is not None:  # the last call's backward never came
            self.after.cancel()
            self.after = None
        grad = torch.is_grad_enabled()
        synced = grad and getattr(wrapper, "require_backward_grad_sync", False)  # DataParallel: never
        sync = None if config.disabled() or not synced else plan(wrapper)
        if sync is not None and self.unsynced:  # after no_sync() accumulation: the .grads join the buckets
            sync = accumulated(wrapper, sync)
        if grad:
            self.unsynced = not synced
        self.sync, self.inner = sync, inner
        if sync is not None:
            wrapper.require_backward_grad_sync = False
            object.__setattr__(inner, "_aotfuse_ddp", sync)
            object.__setattr__(inner, "_aotfuse_ddp_ran", False)
        return sync

    def end(self, wrapper: torch.nn.Module, returned: bool) -> None:
        sync, inner = self.sync, self.inner
        self.sync = self.inner = None
        if sync is None:
            return
        object.__setattr__(inner, "_aotfuse_ddp", None)
        wrapper.require_backward_grad_sync = True
        wrapper.require_forward_param_sync = True  # what DDP's synced forward leaves (buffers next call)
        if returned and not inner._aotfuse_ddp_ran:
            # the call ran eagerly or under Dynamo (a fallback, a full cache): its gradients are
            # all-reduced when the backward ends, in the buckets and order the programs use, so ranks
            # that ran different paths issue the same collectives
            self.after = AfterBackward(list(inner.orig_module.parameters()), sync, wrapper.process_group)


def accumulated(wrapper: torch.nn.Module, sync: Sync) -> Sync:
    """`sync` for the synced call after no_sync() accumulation: with the wrapper's token, its parameters
    registered for ddp_add_accumulated (again at each such call: the list may have changed)."""
    token = _TOKENS.get(wrapper)
    if token is None:
        token = _TOKENS[wrapper] = next(_token_numbers)
        weakref.finalize(wrapper, _ACCUMULATED.pop, token, None)
    _ACCUMULATED[token] = list(wrapper.module.parameters())
    return dataclasses.replace(sync, token=token)


# the DDP wrappers whose calls of a compiled module a Calls manages (AOTDataParallel's, or watch's hooks)
MANAGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pre_hook(calls: Calls, wrapper: torch.nn.Module, _args) -> None:
    inner = wrapper._modules.get("module")
    if getattr(inner, "_aotfuse_compiled", None) is not None:  # not if the module was replaced since
        calls.begin(wrapper, inner)


def _post_hook(calls: Calls, wrapper: torch.nn.Module, _args, _out) -> None:
    calls.end(wrapper, returned=sys.exc_info()[0] is None)  # always_call: after a raise too


def watch(wrapper: torch.nn.Module, inner) -> bool:
    """DDP(memory_efficient_fusion(model)): called by the compiled module's first call inside the DDP's
    forward (DistributedDataParallel._active_ddp_module), which is too late to keep the reducer out of
    that call. Hooks a Calls onto the DDP (a forward pre-hook, first, and an always-called forward hook)
    so its later calls sync in the compiled backward as memory_efficient_fusion(DDP(model))'s do.
    Returns whether this call is one those would sync: the caller then runs it eagerly, once, DDP's
    reducer all-reducing, rather than compiling a program for a signature no later call has."""
    calls = Calls()
    calls.unsynced = torch.is_grad_enabled() and not wrapper.require_backward_grad_sync
    MANAGED[wrapper] = calls
    wrapper.register_forward_pre_hook(functools.partial(_pre_hook, calls), prepend=True)
    wrapper.register_forward_hook(functools.partial(_post_hook, calls), always_call=True)
    return not config.disabled() and plan(wrapper) is not None
