"""aten.cat as windows (decompositions._cat_windows): the first input padded to the whole length,
each later one a slice_scatter into it, so a cat is a fused kernel that computes its pointwise
inputs where it writes them; the rows of a kernel whose guards all lie on one outer dim split
where they change (codegen_c.c, emit_parts over rows); a window's source read through a reshape whose
rows cross the source's rows is not computed in the window's kernel (fuse.c, view_chain)."""
import re

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse.decompositions import default_decompositions
from aotfuse.lower import lower
from aotfuse.testing import compare_models
from helpers import assert_close

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


def _lowered(fn, *args):
    return lower(make_fx(fn, decomposition_table=default_decompositions(norms=True), tracing_mode="fake")(*args))


def _ops(low) -> list[str]:
    """Every ATen op the program's steps name, kernel members and ATen calls alike (a cat is never a
    kernel member: where one is named, it is an ATen call)."""
    return re.findall(r"= (aten::\w+)\.", str(low.program))


def _rotary(x, cos, sin):
    """Llama's apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin,)


def _rotary_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype) for s in ((2, 4, 16, 64), (16, 64), (16, 64))]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary_cat_is_one_kernel_with_eagers_values(dtype):
    """rotate_half's cat of a negated half and the other half: one kernel reading x, no ATen cat,
    no negated copy; its inner loop split in the two halves, each without a comparison. The same
    operations in the same order as eager: its values to the bit."""
    args = _rotary_inputs(dtype)
    low = _lowered(_rotary, *args)
    assert low.program.num_kernels == 1 and "aten::cat" not in _ops(low), str(low.program)
    src = low.program.source
    loops = re.findall(r"for \(af_idx i = (\d+); i < (\d+); i\+\+\)", src)
    assert loops == [("0", "32"), ("32", "64")], src
    assert "AF_GUARDED_LOADS void" not in src, src
    (got,), (ref,) = low(list(args)), _rotary(*args)
    assert got.stride() == ref.stride()
    assert_close(got, ref, f"rotary cat {dtype}", atol=0, rtol=0)
    assert low.program.kernel_fallbacks == 0


def _outer(x):
    return (torch.cat((x.exp(), x[:, :2] * 2, x[:, 2:5].tanh()), 1).sin(),)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_cat_along_an_outer_dim_splits_the_rows(dtype):
    """A cat along dim 1 of [4, 8, 16, 64]: its guards are the same along a row, so the rows split
    in three parts (one comparison a row), each computing its own input only (before, each
    element computed all three and chose: 8.3x the time). Eager's values, and float64's."""
    x = torch.randn(4, 8, 16, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    low = _lowered(_outer, x)
    assert low.program.num_kernels == 1 and "aten::cat" not in _ops(low), str(low.program)
    src = low.program.source
    assert re.search(r"if \(b\d+ < 8\) \{", src) and re.search(r"\} else if \(b\d+ < 10\) \{", src), src
    assert src.count("af_exp(v") == 1 and src.count("af_tanh(v") == 1 and "chosen after its loads" not in src, src
    (got,), (ref,) = low([x]), _outer(x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert_close(got, ref, f"cat along dim 1 ({dtype})", **tol)
    (ref64,) = _outer(x.double())
    assert (got.double() - ref64).abs().max() <= 4 * (ref.double() - ref64).abs().max() + 1e-6


def _heads_joined(a, b, c):
    """GPT2's backward of the qkv split: each head gradient [b, h, t, d] permuted back, copied,
    viewed as [b, t, h * d], and the three joined by a cat."""
    parts = [aten._unsafe_view(aten.clone(aten.permute(t, [0, 2, 1, 3]), memory_format=torch.contiguous_format),
                               [t.shape[0], t.shape[2], t.shape[1] * t.shape[3]]) for t in (a, b, c)]
    return (torch.cat(parts, 2),)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_inputs_read_through_a_reshape_of_rows_are_copied_first(dtype):
    """The cat's inputs view copies of permuted tensors as [b, t, h * d]: a row of the view crosses
    the copy's rows, so computing the copy in the cat's kernel would take a division and a
    remainder and a gathered load for every element (6x the time of copying first). The copies
    stay kernels of their own; the cat's kernel reads them without index arithmetic."""
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(2, 4, 16, 8, generator=g).to(dtype) for _ in range(3)]
    low = _lowered(_heads_joined, *args)
    src = low.program.source
    assert "aten::cat" not in _ops(low) and low.program.num_kernels == 4, str(low.program)
    assert not re.search(r"[/%] 8;", src), src
    if dtype == torch.bfloat16:  # bf16 values copied: the bits stored, no rounding (codegen_common.c, exact_bf16)
        assert not re.search(r"\] = af_bf16_store\(", src) and re.search(r"\] = af_bf16_bits\(", src), src
    (got,), (ref,) = low(list(args)), _heads_joined(*args)
    assert_close(got, ref, f"heads joined ({dtype})", atol=0, rtol=0)


