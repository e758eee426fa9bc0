"""A language-model head's logits gradient made in vocabulary chunks (python/aotfuse/lm_grads.py):
the [tokens x vocab] gradient of `h @ W^T + b` under a cross entropy is never whole; each column
chunk feeds its share of the hidden states' gradient (summed), of the weight's and of the bias'
(concatenated). Gradients are checked against eager and against float64, the program's peak
against the same program made whole."""
import copy

import pytest
import torch

import aotfuse
from aotfuse import lm_grads
from aotfuse.bench import _cpu_peak
from helpers import assert_close

V, H, TOKENS = 4096, 32, 512  # the float32 gradient is 8 MiB: two chunks


class Head(torch.nn.Module):
    """An embedding, a hidden layer and a linear LM head (its own weight and bias) under a cross
    entropy; `logits_loss` also differentiates the logits (their gradient is then not zero)."""

    def __init__(self, logits_loss=False, act=torch.tanh):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.proj = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V)
        self.logits_loss = logits_loss
        self.act = act

    def forward(self, ids, labels):
        h = self.act(self.proj(self.emb(ids)))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        if self.logits_loss:
            loss = loss + logits.float().square().mean() * 1e-3
        return loss, logits


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (4, TOKENS // 4), generator=g)
    labels = torch.randint(0, V, (4, TOKENS // 4), generator=g)
    labels[0, :7] = -100  # ignored tokens
    return ids, labels


def _run(model, dtype, compiled):
    m = copy.deepcopy(model).to(dtype)
    run = aotfuse.memory_efficient_fusion(m) if compiled else m
    loss = run(*_batch())[0]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, run


def _backward_sources(cf):
    bw = cf._aotfuse_compiled.records[-1].programs["backward"]
    return [str(bw.program)] + [str(v.program) for v in bw.variants.values()]


def _check_grads(model, dtype, what):
    loss, ours, cf = _run(model, dtype, True)
    eager_loss, eager, _ = _run(model, dtype, False)
    exact_loss, exact, _ = _run(model, torch.float64, False)
    eps = torch.finfo(dtype).eps
    assert abs(loss.double() - exact_loss).item() <= 4 * abs(eager_loss.double() - exact_loss).item() + 8 * eps
    for name in exact:
        err = (ours[name].double() - exact[name]).abs().max().item()
        eager_err = (eager[name].double() - exact[name]).abs().max().item()
        scale = exact[name].abs().max().item()
        assert err <= 4 * eager_err + 4 * eps * scale, f"{what} {dtype} {name}: {err} from float64, eager {eager_err}"
    return cf


@pytest.mark.parametrize("logits_loss", [False, True], ids=["loss only", "logits differentiated too"])
def test_logits_gradient_in_chunks_matches_eager(logits_loss):
    torch.manual_seed(0)
    cf = _check_grads(Head(logits_loss), torch.float32, "Head")
    sources = _backward_sources(cf)
    # the program that ran: two chunks, each with its two matmuls (no whole [tokens x vocab] matmul)
    ran = sources[-1] if not logits_loss else sources[0]
    assert ran.count("aten::mm.default") >= 2 * 2 + 1, ran
    assert "aten::cat.default" in ran, ran
    assert f"f32[{TOKENS}, {V}] = aten::mm" not in ran and f"f32[{V}, {H}] = aten::mm" not in ran, ran
    if not logits_loss:  # the zero logits gradient is dropped, not made as a zeros tensor
        assert f"[4, {TOKENS // 4}, {V}] = aten::full" not in ran and "aten::zeros" not in ran, ran


def test_chunks_where_the_heads_input_is_recomputed(monkeypatch):
    """h = gelu(proj(x)): the min cut recomputes the head's input in the backward (the default,
    AOTFUSE_RECOMPUTE_MATERIALIZED=auto; gelu's gradient reads proj(x), saved anyway), placed before
    the weight gradient's matmul, after the logits gradient's first reader. The rewrite moves that
    elementwise work before the chunks, so the gradient is still made in chunks; with h saved
    (=0, functorch's rule) the forward saves h's bytes more."""
    saved = {}
    for mode in ("auto", "0"):
        monkeypatch.setenv("AOTFUSE_RECOMPUTE_MATERIALIZED", mode)
        torch.manual_seed(0)
        model = Head(act=torch.nn.functional.gelu)
        cf = _check_grads(model, torch.float32, f"Head with gelu, recompute {mode}")
        ran = _backward_sources(cf)[-1]
        assert ran.count("aten::mm.default") >= 2 * 2 + 1 and "aten::cat.default" in ran, ran
        assert f"f32[{TOKENS}, {V}] = aten::mm" not in ran and f"f32[{V}, {H}] = aten::mm" not in ran, ran
        saved[mode] = aotfuse.explain(aotfuse.memory_efficient_fusion(copy.deepcopy(model)), *_batch()).saved_bytes
    assert saved["auto"] <= saved["0"] - TOKENS * H * 4, saved


def test_peak_falls_and_results_match_the_whole_gradient(monkeypatch):
    """The caller holds the logits through the backward (as `out = model(...); out.loss.backward()`
    does): the whole gradient cannot be written into them (buffer reuse's kernels in place), and the
    chunks keep the peak lower. (Where the caller drops them, the whole gradient written into the
    logits' tensor has the lower peak: benchmarks/results/kernels-in-place-cpu-2026-12-03.md.)"""
    torch.manual_seed(0)
    model = Head()
    ids, labels = _batch()

    def step(m):
        m.zero_grad(set_to_none=True)
        out = m(ids, labels)
        out[0].backward()

    peaks, grads = {}, {}
    for chunks in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_LM_GRAD_CHUNKS", chunks)
        m = copy.deepcopy(model)
        cf = aotfuse.memory_efficient_fusion(m)
        step(cf)
        peaks[chunks] = _cpu_peak(lambda: step(cf))
        grads[chunks] = {n: p.grad.clone() for n, p in m.named_parameters()}
    gradient = TOKENS * V * 4
    assert peaks["1"] <= peaks["0"] - gradient // 4, f"peak with chunks {peaks['1']}, whole {peaks['0']}"
    for name, g in grads["0"].items():  # the hidden states' part is a sum of 2 products here
        assert_close(grads["1"][name], g, f"Head chunks vs whole {name}", atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("how", ["bf16", "AOTFUSE_LM_GRAD_CHUNKS=0"])
def test_gradient_kept_whole_where_not_rewritten(how, monkeypatch):
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if how == "bf16" else torch.float32
    if how == "AOTFUSE_LM_GRAD_CHUNKS=0":
        monkeypatch.setenv("AOTFUSE_LM_GRAD_CHUNKS", "0")
    cf = _check_grads(Head(), dtype, f"Head ({how})")
    for src in _backward_sources(cf):
        assert "aten::cat.default" not in src, src


def _grad_readers(x, lse, w, h, extra):
    """G = exp(x - lse) (x [tokens, vocab], lse [tokens, 1]) read by the three readers, and by a
    whole sum where `extra`."""
    aten = torch.ops.aten
    g = aten.exp.default(aten.sub.Tensor(x, lse))
    outs = [aten.mm.default(g, w), aten.mm.default(aten.t.default(g), h), aten.sum.dim_IntList(g, [0], True)]
    if extra:
        outs.append(aten.sum.default(g))
    return tuple(outs)


@pytest.mark.parametrize("extra", [False, True], ids=["three readers", "a fourth reader"])
def test_rewrite_on_its_own(extra):
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(5)
    vocab = 2 * V  # 16 MiB: four chunks
    args = (torch.randn(TOKENS, vocab, generator=g), torch.randn(TOKENS, 1, generator=g) + 8,
            torch.randn(vocab, H, generator=g), torch.randn(TOKENS, H, generator=g), extra)
    gm = make_fx(lambda *a: _grad_readers(*a, extra), tracing_mode="fake")(*args[:4])
    want = gm(*args[:4])
    assert lm_grads.rewrite_lm_grad_chunks(gm) == (0 if extra else 1)
    got = gm(*args[:4])
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == (2 if extra else 2 * 4), gm.graph
    if not extra:  # the hidden states' partial products summed as they come, not all kept to the end
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        left = [n for n in mms if n.args[0].target is not torch.ops.aten.t.default]
        adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and n.args[1] in left]
        assert len(adds) == len(left) - 1 and all(order[a] < order[m] for a, m in zip(adds, left[2:])), gm.graph
    for a, b in zip(got, want):
        assert_close(a, b, f"rewritten readers ({'extra' if extra else 'three'})", atol=1e-4, rtol=1e-5)


def test_chunk_count():
    assert lm_grads.chunk_count(1 << 20) == 1
    assert lm_grads.chunk_count(8 << 20) == 2
    assert lm_grads.chunk_count(16 << 20) == 4
    assert lm_grads.chunk_count(1 << 30) == lm_grads.MAX_CHUNKS


def test_chunks_are_not_chunked_again():
    """A backward variant is lowered anew from the rewritten graph: chunks big enough to qualify
    themselves (here 8 MiB each) must not be split again (the hidden states' partial products would
    multiply)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.lower import missing_gradients

    with torch._subclasses.fake_tensor.FakeTensorMode():
        args = (torch.empty(4096, 16384), torch.empty(4096, 1), torch.empty(16384, H), torch.empty(4096, H))
        gm = make_fx(lambda *a: _grad_readers(*a, False), tracing_mode="fake")(*args)
    assert lm_grads.chunk_count(4096 * 16384 * 4) == lm_grads.MAX_CHUNKS
    assert lm_grads.rewrite_lm_grad_chunks(gm) == 1
    mms = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert mms == 2 * lm_grads.MAX_CHUNKS
    again = missing_gradients(gm, ())  # a copy, as a variant is made
    assert lm_grads.rewrite_lm_grad_chunks(again) == 0
    assert sum(1 for n in again.graph.nodes if n.target is torch.ops.aten.mm.default) == mms


def test_an_mlps_wide_activation_gradient_is_left_as_traced():
    """The same three readers read a bias-free MLP's wide activation gradient: no softmax there (no exp
    with a per-row value), so it stays whole (K partial products would only change its rounding)."""
    import aotfuse.lower as lower_mod

    counts = []
    real = lm_grads.rewrite_lm_grad_chunks

    def counting(gm):
        counts.append(real(gm))
        return counts[-1]

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 4096, bias=False), torch.nn.Linear(4096, 64, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    m, x = MLP(), torch.randn(1024, 64)
    mc = copy.deepcopy(m)
    lm_grads.rewrite_lm_grad_chunks = counting
    try:
        aotfuse.memory_efficient_fusion(mc)(x).square().sum().backward()
    finally:
        lm_grads.rewrite_lm_grad_chunks = real
    m(x).square().sum().backward()
    assert counts and not any(counts), counts
    assert_close(mc.up.weight.grad, m.up.weight.grad, "MLP up.weight", atol=1e-4, rtol=1e-4)


def test_two_matmuls_reading_one_transpose():
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def f(x, lse, w, h, h2):
        g = aten.exp.default(aten.sub.Tensor(x, lse))
        gt = aten.t.default(g)
        return aten.mm.default(g, w), aten.mm.default(gt, h), aten.mm.default(gt, h2)

    gen = torch.Generator().manual_seed(6)
    args = (torch.randn(TOKENS, V, generator=gen), torch.randn(TOKENS, 1, generator=gen) + 8,
            torch.randn(V, H, generator=gen), torch.randn(TOKENS, H, generator=gen), torch.randn(TOKENS, 3, generator=gen))
    gm = make_fx(f, tracing_mode="fake")(*args)
    want = gm(*args)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # erasing a node twice warns
        assert lm_grads.rewrite_lm_grad_chunks(gm) == 1
    for a, b in zip(gm(*args), want):
        assert_close(a, b, "two readers of one transpose", atol=1e-4, rtol=1e-5)


def test_float16_head_computed_in_float32_is_chunked_too(monkeypatch):
    """A float16 head whose matmuls run in float32 (AOTFUSE_FLOAT32_COMPUTE, decompositions._float32_table):
    G is the float32 conversion of the rounded float16 gradient, read by both matmuls through one
    conversion (partition._convert_before_permutes) and by the bias' sum (partition._sums_of_conversions),
    so it is made in chunks as float32's is: no whole float16 or float32 [tokens x vocab] gradient, no
    whole float32 copy of the weight (each chunk converts its rows), the weight gradient's chunks
    rounded before they are joined; the forward's float32 logits are made in chunks of columns too
    (rewrite_head_chunks), each rounded as it comes; gradients as near float64 as eager's."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
    torch.manual_seed(0)
    cf = _check_grads(Head(), torch.float16, "Head")
    ran = _backward_sources(cf)[-1]
    assert ran.count("aten::mm.default") >= 2 * 2 + 1 and "aten::cat.default" in ran, ran
    for whole in (f"f32[{TOKENS}, {V}] = aten::mm", f"f32[{V}, {H}] = aten::mm", f"f16[4, {TOKENS // 4}, {V}] = aten::add",
                  f"f16[{TOKENS}, {V}] = aten::_to_copy", f"f32[{V}, {H}] = aten::_to_copy", f"f32[{H}, {V}]{{1, {H}}} = aten::_to_copy", f"f32[{V}, {H}] = aten::cat"):
        assert whole not in ran, (whole, ran)
    assert "f16[2048, 32] = aten::_to_copy" in ran, ran  # the chunks' rounded weight-gradient rows
    # the forward's logits too (rewrite_head_chunks): float32 chunks of columns, each rounded, joined
    fw = str(cf._aotfuse_compiled.records[-1].programs["forward"].program)
    for whole in (f"f32[{TOKENS}, {V}] = aten::addmm", f"f32[{TOKENS}, {V}] = aten::mm", f"f32[{V}, {H}] = aten::_to_copy"):
        assert whole not in fw, (whole, fw)
    assert fw.count(f"f32[{TOKENS}, 2048] = aten::addmm") == 2 and f"f16[{TOKENS}, {V}] = aten::cat" in fw, fw
