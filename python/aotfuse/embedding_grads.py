"""A tied embedding's gradient added into the other gradient of its weight, not built apart.

A weight used both as an embedding and elsewhere (Hugging Face's tied input embeddings and LM head:
Bert, GPT2, Albert, Longformer) gets two gradients in the backward, summed:
`add(mm(g^T, h), embedding_dense_backward(g_emb, ids, V, pad, False))`. ATen's embedding backward
fills a fresh [V, H] tensor with zeros and adds each token's gradient row into it, and the add then
reads both [V, H] tensors and writes a third: three passes over vocabulary-sized tensors, two of
them fresh allocations (page faults on the CPU), for a few hundred rows of actual gradient.

Here the sum becomes `index_add(X, 0, flat(ids), flat(g_emb))`: the token rows added straight into
the other gradient X (rows of the padding index masked to zero first, as the embedding backward
skips them). The C runtime lets `index_add` write into X's own tensor where X dies at that step
(runtime.c, plan_reuse's in-place results), so the sum costs one pass over the token rows.

The rows are added in token order, as ATen's CPU embedding backward adds them, but onto X rather
than onto zeros: the sum rounds differently in the last bits. Rewritten on the CPU only (CUDA's
`index_add` adds with atomics, in no fixed order; its embedding backward is deterministic), for
`scale_grad_by_freq=False`, equal dtypes and contiguous tensors; AOTFUSE_EMBEDDING_GRADS=0 keeps
the graph as traced.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from . import config
from .partition import _val

__all__ = ["rewrite_embedding_grad_sums"]

aten = torch.ops.aten


def _match(add: fx.Node) -> tuple[fx.Node, fx.Node, list] | None:
    """(the embedding backward, the other addend, the embedding backward's five arguments) where
    `add` sums them as described above."""
    if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) != 2:
        return None
    if set(add.kwargs) - {"alpha"} or add.kwargs.get("alpha", 1) != 1:
        return None
    out = _val(add)
    if out is None or out.device.type != "cpu" or not out.dtype.is_floating_point or not out.is_contiguous():
        return None
    for emb, other in (add.args, add.args[::-1]):
        if not (isinstance(emb, fx.Node) and emb.op == "call_function"
                and emb.target is aten.embedding_dense_backward.default and len(emb.users) == 1):
            continue
        if not isinstance(other, fx.Node) or other is emb:
            continue
        args = list(emb.args) + [emb.kwargs[k] for k in ("num_weights", "padding_idx", "scale_grad_by_freq")
                                 if k in emb.kwargs]
        if len(args) != 5 or args[4] is not False or not isinstance(args[3], int) or isinstance(args[3], bool):
            continue  # a padding index known only at run time (a symbolic size) keeps the traced sum
        grad, ids = _val(args[0]), _val(args[1])
        x, e = _val(other), _val(emb)
        if grad is None or ids is None or x is None or e is None:
            continue
        if not (x.shape == e.shape == out.shape and x.dtype == e.dtype == out.dtype == grad.dtype
                and x.device == out.device and x.is_contiguous() and grad.is_contiguous() and ids.is_contiguous()
                and e.dim() == 2 and grad.shape[-1] == e.shape[1] and grad.numel() == ids.numel() * e.shape[1]):
            continue
        return emb, other, args
    return None


def rewrite_embedding_grad_sums(gm: fx.GraphModule) -> int:
    """Rewrites, in place, each `add(embedding_dense_backward(...), X)` matched as the module
    docstring says into an `index_add` onto X; returns how many."""
    if not config.embedding_grads():
        return 0
    graph, done = gm.graph, 0
    for add in list(graph.nodes):
        found = _match(add)
        if found is None:
            continue
        emb, other, (grad, ids, _num, pad, _scale) = found
        gval, ival = _val(grad), _val(ids)
        width = _val(emb).shape[1]
        made: list[fx.Node] = []

        def call(target: Any, args: tuple, val: torch.Tensor) -> fx.Node:
            node = graph.call_function(target, args)
            node.meta["val"] = val
            made.append(node)
            return node

        try:
            with graph.inserting_before(add):
                flat_ids = call(aten.view.default, (ids, [-1]), aten.view.default(ival, [-1]))
                rows = call(aten.view.default, (grad, [-1, width]), aten.view.default(gval, [-1, width]))
                if pad >= 0:  # the padding index's rows add nothing
                    is_pad = call(aten.eq.Scalar, (flat_ids, pad), aten.eq.Scalar(flat_ids.meta["val"], pad))
                    col = call(aten.unsqueeze.default, (is_pad, 1), aten.unsqueeze.default(is_pad.meta["val"], 1))
                    rows = call(aten.masked_fill.Scalar, (rows, col, 0.0),
                                aten.masked_fill.Scalar(rows.meta["val"], col.meta["val"], 0.0))
                summed = call(aten.index_add.default, (other, 0, flat_ids, rows),
                              aten.index_add.default(_val(other), 0, flat_ids.meta["val"], rows.meta["val"]))
        except Exception:  # a layout the fake values refuse: keep the traced sum
            for node in reversed(made):
                graph.erase_node(node)
            continue
        if tuple(summed.meta["val"].shape) != tuple(_val(add).shape) or summed.meta["val"].stride() != _val(add).stride():
            for node in reversed(made):
                graph.erase_node(node)
            continue
        summed.meta.update({k: v for k, v in add.meta.items() if k != "val"})
        add.replace_all_uses_with(summed)
        graph.erase_node(add)
        graph.erase_node(emb)
        done += 1
    if done:
        gm.recompile()
    return done
