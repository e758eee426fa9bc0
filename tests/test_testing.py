"""aotfuse.testing itself: a correct compiled model passes, and deliberately wrong "compiled" models
are caught, with the parameter or output named. A check that cannot fail would be a defect."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse.testing as T
from aotfuse.testing import compare_models


class Net(nn.Module):
    """A small MLP with a LayerNorm and a softmax; returns a dict like a ModelOutput."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)
        self.ln = nn.LayerNorm(16)

    def forward(self, x, labels=None):
        logits = self.fc2(self.ln(F.gelu(self.fc1(x))))
        out = {"logits": logits, "probs": logits.softmax(-1)}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def make_net():
    torch.manual_seed(0)
    return Net()


def make_inputs():
    gen = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(6, 8, generator=gen), labels=torch.randint(0, 5, (6,), generator=gen))


class Wrapper(nn.Module):
    """A "compiled" model that runs the original and then does something to its result."""

    def __init__(self, model, after):
        super().__init__()
        self.model, self.after = model, after

    def forward(self, *args, **kwargs):
        return self.after(self.model(*args, **kwargs))


def perturb_grad(name, factor):
    """A compile_fn whose model computes everything right except one parameter's gradient."""

    def compile_fn(model):
        dict(model.named_parameters())[name].register_hook(lambda g: g * factor)
        return model

    return compile_fn


def failed_whats(report, step=None):
    return [m.what for m in report.mismatches if step is None or m.step == step]


# -- a correct model passes --

def test_aotfuse_passes_and_compares_everything():
    report = compare_models(make_net, make_inputs, steps=3)
    report.assert_ok()
    assert report.ok and not report.mismatches
    # per step: 3 outputs, 6 gradients, 6 parameters after the update
    assert report.checked == 3 * (3 + 6 + 6)
    assert 0 < report.worst_fp64 <= 1
    assert "Net float32, 3 steps" in str(report) and "0 mismatches" in str(report)


def test_identity_compile_fn_is_exact():
    report = compare_models(make_net, make_inputs, compile_fn=lambda m: m, dtype=torch.bfloat16)
    report.assert_ok()


def test_torch_compile_backend_as_compile_fn():
    report = compare_models(make_net, make_inputs, steps=2,
                            compile_fn=lambda m: torch.compile(m, backend="aotfuse", dynamic=False))
    report.assert_ok()


# -- wrong models are caught and named --

def test_small_gradient_error_caught_by_fp64_criterion_only():
    # 0.1% on one gradient passes the seed's fp32 tolerance (rtol 5e-3) but not the fp64 criterion
    report = compare_models(make_net, make_inputs, compile_fn=perturb_grad("fc1.weight", 1.001))
    assert not report.ok
    first = report.mismatches[0]
    assert (first.step, first.what, first.failed) == (0, "grad of fc1.weight", "fp64")
    assert first.model == "Net" and first.dtype == torch.float32
    assert first.aotfuse_err > first.allowed > first.eager_err
    assert failed_whats(report, step=0) == ["grad of fc1.weight"]  # nothing else at step 0
    assert [m.step for m in report.mismatches if m.what == "grad of fc1.weight"] == [0, 1, 2]  # kept going


def test_large_gradient_error_fails_both_criteria_and_assert_ok_names_it():
    report = compare_models(make_net, make_inputs, compile_fn=perturb_grad("ln.bias", 1.1), name="mlp")
    assert report.mismatches[0].what == "grad of ln.bias"
    assert report.mismatches[0].failed == "tolerance, fp64"
    assert report.mismatches[0].max_rel_err == pytest.approx(0.1, rel=1e-3)
    with pytest.raises(AssertionError, match=r"(?s)mlp float32.*grad of ln\.bias.*tolerance, fp64"):
        report.assert_ok()


