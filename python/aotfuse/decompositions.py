"""aotfuse's decomposition table: the one place that decides which ATen ops reach the C core as
pointwise primitives plus reductions (so that later stages can fuse them) and which stay whole."""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch._decomp import get_decompositions

from . import config

__all__ = ["default_decompositions", "LayoutRetry", "conv_layout", "keep_layout", "layout_begin", "layout_class", "layout_end"]

aten = torch.ops.aten

# Activations and losses (and their backwards) become pointwise ops and reductions; matmuls,
# convolutions, embedding and attention stay whole (extern calls). (`detach` becomes `alias` on the
# traced graphs, lower.detaches_as_aliases: decomposed here it would trace as a differentiable view.)
_DECOMPOSED = [
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
    aten.rsub,
    aten.transpose.int,
]


# Activations and losses whose forward (and some backwards) are one ATen kernel each: decomposed where
# kernels are generated (config.fusion()), so that they fuse with the pointwise work around them (a
# linear layer's bias, a residual add, the loss's reduction) as GELU and SiLU do, and their backwards
# with theirs; without fusion they stay ATen's. Their pieces are op-table expressions; the C kernels'
# exp, log1p, expm1, tanh and log are the prelude's vectorized polynomials (codegen_c.c), so ELU,
# softplus, Mish, log-sigmoid and binary cross entropy vectorize. AOTFUSE_DECOMPOSE_ACTIVATIONS=0 keeps
# ATen's (an A/B). Binary cross entropy's input check (in [0, 1]) is data-dependent: decomposed, an input
# outside gives NaN (as torch.compile's), where eager raises.
_ACTIVATIONS = [
    aten.elu,  # and SELU, which calls elu
    aten.celu,
    aten.softplus,
    aten.mish,
    aten.mish_backward,
    aten.log_sigmoid_forward,  # its backward: _log_sigmoid_backward
    aten.hardswish,
    aten.hardsigmoid,
    aten.leaky_relu,
    aten.softshrink,
    aten.hardshrink,
    aten.glu,  # not its backward: torch's concatenates the halves' gradients, a copy ATen's avoids
    aten.sgn,
    aten.xlogy,
    aten.binary_cross_entropy,
    aten.binary_cross_entropy_backward,
    aten.binary_cross_entropy_with_logits,
    aten.smooth_l1_loss,
    aten.smooth_l1_loss_backward,
    aten.huber_loss,
    aten.huber_loss_backward,
]


# Layer norm and softmax (and their backwards) are decomposed by default: each becomes one phased
# kernel with the pointwise work around it (the attention's scale, mask and dropout; the residual add
# and dropout before a layer norm), on the CPU and on CUDA. Measured in in-process A/Bs (2026-12-02,
# benchmarks/ab_env.py, after the C helpers became always_inline): 0.86-0.99 of the step at host size
# (the regime of a fast GPU), 0.97-1.02 at the seed's shapes on the CPU, 0.99-1.01 at reduced size,
# the same peak. AOTFUSE_DECOMPOSE_NORMS=0 keeps ATen's native kernels.
#
# Cross entropy's backward is the one place a norm-like op decides peak memory: ATen's nll_loss
# backward makes a zero-filled [tokens x vocab] gradient, log_softmax's backward a second one, beside
# the saved log-probabilities (GPT2 at the seed's shapes: 0.4 GB each, and the peak of the step). So
# log_softmax and its backward are decomposed by default (not softmax or layer norm), and nll_loss's
# backward becomes a one-hot compare (class index == target, a pointwise op, never a scatter): the
# fuser then makes the loss gradient one row kernel with a single [tokens x vocab] output. nll_loss's
# forward becomes a masked row sum in log_softmax's kernel, so the log-probabilities are never stored:
# the forward keeps the logits and two numbers a row.
_NORMS = [
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten._softmax,
    aten._softmax_backward_data,
]


_LOSS = [aten._log_softmax, aten._log_softmax_backward_data]

# Batch norm on the CPU (training and backward: aotfuse's _batch_norm_functional and
# _batch_norm_backward, two-pass statistics; evaluation: torch's decomposition): its statistics become one phased row kernel
# per channel (nested reduced loops over N and H x W, each run of H x W vectorized), the
# normalization fuses with the ReLU and residual add around it, and the backward's two sums and input
# gradient with the ReLU's mask. On CUDA it stays ATen's (cuDNN's): a row per channel is far too few
# blocks for a GPU. Float32 only by default (config.batch_norm_dtypes: ATen's bf16 batch norm is fast
# on the CPU); AOTFUSE_DECOMPOSE_BATCH_NORM=1 takes float16 and bfloat16 too, =0 keeps ATen's.
_BATCH_NORM = [
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
]


def _where_kernels(table: dict) -> dict:
    """The table's decompositions, each used only where kernels are generated for its first
    tensor's device (elsewhere the op stays whole: decomposed, it would be many ATen calls)."""
    out = {}
    for op, fn in table.items():
        def decomposed(*args, _fn=fn, **kwargs):
            if not config.kernels_for(args[0].device):
                return NotImplemented
            return _fn(*args, **kwargs)
        out[op] = decomposed
    return out


def _batch_norm_table() -> dict:
    """Batch norm's decompositions (aotfuse's for training and the backward, torch's for the other
    overloads), used where the input is a CPU tensor of a config.batch_norm_dtypes dtype that gets
    kernels."""
    out = {}
    table = get_decompositions(_BATCH_NORM)
    table[aten.native_batch_norm_backward.default] = _batch_norm_backward
    table[aten._native_batch_norm_legit_functional.default] = _batch_norm_functional
    for op, fn in table.items():
        if op._overloadname == "out":
            continue

        def decomposed(*args, _fn=fn, _x=1 if op is aten.native_batch_norm_backward.default else 0, **kwargs):
            x = args[_x]
            if x.device.type != "cpu" or x.dtype not in config.batch_norm_dtypes() or not config.kernels_for(x.device):
                return NotImplemented
            return _fn(*args, **kwargs)
        out[op] = decomposed
    return out


def _loss_table() -> dict:
    """log_softmax and its backward (torch's decompositions, used where kernels are generated for
    the tensors' device) and nll_loss's forward and backward."""
    table = _where_kernels(get_decompositions(_LOSS))
    table[aten.nll_loss_forward.default] = _nll_loss_forward
    table[aten.nll_loss_backward.default] = _nll_loss_backward
    return table


