"""Mixture-of-experts layers as one graph: transformers' grouped matmul fallback made traceable.

transformers (5.x) runs every expert of its mixture-of-experts layers (Mixtral, Qwen2-MoE, OLMoE, ...)
as one grouped matmul over the tokens sorted by expert: ATen's `_grouped_mm` where it can (bf16, and
outside a compile), else its custom op `transformers::grouped_mm_fallback`, a loop of `mm` over the
experts' token ranges. A capture takes the fallback for float32 (transformers asks
`torch.compiler.is_compiling()`, true while aotfuse traces, and ATen's op compiles for bf16 only).
The op's forward is opaque with a fake kernel, so it traces; its registered backward reads the
offsets with `.tolist()`, a data-dependent value no trace can hold, so every float32 MoE model failed
the capture (CaptureError, or Dynamo's pieces under fallback="dynamo").

`traceable_autograd` is the op's Autograd kernel while aotfuse traces (decompositions.upstream_fixes
puts it in the op's Python kernels and takes it out again): the same forward, and a backward of two
opaque ops with fake kernels, the op itself for the input's gradient (the gradient times each
expert's transposed weight) and `aotfuse::grouped_mm_weight_grad` for the weights' (each expert's
token range of the input, transposed, times the gradient's), so the joint graph holds them as extern
calls and the C core runs them at each step. Numerics are the op's own: the same `mm` calls.
"""
from __future__ import annotations

import sys

import torch


@torch.library.custom_op("aotfuse::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    """[experts, K, N]: expert i's input rows offs[i-1]:offs[i] ([S, K], sorted by expert), transposed,
    times the gradient's same rows ([S, N]); 0 for an expert without tokens."""
    out = input.new_zeros(experts, input.size(1), grad.size(1))
    start = 0
    for i, end in enumerate(offs.tolist()):  # one read of the offsets, as the forward's loop does
        if end > start:
            torch.mm(input[start:end].transpose(0, 1), grad[start:end], out=out[i])
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    return input.new_empty(experts, input.size(1), grad.size(1))


def fallback_op() -> torch._ops.OpOverload | None:
    """transformers' `grouped_mm_fallback` where transformers registered it (its moe module is imported),
    else None."""
    if "transformers.integrations.moe" not in sys.modules:
        return None
    try:
        return torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):
        return None


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight, offs)
        with torch._C._AutoDispatchBelowAutograd():
            return fallback_op()(input, weight, offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        input, weight, offs = ctx.saved_tensors
        grad_input = fallback_op()(grad, weight.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        grad_weight = grouped_mm_weight_grad(input, grad, offs, weight.size(0)) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None


def traceable_autograd(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The fallback op's Autograd kernel while aotfuse traces (module docstring)."""
    return _GroupedMM.apply(input, weight, offs)
