"""Mixed precision: training under torch.autocast matches eager under the same autocast.

Under autocast a norm gets a low-precision input and float32 weights; ATen's CPU kernels then keep
the saved mean and rstd in float32 while torch's meta functions (the traced metadata) say the
input's dtype, so the C core is told their real dtype (lower._real_dtypes). The autocast dtype is
part of the signature: a program traced under bfloat16 autocast is not reused under float16.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing import compare_models

AUTOCASTS = (torch.bfloat16, torch.float16)


class NormNet(nn.Module):
    """A linear layer (autocast: low precision) into each norm (float32 weights)."""

    def __init__(self, norm: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = {"layer": lambda: nn.LayerNorm(8), "group": lambda: nn.GroupNorm(2, 8),
                     "batch": lambda: nn.BatchNorm1d(8)}[norm]()

    def forward(self, x):
        h = self.fc(x)
        if isinstance(self.norm, nn.GroupNorm):
            h = h.unsqueeze(-1)
        return self.norm(h).float().square().mean()


@pytest.mark.parametrize("norm", ["layer", "group", "batch"])
@pytest.mark.parametrize("dtype", AUTOCASTS, ids=["bf16", "fp16"])
def test_norms_under_autocast(norm, dtype):
    def make():
        torch.manual_seed(0)
        return NormNet(norm)

    report = compare_models(make, lambda: (torch.randn(6, 8, generator=torch.Generator().manual_seed(1)),),
                            autocast=dtype, steps=2, name=f"NormNet({norm})")
    report.assert_ok()
    assert report.checked >= 10, report
    assert report.dtype == dtype and "autocast" in str(report)


def test_saved_statistics_have_their_real_dtype():
    """The forward hands the backward float32 statistics; the backward program expects them."""
    torch.manual_seed(0)
    model = aotfuse.memory_efficient_fusion(NormNet("layer"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(6, 8))
    # without the real dtypes: "input getitem_..: dtype code 6, the program was compiled for bfloat16"
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_autocast_dtype_is_part_of_the_signature():
    torch.manual_seed(0)
    model = aotfuse.memory_efficient_fusion(NormNet("layer"))
    x = torch.randn(6, 8)
    seen = []
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            h = model.fc(x)
            loss = model(x)
        loss.backward()
        seen.append(h.dtype)
    assert seen == [torch.bfloat16, torch.float16, torch.bfloat16]
    assert len(model._aotfuse_compiled.records) == 2  # one program per autocast dtype, the third call reuses the first


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["albert", "bert", "gpt2", "longformer"])
def test_hf_models_under_bf16_autocast(name):
    from test_hf_models import make_inputs, model_factory

    transformers.logging.set_verbosity_error()
    compile_fn = None
    if name == "longformer":  # its .item() needs Dynamo's graph break
        compile_fn = lambda m: aotfuse.memory_efficient_fusion(m, fallback="dynamo")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compare_models(model_factory(name), lambda: make_inputs(mask=name != "longformer"),
                                autocast=torch.bfloat16, steps=2, compile_fn=compile_fn, name=name)
    report.assert_ok()
    assert report.checked > 100, report
    assert not report.notes, report.notes[:3]


def test_gpt2_under_fp16_autocast():
    from test_hf_models import make_inputs, model_factory

    report = compare_models(model_factory("gpt2"), lambda: make_inputs(mask=True), autocast=torch.float16, steps=2)
    report.assert_ok()
    assert report.checked > 100, report


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", AUTOCASTS, ids=["bf16", "fp16"])
def test_norms_under_cuda_autocast(dtype):
    """CUDA autocast: the statistics' traced and real dtypes agree there (both float32); the
    captured casts and the generated kernels around the norms match eager on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    for norm in ("layer", "group", "batch"):
        def make():
            torch.manual_seed(0)
            return NormNet(norm).cuda()

        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).cuda()
        report = compare_models(make, lambda: (x,), autocast=dtype, steps=2, name=f"NormNet({norm}) cuda")
        report.assert_ok()
        assert report.checked >= 10, report
