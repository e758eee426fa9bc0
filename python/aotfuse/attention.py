"""Eager attention as torch's fused scaled_dot_product_attention (SDPA), before AOTAutograd traces.

Models written with eager attention (Hugging Face's `attn_implementation="eager"`, hand-written
transformer blocks) compute

    softmax(q @ k.transpose(-2, -1) * scale + mask) -> dropout -> @ v

as separate matmuls around a [batch, heads, L, S] score tensor that the backward needs again. ATen's
SDPA kernels (flash and memory-efficient on CUDA, flash on the CPU) compute the same without that
tensor. Inductor makes the same rewrite on CUDA (its fuse_attention pass).

How: the function is traced once more, cheaply, at the pre-dispatch level (make_fx, pre_dispatch=True:
`aten.matmul`, `aten.softmax.int`, `aten.dropout` are still whole ops there), every chain

    matmul(q, transpose(k, -2, -1)) -> [mul or div by a number] -> [add(mask)] -> softmax(-1[, float32])
    -> [to(q's dtype)] -> [dropout(p, train)] -> matmul(., v)

whose intermediate values nothing else reads becomes one `aten.scaled_dot_product_attention(q, k, v,
attn_mask=mask, dropout_p=p, scale=...)`, and AOTAutograd traces that graph instead of the function
(SDPA's forward and backward are then ATen calls of the C programs, the kernels around them fused as
before). Where nothing matches, the function is traced as it is: the rewrite changes nothing else.

Both entry points use it: memory_efficient_fusion traces the model's flattened function (the first
call of each signature), torch.compile(backend="aotfuse") each graph Dynamo hands over (fused_graph).

Where it applies (`AOTFUSE_FUSE_ATTENTION`): `auto` (default) on CUDA tensors, and on float32 and
float16 CPU tensors where the attention has no dropout (ATen's CPU flash kernel takes no dropout; its
math path would be slower than aotfuse's own kernels: 206 against 124 ms for one attention's training
step at 4 x 12 x 512 x 64, and the flash kernel 50 ms). Not short bfloat16 CPU attention
(_short_bf16_cpu): there ATen's flash kernel was 1.3-1.4x the time of oneDNN's bf16 bmm with aotfuse's
softmax kernel for inference and 1.4-2.3x for a training step (4 x 4 x 128..1024 x 64, an AVX512-BF16
CPU without AMX, 2026-12-06; a Llama training step 1.15x, its peak 0.92x), so it stays as the model
wrote it, at the cost of the saved probabilities, and SDPA calls the model makes become that chain
(unfuse_attention). `1` also on CPU with dropout and in bfloat16 (for tests), and leaves SDPA calls as
they are; `0` neither. Dropout inside SDPA draws from ATen's generator, not aotfuse's.
"""
from __future__ import annotations

import contextlib
import math
import operator
import threading
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from . import checkpoint, config
from .partition import _val

aten = torch.ops.aten

__all__ = ["fuse_attention", "fused_graph", "unfuse_attention"]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _last_two(dims: tuple, rank: int) -> bool:
    return sorted(d % rank for d in dims) == [rank - 2, rank - 1]


MATMULS = (aten.matmul.default, aten.bmm.default)


def _mask_fits(node: fx.Node, dtype: torch.dtype, device: torch.device, scores: torch.Tensor) -> bool:
    """Whether node's value can be SDPA's attn_mask for these scores: of that dtype and device, 2 to
    rank dims, broadcasting to the scores' shape (not widening it)."""
    val = _val(node)
    if val is None or val.dtype != dtype or val.device != device or not 2 <= val.dim() <= scores.dim():
        return False
    try:
        return torch.broadcast_shapes(val.shape, scores.shape) == scores.shape
    except RuntimeError:
        return False


def _short_bf16_cpu(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention of these q and k stays (or becomes) matmuls around aotfuse's softmax kernel
    rather than ATen's CPU flash kernel (AOTFUSE_FUSE_ATTENTION=auto): bfloat16 CPU tensors whose
    [.., L, S] probabilities are no larger than q, k, v and the output together (L * S <= 2E(L + S):
    L = S <= 4E, 256 for 64-wide heads). There the flash kernel took 1.4-2.3x the time of a training
    step's bf16 bmm and softmax kernel (attention.py's docstring); longer attention keeps the kernel
    that never stores the probabilities."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.dim() < 2:
        return False
    big_l, e, big_s = q.shape[-2], q.shape[-1], k.shape[-2]
    return big_l * big_s <= 2 * e * (big_l + big_s)


