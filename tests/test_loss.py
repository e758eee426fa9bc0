"""Cross entropy's gradient as one fused kernel: log_softmax and nll_loss's backward decomposed
(decompositions.py), checked against eager and a float64 reference, and the memory it saves."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.bench import _cpu_peak
from aotfuse.decompositions import default_decompositions
from aotfuse.testing import compare_models


class Head(nn.Module):
    """A linear classifier head with cross entropy, as an LM head: [tokens, hidden] -> [tokens, classes]."""

    def __init__(self, hidden=16, classes=40, weight=None, **ce):
        super().__init__()
        self.proj = nn.Linear(hidden, classes)
        self.register_buffer("weight", weight)
        self.ce = ce

    def forward(self, x, y):
        logits = self.proj(x)
        if logits.dtype != torch.float32:
            logits = logits.float()  # as Hugging Face's loss functions do
        weight = None if self.weight is None else self.weight.float()
        return F.cross_entropy(logits, y, weight=weight, **self.ce), logits


def _targets(n=24, classes=40, ignore=-100):
    y = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(3))
    y[::5] = ignore  # some rows ignored
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_eager_and_float64(dtype, reduction):
    torch.manual_seed(0)
    x = torch.randn(24, 16)
    report = compare_models(lambda: Head(reduction=reduction), (x, _targets()), dtype=dtype,
                            name=f"cross entropy ({reduction})")
    report.assert_ok()


@pytest.mark.parametrize("ignore", [7, 0, 39])
def test_an_ignore_index_inside_the_classes_is_masked(ignore):
    torch.manual_seed(0)
    x = torch.randn(24, 16)
    y = _targets(ignore=ignore)
    y[1] = ignore  # ensure the class is both ignored and (elsewhere) absent
    report = compare_models(lambda: Head(ignore_index=ignore), (x, y), name=f"cross entropy (ignore {ignore})")
    report.assert_ok()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [-100, 7])
def test_a_batch_with_every_target_ignored_has_zero_gradients_as_in_eager(ignore, smoothing):
    """All targets ignored (a micro-batch of padding): the mean loss is 0/0 = NaN in eager, and its
    gradients are zeros. The fused backward multiplied its one-hot by -grad/total_weight = inf,
    so every weight became NaN at the next step."""
    torch.manual_seed(0)
    head, x = Head(ignore_index=ignore, label_smoothing=smoothing), torch.randn(24, 16)
    y = torch.full((24,), ignore, dtype=torch.long)
    compiled = aotfuse.memory_efficient_fusion(Head(ignore_index=ignore, label_smoothing=smoothing))
    compiled.load_state_dict(head.state_dict())
    loss_e, loss_c = head(x, y)[0], compiled(x, y)[0]
    assert torch.isnan(loss_e) and torch.isnan(loss_c)
    loss_e.backward()
    loss_c.backward()
    for (name, p), q in zip(head.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, torch.zeros_like(p.grad)), name  # eager's, as documented above
        assert torch.equal(q.grad, p.grad), f"grad of {name}: {q.grad}"


def test_label_smoothing_and_one_dimensional_input():
    torch.manual_seed(0)
    x = torch.randn(24, 16)
    compare_models(lambda: Head(label_smoothing=0.1), (x, _targets()), name="label smoothing").assert_ok()

    class Single(nn.Module):  # one sample: [classes] logits, a 0-d target
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 40)

        def forward(self, x, y):
            return F.cross_entropy(self.proj(x), y)

    compare_models(Single, (torch.randn(16), torch.tensor(11)), name="1-d cross entropy").assert_ok()


def test_class_weights_keep_atens_backward():
    torch.manual_seed(0)
    w = torch.rand(40) + 0.5
    x = torch.randn(24, 16)
    compare_models(lambda: Head(weight=w), (x, _targets()), name="weighted cross entropy").assert_ok()
    e = aotfuse.explain(Head(weight=w), x.requires_grad_(), _targets())
    assert e.extern_ops.get("aten::nll_loss_backward.default") == 1


def _group_ops(program):
    groups: dict[int, list[str]] = {}
    for op, _kind, group in program.node_groups():
        if group >= 0:
            groups.setdefault(group, []).append(op)
    return list(groups.values())


def _explain(**kw):
    return aotfuse.explain(aotfuse.memory_efficient_fusion(Head(), decompositions=default_decompositions(**kw)),
                           torch.randn(24, 16), _targets())


def test_the_loss_is_one_row_kernel_each_way_and_no_aten_loss_op():
    on, off = _explain(), _explain(loss=False)
    gone = ("aten::nll_loss_forward.default", "aten::nll_loss_backward.default",
            "aten::_log_softmax_backward_data.default", "aten::_log_softmax.default")
    for op in gone:
        assert op not in on.extern_ops, (op, on.extern_ops)
        assert op in off.extern_ops, (op, off.extern_ops)
    # one [24, 40] tensor either way (logits instead of log-probabilities); beside it a few numbers a row
    assert abs(on.saved_bytes - off.saved_bytes) < 24 * 40 * 4 // 4, (on.saved, off.saved)
    # the log-probabilities are not saved: the logits are, with a max and a log-sum per row
    assert not any(shape == (24, 40) and name.startswith(("sub", "_log_softmax")) for name, shape, *_ in on.saved), on.saved
    m = aotfuse.memory_efficient_fusion(Head(), decompositions=default_decompositions())
    m(torch.randn(24, 16), _targets())[0].backward()
    record = m._aotfuse_compiled.records[-1]
    fw = _group_ops(record.programs["forward"].program)
    bw = _group_ops(record.programs["backward"].program)
    # forward: max, sum of exp, log and nll's masked row sum in one kernel (plus two 24-element sums)
    (row,) = [ops for ops in fw if "aten::amax.default" in ops]
    assert {"aten::exp.default", "aten::log.default", "aten::where.self"} <= set(row), fw
    # backward: nll's one-hot gradient and log_softmax's epilogue in one pass (the row sum of the
    # one-hot gradient is g or 0 a row: picks.py), which takes the bias gradient's column sum too
    (grad,) = [ops for ops in bw if "aten::exp.default" in ops]
    assert {"aten::eq.Tensor", "aten::sub.Tensor", "aten::sum.dim_IntList"} <= set(grad), bw
    rows = [line for line in record.programs["backward"].program.source.splitlines() if line.startswith("/* group")]
    assert not any("phases" in line for line in rows) and sum("column reductions" in line for line in rows) == 1, rows
    # beside it only the 0-d scale (-grad / total_weight) and the per-row where of that row sum: no
    # constant or fill kernel of its own
    assert len(bw) == 3 and not any(set(ops) <= {"aten::full.default"} for ops in bw), bw


class MaskedLMHead(nn.Module):
    """Bert's MLM head and loss: a Linear over [batch, seq, hidden], the scores flattened for the loss
    and not returned."""

    def __init__(self, hidden=16, classes=40):
        super().__init__()
        self.proj = nn.Linear(hidden, classes)

    def forward(self, x, y):
        scores = self.proj(torch.tanh(x))
        return (F.cross_entropy(scores.view(-1, scores.shape[-1]), y.view(-1)),)


def test_the_loss_gradient_kernel_stores_the_gradient_alone():
    """The logits' gradient is stored for the matmuls whatever the plan, so the bias gradient (a column
    sum of it, which comes first in the graph) reads it: the row kernel stores no second [tokens,
    classes] tensor for the column sum to recompute the gradient from."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 8, 16, requires_grad=True), _targets(24).view(3, 8)
    m = aotfuse.memory_efficient_fusion(MaskedLMHead(), decompositions=default_decompositions())
    m(x, y)[0].backward()
    bw = m._aotfuse_compiled.records[-1].programs["backward"].program
    # one kernel makes the gradient, stores it (for the matmuls) and sums its columns (the bias
    # gradient): the loss gradient has no row sum left to keep it a row kernel (picks.py)
    grads = [ops for ops in _group_ops(bw) if "aten::exp.default" in ops]
    assert len(grads) == 1, _group_ops(bw)
    columns = [line for line in bw.source.splitlines() if line.startswith("/* group") and "column reductions" in line]
    assert len(columns) == 1 and " 2 outputs, 40 columns x 24 rows" in columns[0], columns
    # intermediates a step: the [24, 40] float gradient, the tanh gradient's [3, 8, 16] and a few
    # numbers a row; not a second [24, 40] tensor
    assert bw.fresh_bytes + bw.reused_bytes < 2 * 24 * 40 * 4, (bw.fresh_bytes, bw.reused_bytes)
    compare_models(MaskedLMHead, (x.detach(), y), name="masked LM head").assert_ok()


