"""Shared checks: compiled vs eager with the seed's fp32 tolerances, naming what differs."""
from __future__ import annotations

import copy

import torch

ATOL, RTOL = 1e-4, 5e-3


def assert_close(actual, expected, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: one side is None"
        return
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_batches_train_like_eager(compiled, twin: torch.nn.Module, model: torch.nn.Module, batches, features: int,
                                    seed: int = 3) -> None:
    """For each batch size: a random [batch, features] input through `compiled` (which trains
    `twin`) and `model`; outputs agree, and after the squared sum's backward so does every
    gradient (cleared after each batch)."""
    g = torch.Generator().manual_seed(seed)
    for batch in batches:
        x = torch.randn(batch, features, generator=g)
        out, ref = compiled(x), model(x)
        assert_close(out, ref, f"batch {batch}: output")
        out.square().sum().backward()
        ref.square().sum().backward()
        assert_grads_match(twin, model, f"batch {batch}")


def assert_grads_match(twin: torch.nn.Module, model: torch.nn.Module, what: str) -> None:
    """Every gradient of `twin` (by parameter name) against `model`'s, then both cleared."""
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert_close(p.grad, q.grad, f"{what}: grad of {name}")
        p.grad, q.grad = None, None


def tensors_of(tree):
    from aotfuse._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def check_module(model: torch.nn.Module, *args, steps: int = 1, **kwargs):
    """Runs eager and aotfuse copies of `model` for `steps` SGD steps on the same inputs; compares
    outputs, every parameter's gradient (by name) and the parameters after each step."""
    import aotfuse

    eager = model
    compiled_base = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(compiled_base)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for step in range(steps):
        out_e = eager(*args, **kwargs)
        out_c = compiled(*args, **kwargs)
        assert type(out_c) is type(out_e), f"step {step}: output type {type(out_c)} vs {type(out_e)}"
        te, tc = tensors_of(out_e), tensors_of(out_c)
        assert len(te) == len(tc)
        for i, (a, b) in enumerate(zip(tc, te)):
            assert_close(a, b, f"step {step} output {i}")
        loss_e = sum(t.float().sum() for t in te if t.requires_grad)
        loss_c = sum(t.float().sum() for t in tc if t.requires_grad)
        opt_e.zero_grad()
        opt_c.zero_grad()
        if isinstance(loss_e, torch.Tensor):
            loss_e.backward()
            loss_c.backward()
        pe = dict(eager.named_parameters())
        for name, p in compiled_base.named_parameters():
            assert_close(p.grad, pe[name].grad, f"step {step} grad of {name}")
        opt_e.step()
        opt_c.step()
        for name, p in compiled_base.named_parameters():
            assert_close(p.detach(), pe[name].detach(), f"step {step} parameter {name} after the update")
        be = dict(eager.named_buffers())
        for name, b in compiled_base.named_buffers():
            assert_close(b, be[name], f"step {step} buffer {name}")
    return compiled


def assert_refused_but_runs_like_eager(fn, call, match: str) -> None:
    """A capture aotfuse refuses (CaptureError matching `match`), which fallback="eager" and
    torch.compile(backend="aotfuse") still run with eager's values: call(f) -> tensors to compare
    (the caller's inputs after the call among them)."""
    import pytest

    import aotfuse

    want = call(fn)
    with pytest.raises(aotfuse.CaptureError, match=match):
        call(aotfuse.aot_function(fn))
    with pytest.warns(UserWarning, match="aotfuse"):
        got = call(aotfuse.memory_efficient_fusion(fn, fallback="eager"))
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
    torch._dynamo.reset()
    got = call(torch.compile(fn, backend="aotfuse"))
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
