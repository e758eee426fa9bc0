"""Views make no ATen call: a view read only by kernels is folded into them (they read its root at
an offset, with its strides), other views are made by torch's _reinterpret_tensor after their
first run matched the graph's layout. A view whose graph layout is wrong is caught on its first
run and stays ATen's (never a wrong answer)."""
import copy
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse import _C
from aotfuse.lower import build_graph
from helpers import assert_close, assert_refused_but_runs_like_eager

aten = torch.ops.aten
sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/benchmarks")


def _program(fn, *args, plain_outputs=None):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    prog = _C.Program(build_graph(gm).graph, fuse=True)
    if plain_outputs is not None:
        prog.set_plain_outputs(plain_outputs)
    return prog


def _steps(prog):
    return {op.split(".")[0] + f"#{i}": how for i, ((op, _k, _g), how) in enumerate(zip(prog.node_groups(), prog.node_steps()))}


def test_views_read_by_kernels_are_folded_with_offsets_and_strides():
    def f(a, b):
        y = aten.mm.default(a, b)  # an extern's output, viewed several ways by kernels
        p = aten.permute.default(aten.view.default(y, [4, 6, 10]), [2, 0, 1])
        s = aten.slice.Tensor(y, 1, 3, 9)           # offset 3
        r = aten.select.int(y, 0, 5)                # offset 50
        e = aten.expand.default(aten.unsqueeze.default(r, 0), [24, 10])
        return aten.mul.Tensor(aten.exp.default(p), 2.0), aten.add.Tensor(aten.mul.Tensor(s, 3.0), 1.0), \
            aten.sub.Tensor(aten.mul.Tensor(e, y), 1.0)

    a, b = torch.randn(24, 7), torch.randn(7, 10)
    prog = _program(f, a, b)
    for _ in range(2):
        out = prog.run([a, b])
        ref = f(a, b)
        for o, r, name in zip(out, ref, ("permuted", "sliced", "selected+expanded")):
            assert_close(o, r, f"{name} view read by a kernel")
    how = [h for (op, _k, _g), h in zip(prog.node_groups(), prog.node_steps())
           if op.split(".")[0] in ("aten::view", "aten::permute", "aten::slice", "aten::select", "aten::unsqueeze",
                                   "aten::expand")]
    assert how and all(h == "folded" for h in how), _steps(prog)
    assert prog.kernel_fallbacks == 0


def test_views_feeding_aten_are_reinterpreted_after_a_checked_first_run():
    def f(x, w):
        return (aten.mm.default(aten.view.default(x, [12, 8]), aten.t.default(w)) * 1.0,)

    x, w = torch.randn(3, 4, 8), torch.randn(5, 8)
    prog = _program(f, x, w)
    for _ in range(3):
        (out,) = prog.run([x, w])
        assert_close(out, x.reshape(12, 8) @ w.t(), "matmul of reinterpreted views")
    steps = _steps(prog)
    assert steps["aten::view#0"] == "view" and steps["aten::t#1"] == "view", steps


def _wrong_view_graph():
    """mm(t(w), x) where the graph claims t(w) is contiguous (ATen gives strides (1, 6))."""
    g = _C.Graph()
    w = g.add_input("w", ("tensor", "float32", "cpu", -1, (4, 6), (6, 1), 0))
    x = g.add_input("x", ("tensor", "float32", "cpu", -1, (4, 3), (3, 1), 0))
    (t,) = g.add_node("aten::t.default", [("v", w)], [], [("tensor", "float32", "cpu", -1, (6, 4), (4, 1), 0)])
    (m,) = g.add_node("aten::mm.default", [("v", t), ("v", x)], [], [("tensor", "float32", "cpu", -1, (6, 3), (3, 1), 0)])
    g.set_outputs([m])
    return g


def test_a_view_with_a_wrong_graph_layout_stays_aten():
    prog = _C.Program(_wrong_view_graph(), fuse=True)
    w, x = torch.randn(4, 6), torch.randn(4, 3)
    for _ in range(3):
        (out,) = prog.run([w, x])
        assert_close(out, w.t() @ x, "matmul through a view whose graph layout is wrong")
    assert prog.node_steps()[0] == "aten"