def _match(softmax: fx.Node, force_cpu: bool, needs_grad: set) -> dict | None:
    """The attention chain around `softmax`, or None. 4-D ([batch, heads, L, E]) or 3-D ([batch * heads,
    L, E], bmm) attention."""
    args = softmax.args
    x = args[0]
    xv = _val(x)
    if xv is None or xv.dim() not in (3, 4) or len(args) < 2 or args[1] % xv.dim() != xv.dim() - 1:
        return None
    rank = xv.dim()
    before: list = []  # from the softmax back to the first matmul
    after: list = []   # from the softmax on, before the last matmul
    # backwards from the softmax: [to(float32)] <- [add(mask)] and/or [masked_fill(c, -inf) or
    # where(c, ., -inf)] <- [mul/div by a number] <- matmul(q, k^T); each value read only by the next
    if _is(x, aten.to.dtype) and len(x.args) == 2 and x.args[1] == torch.float32 and not x.kwargs \
            and _only_user(x) is softmax:
        before.append(x)  # an upcast for the softmax (SDPA's softmax is float32)
        x = x.args[0]
    scores_ops = (aten.mul.Tensor, aten.div.Tensor, *MATMULS, aten.masked_fill.Scalar, aten.add.Tensor,
                  aten.where.ScalarOther)
    mask = cond = None
    keeps = False  # whether cond is True where the scores are kept (where) or where they are -inf (masked_fill)
    while _only_user(x) is (before[-1] if before else softmax):
        # masked_fill(s, c, -inf) is s + where(c, -inf, 0), where(c, s, -inf) s + where(c, 0, -inf): masks.
        # A finite fill is not: a row it masks whole is uniform in eager. (A row -inf masks whole is NaN
        # in eager and zeros in ATen's SDPA, as with an additive -inf mask.)
        if cond is None and _is(x, aten.masked_fill.Scalar) and len(x.args) == 3 and not x.kwargs \
                and x.args[2] == float("-inf"):
            cond = x.args[1]
            before.append(x)
            x = x.args[0]
        elif cond is None and _is(x, aten.where.ScalarOther) and len(x.args) == 3 and not x.kwargs \
                and x.args[2] == float("-inf"):
            cond, keeps = x.args[0], True
            before.append(x)
            x = x.args[1]
        elif mask is None and _is(x, aten.add.Tensor) and len(x.args) == 2 and not x.kwargs:
            a, b = x.args
            if _is(a, *scores_ops):
                scores, mask = a, b
            elif _is(b, *scores_ops):
                scores, mask = b, a
            else:
                return None
            before.append(x)
            x = scores
        else:
            break
    scale = 1.0
    if _is(x, aten.mul.Tensor, aten.div.Tensor) and len(x.args) == 2 and not x.kwargs:
        a, c = x.args
        if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0 or not _is(a, *MATMULS):
            return None
        if _only_user(x) is None:
            return None
        scale = float(c) if x.target is aten.mul.Tensor else 1.0 / float(c)
        before.append(x)
        x = a
    if not _is(x, *MATMULS) or _only_user(x) is None:
        return None
    q, kt = x.args
    before.append(x)
    if not _is(kt, aten.transpose.int) or not _last_two(kt.args[1:3], rank):
        return None
    k = kt.args[0]
    # forwards from the softmax: [to(dtype)] -> [dropout(p, train)] -> matmul(., v)
    y = _only_user(softmax)
    if y is None:
        return None
    if _is(y, aten.to.dtype) and _only_user(y) is not None:
        after.append(y)
        y = _only_user(y)
    p = 0.0
    if _is(y, aten.dropout.default) and len(y.args) == 3 and _only_user(y) is not None:
        p = float(y.args[1]) if y.args[2] else 0.0
        after.append(y)
        y = _only_user(y)
    if not _is(y, *MATMULS) or y.args[0] is not (after[-1] if after else softmax) or len(y.args) != 2:
        return None
    v = y.args[1]
    qv, kv, vv, out = _val(q), _val(k), _val(v), _val(y)
    if any(t is None or t.dim() != rank for t in (qv, kv, vv, out)):
        return None
    if not (qv.dtype == kv.dtype == vv.dtype == out.dtype) or qv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    b = rank - 2  # batch dims
    if not (qv.device == kv.device == vv.device) or qv.shape[:b] != kv.shape[:b] or kv.shape[:b + 1] != vv.shape[:b + 1]:
        return None
    # the scores and the output have q's batch and heads: a mask or condition broadcast no further
    if tuple(xv.shape) != (*qv.shape[:b + 1], kv.shape[b]) or tuple(out.shape) != (*qv.shape[:b + 1], vv.shape[b + 1]):
        return None
    if len(args) > 2 and args[2] not in (None, torch.float32, qv.dtype):
        return None  # SDPA's softmax is float32 (the probabilities' dtype is the last matmul's: q's)
    if cond is not None and not _mask_fits(cond, torch.bool, qv.device, xv):
        return None
    if mask is not None and (not _mask_fits(mask, qv.dtype, qv.device, xv) or mask in needs_grad):
        return None  # (a learned bias: not every SDPA kernel gives the mask a gradient)
    if qv.device.type == "cpu" and (p > 0 or _short_bf16_cpu(qv, kv)) and not force_cpu:
        return None  # ATen's CPU SDPA with dropout is its math path, its bf16 flash kernel slower: ours
    if qv.device.type not in ("cpu", "cuda"):
        return None
    # consumers first: the order to erase them in
    dead = [y, *reversed(after), softmax, *before, kt]
    mask_rank = max((_val(t).dim() for t in (mask, cond) if t is not None), default=0)
    return dict(q=q, k=k, v=v, mask=mask, cond=cond, keeps=keeps, p=p, scale=scale, out=y, dead=dead, rank=rank,
                mask_rank=mask_rank)


