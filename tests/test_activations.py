"""Activations and losses that ATen runs as one kernel each (ELU, SELU, CELU, softplus, Mish, log-sigmoid,
hardswish, hardsigmoid, leaky ReLU, the shrinks, GLU, softsign, binary cross entropy with and without
logits, smooth L1, Huber, KL divergence, Poisson NLL) are decomposed where kernels are generated
(decompositions._ACTIVATIONS), so that they fuse with the pointwise work around them: no ATen call of
theirs is left in either program, and their values and gradients are eager's to rounding, as near a
float64 reference as eager's own, with NaN where eager has NaN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aotfuse


# Offsets a bf16 holds exactly, so that the CUDA rule below cannot matter: ATen's CPU kernels round a
# Python scalar added to a bf16 tensor to bf16 first (`a + 0.1` adds 0.10009765625), as aotfuse's C
# kernels do since 2026-12-06, where CUDA's add it in float (found by tests/test_cuda_emulated.py's
# activation test, whose float outputs compare to 1e-5).
def _target(x):
    return torch.sigmoid(x.detach() * 0.7 + 0.25)


CASES = {
    "elu": lambda x: F.elu(x, alpha=0.7),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=1.3),
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "mish": F.mish,
    "logsigmoid": F.logsigmoid,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.05),
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, 0.4),
    "glu": lambda x: F.glu(x, -1),
    "softsign": F.softsign,
    "bce": lambda x: F.binary_cross_entropy(torch.sigmoid(x), _target(x), reduction="none"),
    "bce_weighted": lambda x: F.binary_cross_entropy(torch.sigmoid(x), _target(x), weight=_target(x[:1]), reduction="none"),
    "bce_logits": lambda x: F.binary_cross_entropy_with_logits(x, _target(x), pos_weight=torch.linspace(0.5, 2.0, x.shape[-1], dtype=x.dtype),
                                                             reduction="none"),
    "smooth_l1": lambda x: F.smooth_l1_loss(x, x.detach() * 0.5 + 0.125, beta=0.5, reduction="none"),
    "huber": lambda x: F.huber_loss(x, x.detach() * 0.5 + 0.125, delta=0.7, reduction="none"),
    "kl_div": lambda x: F.kl_div(F.log_softmax(x, -1), F.softmax(x.detach() * 0.5, -1), reduction="none"),
    "poisson_nll": lambda x: F.poisson_nll_loss(x, x.detach().abs() * 2.0, reduction="none"),
}
# ATen ops the decompositions replace: none of them may be left
REPLACED = ("elu", "celu", "softplus", "mish", "log_sigmoid", "hardswish", "hardsigmoid", "leaky_relu", "shrink",
            "glu.default", "sgn", "binary_cross_entropy", "smooth_l1", "huber", "xlogy")


class _Model(torch.nn.Module):
    def __init__(self, fn, features: int):
        super().__init__()
        self.lin = torch.nn.Linear(features, features)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x) * 2.0) * 1.5 + x[..., : 1]


def _run(model, x, cot):
    out = model(x)
    out.backward(cot)
    return out.detach(), x.grad, model.lin.weight.grad, model.lin.bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_activation_fuses_and_matches_eager_and_float64(name, dtype):
    g = torch.Generator().manual_seed(5)
    features = 32
    torch.manual_seed(0)
    base = _Model(CASES[name], features)
    x = torch.randn(16, features, generator=g) * 2.0
    x[0, :6] = torch.tensor([0.0, -0.0, 0.3, -0.3, 0.4, 1e-3])  # on and near the functions' thresholds
    out_shape = base(x).shape
    cot = torch.randn(out_shape, generator=g)

    def copy(dt):
        m = _Model(CASES[name], features)
        m.load_state_dict(base.state_dict())
        return m.to(dt)

    compiled_model = copy(dtype)
    compiled = aotfuse.memory_efficient_fusion(compiled_model)
    leaf = lambda dt: x.to(dt).clone().requires_grad_()
    got = _run(compiled, leaf(dtype), cot.to(dtype))
    eager = _run(copy(dtype), leaf(dtype), cot.to(dtype))
    ref = _run(copy(torch.float64), leaf(torch.float64), cot.double())
    eps = torch.finfo(dtype).eps
    for what, a, e, r in zip(("output", "input grad", "weight grad", "bias grad"), got, eager, ref):
        assert a.dtype == dtype and a.shape == e.shape, what
        a, e = a.double(), e.double()
        assert torch.equal(a.isnan(), e.isnan()), f"{name} {dtype} {what}: NaN where eager has none or the reverse"
        keep = ~e.isnan()
        # as near float64 as eager, to a few roundings of the tensor's largest values (its terms
        # cancel: 1.5 f(y) + x)
        bound = (e - r).abs() + 8 * eps * r.abs().max()
        bad = ((a - r).abs() > bound) & keep
        assert not bad.any(), (f"{name} {dtype} {what}: {int(bad.sum())} values off float64 more than eager's; "
                               f"first at {bad.nonzero()[0].tolist()}: got {a[bad][0].item()!r}, eager {e[bad][0].item()!r}, "
                               f"float64 {r[bad][0].item()!r}")
    ex = aotfuse.explain(compiled, leaf(dtype))
    program_ops = set(ex.extern_ops)
    bw = compiled._aotfuse_compiled.records[-1].programs
    for stage, low in bw.items():
        program_ops |= {op for op, kind, grp in low.program.node_groups() if grp < 0}
    left = {op for op in program_ops if any(r in op for r in REPLACED)}
    assert not left, f"{name}: ATen calls left: {left}"
    assert ex.fused_kernels >= 1


def test_nan_and_infinities_pass_as_in_eager():
    """NaN in, NaN out, and infinities, as eager's kernels give them, for every function (forward).
    Where eager refuses the NaN (binary cross entropy checks its input lies in [0, 1], a data-dependent
    check no traced graph makes), the fused loss is NaN there, as torch.compile's, and eager's value
    elsewhere."""
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 100.0, -100.0, 0.3]] * 2)
    for name, fn in CASES.items():
        f = lambda x: fn(x * 1.0)
        got = aotfuse.memory_efficient_fusion(f)(x)
        try:
            want = f(x)
        except RuntimeError as e:
            assert name.startswith("bce") and "between 0 and 1" in str(e), (name, e)
            assert got[:, 0].isnan().all(), (name, got)
            got, want = got[:, 1:], f(x[:, 1:])
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("env", ["AOTFUSE_FUSION", "AOTFUSE_DECOMPOSE_ACTIVATIONS"])
def test_without_fusion_or_switched_off_they_stay_aten_calls(env, monkeypatch):
    """Where no kernels are generated (AOTFUSE_FUSION=0), decomposing would only make more ATen calls:
    the functions stay whole, as with AOTFUSE_DECOMPOSE_ACTIVATIONS=0 (an A/B), and still train like
    eager."""
    from aotfuse.decompositions import default_decompositions

    aten = torch.ops.aten
    monkeypatch.setenv(env, "0")
    table = default_decompositions()
    assert aten.elu.default not in table and aten.softplus.default not in table and aten.log_sigmoid_backward.default not in table
    torch.manual_seed(0)
    model = _Model(CASES["mish"], 16)
    x = torch.randn(4, 16, requires_grad=True)
    compiled = aotfuse.memory_efficient_fusion(model)
    out = compiled(x)
    assert "aten::mish.default" in aotfuse.explain(compiled, x).extern_ops
    twin = _Model(CASES["mish"], 16)
    twin.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, twin(x))
    monkeypatch.delenv(env)
    table = default_decompositions()
    assert aten.elu.default in table and aten.log_sigmoid_backward.default in table
