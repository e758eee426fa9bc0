"""Eager attention as torch's scaled_dot_product_attention (python/aotfuse/attention.py): which chains
are rewritten, which are left alone, and that the rewritten models train like eager."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.testing import compare_models

SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")


class Attention(nn.Module):
    """One attention layer written out as eager attention, with switches for the variants models use."""

    def __init__(self, p=0.0, mask=True, scale="mul", f32_softmax=False, return_probs=False, heads=2, causal=None,
                 upcast=False, where=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.p, self.mask, self.scale, self.f32, self.return_probs, self.heads = (
            p, mask, scale, f32_softmax, return_probs, heads)
        # causal: the masked_fill's value (nanoGPT: -inf), or where(tril, scores, causal)'s
        self.causal, self.upcast, self.where = causal, upcast, where
        self.register_buffer("tril", torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))

    def forward(self, x, m):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, 16 // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.scale == "mul":
            scores = scores * (q.shape[-1] ** -0.5)
        elif self.scale == "div":
            scores = scores / math.sqrt(q.shape[-1])
        if self.causal is not None and self.where:
            scores = torch.where(self.tril[:, :, :s, :s] > 0, scores, self.causal)
        elif self.causal is not None:
            scores = scores.masked_fill(self.tril[:, :, :s, :s] == 0, self.causal)
        if self.mask:
            scores = scores + m
        if self.upcast:
            probs = torch.softmax(scores.float(), -1).to(q.dtype)
        elif self.f32:
            probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
        else:
            probs = torch.softmax(scores, -1)
        probs = F.dropout(probs, self.p, self.training)
        y = self.out(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 16))
        return (y, probs) if self.return_probs else y


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, dtype=dtype)
    m = torch.zeros(2, 1, 1, 5, dtype=dtype)
    m[1, ..., -2:] = torch.finfo(dtype).min  # padding, as Hugging Face's masks
    return x, m


def _ops(model, *args, **kwargs):
    return str(aotfuse.explain(aotfuse.memory_efficient_fusion(model), *args, **kwargs))


def _rewritten(monkeypatch, model, *args, compiler=None) -> list:
    """How many attention chains each capture of `model` rewrote (one entry per pre-dispatch trace);
    compiler: memory_efficient_fusion by default."""
    import aotfuse.attention

    counts = []
    real = aotfuse.attention.fuse_attention

    def counting(*a, **k):
        counts.append(real(*a, **k))
        return counts[-1]

    monkeypatch.setattr(aotfuse.attention, "fuse_attention", counting)
    torch._dynamo.reset()
    (compiler or aotfuse.memory_efficient_fusion)(model)(*args)
    monkeypatch.setattr(aotfuse.attention, "fuse_attention", real)
    return counts


def _dynamo(dynamic=False, collect=None):
    """torch.compile(., backend="aotfuse"), its lowered programs appended to `collect`."""
    from aotfuse.dynamo import aotfuse_backend

    backend = functools.partial(aotfuse_backend, collect=collect) if collect is not None else "aotfuse"
    return lambda model: torch.compile(model, backend=backend, dynamic=dynamic)


def _dynamo_ops(model, *args, dynamic=False, **kwargs) -> dict:
    """The ATen calls of the programs torch.compile(model, backend="aotfuse") ran for one training step."""
    torch._dynamo.reset()
    seen: list = []
    out = _dynamo(dynamic, seen)(model)(*args, **kwargs)
    (out.loss if hasattr(out, "loss") else out).sum().backward()
    ops: dict = {}
    for _, low in seen:
        for op, n in low.extern_counts().items():
            op = op.split(".")[0]  # without the overload
            ops[op] = ops.get(op, 0) + n
    torch._dynamo.reset()
    return ops


def _force_for_bf16(monkeypatch, dtype: torch.dtype) -> None:
    """CPU bf16 attention is rewritten only when forced (AOTFUSE_FUSE_ATTENTION=1): so for bf16 these CPU
    tests force it, standing in for the CUDA default's rewrite."""
    if dtype == torch.bfloat16:
        monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")