def test_an_empty_folded_view_never_fails_its_kernel():
    """A kernel reading an empty view of another kernel's value (Phi3's rotary backward pads
    x[..., 8:8]): the view is read nowhere, so its layout is not checked; ATen's layout for it
    differed from the traced one and the kernel ran as ATen calls on every call."""
    from aotfuse.lower import lower

    def f(a, b, w):
        x = a + b
        y = aten.mm(x.view(-1, 8), w).view(2, 2, 16, 8)
        return aten.constant_pad_nd(aten.slice.Tensor(x, 3, 8, 8), [0, 4], 0.0) + 1.0, y

    args = (torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(8, 8))
    low = lower(make_fx(f)(*args))
    for _ in range(2):
        out = low(list(args))
    for got, want in zip(out, f(*args)):
        assert torch.equal(got, want)
    assert any(op.startswith("aten::constant_pad_nd") and g >= 0 for op, _k, g in low.program.node_groups())
    assert low.program.kernel_fallbacks == 0


def test_output_views_stay_aten_unless_plain():
    def f(x):
        return aten.t.default(aten.mul.Tensor(x, 2.0)), aten.view.default(x, [6, 2])

    x = torch.randn(3, 4)
    prog = _program(f, x)
    assert [h for h in prog.node_steps() if h in ("view", "folded")] == []
    out = prog.run([x])
    assert_close(out[0], (x * 2).t(), "view output")
    plain = _program(f, x, plain_outputs=0)
    assert plain.node_steps().count("view") == 2
    for _ in range(2):
        out = plain.run([x])
        assert_close(out[0], (x * 2).t(), "plain view output")
        assert out[1].data_ptr() == x.data_ptr() and out[1].shape == (6, 2)


def test_view_chains_are_held_after_the_first_run():
    """A linear layer's backward: t(t(grad_w)) and view(view(grad_b)) are the values they view
    (their layout is the root's), t(grad_w) and view(grad_b) only feed those views: from the
    second run none of them is made (the runtime holds the root's tensor), the outputs keep the
    graph's values and layouts."""
    def f(g, x, w):
        g2 = aten.view.default(g, [12, 5])
        gx = aten.mm.default(g2, aten.t.default(aten.t.default(w)))
        gw = aten.mm.default(aten.t.default(g2), aten.view.default(x, [12, 8]))
        gb = aten.sum.dim_IntList(aten.mul.Tensor(g2, 2.0), [0], True)
        return (aten.view.default(gx, [3, 4, 8]), aten.t.default(aten.t.default(gw)),
                aten.view.default(aten.view.default(gb, [1, 5]), [5]), aten.view.default(gb, [5, 1]))

    g, x, w = torch.randn(3, 4, 5), torch.randn(3, 4, 8), torch.randn(5, 8)
    prog = _program(f, g, x, w, plain_outputs=0)
    first = _steps(prog)
    assert "alias" not in first.values(), first
    for run in range(3):
        out = prog.run([g, x, w])
        ref = f(g, x, w)
        for o, r, name in zip(out, ref, ("grad x", "grad w", "grad b", "grad b as a column")):
            assert_close(o, r, f"{name}, run {run}")
            assert o.stride() == r.stride(), (name, o.stride(), r.stride())
        if run == 0:
            steps = _steps(prog)
    held = [k for k, h in steps.items() if h == "alias"]
    # t(w) feeds only a view: held; t(t(w)) feeds mm and has w's layout: held (mm reads w);
    # t(gw) likewise, and the output t(t(gw)) is gw's tensor; view(gb, [1, 5]) has gb's layout;
    # view(., [5]) and view(gb, [5, 1]) are outputs with other layouts: views
    assert sorted(held) == ["aten::t#1", "aten::t#10", "aten::t#11", "aten::t#2", "aten::view#12"], steps
    assert len({id(o) for o in out}) == len(out)


def test_a_view_read_by_an_aten_view_is_not_held():
    """view(x) read by a t whose graph layout is wrong (so the t stays ATen's, reading its input's
    real tensor): the view must be made every run."""
    g = _C.Graph()
    x = g.add_input("x", ("tensor", "float32", "cpu", -1, (2, 2, 6), (12, 6, 1), 0))
    y = g.add_input("y", ("tensor", "float32", "cpu", -1, (4, 3), (3, 1), 0))
    (v,) = g.add_node("aten::view.default", [("v", x), ("list", [("int", 4), ("int", 6)])], [],
                      [("tensor", "float32", "cpu", -1, (4, 6), (6, 1), 0)])
    (t,) = g.add_node("aten::t.default", [("v", v)], [], [("tensor", "float32", "cpu", -1, (6, 4), (4, 1), 0)])
    (m,) = g.add_node("aten::mm.default", [("v", t), ("v", y)], [], [("tensor", "float32", "cpu", -1, (6, 3), (3, 1), 0)])
    g.set_outputs([m])
    prog = _C.Program(g, fuse=True)
    x, y = torch.randn(2, 2, 6), torch.randn(4, 3)
    for run in range(3):
        (out,) = prog.run([x, y])
        assert_close(out, x.reshape(4, 6).t() @ y, f"matmul through a view of a view, run {run}")
    assert prog.node_steps()[:2] == ["view", "aten"], prog.node_steps()


