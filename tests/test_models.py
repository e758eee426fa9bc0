"""Small models through memory_efficient_fusion: outputs, every gradient and three optimizer steps
match eager (fp32: atol 1e-4, rtol 5e-3)."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from helpers import assert_close, check_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.tanh(self.fc1(x)))))


class LayerNormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 24)

    def forward(self, x):
        return F.gelu(self.fc(self.ln(x)))


class Attention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.d = heads, d
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = scores.softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(b, s, d)
        return self.ln(x + self.out(y))


class EmbedCE(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


class DropoutZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 12), nn.Dropout(p=0.0)

    def forward(self, x):
        return self.drop(F.gelu(self.fc(x))) + x


def test_mlp():
    check_module(MLP(), torch.randn(8, 16), steps=3)


def test_layernorm_gelu():
    check_module(LayerNormGelu(), torch.randn(4, 6, 24), steps=3)


def test_softmax_attention():
    check_module(Attention(), torch.randn(2, 5, 32), steps=3)


def test_softmax_attention_with_mask():
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    check_module(Attention(), torch.randn(2, 5, 32), mask=mask, steps=2)


def test_embedding_cross_entropy():
    ids = torch.randint(0, 50, (4, 7))
    labels = torch.randint(0, 50, (4, 7))
    check_module(EmbedCE(), ids, labels, steps=3)


def test_batchnorm_training_updates_running_stats():
    model = BNNet()
    compiled = check_module(model, torch.randn(4, 3, 6, 6), steps=3)
    # check_module compared the buffers; make sure they really moved and were counted
    assert int(compiled.orig_module.bn.num_batches_tracked) == 3
    assert compiled.orig_module.bn.running_mean.abs().sum() > 0


def test_batchnorm_eval_uses_running_stats():
    model = BNNet()
    check_module(model, torch.randn(4, 3, 6, 6), steps=1)
    model.eval()
    check_module(model, torch.randn(4, 3, 6, 6), steps=1)


def test_batchnorm_in_bfloat16_updates_running_stats_in_kernels():
    """A CPU batch norm in bfloat16 keeps its new running statistics in bfloat16, where torch's meta
    function says float32: the C core is told their real dtype (lower._real_dtypes), so the kernel
    copying them into the buffers runs as generated (it fell back to ATen calls every step before)."""
    torch.manual_seed(0)
    model = BNNet().to(torch.bfloat16)
    eager, compiled_base = model, copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(compiled_base)
    x = torch.randn(4, 3, 6, 6, dtype=torch.bfloat16)
    for step in range(3):
        out_e, out_c = eager(x), compiled(x)
        assert_close(out_c, out_e, f"step {step} output", atol=1e-2, rtol=1e-1)
        out_e.float().sum().backward()
        out_c.float().sum().backward()
        for (name, pc), pe in zip(compiled_base.named_parameters(), eager.parameters()):
            assert_close(pc.grad, pe.grad, f"step {step} grad of {name}", atol=1e-2, rtol=1e-1)
        for (name, bc), be in zip(compiled_base.named_buffers(), eager.buffers()):
            assert_close(bc, be, f"step {step} buffer {name}", atol=1e-2, rtol=1e-1)
    assert int(compiled_base.bn.num_batches_tracked) == 3 and compiled_base.bn.running_mean.dtype == torch.bfloat16
    programs = [low.program for rec in compiled._aotfuse_compiled.records for low in rec.programs.values()]
    assert programs and all(p.kernel_fallbacks == 0 for p in programs), [p.kernel_fallbacks for p in programs]


def test_a_bf16_batch_norms_running_stats_saved_for_the_backward_arrive_as_they_run():
    """A CPU batch norm in bfloat16 returns its new running statistics in bfloat16 (torch's meta
    function says float32), and `native_batch_norm_backward` takes them as arguments. In this net the
    min-cut saves the third norm's new running mean itself for the backward: its placeholder there
    must say bfloat16 too (lower.set_real_dtypes on the joint graph), or the backward program refuses
    the tensor the forward made ("input getitem_10: dtype code 15, the program was compiled for
    float32"; Hugging Face's ResNet in bf16 failed so)."""
    from aotfuse.testing import compare_models

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 1),
                             nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU())

    holder = []

    def compile_fn(model):
        compiled = aotfuse.memory_efficient_fusion(model)
        holder.append(compiled)
        return compiled

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    report = compare_models(make, lambda: (x.clone(),), dtype=torch.bfloat16, steps=3, name="conv-bn",
                            compile_fn=compile_fn)
    report.assert_ok()
    assert report.kernel_fallbacks == 0, report
    (rec,) = holder[0]._aotfuse_compiled.records
    saved = {n.name: n.meta["val"].dtype for n in rec.graphs["backward"].graph.nodes if n.op == "placeholder"}
    assert saved.get("getitem_10") == torch.bfloat16, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("float32_compute", ["0", "1"], ids=["16-bit convs", "float32 convs"])
