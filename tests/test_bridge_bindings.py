"""Extern calls of some ATen overloads go through their torch.<name> Python binding, which parses its
arguments in C++ and is cheaper per call than the overload's boxed callable (bridge.c,
fast_bindings). That is only right where the binding takes the schema's positional arguments in order
and its keyword-only ones by name, reaches the very same overload, and writes out= the same way:
checked here for every entry of the table, on this torch."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aotfuse import _C

aten = torch.ops.aten


def _samples():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    idx = torch.tensor([[0, 2], [1, 1]])
    return {
        "aten::mm.default": [(r(3, 4), r(4, 5)), {}],
        "aten::addmm.default": [(r(5), r(3, 4), r(4, 5)), {"beta": 0.5, "alpha": 2.0}],
        "aten::bmm.default": [(r(2, 3, 4), r(2, 4, 5)), {}],
        "aten::baddbmm.default": [(r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), {"alpha": 0.25}],
        "aten::sum.dim_IntList": [(r(3, 4), [0], True), {"dtype": torch.float64}],
        "aten::mean.dim": [(r(3, 4, 2), [0, 2], False), {}],
        "aten::amax.default": [(r(3, 4), [1], True), {}],
        "aten::_softmax.default": [(r(3, 4, dtype=torch.bfloat16), -1, False), {}],
        "aten::_log_softmax.default": [(r(3, 4), 1, False), {}],
        "aten::_softmax_backward_data.default": [(r(3, 4), r(3, 4).softmax(-1), -1, torch.float32), {}],
        "aten::_log_softmax_backward_data.default": [(r(3, 4), r(3, 4).log_softmax(0), 0, torch.float32), {}],
        "aten::native_layer_norm.default": [(r(2, 3, 4), [4], r(4), r(4), 1e-5), {}],
        "aten::embedding.default": [(r(5, 3), idx, 1), {}],
        "aten::gather.default": [(r(2, 3), 1, idx), {}],
        "aten::index_select.default": [(r(4, 3), 0, torch.tensor([3, 0, 3])), {}],
    }


class _Overloads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _overload(name: str):
    ns, rest = name.split("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def _out_variant(overload):
    """The overload's out= variant as the bridge finds it (resolve_out_variant): the same arguments by
    name and type, then one keyword-only tensor it writes; with that argument's name."""
    names = [(a.name, str(a.type)) for a in overload._schema.arguments]
    packet = overload.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if len(args) == len(names) + 1 and [(a.name, str(a.type)) for a in args[:-1]] == names:
            last = args[-1]
            if last.kwarg_only and last.alias_info is not None and last.alias_info.is_write:
                return cand, last.name
    return None, None


def _equal(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def test_every_binding_has_a_sample():
    assert {e[0] for e in _C.fast_bindings()} == set(_samples())


@pytest.mark.parametrize("op,binding,out", _C.fast_bindings(), ids=[e[0] for e in _C.fast_bindings()])
def test_binding_is_the_overload(op, binding, out):
    args, kwargs = _samples()[op]
    overload = _overload(op)
    # the graph's split: positional arguments first, the keyword-only ones by name
    kwonly = {a.name for a in overload._schema.arguments if a.kwarg_only}
    assert set(kwargs) <= kwonly, (op, kwargs, kwonly)
    fn = getattr(torch._C._VariableFunctions, binding)
    with _Overloads() as mode:
        got = fn(*args, **kwargs)
    assert mode.seen == [overload], f"torch.{binding} reached {mode.seen}, not {op}"
    assert _equal(got, overload(*args, **kwargs)), op
    if not out:  # out= calls use the out= variant's own callable
        return
    variant, written = _out_variant(overload)
    assert variant is not None and written == "out", f"{op}: no out= variant writing `out`"
    ref = variant(*args, **kwargs, out=torch.empty_like(got))
    into = torch.empty_like(got)
    with _Overloads() as mode:
        res = fn(*args, **kwargs, out=into)
    assert res is into, f"torch.{binding}(..., out=) returned another tensor"
    assert mode.seen == [variant], f"torch.{binding}(..., out=) reached {mode.seen}, not {variant}"
    assert _equal(into, ref), f"{op} out="


def test_programs_run_their_externs_through_the_bindings():
    """An mm, a sum with a dtype and a layer norm as extern steps of a program (no fused kernels) give
    ATen's values, plain and with their results written into dead tensors (buffer reuse, out=)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.lower import lower

    def f(a, b, w, c):
        h = torch.mm(a, b)
        s = torch.sum(h, [0], dtype=torch.float64)
        y = aten.native_layer_norm(torch.mm(h, c), [4], w, w, 1e-5)[0]
        return torch.mm(y, c.t()), s

    a, b, w, c = torch.randn(6, 4), torch.randn(4, 4), torch.randn(4), torch.randn(4, 4)
    expected = f(a, b, w, c)
    lowered = lower(make_fx(f)(a, b, w, c))
    for _ in range(3):  # the first run checks; later ones reuse buffers
        got = lowered([a, b, w, c])
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert lowered.program.reuses_taken > 0  # the last mm wrote into the dead one's tensor (out=)
