"""Outputs nobody differentiates (the logits beside the loss) get no dense zero gradient: autograd
passes None, and the backward runs a variant program in which that gradient is zero, its adds
folded away. Gradients must equal eager's whichever outputs are differentiated."""
import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.lower import missing_gradients
from helpers import assert_close


class TwoHeads(nn.Module):
    """loss and logits, as Hugging Face models return them; the logits' gradient meets the loss's
    in an add, and a second output uses its gradient in a product."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(x.shape[0]) % 5)
        return loss, logits, h * 3.0


@pytest.mark.parametrize("which", ["loss", "loss+logits", "logits", "all"])
def test_gradients_match_eager_whichever_outputs_are_differentiated(which):
    torch.manual_seed(0)
    model = TwoHeads()
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(6, 8)
    for _ in range(2):  # the second call reuses the variant
        for m in (model, eager):
            m.zero_grad()
        outs = [compiled(x), eager(x)]
        for loss, logits, h in outs:
            total = {"loss": loss, "loss+logits": loss + logits.square().sum(), "logits": logits.sum(),
                     "all": loss + logits.sum() + h.sum()}[which]
            total.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"grad of {name} ({which})")
    bw = compiled._aotfuse_compiled.records[-1].programs["backward"]
    assert bw.program.num_kernels > 0
    if which == "all":
        assert not bw.variants
        assert bw.program.kernels_loaded
    else:
        assert bw.variants, "the backward ran with dense zero gradients"
        for missing, variant in bw.variants.items():
            assert variant.program.num_inputs == bw.program.num_inputs - len(missing)
            assert variant.program.kernels_loaded
        # a backward's kernels compile at its first run: this one never ran
        assert not bw.program.kernels_loaded and bw.program.source and not bw.program.cache_hit


class SideHead(nn.Module):
    """A returned value and a head over it; training on the value alone leaves the head's weights
    without a gradient in eager."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return h, self.head(h)


@pytest.mark.parametrize("entry", ["memory_efficient_fusion", "torch.compile"])
def test_weights_reached_only_through_undifferentiated_outputs_get_no_gradient(entry):
    """Eager leaves a parameter's .grad None where it reaches only outputs nobody differentiated;
    the compiled backward gave zeros (as AOTAutograd does under aot_eager), so AdamW's weight decay
    moved weights eager leaves alone. The variant program's outputs that read none of the gradients
    given are None now."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = SideHead()
    x = torch.randn(5, 4)
    runs = {}
    for kind in ("eager", "compiled"):
        model = copy.deepcopy(base)
        f = model if kind == "eager" else (aotfuse.memory_efficient_fusion(model) if entry == "memory_efficient_fusion"
                                           else torch.compile(model, backend="aotfuse"))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        for _ in range(2):
            opt.zero_grad()
            h, _y = f(x)
            h.sum().backward()
            assert model.head.weight.grad is None and model.head.bias.grad is None, kind
            opt.step()
        h, _y = f(x)
        grads = torch.autograd.grad(h.square().sum(), list(model.parameters()), allow_unused=True)
        runs[kind] = (model, grads)
    (eager, eager_grads), (compiled, compiled_grads) = runs["eager"], runs["compiled"]
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert_close(p, q, f"{entry}: {name} after two AdamW steps")
    for name, g, r in zip(dict(eager.named_parameters()), compiled_grads, eager_grads):
        assert (g is None) == (r is None), name
        if r is not None:
            assert_close(g, r, f"{entry}: autograd.grad of {name}")
    torch._dynamo.reset()


def test_the_zero_gradient_add_is_folded_away():
    torch.manual_seed(0)
    compiled = aotfuse.memory_efficient_fusion(TwoHeads())
    loss, _logits, _h = compiled(torch.randn(6, 8))
    loss.backward()
    record = compiled._aotfuse_compiled.records[-1]
    (missing, variant), = record.programs["backward"].variants.items()
    gm = missing_gradients(record.graphs["backward"], missing)
    before = [n for n in record.graphs["backward"].graph.nodes if n.op == "placeholder"]
    after = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(after) == len(before) - len(missing) and all(before[i].name not in after for i in missing)
    # the logits' gradient was only added to the loss's: no zeros tensor is made for it
    zeros = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.zeros.default]
    shapes = [tuple(n.meta["val"].shape) for n in zeros]
    assert (6, 5) not in shapes, shapes


def test_two_missing_gradients_added_together():
    """h's gradient is the sum of two outputs' gradients, both missing: a zeros tensor, not an error."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            return h.square().sum(), h, h + 0.0

    torch.manual_seed(0)
    model = M()
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(3, 4)
    compiled(x)[0].backward()
    eager(x)[0].backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")
    assert compiled._aotfuse_compiled.records[-1].programs["backward"].variants


class KVCacheLike(nn.Module):
    """Attention returning its keys as a cache (GPT2's `present` with use_cache=True): the keys'
    gradient is the (missing) cache gradient plus a transposed matmul gradient, and it is sliced
    (the cache's concatenation) and permuted before the projection's backward."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = (lin(x).view(2, 8, 2, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        keys = torch.cat([k.new_zeros(2, 2, 0, 8), k], dim=2)
        att = (q @ keys.transpose(-1, -2)).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(2, 8, 16).square().sum(), keys


def test_a_dropped_add_keeps_the_layout_its_views_were_traced_with():
    """The sum was contiguous, the other addend a transposed matmul gradient: the variant copies it
    to the sum's layout instead of reading it in place, so the views after it have the layouts their
    metadata gives and no kernel falls back to ATen calls on every run (GPT2's 12 lone copies did)."""
    torch.manual_seed(0)
    model = KVCacheLike()
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(2, 8, 16)
    for _ in range(3):
        for m in (model, eager):
            m.zero_grad()
        for m in (compiled, eager):
            m(x)[0].backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"grad of {name}")
    (variant,) = compiled._aotfuse_compiled.records[-1].programs["backward"].variants.values()
    assert variant.program.num_kernels > 0
    assert variant.program.kernel_fallbacks == 0