def _needing_grad(graph: fx.Graph, grad_inputs: list[bool] | None) -> set:
    """The nodes computed from an input that requires grad (through any op); without grad_inputs,
    every input counts as one (a pre-dispatch trace's values do not say)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    seeds = set(placeholders) if grad_inputs is None else {n for n, g in zip(placeholders, grad_inputs) if g}
    out = set(seeds)
    for node in graph.nodes:
        if node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _replace(graph: fx.Graph, old: fx.Node, new: fx.Node, dead: list) -> None:
    """new takes old's place (its metadata, its users); the nodes of `dead` nothing reads are erased,
    consumers first."""
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    for node in dead:
        if not node.users:
            graph.erase_node(node)


def _recompiled(gm: fx.GraphModule, found: int) -> int:
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


def fuse_attention(gm: fx.GraphModule, force_cpu: bool = False, grad_inputs: list[bool] | None = None) -> int:
    """Rewrites every eager attention chain of a pre-dispatch graph into one SDPA call, in place.
    grad_inputs: whether each placeholder's tensor requires grad (a mask computed from one keeps its
    chain as it is; None: all do). Returns how many were rewritten."""
    graph = gm.graph
    needs_grad = _needing_grad(graph, grad_inputs)
    found = 0
    for node in list(graph.nodes):
        if not _is(node, aten.softmax.int):
            continue
        m = _match(node, force_cpu, needs_grad)
        if m is None:
            continue
        with graph.inserting_before(m["out"]):
            mask, cond = m["mask"], m["cond"]
            if cond is not None and m["keeps"]:  # SDPA's boolean mask: True where the scores are kept
                mask = cond if mask is None else graph.call_function(aten.where.ScalarOther, (cond, mask, float("-inf")))
            elif cond is not None:  # True where the scores are -inf
                mask = (graph.call_function(aten.logical_not.default, (cond,)) if mask is None else
                        graph.call_function(aten.where.ScalarSelf, (cond, float("-inf"), mask)))
            q, k, v = m["q"], m["k"], m["v"]
            if m["rank"] == 3:  # SDPA's fused kernels take 4-D tensors: one head
                q, k, v = (graph.call_function(aten.unsqueeze.default, (t, 1)) for t in (q, k, v))
                if m["mask_rank"] == 3:
                    mask = graph.call_function(aten.unsqueeze.default, (mask, 1))
            sdpa = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                       {"attn_mask": mask, "dropout_p": m["p"], "is_causal": False,
                                        "scale": m["scale"]})
            if m["rank"] == 3:
                sdpa = graph.call_function(aten.squeeze.dim, (sdpa, 1))
        _replace(graph, m["out"], sdpa, m["dead"])
        found += 1
    return _recompiled(gm, found)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def unfuse_attention(gm: fx.GraphModule) -> int:
    """Rewrites each SDPA call of a pre-dispatch graph that _short_bf16_cpu takes and has no dropout, and
    each one on bf16 CPU tensors with dropout (ATen's CPU SDPA is then its math path, in float32: bf16
    matmuls and probabilities are faster and smaller, a training step 0.95-0.98 of the math path's and
    its peak 12-21% lower: Bert, GPT2, ViT, 2026-12-06), without grouped-query heads, into the chain
    eager attention is (bf16 matmuls, a float32 softmax of the scaled and masked scores, its bf16
    probabilities, dropped out by aotfuse's dropout, times v: transformers' eager attention's numerics,
    a little farther from float64 than the flash kernel's float32 products), in place; the softmax is
    _safe_softmax, SDPA's: a row every key is masked from is 0, as ATen's flash kernel gives, not NaN.
    Only boolean masks (transformers' for its sdpa attention) or none: an additive float mask (T5's
    position biases) keeps the call. So rewritten, T5's tiny bf16 test model's second training step was
    farther from float64 than eager's (one row of a ReLU layer's weight gradient: a unit that rounding
    after the first step switched, though that step's gradients were as close to float64 as eager's);
    the speed with such masks is unmeasured.
    Returns how many were rewritten."""
    graph = gm.graph
    found = 0
    for node in list(graph.nodes):
        if not _is(node, aten.scaled_dot_product_attention.default):
            continue
        a = dict(zip(_SDPA_ARGS, node.args))
        a.update(node.kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask, p, causal = a.get("attn_mask"), a.get("dropout_p", 0.0), a.get("is_causal", False)
        qv, kv, vv = _val(q), _val(k), _val(v)
        if any(t is None for t in (qv, kv, vv)) or a.get("enable_gqa") or not (qv.dtype == kv.dtype == vv.dtype) \
                or qv.dim() != kv.dim() or qv.shape[-3:-2] != kv.shape[-3:-2]:
            continue
        # with dropout, any length: ATen's CPU SDPA is then its math path, which computes bf16 in float32
        # and saves float32 probabilities, more than this chain's bf16 ones
        dropped = p != 0.0 and qv.device.type == "cpu" and qv.dtype == torch.bfloat16
        if not (dropped or (p == 0.0 and _short_bf16_cpu(qv, kv))):
            continue
        mv = _val(mask) if isinstance(mask, fx.Node) else None
        if mask is not None and (mv is None or mv.dtype != torch.bool or causal):
            continue
        scale = a.get("scale")
        scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)
        with graph.inserting_before(node):
            # eager attention's numerics (bf16 scores and probabilities around a float32 softmax): a
            # float32 chain, nearer the flash kernel's, took 0.884 of the step against this one's
            # 0.837 (Llama, 2026-12-06) and saved float32 probabilities (peak 1.20x against 1.08x)
            kt = graph.call_function(aten.transpose.int, (k, -2, -1))
            scores = graph.call_function(aten.to.dtype, (graph.call_function(aten.matmul.default, (q, kt)),
                                                         torch.float32))
            scores = graph.call_function(aten.mul.Tensor, (scores, scale))
            if causal:  # SDPA's causal mask is the lower triangle from the top left
                ones = graph.call_function(aten.ones.default, ([qv.shape[-2], kv.shape[-2]],),
                                           {"dtype": torch.bool, "device": qv.device})
                mask = graph.call_function(aten.tril.default, (ones,))
            if mask is not None:
                scores = graph.call_function(aten.where.ScalarOther, (mask, scores, float("-inf")))
            probs = graph.call_function(aten.to.dtype, (graph.call_function(aten._safe_softmax.default, (scores, -1)),
                                                        qv.dtype))
            if p != 0.0:
                probs = graph.call_function(aten.dropout.default, (probs, float(p), True))
            out = _strided_like(graph, graph.call_function(aten.matmul.default, (probs, v)), _val(node))
        _replace(graph, node, out, [node])
        found += 1
    return _recompiled(gm, found)


def _strided_like(graph: fx.Graph, out: fx.Node, want: torch.Tensor | None) -> fx.Node:
    """`out` (contiguous, as a matmul makes it) in the memory order of `want`, the SDPA call's output:
    ATen's CPU kernels give [B, H, L, E] with the heads inside the sequence ([B, L, H, E] in memory), so
    the graph traced behind the call took `o.transpose(1, 2).contiguous()` as no copy and views it
    (`.view(B, L, -1)`: AFMoE with transformers' default attention), which the matmul's own layout
    cannot take."""
    if want is None or want.is_contiguous() or want.dim() < 2:
        return out
    order = sorted(range(want.dim()), key=lambda d: (-want.stride(d), d))  # outermost first
    inverse = [order.index(d) for d in range(want.dim())]
    packed = graph.call_function(aten.clone.default, (graph.call_function(aten.permute.default, (out, order)),),
                                 {"memory_format": torch.contiguous_format})
    return graph.call_function(aten.permute.default, (packed, inverse))


_apply_lock = threading.Lock()
_apply_patch: dict = {"count": 0, "original": None}
_applying = threading.local()


@contextlib.contextmanager
def _custom_functions_applied() -> Iterator[list]:
    """The custom autograd.Functions this thread applies while active (aotfuse's own left out). A
    pre-dispatch trace records a Function's forward ops in its place, run under no_grad, and nothing of
    its backward: AOTAutograd, tracing that graph, would give no gradient through it (a straight-through
    estimator's input, PhiMoE's router weights under torch.compile: their .grad None) or fail ("element 0
    of tensors does not require grad"). Dynamo's graphs hold such a Function as an
    `autograd_function_apply` node, which applies one too."""
    seen: list = []
    with _apply_lock:
        if _apply_patch["count"] == 0:
            original = torch.autograd.Function.__dict__["apply"]

            def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
                record = getattr(_applying, "seen", None)
                if record is not None and not str(getattr(cls, "__module__", "")).startswith("aotfuse."):
                    record.append(cls)
                # a classmethod (torch 2.13) or a C classmethod_descriptor (torch 2.14): bound to cls
                return original.__get__(None, cls)(*args, **kwargs)

            _apply_patch["original"] = original
            torch.autograd.Function.apply = classmethod(apply)
        _apply_patch["count"] += 1
    before = getattr(_applying, "seen", None)
    _applying.seen = seen
    try:
        yield seen
    finally:
        _applying.seen = before
        with _apply_lock:
            _apply_patch["count"] -= 1
            if _apply_patch["count"] == 0:
                torch.autograd.Function.apply = _apply_patch["original"]
                _apply_patch["original"] = None


def fused_graph(fn: Callable, tensors: list, mode: str) -> fx.GraphModule | None:
    """fn traced at the pre-dispatch level with its attention chains as SDPA, or None where none matched
    or the graph cannot be replayed as ATen ops (then fn is traced as it is; AOTFUSE_LOG=cache says
    why). mode: "auto" or "1" (AOTFUSE_FUSE_ATTENTION)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        # a fake mode of its own, static shapes: not the one of a Dynamo compile under way (whose shape
        # environment would take the trace's sizes for symbols without a source)
        with torch._guards.tracing(None), checkpoint.pre_dispatch(), _custom_functions_applied() as functions:
            gm = make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*tensors)
    except Exception as e:  # noqa: BLE001 - the usual capture decides, and explains
        config.emit("cache", f"attention: no pre-dispatch graph ({type(e).__name__}); traced as it is")
        return None
    fake = [name for name, t in (*gm.named_parameters(), *gm.named_buffers(), *vars(gm).items())
            if isinstance(t, torch._subclasses.fake_tensor.FakeTensor)]
    if fake:  # a value the trace made and keeps as a constant of its own fake mode (Gemma 3n's, bf16 under
        # torch.compile): AOTAutograd would pass it to each call as an input with no data
        config.emit("cache", f"attention: the pre-dispatch graph holds fake tensors ({', '.join(fake[:3])}); "
                             f"traced as it is")
        return None
    if functions:  # their backwards are not in the pre-dispatch graph (_custom_functions_applied)
        names = sorted({getattr(f, "__qualname__", str(f)) for f in functions})
        config.emit("cache", f"attention: the function applies custom autograd.Functions ({', '.join(names)}), "
                             f"which a pre-dispatch graph would run without their backwards; traced as it is")
        return None
    # grad-mode switches (a rotary embedding's @torch.no_grad()) replay as they are when AOTAutograd
    # traces the graph; anything else but ATen ops (higher-order ops, autocast) leaves fn as it is
    # (a shape family's trace, shapes.py: size arithmetic on symbolic sizes replays too)
    other = {str(n.target) for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
             and not isinstance(n.target, torch._ops.OpOverload)
             and n.target not in (operator.getitem, torch._C._set_grad_enabled)
             and not isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))}
    if other:
        config.emit("cache", f"attention: the pre-dispatch graph has {', '.join(sorted(other))}; traced as it is")
        return None
    grad_inputs = [isinstance(t, torch.Tensor) and t.requires_grad for t in tensors]
    found = fuse_attention(gm, force_cpu=mode == "1", grad_inputs=grad_inputs)
    config.emit("cache", f"attention: {found} chain(s) as scaled_dot_product_attention")
    if mode == "auto":
        unfused = unfuse_attention(gm)
        if unfused:
            config.emit("cache", f"attention: {unfused} scaled_dot_product_attention call(s) as matmuls and a "
                                 f"softmax (short bf16 CPU attention)")
        found += unfused
    if found and checkpoint.tagged(gm):  # activation checkpointing's regions (checkpoint.py) stay regions
        gm = checkpoint.replay_with_tags(gm)
    return gm if found else None
