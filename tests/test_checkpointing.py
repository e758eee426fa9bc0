"""Activation checkpointing (torch.utils.checkpoint, transformers' gradient_checkpointing_enable) inside
compiled functions: the regions' nodes are recomputed in the backward, matmuls too, not saved
(checkpoint.py, the C partitioner's node_policy); values and gradients stay eager's."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import aotfuse
import aotfuse.partition as partition_mod
from aotfuse import _C
from helpers import assert_close

aten = torch.ops.aten


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Net(nn.Module):
    """Three residual MLP blocks, each run through torch.utils.checkpoint (or not)."""

    def __init__(self, width: int = 16, ckpt: dict | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(3))
        self.ckpt = ckpt  # checkpoint()'s keyword arguments, or None: no checkpointing

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.ckpt is None else checkpoint(block, h, **self.ckpt)
        return h.square().mean()


def _pair(ckpt: dict | None, width: int = 16):
    torch.manual_seed(0)
    model = _Net(width, ckpt)
    return model, copy.deepcopy(model)


def _step(fn, model, x):
    loss = fn(x)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _assert_same_step(got, want, what: str) -> None:
    assert_close(got[0], want[0], f"{what}: loss")
    for name, g in want[1].items():
        assert_close(got[1][name], g, f"{what}: gradient of {name}")


def _activation_bytes(report) -> int:
    """Bytes saved for the backward other than the inputs (parameters live anyway)."""
    return sum(nbytes for name, _, _, nbytes in report.saved if not name.startswith("primals"))


def _recomputed_matmuls(report) -> list[str]:
    return [n for n in report.recomputed if n.startswith(("mm", "addmm"))]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_are_recomputed_with_their_matmuls_not_saved(reentrant):
    x = torch.randn(8, 16, requires_grad=reentrant)  # a reentrant region needs an input needing grad
    plain = aotfuse.explain(aotfuse.memory_efficient_fusion(_pair(None)[1]), x)
    model, twin = _pair({"use_reentrant": reentrant})
    compiled = aotfuse.memory_efficient_fusion(twin)
    report = aotfuse.explain(compiled, x)
    # each block's first linear runs again in the backward (its output feeds the GELU's gradient); each
    # block's output is saved where the next block, or the loss, reads it; without checkpointing none
    assert len(_recomputed_matmuls(report)) == 3, report.recomputed
    assert not _recomputed_matmuls(plain), plain.recomputed
    # what a block makes inside (the 4x wide activations) is not saved: less than half the activations
    assert _activation_bytes(report) < _activation_bytes(plain) / 2, (report.saved, plain.saved)
    assert all(shape[-1] != 64 for name, shape, _, _ in report.saved if not name.startswith("primals")), report.saved
    _assert_same_step(_step(compiled, twin, x), _step(model, model, x), f"reentrant={reentrant}")
    # and against float64 (eager's fp32 rounding told from a bug)
    ref = copy.deepcopy(model).double()
    loss64, grads64 = _step(ref, ref, x.double())
    loss, grads = _step(compiled, twin, x)
    assert_close(loss.double(), loss64, "loss against float64")
    for name, g in grads64.items():
        assert_close(grads[name].double(), g, f"gradient of {name} against float64")


def test_reentrant_checkpoint_whose_inputs_need_no_grad_gives_no_gradients_as_eager():
    """Eager's reentrant checkpoint does not differentiate a region none of whose inputs needs grad
    (with a warning): its parameters get no gradient. Traced, it means the same."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = _Block(8), nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=True)).sum()

    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(twin)
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="requires_grad"):
        want = _step(model, model, x)
    got = _step(compiled, twin, x)
    assert compiled._aotfuse_compiled.last_entry.fallback is None  # it ran compiled
    assert want[1]["block.fc1.weight"] is None and got[1]["block.fc1.weight"] is None
    assert_close(got[1]["head.weight"], want[1]["head.weight"], "head's gradient")


def test_selective_checkpoint_policy_saves_the_ops_it_names():
    """create_selective_checkpoint_contexts([aten.gelu.default]): each block's GELU output is saved, its
    input recomputed by the first linear again (only the GELU's gradient reads it)."""
    ctx = functools.partial(create_selective_checkpoint_contexts, [aten.gelu.default])
    model, twin = _pair({"use_reentrant": False, "context_fn": ctx})
    compiled = aotfuse.memory_efficient_fusion(twin)
    x = torch.randn(8, 16)
    report = aotfuse.explain(compiled, x)
    wide = [name for name, shape, _, _ in report.saved if not name.startswith("primals") and shape[-1] == 64]
    assert len(wide) == 3, report.saved  # the GELUs' outputs, and nothing else 4x wide
    assert len(_recomputed_matmuls(report)) == 3, report.recomputed  # each fc1
    _assert_same_step(_step(compiled, twin, x), _step(model, model, x), "selective policy")


