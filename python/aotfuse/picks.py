"""One-hot picks: a row sum of `where(hit, V, 0)` where `hit` holds at most one true per row is V at
that one element, computed once a row, not for every element.

nll_loss's forward is decomposed (decompositions.py) as `-sum(where(class == target, logp, 0), -1)`:
a masked row sum, so that the log-probabilities need not be stored. But then the fused cross
entropy kernel computes `logp = (x - max) - log(sum(exp(x - max)))` (rounded to bf16 where the model
is bf16) for every element of the row in a third pass after the log-sum-exp, only to keep one.

Here the sum becomes that computation applied to picked values: V's elementwise ancestors that vary
along the last dim are followed back to their leaves (the logits), each leaf is picked by its own
masked row max `amax(where(hit, leaf, -inf), -1, keepdim=True)`, exact (one element, the rest -inf;
-0.0 stays -0.0), which needs nothing from later passes, so it joins the kernel's first pass, and V's nodes are applied again
to the picked [.., 1] values and the per-row values they read. The same operations on the same
values in the same dtypes give the same bits; a row with no hit (an ignored target) gives 0, as the
sum did. The cross entropy kernel at 512 x 8192 (bf16) loses its third pass: 2.55 -> 1.87 ms.

The cross entropy's backward has the other form, `sum(mul(hit, g), -1)` with g constant along the
row (nll_loss's gradient, -grad / N, times the one-hot mask): the log-softmax backward's row sum of
its incoming gradient. That sum is g where the row has a hit and 0 where it has none (a sum of one
g and zeros, or of zeros alone), so it becomes `where(hits, g, 0)`, a per-row value: the backward
kernel loses its first pass over the row, which computed nothing else
(benchmarks/results/backward-order-picks-cpu-2026-12-06.md). CPU tensors only (`_SCALED_DEVICES`):
unmeasured on a GPU. For a finite g the bits are the sum's; for an infinite or NaN g the sum's
0 * inf = NaN on the other elements is gone, which is what eager's scatter of g into zeros gives.

`hit` must be an `eq` of an `arange` over the last dim (distinct values, compared in int32, int64,
float32 or float64: a bf16 or uint8 comparison may make two of them one) with a per-row value, or such
an `eq` and-ed (mul, logical_and) with per-row values: what _one_hot builds. AOTFUSE_ONE_HOT_PICKS=0
keeps the graph as traced.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx

from . import config
from .partition import _val

__all__ = ["rewrite_one_hot_picks"]

aten = torch.ops.aten
prims = torch.ops.prims

MAX_CHAIN = 32  # V's nodes applied again at most; a longer chain is left as traced
# the devices whose `sum(mul(hit, g), -1)` is rewritten: measured on the CPU only; a GPU keeps the
# cross entropy backward's phased row kernel until a device run times both
_SCALED_DEVICES = ("cpu",)


def _tensor(n: Any) -> torch.Tensor | None:
    v = _val(n) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _per_row(n: Any, width: int) -> bool:
    """A value constant along the last dim of a [.., width] result: a scalar, or last dim 1."""
    if not isinstance(n, fx.Node):
        return not isinstance(n, (list, tuple))
    v = _tensor(n)
    return v is not None and (v.dim() == 0 or (v.shape[-1] == 1 and width > 1))


def _arange(n: Any, width: int) -> bool:
    """`arange(width)` (or arange(0, width, 1)): distinct values along one dim of size width."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    v = _tensor(n)
    if v is None or v.dim() != 1 or v.shape[0] != width:
        return False
    if n.target is aten.arange.default:
        return len(n.args) == 1
    if n.target in (aten.arange.start, aten.arange.start_step):
        step = n.args[2] if len(n.args) > 2 else n.kwargs.get("step", 1)
        return len(n.args) >= 2 and n.args[0] == 0 and step == 1
    return False


_EXACT = (torch.int32, torch.int64, torch.float32, torch.float64)  # hold 0 .. 2**24 - 1 exactly