def test_float64_runs_tell_the_same_program_from_a_slightly_wrong_one():
    """dtype=float64: aotfuse's program in float64 against eager's, to the criterion's 1e-10 of scale;
    a gradient off by one part in a million, below float32's rounding noise (fp32 passes it), fails."""
    report = compare_models(make_net, make_inputs, dtype=torch.float64, name="mlp64")
    report.assert_ok()
    assert report.checked > 20 and 0 < report.worst_fp64 < 0.5 and not report.notes, report
    wrong = perturb_grad("fc1.weight", 1 + 1e-6)
    assert compare_models(make_net, make_inputs, compile_fn=wrong).ok  # within float32's noise
    report = compare_models(make_net, make_inputs, dtype=torch.float64, compile_fn=wrong)
    assert failed_whats(report, step=0) == ["grad of fc1.weight", "fc1.weight after the update"], report
    assert report.mismatches[0].failed == "tolerance, fp64" and report.mismatches[0].dtype == torch.float64


def test_bf16_gradient_error_caught():
    report = compare_models(make_net, make_inputs, dtype=torch.bfloat16, compile_fn=perturb_grad("fc2.bias", 1.25))
    assert "grad of fc2.bias" in failed_whats(report, step=0)
    assert all(m.dtype == torch.bfloat16 for m in report.mismatches)


def test_wrong_output_named_by_key():
    def compile_fn(model):
        return Wrapper(model, lambda out: {**out, "probs": out["probs"] * 1.01})

    report = compare_models(make_net, make_inputs, compile_fn=compile_fn)
    assert failed_whats(report, step=0)[0] == "output probs"
    # the wrong output also flows into the backward: fc2's gradients are wrong too
    assert "grad of fc2.weight" in failed_whats(report, step=0)


def test_missing_gradient_is_a_structure_mismatch():
    def compile_fn(model):
        def run(x, labels=None):
            params = {"fc1.weight": model.fc1.weight.detach()}
            return torch.func.functional_call(model, params, (x,), {"labels": labels})

        return run

    report = compare_models(make_net, make_inputs, compile_fn=compile_fn, steps=1)
    m = next(m for m in report.mismatches if m.what == "grad of fc1.weight")
    assert m.failed == "structure" and "missing in aotfuse" in m.detail


def test_output_type_change_is_caught():
    def compile_fn(model):
        return Wrapper(model, lambda out: tuple(out.values()))

    report = compare_models(make_net, make_inputs, compile_fn=compile_fn, steps=1)
    assert report.mismatches[0].what == "output" and "tuple" in report.mismatches[0].detail
    assert "output logits" in failed_whats(report)  # missing under its name


def test_wrong_dtype_or_shape_is_caught():
    def compile_fn(model):
        return Wrapper(model, lambda out: {**out, "logits": out["logits"].double(), "probs": out["probs"][:3]})

    report = compare_models(make_net, make_inputs, compile_fn=compile_fn, steps=1)
    details = {m.what: m.detail for m in report.mismatches if m.failed == "structure"}
    assert "torch.float64" in details["output logits"]
    assert "(3, 5)" in details["output probs"]


def test_non_finite_only_in_aotfuse_is_caught():
    def compile_fn(model):
        def poison(out):
            logits = out["logits"].clone()
            logits[0, 0] = math.nan
            return {**out, "logits": logits}

        return Wrapper(model, poison)

    report = compare_models(make_net, make_inputs, compile_fn=compile_fn, steps=1)
    m = report.mismatches[0]
    assert (m.what, m.failed) == ("output logits", "non-finite")


def test_tensor_hidden_in_an_object_is_compared():
    class Cache:  # like transformers' DynamicCache: tensors in attributes of plain objects
        def __init__(self, t):
            self.layers = [type("Layer", (), {})()]
            self.layers[0].keys = t

    class WithCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return {"y": y, "cache": Cache(y * 2)}

    def compile_fn(model):
        return Wrapper(model, lambda out: {"y": out["y"], "cache": Cache(out["y"] * 3)})

    report = compare_models(WithCache, lambda: (torch.randn(2, 4),), compile_fn=compile_fn, steps=1)
    assert "output cache.layers[0].keys" in failed_whats(report)
    assert "output y" not in failed_whats(report)


