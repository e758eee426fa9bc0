"""Constant folding (constfold.py): values no graph input reaches are computed once when lowering.

Each test checks the values against eager (bit for bit: folding evaluates the same ATen ops) and
what was folded: which ATen calls are gone, how many constants the program binds."""
import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse.lower import lower
from helpers import assert_close

aten = torch.ops.aten


def band_masks(x):
    """Longformer's per-layer band masks: new_ones(...).tril().flip(...), twice (equal values),
    applied with where; and Bert's extended attention mask from ones."""
    n = x.shape[-1]
    outs = []
    for _ in range(2):
        mask2d = aten.flip.default(aten.tril.default(aten.new_ones.default(x, [n, n])), [0])
        mask = aten.expand.default(aten.unsqueeze.default(mask2d, 0), list(x.shape))
        outs.append(aten.where.ScalarOther(aten._to_copy.default(mask, dtype=torch.bool), x, -1.0))
    ext = aten.mul.Tensor(aten.rsub.Scalar(aten.ones.default([1, n], dtype=torch.float32), 1.0), -1e9)
    return aten.add.Tensor(outs[0], outs[1]), aten.add.Tensor(x, ext)


def test_band_masks_are_computed_once_and_kept_once():
    x = torch.randn(3, 5, 5)
    lowered = lower(make_fx(band_masks)(x))
    for _ in range(2):
        for i, (a, r) in enumerate(zip(lowered([x]), band_masks(x))):
            assert_close(a, r, f"band mask output {i}", atol=0, rtol=0)
    externs = lowered.extern_counts()
    for op in ("aten::tril.default", "aten::flip.default", "aten::new_ones.default", "aten::ones.default"):
        assert op not in externs, externs
    # the two flipped masks are equal: one constant; the extended mask ((1 - 1) * -1e9 = -0.0 in
    # every element) is uniform: an aten.full member, no constant
    # (the masks as bool, expanded: what the where reads, 75 bytes)
    assert len(lowered._constants) == 1, [tuple(c.shape) for c in lowered._constants]
    assert tuple(lowered._constants[0].shape) == (3, 5, 5) and lowered._constants[0].dtype == torch.bool
    assert "aten::full.default" in [op for op, _k, _g in lowered.program.node_groups()]


def test_folding_off_computes_every_step(monkeypatch):
    monkeypatch.setenv("AOTFUSE_CONSTANT_FOLD", "0")
    x = torch.randn(3, 5, 5)
    lowered = lower(make_fx(band_masks)(x))
    assert not lowered._constants
    assert lowered.extern_counts().get("aten::flip.default") == 2, lowered.extern_counts()
    for a, r in zip(lowered([x]), band_masks(x)):
        assert_close(a, r, "unfolded", atol=0, rtol=0)


def test_uniform_values_keep_the_sign_of_zero():
    # (1 - 1) * -1e9 is -0.0: a full member must write -0.0, which 1 / x tells from +0.0 (and a
    # kernel's -0.0 literal must be a float: C's "-0" is the integer 0)
    def f(x):
        zero = aten.mul.Tensor(aten.rsub.Scalar(aten.ones.default([4], dtype=torch.float32), 1.0), -1e9)
        mixed = aten.cat.default([zero, aten.zeros.default([4], dtype=torch.float32)])  # -0.0 and +0.0
        return aten.div.Tensor(x, zero), aten.div.Tensor(1.0, mixed), aten.div.Tensor(1.0, aten.mul.Tensor(x, -0.0))

    x = torch.ones(4)
    lowered = lower(make_fx(f)(x))
    a, b, c = lowered([x])
    ra, rb, rc = f(x)
    assert torch.equal(a, ra) and bool((a == -torch.inf).all()), a
    assert torch.equal(c, rc) and bool((c == -torch.inf).all()), c  # a -0.0 scalar in a kernel
    assert torch.equal(b, rb) and b[:4].eq(-torch.inf).all() and b[4:].eq(torch.inf).all(), b


