"""Mixture-of-experts models as one graph (aotfuse/moe.py): transformers' grouped matmul fallback, which a
float32 capture takes, had a backward reading its offsets with `.tolist()`; while aotfuse traces, its
Autograd kernel is one whose backward is two opaque ops. Tiny configs, random weights."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse import moe
from aotfuse.testing import compare_models

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
pytest.importorskip("transformers.integrations.moe")

V = 100
_SIZES = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64)
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_SIZES, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**_SIZES, num_experts=4,
                                                                            num_experts_per_tok=2)),
}


def _inputs():
    ids = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


def test_the_traceable_backward_is_the_grouped_matmuls_gradient_in_float64():
    """gradcheck of moe.traceable_autograd in float64 (the op's loop of mm runs in any dtype): 3 experts,
    the middle one without tokens."""
    op = moe.fallback_op()
    assert op is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 7])
    assert torch.autograd.gradcheck(lambda a, b: moe.traceable_autograd(a, b, offs), (x, w))
    torch.testing.assert_close(moe.traceable_autograd(x, w, offs), op(x, w, offs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_moe_models_are_captured_whole_and_train_like_eager(name, dtype):
    """One graph (compare_models's compiled copy has fallback='error'), eager's values at the seed's
    tolerances and within the float64 criterion: the float64 copy runs its experts as plain loops
    (ATen's grouped matmul has no float64 kernel; before, the reference was dropped with a note).
    float32 runs the fallback op and aotfuse's weight-gradient op as extern calls; bf16 runs ATen's
    grouped matmul, which traced before too. The op's Python kernels are as they were afterwards."""
    op = moe.fallback_op()

    def make():
        torch.manual_seed(0)
        return MODELS[name]().train()

    report = compare_models(make, _inputs, dtype=dtype, steps=2, name=name)
    report.assert_ok()
    assert report.checked > 50 and not report.notes and 0 < report.worst_fp64 <= 1, report
    assert torch._C.DispatchKey.Autograd not in op.py_kernels
    if dtype == torch.float32:
        externs = aotfuse.explain(aotfuse.memory_efficient_fusion(make()), **_inputs()).extern_ops
        # per layer: 2 in the forward (gate-up, down), 2 more in the backward (the inputs' gradients),
        # 2 weight-gradient calls
        assert externs.get("transformers::grouped_mm_fallback.default") == 8, externs
        assert externs.get("aotfuse::grouped_mm_weight_grad.default") == 4, externs


def test_torch_compile_takes_the_same_backward():
    """torch.compile(backend="aotfuse"): Dynamo's graph holds the fallback op, whose capture
    (aot_module_simplified under upstream_fixes) takes the traceable backward too."""
    def make():
        torch.manual_seed(0)
        return MODELS["mixtral"]().train()

    report = compare_models(make, _inputs, steps=2, name="mixtral torch.compile",
                            compile_fn=lambda m: torch.compile(m, backend="aotfuse", dynamic=False))
    report.assert_ok()
    torch._dynamo.reset()


def test_a_float64_copy_whose_experts_setter_fails_is_run_as_it_is(monkeypatch):
    """`_plain_experts` asks transformers to run the float64 copy's experts as loops; a setter that fails
    with any error (here a TypeError) leaves the copy as it is: its grouped matmul has no float64 kernel,
    so the reference is dropped with a note naming it and the run goes on against eager (before, only
    ValueError and RuntimeError were caught, and this error stopped compare_models)."""
    def refuse(self, impl):
        raise TypeError("no such implementation here")

    monkeypatch.setattr(transformers.PreTrainedModel, "set_experts_implementation", refuse)

    def make():
        torch.manual_seed(0)
        return MODELS["mixtral"]().train()

    report = compare_models(make, _inputs, steps=1, name="mixtral, setter failing")
    report.assert_ok()
    assert report.checked >= 40 and report.worst_fp64 == 0, report
    assert [n.what for n in report.notes] == ["float64 reference"], report.notes
