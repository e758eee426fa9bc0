"""16-bit CPU matmuls, convolutions and flash attention run in float32, rounded once to their dtype, where
ATen's CPU kernels of that dtype have no fast path (config.float32_compute, decompositions._float32_table):
on a CPU without AVX512-FP16 or AMX-FP16 ATen's float16 mm is a generic loop, 4-70x slower than float32's
sgemm with the conversions. Those loops accumulate in float32 and round once, so the float32 op rounded
once gives eager's values to the order of its sums: models train like eager and as near float64.

The tests set AOTFUSE_FLOAT32_COMPUTE=1 (both 16-bit dtypes, whatever this CPU's oneDNN offers), except
the one checking that `auto` follows oneDNN's queries."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse import config
from aotfuse.testing import compare_models

DTYPES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]
_WIDE = re.compile(r"aten::(mm|addmm|bmm|baddbmm|convolution|convolution_backward|"
                   r"_scaled_dot_product_flash_attention_for_cpu|_scaled_dot_product_flash_attention_for_cpu_backward)"
                   r"\.default\(")


def _wide_calls(program: str) -> tuple[list[str], list[str]]:
    """The matmul, convolution and attention calls of a program's text: (those with a 16-bit result,
    those with a float32 one)."""
    sixteen, thirty_two = [], []
    for line in program.splitlines():
        if not _WIDE.search(line):
            continue
        results = line.split(" = aten::")[0]
        (sixteen if re.search(r"\bb?f16\[", results) else thirty_two if "f32[" in results else []).append(line)
    return sixteen, thirty_two


class _Mixed(nn.Module):
    """Every op of the table: addmm and mm (linear layers with and without bias), bmm, baddbmm, a
    strided grouped convolution, a transposed one, and SDPA with an additive mask and causal."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16, bias=False)
        self.bias = nn.Parameter(torch.randn(2, 16, 16) * 0.1)

    def forward(self, x, mask):
        y = F.gelu(self.conv(x))                          # [2, 8, 4, 4]
        z = self.up(y) + x[:, :4]                           # [2, 4, 8, 8]
        t = y.flatten(2).transpose(1, 2) * 1.0              # [2, 16, 8]
        t = torch.cat([t, t.flip(-1)], -1)                  # [2, 16, 16]
        q, k, v = self.qkv(t).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        c = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = (a + c).transpose(1, 2).flatten(2)              # [2, 16, 16]
        s = torch.baddbmm(self.bias, h, h.transpose(1, 2), beta=0.5, alpha=0.25)
        w = torch.bmm(torch.softmax(s.float(), -1).to(h.dtype), h)
        # each op's result reaches the loss directly, so that a wrong one shows in the values
        return sum(t.float().square().mean() for t in (self.out(w), z, s, a, c))


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.randn(16, 16, generator=gen) * 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_16_bit_matmuls_convolutions_and_attention_run_in_float32(monkeypatch, dtype):
    """Forward and backward: no 16-bit call of these ops is left in either program; values, gradients
    and updated parameters are eager's (the seed's tolerance) and as near float64."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    torch.manual_seed(0)
    model = _Mixed().to(dtype)
    x, mask = (t.to(dtype) for t in _inputs())
    e = aotfuse.explain(model, x, mask)
    for program in (e.forward_program, e.backward_program):
        sixteen, thirty_two = _wide_calls(program)
        assert not sixteen, "\n".join(sixteen)
    fw32, bw32 = _wide_calls(e.forward_program)[1], _wide_calls(e.backward_program)[1]
    assert {re.search(r"aten::(\w+)", line).group(1) for line in fw32} == {
        "addmm", "mm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu"}, fw32
    assert {re.search(r"aten::(\w+)", line).group(1) for line in bw32} >= {
        "mm", "bmm", "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu_backward"}, bw32

    torch.manual_seed(0)
    report = compare_models(_Mixed(), lambda: _inputs(), dtype=dtype, steps=2, name=f"mixed {dtype}")
    report.assert_ok()
    assert report.checked > 20, report
    assert report.kernel_fallbacks == 0, report


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_switch_off_keeps_atens_16_bit_calls(monkeypatch, dtype):
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False)).to(dtype)
    x = torch.randn(6, 8, dtype=dtype)
    e = aotfuse.explain(model, x)
    sixteen, thirty_two = _wide_calls(e.forward_program)
    assert len(sixteen) == 2 and not thirty_two, e.forward_program
    compiled = aotfuse.memory_efficient_fusion(model)
    torch.testing.assert_close(compiled(x), model(x))


def test_auto_follows_onednns_queries(monkeypatch):
    """auto: float32 for exactly the dtypes whose oneDNN path ATen lacks on this CPU; 1 both; 0 none;
    anything else an error naming the variable."""
    monkeypatch.delenv("AOTFUSE_FLOAT32_COMPUTE", raising=False)
    for fast in ((), (torch.float16,), (torch.bfloat16,), (torch.float16, torch.bfloat16)):
        monkeypatch.setattr(config, "onednn_fast", lambda dtype, fast=fast: dtype in fast)
        assert set(config.float32_compute()) == {torch.float16, torch.bfloat16} - set(fast)
    monkeypatch.setattr(config, "onednn_fast", lambda dtype: dtype == torch.bfloat16)
    model = nn.Linear(8, 4)
    for dtype, widened in ((torch.float16, True), (torch.bfloat16, False)):
        sixteen, thirty_two = _wide_calls(aotfuse.explain(model.to(dtype), torch.randn(3, 8, dtype=dtype)).forward_program)
        assert (len(thirty_two), len(sixteen)) == ((1, 0) if widened else (0, 1)), (dtype, sixteen, thirty_two)
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    assert config.float32_compute() == (torch.float16, torch.bfloat16)
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")
    assert config.float32_compute() == ()
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "fp16")
    with pytest.raises(config.ConfigError, match="AOTFUSE_FLOAT32_COMPUTE"):
        config.float32_compute()


def test_float32_operands_and_mixed_dtypes_are_left_alone(monkeypatch):
    """Only CPU calls whose tensors all share one 16-bit dtype are widened: float32 ones, and a float16
    attention with a float32 mask, keep their calls."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    model = nn.Linear(8, 4)
    sixteen, thirty_two = _wide_calls(aotfuse.explain(model, torch.randn(3, 8)).forward_program)
    assert len(thirty_two) == 1 and not sixteen
    assert "_to_copy" not in aotfuse.explain(model, torch.randn(3, 8)).forward_program

    def attend(q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).float().sum()

    q = torch.randn(1, 2, 8, 4, dtype=torch.float16, requires_grad=True)
    mask = torch.randn(8, 8)
    compiled = aotfuse.aot_function(attend)
    torch.testing.assert_close(compiled(q, mask), attend(q, mask))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_models_train_in_float16_like_eager(monkeypatch, name):
    """The seed's models in float16 (tiny configs): every matmul and attention in float32, rounded
    once; outputs, gradients and parameters agree with eager's and float64's."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    pytest.importorskip("transformers")
    from test_hf_models import check

    check(name, dtype=torch.float16)


def test_torch_compile_backend_widens_too(monkeypatch):
    """torch.compile(backend="aotfuse") traces each Dynamo graph with the same table: its 16-bit
    matmuls, convolutions and attention are converted too, and it trains like eager."""
    from aotfuse import decompositions

    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    converted = []
    real = decompositions._f32
    monkeypatch.setattr(decompositions, "_f32", lambda t: converted.append(t) or real(t))
    torch._dynamo.reset()
    torch.manual_seed(0)
    report = compare_models(_Mixed(), lambda: _inputs(), dtype=torch.float16, steps=2, name="mixed fp16, torch.compile",
                            compile_fn=lambda m: torch.compile(m, backend="aotfuse", dynamic=False))
    report.assert_ok()
    assert report.checked > 20, report
    assert len(converted) >= 20, len(converted)  # the forward's and backward's operands, every op of the table


class _Attention(nn.Module):
    """Eager attention written with matmuls (bmm), as Albert's and Bert's eager attention is."""

    def __init__(self, d: int = 32, heads: int = 2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = torch.softmax((q @ k.transpose(-1, -2)).float() * 0.25, -1).to(x.dtype)
        return self.out((p @ v).transpose(1, 2).reshape(b, t, d)).float().square().mean()


def test_the_min_cut_saves_16_bit_sources_not_their_float32_conversions(monkeypatch):
    """The float32 conversion of a 16-bit matmul operand holds twice its source's bytes: the min cut
    saves the source and converts it again in the backward (partition.c's save_weight,
    widening_conversion), also where the operand is read through a transpose, a view of the conversion.
    Before, the conversions won a tie of the cut's weights: Albert's float16 step saved float32 copies of
    its attention's q, k, v and probabilities (45.8 MB saved, 41.1 MB now; its peak 58.8 -> 54.0 MB)."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")  # the matmuls as written
    torch.manual_seed(0)
    model = _Attention().half()
    x = torch.randn(4, 16, 32, dtype=torch.float16)
    e = aotfuse.explain(model, x)
    # (the softmax's per-row statistics, [4, 2, 16, 1], are float32 as in eager)
    wide = [(name, shape) for name, shape, dtype, nbytes in e.saved if dtype == "float32" and shape[-1] != 1]
    assert not wide, e
    assert any(dtype == "float16" and tuple(shape)[-2:] == (16, 16) for _n, shape, dtype, _b in e.saved), e  # p
    report = compare_models(_Attention(), lambda: (torch.randn(4, 16, 32),), dtype=torch.float16, steps=2,
                            name="attention fp16")
    report.assert_ok()
