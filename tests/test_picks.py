"""One-hot picks (python/aotfuse/picks.py): nll_loss's masked row sum computed from the picked logits,
once a row, in the cross entropy kernel's first pass; the same bits as the masked sum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse.picks import rewrite_one_hot_picks


def _logits(dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(48, 300, generator=g) * 4).to(dtype)
    x[5, 7] = float("-inf")   # a masked logit, picked below
    x[6] = -0.0               # a row of negative zeros
    x[9, :] = float("-inf")   # every logit masked: NaN log-probabilities
    t = torch.randint(0, 300, (48,), generator=g)
    t[5], t[6] = 7, 2
    t[::7] = -100            # ignored rows
    return x, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_row_losses_are_the_masked_sums_bits(dtype, monkeypatch):
    """reduction='none': every row's loss bit for bit what the masked row sum gives (the rewrite off),
    ignored rows 0, a picked -inf logit inf, an all -inf row NaN (as eager); the mean within the
    seed's tolerances of float64's."""
    x, t = _logits(dtype)
    out = {}
    for on in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_ONE_HOT_PICKS", on)
        for red in ("none", "mean"):
            f = lambda x, t, red=red: F.cross_entropy(x, t, reduction=red)
            out[on, red] = aotfuse.memory_efficient_fusion(f)(x, t)
    got, base = out["1", "none"], out["0", "none"]
    assert torch.equal(got.isnan(), base.isnan()), (got, base)
    keep = ~base.isnan()
    assert torch.equal(got[keep].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       base[keep].view(torch.int16 if dtype != torch.float32 else torch.int32)), (got, base)
    eager = F.cross_entropy(x, t, reduction="none")
    assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf()), (got, eager)
    assert (got[::7] == 0).all() and got[5].isinf() and got[9].isnan()
    ok = t.ne(-100)
    ok[5] = ok[9] = False  # inf and NaN: the mean of the rest
    ref = F.cross_entropy(x[ok].double(), t[ok])
    mean = aotfuse.memory_efficient_fusion(lambda x, t: F.cross_entropy(x, t))(x[ok], t[ok])
    tol = (1e-4, 5e-3) if dtype == torch.float32 else (1e-2, 1e-1)
    assert abs(mean.double() - ref) <= tol[0] + tol[1] * abs(ref), (dtype, mean.item(), ref.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_forward_reads_the_logits_in_two_passes(dtype, monkeypatch):
    """The cross entropy forward is one row kernel with two passes over a row (max and the picks,
    then the sum of exponentials), where the masked sum needed a third; gradients as eager's."""
    x, t = _logits(dtype)
    x = x[10:20].clone().requires_grad_()  # rows without NaN
    t = t[10:20]
    sources = {}
    for on in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_ONE_HOT_PICKS", on)
        m = aotfuse.memory_efficient_fusion(lambda x, t: F.cross_entropy(x, t))
        loss = m(x, t)
        loss.backward()
        sources[on] = m.records[-1].programs["forward"].program.source
        grad, x.grad = x.grad, None
        x.grad = None
        ref_loss = F.cross_entropy(x, t)
        ref_loss.backward()
        tol = (1e-4, 5e-3) if dtype == torch.float32 else (1e-2, 1e-1)
        assert torch.allclose(loss.float(), ref_loss.float(), atol=tol[0], rtol=tol[1]), (on, loss, ref_loss)
        assert torch.allclose(grad.float(), x.grad.float(), atol=tol[0], rtol=tol[1]), on
        x.grad = None
    rows = lambda src: [line for line in src.splitlines() if line.startswith("/* group") and "10 x 300" in line]
    assert len(rows(sources["1"])) == 1 and "2 phases" in rows(sources["1"])[0], rows(sources["1"])
    assert len(rows(sources["0"])) == 1 and "3 phases" in rows(sources["0"])[0], rows(sources["0"])