def test_the_fused_loss_gradient_lowers_the_peak_by_a_class_sized_tensor():
    torch.manual_seed(0)
    tokens, classes = 256, 4096
    base = Head(hidden=8, classes=classes)
    x = torch.randn(tokens, 8)
    y = torch.randint(0, classes, (tokens,))
    peaks = {}
    for name, kw in (("on", {}), ("off", dict(loss=False))):
        m = aotfuse.memory_efficient_fusion(base, decompositions=default_decompositions(**kw))

        def step():
            loss = m(x, y)[0]
            loss.backward()
            base.zero_grad(set_to_none=True)

        step()  # compiles
        peaks[name] = _cpu_peak(step)  # the bench's CPU memory measure
    one = tokens * classes * 4
    # off: saved log-probabilities + nll's zero-filled gradient + log_softmax's gradient at once
    assert peaks["off"] - peaks["on"] >= 0.9 * one, (peaks, one)


class CausalHead(nn.Module):
    """Hugging Face's causal LM loss on [batch, seq, vocab] logits: `logits.float()`, then a reshape."""

    def __init__(self, hidden=16, classes=40):
        super().__init__()
        self.proj = nn.Linear(hidden, classes)

    def forward(self, x, y):
        logits = self.proj(x)
        flat = logits.float().view(-1, logits.shape[-1])
        return F.cross_entropy(flat, y.view(-1), ignore_index=-100), logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_conversion_beside_a_reshape_joins_the_loss_kernels(dtype, monkeypatch):
    # ATen's 16-bit matmul making the logits, the case this test is for (on a CPU without oneDNN's
    # float16 path the float16 head's matmul runs in float32 by default: tests/test_float32_compute.py)
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")
    torch.manual_seed(0)
    x, y = torch.randn(3, 8, 16), _targets(24).view(3, 8)
    compare_models(CausalHead, (x, y), dtype=dtype, name="causal LM loss").assert_ok()

    m = aotfuse.memory_efficient_fusion(CausalHead().to(dtype))
    loss, logits = m(x.to(dtype), y)
    loss.backward()
    record = m._aotfuse_compiled.records[-1]
    fw = _group_ops(record.programs["forward"].program)
    bw = _group_ops(record.programs["backward"].program)
    # forward: the upcast of the logits, log_softmax's phases and nll's masked row sum in one kernel
    (loss_fw,) = [ops for ops in fw if "aten::amax.default" in ops]
    assert "aten::_to_copy.default" in loss_fw and "aten::where.self" in loss_fw, fw
    # backward: the upcast recomputed, and the gradient converted back to the logits' dtype, in the
    # gradient's kernel (no float32 [tokens, vocab] gradient is stored)
    (loss_bw,) = [ops for ops in bw if "aten::exp.default" in ops]
    assert loss_bw.count("aten::_to_copy.default") == 2, bw