def test_a_made_view_follows_its_base_when_the_base_is_held():
    """view(slice(x)) read by mm: the first run makes the view from the slice (offset 0 from it), later
    runs hold the slice and make the view from x (offset 6 from it). The view's reinterpretation
    arguments are built once and built again when that offset changes: every run gives the values."""
    g = _C.Graph()
    x = g.add_input("x", ("tensor", "float32", "cpu", -1, (4, 6), (6, 1), 0))
    y = g.add_input("y", ("tensor", "float32", "cpu", -1, (4, 2), (2, 1), 0))
    (s,) = g.add_node("aten::slice.Tensor", [("v", x), ("int", 0), ("int", 1), ("int", 3)], [],
                      [("tensor", "float32", "cpu", -1, (2, 6), (6, 1), 6)])
    (v,) = g.add_node("aten::view.default", [("v", s), ("list", [("int", 3), ("int", 4)])], [],
                      [("tensor", "float32", "cpu", -1, (3, 4), (4, 1), 6)])
    (m,) = g.add_node("aten::mm.default", [("v", v), ("v", y)], [], [("tensor", "float32", "cpu", -1, (3, 2), (2, 1), 0)])
    g.set_outputs([m])
    prog = _C.Program(g, fuse=True)
    for run in range(4):
        x, y = torch.randn(4, 6), torch.randn(4, 2)
        (out,) = prog.run([x, y])
        assert_close(out, x[1:3].reshape(3, 4) @ y, f"mm of a view of a slice, run {run}")
    assert prog.node_steps()[:2] == ["alias", "view"], prog.node_steps()


def test_two_outputs_with_one_root_are_two_tensors():
    def f(x):
        y = aten.mul.Tensor(x, 2.0)
        return aten.t.default(aten.t.default(y)), aten.view.default(y, [3, 4]), aten.expand.default(x, [3, 4])

    x = torch.randn(3, 4)
    prog = _program(f, x, plain_outputs=0)
    for _ in range(3):
        out = prog.run([x])
        for o, r in zip(out, f(x)):
            assert_close(o, r, "outputs viewing one value")
        assert len({id(o) for o in out}) == 3 and out[2] is not x


def test_kernels_read_pointers_only_after_a_checked_run_and_only_with_checked_inputs():
    """After one run found a kernel's operands with the graph's layouts, later runs read their data
    pointers only (program inputs are checked each run). With input checks off, every run checks
    the operands: an input with other strides makes the kernel fall back, never a wrong answer."""
    def f(a, b, c):
        return (aten.add.Tensor(aten.mul.Tensor(aten.mm.default(a, b), 2.0), c),)

    a, b, c = torch.randn(6, 5), torch.randn(5, 4), torch.randn(6, 4)
    prog = _program(f, a, b, c)
    for run in range(3):
        a, b, c = torch.randn(6, 5), torch.randn(5, 4), torch.randn(6, 4)
        (out,) = prog.run([a, b, c])
        assert_close(out, (a @ b) * 2 + c, f"kernel over an extern's output, run {run}")
    assert prog.kernel_fallbacks == 0
    with pytest.raises(_C.Error, match="stride"):
        prog.run([a, b, torch.randn(4, 6).t()])
    prog.check_inputs = False
    c_t = torch.randn(4, 6).t()  # [6, 4] with strides (1, 6): not what the kernel was compiled for
    (out,) = prog.run([a, b, c_t])
    assert_close(out, (a @ b) * 2 + c_t, "kernel with an unchecked input of other strides")
    assert prog.kernel_fallbacks == 1