def test_dropout_in_a_checkpointed_region_draws_the_same_mask_in_the_recompute():
    """aotfuse's dropout masks are a function of a saved seed: a region recomputed in the backward
    draws the masks its forward drew, so the gradients are those of the same step without
    checkpointing (same seeds)."""
    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.fc1, self.fc2, self.ckpt = nn.Linear(16, 64), nn.Linear(64, 16), ckpt

        def block(self, x):
            return self.fc2(nn.functional.dropout(torch.relu(self.fc1(x)), 0.3, self.training))

        def forward(self, x):
            return (checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)).square().sum()

    steps = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        twin = Net(ckpt)
        compiled = aotfuse.memory_efficient_fusion(twin)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        steps.append(_step(compiled, twin, x))
        report = aotfuse.explain(compiled, x)
    assert len(_recomputed_matmuls(report)) == 1, report.recomputed  # fc1 again; the region's output is saved
    _assert_same_step(steps[1], steps[0], "checkpointed against not")


def test_torch_compile_backend_honors_the_regions_dynamo_makes(monkeypatch):
    stats = []
    real = partition_mod._partition

    def recording(*args, **kwargs):
        fw, bw = real(*args, **kwargs)
        stats.append(fw.meta["aotfuse_partition"])
        return fw, bw
    monkeypatch.setattr(partition_mod, "_partition", recording)
    torch._dynamo.reset()
    model, twin = _pair({"use_reentrant": False})
    compiled = torch.compile(twin, backend="aotfuse")
    x = torch.randn(8, 16)
    _assert_same_step(_step(compiled, twin, x), _step(model, model, x), "torch.compile(backend='aotfuse')")
    assert stats, "the aotfuse partitioner did not run"
    recomputed = [n for s in stats for n in s.recomputed if n.startswith(("mm", "addmm"))]
    assert len(recomputed) == 3, [s.recomputed for s in stats]
    torch._dynamo.reset()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_recomputes_each_layer(reentrant, monkeypatch):
    """gradient_checkpointing_enable() on a Bert (eager attention, rewritten as SDPA first: its
    pre-dispatch graph keeps the regions): each layer's linears run again in the backward, the
    gradients eager's."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "1")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    models = []
    for gc in (False, True, True):
        torch.manual_seed(0)
        m = transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager").train()
        if gc:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        models.append(m)
    plain, model, twin = models
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled = aotfuse.memory_efficient_fusion(twin)
    report = aotfuse.explain(compiled, input_ids=ids, labels=ids)
    before = aotfuse.explain(aotfuse.memory_efficient_fusion(plain), input_ids=ids, labels=ids)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in str(report.extern_ops)
    assert len(_recomputed_matmuls(report)) == 12, report.recomputed  # 2 layers x 6 linears
    assert _activation_bytes(report) < _activation_bytes(before) / 2, (report.saved, before.saved)
    got = _step(lambda kw: compiled(**kw).loss, twin, {"input_ids": ids, "labels": ids})
    want = _step(lambda kw: model(**kw).loss, model, {"input_ids": ids, "labels": ids})
    _assert_same_step(got, want, f"Bert, use_reentrant={reentrant}")


def test_partition_node_policy_is_checked():
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.lower import build_graph

    gm = make_fx(lambda x: (x.exp() * 2,))(torch.randn(4))
    build = build_graph(gm, exact=True)
    n = len(build.ir_nodes)
    res = _C.partition(build.graph, bytes([0]), 1, node_policy=bytes([1] * n))
    assert res["saved"] == []
    with pytest.raises(ValueError, match="entries"):
        _C.partition(build.graph, bytes([0]), 1, node_policy=bytes(n + 1))
    with pytest.raises(ValueError, match="recompute"):
        _C.partition(build.graph, bytes([0]), 1, node_policy=bytes([3] * n))


def test_regions_switched_off_are_traced_through(monkeypatch):
    """AOTFUSE_CHECKPOINT_REGIONS=0: the partitioner decides as without checkpointing (before 2026-12-04)."""
    monkeypatch.setenv("AOTFUSE_CHECKPOINT_REGIONS", "0")
    model, twin = _pair({"use_reentrant": False})
    compiled = aotfuse.memory_efficient_fusion(twin)
    x = torch.randn(8, 16)
    report = aotfuse.explain(compiled, x)
    assert not _recomputed_matmuls(report), report.recomputed
    _assert_same_step(_step(compiled, twin, x), _step(model, model, x), "regions off")


@pytest.mark.parametrize("float32_compute", ["0", "1"], ids=["bf16 matmuls", "float32 matmuls"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_checkpointed_bert_trains_like_eager_and_float64(device, float32_compute, monkeypatch):
    """aotfuse.testing.compare_models on a Bert with gradient_checkpointing_enable() (eager attention:
    SDPA on CUDA): three steps in bf16 against eager and a float64 copy, each layer recomputed, its
    matmuls too; also where the CPU's bf16 matmuls run in float32 (AOTFUSE_FLOAT32_COMPUTE, the default
    on CPUs without AVX-512): there the backward's transposes of the float32 copies, rewritten by the
    partitioner's passes without the backward's tag until 2026-12-06, read as forward nodes outside
    the regions, and half the layers' matmuls and their float32 operands were saved."""
    if device == "cuda" and float32_compute == "1":
        pytest.skip("AOTFUSE_FLOAT32_COMPUTE is a CPU switch")
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", float32_compute)
    transformers = pytest.importorskip("transformers")
    from aotfuse.testing import compare_models

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def make():
        m = transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager").to(device).train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    held = []

    def compile_fn(model):
        held.append(aotfuse.memory_efficient_fusion(model))
        return held[-1]

    compare_models(make, lambda: dict(input_ids=ids, labels=ids.clone()), dtype=torch.bfloat16,
                   compile_fn=compile_fn).assert_ok()
    records = held[0]._aotfuse_compiled.records
    assert len([n for r in records for n in r.recomputed if n.startswith(("mm", "addmm"))]) == 12


