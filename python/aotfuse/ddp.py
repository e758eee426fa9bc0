"""DistributedDataParallel's gradient all-reduce inside the compiled backward, bucket by bucket.

`memory_efficient_fusion(DDP(model))` runs DDP's own forward around the compiled module
(compile.AOTDataParallel). Left to DDP's reducer, the all-reduce of the gradients would start only when
the compiled backward (one autograd node) returns them all at once. Instead, for a call DDP would sync,
the reducer is told to stand by (as under `no_sync()`) and the backward program all-reduces the
gradients itself: they are put in buckets in the order the backward produces them (DDP's caps: a first
bucket of 1 MiB, then `bucket_cap_mb`), each bucket is flattened, divided by the world size and handed to
torch's functional all-reduce (`_c10d_functional.all_reduce_`, in place, asynchronous: gloo's thread, NCCL's stream)
right after its last gradient is computed, and every bucket is waited for at the end of the backward,
its gradients returned as views of it. So the communication runs while the rest of the backward
computes, as in eager DDP.

Calls where DDP does something this does not (find_unused_parameters, static_graph, comm hooks, mixed
precision, ignored parameters, gradients already accumulated under `no_sync()`), or with
AOTFUSE_DDP_OVERLAP=0, keep DDP's reducer: the all-reduce after the backward.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math

import torch
import torch.fx as fx

from . import config

__all__ = ["Sync", "plan", "insert_all_reduces", "current"]

aten = torch.ops.aten

_lib = torch.library.Library("aotfuse", "FRAGMENT")
_lib.define("ddp_wait(Tensor(a) bucket) -> Tensor(a)")


def _ddp_wait(bucket: torch.Tensor) -> torch.Tensor:
    """Waits for the functional all-reduce that made `bucket`; returns a view of it (the schema's alias:
    the runtime keeps the bucket's storage for its readers and never hands it to another value)."""
    torch.ops._c10d_functional.wait_tensor(bucket)
    return bucket.view(bucket.shape)


_lib.impl("ddp_wait", _ddp_wait, "CompositeExplicitAutograd")

# the DDP sync of the call being traced or run (a Sync), set by AOTDataParallel around its module's
# call: part of the inner module's signatures (compile.AOTModule.forward) and of the record a trace makes
_SYNC: contextvars.ContextVar = contextvars.ContextVar("aotfuse_ddp_sync", default=None)


@dataclasses.dataclass(frozen=True)
class Sync:
    """How a synced call's backward all-reduces: the process group's registered name, its size, DDP's
    bucket caps in bytes, and how many of the backward's first outputs are the module's parameters'
    gradients (the inner module's parameters come first, in named_parameters order)."""
    group_name: str
    world: int
    bucket_bytes: int
    first_bucket_bytes: int
    num_params: int


def current() -> Sync | None:
    return _SYNC.get()


def plan(wrapper: torch.nn.Module) -> Sync | None:
    """The Sync for this call of a DistributedDataParallel, or None where its reducer must sync (a call
    it would not sync, or options this does not reproduce)."""
    from torch.nn.parallel import DistributedDataParallel

    if not config.ddp_overlap() or not isinstance(wrapper, DistributedDataParallel):
        return None
    if not (torch.is_grad_enabled() and wrapper.require_backward_grad_sync):
        return None  # under no_sync() or no_grad: nothing to all-reduce
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
    params = list(wrapper.module.parameters())
    if any(p.grad is not None for p in params if p.requires_grad):
        # gradients accumulated under no_sync(): DDP all-reduces the sum, this backward's alone would not
        return None
    pg = wrapper.process_group
    name = getattr(pg, "group_name", None)
    if not name:
        return None
    first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)
    cap = int(getattr(wrapper, "bucket_bytes_cap", 25 * 1024 * 1024))
    return Sync(str(name), pg.size(), cap, min(first, cap), len(params))


def _val(node: fx.Node):
    return node.meta.get("val")


def _call(graph: fx.Graph, op, args: tuple, val) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = val
    return node


def insert_all_reduces(gm: fx.GraphModule, sync: Sync) -> int:
    """Rewrites a backward graph (outputs: the gradients of the forward's inputs, the parameters' first)
    so it all-reduces the parameters' gradients itself; returns the number of buckets (0: nothing to do,
    the graph unchanged). Idempotent: a graph that has them already is left as it is."""
    graph = gm.graph
    if any(n.target is torch.ops.aotfuse.ddp_wait.default for n in graph.nodes):
        return 0
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    grads = []
    for i in range(min(sync.num_params, len(outs))):
        g = outs[i]
        if isinstance(g, fx.Node) and isinstance(_val(g), torch.Tensor) and _val(g).is_floating_point():
            grads.append((order[g], i, g))
    if not grads:
        return 0
    grads.sort(key=lambda t: (t[0], t[1]))
    # buckets in the order the gradients are ready, one dtype each
    buckets: list[list[tuple[int, fx.Node]]] = []
    open_: dict[torch.dtype, list] = {}
    sizes: dict[torch.dtype, int] = {}
    for _, i, g in grads:
        v = _val(g)
        dt = v.dtype
        open_.setdefault(dt, []).append((i, g))
        sizes[dt] = sizes.get(dt, 0) + v.numel() * v.element_size()
        cap = sync.first_bucket_bytes if not buckets else sync.bucket_bytes
        if sizes[dt] >= cap:
            buckets.append(open_.pop(dt))
            sizes[dt] = 0
    buckets += [b for b in open_.values() if b]
    world = sync.world
    done = []
    for bucket in buckets:
        last = max((g for _, g in bucket), key=lambda n: order[n])
        # before the node after the last gradient (after the placeholders, for a gradient that is an input)
        after = last.next if last.op != "placeholder" else next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(after):
            flats = [_call(graph, aten.reshape.default, (g, [-1]), _val(g).reshape(-1)) for _, g in bucket]
            cat_val = torch.cat([f.meta["val"] for f in flats])
            flat = _call(graph, aten.cat.default, (flats,), cat_val)
            scaled = _call(graph, aten.div.Tensor, (flat, world), cat_val / world)
            # in place: the bucket is this kernel's fresh output, read by nothing else (no clone of it)
            reduced = _call(graph, torch.ops._c10d_functional.all_reduce_.default, (scaled, "sum", sync.group_name),
                            scaled.meta["val"])
        done.append((bucket, reduced))
    with graph.inserting_before(out_node):
        for bucket, reduced in done:
            rv = _val(reduced)
            waited = _call(graph, torch.ops.aotfuse.ddp_wait.default, (reduced,), rv.view(rv.shape))
            off = 0
            for i, g in bucket:
                gv = _val(g)
                n = math.prod(gv.shape)
                part = _call(graph, aten.slice.Tensor, (waited, 0, off, off + n), rv[off:off + n])
                outs[i] = _call(graph, aten.view.default, (part, list(gv.shape)), rv[off:off + n].view(gv.shape))
                off += n
    out_node.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return len(done)