def _rewritten(f, *args):
    gm = make_fx(f, tracing_mode="fake")(*args)
    n = rewrite_one_hot_picks(gm)
    return n, gm


def test_only_one_hot_masks_are_picked():
    """The rewrite needs a mask with at most one true a row (an eq of an arange over the last dim with
    a per-row value, and-ed with per-row values) and a zero as the other value; anything else stays
    a masked sum. Rewritten or not, the graph computes what it traced."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 10, generator=g)
    t = torch.randint(0, 10, (6,), generator=g).float()
    t[2], t[3], t[4] = -1, 2.5, float("nan")  # no class: these rows sum to 0
    ar = lambda: torch.arange(10, dtype=torch.float32)
    cases = {
        "eq": (lambda x, t: torch.where(ar() == t[:, None], (x - 1) * 3, 0.0).sum(-1), 1),
        "eq and a per-row mask": (lambda x, t: torch.where((ar() == t[:, None]) * (t != t[0])[:, None], x.exp(), 0.0).sum(-1), 1),
        "a mask of many trues": (lambda x, t: torch.where(x > 0, x * 3, 0.0).sum(-1), 0),
        "an arange not over the last dim": (lambda x, t: torch.where(torch.arange(6.0)[:, None] == t[None, :6].T, x, 0.0).sum(-1), 0),
        "another value than 0": (lambda x, t: torch.where(ar() == t[:, None], x, 1.0).sum(-1), 0),
        "a sum over the rows": (lambda x, t: torch.where(ar() == t[:, None], x, 0.0).sum(0), 0),
    }
    for what, (f, expect) in cases.items():
        n, gm = _rewritten(f, x, t)
        assert n == expect, what
        assert torch.equal(gm(x, t), f(x, t)), what


def test_a_chain_reaching_an_integer_leaf_is_left_alone():
    """V's values followed back must end at floating-point leaves (an exact pick); an integer one
    keeps the masked sum."""
    x = torch.randn(4, 8)
    k = torch.randint(0, 5, (4, 8))
    t = torch.tensor([1.0, 7.0, 0.0, 3.0])
    f = lambda x, k, t: torch.where(torch.arange(8.0) == t[:, None], x * k.float(), 0.0).sum(-1)
    gm = make_fx(f, tracing_mode="fake")(x, k, t)
    assert rewrite_one_hot_picks(gm) == 0
    assert torch.equal(gm(x, k, t), f(x, k, t))


def test_masks_compared_where_indices_could_collide_are_left_alone():
    """An arange compared with a bf16 value is compared in bf16 (256 and 257 are one value there), a
    uint8 arange wraps at 256: neither is one-hot, and neither is rewritten (found by a review: the
    rewrite summed several elements' values)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 300, generator=g)
    t = torch.tensor([256, 3, 258, 257])
    cases = [
        lambda x, t: torch.where(torch.arange(300) == t[:, None].bfloat16(), x.exp(), 0.0).sum(-1),
        lambda x, t: torch.where(torch.arange(300, dtype=torch.bfloat16) == t[:, None], x.exp(), 0.0).sum(-1),
        lambda x, t: torch.where(torch.arange(300, dtype=torch.uint8) == t[:, None], x.exp(), 0.0).sum(-1),
    ]
    for k, f in enumerate(cases):
        n, gm = _rewritten(f, x, t)
        assert n == 0, k
        assert torch.equal(gm(x, t), f(x, t)), k
        assert torch.allclose(aotfuse.memory_efficient_fusion(f)(x, t), f(x, t), rtol=1e-6, atol=0), k


def test_a_picked_negative_zero_keeps_its_sign_and_a_sum_over_every_dim_is_no_pick():
    """The pick is a masked max, not a sum with zeros (which made -0.0 +0.0: 1 / x gave inf for
    eager's -inf); sum(dim=None) is not a row sum (it made the capture fail)."""
    x = torch.tensor([[-0.0, 1.0, 2.0], [3.0, -0.0, 5.0]])
    t = torch.tensor([0, 1])
    f = lambda x, t: torch.where(torch.arange(3) == t[:, None], 1.0 / x, 0.0).sum(-1)
    n, gm = _rewritten(f, x, t)
    assert n == 1
    assert torch.equal(gm(x, t), f(x, t)) and torch.equal(gm(x, t), torch.tensor([float("-inf")] * 2))
    assert torch.equal(aotfuse.memory_efficient_fusion(f)(x, t), f(x, t))
    g = lambda x: torch.where(x > 0, x, 0.0).sum(dim=None)
    y = torch.randn(3, 4)
    assert torch.allclose(aotfuse.memory_efficient_fusion(g)(y), g(y))


def test_a_one_hot_gradients_row_sum_is_its_per_row_value():
    """`sum(hit * g, -1)`, hit one-hot and g constant along the row (nll_loss's gradient before the
    log-softmax backward) is g where the row has a hit and 0 where it has none: rewritten to a
    per-row where, the same values for finite g; a g varying along the row, a mask of many trues
    and a sum over the rows stay sums."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 10, (6,), generator=g).float()
    t[2], t[3], t[4] = -1, 2.5, float("nan")  # no class: these rows sum to 0
    scale = torch.tensor(-0.375)
    rows = torch.randn(6, 1, generator=g)
    full = torch.randn(6, 10, generator=g)
    ar = lambda: torch.arange(10, dtype=torch.float32)
    cases = {
        "a scalar g": (lambda t, s, r, f: ((ar() == t[:, None]) * s).sum(-1), 1),
        "a per-row g, kept dims": (lambda t, s, r, f: (r * (ar() == t[:, None])).sum(-1, keepdim=True), 1),
        "a g varying along the row": (lambda t, s, r, f: ((ar() == t[:, None]) * f).sum(-1), 0),
        "a mask of many trues": (lambda t, s, r, f: ((f > 0) * s).sum(-1), 0),
        "a sum over the rows": (lambda t, s, r, f: ((ar() == t[:, None]) * s).sum(0), 0),
    }
    for what, (f, expect) in cases.items():
        gm = make_fx(f, tracing_mode="fake")(t, scale, rows, full)
        assert rewrite_one_hot_picks(gm, scaled_only=True) == expect, what
        assert torch.equal(gm(t, scale, rows, full), f(t, scale, rows, full)), what


@pytest.mark.parametrize("dtype,upcast", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_the_cross_entropy_backward_reads_a_row_once(dtype, upcast):
    """The cross entropy's backward (ignored rows among the targets) is one pass over each row, no
    row sum before it (its first pass had summed the one-hot gradient, which is g or 0 a row; on
    bf16 logits, the sum of its float32 conversion); gradients as eager's and within the seed's
    tolerances of float64's."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(40, 300, generator=g) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, 300, (40,), generator=g)
    t[::6] = -100
    f = (lambda x, t: F.cross_entropy(x.float(), t)) if upcast else (lambda x, t: F.cross_entropy(x, t))
    m = aotfuse.memory_efficient_fusion(f)
    m(x, t).backward()
    got, x.grad = x.grad, None
    groups = [line for line in m.records[-1].programs["backward"].program.source.splitlines()
              if line.startswith("/* group")]
    assert not any("reductions" in line for line in groups), groups
    f(x, t).backward()
    tol = (1e-4, 5e-3) if dtype == torch.float32 else (1e-2, 1e-1)
    torch.testing.assert_close(got, x.grad, atol=tol[0], rtol=tol[1])
    ref = torch.autograd.grad(F.cross_entropy(xd := x.detach().double().requires_grad_(), t), xd)[0]
    assert (got.double() - ref).abs().max() <= tol[0] + tol[1] * ref.abs().max(), (dtype, (got.double() - ref).abs().max())