class MaskedHead(CausalHead):
    """Bert's masked LM loss: cross entropy straight on the reshaped low-precision logits."""

    def forward(self, x, y):
        logits = self.proj(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)), logits


@pytest.mark.parametrize("head", [CausalHead, MaskedHead])
def test_no_conversion_is_left_alone_in_a_kernel_of_its_own(head, monkeypatch):
    """A reshape is swapped with a conversion only where that stores fewer bytes: the logits exist
    anyway, so their reshape is read by the kernel that upcasts them (never a float32 copy first)."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    torch.manual_seed(0)
    x, y = torch.randn(3, 8, 16), _targets(24).view(3, 8)
    compare_models(head, (x, y), dtype=torch.bfloat16, name=head.__name__).assert_ok()
    m = aotfuse.memory_efficient_fusion(head().to(torch.bfloat16))
    m(x.to(torch.bfloat16), y)[0].backward()
    record = m._aotfuse_compiled.records[-1]
    for stage in ("forward", "backward"):
        groups = _group_ops(record.programs[stage].program)
        assert ["aten::_to_copy.default"] not in groups, (stage, groups)


@pytest.mark.parametrize("bad", [40, 41, -3, 2**30])
def test_a_target_out_of_bounds_is_an_error_as_in_eager(bad):
    """ATen's nll_loss refuses such a target (IndexError on the CPU); the decomposed one must not
    quietly treat it as a row with no class."""
    torch.manual_seed(0)
    m = aotfuse.memory_efficient_fusion(Head())
    x, y = torch.randn(24, 16), _targets()
    m(x, y)[0].backward()  # compiles; in-bounds targets (and ignored rows) pass the check
    y = y.clone()
    y[4] = bad
    with pytest.raises(IndexError):
        Head()(x, y)
    with pytest.raises(RuntimeError, match="out of bounds"):
        m(x, y)


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_stops_at_the_first_minus_one(reduction, how):
    """multilabel_margin_loss's targets end at their first -1 (the padding of rows with fewer labels).
    torch's decomposition, which every trace under the Python dispatcher takes (torch's own
    aot_function and Inductor too, torch 2.13), counted the slots after it as labels of class 0:
    silently wrong losses and gradients (2.05 for eager's 0.85). aotfuse traces its own."""
    import torch._dynamo

    g = torch.Generator().manual_seed(6)
    x0 = torch.randint(-4, 5, (6, 5), generator=g).double() / 4  # ties: margins of exactly 0 too
    target = torch.randint(0, 5, (6, 5), generator=g)
    ends = torch.tensor([0, 1, 2, 4, 5, 3])  # row i's labels end at slot ends[i] (5: no -1)
    target[torch.arange(5) >= ends.unsqueeze(1)] = -1
    target[5, 4] = 2  # a label after the -1: ignored
    target[3, 1] = target[3, 0]  # a repeated label: counted twice, as eager does
    fn = lambda x, t: F.multilabel_margin_loss(x, t, reduction=reduction)  # noqa: E731
    if how == "torch.compile":
        torch._dynamo.reset()
    compiled = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")
    for x_in, t_in in ((x0, target), (x0[2], target[2])):  # a matrix, then one row
        x, xe = (x_in.clone().requires_grad_() for _ in range(2))
        out, ref = compiled(x, t_in), fn(xe, t_in)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        w = torch.arange(1.0, ref.numel() + 1, dtype=torch.float64).reshape(ref.shape)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)