def _assert_becomes_sdpa_and_trains_like_eager(cls, variant: dict, dtype: torch.dtype, monkeypatch) -> None:
    """cls(**variant) trains like eager (and float64), and its attention is one SDPA call, no bmm left
    (bf16: forced, _force_for_bf16)."""
    x, m = _inputs(dtype)
    _force_for_bf16(monkeypatch, dtype)
    report = compare_models(lambda: cls(**variant), lambda: (x, m), dtype=dtype, steps=2, name=str(variant))
    report.assert_ok()
    ops = _ops(cls(**variant).to(dtype), x, m)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::bmm" not in ops, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", [{}, {"scale": "div"}, {"scale": None}, {"mask": False}, {"f32_softmax": True},
                                     {"heads": 4}, {"causal": float("-inf"), "mask": False},
                                     {"causal": float("-inf")}, {"causal": float("-inf"), "mask": False, "where": True},
                                     {"causal": float("-inf"), "where": True}, {"upcast": True}],
                         ids=["mul", "div", "unscaled", "no-mask", "f32-softmax", "4-heads", "causal-fill",
                              "causal-fill-and-mask", "causal-where", "causal-where-and-mask", "upcast"])
def test_eager_attention_becomes_sdpa_and_trains_like_eager(variant, dtype, monkeypatch):
    _assert_becomes_sdpa_and_trains_like_eager(Attention, variant, dtype, monkeypatch)


def test_what_reads_the_probabilities_keeps_the_attention_eager():
    """output_attentions: the probabilities are an output, so there is nothing to fuse."""
    x, m = _inputs()
    report = compare_models(lambda: Attention(return_probs=True), lambda: (x, m), steps=2, name="probs")
    report.assert_ok()
    assert not any(op in _ops(Attention(return_probs=True), x, m) for op in SDPA_OPS)


def test_a_finite_masked_fill_keeps_the_attention_eager(monkeypatch):
    """masked_fill(scores, c, -1e9) (or where(c, scores, -1e9)) is not a mask: a row masked whole is
    uniform in eager, not in SDPA (with -inf it is the same: such a row is NaN either way)."""
    x, m = _inputs()
    assert _rewritten(monkeypatch, Attention(causal=-1e9), x, m) == [0]
    assert _rewritten(monkeypatch, Attention(causal=-1e9, where=True), x, m) == [0]
    assert _rewritten(monkeypatch, Attention(causal=float("-inf")), x, m) == [1]
    compare_models(lambda: Attention(causal=-1e9), lambda: (x, m), steps=2, name="finite fill").assert_ok()