def _exact_compare(a: Any, b: Any, width: int) -> bool:
    """Whether eq(a, b) compares in a dtype holding 0 .. width - 1 exactly (then the arange's values
    stay distinct: an int64 arange compared with a bf16 value is compared in bf16, where 256 and 257
    are one value), both operands in such dtypes."""
    va, vb = _tensor(a), _tensor(b)
    return (va is not None and vb is not None and va.dtype in _EXACT and vb.dtype in _EXACT and width <= 2**24
            and torch.promote_types(va.dtype, vb.dtype) in _EXACT)


def _one_hot(hit: Any, width: int) -> bool:
    """Whether hit has at most one true along its last dim (of size width)."""
    if not isinstance(hit, fx.Node) or hit.op != "call_function" or hit.kwargs:
        return False
    v = _tensor(hit)
    if v is None or v.dtype != torch.bool or v.dim() == 0 or v.shape[-1] != width:
        return False
    a = hit.args
    if hit.target is aten.eq.Tensor and len(a) == 2:
        if not _exact_compare(a[0], a[1], width):
            return False
        return (_arange(a[0], width) and _per_row(a[1], width)) or (_arange(a[1], width) and _per_row(a[0], width))
    if hit.target in (aten.mul.Tensor, aten.logical_and.default) and len(a) == 2 and all(isinstance(x, fx.Node) for x in a):
        return (_one_hot(a[0], width) and _per_row(a[1], width)) or (_one_hot(a[1], width) and _per_row(a[0], width))
    return False


def _hits(hit: fx.Node, width: int, call: Any) -> fx.Node:
    """Per row, whether hit (a _one_hot mask) has a true: its per-row values alone, not the row.
    `eq(arange(width), r)`: r is one of 0, 1, ..., width - 1 (NaN is not); an and-ed mask: also
    nonzero."""
    a, b = hit.args
    if hit.target is aten.eq.Tensor:
        r = b if _arange(a, width) else a
        ok = call(aten.logical_and.default, (call(aten.ge.Scalar, (r, 0)), call(aten.le.Scalar, (r, width - 1))))
        if _tensor(r).dtype.is_floating_point:
            ok = call(aten.logical_and.default, (ok, call(aten.eq.Tensor, (call(aten.trunc.default, (r,)), r))))
        return ok
    mask, other = (a, b) if _one_hot(a, width) and _per_row(b, width) else (b, a)
    return call(aten.logical_and.default, (_hits(mask, width, call), call(aten.ne.Scalar, (other, 0))))


def _zero(n: Any) -> bool:
    """A 0-d zero made by scalar_tensor, or full([], 0) as it is traced (what _nll_loss_forward
    passes to where)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    if n.target is aten.scalar_tensor.default:
        return len(n.args) == 1 and n.args[0] == 0
    if n.target is aten.full.default:
        return len(n.args) == 2 and list(n.args[0]) == [] and n.args[1] == 0
    return False


def _elementwise(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function":
        return False
    if t is aten._to_copy.default:
        return set(n.kwargs) <= {"dtype"}
    if t is prims.convert_element_type.default:
        return not n.kwargs
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags and not t._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in t.tags
            and all(not isinstance(x, (list, tuple)) for x in list(n.args) + list(n.kwargs.values())))


def _last_dim_sum(s: fx.Node) -> fx.Node | None:
    """x where s is `sum(x, [-1])` (keepdim or not), x a floating tensor of at least one dim."""
    if s.op != "call_function" or s.target is not aten.sum.dim_IntList or set(s.kwargs) - {"keepdim"}:
        return None
    x = s.args[0]
    xv = _tensor(x)
    if xv is None or xv.dim() == 0 or not xv.dtype.is_floating_point:
        return None
    dims = s.args[1] if len(s.args) > 1 else None
    if not isinstance(dims, (list, tuple)) or [d % xv.dim() for d in dims] != [xv.dim() - 1]:
        return None
    return x


def _match(s: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(hit, V, width) where s is `sum(where(hit, V, 0), [-1])` as the module docstring says."""
    w = _last_dim_sum(s)
    if w is None or w.op != "call_function" or w.target is not aten.where.self or w.kwargs or len(w.users) != 1:
        return None
    wv = _tensor(w)
    hit, v, zero = w.args
    vv = _tensor(v)
    width = wv.shape[-1]
    if vv is None or vv.shape != wv.shape or vv.dtype != wv.dtype or not _zero(zero) or not _one_hot(hit, width):
        return None
    return hit, v, width