class BrokenTwoHeads(TwoHeads):
    """TwoHeads with a graph break in the middle: torch.compile(backend="aotfuse") runs two graphs."""

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        torch._dynamo.graph_break()
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(x.shape[0]) % 5)
        return loss, logits, h * 3.0


@pytest.mark.parametrize("which", ["loss", "all"])
def test_dynamo_backend_gets_no_dense_zero_gradients_either(which):
    """torch.compile(backend="aotfuse"): the same variant programs for outputs nobody differentiates."""
    from unittest import mock

    import aotfuse.dynamo as dyn

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = BrokenTwoHeads()
    eager = copy.deepcopy(model)
    lowered, real = [], dyn.lower

    def recording(gm, example_inputs=None, saved_from=None, lazy=False):
        lowered.append(real(gm, example_inputs, saved_from, lazy=lazy))
        return lowered[-1]

    with mock.patch.object(dyn, "lower", recording):
        compiled = torch.compile(model, backend="aotfuse")
        x = torch.randn(6, 8)
        for _ in range(2):
            for m in (model, eager):
                m.zero_grad()
            for loss, logits, h in (compiled(x), eager(x)):
                (loss if which == "loss" else loss + logits.sum() + h.sum()).backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                assert_close(p.grad, q.grad, f"grad of {name} ({which})")
    torch._dynamo.reset()
    backwards = [low for low in lowered if low.graph_module is not None]
    assert len(backwards) >= 2, "two graphs, each with a backward"
    if which == "loss":
        assert any(low.variants for low in backwards), "a backward ran with dense zero gradients"
    else:
        assert not any(low.variants for low in backwards)


def test_a_backward_whose_kernels_cannot_be_built_raises_and_a_later_step_builds_them(tmp_path, monkeypatch):
    """A backward's kernels compile at its first run (lazy_jit): a C compiler failing there is a clear
    error raised by backward(), and the next step compiles them and trains like eager."""
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))  # nothing compiled yet
    # and no body an earlier test's program compiled in this process (kernel templates) serves it
    monkeypatch.setenv("AOTFUSE_KERNEL_TEMPLATES", "0")
    torch.manual_seed(0)
    model = TwoHeads()
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(6, 8)
    loss, logits, h = compiled(x)  # the forward's kernels compile now
    bw = compiled._aotfuse_compiled.records[-1].programs["backward"]
    assert bw.program.num_kernels > 0 and not bw.program.kernels_loaded
    monkeypatch.setenv("AOTFUSE_CC", "/nonexistent/cc")
    with pytest.raises(Exception, match="C compiler"):
        (loss + logits.sum() + h.sum()).backward()
    monkeypatch.delenv("AOTFUSE_CC")
    for m in (model, eager):
        m.zero_grad()
        loss, logits, h = (compiled if m is model else eager)(x)
        (loss + logits.sum() + h.sum()).backward()
    assert compiled._aotfuse_compiled.records[-1].programs["backward"].program.kernels_loaded
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")


def test_views_of_a_missing_gradient_added_are_dropped_others_read_its_zeros():
    """A slice of a missing gradient that only adds read goes with it (lm_grads.py's chunks add the
    gradient's column slices): no zeros tensor is made for it. A slice read otherwise is a view of the
    zeros tensor of the whole gradient, with the layout it was traced with: an as_strided reader
    addressing the storage, or a transpose, sees the strides and offset of the trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def added(tangent, x):
        return (aten.mul.Tensor(aten.add.Tensor(aten.slice.Tensor(tangent, 1, 8, 16), x), 2.0),)

    def addressed(tangent, w):
        s = aten.slice.Tensor(tangent, 1, 8, 16)  # [16, 8] at storage offset 8, strides (16, 1)
        a = aten.as_strided.default(s, [16, 8], [16, 1], 8)
        return (aten.mm.default(a, w), aten.t.default(aten.slice.Tensor(tangent, 1, 0, 8)))

    t, x, w = torch.randn(16, 16), torch.randn(16, 8), torch.randn(8, 4)
    variant = missing_gradients(make_fx(added, tracing_mode="fake")(t, x), (0,))
    assert not [n for n in variant.graph.nodes if n.target in (aten.zeros.default, aten.slice.Tensor)], variant.graph
    assert torch.equal(variant(x)[0], x * 2.0)
    gm = make_fx(addressed, tracing_mode="fake")(t, w)
    variant = missing_gradients(gm, (0,))
    got = variant(w)
    assert torch.equal(got[0], torch.zeros(16, 4)) and torch.equal(got[1], torch.zeros(8, 16))
    traced = [n.meta["val"].stride() for n in gm.graph.nodes if n.target is aten.t.default]
    assert got[1].stride() == traced[0] == (1, 16), "the transpose of the slice lost its traced layout"
