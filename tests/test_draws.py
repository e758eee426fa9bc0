"""Random draws in a traced forward (aotfuse/draws.py): LayerDrop's `torch.rand([]) < p` answered where
p decides it, so BART-like models are captured whole in training; Python and NumPy draws refuse the
capture, where the graph would keep the first call's numbers."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import aotfuse
from aotfuse import draws
from aotfuse.testing import compare_models


class _LayerDrop(torch.nn.Module):
    """Two residual layers, each skipped in training where `test(draw, p)` holds, and a head."""

    def __init__(self, p: float, test, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 8)
        self.p, self.test, self.draw_dtype = p, test, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.test(torch.rand([], dtype=self.draw_dtype), self.p):
                continue
            x = x + torch.tanh(layer(x))
        return self.head(x)


TESTS = {  # the ways transformers and others write the test
    "u < p": lambda u, p: u < p,
    "p > u": lambda u, p: p > u,
    "torch.lt": lambda u, p: torch.lt(u, p),
    "not u.ge(p)": lambda u, p: not u.ge(p),
    "item": lambda u, p: (u < p).item(),
    "and": lambda u, p: True and u < p,
    "rand(1)": lambda u, p: torch.rand(1) < p,
}


@pytest.mark.parametrize("form", list(TESTS))
@pytest.mark.parametrize("p,skipped", [(0.0, False), (-1.0, False), (1.0, True), (1.5, True)])
def test_a_draw_the_probability_decides_is_captured_whole_and_trains_like_eager(form, p, skipped):
    """p = 0 (every HF config's default LayerDrop), p < 0: the layers always run; p >= 1: always
    skipped. The capture succeeds without a fallback, its values and gradients are eager's, and the
    program still draws as eager does: torch's generator is where eager's call leaves it."""
    torch.manual_seed(0)
    model = _LayerDrop(p, TESTS[form])
    x = torch.randn(4, 8)
    report = compare_models(model, (x,), steps=2)
    report.assert_ok()
    compiled = aotfuse.memory_efficient_fusion(model)  # fallback="error": a failed capture raises
    eager_out = model(x)
    torch.manual_seed(1)
    model(x)
    eager_state = torch.get_rng_state()
    out = compiled(x)
    torch.manual_seed(1)
    compiled(x)
    assert torch.equal(torch.get_rng_state(), eager_state)
    torch.testing.assert_close(out, eager_out)
    out.sum().backward()
    grads = [layer.weight.grad for layer in model.layers]
    assert all((g is None or not g.any()) if skipped else (g is not None and g.any()) for g in grads), grads


@pytest.mark.parametrize("p,dtype", [(0.5, torch.float32), (1e-9, torch.float32), (1.0, torch.bfloat16)],
                         ids=["p=0.5", "p=1e-9", "bf16 u<1"])
def test_a_draw_the_probability_does_not_decide_still_fails_the_capture(p, dtype):
    """A LayerDrop that can skip layers (or a 16-bit draw, which may round up to 1) is data: the
    capture fails as before, and fallback='dynamo' draws each call as eager does."""
    torch.manual_seed(0)
    model = _LayerDrop(p, TESTS["u < p"], dtype)
    x = torch.randn(4, 8)
    with pytest.raises(aotfuse.CaptureError, match="_local_scalar_dense") as info:
        aotfuse.memory_efficient_fusion(model)(x)
    assert "a probability that does not decide it (LayerDrop" in str(info.value), str(info.value)
    torch._dynamo.reset()
    compiled = aotfuse.memory_efficient_fusion(model, fallback="dynamo")
    torch.manual_seed(3)
    eager = [model(x) for _ in range(6)]
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one warning
        outs = [compiled(x) for _ in range(6)]
    for a, b in zip(outs, eager):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("closed", [False, True], ids=["[0,1)", "[0,1]"])
@pytest.mark.parametrize("op", ["lt", "le", "gt", "ge"])
def test_decide_agrees_with_every_draw(op, closed):
    """draws._decide answers exactly where every u of the range gives the same truth."""
    us = [0.0, 1e-30, 0.25, 0.5, 1.0 - 2.0**-24] + ([1.0] if closed else [])
    cmp = {"lt": lambda u, p: u < p, "le": lambda u, p: u <= p, "gt": lambda u, p: u > p,
           "ge": lambda u, p: u >= p}[op]
    for p in (-1.0, -0.0, 0.0, 1e-9, 0.5, 1.0 - 2.0**-24, 1.0, 1.0 + 2.0**-23, 2.0, float("nan"), float("inf")):
        truths = {cmp(u, p) for u in us}
        got = draws._decide(op, p, closed)
        if got is not None:
            assert truths == {got}, (op, p, closed, got)
        elif p in (-1.0, 2.0, float("inf")) or (p in (-0.0, 0.0) and op in ("lt", "ge")):
            pytest.fail(f"{op} {p} is decided by every draw but was left open")


class _PythonDraw(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = random.random() if self.kind == "random" else float(np.random.rand())
        y = self.lin(x)
        return y * 2 if u < 0.5 else y - 1


@pytest.mark.parametrize("kind", ["random", "numpy"])
def test_python_and_numpy_draws_refuse_the_capture_and_the_fallback_draws_as_eager(kind):
    """A graph would keep the trace's draw for every call (a layer always kept, a frozen SpecAugment
    mask). The capture is refused, naming the cause, and leaves the generators as it found them, so
    fallback='dynamo' and 'eager' draw exactly eager's numbers, call after call."""
    torch.manual_seed(0)
    model = _PythonDraw(kind)
    x = torch.randn(3, 4)
    random.seed(0)
    np.random.seed(0)
    state = draws.python_rng_state()
    with pytest.raises(aotfuse.CaptureError, match="draws Python or NumPy random numbers") as info:
        aotfuse.memory_efficient_fusion(model)(x)
    assert "RandomStateError" in str(info.value)
    assert draws.python_rng_state() == state
    random.seed(0)
    np.random.seed(0)
    eager = [model(x) for _ in range(8)]
    assert len({round(float(e.detach().sum()), 4) for e in eager}) == 2  # both branches taken
    for fallback in ("dynamo", "eager"):
        torch._dynamo.reset()
        compiled = aotfuse.memory_efficient_fusion(model, fallback=fallback)
        random.seed(0)
        np.random.seed(0)
        with pytest.warns(UserWarning, match="could not capture"):
            outs = [compiled(x) for _ in range(8)]
        for a, b in zip(outs, eager):
            torch.testing.assert_close(a, b)
    torch._dynamo.reset()