def _nll_ok(self, weight) -> bool:
    """Where nll_loss decomposes: no class weight, [N, C] or [C] input, fewer than 2**24 classes (exact
    as float indices), a device with generated kernels."""
    classes = self.shape[-1] if self.dim() > 0 else 0
    return (weight is None and self.dim() in (1, 2) and self.dtype.is_floating_point and 0 < classes < 2**24
            and config.kernels_for(self.device))


def _one_hot(self, target, ignore_index):
    """(hit, picked): hit[i, c] = (c == target[i]) and target[i] != ignore_index, a pointwise compare
    over [N, C] (bool); picked = the targets as float, [N, 1] (or 0-d for [C] input)."""
    classes = self.shape[-1]
    picked = torch.ops.prims.convert_element_type(target, torch.float32)
    index = aten.arange.start_step(0, classes, 1, dtype=torch.float32, device=self.device)
    if self.dim() == 2:
        picked = aten.unsqueeze.default(picked, 1)
    hit = aten.eq.Tensor(index, picked)
    if 0 <= ignore_index < classes:  # a target equal to ignore_index selects no class
        hit = aten.mul.Tensor(hit, aten.ne.Scalar(picked, ignore_index))
    return hit, picked


def _nll_loss_forward(self, target, weight, reduction, ignore_index):
    """nll_loss as a row reduction: -sum_c where(class == target, self, 0), so the log-probabilities it
    reads need not exist (the fuser computes them in the same kernel as log_softmax's row reductions,
    and the backward recomputes them from the logits). Returns (loss, total_weight) as ATen does.
    A target out of bounds (not a class, not ignore_index) matches no class; as ATen's, the call
    then fails (aten._assert_async: at once on the CPU, a device-side assert on CUDA)."""
    if not _nll_ok(self, weight):
        return NotImplemented
    f32 = torch.float32
    hit, picked = _one_hot(self, target, ignore_index)
    zero = aten.scalar_tensor.default(0.0, dtype=self.dtype, device=self.device)
    # exact: one term, the rest zeros (where, not a multiply: 0 * -inf is nan)
    chosen = aten.sum.dim_IntList(aten.where.self(hit, self, zero), [-1])
    losses = aten.neg.default(chosen)  # ignored rows: 0
    targets = picked if self.dim() == 1 else aten.squeeze.dim(picked, 1)
    # the count of targets not ignored (made here, where the fuser groups it with the final divide)
    counted = None if reduction == 0 else aten.sum.default(
        torch.ops.prims.convert_element_type(aten.ne.Scalar(targets, ignore_index), f32))
    # every target is a class or ignore_index (as floats: a target past 2**24 rounds to one >= classes),
    # checked on the [N] targets, not in the [N, C] kernel
    in_range = aten.mul.Tensor(aten.ge.Scalar(targets, 0), aten.lt.Scalar(targets, self.shape[-1]))
    fine = aten.maximum.default(torch.ops.prims.convert_element_type(in_range, f32),
                                torch.ops.prims.convert_element_type(aten.eq.Scalar(targets, ignore_index), f32))
    # all fine: the sum of (fine - 1) is 0 (not sum(fine) == numel, which would make a traced
    # graph with a symbolic row count specialize on it)
    aten._assert_async.msg(aten.eq.Scalar(aten.sum.default(aten.sub.Tensor(fine, 1.0)), 0.0),
                           "nll_loss: a target is out of bounds (neither in [0, classes) nor ignore_index)")
    if reduction == 0:  # none
        return losses, zero
    total_weight = torch.ops.prims.convert_element_type(counted, self.dtype)
    total = aten.sum.default(losses)
    return (aten.div.Tensor(total, total_weight) if reduction == 1 else total), total_weight


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """nll_loss's gradient as `(class == target) * -scale`: pointwise over [N, C], so it fuses with
    log_softmax's backward. ATen's own where there is a class weight or the device gets no kernels."""
    if not _nll_ok(self, weight):
        return NotImplemented
    hit, _ = _one_hot(self, target, ignore_index)
    if reduction == 1:  # mean; with every target ignored total_weight is 0 and eager's gradient all
        # zeros: divide by 1 then (hit is all false), not 0 (0 * inf would be NaN in every weight)
        scale = aten.div.Tensor(grad_output, aten.add.Tensor(total_weight, aten.eq.Scalar(total_weight, 0)))
    else:  # sum, or none: one gradient per row
        scale = grad_output if reduction == 2 or self.dim() == 1 else aten.unsqueeze.default(grad_output, 1)
    return aten.mul.Tensor(hit, aten.neg.default(scale))


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as two reductions (mean, then the mean square deviation): the C backend runs both,
    and whatever normalizes with them, as phases of one kernel; two passes are numerically sound
    where E[x^2] - E[x]^2 is not. Low-precision inputs are computed in float32, as ATen does.
    Complex inputs stay ATen's (their variance is the real mean of |x - mean|^2, which this squares
    as complex numbers: silently wrong values)."""
    if x.dtype.is_complex:
        return NotImplemented
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


def _safe_softmax(x, dim, dtype=None):
    """_safe_softmax, SDPA's math path's softmax (ATen's CPU SDPA with dropout, or with a mask on a
    backend without a fused kernel): a softmax whose rows of only -inf are 0, not NaN. As torch's
    _softmax decomposition (16-bit inputs computed in float32), the row's max telling the masked rows:
    it is -inf exactly where every element is (a NaN row stays NaN), so the rows' test is one more
    member of the softmax's kernel, not a reduction of its own. ATen's derivative (softmax's backward
    of this output) stays: a masked row's gradient is 0."""
    if dtype is not None:
        x = torch.ops.prims.convert_element_type(x, dtype)
    out_dtype = x.dtype
    low = x.dtype in (torch.float16, torch.bfloat16)
    xf = torch.ops.prims.convert_element_type(x, torch.float32) if low else x
    x_max = aten.amax.default(xf, [dim], True)
    e = aten.exp.default(aten.sub.Tensor(xf, x_max))
    out = aten.div.Tensor(e, aten.sum.dim_IntList(e, [dim], True))
    out = aten.where.self(aten.eq.Scalar(x_max, float("-inf")), aten.scalar_tensor.default(0.0, dtype=out.dtype),
                          out)
    return torch.ops.prims.convert_element_type(out, out_dtype) if low else out


def _convert(t, dtype):
    """t in dtype: a prims conversion where it is in another."""
    return torch.ops.prims.convert_element_type(t, dtype) if t.dtype != dtype else t