def test_batch_norm_in_a_checkpointed_region_updates_its_statistics_once():
    """A region with a training batch norm: its running statistics are updated after the forward, so
    the region's norm is saved, not run again (before: autograd's version check failed the backward).
    The statistics move once a step, as without checkpointing and under torch.compile (eager's
    checkpoint moves them again in its recompute)."""
    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
            self.head, self.ckpt = nn.Linear(8, 1), ckpt

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)
            return self.head(h).sum()

    torch.manual_seed(0)
    model = Net(False)
    twin = Net(True)
    twin.load_state_dict(model.state_dict())
    compiled = aotfuse.memory_efficient_fusion(twin)
    x = torch.randn(6, 8, requires_grad=True)
    assert len(_recomputed_matmuls(aotfuse.explain(compiled, x))) >= 1  # a forward: the statistics move
    model(x)
    for step in range(3):
        x = torch.randn(6, 8, requires_grad=True)
        _assert_same_step(_step(compiled, twin, x), _step(model, model, x), f"step {step}")
    assert_close(twin.block[1].running_mean, model.block[1].running_mean, "running mean")
    assert_close(twin.block[1].running_var, model.block[1].running_var, "running var")
    assert int(twin.block[1].num_batches_tracked) == int(model.block[1].num_batches_tracked) == 4


def test_residual_stream_between_regions_is_saved_at_each_region():
    """x = x + checkpoint(block, x): the residual add is outside the regions. Each region's output is
    saved where the stream leaves it, so the backward recomputes one block at a time (before: nothing
    was saved and every block recomputed from the input, peak memory above that without checkpointing)."""
    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4))
            self.ckpt = ckpt

        def forward(self, x):
            for b in self.blocks:
                x = x + (checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x))
            return x.square().mean()

    x = torch.randn(32, 16)
    reports = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = Net(ckpt)
        twin = copy.deepcopy(model)
        compiled = aotfuse.memory_efficient_fusion(twin)
        reports[ckpt] = aotfuse.explain(compiled, x)
        _assert_same_step(_step(compiled, twin, x), _step(model, model, x), f"checkpoint={ckpt}")
    saved = _activation_bytes(reports[True])
    assert 0 < saved < _activation_bytes(reports[False]) / 2, (reports[True].saved, reports[False].saved)
    # one [32, 16] tensor a block where the stream leaves it; every first linear run again
    assert saved <= 4 * 32 * 16 * 4 + 64, reports[True].saved
    assert len(_recomputed_matmuls(reports[True])) == 4, reports[True].recomputed