def test_input_gradients_are_compared():
    def compile_fn(model):
        def run(x):
            x.register_hook(lambda g: g * 1.5)
            return model(x)

        return run

    report = compare_models(lambda: nn.Linear(4, 3), lambda: (torch.randn(2, 4, requires_grad=True),),
                            compile_fn=compile_fn, steps=1)
    assert failed_whats(report) == ["grad of input [0]"]


# -- rounding is told from bugs --

class Cancellation(nn.Module):
    """(x * w + 256) - 256: in bfloat16 the sum rounds to a multiple of 2, so eager loses x's digits."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.register_buffer("shift", torch.tensor(256.0))

    def forward(self, x):
        return (x * self.w + self.shift) - self.shift


def test_better_rounding_is_not_a_mismatch():
    """A "compiled" bf16 model that computes in float32 and rounds once: the seed's bf16 tolerance
    fails where bf16 eager is itself that far from float64, but this model is closer to float64
    than eager, so it passes, with notes."""

    def compile_fn(model):
        def run(x):
            return ((x.float() * model.w.float() + model.shift.float()) - model.shift.float()).to(x.dtype)

        return run

    inputs = lambda: (torch.randn(8, 64, generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    report = compare_models(Cancellation, inputs, dtype=torch.bfloat16, compile_fn=compile_fn, steps=1)
    report.assert_ok()
    assert any(n.what == "output" and "seed tolerance exceeded" in n.reason for n in report.notes), report
    # a real error on top is still caught: 5% on the output hides in eager's own noise there (up
    # to 1.0, half an ulp of 256), but it reaches w's gradient, which eager computes accurately
    worse = compare_models(Cancellation, inputs, dtype=torch.bfloat16, steps=1,
                           compile_fn=lambda m: Wrapper(compile_fn(m), lambda y: y * 1.05))
    assert failed_whats(worse) == ["grad of w"]


class Shifted(nn.Module):
    """(x * w + 32) - 32 for x in [4, 5): in bfloat16 the sum rounds to a multiple of 1/4, so eager is
    up to 1/8 off, within the seed's bf16 tolerance of float64 everywhere (values above 2)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.register_buffer("shift", torch.tensor(32.0))

    def forward(self, x):
        return (x * self.w + self.shift) - self.shift