def _upcast(input):
    """What a norm's decomposition applies to the tensors it computes with: a conversion to float32
    where `input` is float16 or bfloat16 (ATen computes those in float32), else nothing."""
    if input.dtype in (torch.float16, torch.bfloat16):
        return lambda t: _convert(t, torch.float32)
    return lambda t: t


def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """Layer norm's backward with the row's scale applied per element, `(g - sum(g)/N - x_hat *
    sum(g * x_hat)/N) * rstd` (g = grad_out * weight): one phased kernel, its two row sums in the
    first pass, with rstd read as a broadcast operand. The textbook form scales first (rstd / N, a
    [rows, 1] op of its own) and costs a lone kernel step per layer norm. Low-precision tensors are
    computed in float32, as ATen does."""
    inner = list(range(input.dim() - len(normalized_shape), input.dim()))
    outer = list(range(input.dim() - len(normalized_shape)))
    n = 1
    for size in normalized_shape:
        n *= size
    up, to = _upcast(input), _convert

    x, go, mean, rstd = up(input), up(grad_out), up(mean), up(rstd)
    x_hat = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    g = aten.mul.Tensor(go, up(weight)) if weight is not None else go
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        row_g = aten.div.Tensor(aten.sum.dim_IntList(g, inner, True), n)
        row_gx = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(g, x_hat), inner, True), n)
        d = aten.sub.Tensor(aten.sub.Tensor(g, row_g), aten.mul.Tensor(x_hat, row_gx))
        grad_input = to(aten.mul.Tensor(d, rstd), input.dtype)
    # both column sums before either is converted: a conversion reading one closes its kernel,
    # and the other sum joins it (one kernel recomputing x_hat, see fuse.c's recompute_cone)
    gw = gb = None
    if output_mask[1] and weight is not None:
        gw = aten.mul.Tensor(go, x_hat)
        gw = aten.sum.dim_IntList(gw, outer, False) if outer else gw
    if output_mask[2] and bias is not None:
        gb = aten.sum.dim_IntList(go, outer, False) if outer else go
    if gw is not None:
        grad_weight = to(gw, weight.dtype)
    if gb is not None:
        grad_bias = to(gb, bias.dtype)
    return grad_input, grad_weight, grad_bias