class LearnedBias(Attention):
    """A learned additive bias in the mask's place (ALiBi-like, T5's relative bias): it needs a gradient."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 2, 5, 5) * 0.1)

    def forward(self, x, m):
        return super().forward(x, m + self.bias)


def test_a_mask_that_needs_a_gradient_keeps_the_attention_eager(monkeypatch):
    x, m = _inputs()
    assert _rewritten(monkeypatch, LearnedBias(), x, m) == [0]
    report = compare_models(LearnedBias, lambda: (x, m), steps=2, name="learned bias")
    report.assert_ok()
    torch.manual_seed(0)
    model, ref = LearnedBias(), LearnedBias()
    ref.load_state_dict(model.state_dict())
    aotfuse.memory_efficient_fusion(model)(x, m).sum().backward()
    ref(x, m).sum().backward()
    assert model.bias.grad is not None and model.bias.grad.abs().sum() > 0
    torch.testing.assert_close(model.bias.grad, ref.bias.grad, atol=1e-6, rtol=1e-5)


def test_cpu_attention_with_dropout_stays_aotfuses_unless_forced(monkeypatch):
    """On the CPU ATen's SDPA with dropout is its math path (eager's ops again, slower than aotfuse's
    kernels): such attention is left alone, and a module with an active dropout layer is not even
    traced for it; AOTFUSE_FUSE_ATTENTION=1 forces the rewrite, =0 turns it off everywhere."""
    x, m = _inputs()
    assert _rewritten(monkeypatch, Attention(), x, m) == [1]
    assert _rewritten(monkeypatch, Attention(p=0.1), x, m) == [0]
    model = Attention()
    model.drop = nn.Dropout(0.1)  # a dropout layer anywhere: not traced for it
    assert _rewritten(monkeypatch, model, x, m) == []
    model.eval()  # inactive
    assert _rewritten(monkeypatch, model, x, m) == [1]
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")
    assert _rewritten(monkeypatch, Attention(p=0.1), x, m) == [1]
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")
    assert _rewritten(monkeypatch, Attention(), x, m) == []


def test_cpu_bf16_attention_stays_aotfuses_unless_forced(monkeypatch):
    """ATen's CPU flash kernel is slower in bf16 than oneDNN's bf16 bmm with aotfuse's softmax kernel
    (attention.py): bf16 CPU attention stays as written (bmm, no SDPA call) and trains like eager;
    float32 is rewritten; AOTFUSE_FUSE_ATTENTION=1 rewrites bf16 too."""
    x, m = _inputs()
    assert _rewritten(monkeypatch, Attention(), x, m) == [1]
    xb, mb = _inputs(torch.bfloat16)
    assert _rewritten(monkeypatch, Attention().to(torch.bfloat16), xb, mb) == [0]
    ops = _ops(Attention().to(torch.bfloat16), xb, mb)
    assert "aten::bmm" in ops and "_scaled_dot_product_flash_attention_for_cpu" not in ops, ops
    compare_models(Attention, lambda: (xb, mb), dtype=torch.bfloat16, steps=2, name="bf16").assert_ok()
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")
    assert _rewritten(monkeypatch, Attention().to(torch.bfloat16), xb, mb) == [1]


def test_forced_sdpa_dropout_drops_at_the_rate_asked(monkeypatch):
    """Dropout inside SDPA draws from ATen's generator: not eager's masks, but the same rate and scale."""
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")
    torch.manual_seed(0)
    model = Attention(p=0.5)
    compiled = aotfuse.memory_efficient_fusion(model)
    x, m = _inputs()
    outs = torch.stack([compiled(x, m).detach() for _ in range(200)])
    assert _rewritten(monkeypatch, Attention(p=0.5), x, m) == [1]
    model.eval()
    expected = model(x, m).detach()
    # the output is linear in the dropped probabilities: the mean of many draws approaches the
    # dropout-free output
    assert torch.allclose(outs.mean(0), expected, atol=0.1), (outs.mean(0) - expected).abs().max()
    assert outs.std(0).max() > 0.01  # it does drop


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_compile_rewrites_eager_attention_too(dtype, dynamic, monkeypatch):
    """torch.compile(backend="aotfuse"): each graph Dynamo hands over is traced at the pre-dispatch level
    as memory_efficient_fusion's function is (symbolic shapes: each concrete shape's graph)."""
    x, m = _inputs(dtype)
    _force_for_bf16(monkeypatch, dtype)
    report = compare_models(Attention, lambda: (x, m), dtype=dtype, steps=2, compile_fn=_dynamo(dynamic),
                            name=f"torch.compile dynamic={dynamic}")
    report.assert_ok()
    ops = _dynamo_ops(Attention().to(dtype), x, m, dynamic=dynamic)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::bmm" not in ops, ops


def test_torch_compile_attention_rewrite_follows_the_same_switches(monkeypatch):
    """Under torch.compile too: CPU attention with dropout is left alone (its graph not even traced for
    it), AOTFUSE_FUSE_ATTENTION=1 forces the rewrite and =0 turns it off; the probabilities as an
    output keep the chain."""
    x, m = _inputs()
    compiler = _dynamo()
    assert _rewritten(monkeypatch, Attention(), x, m, compiler=compiler) == [1]
    assert _rewritten(monkeypatch, Attention(p=0.1), x, m, compiler=compiler) == []
    assert _rewritten(monkeypatch, Attention(return_probs=True), x, m, compiler=compiler) == [0]
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")
    assert _rewritten(monkeypatch, Attention(p=0.1), x, m, compiler=compiler) == [1]
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")
    assert _rewritten(monkeypatch, Attention(), x, m, compiler=compiler) == []
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["BertForMaskedLM", "GPT2LMHeadModel", "AlbertForMaskedLM"])
def test_hugging_face_eager_attention_without_dropout_trains_like_eager(name):
    """The seed models with attn_implementation='eager', no dropout and a padding mask: every layer's
    attention is one SDPA call, and the model trains like eager in fp32 and bf16."""
    pytest.importorskip("transformers")
    from aotfuse import bench

    _, inputs, _ = bench.build_model(name, "tiny", torch.float32, "cpu", dropout=0.0, attention_mask=True)
    inputs["attention_mask"][1, -5:] = 0

    def make():
        return bench.build_model(name, "tiny", torch.float32, "cpu", dropout=0.0, attention_mask=True)[0]

    for dtype in (torch.float32, torch.bfloat16):
        compare_models(make, lambda: inputs, dtype=dtype, steps=2, name=name).assert_ok()
    ops = _ops(make(), **inputs)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops, ops
    # torch.compile(backend="aotfuse") too: every layer's attention
    compare_models(make, lambda: inputs, steps=2, name=name, compile_fn=_dynamo()).assert_ok()
    model = make()
    ops = _dynamo_ops(model, **inputs)
    assert ops.get("aten::_scaled_dot_product_flash_attention_for_cpu") == model.config.num_hidden_layers, ops


def test_llama_eager_attention_under_its_rotary_no_grad_is_rewritten(monkeypatch):
    """Llama's rotary embedding runs under @torch.no_grad(): the pre-dispatch graph carries grad-mode
    switches, which replay as they are; both layers' attention becomes SDPA and the model trains like
    eager (grouped-query attention: k and v repeated before the matmul). Forced: bf16 CPU attention is
    rewritten only then."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")  # the model has no dropout: only bf16 is forced
    transformers.logging.set_verbosity_error()
    cfg = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, max_position_embeddings=64)

    def make():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).train()
        model.set_attn_implementation("eager")
        return model

    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -4:] = 0
    inputs = dict(input_ids=ids, labels=ids, attention_mask=mask)
    import aotfuse.attention

    counts = []
    real = aotfuse.attention.fuse_attention
    monkeypatch.setattr(aotfuse.attention, "fuse_attention", lambda *a, **k: counts.append(real(*a, **k)) or counts[-1])
    for dtype in (torch.float32, torch.bfloat16):
        compare_models(make, lambda: inputs, dtype=dtype, steps=2, name="llama").assert_ok()
    assert counts and all(c == 2 for c in counts), counts