def test_outputs_are_never_shared_constants():
    # a graph output computed from no input is made every call: the caller may write to it
    def f(x):
        return aten.add.Tensor(x, 1.0), aten.mul.Tensor(aten.arange.default(4, dtype=torch.float32), 2.0)

    x = torch.randn(4)
    lowered = lower(make_fx(f)(x))
    first = lowered([x])[1]
    first.add_(100.0)
    second = lowered([x])[1]
    assert first.data_ptr() != second.data_ptr()
    assert_close(second, torch.arange(4.0) * 2.0, "constant output after the caller wrote the last one", atol=0, rtol=0)


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_outputs_that_are_views_of_constants_are_never_shared(how):
    """An output that is a view of a value no input reaches (`ones_like(a)` updated in place, then
    sliced; `zeros_like` of an integer input, reshaped; an item of `unbind`) keeps its base a node: folded, the base was
    one tensor under every call's output, so a caller's in-place update of one call's result showed in
    the next call's (found by a random aliasing sweep)."""
    def f(a):
        v = torch.ones_like(a)
        v[3].neg_()
        return v[1:2], a * 2

    def g(a):
        return (torch.zeros_like(a).reshape(-1),)

    make = {"aot_function": aotfuse.aot_function, "memory_efficient_fusion": aotfuse.memory_efficient_fusion,
            "torch.compile": lambda fn: torch.compile(fn, backend="aotfuse")}[how]
    torch._dynamo.reset()
    cf = make(f)
    first = cf(torch.randn(4, requires_grad=True))[0]
    with torch.no_grad():
        first.add_(10.0)
    second = cf(torch.randn(4, requires_grad=True))[0]
    assert second.tolist() == [1.0] and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    cg = make(g)
    first = cg(torch.ones(4, 3, dtype=torch.int64))[0]
    first.add_(5)
    second = cg(torch.ones(4, 3, dtype=torch.int64))[0]
    assert torch.equal(second, torch.zeros(12, dtype=torch.int64))
    # an item of a multi-output view (unbind, split: taken by operator.getitem) is a view too (of a
    # transposed input: its full_like is no contiguous fill, which would stay a node anyway)
    ch = make(lambda a: ((torch.full_like(a, 2) * 0.5).unbind(0)[2],))
    first = ch(torch.randn(4, 3, requires_grad=True).t())[0]
    with torch.no_grad():
        first.add_(1.0)
    second = ch(torch.randn(4, 3, requires_grad=True).t())[0]
    assert second.tolist() == [1.0] * 4 and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def test_random_and_input_dependent_values_are_not_folded():
    def f(x):
        noise = aten.rand.default([4], dtype=torch.float32, device=torch.device("cpu"), pin_memory=False)
        return aten.add.Tensor(x, noise), aten.mul.Tensor(aten.exp.default(x), aten.arange.default(4, dtype=torch.float32))

    x = torch.randn(4)
    lowered = lower(make_fx(f)(x))
    a1, b1 = lowered([x])
    a2, b2 = lowered([x])
    assert not torch.equal(a1, a2), "a random draw was folded into a constant"
    assert_close(b1, torch.exp(x) * torch.arange(4.0), "input-dependent", atol=0, rtol=0)
    assert torch.equal(b1, b2)
    assert "aten::rand.default" in lowered.extern_counts()


def test_views_of_constants_stay_views_and_big_values_are_not_kept():
    def f(x, y):
        table = aten.mul.Tensor(aten.arange.default(12, dtype=torch.float32), 0.5)
        view = aten.t.default(aten.view.default(table, [3, 4]))                    # [4, 3], strides (1, 4)
        big = aten.tril.default(aten.ones.default([600, 600], dtype=torch.float32))  # 1.44 MB > 1 MiB
        return aten.add.Tensor(x, view), aten.mul.Tensor(y, big)

    x, y = torch.randn(4, 3), torch.randn(600, 600)
    lowered = lower(make_fx(f)(x, y))
    for a, r in zip(lowered([x, y]), f(x, y)):
        assert_close(a, r, "views and big", atol=0, rtol=0)
    shapes = sorted(tuple(c.shape) for c in lowered._constants)
    # the table is kept (the view reads it), the big mask is computed from a kept all-ones fill
    assert shapes == [(12,)], shapes
    assert "aten::tril.default" in lowered.extern_counts()


def test_like_fills_read_only_the_layout():
    """full_like(x, -inf) in x's (transposed) layout reads nothing of x: it folds, keeping its layout.
    Small, it is a constant; too big to keep (Longformer's full_like of a strided slice at the seed's
    size), it is an aten.full member permuted to the traced layout, which keeps no memory."""
    def g(x):
        xt = aten.t.default(x)
        filled = aten.full_like.default(xt, -float("inf"), memory_format=torch.preserve_format)
        band = aten.tril.default(filled, -1)
        return aten.where.self(aten.isinf.default(band), xt, band), aten.add.Tensor(filled, xt)

    for n in (5, 600):  # 600 x 600 fp32 (1.44 MB) is above the largest constant kept
        x = torch.randn(n, n)
        lowered = lower(make_fx(g)(x))
        for _ in range(2):
            for i, (a, r) in enumerate(zip(lowered([x]), g(x))):
                assert a.stride() == r.stride(), (n, i, a.stride(), r.stride())
                assert_close(a, r, f"full_like of a transposed input, {n}x{n}, output {i}", atol=0, rtol=0)
        ops = [op for op, _k, _g in lowered.program.node_groups()]
        assert "aten::full_like.default" not in ops, ops
        kept = {(str(c.dtype), c.stride()) for c in lowered._constants}
        if n == 5:  # filled (transposed), band and isinf(band): all kept
            assert not lowered.extern_counts(), lowered.extern_counts()
            assert kept == {("torch.float32", (1, 5)), ("torch.float32", (5, 1)), ("torch.bool", (5, 1))}, kept
            assert "aten::full.default" not in ops
        else:  # filled is a permuted fill; band (1.44 MB) is computed from it; isinf(band) (360 kB) is kept
            assert "aten::full.default" in ops and "aten::permute.default" in ops, ops
            assert kept == {("torch.bool", (600, 1))}, kept
            assert lowered.extern_counts() == {"aten::tril.default": 1}, lowered.extern_counts()