def _batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm in training (`_native_batch_norm_legit_functional`): torch's decomposition's values
    (two-pass statistics in float32, the running ones updated in float32, the saved statistics in
    the input's dtype on the CPU), with the normalized output, scaled, shifted and converted,
    computed before the statistics are squeezed to [C]: a view reading a kernel's value closes its
    group, and torch's order (squeeze, running statistics, then weight and bias) left the scale and
    shift to a second kernel reading a full-size float32 intermediate."""
    n = input.numel() // max(input.shape[1], 1) if input.dim() > 1 else 0
    if not training or n <= 1:
        return NotImplemented  # torch's (evaluation), or ATen's error for one value per channel
    axes = [0] + list(range(2, input.dim()))
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    x = _upcast(input)(input)
    mean = aten.mean.dim(x, axes, True)
    diff = aten.sub.Tensor(x, mean)
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(diff, diff), axes, True), n)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(diff, rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.reshape.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.reshape.default(bias, shape))
    out = _convert(out, input.dtype)
    save_mean, save_rstd = aten.squeeze.dims(mean, axes), aten.squeeze.dims(rstd, axes)
    new_mean = aten.add.Tensor(aten.mul.Tensor(save_mean, momentum), aten.mul.Tensor(running_mean, 1 - momentum))
    unbiased = aten.mul.Tensor(aten.squeeze.dims(var, axes), n / (n - 1))
    new_var = aten.add.Tensor(aten.mul.Tensor(unbiased, momentum), aten.mul.Tensor(running_var, 1 - momentum))
    if input.device.type == "cpu":
        save_mean, save_rstd = _convert(save_mean, input.dtype), _convert(save_rstd, input.dtype)
    return out, save_mean, save_rstd, new_mean, new_var


def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                         output_mask):
    """Batch norm's backward in the form of _layer_norm_backward, its sums over N and the spatial
    dims kept as [1, C, 1, ...] (keepdim), so that the input gradient is one phased kernel reading
    them, with the ReLU mask before it. torch's decomposition sums to [C] and reshapes the sums
    back, a view between a reduction and its readers that split the kernel in two and wrote two
    full-size float32 tensors between them (ResNet's stem in bf16: 1.2 + 0.4 ms against ATen's
    0.75). Low-precision tensors are computed in float32, as ATen does."""
    axes = [0] + list(range(2, input.dim()))
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    n = input.numel() // max(input.shape[1], 1)
    up, to = _upcast(input), _convert

    x, go = up(input), up(grad_out)
    if train:
        mean = aten.reshape.default(up(save_mean), shape)
        rstd = aten.reshape.default(up(save_invstd), shape)
    else:
        mean = aten.reshape.default(up(running_mean), shape)
        rstd = aten.rsqrt.default(aten.add.Tensor(aten.reshape.default(up(running_var), shape), eps))
    x_hat = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    scale = aten.mul.Tensor(rstd, aten.reshape.default(up(weight), shape)) if weight is not None else rstd
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if train:
            mean_g = aten.div.Tensor(aten.sum.dim_IntList(go, axes, True), n)
            mean_gx = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(go, x_hat), axes, True), n)
            d = aten.sub.Tensor(aten.sub.Tensor(go, mean_g), aten.mul.Tensor(x_hat, mean_gx))
            grad_input = to(aten.mul.Tensor(d, scale), input.dtype)
        else:
            grad_input = to(aten.mul.Tensor(go, scale), input.dtype)
    gw = gb = None
    if output_mask[1] and weight is not None:
        gw = aten.sum.dim_IntList(aten.mul.Tensor(go, x_hat), axes, False)
    if output_mask[2]:
        gb = aten.sum.dim_IntList(go, axes, False)
    if gw is not None:
        grad_weight = to(gw, weight.dtype)
    if gb is not None:
        grad_bias = to(gb, weight.dtype if weight is not None else input.dtype)
    return grad_input, grad_weight, grad_bias


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


# clamp and hardtanh (ReLU6) with number bounds: `clamp_min` then `clamp_max`, op-table expressions
# (af_max/af_min, NaN kept as ATen's clamp keeps it), so they fuse; ATen's clamp has optional bounds no
# one expression takes, and torch's own decomposition makes eight ops of it (isnan, bitwise_or, where).
# MobileNetV2's 35 ReLU6 were ATen calls between kernels (2 ms of an 83 ms step).
def _clamp_bounds_ok(x, *bounds) -> bool:
    return (x.is_floating_point() and any(b is not None for b in bounds)
            and all(b is None or (isinstance(b, (int, float)) and not isinstance(b, bool)) for b in bounds))


def _clamp(x, min=None, max=None):
    if not _clamp_bounds_ok(x, min, max):
        return NotImplemented
    y = x if min is None else aten.clamp_min.default(x, min)
    return y if max is None else aten.clamp_max.default(y, max)


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return _clamp(x, min_val, max_val)


def _logit_backward(grad_output, self, eps=None):
    """ATen's: grad / (x (1 - x)) inside [eps, 1 - eps] and 0 outside where eps is given (not negative),
    NaN outside [0, 1] where it is not. A NaN input's gradient stays NaN: torch's decomposition tests
    `lo <= x <= hi`, false for NaN, and gave 0 (Inductor gives 0 too)."""
    grad = aten.div.Tensor(grad_output, aten.mul.Tensor(self, aten.rsub.Scalar(self, 1.0)))
    lo, hi, fill = (0.0, 1.0, float("nan")) if eps is None or eps < 0 else (eps, 1.0 - eps, 0.0)
    outside = aten.logical_or(aten.lt.Scalar(self, lo), aten.gt.Scalar(self, hi))
    return aten.where.self(outside, aten.full_like(grad, fill), grad)


def _activations_table() -> dict:
    """_ACTIVATIONS' decompositions (and _log_sigmoid_backward), each computing in float for fp16 and
    bf16 tensors and rounding its results once, as ATen's kernels do (torch's decompositions of ELU,
    softplus, Mish, ... compute in the tensors' dtype, so each of their steps rounded to bf16: a
    log-sigmoid gradient one bf16 step from eager's). Overloads that write an out= tensor are left
    as torch gives them."""
    from torch._decomp.decompositions import pw_cast_for_opmath

    table = get_decompositions(_ACTIVATIONS)
    table[aten.log_sigmoid_backward.default] = _log_sigmoid_backward
    return {op: fn if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
            else pw_cast_for_opmath(fn) for op, fn in table.items()}


def _log_sigmoid_backward(grad_output, self, buffer):
    """log_sigmoid's gradient as ATen's CPU kernel computes it, g (m - s z / (1 + z)) with z = exp(-|x|),
    m = 1 and s = 1 where x < 0, m = 0 and s = -1 elsewhere, with m and s floating (torch's
    decomposition makes them integer tensors, which never join a kernel, so its gradient ran as three
    ATen calls). The forward's buffer (z on the CPU) is not read: z is recomputed beside the rest, and
    nothing is saved for it."""
    z = aten.exp.default(aten.neg.default(aten.abs.default(self)))
    negative = aten.lt.Scalar(self, 0.0)
    m = aten.where.self(negative, aten.full_like(z, 1.0), aten.full_like(z, 0.0))
    s = aten.where.self(negative, aten.full_like(z, 1.0), aten.full_like(z, -1.0))
    return aten.mul.Tensor(grad_output, aten.sub.Tensor(m, aten.mul.Tensor(s, aten.div.Tensor(z, aten.add.Tensor(z, 1.0)))))


# ATen's CPU max pool over a contiguous [N, C, H, W] input walks each plane with scalar code; over a
# channels-last one it runs its vectorized kernel across channels: (16, 32, 32, 32), 3x3 stride 2,
# 6.4 ms against 0.3 (fp32, one thread; 2-5x with the two copies around it at (8, 64, 112, 112),
# (16, 256, 8, 8), (4, 512, 14, 14), fp32 and bf16; slower at 3 channels). A pool of a contiguous CPU
# input with at least 16 channels is run on a channels-last copy, its value and indices copied back
# into the layout the graph has (both are eager's to the bit: the same windows, ties and NaNs).
# Autograd's backward is max_pool2d_with_indices_backward on the indices, as before.
_POOL_MIN_CHANNELS = 16


def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    if x.device.type != "cpu" or not _nchw(x) or x.shape[1] < _POOL_MIN_CHANNELS or x.numel() == 0:
        return NotImplemented  # ATen's own (a channels-last input: its fast case already)
    cl = aten.clone.default(x, memory_format=torch.channels_last)
    out, idx = aten.max_pool2d_with_indices.default(cl, kernel_size, stride, padding, dilation, ceil_mode)
    return (aten.clone.default(out, memory_format=torch.contiguous_format),
            aten.clone.default(idx, memory_format=torch.contiguous_format))


# ---- channels-last convolutions on the CPU (a layout decided while tracing) ----
#
# oneDNN's CPU convolutions run faster over channels-last tensors (ResNet's 19 forward convolutions:
# 3.3 ms against 6.4 ms a step in NCHW, fp32, one thread), as Inductor knows: with oneDNN it makes
# every CPU convolution channels-last (torch/_inductor/graph.py, decide_layout_opt). Here a forward
# convolution of a contiguous NCHW input runs on a channels-last copy of it; its output comes back
# channels-last, and the pointwise ops, norms and pools after it keep that layout (ATen's stride
# rules, which the trace follows), so the next convolution's input is channels-last already and only
# the network's first input is copied. Values are the same ops' (oneDNN sums in another order).
#
# The layout is the trace's, not eager's, so what a user could see is guarded:
# - outputs: the function's outputs get eager's strides back (compile.py records them from the pass
#   that runs without decompositions: AOTAutograd's metadata pass, or attention's pre-trace);
# - aliasing: a `reshape`/`contiguous()` of a contiguous tensor is a view in eager but a copy of a
#   channels-last one, so an in-place write through it would not reach the original: such a copy
#   (clone to contiguous of a channels-last value) while the user's function is traced, and any
#   `as_strided` of one (its values depend on the layout), raise LayoutRetry;
# - a `view` the new layout cannot take fails the trace;
# and either way the signature is traced again without the layout (compile.py, dynamo.py).
# Only inside a trace that asks for it (`conv_layout()`), with oneDNN, on float32/bfloat16 2-d
# convolutions with concrete sizes; AOTFUSE_CHANNELS_LAST_CONVS=0 turns it off.

class LayoutRetry(RuntimeError):
    """The channels-last layout would change what the traced function does (see above): trace it again
    without."""


class _LayoutState(threading.local):
    on = False  # tracing the user's function, layout changes allowed
    fired = False  # a convolution of this trace runs channels-last
    restriding = False  # compile.py giving outputs eager's strides (its clones are not the user's)


_layout = _LayoutState()
_CL = torch.channels_last


def layout_begin(on: bool = True) -> None:
    """The user's function is traced from here (a pass: `fired` reset) to layout_end: forward
    convolutions may run channels-last."""
    _layout.on, _layout.fired = on and config.switch("AOTFUSE_CHANNELS_LAST_CONVS", True), False


def layout_end() -> bool:
    """Whether a convolution of this pass ran channels-last; `fired` is kept for the backward, traced
    after the function returns."""
    _layout.on = False
    return _layout.fired


@contextlib.contextmanager
def conv_layout(on: bool = True):
    """layout_begin/layout_end around the user's function. Yields the state (read `fired` after)."""
    prev = _layout.on
    layout_begin(on)
    try:
        yield _layout
    finally:
        layout_end()
        _layout.on = prev


def _flagged(t: Any) -> bool:
    """A 4-d tensor channels-last and not contiguous (what a layout change here can make)."""
    return isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=_CL)