def _fused_count(fn, *args) -> int:
    """How many chains fuse_attention rewrites in fn's pre-dispatch graph (q, k, v need gradients)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.attention import fuse_attention

    return fuse_attention(make_fx(fn, pre_dispatch=True)(*args), grad_inputs=[True, True, True, False])


def test_masks_sdpa_cannot_take_keep_the_attention_eager():
    """A mask or condition that broadcasts the scores beyond q's batch and heads, or one of fewer than 2
    dims, is not SDPA's attn_mask: such chains stay as they are (and run as in eager)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))

    def filled(q, k, v, c):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)).masked_fill(c, float("-inf")), -1), v)

    def added(q, k, v, m):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + m, -1), v)

    causal = torch.ones(4, 4).triu(1).bool()
    assert _fused_count(filled, q, k, v, causal) == 1
    assert _fused_count(filled, q, k, v, causal.expand(2, 1, 4, 4).clone()) == 0  # a batch of 2 from the mask
    assert _fused_count(filled, q, k, v, torch.tensor([False, False, True, False])) == 0  # 1-D
    assert _fused_count(added, q, k, v, torch.zeros(2, 2, 4, 4)) == 0
    assert _fused_count(added, q, k, v, torch.zeros(4)) == 0
    assert _fused_count(added, q, k, v, torch.zeros(1, 1, 4, 4)) == 1


