"""Errors: untraceable code, unsupported ops, bad input to programs and graphs. Never a crash."""
import warnings

import pytest
import torch

import aotfuse
from aotfuse import _C


def data_dependent(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


def test_untraceable_function_raises_a_clear_error():
    cf = aotfuse.aot_function(data_dependent)
    for _ in range(2):  # each call of the signature explains itself, not only the first
        with pytest.raises(aotfuse.CaptureError) as info:
            cf(torch.randn(4, requires_grad=True))  # (of an input without grad, decisions.py answers it)
        msg = str(info.value)
        assert "data_dependent" in msg and "fallback='dynamo'" in msg and "backend='aotfuse'" in msg

    assert "data-dependent control flow" in msg


def test_a_tensor_read_without_being_an_input_is_named_as_such():
    """A global model a loss function calls, a closed-over tensor, an unregistered tensor attribute:
    the capture meets real tensors among its traced ones. The error says so and how to pass them, where
    it used to blame control flow; fallback='eager' still runs such functions as they are."""
    model = torch.nn.Linear(4, 2)
    w = torch.randn(4, requires_grad=True)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.tensor(2.0)  # neither a parameter nor a buffer

        def forward(self, x):
            return self.lin(x) * self.scale

    x = torch.randn(3, 4)
    for name, fn in (("global model", aotfuse.memory_efficient_fusion(lambda x: model(x).pow(2).mean())),
                     ("closed-over tensor", aotfuse.aot_function(lambda x: (x * w).sum())),
                     ("tensor attribute", aotfuse.memory_efficient_fusion(Scaled()))):
        with pytest.raises(aotfuse.CaptureError, match="reads a tensor that is not one of its inputs") as info:
            fn(x)
        assert "register_buffer" in str(info.value) and "control flow" not in str(info.value), name
    fallback = aotfuse.aot_function(lambda x: (x * w).sum(), fallback="eager")
    with pytest.warns(UserWarning):
        out = fallback(x)
    assert torch.equal(out, (x * w).sum())


class _Recompute(torch.autograd.Function):
    """Reformer's reversible layers' way: the backward runs the layer again, reading its parameters."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = ctx.layer(x)
            y.backward(g)
        return x.grad, None


def test_a_functions_backward_that_runs_a_module_is_named_and_runs_under_dynamo():
    """A custom autograd.Function whose backward runs a module (reversible layers) meets the module's
    real parameters when the joint graph is traced: the error names that case beside the others of
    its kind, and fallback='dynamo' trains it as eager does (a 2026-12-06 sweep: Reformer without an
    attention mask)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            return _Recompute.apply(x, self.ln)

    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(aotfuse.CaptureError, match="autograd.Function whose backward runs a module"):
        aotfuse.memory_efficient_fusion(M())(x).sum().backward()
    torch.manual_seed(0)
    eager, compiled = M(), M()
    compiled.load_state_dict(eager.state_dict())
    _Recompute.apply(x, eager.ln).sum().backward()
    with pytest.warns(UserWarning, match="could not capture"):
        aotfuse.memory_efficient_fusion(compiled, fallback="dynamo")(x).sum().backward()
    torch.testing.assert_close(compiled.ln.weight.grad, eager.ln.weight.grad)
    torch.testing.assert_close(compiled.ln.bias.grad, eager.ln.bias.grad)


def test_a_call_the_signature_refuses_raises_eagers_type_error():
    """A missing, extra or unknown argument raises TypeError, as the eager call would, before anything
    is traced (it was a CaptureError blaming control flow, which `except TypeError` missed); a function
    taking *args/**kwargs (a decorator's wrapper) binds anything and compiles as before."""
    import functools

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(2, 4)
    for call, what in ((lambda: compiled(), "missing a required argument"), (lambda: compiled(x, x), "too many"),
                       (lambda: compiled(x, foo=1), "unexpected keyword argument 'foo'")):
        with pytest.raises(TypeError, match=what):
            call()
    assert torch.allclose(compiled(x), model(x), atol=1e-6)

    def f(a, b):
        return (a * b).sum()

    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        aotfuse.aot_function(f)(x)

    @functools.wraps(f)
    def renaming(*args, **kwargs):  # accepts an old keyword the wrapped signature has not
        if "old_b" in kwargs:
            kwargs["b"] = kwargs.pop("old_b")
        return f(*args, **kwargs)

    assert torch.allclose(aotfuse.aot_function(renaming)(x, old_b=x), f(x, x))


def test_a_partitioner_failure_is_reported_as_aotfuses_bug_not_the_models(monkeypatch):
    import aotfuse.partition

    def broken(*_args):
        raise RuntimeError("reorder broke")

    monkeypatch.setattr(aotfuse.partition, "_reorder", broken)
    cf = aotfuse.aot_function(lambda x: (x.sin() * 2).sum())
    with pytest.raises(aotfuse.CaptureError) as info:
        cf(torch.randn(4, requires_grad=True))
    msg = str(info.value)
    assert "partitioning it failed: an aotfuse bug" in msg and "reorder broke" in msg
    assert "data-dependent" not in msg


class _Memo(torch.nn.Module):
    """Keeps tensors derived from a parameter in a dict in eval mode, as LeViT's attention-bias cache
    does (`self.cache[device] = self.biases[:, idxs]`), and as rotary caches do, a tuple of them."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("idx", torch.randint(0, 8, (8,)), persistent=False)
        self.cache, self.rotary = {}, {}

    def forward(self, x):
        if self.training:
            return x @ self.w[:, self.idx]
        if "b" not in self.cache:
            self.cache["b"] = self.w[:, self.idx]
        if 8 not in self.rotary:
            self.rotary[8] = (self.w.cos(), self.w.sin())
        cos, sin = self.rotary[8]
        return x @ self.cache["b"] + x @ (cos * sin)


@pytest.mark.parametrize("fallback", ["error", "eager", "dynamo"])
def test_a_module_memoizing_tensors_in_python_state_is_captured_and_keeps_no_traced_tensor(fallback):
    """The capture traces the forward more than once; a tensor kept in a dict or list by one pass
    would be a foreign constant to the next (capture failed) and a fake tensor left in the module
    (every later call failed, the fallbacks included). Each pass now gives the module's Python state
    back, so the memoized value is computed in the graph and the module holds only real tensors."""
    torch.manual_seed(0)
    ref, m = _Memo(), _Memo()
    m.load_state_dict(ref.state_dict())
    m.idx.copy_(ref.idx)
    ref.eval(), m.eval()
    x = torch.randn(4, 8)
    compiled = aotfuse.memory_efficient_fusion(m, fallback=fallback)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # captured as one graph: no fallback warning
        for _ in range(2):
            torch.testing.assert_close(compiled(x), ref(x))
    cf = compiled._aotfuse_compiled
    assert cf.compile_count == 1 and all(e.fallback is None for e in cf._cache.values())
    assert m.cache == {} and m.rotary == {}  # nothing the trace kept is left
    torch.testing.assert_close(m(x), ref(x))  # the module itself still runs eagerly
    assert type(m.cache["b"]) is torch.Tensor and type(m.rotary[8][0]) is torch.Tensor


class _Stateful(torch.nn.Module):
    """Keeps state the next call reads (truncated backpropagation through time: `self.prev`) and a
    list the training loop reads: a compiled graph cannot replay either."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.prev, self.log = None, []

    def forward(self, x):
        y = self.lin(x if self.prev is None else x + self.prev)
        self.prev = y.detach()
        self.log.append(y.detach().sum())
        return y


@pytest.mark.parametrize("fallback", ["error", "eager", "dynamo"])
def test_state_the_forward_keeps_fails_the_capture_not_silently(fallback):
    """Python state the forward writes for later (not a memo) is not dropped silently: the capture
    fails, naming it, and the fallbacks run the module with its state, as eager does."""
    torch.manual_seed(0)
    ref, m = _Stateful(), _Stateful()
    m.load_state_dict(ref.state_dict())
    compiled = aotfuse.memory_efficient_fusion(m, fallback=fallback)
    xs = [torch.randn(2, 4) for _ in range(3)]
    if fallback == "error":
        with pytest.raises(aotfuse.CaptureError, match=r"_Stateful\.prev"):
            compiled(xs[0])
        assert m.prev is None and m.log == []  # and the module keeps no traced tensor
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            torch.testing.assert_close(compiled(x), ref(x))
    assert any("could not capture" in str(w.message) and "_Stateful.prev" in str(w.message) for w in caught)
    torch.testing.assert_close(m.prev, ref.prev)
    assert len(m.log) == 3 and all(type(t) is torch.Tensor for t in m.log)
    torch._dynamo.reset()


def test_fallback_eager_warns_once_and_is_right():
    cf = aotfuse.aot_function(data_dependent, fallback="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.ones(3), -torch.ones(3), torch.ones(3)):
            x.requires_grad_()  # (of an input without grad, decisions.py answers the branch)
            torch.testing.assert_close(cf(x), data_dependent(x))
    assert len([w for w in caught if "aotfuse" in str(w.message)]) == 1


def test_fallback_dynamo_splits_the_graph_and_is_right():
    cf = aotfuse.aot_function(data_dependent, fallback="dynamo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.ones(3), -torch.ones(3), torch.ones(3)):  # both branches, guarded by Dynamo
            x = x.requires_grad_()
            out = cf(x)
            torch.testing.assert_close(out, data_dependent(x.detach()))
            out.sum().backward()
            torch.testing.assert_close(x.grad, torch.full((3,), 2.0 if x.sum() > 0 else 1.0))
    assert len([w for w in caught if "aotfuse: could not capture" in str(w.message)]) == 1
    torch._dynamo.reset()


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y - 1


@pytest.mark.parametrize("fallback", ["eager", "dynamo"])
def test_a_modules_fallback_runs_the_module_itself(fallback, monkeypatch):
    """A module that cannot be captured runs as itself (its own tensors, eagerly or under Dynamo),
    not through functional_call, which swaps every tensor in and out on each call."""
    torch.manual_seed(0)
    model, ref = _Branchy(), _Branchy()
    ref.load_state_dict(model.state_dict())
    compiled = aotfuse.memory_efficient_fusion(model, fallback=fallback)
    calls = []
    real = torch.func.functional_call
    monkeypatch.setattr(torch.func, "functional_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sign in (1.0, -1.0, 1.0):
            x = torch.full((3, 4), sign)
            model.zero_grad(), ref.zero_grad()
            out = compiled(x)
            expect = ref(x)
            torch.testing.assert_close(out, expect)
            out.sum().backward(), expect.sum().backward()
            torch.testing.assert_close(model.lin.weight.grad, ref.lin.weight.grad)
            calls_after_capture = len(calls)
    # the capture attempts (attention.py's pre-dispatch trace, then AOTAutograd's), then never again
    assert calls_after_capture <= 2
    assert compiled._aotfuse_compiled.module_fallback is not None  # later calls skip the tensor walk
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in (torch.ones(5, 4), -torch.ones(2, 4)):  # other signatures, in eval mode too
            torch.testing.assert_close(compiled(x), ref(x))
            compiled.eval(), ref.eval()
            torch.testing.assert_close(compiled(x), ref(x))
            compiled.train(), ref.train()
    torch._dynamo.reset()


def test_bad_fallback_value():
    with pytest.raises(ValueError):
        aotfuse.aot_function(lambda x: x, fallback="maybe")


def _graph_1in():
    g = _C.Graph()
    x = g.add_input("x", ("tensor", "float32", "cpu", -1, (2, 3), (3, 1), 0))
    return g, x


def test_graph_repr_and_verify():
    g, x = _graph_1in()
    (y,) = g.add_node("aten::mul.Tensor", [("v", x), ("v", x)], [], [("tensor", "float32", "cpu", -1, (2, 3), (3, 1), 0)])
    g.set_outputs([y])
    g.verify()
    text = repr(g)
    assert "aten::mul.Tensor(%x, %x)" in text and "f32[2, 3]" in text and "pointwise" in text
    prog = _C.Program(g)
    x_val = torch.randn(2, 3)
    (out,) = prog.run([x_val])
    torch.testing.assert_close(out, x_val * x_val)
    with pytest.raises(_C.Error):
        g.verify()  # consumed by the program


@pytest.mark.parametrize("bad", [
    lambda g, x: g.add_node("aten::mul.Tensor", [("v", 99)], [], [("tensor", "float32", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::mul.Tensor", [("v", -1)], [], [("tensor", "float32", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("", [("v", x)], [], [("tensor", "float32", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::neg.default", [("v", x)], [], []),
    lambda g, x: g.add_node("aten::neg.default", [("v", x)], [], [("tensor", "float32", "cpu", -1, (-2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::neg.default", [("v", x)], [], [("tensor", "float99", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::neg.default", [("v", x)], [], [("tensor", "float32", "tpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::neg.default", [("bogus", 1)], [], [("tensor", "float32", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_node("aten::neg.default", [42], [], [("tensor", "float32", "cpu", -1, (2,), (1,), 0)]),
    lambda g, x: g.add_input("y", ("tensor", "float32", "cpu", -1, (1,) * 17, (1,) * 17, 0)),
    lambda g, x: g.set_outputs([5]),
])
def test_malformed_graphs_are_rejected(bad):
    g, x = _graph_1in()
    with pytest.raises((_C.Error, ValueError, TypeError)):
        bad(g, x)
    g.verify()  # still a valid graph
    assert g.num_nodes == 0


def test_unknown_op_fails_when_resolved_not_later():
    g, x = _graph_1in()
    (y,) = g.add_node("aten::no_such_op.default", [("v", x)], [], [("tensor", "float32", "cpu", -1, (2, 3), (3, 1), 0)])
    g.set_outputs([y])
    with pytest.raises(_C.Error, match="no_such_op"):
        _C.Program(g)


def test_program_rejects_wrong_inputs():
    g, x = _graph_1in()
    (y,) = g.add_node("aten::neg.default", [("v", x)], [], [("tensor", "float32", "cpu", -1, (2, 3), (3, 1), 0)])
    g.set_outputs([y])
    prog = _C.Program(g)
    for bad, what in [((torch.randn(3, 2),), "size"), ((torch.randn(2, 3).double(),), "dtype"),
                      ((torch.randn(3, 2).t(),), "stride"), (("nope",), "tensor"), ((), "inputs")]:
        with pytest.raises(_C.Error, match=what):
            prog.run(list(bad))


def test_extern_exception_propagates_with_a_note():
    g, x = _graph_1in()
    # mm of [2,3] x [2,3] fails inside ATen; the error keeps its type and names the step
    (y,) = g.add_node("aten::mm.default", [("v", x), ("v", x)], [], [("tensor", "float32", "cpu", -1, (2, 3), (3, 1), 0)])
    g.set_outputs([y])
    prog = _C.Program(g)
    with pytest.raises(RuntimeError) as info:
        prog.run([torch.randn(2, 3)])
    assert any("aten::mm.default" in n for n in getattr(info.value, "__notes__", []))


def test_bridge_reports_the_shim_functions_it_found():
    info = _C.bridge_info()
    for name in ("aoti_torch_get_sizes", "aoti_torch_get_strides", "aoti_torch_get_dtype",
                 "aoti_torch_delete_tensor_object"):
        assert info[name] is True


def test_a_list_of_inputs_is_handed_over_and_released():
    import weakref

    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.lower import lower

    gm = make_fx(lambda a, b: (a * 2.0).exp() + b.sum())(torch.randn(64, 64), torch.randn(64))
    lowered = lower(gm)
    a, b = torch.randn(64, 64), torch.randn(64)
    expected = (a * 2.0).exp() + b.sum()
    ref_a = weakref.ref(a)
    args = [a, b]
    del a
    (out,) = lowered(args)
    assert args == []  # AOTAutograd's boxed convention: the callee empties the list
    assert ref_a() is None  # the program dropped its reference (no leak)
    torch.testing.assert_close(out, expected)
    # a tuple is only read, never emptied
    t = (torch.ones(64, 64), torch.ones(64))
    (out2,) = lowered.program.run(t)
    assert len(t) == 2 and torch.isfinite(out2).all()


def test_program_profiling_times_every_step():
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotfuse.lower import lower

    gm = make_fx(lambda a, w: torch.mm((a * 2.0).exp(), w).tanh() * 3.0)(torch.randn(32, 32), torch.randn(32, 32))
    lowered = lower(gm)
    p = lowered.program
    assert p.profile()[0] == 0  # off by default
    p.profiling = True
    for _ in range(2):
        lowered([torch.randn(32, 32), torch.randn(32, 32)])
    runs, steps = p.profile()
    assert runs == 2 and len(steps) == p.num_steps
    assert {k for k, *_ in steps} == {"extern", "kernel"}
    assert any(op.startswith("aten::mm") for k, op, _i, _s in steps if k == "extern")
    assert all(sec >= 0 for *_, sec in steps) and sum(sec for *_, sec in steps) > 0
    p.profiling = False
    assert p.profile()[0] == 0


class _Tagged(torch.Tensor):
    """A subclass that only overrides __torch_function__ (what `as_subclass` makes)."""


@pytest.mark.parametrize("kind", ["sparse_csr", "sparse_coo", "nested", "quantized", "subclass"])
def test_inputs_programs_cannot_take_fall_back_or_say_so(kind):
    """A sparse CSR or nested tensor argument: computing the call's signature raised torch's own
    error ('Sparse CSR tensors do not have strides', 'NestedTensorImpl doesn't support sizes'), even
    under fallback='eager'; its second call (the last call's guard) aborted the process in torch's
    C++ tensor check ('Sparse CSR tensors do not have strides', uncaught). A quantized one and a
    `as_subclass` one failed with headlines blaming control flow, the subclass even under
    fallback='eager' (its program's ATen call refused it at run time, as torch's aot_eager does).
    Now the capture says what it cannot take, and fallback='eager' runs the function eagerly, with
    eager's values, on every call."""
    a, b = torch.eye(4), torch.arange(12.0).view(4, 3)
    fn = lambda a, b: (a @ b).sin()  # noqa: E731
    if kind == "sparse_csr":
        args, what = (a.to_sparse_csr(), b), "a sparse_csr tensor"
    elif kind == "sparse_coo":
        args, what = (a.to_sparse(), b), "a sparse_coo tensor"
    elif kind == "quantized":
        fn = lambda a, b: (a.dequantize() @ b).sin()  # noqa: E731
        args, what = (torch.quantize_per_tensor(a, 0.5, 0, torch.qint8), b), "a quantized tensor"
    elif kind == "subclass":
        args, what = (a.as_subclass(_Tagged), b), "a _Tagged, a tensor subclass without __torch_dispatch__"
    else:
        fn, what = (lambda a: (a * 2).sin()), "a nested tensor"
        args = (torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(3, 3)]),)
    expected = fn(*args)
    compiled = aotfuse.aot_function(fn, fallback="eager")
    with pytest.warns(UserWarning, match="could not capture"):
        got = compiled(*args)
    again = compiled(*args)
    for out in (got, again):
        assert type(out) is type(expected)
        for g, e in zip(out.unbind() if kind == "nested" else [out], expected.unbind() if kind == "nested" else [expected]):
            assert torch.equal(g, e)
    with pytest.raises(aotfuse.CaptureError, match=f"an argument is {what}"):
        aotfuse.aot_function(fn)(*args)  # said as what it is, not as a global tensor or control flow


def test_state_kept_in_python_is_named_in_the_headline():
    """Old-style spectral_norm (and weight_norm, pruning) sets a module attribute to a tensor in each
    forward: the CaptureError's cause said so, but its headline blamed data-dependent control flow."""
    model = torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4))
    with pytest.raises(aotfuse.CaptureError) as err:
        aotfuse.memory_efficient_fusion(model)(torch.randn(2, 4))
    headline = str(err.value).splitlines()[0]
    assert "keeps tensors in Python state" in headline and "fallback='dynamo'" in headline, headline
    assert "data-dependent" not in headline, headline


def test_a_compiler_that_writes_a_broken_object_is_a_backend_error(tmp_path, monkeypatch):
    """A compiler whose output is no shared object (a wrapper that writes garbage): the load's error
    now says the C compiler built it, so the capture blames the backend (and AOTFUSE_BACKEND=aten), not
    data-dependent control flow."""
    cc = tmp_path / "garbage-cc"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = "-o" ] && { echo garbage > "$2"; }; shift; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("AOTFUSE_CC", str(cc))
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(aotfuse.CaptureError) as err:
        aotfuse.aot_function(lambda x: (x.sin() * 3.0).exp())(torch.randn(5))
    headline = str(err.value).splitlines()[0]
    assert "cannot be built on this machine" in headline and "AOTFUSE_BACKEND=aten" in headline, headline
    assert "C compiler built" in str(err.value)


@pytest.mark.parametrize("name,value,read", [
    ("AOTFUSE_FUSION", "false", lambda c: c.fusion() is False),
    ("AOTFUSE_FUSION", "OFF", lambda c: c.fusion() is False),
    ("AOTFUSE_FUSION", "", lambda c: c.fusion() is True),  # empty: as unset
    ("AOTFUSE_DISABLE", "no", lambda c: c.disabled() is False),
    ("AOTFUSE_DISABLE", "true", lambda c: c.disabled() is True),
    ("AOTFUSE_FALLBACK_RANDOM", "yes", lambda c: c.fallback_random() is True),
    ("AOTFUSE_DYNAMIC", "off", lambda c: c.dynamic() == "0"),
    ("AOTFUSE_DYNAMIC", "", lambda c: c.dynamic() == "auto"),
    ("AOTFUSE_FUSE_ATTENTION", "force", lambda c: c.fuse_attention() == "1"),
    ("AOTFUSE_CACHE_SIZE", " 3 ", lambda c: c.cache_size() == 3),
    ("AOTFUSE_SHAPE_PROGRAMS", "2", lambda c: c.shape_programs() == 2),
])
def test_switches_take_the_usual_spellings(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    assert read(aotfuse.config)


@pytest.mark.parametrize("name,value,read", [
    ("AOTFUSE_FUSION", "nein", "fusion"), ("AOTFUSE_DISABLE", "2", "disabled"),
    ("AOTFUSE_DYNAMIC", "bogus", "dynamic"), ("AOTFUSE_FUSE_ATTENTION", "maybe", "fuse_attention"),
    ("AOTFUSE_CACHE_SIZE", "abc", "cache_size"), ("AOTFUSE_CACHE_SIZE", "-1", "cache_size"),
    ("AOTFUSE_SHAPE_PROGRAMS", "0", "shape_programs"), ("AOTFUSE_BACKEND", "gpu", "backend"),
])
def test_a_switch_with_a_value_it_cannot_take_is_an_error(monkeypatch, name, value, read):
    """Before 2026-12-04 every value but '' and '0' read as on (AOTFUSE_FUSION=false built kernels,
    AOTFUSE_DISABLE=no turned aotfuse off), and a cache size of 'abc' silently became 8."""
    monkeypatch.setenv(name, value)
    with pytest.raises(aotfuse.config.ConfigError, match=name):
        getattr(aotfuse.config, read)()


def test_a_bad_switch_is_raised_at_the_call_not_hidden_by_a_fallback(monkeypatch):
    monkeypatch.setenv("AOTFUSE_FUSION", "nein")
    with pytest.raises(aotfuse.config.ConfigError, match="AOTFUSE_FUSION must be 1 or 0"):
        aotfuse.aot_function(lambda x: x.sin() * 2, fallback="eager")(torch.randn(4))