def _cat_of(*ts, dim=0):
    return (torch.cat(ts, dim) * 1.0,)


def _kept_cases():
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "mixed dtypes": (r(3, 4), r(2, 4).double()),
        "nine inputs": tuple(r(2, 3) for _ in range(9)),
        "an empty input": (r(3, 4), r(0, 4), r(2, 4)),
        "integers": (torch.arange(6).view(2, 3), torch.arange(3).view(1, 3)),
        "channels-last": (r(2, 3, 4, 5).to(memory_format=torch.channels_last),
                          r(2, 3, 4, 5).to(memory_format=torch.channels_last)),
    }


@pytest.mark.parametrize("case", list(_kept_cases()))
def test_cats_the_windows_do_not_take_stay_atens(case):
    """Where the windows' result would not be the cat's (type promotion, an empty or legacy input,
    channels-last inputs, whose cat is channels-last) or the kernel too wide (more than 8 inputs),
    or for integers, the cat stays ATen's: eager's values and strides."""
    args = _kept_cases()[case]
    low = _lowered(_cat_of, *args)
    assert "aten::cat" in _ops(low), (case, str(low.program))
    (got,), (ref,) = low(list(args)), _cat_of(*args)
    assert got.dtype == ref.dtype and got.stride() == ref.stride(), case
    assert_close(got, ref, case, atol=0, rtol=0)


def test_the_switch_off_keeps_atens_cat(monkeypatch):
    monkeypatch.setenv("AOTFUSE_CAT_WINDOWS", "0")
    args = _rotary_inputs(torch.float32)
    low = _lowered(_rotary, *args)
    assert "aten::cat" in _ops(low) and low.program.num_kernels == 2, str(low.program)
    assert_close(low(list(args))[0], _rotary(*args)[0], "rotary, switch off", atol=0, rtol=0)


class _RotaryBlock(nn.Module):
    """A projection, rotary embedding of its output (a cat in the forward, slices of the gradient
    in the backward), a cat of two branches along the features, and a head."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.out = nn.Linear(d, d), nn.Linear(2 * d, 4)
        pos = torch.arange(8.0)[:, None] * torch.arange(d)[None, :] / d
        self.register_buffer("cos", pos.cos()), self.register_buffer("sin", pos.sin())

    def forward(self, x):
        q = self.q(x)
        (r,) = _rotary(q, self.cos, self.sin)
        return self.out(torch.cat((torch.tanh(r), q * 0.5), -1)).sum()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_model_with_cats_trains_like_eager_and_float64(dtype):
    report = compare_models(_RotaryBlock(), lambda: (torch.randn(3, 8, 32),), dtype=dtype, steps=2,
                            name=f"rotary block {dtype}")
    report.assert_ok()
    assert report.checked > 8 and report.kernel_fallbacks == 0, report
    e = aotfuse.explain(_RotaryBlock().to(dtype), torch.randn(3, 8, 32, dtype=dtype))
    assert "aten::cat.default" not in e.extern_ops, e.extern_ops