transformers = pytest.importorskip("transformers")


def _bart(**kw):
    cfg = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, **kw)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(cfg)


def _seq2seq_inputs():
    gen = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(3, 100, (2, 16), generator=gen), labels=torch.randint(3, 100, (2, 16), generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bart_in_training_is_captured_whole(dtype):
    """BART's LayerDrop (`torch.rand([]) < 0.0` by default) had kept it from one graph in training:
    it ran in Dynamo's pieces. Now one capture, eager's and float64's values (compare_models's
    compiled copy has fallback='error')."""
    compare_models(_bart, _seq2seq_inputs, dtype=dtype, steps=2).assert_ok()


def test_bart_with_layerdrop_and_wav2vec2_with_time_masks_are_refused_naming_why():
    """BART with encoder LayerDrop 0.1 may skip layers: data, CaptureError (the fallback trains it).
    Wav2Vec2's SpecAugment draws its time masks with NumPy: refused as a Python draw, not frozen."""
    with pytest.raises(aotfuse.CaptureError, match="_local_scalar_dense"):
        aotfuse.memory_efficient_fusion(_bart(encoder_layerdrop=0.1))(**_seq2seq_inputs())
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        mask_time_prob=0.5, mask_time_length=2, layerdrop=0.0)
    model = transformers.Wav2Vec2Model(cfg).train()
    with pytest.raises(aotfuse.CaptureError, match="draws Python or NumPy random numbers"):
        aotfuse.memory_efficient_fusion(model)(input_values=torch.randn(2, 1600))
