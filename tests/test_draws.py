"""Random draws in a traced forward (aotfuse/draws.py): LayerDrop's `torch.rand([]) < p` answered where
p decides it, so BART-like models are captured whole in training; Python's and NumPy's scalar draws
answered the same way and made again by every run; other Python and NumPy draws refuse the capture,
where the graph would keep the first call's numbers."""
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


DRAWS = {  # the scalar draws python_draws answers, as models write them (MusicGen, VITS, the adapters)
    "random.random()": lambda: random.random(),
    "random.uniform(0, 1)": lambda: random.uniform(0, 1),
    "random.uniform(b=1.0, a=0.0)": lambda: random.uniform(b=1.0, a=0.0),
    "np.random.random()": lambda: np.random.random(),
    "np.random.rand()": lambda: np.random.rand(),
    "np.random.random_sample()": lambda: np.random.random_sample(),
    "np.random.uniform(0, 1)": lambda: np.random.uniform(0, 1),
}


class _PythonLayerDrop(torch.nn.Module):
    """MusicGen's LayerDrop with a Python or NumPy draw."""

    def __init__(self, p: float, draw, test=lambda u, p: u < p) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.p, self.draw, self.test = p, draw, test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.test(self.draw(), self.p):
                continue
            x = x + torch.tanh(layer(x))
        return x.sum()


def _states_after(fn, x, calls: int) -> tuple[list[torch.Tensor], tuple, torch.Tensor]:
    """fn's outputs over `calls` calls from fixed seeds, then the Python, NumPy and torch generators' states."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(1)
    outs = [fn(x) for _ in range(calls)]
    return outs, draws.python_rng_state(), torch.get_rng_state()


@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("p,test", [(0.0, "u < p"), (0.0, "p > u"), (1.5, "u < p"), (-0.5, "not u >= p")])
def test_a_python_draw_the_probability_decides_is_captured_whole_and_drawn_each_call(draw, p, test):
    """MusicGen's `random.uniform(0, 1) < layerdrop` at its default 0 (and the others' NumPy forms): one
    graph, whose every run makes the trace's Python and NumPy draws again, so the generators move as
    eager's calls move them (a data loader's shuffle after the step is eager's)."""
    tests = {"u < p": lambda u, p: u < p, "p > u": lambda u, p: p > u, "not u >= p": lambda u, p: not u >= p}
    torch.manual_seed(0)
    model = _PythonLayerDrop(p, DRAWS[draw], tests[test])
    x = torch.randn(4, 8)
    compiled = aotfuse.memory_efficient_fusion(model)  # fallback="error": a refusal fails the test
    eager_outs, eager_state, eager_torch = _states_after(model, x, 3)
    outs, state, torch_state = _states_after(compiled, x, 3)
    cf = compiled._aotfuse_compiled
    assert cf.compile_count == 1 and len(cf.last_entry.record.python_draws) == 3
    assert state == eager_state and torch.equal(torch_state, eager_torch)
    for a, b in zip(outs, eager_outs):
        torch.testing.assert_close(a, b)
    assert random.random is not None and getattr(random.random, "__self__", None) is random._inst  # put back
    assert getattr(np.random.random, "__self__", None) is np.random.mtrand._rand


FRAMES = {  # forms a graph cannot draw anew each call: refused, naming the draw or the state change
    "undecided": (lambda: random.random() < 0.5, "UndecidedDrawError: random.random"),
    "float()": (lambda: float(np.random.rand()) < 0.0, "UndecidedDrawError: numpy.random.rand"),
    "arithmetic": (lambda: random.uniform(0, 1) * 2 < 0.0, "UndecidedDrawError: random.uniform"),
    "tensor": (lambda: bool(torch.tensor(np.random.random()) < 0.0), "dtype of PythonDraw"),
    "array": (lambda: np.random.rand(1)[0] < 0.5, "RandomStateError"),
    "gauss": (lambda: random.gauss(0, 1) < 0.0, "RandomStateError"),
}


class _PythonDraw(torch.nn.Module):
    def __init__(self, branch) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if self.branch() else y - 1


