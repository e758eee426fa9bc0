"""aotfuse's decomposition table: the one place that decides which ATen ops reach the C core as
pointwise primitives plus reductions (so that later stages can fuse them) and which stay whole."""
from __future__ import annotations

import os

import torch
from torch._decomp import get_decompositions

from . import config

__all__ = ["default_decompositions"]

aten = torch.ops.aten

# Activations and losses (and their backwards) become pointwise ops and reductions; matmuls,
# convolutions, embedding and attention stay whole (extern calls).
_DECOMPOSED = [
    aten.detach,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.tanh_backward,
    aten.sigmoid_backward,
    aten.threshold_backward,
    aten.hardtanh_backward,
    aten.hardsigmoid_backward,
    aten.hardswish_backward,
    aten.leaky_relu_backward,
    aten.elu_backward,
    aten.softplus_backward,
    aten.mse_loss_backward,
    aten.l1_loss,
    aten.native_dropout_backward,
    aten.masked_fill,
    aten.addcmul,
    aten.addcdiv,
    aten.clamp_min,
    aten.clamp_max,
    aten.logit_backward,
    aten.rsub,
    aten.transpose.int,
]


# Layer norm and softmax (and their backwards) decompose into reductions whose epilogues (the
# normalize, the divide) the CPU fuser cannot yet put in the same kernel; ATen's native kernels
# do each in one pass, and measured faster (benchmarks/blocks.py, 1 thread: Bert layer 73 ms whole
# vs 98 ms decomposed, GPT2 block 68 vs 85 ms) for the same saved bytes within 1%. They stay whole
# until the fuser handles them; AOTFUSE_DECOMPOSE_NORMS=1 decomposes them anyway.
#
# nll_loss (the second half of cross entropy) is never decomposed: its backward would be a zero
# fill, a scatter and masking multiplies over the whole [tokens x vocab] gradient (Bert, reduced CPU
# config: 27 ms of a 228 ms step, against ATen's one zero fill and one write per row).
_NORMS = [
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten._softmax,
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
]


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as two reductions (mean, then the mean square deviation): the C backend runs both,
    and whatever normalizes with them, as phases of one kernel; two passes are numerically sound
    where E[x^2] - E[x]^2 is not. Low-precision inputs are computed in float32, as ATen does."""
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    dims = [d % max(x.dim(), 1) for d in dims] or list(range(x.dim()))
    n = 1
    for d in dims:
        n *= x.shape[d]
    low = x.dtype in (torch.float16, torch.bfloat16)
    xf = torch.ops.prims.convert_element_type(x, torch.float32) if low else x
    mean = aten.mean.dim(xf, dims, True)
    diff = aten.sub.Tensor(xf, mean)
    c = 1 if correction is None else correction
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(diff, diff), dims, True), max(n - c, 0))
    if not keepdim:
        var, mean = aten.squeeze.dims(var, dims), aten.squeeze.dims(mean, dims)
    if low:
        var = torch.ops.prims.convert_element_type(var, x.dtype)
        mean = torch.ops.prims.convert_element_type(mean, x.dtype)
    return var, mean


_SEED_HIGH = 2**63 - 1


def _native_dropout(input, p, train):
    """Dropout with aotfuse's counter-based generator (rng.py): the forward draws one 8-byte seed
    from torch's generator, the mask is `philox_rand(seed) > p`, a pointwise function of the seed
    that the kernel applying it computes and the backward recomputes (never stored). Tensors whose
    device gets no generated kernels keep ATen's dropout."""
    if not (train and p != 0) or p == 1 or not input.dtype.is_floating_point:
        return NotImplemented  # ATen's own (identity, all-zero, or its error)
    if not config.kernels_for(input.device):
        return NotImplemented
    from . import rng  # noqa: F401  (registers aotfuse::rng_uniform)

    seed = aten.randint.low(0, _SEED_HIGH, [], dtype=torch.int64, device=input.device)
    keep = aten.gt.Scalar(torch.ops.aotfuse.rng_uniform(seed, list(input.shape)), p)
    return aten.mul.Tensor(aten.mul.Tensor(keep, input), float(1.0 / (1.0 - p))), keep


def default_decompositions(norms: bool | None = None, random: bool | None = None) -> dict:
    """The table memory_efficient_fusion and aot_function use when given none (a fresh dict).
    norms: also decompose layer norm and softmax (default: AOTFUSE_DECOMPOSE_NORMS, off).
    random: dropout with aotfuse's own generator, fused and recomputed (default: on unless
    AOTFUSE_FALLBACK_RANDOM=1 or no kernels are generated)."""
    if norms is None:
        norms = os.environ.get("AOTFUSE_DECOMPOSE_NORMS", "0") not in ("", "0")
    if random is None:
        random = not config.fallback_random() and config.fusion()
    table = get_decompositions(_DECOMPOSED + (_NORMS if norms else []))
    if norms:
        table[aten.var_mean.correction] = _var_mean
    if random:
        table[aten.native_dropout.default] = _native_dropout
    return table