def test_two_roundings_within_tolerance_of_float64_are_not_a_mismatch():
    """A "compiled" model as far from float64 as eager but on the other side of it: the two differ by
    up to twice eager's error, beyond the seed's tolerance of each other, while both are within it of
    float64: noted, not a mismatch (a 2026-12-06 sweep met this in DeiT's and BEiT's bf16 gradients).
    Three times as far is within the fp64 criterion (k = 4) but not the tolerance: still a mismatch."""

    def reflected(times):
        def compile_fn(model):
            def run(x):
                exact = x.float() * model.w.float()
                eager = model(x).float()
                return (exact + times * (exact - eager).detach()).to(x.dtype)

            return run

        return compile_fn

    inputs = lambda: (4 + torch.rand(8, 64, generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    report = compare_models(Shifted, inputs, dtype=torch.bfloat16, compile_fn=reflected(1.0), steps=1)
    report.assert_ok()
    assert any(n.what == "output" and "within it of float64" in n.reason for n in report.notes), report
    worse = compare_models(Shifted, inputs, dtype=torch.bfloat16, compile_fn=reflected(3.0), steps=1)
    assert [(m.what, m.failed) for m in worse.mismatches] == [("output", "tolerance")], worse


def test_non_finite_eager_is_noted_not_failed():
    class Overflow(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((4,), 300.0))

        def forward(self, x):
            return x * self.w * self.w  # 300 * 300 * 1 overflows float16 (max 65504)

    report = compare_models(Overflow, lambda: (torch.ones(3, 4),), dtype=torch.float16, steps=1)
    report.assert_ok()
    assert any(n.what == "output" and "not finite" in n.reason for n in report.notes), report
    assert "note: eager is not finite" in str(report)


# -- the API --

def test_tolerances_table():
    assert T.TOLERANCES == {torch.float32: (1e-4, 5e-3), torch.float16: (1e-2, 1e-1),
                            torch.bfloat16: (1e-2, 1e-1), torch.float64: (1e-9, 1e-7)}


def test_rejects_unknown_dtype_and_non_modules():
    with pytest.raises(ValueError, match="dtype"):
        compare_models(make_net, make_inputs, dtype=torch.int64)
    with pytest.raises(TypeError, match="nn.Module"):
        compare_models(lambda: (lambda x: x), make_inputs)


def test_exceptions_of_the_compiled_model_propagate():
    def compile_fn(model):
        def run(*args, **kwargs):
            raise RuntimeError("core failure")

        return run

    with pytest.raises(RuntimeError, match="core failure"):
        compare_models(make_net, make_inputs, compile_fn=compile_fn)


def test_global_rng_state_is_left_alone():
    before = torch.random.get_rng_state()
    compare_models(make_net, make_inputs, steps=1)
    assert torch.equal(before, torch.random.get_rng_state())


def test_accepts_a_module_and_plain_inputs():
    model = nn.Linear(3, 2)
    report = compare_models(model, torch.randn(4, 3), steps=1)
    report.assert_ok()
    assert report.model == "Linear"


class CenteredBN(nn.Module):
    """A BatchNorm whose running mean is 0, exactly in eager and in float64 (its input is zeros),
    beside a running variance near 1."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.fc(x)
        return self.bn(h * 0.0) + h.tanh()


def _nudge_running_mean(by):
    """A "compiled" model that moves bn.running_mean by `by`, then runs the original (which keeps
    0.9 of that)."""

    def compile_fn(model):
        def run(x):
            with torch.no_grad():
                model.bn.running_mean.add_(by)
            return model(x)

        return run

    return compile_fn


def test_a_running_mean_of_zero_is_judged_at_its_modules_scale():
    """Rounding noise far below the running variance's scale (1e-12 on a running mean that eager
    and float64 give as exactly 0, where the tensor's own scale allows nothing) passes; an error of
    1e-4 is still caught."""
    inputs = lambda: (torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    make = lambda: (torch.manual_seed(0), CenteredBN())[1]  # noqa: E731
    compare_models(make, inputs, steps=2, compile_fn=_nudge_running_mean(1e-12)).assert_ok()
    worse = compare_models(make, inputs, steps=2, compile_fn=_nudge_running_mean(1e-4))
    assert "buffer bn.running_mean after the step" in failed_whats(worse), worse


class NoFloat64(nn.Module):
    """XGLM's clamp: `torch.full((), finfo(scores.dtype).min)` is float32, and float64's min overflows it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.max(y, torch.full((), torch.finfo(y.dtype).min)).tanh().sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_that_cannot_run_in_float64_is_compared_against_eager_alone(dtype):
    """The float64 copy's failure is one note, not an exception and not a note per tensor; the seed's
    tolerances still judge aotfuse against eager, so a wrong gradient still fails."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="overflow"):
        NoFloat64().double()(x.double())
    report = compare_models(NoFloat64, (x,), dtype=dtype, steps=2)
    report.assert_ok()
    assert [n.what for n in report.notes] == ["float64 reference"] and "seed's tolerances only" in str(report)
    assert report.checked == 2 * (1 + 2 + 2)
    wrong = compare_models(NoFloat64, (x,), dtype=dtype, steps=2, compile_fn=perturb_grad("fc.bias", 1.1))
    assert "grad of fc.bias" in failed_whats(wrong, step=0)
    assert all(m.failed == "tolerance" for m in wrong.mismatches)