def _conversion(n: Any) -> bool:
    """n converts a floating tensor to another floating dtype, and does nothing else."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or len(n.args) < 1:
        return False
    if n.target is aten._to_copy.default:
        ok = len(n.args) == 1 and set(n.kwargs) <= {"dtype", "layout", "device"}
    elif n.target is prims.convert_element_type.default:
        ok = len(n.args) == 2 and not n.kwargs
    else:
        return False
    a, v = _tensor(n.args[0]), _tensor(n)
    return (ok and a is not None and v is not None and a.dtype.is_floating_point and v.dtype.is_floating_point
            and a.device == v.device and a.layout == v.layout == torch.strided)


def _match_scaled(s: fx.Node) -> tuple[fx.Node, fx.Node, int, fx.Node | None] | None:
    """(hit, g, width, conversion) where s is `sum(mul(hit, g), [-1])` (either operand order), or the
    sum of a floating conversion of that product (a bf16 model's gradient summed in float32), hit a
    _one_hot mask and g a floating value constant along the last dim (per row, or a scalar)."""
    m, conv = _last_dim_sum(s), None
    if m is not None and _conversion(m):
        m, conv = m.args[0], m
    mv = _tensor(m)
    if (m is None or m.op != "call_function" or m.target is not aten.mul.Tensor or m.kwargs or len(m.args) != 2
            or mv is None or mv.dim() == 0 or not mv.dtype.is_floating_point or mv.device.type not in _SCALED_DEVICES):
        return None
    width = mv.shape[-1]
    for hit, g in (m.args, m.args[::-1]):
        gv = _tensor(g)
        if (gv is not None and gv.dtype == mv.dtype and _per_row(g, width) and _one_hot(hit, width)):
            return hit, g, width, conv
    return None


def _hoist(node: fx.Node, order: dict[fx.Node, int]) -> None:
    """Moves node and the pure call_function nodes making it to just after the last of their other
    inputs (a placeholder, a node outside them), keeping their order: the one-hot mask of targets is
    traced after the softmax it picks from, but needs nothing from it."""
    closure: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in closure or n.op in ("placeholder", "get_attr"):  # inputs stay where they are
            continue
        if n.op != "call_function" or n.is_impure() or len(closure) > 64:
            return
        closure.add(n)
        stack.extend(n.all_input_nodes)
    inputs = [a for n in closure for a in n.all_input_nodes if a not in closure]
    inputs += [n for n in node.graph.nodes if n.op == "placeholder"][-1:]  # never among the placeholders
    anchor = max(inputs, key=order.__getitem__, default=None)
    if anchor is None:
        return
    for n in sorted(closure, key=order.__getitem__):
        if order[n] > order[anchor]:
            anchor.append(n)
            anchor = n


def rewrite_one_hot_picks(gm: fx.GraphModule, scaled_only: bool = False) -> int:
    """Rewrites, in place, every one-hot pick matched as the module docstring says; returns how many.
    `scaled_only`: the `sum(mul(hit, g), -1)` form alone, on a joint graph (partition.py), where the
    backward's mask still reads the forward's arange (the backward graph gets it as a saved input)."""
    if not config.one_hot_picks():
        return 0
    graph, done, tried = gm.graph, 0, False
    for s in list(graph.nodes):
        m = None if scaled_only else _match(s)
        if m is not None:
            tried = True  # its mask may have moved up, rewritten or not
            done += _pick(graph, s, *m)
            continue
        m = _match_scaled(s)
        if m is not None:
            tried = True
            done += _pick(graph, s, *m[:3], scaled=True, conversion=m[3])
    if tried:
        gm.recompile()
    return done


def _pick(graph: fx.Graph, s: fx.Node, hit: fx.Node, v: fx.Node, width: int, scaled: bool = False,
          conversion: fx.Node | None = None) -> bool:
    """s's value from the picked element of v (`_match`), or, `scaled`, from v itself (`_match_scaled`:
    v is already one value a row, converted as `conversion` converted the product: exact, the
    product being v or a zero)."""
    made: list[fx.Node] = []
    mode = getattr(_tensor(hit), "fake_mode", None)  # new values' metadata made in the graph's fake mode

    def call(target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        fake = [_tensor(a) if isinstance(a, fx.Node) else a for a in args]
        with mode if mode is not None else contextlib.nullcontext():
            val = target(*fake, **(kwargs or {}))
        node = graph.call_function(target, args, kwargs or {})
        node.meta["val"] = val
        made.append(node)
        return node

    def zero_like(x: fx.Node) -> fx.Node:
        xv = _tensor(x)
        return call(aten.scalar_tensor.default, (0.0,), {"dtype": xv.dtype, "device": xv.device})

    picked: dict[fx.Node, fx.Node] = {}
    applied = 0
    order = {n: i for i, n in enumerate(graph.nodes)}

    def pick(x: fx.Node) -> fx.Node:
        nonlocal applied
        if x in picked:
            return picked[x]
        xv = _tensor(x)
        if xv is None:
            raise ValueError("not a tensor")
        if _per_row(x, width):
            out = x
        elif _elementwise(x) and applied < MAX_CHAIN and x is not hit:
            applied += 1
            args = tuple(pick(a) if isinstance(a, fx.Node) else a for a in x.args)
            kwargs = {k: (pick(a) if isinstance(a, fx.Node) else a) for k, a in x.kwargs.items()}
            out = call(x.target, args, kwargs)
        elif xv.dtype.is_floating_point:  # a leaf: the row's one element, the rest -inf, its max
            # (exact, and -0.0 stays -0.0, which a sum with zeros would make +0.0); made as early as
            # the leaf and hit allow: the fuser then puts it in the leaf's first row kernel (beside
            # the softmax's max), not in a kernel of its own after it
            at = x if order[x] > order[hit] else hit
            with graph.inserting_after(at):
                low = call(aten.scalar_tensor.default, (float("-inf"),), {"dtype": xv.dtype, "device": xv.device})
            with graph.inserting_after(low):
                masked = call(aten.where.self, (hit, x, low))
            with graph.inserting_after(masked):
                out = call(aten.amax.default, (masked, [-1], True))
        else:
            raise ValueError("a leaf that is not floating point")
        picked[x] = out
        return out

    if not scaled:
        _hoist(hit, order)  # hit's computation (from the targets alone) as early as its inputs allow
        order = {n: i for i, n in enumerate(graph.nodes)}  # (the graph stays valid if the pick fails)
    with graph.inserting_before(s):
        try:
            value = v if scaled else pick(v)
            if conversion is not None:  # made right after g: a 0-d g's kernel computes it too
                at = v if v.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
                with graph.inserting_after(at):
                    value = call(conversion.target, (value,) + tuple(conversion.args[1:]), dict(conversion.kwargs))
                v = conversion
            want = _tensor(s.args[0]).shape[:-1] + (1,)
            if not scaled and (_tensor(value).shape != want or _tensor(value).dtype != _tensor(v).dtype):
                raise ValueError("the picked value's shape or dtype is not the sum's")
            out = call(aten.where.self, (_hits(hit, width, call), value, zero_like(v)))
            if _tensor(out).shape != want:  # a scalar g and per-row hits broadcast to [.., 1] already
                raise ValueError("the per-row value's shape is not the sum's")
            if not s.kwargs.get("keepdim", s.args[2] if len(s.args) > 2 else False):
                out = call(aten.squeeze.dim, (out, -1))
        except (ValueError, RuntimeError, TypeError, AssertionError):  # AssertionError: fake modes mixed
            for n in reversed(made):
                graph.erase_node(n)
            return False
    if _tensor(out).shape != _tensor(s).shape or _tensor(out).dtype != _tensor(s).dtype:
        for n in reversed(made):
            graph.erase_node(n)
        return False
    for n in made:
        n.meta.update({k: val for k, val in s.meta.items() if k not in ("val", "tensor_meta")})
    s.replace_all_uses_with(out)
    dead = [s]  # the sum, and what only it read (the where, V's whole-row nodes no one else reads)
    while dead:
        n = dead.pop()
        if n.users or n.op != "call_function" or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        dead.extend(inputs)
    return True
