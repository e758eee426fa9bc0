"""aotfuse's decomposition table: the one place that decides which ATen ops reach the C core as
pointwise primitives plus reductions (so that later stages can fuse them) and which stay whole."""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

__all__ = ["default_decompositions"]

aten = torch.ops.aten

# Norms, softmax and activations (and their backwards) become pointwise ops and reductions;
# matmuls, convolutions, embedding and attention stay whole (extern calls).
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
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten._softmax,
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.nll_loss_forward,
    aten.nll_loss_backward,
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


def default_decompositions() -> dict:
    """The table memory_efficient_fusion and aot_function use when given none (a fresh dict)."""
    return get_decompositions(_DECOMPOSED)