def test_bert_layer_has_2x_fewer_kernels_and_aten_calls_than_eager_ops():
    """Issue 5's count: launched kernels + ATen calls of a Bert layer's forward+backward against
    the top-level ATen ops torch's profiler sees in eager (views without an ATen call are
    reported apart)."""
    pytest.importorskip("transformers")
    from blocks import bert_layer, eager_aten_ops, step_fn

    torch.manual_seed(0)
    model = bert_layer(64)
    x = torch.randn(2, 16, 64, requires_grad=True)
    step = step_fn(model, x)
    step()
    eager_ops = eager_aten_ops(step)
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(model), x)
    ours = report.fused_kernels + sum(report.extern_ops.values())
    print(f"bert layer: eager {eager_ops} ATen ops; aotfuse {report.fused_kernels} kernels + "
          f"{sum(report.extern_ops.values())} ATen calls = {ours} ({eager_ops / ours:.2f}x fewer); "
          f"{sum(report.views.values())} views without an ATen call")
    assert ours * 2 <= eager_ops, (ours, eager_ops, report)


class _NormOverChannels(torch.nn.Module):
    """Batch norm over C of a (B, T, C) activation (transposed in and out), then a view of its result."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, h):
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h).view(-1, 5)


@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
def test_a_view_of_an_aten_result_laid_out_unlike_its_meta(mode):
    """CPU batch norm over a transposed input returns a contiguous tensor where its meta function (what
    the graph was traced with) keeps the input's strides, so the view the graph makes of it failed
    ('view size is not compatible'; torch's aot_eager fails the same). The program now checks the
    bases of its views on the first run and gives such a result the graph's layout by a copy."""
    torch.manual_seed(0)
    model = _NormOverChannels()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    if mode == "eval":
        for m in (model, ref, ref64):
            m.eval()
    compiled = aotfuse.memory_efficient_fusion(model)
    for step in range(2):
        h = torch.randn(3, 6, 8, requires_grad=mode != "no_grad")
        h64 = h.detach().double().requires_grad_(h.requires_grad)
        if mode == "no_grad":
            with torch.no_grad():
                out, expected = compiled(h), ref(h)
            assert_close(out, expected, f"{mode} step {step}: output")
            continue
        out, expected, out64 = compiled(h), ref(h), ref64(h64)
        assert_close(out, expected, f"{mode} step {step}: output")
        for o in (out, expected, out64):
            o.square().mean().backward()
        for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
            assert_close(p.grad, q.grad, f"{mode} step {step}: grad of {name}")
            assert (p.grad.double() - r.grad).abs().max() <= max(4 * (q.grad.double() - r.grad).abs().max(), 1e-6)
            p.grad = q.grad = r.grad = None
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            assert_close(b.float(), c.float(), f"{mode} step {step}: buffer {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entry", ["aot_function", "torch.compile"])
def test_a_saved_aten_result_laid_out_unlike_its_meta_reaches_the_backward(entry, dtype, monkeypatch):
    """log_sigmoid_forward over a transposed input returns its `buffer` (saved for the backward)
    contiguous where its meta function keeps the input's strides, and the backward program's input
    check refused it ('stride 5 in dim 0, the program was compiled for 1'). A program's outputs are
    now checked against their metadata on the first run, and given that layout by a copy where ATen
    made another. (Since 2026-12-06 log-sigmoid is decomposed into kernels by default; here it stays
    ATen's, AOTFUSE_DECOMPOSE_ACTIVATIONS=0, the case this test is about.)"""
    monkeypatch.setenv("AOTFUSE_DECOMPOSE_ACTIVATIONS", "0")
    torch._dynamo.reset()
    base = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=dtype)

    def f(a):
        return torch.nn.functional.logsigmoid(a) * 2

    compiled = aotfuse.aot_function(f) if entry == "aot_function" else torch.compile(f, backend="aotfuse")
    for step in range(2):
        a, a_ref, a64 = ((base.clone() if step else base).t() for _ in range(3))
        a, a_ref = a.detach().requires_grad_(), a_ref.detach().requires_grad_()
        a64 = a64.detach().double().requires_grad_()
        assert a.stride() == (1, 3)
        (g,), (r,), (r64,) = (torch.autograd.grad(fn(x).sum(), x) for fn, x in ((compiled, a), (f, a_ref), (f, a64)))
        assert_close(g, r, f"{entry} {dtype} step {step}: gradient")
        assert (g.double() - r64).abs().max() <= max(2 * (r.double() - r64).abs().max(), 1e-6)