@pytest.mark.parametrize("form", list(FRAMES))
def test_python_and_numpy_draws_a_graph_would_freeze_refuse_the_capture_and_the_fallback_draws_as_eager(form):
    """A graph would keep the trace's draw for every call (a layer always kept, a frozen SpecAugment
    mask). The capture is refused, naming the cause, and leaves the generators as it found them, so
    fallback='dynamo' and 'eager' draw exactly eager's numbers, call after call (Dynamo's own default
    draws NumPy's arrays from torch's generator: the fallback runs them as NumPy)."""
    branch, cause = FRAMES[form]
    torch.manual_seed(0)
    model = _PythonDraw(branch)
    x = torch.randn(3, 4)
    random.seed(0)
    np.random.seed(0)
    state = draws.python_rng_state()
    with pytest.raises(aotfuse.CaptureError, match="draws Python or NumPy random numbers") as info:
        aotfuse.memory_efficient_fusion(model)(x)
    assert cause in str(info.value)
    assert draws.python_rng_state() == state
    random.seed(0)
    np.random.seed(0)
    eager = [model(x) for _ in range(8)]
    if form in ("undecided", "array"):
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


def test_python_draws_answer_only_the_tracing_thread_and_only_one_number():
    """Other threads calling random.random while a pass traces get numbers; array draws and other
    signatures go to the real function (the pass's state check sees them); the comparisons decide as
    draws._decide over the call's range (uniform(a, b) may round up to b)."""
    import threading

    got = []
    with draws.python_draws() as pd:
        t = threading.Thread(target=lambda: got.append(random.random()))
        t.start()
        t.join()
        u = random.uniform(2.0, 3.0)
        assert not u < 2.0 and u < 3.5 and u <= 3.0 and u > 1.0 and u != 5.0
        with pytest.raises(draws.UndecidedDrawError):
            _ = u < 3.0  # 2 + 1 * r may round to 3
        with pytest.raises(draws.UndecidedDrawError):
            _ = u == 2.5
        v = np.random.uniform(low=0.0, high=1.0)
        assert not v < 0.0 and v < 1.0  # 0 + 1 * r is r: never 1
        w = random.random()  # taken as never exactly 0.0 (once in 2**53 draws): the adapters' `u > 0`
        assert w > 0 and not w <= 0 and w != 0 and not 0 >= w
        assert np.random.rand(2).shape == (2,) and isinstance(np.random.random(size=None), draws.PythonDraw)
        assert isinstance(np.random.random(size=3), np.ndarray)
    assert isinstance(got[0], float)
    assert len(pd.calls) == 4
    random.seed(5)
    expect = [random.uniform(2.0, 3.0) for _ in range(2)]
    random.seed(5)
    draws.replay(pd.calls[:1])
    assert random.uniform(2.0, 3.0) == expect[1]


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


def _musicgen():
    cfg = transformers.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, num_codebooks=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    return transformers.MusicgenForCausalLM(cfg).train()


def _musicgen_inputs():
    gen = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(0, 64, (4, 12), generator=gen),
                labels=torch.randint(0, 64, (2, 12, 2), generator=gen))


def _wav2vec2_adapter():
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0, layerdrop=0.0, add_adapter=True, adapter_stride=2, num_adapter_layers=2, output_hidden_size=32,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0)
    torch.manual_seed(0)
    return transformers.Wav2Vec2Model(cfg).train()


@pytest.mark.parametrize("name", ["musicgen", "wav2vec2-adapter"])
def test_models_testing_python_draws_against_layerdrop_are_captured_whole(name):
    """MusicGen (`random.uniform(0, 1) < layerdrop`) and Wav2Vec2's adapter layers
    (`np.random.random() > layerdrop`) at LayerDrop 0 (MusicGen's default; Wav2Vec2's is 0.1, which its
    encoder tests with `torch.rand([])`, undecided): one graph in training, eager's and
    float64's values (compare_models's compiled copy has fallback='error'), and Python's and NumPy's
    generators where eager's calls leave them."""
    make, inputs = {"musicgen": (_musicgen, _musicgen_inputs),
                    "wav2vec2-adapter": (_wav2vec2_adapter,
                                         lambda: dict(input_values=torch.randn(2, 1600, generator=torch.Generator()
                                                                                .manual_seed(2))))}[name]
    compare_models(make, inputs, steps=2, name=name).assert_ok()
    model = make()
    compiled = aotfuse.memory_efficient_fusion(model)
    kwargs = inputs()
    states = []
    for fn in (model, compiled):
        random.seed(0)
        np.random.seed(0)
        for _ in range(2):
            fn(**kwargs)
        states.append(draws.python_rng_state())
    assert states[0] == states[1]
    assert len(compiled._aotfuse_compiled.last_entry.record.python_draws) == 2  # one per layer
