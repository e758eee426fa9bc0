"""Batch norm on the CPU as aotfuse's own kernels (decompositions._batch_norm_table): the statistics
one phased row kernel per channel with nested reduced loops (N, then each run of the spatial dims),
the normalization fused with what follows, the backward one phased kernel. Values are checked
against eager and a float64 copy, through training steps, evaluation and the running statistics."""
import copy

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse.decompositions import default_decompositions
from aotfuse.lower import lower

CASES = {
    "2d": (lambda: nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)), (4, 6, 12, 12)),
    "2d-no-affine": (lambda: nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8, affine=False), nn.ReLU()),
                     (4, 6, 9, 7)),
    "1d-sequence": (lambda: nn.Sequential(nn.Conv1d(6, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU()), (4, 6, 40)),
    "1d-features": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU()), (16, 6)),
    "3d": (lambda: nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU()), (2, 3, 4, 6, 6)),
}


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _steps(case, dtype, channels_last, steps=2):
    """Eager, aotfuse and float64 copies of a CASES model, `steps` SGD steps in training and one
    forward and backward in evaluation; yields (what, aotfuse's error, eager's error) against float64
    for outputs, gradients and buffers. Each step starts the eager and float64 copies from the
    aotfuse copy's parameters and buffers, so that every step compares one step's rounding (in
    bf16 the three trajectories part after a step, in either direction)."""
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = make().to(dtype)
    fmt = torch.channels_last if channels_last and len(shape) == 4 else torch.contiguous_format
    model = model.to(memory_format=fmt)
    ref, r64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = aotfuse.memory_efficient_fusion(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, r64)]
    for step in range(steps + 1):
        with torch.no_grad():
            for m in (ref, r64):
                for t, src in zip(list(m.parameters()) + list(m.buffers()), list(model.parameters()) + list(model.buffers())):
                    t.copy_(src)
        if step == steps:  # evaluation: the running statistics normalize
            for m in (model, ref, r64):
                m.eval()
        x = torch.randn(shape).to(dtype).contiguous(memory_format=fmt)
        outs = [f(x if f is not r64 else x.double()) for f in (compiled, ref, r64)]
        w = torch.randn(outs[2].shape, dtype=torch.float64)
        yield f"step {step} output", _rel(outs[0], outs[2].detach()), _rel(outs[1], outs[2].detach())
        for o, opt in zip(outs, opts):
            opt.zero_grad()
            (o.double() * w).sum().backward()
        grads = zip(model.named_parameters(), ref.parameters(), r64.parameters())
        for (name, p), q, p64 in grads:
            i = int(name.split(".")[0])
            if name.endswith("bias") and i + 1 < len(model) and isinstance(model[i + 1], nn.modules.batchnorm._BatchNorm):
                continue  # a bias before a batch norm: its exact gradient is 0, its rounding all there is
            yield f"step {step} grad of {name}", _rel(p.grad, p64.grad), _rel(q.grad, p64.grad)
        for opt in opts:
            opt.step()
        for (name, b), c, b64 in zip(model.named_buffers(), ref.buffers(), r64.buffers()):
            if b.dtype.is_floating_point:
                yield f"step {step} buffer {name}", _rel(b, b64), _rel(c, b64)
            else:
                assert torch.equal(b, c), (step, name)


@pytest.mark.parametrize("case, channels_last", [(c, False) for c in CASES] +
                         [(c, True) for c, (_, shape) in CASES.items() if len(shape) == 4])
def test_batch_norm_trains_like_eager_and_float64(case, channels_last):
    """float32 (decomposed by default), NCHW and channels-last: every output, gradient and running
    statistic within 4x eager's distance from float64, plus 1e-6 (both are rounding)."""
    for what, ours, eager in _steps(case, torch.float32, channels_last):
        assert ours <= 4 * eager + 1e-6, f"{case} float32{' channels_last' if channels_last else ''}: {what}: " \
                                         f"{ours:.3g} from float64 (eager {eager:.3g})"


@pytest.mark.parametrize("case", ["2d", "1d-sequence", "1d-features"])
def test_batch_norm_in_bfloat16_when_asked_trains_like_eager_and_float64(case, monkeypatch):
    """bfloat16 is ATen's by default (config.batch_norm_dtypes); AOTFUSE_DECOMPOSE_BATCH_NORM=1
    decomposes it too: computed in float32, within 2x eager's distance from float64 plus half a
    bf16 ulp."""
    monkeypatch.setenv("AOTFUSE_DECOMPOSE_BATCH_NORM", "1")
    for what, ours, eager in _steps(case, torch.bfloat16, False):
        assert ours <= 2 * eager + 4e-3, f"{case} bfloat16: {what}: {ours:.3g} from float64 (eager {eager:.3g})"


def _forward_backward_graph(dtype):
    """A conv + batch norm + ReLU's joint graph as aotfuse traces it (its decomposition table)."""
    from aotfuse import compile as afc

    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).to(dtype)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    f = afc.aot_module(model, fw_compiler=keep, bw_compiler=keep, decompositions=default_decompositions())
    f(torch.randn(2, 4, 6, 6, dtype=dtype)).sum().backward()
    return "\n".join(str(g.graph) for g in graphs)


@pytest.mark.parametrize("setting, dtype, decomposed", [
    (None, torch.float32, True), ("0", torch.float32, False), (None, torch.bfloat16, False),
    ("1", torch.bfloat16, True), ("auto", torch.float64, False), ("1", torch.float64, False)])
def test_which_batch_norms_are_decomposed(setting, dtype, decomposed, monkeypatch):
    """float32 by default, float16/bfloat16 with AOTFUSE_DECOMPOSE_BATCH_NORM=1, none with 0, never
    float64 (no kernels: it would become many ATen calls)."""
    if setting is None:
        monkeypatch.delenv("AOTFUSE_DECOMPOSE_BATCH_NORM", raising=False)
    else:
        monkeypatch.setenv("AOTFUSE_DECOMPOSE_BATCH_NORM", setting)
    text = _forward_backward_graph(dtype)
    assert ("batch_norm" not in text) == decomposed, text


def test_batch_norm_statistics_run_as_one_phased_kernel_with_nested_loops():
    """The statistics over [N, H x W] of an NCHW tensor: one phased kernel (mean, variance,
    normalize, scale and shift) whose chunks follow each H x W run, offsets unflattened once a chunk
    (`i0 = i1`), not a division and remainder per element; its values match ATen's batch norm."""
    x = torch.randn(4, 8, 10, 10)
    w, b = torch.randn(8), torch.randn(8)
    rm, rv = torch.zeros(8), torch.ones(8)

    def f(x, w, b, rm, rv):
        return torch.ops.aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)

    gm = make_fx(f, decomposition_table=default_decompositions())(x, w, b, rm, rv)
    lowered = lower(gm)
    src = lowered.program.source
    assert lowered.program.num_kernels <= 2 and "phases" in src and "i0 = i1" in src, src
    got, ref = lowered([x, w, b, rm, rv]), f(x, w, b, rm.clone(), rv.clone())
    for name, g, r in zip(("output", "mean", "rstd", "running mean", "running var"), got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)