_WINDOWS = {
    "unfold": lambda x: (x * 1.5 - 0.25).unfold(0, 3, 1),
    "unfold-sliced": lambda x: (x * 1.5 - 0.25).unfold(0, 3, 1)[1:],
    "as_strided": lambda x: (x + 1).as_strided((4, 3), (2, 1)),
}


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "aot_function", "torch.compile"])
@pytest.mark.parametrize("name", list(_WINDOWS))
def test_an_output_of_overlapping_windows_over_an_intermediate_has_eagers_gradient(name, how):
    """An output whose elements share memory (an unfold's windows) viewing an intermediate: AOTAutograd
    returns it as its base's view, made again outside the compiled function, and the input's gradient
    through it came out wrong without an error (torch 2.13: its own aot_function, aot_eager and
    Inductor too; 7.0 off on a 5 x 4 input). aotfuse's graph returns the base, and the call makes the
    view of it (compile._BaseView, dynamo._own_overlapping_outputs), so the gradient is eager's and so
    is the aliasing: an in-place add on the output adds twice where two windows share an element, as
    eager's (until 2026-12-05 such an output was a copy, which added once; found by a random aliasing
    sweep). The windows over an input stay a view of it, and a plain view of an intermediate stays a
    view: their gradients were right."""
    f = _WINDOWS[name]
    compiled = {"memory_efficient_fusion": aotfuse.memory_efficient_fusion, "aot_function": aotfuse.aot_function,
                "torch.compile": lambda fn: torch.compile(fn, backend="aotfuse")}[how](
        lambda x: (f(x), x.unfold(0, 2, 1), (x * 2).t()))
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(5, 4, dtype=torch.float64, generator=g)
    ws = [torch.randn(s, dtype=torch.float64, generator=g) for s in (f(x64).shape, (4, 4, 2), (4, 5))]

    def grad(fn, x):
        x = x.clone().requires_grad_()
        outs = fn(x)
        (gx,) = torch.autograd.grad(sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, ws)), x)
        return outs, gx

    ref_outs, ref = grad(lambda x: (f(x), x.unfold(0, 2, 1), (x * 2).t()), x64)
    for dtype in (torch.float64, torch.float32):
        outs, gx = grad(compiled, x64.to(dtype))
        eager_outs, eager = grad(lambda x: (f(x), x.unfold(0, 2, 1), (x * 2).t()), x64.to(dtype))
        for i, (o, e) in enumerate(zip(outs, eager_outs)):
            assert_close(o, e, f"{name} {how} {dtype}: output {i}")
        assert_close(gx, eager, f"{name} {how} {dtype}: input gradient")
        assert (gx.double() - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-6, (name, how, dtype)
    x = torch.randn(5, 4, requires_grad=True)
    outs = compiled(x)
    assert outs[1]._base is x  # the windows over the input still view it
    eager_outs = f(x.detach())
    assert outs[0]._base is not None and outs[0].stride() == eager_outs.stride(), (name, how, outs[0].stride())
    with torch.no_grad():
        outs[0].add_(1.0)
        eager_outs.add_(1.0)
    assert_close(outs[0], eager_outs, f"{name} {how}: the output after an in-place add (windows sharing elements)")


def test_a_mutation_of_an_input_that_overlaps_itself_is_refused_or_run_as_eager():
    """`a[:, 2] = -1.5` on `b.as_strided((3, 4), (2, 1))`: the column's elements are also the next
    rows' first ones. ATen's functional scatter keeps that overlap in a storage of its own, so the
    write shows in every element sharing the memory; aotfuse's kernels computed each element on its
    own, and the caller's b came back with one write of three (found by a random aliasing sweep). The
    capture is refused with the reason (the fallbacks run it: eager's values), and under
    torch.compile the graph runs as Dynamo traced it."""
    def fn(a):
        a[:, 2] = -1.5
        return a + 1

    def call(f):
        b = torch.arange(10.0)
        out = f(b.as_strided((3, 4), (2, 1)))
        return b, out

    assert_refused_but_runs_like_eager(fn, call, "overlaps itself")
    # reading an input that overlaps itself stays compiled
    cf = aotfuse.aot_function(lambda a: a * 2 + 1)
    b = torch.arange(10.0)
    assert torch.equal(cf(b.as_strided((3, 4), (2, 1))), b.as_strided((3, 4), (2, 1)) * 2 + 1)
    assert cf.records and cf.records[-1].programs


def _entry_point(how: str):
    """The compiler of one entry point (aot_function, memory_efficient_fusion or torch.compile with
    aotfuse's backend), with Dynamo's caches reset."""
    torch._dynamo.reset()
    return {"aot_function": aotfuse.aot_function, "memory_efficient_fusion": aotfuse.memory_efficient_fusion,
            "torch.compile": lambda f: torch.compile(f, backend="aotfuse")}[how]


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_an_in_place_add_into_an_empty_view_of_an_input_trains(how):
    """`a0.narrow(0, 3, 0).add_(a2)`: the backward copies an empty slice of a pointwise value, and
    the sink (computing such copies from the value's sources) made it a [3] read of the last row,
    whose [0, 3] reshape then failed (found by a random aliasing sweep). Empty views are not sunk;
    a2 gets eager's zero gradient."""
    def fn(a0, a2):
        a0.narrow(0, 3, 0).add_(a2)
        return a0 * 2

    make = _entry_point(how)
    torch.manual_seed(0)
    a0 = torch.randn(4, 3)
    l2 = torch.randn(3, requires_grad=True)
    out = make(fn)(a0.clone(), l2.clone())
    out.sum().backward()
    assert torch.equal(l2.grad, torch.zeros(3)) and torch.equal(out, a0 * 2)


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_an_updated_input_returned_beside_a_synthetic_base_is_the_callers_tensor(how):
    """`a2.mul_(2); a3.mul_(2); return a2`, with a2 = b1[1:] and a3, a4 two views of one other
    base (which AOTAutograd merges into one synthetic base): as a graph output, the returned a2 came
    back at storage offset 0, b1[:3] where eager returns b1[1:] (AOTAutograd's aliasing of it to
    its input lost the offset; torch's own aot_function gives the same wrong values). An input
    returned as itself is now no graph output: the call returns the caller's tensor, as eager,
    which AOTAutograd has updated. Found by a random aliasing sweep; its form with a relu_ on a
    split of a2 was wrong under aotfuse alone. The gradient through it is eager's."""
    def fn(a2, a3, a4):
        a2.mul_(2)
        a3.mul_(2)
        return (a2, a4 * 3)

    make = _entry_point(how)
    compiled = make(fn)
    for call in range(2):
        runs = []
        for f in (fn, compiled):
            leaf = torch.arange(16.0).view(4, 4).requires_grad_()
            b1 = leaf * 1
            b2 = torch.arange(8.0).view(2, 4)
            a2 = b1[1:]
            out, other = f(a2, b2[0], b2[:, 1:])
            (out * torch.arange(12.0).view(3, 4)).sum().backward()
            runs.append((out, other, b1, b2, leaf.grad, out is a2))
        (e_out, e_other, e_b1, e_b2, e_grad, _), (out, other, b1, b2, grad, same) = runs
        assert same and out.storage_offset() == 4, (how, call, out.storage_offset())
        assert torch.equal(out, e_out) and torch.equal(other, e_other), (how, call, out[0].tolist())
        assert torch.equal(b1, e_b1) and torch.equal(b2, e_b2) and torch.equal(grad, e_grad), (how, call)


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_a_detached_output_beside_a_view_of_its_value_needs_no_gradient(how):
    """`v = -a; return v.expand(2, *v.shape), v.detach()`: the detach came back with
    requires_grad=True (eager: False). The decomposition table made it an `alias` while AOTAutograd
    collected its metadata, a differentiable view; and a returned alias is a view of the forward's
    output, which autograd.Function keeps differentiable. detach is now no decomposition: the traced
    graphs' detaches become aliases where they are no graph output (a chain through one is still one
    kernel), and a returned one stays ATen's detach. Found by a random aliasing sweep."""
    def fn(a):
        v = -a
        return v.expand(2, *v.shape), v.detach()

    make = _entry_point(how)
    compiled = make(fn)
    for call in range(2):
        runs = []
        for f in (fn, compiled):
            leaf = torch.arange(12.0).view(4, 3).requires_grad_()
            e, d = f(leaf * 1)
            assert d._base is None and d.untyped_storage().data_ptr() == e.untyped_storage().data_ptr(), (how, call)
            (e * 2).sum().backward()
            runs.append((e, d, d.requires_grad, leaf.grad))
        assert runs[1][2] is False, (how, call)
        assert all(torch.equal(x, y) for x, y in zip(runs[0][:2] + runs[0][3:], runs[1][:2] + runs[1][3:])), (how, call)

    # a chain through a detach (no graph output) stays one kernel
    cf = aotfuse.aot_function(lambda x: (x.sin().detach() * 2).exp())
    x = torch.randn(8, 4)
    assert_close(cf(x), (x.sin() * 2).exp(), "sin, detach, mul, exp")
    (low,) = cf.records[-1].programs.values()
    assert low.program.num_kernels == 1 and not low.extern_counts(), low.extern_counts()


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("view", ["split", "unbind", "narrow", "overlapping"])
def test_a_view_of_an_input_sharing_its_storage_is_made_from_the_callers_tensor(how, view):
    """`a0.mul_(2); return a1.split(2)[1]` with a0 = b[0], a1 = b.t(): AOTAutograd merges the two
    inputs into one synthetic base and replays the output's view ops on it as if on a1; torch 2.13
    failed an assert where b is a view, and crashed the process (SIGSEGV) where it is not, under its
    own aot_function and torch.compile's aot_eager too. Such an output is now no graph output: the
    call makes it from the caller's a1 at its traced place in the storage. Values, aliasing (an
    in-place add through it reaches b), and the gradients of a leaf b is made from are eager's. Found
    by a random aliasing sweep."""
    take = {"split": lambda t: t.split(2)[1], "unbind": lambda t: t.unbind(0)[1],
            "narrow": lambda t: t.narrow(0, 2, 1),
            # elements shared by its rows: still the input's view (not an intermediate's, which a
            # synthetic base as its _base made it look like in one of AOTAutograd's passes)
            "overlapping": lambda t: t.as_strided((2, 2), (1, 1), 1)}[view]

    def fn(a0, a1, w):
        a0.mul_(w)
        return take(a1), (a1 * w.sum()).sum()

    make = _entry_point(how)
    compiled = make(fn)
    for call in range(2):
        runs = []
        for f in (fn, compiled):
            leaf = (torch.arange(8.0).view(2, 4) + call).requires_grad_()
            lw = torch.tensor([2.0, 3.0, 5.0, 7.0], requires_grad=True)
            b = leaf * 1
            out, s = f(b[0], b.t(), lw * 1)
            assert out.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), (how, view, call)
            ((out * torch.arange(1.0, out.numel() + 1).view(out.shape)).sum() + s).backward(retain_graph=True)
            values = (out.detach().clone(), s.detach(), b.detach().clone(), leaf.grad, lw.grad)
            with torch.no_grad():
                out.add_(100)  # through the output into b
            runs.append(values + (b.detach().clone(),))
        for name, e, c in zip(("output", "sum", "b", "leaf grad", "w grad", "b after out.add_"), *runs):
            assert torch.equal(e, c), (how, view, call, name, e, c)


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_a_view_of_an_input_at_a_storage_offset_sharing_its_storage_keeps_its_place(how):
    """`a1.sin_(); return a1.diagonal(), a1` with a0 = b[0:4], a1 = b[4:8]: the diagonal is made by
    the call from the caller's a1 (compile._InputView) at its place relative to a1, as traced.
    Recorded as an absolute storage offset it read b's first rows (offset 0 where eager's is 16):
    AOTAutograd's last tracing pass held a1 at offset 0. Found by a random aliasing sweep."""
    def fn(a0, a1, s):
        a0[3].fill_(s)
        a1.sin_()
        return a1.diagonal(), a1, (a0 * a1).sum()

    make = _entry_point(how)
    compiled = make(fn)
    for call in range(2):
        runs = []
        for f in (fn, compiled):
            leaf = (torch.arange(32.0).view(8, 4) / 7 + call).double().requires_grad_()
            b = leaf * 1
            d, a1, total = f(b[0:4], b[4:8], torch.tensor(0.5, dtype=torch.float64))
            assert d.storage_offset() == 16 and d.stride() == (5,), (how, call, d.storage_offset(), d.stride())
            ((d * torch.arange(1.0, 5.0, dtype=torch.float64)).sum() + total).backward()
            runs.append((d.detach().clone(), b.detach().clone(), total.detach(), leaf.grad))
        for name, e, c in zip(("diagonal", "b", "sum", "leaf grad"), *runs):
            assert torch.equal(e, c), (how, call, name, e, c)