def _nchw(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous() and not t.is_contiguous(memory_format=_CL)


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def _convolution_channels_last(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if (not _layout.on or transposed or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16)
            or weight.dim() != 4 or not _nchw(x) or not _concrete(x) or not torch.backends.mkldnn.is_available()
            or not torch.backends.mkldnn.enabled):
        return NotImplemented
    _layout.fired = True
    return aten.convolution.default(aten.clone.default(x, memory_format=_CL), weight, bias, stride, padding,
                                    dilation, transposed, output_padding, groups)


def _convolution_backward_channels_last(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                        output_padding, groups, output_mask):
    # the first convolution's backward: its gradient is channels-last (the forward's output was), its
    # input the network's NCHW one; oneDNN would copy the gradient to NCHW, so the input is copied
    # instead, in the backward (`_to_copy`, not the forward's `clone`: the graph's CSE would make them
    # one value, which the min cut then saved, a copy of the input held from forward to backward)
    if not _layout.fired or transposed or not _nchw(x) or not _flagged(grad) or x.device.type != "cpu":
        return NotImplemented
    return aten.convolution_backward.default(grad, aten._to_copy.default(x, memory_format=_CL), weight, bias_sizes,
                                             stride, padding, dilation, transposed, output_padding, groups,
                                             output_mask)


def _clone_watch(x, memory_format=None):
    if (_layout.on and _layout.fired and not _layout.restriding and memory_format == torch.contiguous_format
            and _flagged(x)):
        raise LayoutRetry("a contiguous copy (reshape, contiguous()) of a tensor that is channels-last only in "
                          "aotfuse's trace: in eager it may be a view of it")
    return NotImplemented


def _as_strided_watch(x, size, stride, storage_offset=None):
    if _layout.on and _layout.fired and _flagged(x):
        raise LayoutRetry("as_strided of a tensor that is channels-last only in aotfuse's trace")
    return NotImplemented


def layout_class(x: Any) -> Any:
    """What keep_layout restores: "contiguous", "channels_last", the strides of another layout, or None
    (not a tensor)."""
    if not isinstance(x, torch.Tensor):
        return None
    if x.is_contiguous():
        return "contiguous"
    if x.dim() == 4 and x.is_contiguous(memory_format=_CL):
        return "channels_last"
    return tuple(x.stride())


def keep_layout(x: Any, eager: Any) -> Any:
    """x in the layout eager gave this output (`eager`: its layout_class in the pass without
    decompositions); x itself where it has it. LayoutRetry where it is not one a copy can make."""
    ours = layout_class(x)
    if ours == eager or eager is None:
        return x
    if eager not in ("contiguous", "channels_last"):
        raise LayoutRetry(f"an output with strides {eager} in eager, {tuple(x.stride())} in aotfuse's trace")
    _layout.restriding = True
    try:
        return aten.clone.default(x, memory_format=torch.contiguous_format if eager == "contiguous" else _CL)
    finally:
        _layout.restriding = False


# ---- depthwise convolutions' weight gradient (CPU) ----
#
# A depthwise convolution's weight gradient (groups == channels, one filter a channel) is, for each
# channel and tap (i, j), the sum over images and output positions of the output's gradient times the
# input at that tap's offset. oneDNN's (ATen's CPU path for channels-last tensors, which ConvNeXt's and
# MobileNet's blocks make) took 1.7 ms and a 19 MB scratch buffer for a [16, 256, 2, 2] bfloat16 input
# (7 x 7 taps, 1.6 MFLOP); NCHW's native kernel is slower still. Here it is kh * kw column sums of
# products of the gradient with strided slices of the padded input: one fused kernel (every sum reads
# the same loop), one pass over the gradient, the slices read in place; only the padded input is
# written. A 7x7 depthwise layer's training step (one thread, `python benchmarks/depthwise.py`,
# ConvNeXt's maps at 16 images and ConvNeXt-T's at 8 of 224 x 224): bf16 1.5-2.5x faster than eager,
# fp32 1.3-4.9x from 4x4 maps up (0.70x at 2x2, where oneDNN is quick in fp32), the step's peak 1.3-15x
# lower but fp32's 56x56 (1.1x higher: the padded copy), the gradient as near float64's sums as
# oneDNN's or nearer (benchmarks/results/depthwise-grads-cpu-2026-12-05.md). The input's gradient
# stays ATen's convolution_backward (asked for it alone: 0.05-0.3 ms). Kernels of 10 to 49 taps (3 x 3
# stays oneDNN's, below). A strided bf16/fp16 depthwise convolution, any kernel size, also has its
# input gradient taken here: oneDNN's 16-bit strided backward-data is a slow path (MobileNetV2's
# [16, 96, 33, 33] 3x3 stride 2: 14.9 ms; 5x5 35 ms; float32's 0.1-0.8 ms), so it is float32's
# transposed convolution of the gradient, rounded once (a layer's step 10-19x faster, as near float64
# as eager's; benchmarks/results/mobilenet-cpu-2026-12-05.md). AOTFUSE_DEPTHWISE_GRADS=0 keeps ATen's.

_DEPTHWISE_MAX_TAPS = 49  # kernels up to 7 x 7: one kernel of at most 256 nodes
# 3 x 3 and smaller stay oneDNN's where the map is at least the kernel's size: its 3 x 3 depthwise weight
# gradient is quick there and needs no large scratch (MobileNetV2's layers, 4x4 to 32x32 maps: ATen's step
# 1.3-2.7x faster than the sums' in bf16 and fp32, measured again after window kernels took memory order);
# on a smaller map (2x2, 1x1) oneDNN's scratch grows with the channels (16.6 MB at [16, 1152, 2, 2] bf16,
# 11.0 MB fp32) and the sums win (5.9 -> 1.0 ms bf16, 1.7 -> 0.8 fp32); from 5 x 5 on the sums win
# everywhere (bf16 2-4x, fp32 1.0-1.9x on MobileNetV2's layers)
_DEPTHWISE_MIN_TAPS = 10


def _depthwise_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                        groups, output_mask):
    if (transposed or x.dim() != 4 or weight.dim() != 4 or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or grad.dtype != x.dtype
            or weight.dtype != x.dtype):
        return NotImplemented
    # ATen takes one value for both dims too (padding="valid" arrives as [0])
    stride, padding, dilation = (list(v) * 2 if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    sizes = (*x.shape, *weight.shape, *grad.shape, *stride, *padding, *dilation, groups)
    if not all(isinstance(v, int) for v in sizes) or len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return NotImplemented
    n, c, h, w = x.shape
    kh, kw = weight.shape[2:]
    if groups == 1 or groups != c or tuple(weight.shape[:2]) != (c, 1):
        return NotImplemented
    oh, ow = grad.shape[2:]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    f32 = torch.float32
    # below 10 taps only where the map is smaller than the kernel: there oneDNN's weight gradient takes
    # another path, its scratch growing with the channels (EfficientNet's last 3x3 layer, [16, 1152, 2, 2]
    # bf16: 16.6 MB, the step's peak; 5.9 ms against the sums' 1.0)
    small_map = h < kh or w < kw
    sums = (output_mask[1] and x.dtype != torch.float16 and config.kernels_for(x.device)
            and (_DEPTHWISE_MIN_TAPS <= kh * kw or small_map) and kh * kw <= _DEPTHWISE_MAX_TAPS)
    # a strided 16-bit input gradient: oneDNN's is 20-50x slower than float32's (below)
    widened = output_mask[0] and x.dtype != f32 and (sh > 1 or sw > 1)
    if not sums and not widened:
        return NotImplemented
    grad_input = grad_weight = grad_bias = None
    if widened:  # the transposed convolution of the float32 gradient and weight is the input's gradient
        out_pad = [size + 2 * p - d * (k - 1) - 1 - (o - 1) * st
                   for size, p, d, k, o, st in ((h, ph, dh, kh, oh, sh), (w, pw, dw, kw, ow, sw))]
        grad_input = aten._to_copy.default(
            aten.convolution.default(aten._to_copy.default(grad, dtype=f32), aten._to_copy.default(weight, dtype=f32),
                                     None, stride, padding, dilation, True, out_pad, groups), dtype=x.dtype)
    elif output_mask[0]:
        grad_input = aten.convolution_backward.default(grad, x, weight, bias_sizes, stride, padding, dilation,
                                                       transposed, output_padding, groups, [True, False, False])[0]
    if not sums:
        if output_mask[1] or output_mask[2]:
            _, grad_weight, grad_bias = aten.convolution_backward.default(
                grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                [False, output_mask[1], output_mask[2]])
        return grad_input, grad_weight, grad_bias
    g = grad if grad.dtype == f32 else aten._to_copy.default(grad, dtype=f32)
    xp = aten.constant_pad_nd.default(x, [pw, pw, ph, ph], 0.0) if ph or pw else x
    taps = []
    for i in range(kh):
        rows = aten.slice.Tensor(xp, 2, i * dh, i * dh + (oh - 1) * sh + 1, sh)
        for j in range(kw):
            win = aten.slice.Tensor(rows, 3, j * dw, j * dw + (ow - 1) * sw + 1, sw)
            if win.dtype != f32:
                win = aten._to_copy.default(win, dtype=f32)
            taps.append(aten.sum.dim_IntList(aten.mul.Tensor(g, win), [0, 2, 3]))
    grad_weight = aten.view.default(aten.stack.default(taps, 1), [c, 1, kh, kw])
    grad_bias = aten.sum.dim_IntList(g, [0, 2, 3]) if output_mask[2] else None
    if x.dtype != f32:
        grad_weight = aten._to_copy.default(grad_weight, dtype=x.dtype)
        grad_bias = None if grad_bias is None else aten._to_copy.default(grad_bias, dtype=x.dtype)
    return grad_input, grad_weight, grad_bias


# ---- 16-bit CPU matmuls, convolutions and attention in float32, rounded once ----
#
# ATen's CPU kernels of a 16-bit dtype without oneDNN's support (float16 without AVX512-FP16 or AMX-FP16,
# bfloat16 without AVX-512) are generic loops: on this machine's AVX-512 CPU a float16 [512 x 8192] @
# [8192 x 256] took 95-1600 ms by its operands' layouts, against 24 ms converting to float32, sgemm and
# rounding; a 3x3 convolution's training step 27x float32's, bmm 13-20x, the CPU flash attention 7x. Those
# kernels accumulate in float32 and round each result once, so the float32 op rounded once gives the same
# values to the order of its sums. config.float32_compute() says for which dtypes.


def _wide(dtype) -> bool:
    return dtype in config.float32_compute()


def _f32(t):
    return None if t is None else aten._to_copy.default(t, dtype=torch.float32)


def _narrow(t, dtype):
    return None if t is None else aten._to_copy.default(t, dtype=dtype)


def _cpu_16(*tensors) -> Any:
    """The 16-bit dtype the tensors share, where all are CPU tensors of it that float32_compute names;
    else None."""
    dtype = tensors[0].dtype
    if not _wide(dtype):
        return None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != dtype:
            return None
    return dtype


def _widened(op):
    """op (a matmul whose positional arguments are all tensors: mm, bmm, addmm, baddbmm) on float32
    conversions of its 16-bit operands, rounded once; its keyword arguments (beta, alpha) as given."""
    def wide(*tensors, **kwargs):
        dtype = _cpu_16(*tensors)
        if dtype is None:
            return NotImplemented
        return _narrow(op(*map(_f32, tensors), **kwargs), dtype)
    return wide


def _convolution_wide(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    dtype = _cpu_16(x, weight, *([] if bias is None else [bias]))
    if dtype is None:
        return NotImplemented
    return _narrow(aten.convolution.default(_f32(x), _f32(weight), _f32(bias), stride, padding, dilation,
                                            transposed, output_padding, groups), dtype)


def _convolution_backward_wide(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                               output_padding, groups, output_mask):
    dtype = _cpu_16(grad, x, weight)
    if dtype is None:
        return NotImplemented
    grads = aten.convolution_backward.default(_f32(grad), _f32(x), _f32(weight), bias_sizes, stride, padding,
                                              dilation, transposed, output_padding, groups, output_mask)
    return tuple(_narrow(g, dtype) for g in grads)


def _mask_f32(mask, dtype):
    """An additive attention mask of the operands' dtype in float32 (a bool one as it is)."""
    return _f32(mask) if isinstance(mask, torch.Tensor) and mask.dtype == dtype else mask


def _flash_cpu_wide(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    dtype = _cpu_16(q, k, v)
    if dtype is None or (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype not in (dtype, torch.bool)):
        return NotImplemented
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
        _f32(q), _f32(k), _f32(v), dropout_p, is_causal, attn_mask=_mask_f32(attn_mask, dtype), scale=scale)
    return _narrow(out, dtype), lse


def _flash_cpu_backward_wide(grad, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    dtype = _cpu_16(grad, q, k, v, out)
    if dtype is None or (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype not in (dtype, torch.bool)):
        return NotImplemented
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        _f32(grad), _f32(q), _f32(k), _f32(v), _f32(out), lse, dropout_p, is_causal,
        attn_mask=_mask_f32(attn_mask, dtype), scale=scale)
    return tuple(_narrow(g, dtype) for g in grads)


def _float32_table() -> dict:
    if not config.float32_compute():
        return {}
    matmuls = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default)
    return {**{op: _widened(op) for op in matmuls}, aten.convolution.default: _convolution_wide,
            aten.convolution_backward.default: _convolution_backward_wide,
            aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu_wide,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_cpu_backward_wide}


_CAT_MAX_INPUTS = 8  # each input is a window member of the kernel, and a piece of its split rows


def _cat_windows(tensors, dim=0):
    """cat(tensors, dim) as windows the fuser takes apart (fuse.c, af_fuse_window): the first input
    padded with zeros to the whole length along dim, each later one a slice_scatter into it. The
    cat is then a kernel that computes its pointwise inputs where it writes them (Llama's rotary
    `cat((-x2, x1))` reads x, not a negated copy), instead of an ATen copy of values kernels stored
    for it. Exact: every element is its input's, the zeros all overwritten. Taken where the result
    is the cat's, layout included: 2 to 8 inputs of one floating dtype on one device with kernels,
    none empty, the lengths along dim plain ints, every input of the contiguous memory format
    (then ATen's cat and the pad both make a contiguous result)."""
    from torch._prims_common import suggest_memory_format

    tensors = list(tensors)
    if not 2 <= len(tensors) <= _CAT_MAX_INPUTS:
        return NotImplemented
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or not first.dtype.is_floating_point or first.ndim == 0 \
            or not config.kernels_for(first.device):
        return NotImplemented
    d = dim + first.ndim if dim < 0 else dim
    if not 0 <= d < first.ndim:
        return NotImplemented
    lengths = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != first.dtype or t.device != first.device \
                or t.ndim != first.ndim or suggest_memory_format(t) != torch.contiguous_format:
            return NotImplemented
        n = t.shape[d]
        if not isinstance(n, int) or n <= 0 or any(isinstance(s, int) and s == 0 for s in t.shape):
            return NotImplemented
        lengths.append(n)
    total = sum(lengths)
    pad = [0, 0] * (first.ndim - 1 - d) + [0, total - lengths[0]]
    out = aten.constant_pad_nd.default(first, pad, 0.0)
    start = lengths[0]
    for t, n in zip(tensors[1:], lengths[1:]):
        out = aten.slice_scatter.default(out, t, d, start, start + n)
        start += n
    return out


def _chain(first, then):
    """A decomposition trying `first`, then `then` (None: the op as it is)."""
    def decomposed(*args, **kwargs):
        out = first(*args, **kwargs)
        if out is NotImplemented and then is not None:
            out = then(*args, **kwargs)
        return out
    return decomposed


def _layout_table() -> dict:
    if not config.switch("AOTFUSE_CHANNELS_LAST_CONVS", True):
        return {}
    return {aten.convolution.default: _convolution_channels_last,
            aten.convolution_backward.default: _convolution_backward_channels_last,
            aten.clone.default: _clone_watch, aten.as_strided.default: _as_strided_watch}


def default_decompositions(norms: bool | None = None, random: bool | None = None,
                           loss: bool | None = None) -> dict:
    """The table memory_efficient_fusion and aot_function use when given none (a fresh dict).
    norms: decompose layer norm and softmax too, and on the CPU batch norm (default: on unless
    AOTFUSE_DECOMPOSE_NORMS=0 or no kernels are generated; AOTFUSE_DECOMPOSE_BATCH_NORM=0 keeps ATen's
    batch norm alone).
    random: dropout with aotfuse's own generator, fused and recomputed (default: on unless
    AOTFUSE_FALLBACK_RANDOM=1 or no kernels are generated).
    loss: log_softmax and nll_loss (forward and backward) decomposed, so cross entropy is one fused
    row kernel each way (default: on unless AOTFUSE_DECOMPOSE_LOSS=0 or no kernels are generated)."""
    if norms is None:
        norms = config.switch("AOTFUSE_DECOMPOSE_NORMS", True) and config.fusion()
    if random is None:
        random = not config.fallback_random() and config.fusion()
    if loss is None:
        loss = config.switch("AOTFUSE_DECOMPOSE_LOSS", True) and config.fusion()
    table = get_decompositions(_DECOMPOSED)
    table[aten.logit_backward.default] = _logit_backward
    if config.switch("AOTFUSE_CHANNELS_LAST_POOLS", True):
        table[aten.max_pool2d_with_indices.default] = _max_pool2d_with_indices
    table.update(_layout_table())
    if config.switch("AOTFUSE_DEPTHWISE_GRADS", True):
        table[aten.convolution_backward.default] = _chain(_depthwise_backward,
                                                          table.get(aten.convolution_backward.default))
    # 16-bit CPU matmuls, convolutions and attention in float32 first: the float32 op they become is
    # then decomposed as any other (channels-last, depthwise sums)
    for op, wide in _float32_table().items():
        table[op] = _chain(wide, table.get(op))
    if config.fusion():
        table[aten.clamp.default] = _clamp
        table[aten.hardtanh.default] = _hardtanh
        if config.switch("AOTFUSE_CAT_WINDOWS", True):
            table[aten.cat.default] = _cat_windows
        if config.switch("AOTFUSE_DECOMPOSE_ACTIVATIONS", True):
            table.update(_activations_table())
    if loss:
        table.update(_loss_table())
    if norms:
        table.update(_where_kernels({**get_decompositions(_NORMS), aten.var_mean.correction: _var_mean,
                                     aten._safe_softmax.default: _safe_softmax,
                                     aten.native_layer_norm_backward.default: _layer_norm_backward}))
    if random:
        table[aten.native_dropout.default] = _native_dropout
    if norms and config.batch_norm_dtypes():
        table.update(_batch_norm_table())
    return table


# ---- upstream decompositions that give wrong values, replaced while aotfuse traces ----

def _multilabel_margin_loss_forward(input: torch.Tensor, target: torch.Tensor, reduction: int):
    """multilabel_margin_loss (and its is_target), as ATen's kernel defines it: row i's loss is the
    sum over its labels j (target[i, :], up to the first -1) and the classes k that are none of its
    labels of max(0, 1 - x[i, label j] + x[i, k]), over the number of classes. torch's decomposition
    (a Python kernel at the Autograd key, which every trace under the Python dispatcher takes: torch
    2.11-2.14) also counts the slots after the -1, as if they held class 0: a row [3, 0, -1, 1]
    gave 2.05 where eager gives 0.85. The margin's gradient is taken where it is positive, as eager's."""
    x = input if input.dim() == 2 else input.reshape(1, -1)
    labels = target.reshape(x.shape)
    classes = x.shape[1]
    valid = (labels == -1).cumsum(-1) == 0  # the label slots before the first -1
    picked = torch.gather(x, 1, torch.where(valid, labels, 0))  # x[i, label j] (class 0 where unused)
    k = torch.arange(classes, device=x.device)
    is_target = ((labels.unsqueeze(-1) == k) & valid.unsqueeze(-1)).any(1)  # [rows, classes]
    margin = 1 - picked.unsqueeze(-1) + x.unsqueeze(1)  # [rows, label slot j, class k]
    counted = valid.unsqueeze(-1) & ~is_target.unsqueeze(1) & (margin > 0)
    per_row = torch.where(counted, margin, 0).sum((1, 2)) / classes
    if reduction == 1:  # mean
        loss = per_row.mean()
    elif reduction == 2:  # sum
        loss = per_row.sum()
    else:
        loss = per_row if input.dim() == 2 else per_row.reshape(())
    return loss, is_target.to(input.dtype).reshape(target.shape)


_EMBEDDING_BAGS = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
_in_bag_fix = threading.local()


def _embedding_bag_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """FakeTensor's _embedding_bag (and _embedding_bag_forward_only) with a bfloat16 table on the CPU's
    fast path: ATen's CPU kernel sums its bags by index_select_add, as float's and half's, and leaves
    offset2bag empty, where torch's meta function (torch 2.13) counts only float and half as fast and
    gives offset2bag an entry per index. The traced forward held the kernel's empty offset2bag to that
    size: a bfloat16 EmbeddingBag(mode="sum") with a gradient failed at its first run. The meta's
    outputs, offset2bag empty."""
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset", "padding_idx")
    a = {"scale_grad_by_freq": False, "mode": 0, "sparse": False, "per_sample_weights": None,
         "include_last_offset": False, "padding_idx": -1}
    a.update(zip(names, args))
    a.update(kwargs)
    weight, offsets, psw = a["weight"], a["offsets"], a["per_sample_weights"]
    if getattr(_in_bag_fix, "active", False) or not (
            weight.dtype == torch.bfloat16 and offsets.device.type == "cpu" and a["mode"] == 0
            and a["padding_idx"] < 0 and weight.stride(1) == 1 and (psw is None or psw.stride(0) == 1)):
        return NotImplemented
    _in_bag_fix.active = True
    try:
        with fake_mode:
            out = func(*args, **kwargs)
            return (out[0], offsets.new_empty(0), *out[2:]) if out[0].stride(1) == 1 else out
    finally:
        _in_bag_fix.active = False


_UPSTREAM_FIXES = ((aten.multilabel_margin_loss_forward.default, torch._C.DispatchKey.Autograd,
                    _multilabel_margin_loss_forward),)


@contextlib.contextmanager
def upstream_fixes():
    """While aotfuse traces (memory_efficient_fusion's passes, a Dynamo graph's aot_module_simplified):
    torch's Python kernels that give wrong values replaced by aotfuse's own (_UPSTREAM_FIXES),
    FakeTensor's _embedding_bag corrected (_embedding_bag_fake), and transformers' MoE grouped matmul
    given a backward a trace can hold (moe.py), put back afterwards. Tracing holds
    aotfuse's compile lock; a trace elsewhere meanwhile (another thread's torch.compile) would take the
    fixed kernel too."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode

    def forget_bags() -> None:  # FakeTensor's results cache, shared by every trace: none made without the fix
        cache = getattr(FakeTensorMode, "cache", {})
        for k in [k for k in cache if getattr(k, "key", None) and k.key[0] in _EMBEDDING_BAGS]:
            cache.pop(k, None)

    from . import moe

    saved, added = [], []
    bag_check = (lambda func: func in _EMBEDDING_BAGS, _embedding_bag_fake)
    forget_bags()
    try:
        for op, key, fn in _UPSTREAM_FIXES:
            if key in op.py_kernels:
                saved.append((op, key, op.py_kernels[key]))
                op.py_kernels[key] = fn
                op._dispatch_cache.clear()
        grouped = moe.fallback_op()  # transformers' MoE grouped matmul: a backward a trace can hold (moe.py)
        if grouped is not None and torch._C.DispatchKey.Autograd not in grouped.py_kernels:
            grouped.py_kernels[torch._C.DispatchKey.Autograd] = moe.traceable_autograd
            grouped._dispatch_cache.clear()
            added.append(grouped)
        fake_impls.op_implementations_checks.insert(0, bag_check)
        yield
    finally:
        if bag_check in fake_impls.op_implementations_checks:
            fake_impls.op_implementations_checks.remove(bag_check)
        forget_bags()
        for op, key, fn in saved:
            op.py_kernels[key] = fn
            op._dispatch_cache.clear()
        for op in added:
            op.py_kernels.pop(torch._C.DispatchKey.Autograd, None)
            op._dispatch_cache.clear()