class Banded(torch.nn.Module):
    """A linear layer times a band mask built from nothing (Longformer's), which the backward reads;
    with_output: also returns a value computed from the mask alone."""

    def __init__(self, with_output: bool):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.with_output = with_output

    def forward(self, x):
        mask = torch.ones(6, 6).tril().flip(0)
        loss = (self.fc(x) * mask).sum()
        return (loss, mask * 2.0) if self.with_output else loss


def test_saved_values_may_be_constants():
    """A forward's outputs after the user-visible ones are saved for its backward, which only reads
    them: a mask computed from nothing is a constant there (Longformer's ending mask), and the
    backward reads the saved constant instead of recomputing it."""
    torch.manual_seed(0)
    model = Banded(with_output=True)
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(6, 6)
    for step in range(2):
        (loss_c, out_c), (loss_e, out_e) = compiled(x), eager(x)
        assert_close(loss_c, loss_e, f"step {step} loss")
        assert_close(out_c, out_e, f"step {step} output")
        out_c.add_(1.0)  # the caller writes to its output: it must not be a shared constant
        loss_c.backward()
        loss_e.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"step {step} grad of {name}")
    rec = compiled._aotfuse_compiled.records[-1]
    fwd, bwd = rec.programs["forward"], rec.programs["backward"]
    assert len(fwd._constants) == 1 and "aten::flip.default" not in fwd.extern_counts(), fwd.extern_counts()
    assert "aten::flip.default" not in bwd.extern_counts() and not bwd._constants, bwd.extern_counts()


def test_uniform_values_in_other_layouts_without_fusion(monkeypatch):
    # a fill too big to keep, transposed: ATen's full and permute make the traced layout, which a
    # view that needs it (t, then view) reads
    monkeypatch.setenv("AOTFUSE_FUSION", "0")
    x = torch.randn(600, 600)

    def g(x):
        filled = aten.full_like.default(aten.t.default(x), 2.0, memory_format=torch.preserve_format)
        return aten.add.Tensor(filled, 1.0), aten.view.default(aten.t.default(aten.mul.Tensor(filled, x)), [360000])

    lowered = lower(make_fx(g)(x))
    assert lowered.extern_counts().get("aten::full.default") == 1 and not lowered._constants, lowered.extern_counts()
    for a, r in zip(lowered([x]), g(x)):
        assert a.stride() == r.stride()
        assert_close(a, r, "ATen's full and permute", atol=0, rtol=0)


class Masked(torch.nn.Module):
    """A model whose mask is built from shapes every step (as Hugging Face models do without an
    attention mask), trained through memory_efficient_fusion."""

    def __init__(self):
        super().__init__()
        self.q, self.v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        bias = torch.zeros(n, n).masked_fill(~causal, float("-inf"))
        scores = self.q(x) @ x.transpose(1, 2) / 4.0 + bias
        return torch.softmax(scores, -1) @ self.v(x)


@pytest.mark.parametrize("fold", ["1", "0"])
def test_a_folded_model_trains_like_eager(monkeypatch, fold):
    monkeypatch.setenv("AOTFUSE_CONSTANT_FOLD", fold)
    torch.manual_seed(0)
    model = Masked()
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(2, 6, 16)
    for step in range(2):
        out_c, out_e = compiled(x), eager(x)
        assert_close(out_c, out_e, f"step {step} output")
        out_c.square().sum().backward()
        out_e.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"step {step} grad of {name}")
    fwd = compiled._aotfuse_compiled.records[-1].programs["forward"]
    externs = fwd.extern_counts()
    if fold == "1":
        assert "aten::tril.default" not in externs and "aten::masked_fill.Scalar" not in externs, externs
        assert len(fwd._constants) == 1
    else:
        assert "aten::tril.default" in externs and not fwd._constants, externs


def test_dynamo_pieces_fold_and_save_constants():
    """torch.compile(backend="aotfuse") lowers each Dynamo graph through the same folding, its
    forwards with saved_from (the saved mask is a constant there too)."""
    import functools

    from aotfuse.dynamo import aotfuse_backend

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Banded(with_output=False)
    eager = copy.deepcopy(model)
    lowered: list = []
    compiled = torch.compile(model, backend=functools.partial(aotfuse_backend, collect=lowered), dynamic=False)
    x = torch.randn(6, 6)
    for step in range(2):
        loss_c, loss_e = compiled(x), eager(x)
        assert_close(loss_c, loss_e, f"step {step} loss")
        loss_c.backward()
        loss_e.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"step {step} grad of {name}")
    forwards = [low for stage, low in lowered if stage == "forward"]
    assert forwards and all("aten::flip.default" not in low.extern_counts() for low in forwards)
    assert sum(len(low._constants) for low in forwards) == 1