def test_torch_compile_rewrite_keeps_the_static_inputs(monkeypatch):
    """AOTAutograd marks Dynamo's parameters static by metadata on Dynamo's own graph, not on the traced
    one: the partitioner is told the same static inputs either way (free to save: they live anyway)."""
    import aotfuse.dynamo

    seen = []
    real = aotfuse.dynamo.min_cut_rematerialization_partition

    def recording(joint, joint_inputs, **kwargs):
        seen.append(list(kwargs.get("aotfuse_static_inputs", kwargs.get("static_lifetime_input_indices")) or []))
        return real(joint, joint_inputs, **kwargs)

    monkeypatch.setattr(aotfuse.dynamo, "min_cut_rematerialization_partition", recording)
    x, m = _inputs()
    for mode in ("0", "auto"):
        monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", mode)
        torch._dynamo.reset()
        torch.compile(Attention(), backend="aotfuse")(x, m).sum().backward()
    torch._dynamo.reset()
    assert len(seen) == 2 and seen[0] and seen[0] == seen[1], seen


class Attention3D(nn.Module):
    """Heads folded into the batch ([batch * heads, L, E]), as hand-written blocks and torch's own
    multi-head attention write it: bmm (or matmul), a [batch * heads, 1, S] padding mask or a causal
    masked_fill, softmax, bmm."""

    def __init__(self, bmm=True, causal=False, heads=2):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.bmm, self.causal, self.heads = bmm, causal, heads

    def forward(self, x, m):
        b, s, _ = x.shape
        h, d = self.heads, 16 // self.heads
        q, k, v = (t.reshape(b, s, h, d).transpose(1, 2).reshape(b * h, s, d) for t in self.qkv(x).chunk(3, -1))
        mm = torch.bmm if self.bmm else torch.matmul
        scores = mm(q, k.transpose(1, 2)) / math.sqrt(d)
        if self.causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        scores = scores + m.reshape(b, 1, 1, s).expand(b, h, 1, s).reshape(b * h, 1, s)
        y = mm(torch.softmax(scores, -1), v)
        return self.out(y.reshape(b, h, s, d).transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", [{}, {"bmm": False}, {"causal": True}], ids=["bmm", "matmul", "causal"])
def test_3d_attention_becomes_sdpa_and_trains_like_eager(variant, dtype, monkeypatch):
    _assert_becomes_sdpa_and_trains_like_eager(Attention3D, variant, dtype, monkeypatch)


class SdpaAttention(nn.Module):
    """Attention as one call of torch's SDPA, as transformers' default attention ("sdpa") writes it."""

    def __init__(self, mask=True, causal=False, heads=2, p=0.0, viewed=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.mask, self.causal, self.heads, self.p, self.viewed = mask, causal, heads, p, viewed

    def forward(self, x, m):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, 16 // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m if self.mask else None, is_causal=self.causal,
                                           dropout_p=self.p if self.training else 0.0)
        if self.viewed:  # transformers' sdpa_attention_forward, then `.view(*input_shape, -1)` (AFMoE)
            return self.out(y.transpose(1, 2).contiguous().view(b, s, 16))
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


def _sdpa_inputs(kind: str, dtype: torch.dtype, s: int = 5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, s, 16, generator=g, dtype=dtype)
    if kind == "bool":  # True where a key is attended; query 2 of the second sequence attends to none
        m = torch.ones(2, 1, s, s, dtype=torch.bool)
        m[1, :, :, -2:] = False
        m[1, :, 2] = False
    else:  # Hugging Face's additive padding mask
        m = torch.zeros(2, 1, 1, s, dtype=dtype)
        m[1, ..., -2:] = torch.finfo(dtype).min
    return x, m


@pytest.mark.parametrize("variant", [{}, {"mask": "float"}, {"mask": None, "causal": True}, {"mask": None}],
                         ids=["bool-mask", "float-mask", "causal", "no-mask"])
def test_short_bf16_cpu_sdpa_runs_as_matmuls_and_a_softmax_kernel(variant):
    """attention.unfuse_attention: on bf16 CPU tensors, SDPA whose probabilities are no larger than q, k,
    v and the output becomes bf16 matmuls around a float32 softmax kernel (ATen's flash kernel is slower
    there): no flash call is left, and the model trains like eager's SDPA and float64, a fully masked
    query row included (0, as the flash kernel gives, not NaN). float32 keeps the flash kernel, and so
    does an additive float mask (attention.unfuse_attention says why)."""
    kind = variant.get("mask", "bool") or "bool"
    kwargs = dict(mask=variant.get("mask", "bool") is not None, causal=variant.get("causal", False))
    for dtype in (torch.bfloat16, torch.float32):
        x, m = _sdpa_inputs(kind, dtype)
        compare_models(lambda: SdpaAttention(**kwargs), lambda: (x, m), dtype=dtype, steps=2,
                       name=f"sdpa {variant}").assert_ok()
        ops = _ops(SdpaAttention(**kwargs).to(dtype), x, m)
        if dtype == torch.bfloat16 and kind == "bool":
            assert "flash_attention" not in ops and "aten::bmm" in ops and "_safe_softmax" not in ops, ops
        else:
            assert "_scaled_dot_product_flash_attention_for_cpu" in ops, ops


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_runs_short_bf16_sdpa_as_matmuls_too(dynamic):
    """torch.compile(backend="aotfuse"): a Dynamo graph calling SDPA on short bf16 CPU attention is
    traced for unfuse_attention as memory_efficient_fusion's function is, and trains like eager."""
    x, m = _sdpa_inputs("bool", torch.bfloat16)
    compare_models(SdpaAttention, lambda: (x, m), dtype=torch.bfloat16, steps=2, compile_fn=_dynamo(dynamic),
                   name=f"torch.compile sdpa dynamic={dynamic}").assert_ok()
    ops = _dynamo_ops(SdpaAttention().to(torch.bfloat16), x, m, dynamic=dynamic)
    assert "aten::bmm" in ops and not any("flash" in op for op in ops), ops


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("entry", ["memory_efficient_fusion", "torch.compile"])
def test_a_rewritten_sdpa_keeps_the_calls_layout_and_a_rewrite_that_cannot_trace_is_undone(entry, p, monkeypatch):
    """ATen's CPU SDPA gives [B, H, L, E] with the heads inside the sequence, so the graph behind it
    traced `o.transpose(1, 2).contiguous()` as no copy and then views it (`.view(B, L, -1)`:
    AFMoE with transformers' default attention): as matmuls (short bf16 attention; bf16 with
    dropout) the output is now laid out as the call's, where it was the matmul's and the view failed the
    capture (`Cannot view a tensor ...`). And a rewritten graph that still cannot be traced (that layout
    step undone here) is traced as the function is, with its SDPA call, not refused."""
    import aotfuse.attention

    x, m = _sdpa_inputs("bool", torch.bfloat16)
    make = functools.partial(SdpaAttention, viewed=True, p=p)
    if p == 0.0:  # (with dropout the draws are aotfuse's: the capture and its calls are checked below)
        compile_fn = _dynamo() if entry == "torch.compile" else None
        compare_models(make, lambda: (x, m), dtype=torch.bfloat16, steps=2, compile_fn=compile_fn,
                       name=f"{entry} viewed sdpa").assert_ok()
    model = make().to(torch.bfloat16)
    ops = _dynamo_ops(model, x, m) if entry == "torch.compile" else _ops(model, x, m)
    assert "aten::bmm" in ops and "flash" not in str(ops), ops
    if p == 0.0:  # (SDPA's math path, with dropout, gives the matmul's layout: nothing to undo)
        monkeypatch.setattr(aotfuse.attention, "_strided_like", lambda graph, out, want: out)
        ops = _dynamo_ops(model, x, m) if entry == "torch.compile" else _ops(model, x, m)
        assert "flash" in str(ops), ops


def test_long_bf16_sdpa_and_switched_off_rewrites_keep_the_flash_kernel(monkeypatch):
    """Where the probabilities would outgrow q, k, v and the output (L = 16 > 4 x 2-wide heads), the
    flash kernel stays, and so does eager attention of that size become it; AOTFUSE_FUSE_ATTENTION=0 and
    =1 leave SDPA calls alone (1 forces eager attention into SDPA)."""
    x, m = _sdpa_inputs("bool", torch.bfloat16, s=16)
    ops = _ops(SdpaAttention(heads=8).to(torch.bfloat16), x, m)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::bmm" not in ops, ops
    xe, me = torch.randn(2, 16, 16).to(torch.bfloat16), torch.zeros(2, 1, 1, 16, dtype=torch.bfloat16)
    assert _rewritten(monkeypatch, Attention(heads=8).to(torch.bfloat16), xe, me) == [1]
    x, m = _sdpa_inputs("bool", torch.bfloat16)
    for mode in ("0", "1"):
        monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", mode)
        assert "_scaled_dot_product_flash_attention_for_cpu" in _ops(SdpaAttention().to(torch.bfloat16), x, m)


def test_bf16_cpu_sdpa_with_dropout_runs_as_bf16_matmuls_and_drops_at_the_rate_asked(monkeypatch):
    """With dropout ATen's CPU SDPA is its math path, which computes bf16 attention in float32: such a
    call becomes eager attention's bf16 chain with aotfuse's dropout, at any length (L = 16 > 4 x 2-wide
    heads here): bf16 matmuls only, no float32 one; a module with dropout layers is traced for it too.
    Its draws are aotfuse's, not eager's: the mean of many calls approaches the dropout-free output."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    x, m = _sdpa_inputs("bool", torch.bfloat16, s=16)
    torch.manual_seed(0)
    model = SdpaAttention(heads=8, p=0.5).to(torch.bfloat16)
    model.drop = nn.Dropout(0.1)  # an active dropout layer elsewhere: traced all the same
    compiled = aotfuse.memory_efficient_fusion(model)
    outs = torch.stack([compiled(x, m).detach().float() for _ in range(300)])
    programs = [str(low.program) for rec in compiled._aotfuse_compiled.records for low in rec.programs.values()]
    bmms = [line for p in programs for line in p.splitlines() if "aten::bmm" in line]
    assert bmms and all(" bf16[" in line for line in bmms), bmms
    assert not any("flash_attention" in p or "_safe_softmax" in p or "native_dropout" in p for p in programs)
    model.eval()
    expected = model(x, m).detach().float()
    assert torch.allclose(outs.mean(0), expected, atol=0.08), (outs.mean(0) - expected).abs().max()
    assert outs.std(0).max() > 0.01  # it does drop
    model.train()
    compiled(x, m).float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_bf16_transformers_model_with_dropout_is_traced_for_sdpa_only_if_it_calls_it(monkeypatch):
    """A bf16 CPU module with dropout layers gets the pre-dispatch trace only for its SDPA calls (their
    dropout becomes aotfuse's): a transformers model with eager attention, the seed table's way, is not
    traced (0.25 s of Bert's first step at the reduced size), one with its default sdpa attention is,
    and its attention is rewritten."""
    pytest.importorskip("transformers")
    import aotfuse.attention
    from aotfuse import bench

    counts = []
    real = aotfuse.attention.unfuse_attention
    monkeypatch.setattr(aotfuse.attention, "unfuse_attention", lambda gm: counts.append(real(gm)) or counts[-1])
    for attn in ("eager", "sdpa"):
        model, inputs, _ = bench.build_model("BertForMaskedLM", "tiny", torch.bfloat16, "cpu", attn=attn, dropout=0.1)
        counts.clear()
        aotfuse.memory_efficient_fusion(model)(**inputs).loss.backward()
        assert counts == ([] if attn == "eager" else [model.config.num_hidden_layers]), (attn, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpas_math_path_softmax_is_a_kernel_and_masked_rows_are_zero(dtype):
    """ATen's CPU SDPA with dropout (transformers' default attention in training) is its math path,
    whose softmax is _safe_softmax: decomposed (decompositions._safe_softmax), it is one kernel with the
    mask before it, not an ATen call, and a fully masked row is 0 (its gradient too), as ATen's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, m = _sdpa_inputs("bool", dtype)
    with sdpa_kernel(SDPBackend.MATH):  # the math path without dropout: values that compare with eager's
        compare_models(SdpaAttention, lambda: (x, m), dtype=dtype, steps=2, name="math path").assert_ok()
        ops = _ops(SdpaAttention().to(dtype), x, m)
    assert "_safe_softmax" not in ops and "flash_attention" not in ops, ops


class _ReverseGradient(torch.autograd.Function):
    """A gradient reversal layer (domain-adversarial training): the identity forward, -0.5 x the gradient
    backward, which no autograd of the forward gives."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class _AttentionThenFunction(nn.Module):
    """Attention (SDPA, or the eager chain), then a custom autograd.Function on one of two paths."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.attention = SdpaAttention(mask=False) if sdpa else Attention(mask=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        y = self.attention(x, None)  # no mask
        return self.head(_ReverseGradient.apply(y)) + y.sum(-1, keepdim=True)


@pytest.mark.parametrize("entry", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("case", ["bf16-sdpa-auto", "fp32-eager-chain-forced"])
def test_a_custom_autograd_function_beside_rewritten_attention_keeps_its_backward(case, entry, monkeypatch):
    """A pre-dispatch trace (attention.fused_graph) records a custom autograd.Function's forward ops in
    its place, under no_grad, and nothing of its backward. Where the attention was rewritten, AOTAutograd
    then traced that graph: memory_efficient_fusion gave the attention's weights the gradient of the
    second path only, and torch.compile (whose graph holds the Function as `autograd_function_apply`)
    failed ("element 0 of tensors does not require grad"); PhiMoE's router weights had no gradient under
    torch.compile in bf16 (the sweep of 2026-12-08). A function that applies one is now traced as it is."""
    import aotfuse.attention

    sdpa = case.startswith("bf16")
    dtype = torch.bfloat16 if sdpa else torch.float32
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "auto" if sdpa else "1")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    compile_fn = None if entry == "memory_efficient_fusion" else _dynamo(False)
    torch._dynamo.reset()
    compare_models(lambda: _AttentionThenFunction(sdpa), lambda: (x,), dtype=dtype, steps=2, compile_fn=compile_fn,
                   name=f"{case} {entry}").assert_ok()
    original = vars(torch.autograd.Function)["apply"]
    with aotfuse.attention._custom_functions_applied() as applied:
        _ReverseGradient.apply(torch.ones(1))
    assert applied == [_ReverseGradient] and vars(torch.autograd.Function)["apply"] is original  # put back
    torch._dynamo.reset()


class _ClampsItsWeightData(nn.Module):
    """SDPA, then a linear layer whose weight the forward clamps through `.data` (Gemma 3n's AltUp
    clips its coefficients so in training)."""

    def __init__(self):
        super().__init__()
        self.attention = SdpaAttention(mask=False)
        self.coefs = nn.Linear(16, 4)

    def forward(self, x):
        if self.training:
            self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.coefs(self.attention(x, None))


@pytest.mark.parametrize("entry", ["memory_efficient_fusion", "torch.compile"])
def test_a_forward_that_clamps_a_weights_data_beside_rewritten_attention_trains_like_eager(entry):
    """Under torch.compile a parameter's `.data` is a constant of the pre-dispatch trace, a fake tensor of
    its own fake mode, and the rewritten graph clamped that constant: AOTAutograd passed it to every call
    ("torch's shim could not read a kernel operand": Gemma 3n text, bf16, the sweep of 2026-12-08). A
    pre-dispatch graph holding fake tensors is dropped: the function is traced as it is."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    compile_fn = None if entry == "memory_efficient_fusion" else _dynamo(False)
    torch._dynamo.reset()
    compare_models(_ClampsItsWeightData, lambda: (x,), dtype=torch.bfloat16, steps=2, compile_fn=compile_fn,
                   name=f"clamped .data {entry}").assert_ok()
    torch._dynamo.reset()