def test_a_batch_norm_after_a_frozen_convolution_needs_no_input_gradient(dtype, float32_compute, monkeypatch):
    """Fine-tuning with the stem frozen: the first batch norm's input gradient is not needed, so its
    `native_batch_norm_backward` runs with output_mask [False, True, True] and ATen's kernel returns
    None there, where torch's meta function gives a tensor. The C core is told so (an "other" value,
    lower._real_dtypes); before, the runtime stopped: "output 0 is a NoneType, the graph expects a
    tensor" (Hugging Face's ResNet with its embedder frozen). The second batch norm's input gradient is
    channels-last at run time (its input's format; the meta function gives its contiguous output
    gradient's, lower._real_layouts): where a kernel reads it (the conversion of bf16 convolutions computed
    in float32, AOTFUSE_FLOAT32_COMPUTE, the default on CPUs without AVX-512) that kernel ran its nodes as
    ATen calls at every step, two kernel fallbacks a step, until 2026-12-06."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", float32_compute)
    from aotfuse.testing import compare_models

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))
        model[0].requires_grad_(False)
        return model

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    report = compare_models(make, lambda: (x.clone(),), dtype=dtype, steps=2, name="frozen-conv-bn")
    report.assert_ok()
    assert report.kernel_fallbacks == 0 and report.checked > 10, report


def test_dropout_p0():
    check_module(DropoutZero(), torch.randn(5, 12), steps=3)


def test_function_gradients_match():
    def f(x, w, b):
        return F.layer_norm(F.gelu(x @ w + b), (w.shape[1],)).softmax(-1)

    args = [torch.randn(6, 8, requires_grad=True), torch.randn(8, 10, requires_grad=True),
            torch.randn(10, requires_grad=True)]
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    cf = aotfuse.aot_function(f)
    out, ref = cf(*args), f(*ref_args)
    assert_close(out, ref, "output")
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    for i, (a, r) in enumerate(zip(args, ref_args)):
        assert_close(a.grad, r.grad, f"grad of argument {i}")


def test_inputs_that_do_not_require_grad():
    def f(x, w):
        return (x @ w).tanh()

    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    cf = aotfuse.aot_function(f)
    out = cf(x, w)
    out.sum().backward()
    w_grad = w.grad.clone()
    w.grad = None
    f(x, w).sum().backward()
    assert x.grad is None
    assert_close(w_grad, w.grad, "grad of w")


def test_no_grad_and_inference_mode():
    model = MLP()
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert not out.requires_grad
    assert_close(out, ref, "no_grad output")
    with torch.inference_mode():
        out, ref = compiled(x), model(x)
    assert out.is_inference()
    assert_close(out, ref, "inference_mode output")
    out = compiled(x)  # grad mode again: a separate signature, with autograd
    assert out.requires_grad


def test_graph_with_tensor_constants():
    # a tensor literal in the model becomes a get_attr constant in the captured graph
    def f(x):
        return x * torch.tensor([1.0, 2.0, 3.0]) + torch.tensor(0.5)

    x = torch.randn(4, 3, requires_grad=True)
    cf = aotfuse.aot_function(f)
    out = cf(x)
    assert_close(out, f(x.detach()), "output")
    out.sum().backward()
    assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0]).expand(4, 3), "grad")


class RNNs(nn.Module):
    """torch's LSTM/GRU decompositions choose oneDNN's mkldnn_rnn_layer on a CPU when oneDNN is on;
    its inference-mode workspace is None at run time though the traced graph expects a tensor, so
    capture traces the plain decomposition (oneDNN stays on): matmuls and pointwise ops, fused."""

    def __init__(self, kind: str, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(6, 5, batch_first=True, **kw)
        self.fc = nn.Linear(5 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x):
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return self.fc(out).tanh(), h


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}], ids=["one_layer", "two_layers_bidirectional"])
def test_recurrent_layers_train_like_eager(kind, kw):
    torch.manual_seed(0)
    compiled = check_module(RNNs(kind, **kw), torch.randn(3, 7, 6), steps=2)
    assert torch.backends.mkldnn.enabled
    assert not any("mkldnn" in op for low in compiled._aotfuse_compiled.records[0].programs.values()
                   for op, _k, _g in low.program.node_groups()), "an oneDNN RNN call in the captured programs"


class DepthwiseBlock(nn.Module):
    """ConvNeXt's block: a depthwise 7x7 convolution, channels-last work (norm, linear, GELU, linear),
    permuted back and added to the block's input, twice."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.dw = nn.ModuleList(nn.Conv2d(c, c, 7, padding=3, groups=c) for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(c) for _ in range(2))
        self.fc = nn.ModuleList(nn.Linear(c, c) for _ in range(2))

    def forward(self, x):
        x = x.permute(0, 3, 1, 2)  # a channels-last input, as after ConvNeXt's downsampling norm
        for dw, norm, fc in zip(self.dw, self.norm, self.fc):
            y = fc(norm(dw(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
            x = x + torch.nn.functional.gelu(y)
        return x


def test_convolutions_of_channels_last_inputs_keep_eagers_layout():
    """The fake convolution's layout comes from the backend that runs it: with oneDNN off while
    tracing (as capture once set it, for the LSTM's sake), a depthwise convolution of a channels-last
    input traced contiguous, so its channels-last result was copied into that layout at every run and
    the next convolutions read contiguous inputs, oneDNN's slow case (ConvNeXt's step at 147% of
    eager's). The graph's convolutions, and the output, now have eager's strides."""
    torch.manual_seed(0)
    model = DepthwiseBlock()
    x = torch.randn(16, 8, 8, 16)  # oneDNN off, the fake picked contiguous at batch 16, not at 4
    compiled = check_module(model, x, steps=1)
    eager_strides = []
    hooks = [m.register_forward_hook(lambda m, a, o: eager_strides.append(o.stride())) for m in model.dw]
    expect = model(x)
    for h in hooks:
        h.remove()
    assert all(s == (1024, 1, 128, 16) for s in eager_strides), eager_strides  # channels-last, as oneDNN runs it
    graph = compiled._aotfuse_compiled.records[0].graphs["forward"]
    traced = [n.meta["val"].stride() for n in graph.graph.nodes if n.target == torch.ops.aten.convolution.default]
    assert traced == eager_strides, traced
    with torch.no_grad():
        out = compiled(x)
    assert out.stride() == expect.stride(), (out.stride(), expect.stride())


@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=2),
                                dict(kernel_size=3, stride=1, padding=1, dilation=2, ceil_mode=True)],
                         ids=["resnet_stem", "2x2", "dilated_ceil"])
