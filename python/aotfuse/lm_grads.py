"""A language-model head's logits gradient made in vocabulary chunks, never whole.

The backward of `logits = h @ W^T (+ b)` followed by a cross entropy makes the logits' gradient G
([tokens x vocab], the largest tensor of a step: 16 MB for Bert at the reduced size in float32, 411 MB
for GPT2 at the seed's shapes) and reads it three times: `mm(G, W)` (the hidden states' gradient),
`mm(G^T, h)` (the weight's) and a column sum (the bias'). G is at the backward's peak.

Here G is made in K chunks of its columns (vocabulary slices; K from G's size, at most 8): for each
chunk c, the elementwise computation that produced G runs on the slices of its [.., vocab] operands
(the logits, a label mask...; per-row values such as the log-sum-exp broadcast as they are), and
its three readers take that chunk: `mm(G_c, W[c])` summed over the chunks, `mm(G_c^T, h)` and the
column sums concatenated. Only one chunk of G is alive at a time (the C runtime's buffer reuse gives
each chunk the previous one's tensor), so the peak falls by about G's size, less a chunk.

Row reductions of the elementwise computation (the cross entropy's per-row sums) read whole rows:
they stay as traced, outside the chunks. The rewrite needs every reader of G to be one of the three
above, the weight's among them (a backward), G's computation to be a softmax's gradient (an exp and a
per-row value: not an MLP's wide activations, whose gradients have the same readers), and float32 or
float64 G: the hidden states' gradient is a sum of K products, rounded once per
chunk, which costs nothing visible in float32 but in bfloat16 would round K times where the single
product rounds once (no CPU matmul gives a float32 result of bfloat16 operands). AOTFUSE_LM_GRAD_CHUNKS=0
keeps the graph as traced.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from . import config
from .lower import _plain_conversion  # a `_to_copy` changing the dtype alone (GPT2's `.to(dtype, layout, device)`)
from .partition import _val

__all__ = ["rewrite_lm_grad_chunks", "rewrite_head_chunks", "chunk_count"]

aten = torch.ops.aten

CHUNK_BYTES = 4 << 20  # a chunk of G about this size: the mm's operands stay in the CPU's caches
MAX_CHUNKS = 8
MIN_VOCAB = 2048
CHUNK_MARK = "aotfuse_lm_grad_chunk"
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SAME = (aten.alias.default, aten.clone.default)
_MOVABLE = (aten.t.default, aten.view.default, aten.permute.default, aten.transpose.int, aten.alias.default)


def chunk_count(nbytes: int) -> int:
    """How many chunks a G of nbytes is made in (1: not chunked)."""
    if nbytes < 2 * CHUNK_BYTES:
        return 1
    return max(2, min(MAX_CHUNKS, math.ceil(nbytes / CHUNK_BYTES)))


def _tensor(n: Any) -> torch.Tensor | None:
    v = _val(n) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _readers(g: fx.Node) -> tuple[list, list, list] | None:
    """G's readers by kind: [mm(G, X)], [(t(G), mm(t(G), Y))], [sum(G, [0], keepdim)]; None where G
    has another reader."""
    left, right, sums = [], [], []
    for u in g.users:
        if u.op != "call_function":
            return None
        if u.target is aten.mm.default and u.args[0] is g and u.args[1] is not g and not u.kwargs:
            left.append(u)
        elif u.target is aten.t.default and u.users and all(
                w.op == "call_function" and w.target is aten.mm.default and w.args[0] is u and w.args[1] is not g
                and not w.kwargs for w in u.users):
            right.extend((u, w) for w in u.users)
        elif (u.target is aten.sum.dim_IntList and len(u.args) >= 2 and list(u.args[1]) in ([0], [-2])
              and set(u.kwargs) <= {"keepdim"} and "dtype" not in u.kwargs):
            sums.append(u)
        else:
            return None
    return (left, right, sums) if (left or right) else None


def _region(g: fx.Node, vocab: int) -> set[fx.Node] | None:
    """The nodes G's chunks recompute on column slices: G and its ancestors that are elementwise
    (or views keeping the last dim) with last dim `vocab`, every tensor operand either such a node,
    a [.., vocab] leaf to slice, or broadcast along the last dim. None where G itself is not."""
    region: set[fx.Node] = set()

    def chunkable(n: fx.Node) -> bool:
        v = _tensor(n)
        if n.op != "call_function" or v is None or v.dim() == 0 or v.shape[-1] != vocab:
            return False
        t = n.target
        if t in _VIEWS:
            src = _tensor(n.args[0])
            if src is None or src.dim() == 0 or src.shape[-1] != vocab or len(n.args) != 2 or n.kwargs:
                return False
        elif t in _SAME:
            if set(n.kwargs) - ({"memory_format"} if t is aten.clone.default else set()):
                return False
            if n.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
                return False
        elif t is aten._to_copy.default:
            if not _plain_conversion(n):
                return False
        elif not (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
                  and not t._schema.is_mutable and torch.Tag.nondeterministic_seeded not in t.tags):
            return False
        for a in n.all_input_nodes:
            av = _tensor(a)
            if av is None:
                return False
            if av.dim() > 0 and av.shape[-1] not in (1, vocab):
                return False
        return True

    if not chunkable(g):
        return None
    stack = [g]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in n.all_input_nodes:
            if a not in region and chunkable(a):
                stack.append(a)
    return region


def _softmax_like(region: set[fx.Node]) -> bool:
    """Whether the region is a (log-)softmax's gradient: an exp, and a per-row value ([.., 1]) read.
    A weight gradient's reader is required too (a backward): an MLP's wide activations, whose
    gradients have the same three readers, are left as traced."""
    has_exp = any(n.target is aten.exp.default for n in region)
    per_row = any((v := _tensor(a)) is not None and v.dim() > 0 and v.shape[-1] == 1
                  for n in region for a in n.all_input_nodes if a not in region)
    return has_exp and per_row


def rewrite_lm_grad_chunks(gm: fx.GraphModule) -> int:
    """Rewrites, in place, each logits gradient matched as the module docstring says into chunks;
    returns how many."""
    if not config.lm_grad_chunks():
        return 0
    graph, done = gm.graph, 0
    for g in list(graph.nodes):
        gv = _tensor(g)
        if (g.op != "call_function" or gv is None or gv.dim() != 2 or gv.dtype not in (torch.float32, torch.float64)
                or gv.shape[1] < MIN_VOCAB or g.meta.get(CHUNK_MARK)):
            continue
        k = chunk_count(gv.numel() * gv.element_size())
        readers = _readers(g) if k > 1 else None
        region = _region(g, gv.shape[1]) if readers and readers[1] else None
        if region is None or not _softmax_like(region):
            continue
        if _chunk(graph, g, readers, region, k):
            done += 1
    if done:
        gm.recompile()
    return done


def _chunk_width(vocab: int, k: int) -> int:
    """The columns of each of k chunks: boundaries on 64-column (256-byte) lines."""
    width = -(-vocab // k)
    return -(-width // 64) * 64


def _caller(graph: fx.Graph, made: list) -> Any:
    """call(target, args, kwargs): a node of the graph (at its insertion point) calling target, its
    value computed on the arguments' fake values; appended to `made`, so a failed rewrite can erase
    what it made."""
    def call(target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        fake = [_tensor(a) if isinstance(a, fx.Node) else a for a in args]
        fake = [[_tensor(x) if isinstance(x, fx.Node) else x for x in a] if isinstance(a, list) else a for a in fake]
        val = target(*fake, **(kwargs or {}))
        node = graph.call_function(target, args, kwargs or {})
        node.meta["val"] = val
        made.append(node)
        return node
    return call


def _chunk(graph: fx.Graph, g: fx.Node, readers: tuple[list, list, list], region: set[fx.Node], k: int) -> bool:
    vocab = _tensor(g).shape[1]
    width = _chunk_width(vocab, k)
    left, right, sums = readers
    made: list[fx.Node] = []
    call = _caller(graph, made)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_reader = min(g.users, key=order.__getitem__)
    if any(not isinstance(mm.args[1], fx.Node) for mm in left) or any(not isinstance(mm.args[1], fx.Node) for _t, mm in right):
        return False

    def early(x: fx.Node) -> fx.Node:
        """x, or where it is made after G's first reader: a copy there of the views making it (the
        weight's `t` is traced just before its matmul), or x itself moved there where it is elementwise
        work (the hidden states recomputed in the backward, placed before their first reader, the
        weight's matmul); anything else cannot move"""
        if order[x] < order[first_reader]:
            return x
        if x.op == "call_function" and x.target in _MOVABLE:
            return call(x.target, tuple(early(a) if isinstance(a, fx.Node) else a for a in x.args), dict(x.kwargs))
        if x.op != "call_function" or not _elementwise(x):
            raise ValueError("an operand made after G's first reader")
        for a in x.all_input_nodes:  # its operands first
            e = early(a)
            if e is not a:  # a copied view
                x.replace_input_with(a, e)
        first_reader.prepend(x)
        order[x] = order[first_reader] - 0.5
        return x

    try:
        with graph.inserting_before(first_reader):
            xs = [early(mm.args[1]) for mm in left]
            ys = [early(mm.args[1]) for _t, mm in right]
            unread: list[fx.Node] = []  # old matmuls left unread by the rewrite (after their readers)
            totals: list = [None] * len(left)  # the hidden states' gradients: running sums of the chunks' products
            parts: dict[str, list] = {"right": [[] for _ in right], "sums": [[] for _ in sums]}
            for c in range(k):
                lo, hi = c * width, min(vocab, (c + 1) * width)
                if lo >= hi:
                    break
                env: dict[fx.Node, fx.Node] = {}

                def chunk(n: fx.Node) -> fx.Node:
                    if n in env:
                        return env[n]
                    v = _tensor(n)
                    if n not in region:  # a leaf: its columns, or the whole of it where it broadcasts
                        out = n if v.dim() == 0 or v.shape[-1] == 1 else call(aten.slice.Tensor, (n, v.dim() - 1, lo, hi))
                    else:
                        args = tuple(chunk(a) if isinstance(a, fx.Node) else a for a in n.args)
                        if n.target in _VIEWS:
                            shape = list(n.args[1])
                            if shape[-1] != -1:
                                shape[-1] = hi - lo
                            out = call(aten.view.default, (args[0], shape))
                        else:
                            out = call(n.target, args, dict(n.kwargs))
                    env[n] = out
                    return out

                gc = chunk(g)
                gc.meta[CHUNK_MARK] = True  # a chunk is never chunked again (a backward variant is lowered anew)
                for i, x in enumerate(xs):  # summed as they come: one partial product alive at a time
                    part = call(aten.mm.default, (gc, _rows(call, x, lo, hi)))
                    totals[i] = part if totals[i] is None else call(aten.add.Tensor, (totals[i], part))
                gt = call(aten.t.default, (gc,)) if right else None
                for i, y in enumerate(ys):
                    parts["right"][i].append(call(aten.mm.default, (gt, y)))
                for i, s in enumerate(sums):
                    parts["sums"][i].append(call(aten.sum.dim_IntList, (gc, [0], bool(_keepdim(s)))))
            news: list[tuple[fx.Node, fx.Node]] = []
            news += list(zip(left, totals))
            for i, (_t, mm) in enumerate(right):
                narrow = _narrowing(mm)
                if narrow is None:
                    news.append((mm, call(aten.cat.default, (parts["right"][i], 0))))
                else:  # each chunk's rows rounded before they are joined: half the bytes held for the join
                    dtype = narrow.kwargs["dtype"]
                    news.append((narrow, call(aten.cat.default, (
                        [call(aten._to_copy.default, (part,), {"dtype": dtype}) for part in parts["right"][i]], 0))))
                    unread.append(mm)
            for i, s in enumerate(sums):
                news.append((s, call(aten.cat.default, (parts["sums"][i], 1 if _keepdim(s) else 0))))
    except Exception:  # a view or layout the fake values refuse: keep the traced graph
        for node in reversed(made):
            graph.erase_node(node)
        return False
    for old, new in news:
        ov, nv = _tensor(old), _tensor(new)
        if ov is None or nv is None or tuple(ov.shape) != tuple(nv.shape) or ov.dtype != nv.dtype:
            for node in reversed(made):
                graph.erase_node(node)
            return False
    for old, new in news:
        new.meta.update({key: val for key, val in old.meta.items() if key != "val"})
        old.replace_all_uses_with(new)
    # what only the old readers read goes: the readers, G's transposes, then G and its region where unread
    for old, _new in news:
        graph.erase_node(old)
    for mm in unread:  # a weight gradient whose rounding took the chunks' rows
        graph.erase_node(mm)
    for t in dict.fromkeys(t for t, _mm in right):  # two matmuls may read one transpose
        if not t.users:
            graph.erase_node(t)
    for n in sorted(region, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
    return True


def _rows(call: Any, x: fx.Node, lo: int, hi: int, dim: int = 0) -> fx.Node:
    """Rows lo:hi (dim 1: columns) of x (2-d, or a 1-d bias); where x is a float32 conversion (a 16-bit weight its
    matmuls read in float32, decompositions._float32_table), through transposes, the conversion of its
    source's slice: the whole weight is never converted (Bert's [8192 x 256] float16 head: 8.4 MB in
    float32)."""
    y, flips, first = x, 0, dim
    while y.op == "call_function" and y.target is aten.t.default and isinstance(y.args[0], fx.Node):
        y, dim, flips = y.args[0], 1 - dim, flips + 1
    if (y.op == "call_function" and y.target is aten._to_copy.default and len(y.args) == 1
            and set(y.kwargs) == {"dtype"} and isinstance(y.args[0], fx.Node)):
        out = call(aten._to_copy.default, (call(aten.slice.Tensor, (y.args[0], dim, lo, hi)),), dict(y.kwargs))
        for _ in range(flips):
            out = call(aten.t.default, (out,))
        return out
    return call(aten.slice.Tensor, (x, first, lo, hi))


_HEADS = (aten.mm.default, aten.addmm.default)


def rewrite_head_chunks(gm: fx.GraphModule) -> int:
    """A language-model head's forward computed in float32 for a 16-bit model
    (decompositions._float32_table: `_to_copy(addmm(b, x, t(_to_copy(W))), dtype=float16)`) holds its
    float32 logits, twice the bytes of the 16-bit ones, beside their rounding, and the whole weight in
    float32: the step's peak in the seed models (Albert's [1024 x 8192] logits: 33.5 MB in float32). Made
    in vocabulary chunks of columns instead, as the backward's gradient is (same CHUNK_BYTES, at most
    MAX_CHUNKS), each chunk converting its rows of the weight and rounded as it comes, joined by a cat:
    the float32 bytes alive are one chunk's. The values are the whole product's (each column is the same
    dot product). Returns how many heads were rewritten; AOTFUSE_LM_GRAD_CHUNKS=0 keeps them whole."""
    if not config.lm_grad_chunks():
        return 0
    graph, done = gm.graph, 0
    for narrow in list(graph.nodes):
        if narrow.op != "call_function" or narrow.target is not aten._to_copy.default or not narrow.args:
            continue
        mm = narrow.args[0]
        if not (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target in _HEADS
                and all(mm.kwargs.get(key, 1) == 1 for key in ("beta", "alpha")) and set(mm.kwargs) <= {"beta", "alpha"}
                and _narrowing(mm) is narrow):
            continue
        out = _tensor(mm)
        if out is None or out.dim() != 2 or out.dtype != torch.float32 or not isinstance(out.shape[1], int) \
                or out.shape[1] < MIN_VOCAB or not all(isinstance(d, int) for d in out.shape):
            continue
        k = chunk_count(out.numel() * out.element_size())
        if k < 2:
            continue
        if _chunk_head(graph, mm, narrow, k):
            done += 1
    if done:
        gm.recompile()
    return done


def _chunk_head(graph: fx.Graph, mm: fx.Node, narrow: fx.Node, k: int) -> bool:
    vocab = _tensor(mm).shape[1]
    width = _chunk_width(vocab, k)
    bias = mm.args[0] if mm.target is aten.addmm.default else None
    a, b = mm.args[-2], mm.args[-1]
    if len(mm.args) != (3 if bias is not None else 2) or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return False
    bv = _tensor(bias) if isinstance(bias, fx.Node) else None
    if bias is not None and (bv is None or bv.dim() != 1):
        return False  # a broadcast row of biases (Linear's); beta and alpha are 1 (the caller's check)
    made: list[fx.Node] = []
    call = _caller(graph, made)
    try:
        with graph.inserting_before(narrow):
            parts = []
            for c in range(k):
                lo, hi = c * width, min(vocab, (c + 1) * width)
                if lo >= hi:
                    break
                cols = _rows(call, b, lo, hi, dim=1)
                if bias is None:
                    part = call(aten.mm.default, (a, cols))
                else:
                    part = call(aten.addmm.default, (_rows(call, bias, lo, hi), a, cols))
                parts.append(call(aten._to_copy.default, (part,), dict(narrow.kwargs)))
            joined = call(aten.cat.default, (parts, 1))
    except Exception:  # a layout the fake values refuse: keep the graph as traced
        for node in reversed(made):
            graph.erase_node(node)
        return False
    ov, nv = _tensor(narrow), _tensor(joined)
    if ov is None or nv is None or tuple(ov.shape) != tuple(nv.shape) or ov.dtype != nv.dtype \
            or tuple(ov.stride()) != tuple(nv.stride()):
        for node in reversed(made):
            graph.erase_node(node)
        return False
    joined.meta.update({key: val for key, val in narrow.meta.items() if key != "val"})
    narrow.replace_all_uses_with(joined)
    graph.erase_node(narrow)
    graph.erase_node(mm)
    for n in (b, bias):  # the whole conversions and views only the old matmul read
        while isinstance(n, fx.Node) and not n.users and n.op == "call_function" and n.target in (
                aten.t.default, aten._to_copy.default):
            src = n.args[0]
            graph.erase_node(n)
            n = src
    return True


def _narrowing(mm: fx.Node) -> fx.Node | None:
    """mm's one reader where that is a conversion to a 16-bit dtype (a float32 weight gradient of a
    16-bit weight, decompositions._float32_table), else None."""
    users = list(mm.users)
    if len(users) != 1:
        return None
    u = users[0]
    if (u.op == "call_function" and u.target is aten._to_copy.default and len(u.args) == 1
            and set(u.kwargs) == {"dtype"} and u.kwargs["dtype"] in (torch.float16, torch.bfloat16)):
        return u
    return None


def _elementwise(n: fx.Node) -> bool:
    """Whether n is elementwise work or a view that can run anywhere after its operands: no random
    numbers, no mutation."""
    t = n.target
    if t in _VIEWS or t in _SAME or t in _MOVABLE or t in (aten.expand.default, aten.unsqueeze.default,
                                                          aten.squeeze.dim, aten._to_copy.default):
        return True
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags and not t._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in t.tags)


def _keepdim(s: fx.Node) -> bool:
    return bool(s.args[2]) if len(s.args) > 2 else bool(s.kwargs.get("keepdim", False))
