"""The activation memory budget (AOTFUSE_MEMORY_BUDGET, torch._functorch.config.activation_memory_budget,
or min_cut_rematerialization_partition(memory_budget=...)): below 1 the C min cut may recompute
matmuls and other extern calls, the cheapest first, to save fewer activations; values and gradients
stay eager's."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import aotfuse
from helpers import assert_close


def _bert(dropout: float = 0.0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager").train()


def _activation_bytes(report) -> int:
    return sum(nbytes for name, _, _, nbytes in report.saved if not name.startswith("primals"))


def _extern_recomputed(report) -> list[str]:
    return [n for n in report.recomputed if n.startswith(("mm", "addmm", "bmm", "_scaled", "embedding"))]


def _step(compiled, model, ids):
    torch.manual_seed(3)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def test_a_lower_budget_saves_fewer_activations_and_trains_the_same(monkeypatch):
    """Budgets 1, 0.5, 0: the activations saved fall, matmuls are recomputed, and the step (with
    dropout: its seeds are saved, never drawn again) is the same to rounding."""
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    saved, steps = {}, {}
    for budget in ("1", "0.5", "0"):
        monkeypatch.setenv("AOTFUSE_MEMORY_BUDGET", budget)
        model = _bert(dropout=0.1)
        compiled = aotfuse.memory_efficient_fusion(model)
        report = aotfuse.explain(compiled, input_ids=ids, labels=ids)
        saved[budget] = (_activation_bytes(report), len(_extern_recomputed(report)))
        steps[budget] = _step(compiled, model, ids)
    assert saved["1"][1] == 0, saved
    assert saved["0"][0] < saved["0.5"][0] < saved["1"][0], saved
    assert saved["0"][1] > saved["0.5"][1] > 0, saved
    for budget in ("0.5", "0"):
        assert_close(steps[budget][0], steps["1"][0], f"budget {budget}: loss")
        for name, g in steps["1"][1].items():
            assert_close(steps[budget][1][name], g, f"budget {budget}: gradient of {name}")


def test_budget_zero_matches_eager_and_float64(monkeypatch):
    """Budget 0, no dropout: aotfuse.testing.compare_models against eager and float64."""
    from aotfuse.testing import compare_models

    monkeypatch.setenv("AOTFUSE_MEMORY_BUDGET", "0")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    compare_models(_bert, lambda: dict(input_ids=ids, labels=ids.clone())).assert_ok()


def test_torchs_activation_memory_budget_and_the_partition_option(monkeypatch):
    """torch's config (what torch.compile reads) and the partition function's option say the same as
    the environment variable; the option wins over both."""
    import torch._functorch.config as functorch_config

    monkeypatch.delenv("AOTFUSE_MEMORY_BUDGET", raising=False)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))

    def activations(**overrides):
        return _activation_bytes(aotfuse.explain(aotfuse.memory_efficient_fusion(_bert(), **overrides),
                                                 input_ids=ids, labels=ids))

    full = activations()
    with functorch_config.patch(activation_memory_budget=0.0):
        low = activations()
        # the partition function's own option wins (a partial of it keeps parameters free to save)
        kept = activations(partition_fn=functools.partial(aotfuse.min_cut_rematerialization_partition,
                                                          memory_budget=1.0))
    monkeypatch.setenv("AOTFUSE_MEMORY_BUDGET", "0")
    assert activations() == low < full == kept


def test_a_bad_budget_is_said_before_tracing(monkeypatch):
    monkeypatch.setenv("AOTFUSE_MEMORY_BUDGET", "2")
    compiled = aotfuse.memory_efficient_fusion(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compiled(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        aotfuse.min_cut_rematerialization_partition(None, None, num_fwd_outputs=1, memory_budget=-1)


def test_a_buffer_update_is_never_recomputed(monkeypatch):
    """Budget 0 with batch norm in training: the running statistics' update (a mutation) happens
    once a step, as in eager."""
    monkeypatch.setenv("AOTFUSE_MEMORY_BUDGET", "0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 1))
    twin = __import__("copy").deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(twin)
    for _ in range(3):
        x = torch.randn(6, 8)
        out, ref = compiled(x), model(x)
        assert_close(out, ref, "output")
        out.sum().backward()
        ref.sum().backward()
        for (name, p), q in zip(twin.named_parameters(), model.parameters()):
            assert_close(p.grad, q.grad, f"gradient of {name}")
    assert_close(twin[1].running_mean, model[1].running_mean, "running mean")
    assert_close(twin[1].running_var, model[1].running_var, "running var")
    assert twin[1].num_batches_tracked == model[1].num_batches_tracked == 3


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while `fn` runs (the compiled programs'
    saved activations and parameters), through saved_tensors_hooks."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(sizes)


def test_torch_compile_options_set_the_budget(monkeypatch):
    """torch.compile(model, backend="aotfuse", options={"memory_budget": 0}) saves less than the default
    and trains the same; an unknown option (Inductor's, say) is an error naming the known ones, not
    silently dropped; a mode aotfuse has none of warns once and compiles as the default."""
    monkeypatch.delenv("AOTFUSE_MEMORY_BUDGET", raising=False)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    saved, grads = {}, {}
    for options in (None, {"memory_budget": 0.0}):
        torch._dynamo.reset()
        model = _bert()
        compiled = torch.compile(model, backend="aotfuse", options=options)
        out, saved[bool(options)] = _saved_bytes(lambda: compiled(input_ids=ids, labels=ids))
        out.loss.backward()
        grads[bool(options)] = {n: p.grad for n, p in model.named_parameters()}
    assert saved[True] < saved[False], saved
    for name, g in grads[False].items():
        assert_close(grads[True][name], g, f"budget 0 under torch.compile: grad of {name}")

    x = torch.randn(2, 4)
    torch._dynamo.reset()
    bad = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.GELU()), backend="aotfuse",
                        options={"triton.cudagraphs": True})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['triton.cudagraphs'\].*'memory_budget'"):
        bad(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"memory_budget'\] must be a number in \[0, 1\]"):
        torch.compile(nn.Linear(4, 4), backend="aotfuse", options={"memory_budget": 2})(x)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.warns(UserWarning, match="mode='max-autotune' has no meaning for the aotfuse backend"):
        out = torch.compile(model, backend="aotfuse", mode="max-autotune")(x)
    assert_close(out, model(x), "mode='max-autotune' output")