def test_max_pools_run_on_channels_last_copies_with_eagers_values_and_indices(kw, monkeypatch):
    """ATen's CPU max pool of a contiguous input is scalar code per plane, of a channels-last one a
    vectorized kernel across channels (6.4 against 0.3 ms at (16, 32, 32, 32), 3x3 stride 2): a pool
    of a contiguous CPU input with at least 16 channels runs on a channels-last copy, its value and
    indices copied back (ResNet's step 101% -> 85% of eager's). Values, indices (ties and NaNs
    included) and gradients are eager's to the bit; fewer channels, or AOTFUSE_CHANNELS_LAST_POOLS=0,
    keep ATen's call as it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (4, 16, 9, 11), generator=g).float()  # ties everywhere
    x[0, 1, 2, 3] = float("nan")
    x.requires_grad_()

    def f(x):
        out, idx = torch.nn.functional.max_pool2d(x, return_indices=True, **kw)
        return out * 2.0, idx

    for channels, env, rewritten in ((16, None, True), (15, None, False), (16, "0", False)):
        if env is not None:
            monkeypatch.setenv("AOTFUSE_CHANNELS_LAST_POOLS", env)
        xs = x.detach()[:, :channels].clone().requires_grad_()
        cf = aotfuse.aot_function(f)
        out, idx = cf(xs)
        ref, ref_idx = f(xs)
        assert torch.equal(idx, ref_idx) and idx.stride() == ref_idx.stride()
        assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0)) and out.stride() == ref.stride()
        grad = torch.randn(out.shape, generator=g)
        got, = torch.autograd.grad(out, xs, grad)
        want, = torch.autograd.grad(ref, xs, grad)
        assert torch.equal(got, want)
        forward = str(cf.records[-1].programs["forward"])
        assert ("memory_format=torch.channels_last" in forward) == rewritten, forward
