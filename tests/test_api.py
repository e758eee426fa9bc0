"""The public API: pytrees in and out, the signature cache, modules, explain, errors."""
import collections
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import aotfuse
from helpers import assert_batches_train_like_eager, assert_close, assert_refused_but_runs_like_eager, tensors_of

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float
    tag: str = "train"


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    total: torch.Tensor
    note: str


def _compare_trees(out, ref, what="output"):
    assert type(out) is type(ref), f"{what}: {type(out)} vs {type(ref)}"
    if isinstance(ref, torch.Tensor):
        assert_close(out, ref, what)
    elif isinstance(ref, dict):
        assert list(out.keys()) == list(ref.keys()), what
        for k in ref:
            _compare_trees(out[k], ref[k], f"{what}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(out) == len(ref), what
        for i, (a, b) in enumerate(zip(out, ref)):
            _compare_trees(a, b, f"{what}[{i}]")
    elif dataclasses.is_dataclass(ref):
        for f in dataclasses.fields(ref):
            _compare_trees(getattr(out, f.name), getattr(ref, f.name), f"{what}.{f.name}")
    else:
        assert out == ref, f"{what}: {out!r} vs {ref!r}"


def _run_both(fn, *args, **kwargs):
    """Calls aotfuse and eager on cloned inputs; compares outputs and input gradients."""
    from aotfuse._pytree import tree_flatten, tree_unflatten

    def clone(tree):
        leaves, spec = tree_flatten(tree)
        return tree_unflatten([x.detach().clone().requires_grad_(x.requires_grad)
                               if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    ref_args, ref_kwargs = clone((args, kwargs))
    cf = aotfuse.aot_function(fn)
    out = cf(*args, **kwargs)
    ref = fn(*ref_args, **ref_kwargs)
    _compare_trees(out, ref)
    loss = sum(t.sum() for t in tensors_of(out) if t.requires_grad)
    ref_loss = sum(t.sum() for t in tensors_of(ref) if t.requires_grad)
    loss.backward()
    ref_loss.backward()
    for i, (a, b) in enumerate(zip(tensors_of((args, kwargs)), tensors_of((ref_args, ref_kwargs)))):
        if b.requires_grad:
            assert_close(a.grad, b.grad, f"grad of input leaf {i}")
    return cf, out


def test_positional_and_keyword_args():
    def f(x, y, *, scale, bias=None):
        return (x * y).sin() * scale + (0 if bias is None else bias)

    _run_both(f, torch.randn(4, requires_grad=True), torch.randn(4), scale=2.0, bias=torch.randn(4, requires_grad=True))


def test_nested_containers_in_and_out():
    def f(inputs, opts):
        a, (b, c) = inputs["pair"]
        out = {"sum": a + b, "list": [a * c, (b - c).exp()], "pair": Pair(a.sin(), b.cos())}
        out["scaled"] = (a * opts["k"],)
        return out

    x = [torch.randn(3, requires_grad=True) for _ in range(3)]
    _run_both(f, {"pair": (x[0], [x[1], x[2]])}, {"k": 3})


def test_dataclass_in_and_out_with_non_tensor_leaves():
    def f(batch: Batch):
        y = batch.x * batch.scale
        return Result(y=y, total=y.sum(), note=batch.tag + "!"), None, 7, "done"

    cf, out = _run_both(f, Batch(x=torch.randn(2, 3, requires_grad=True), scale=0.5))
    assert out[1] is None and out[2] == 7 and out[3] == "done" and out[0].note == "train!"


def test_non_tensor_leaf_values_are_part_of_the_signature():
    cf = aotfuse.aot_function(lambda x, k, mode: x * k if mode == "mul" else x + k)
    x = torch.randn(3)
    assert_close(cf(x, 2.0, "mul"), x * 2.0, "mul 2")
    assert_close(cf(x, 3.0, "mul"), x * 3.0, "mul 3")
    assert_close(cf(x, 3.0, "add"), x + 3.0, "add 3")
    assert cf.compile_count == 3


def test_hf_model_output():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x, labels=None):
            logits = self.fc(x)
            loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
            return SequenceClassifierOutput(loss=loss, logits=logits)

    model = Tiny()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x, labels = torch.randn(4, 6), torch.tensor([0, 2, 1, 0])
    out, ref = compiled(x, labels=labels), model(x, labels=labels)
    assert type(out) is SequenceClassifierOutput
    assert list(out.keys()) == list(ref.keys()) == ["loss", "logits"]
    assert_close(out.loss, ref.loss, "loss")
    assert_close(out[1], ref.logits, "logits by index")
    if out.loss < 0:  # Python around the model still works on real tensors
        raise AssertionError("cross entropy is never negative")
    out.loss.backward()
    ref.loss.backward()
    assert_close(compiled.fc.weight.grad, model.fc.weight.grad, "fc.weight grad")
    no_labels = compiled(x)
    assert no_labels.loss is None and list(no_labels.keys()) == ["logits"]


def test_batch_size_change_recompiles_and_is_right():
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2))
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    cf = compiled._aotfuse_compiled
    for batch in (4, 9, 4, 1):
        x = torch.randn(batch, 5)
        out = compiled(x)
        assert out.shape == (batch, 2)
        assert_close(out, model(x), f"batch {batch}")
        out.sum().backward()
    assert cf.compile_count == 3  # 4, 9, 1: the second batch of 4 reused the first program


def test_same_signature_twice_does_not_recompile():
    cf = aotfuse.aot_function(lambda x, w: (x @ w).relu())
    w = torch.randn(4, 4, requires_grad=True)
    for _ in range(3):
        cf(torch.randn(2, 4), w).sum().backward()
    assert cf.compile_count == 1


@pytest.mark.parametrize("change", ["dtype", "stride", "requires_grad", "grad_mode"])
def test_signature_changes_recompile(change):
    cf = aotfuse.aot_function(lambda x: (x * 2).sin())
    x = torch.randn(4, 6, requires_grad=True)
    cf(x)
    y = {"dtype": lambda: x.detach().double(), "stride": lambda: x.detach().t(),
         "requires_grad": lambda: x.detach(), "grad_mode": lambda: x}[change]()
    if change == "grad_mode":
        with torch.no_grad():
            out = cf(y)
    else:
        out = cf(y)
    assert_close(out, (y * 2).sin(), change)
    assert cf.compile_count == 2


def test_repeated_calls_take_the_last_signature_only_when_it_is_theirs():
    """A call with the last call's signature skips the key (a guard on the last signature); every
    other call must still find its own program: alternate signatures several times."""
    cf = aotfuse.aot_function(lambda x, y, k, opts: (x * k + y).sin() if opts["sin"] else x * k - y, max_cache_size=32)
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 6)
    calls = {
        "base": lambda: (x, y, 2.0, {"sin": True}),
        "k": lambda: (x, y, 3.0, {"sin": True}),
        "k int": lambda: (x, y, 2, {"sin": True}),
        "flag": lambda: (x, y, 2.0, {"sin": False}),
        "dtype": lambda: (x.detach().double(), y.double(), 2.0, {"sin": True}),
        "stride": lambda: (x.detach().t().contiguous().t(), y, 2.0, {"sin": True}),
        "requires_grad": lambda: (x.detach(), y, 2.0, {"sin": True}),
        "same tensor twice": lambda: (y, y, 2.0, {"sin": True}),
        "new tensors": lambda: (torch.randn(4, 6, requires_grad=True), torch.randn(4, 6), 2.0, {"sin": True}),
    }
    seen = []
    for name in ["base", "base", "k", "k", "base", "k int", "flag", "flag", "base", "dtype", "dtype", "stride",
                 "stride", "base", "requires_grad", "base", "same tensor twice", "same tensor twice", "base",
                 "new tensors", "new tensors", "base"]:
        a, b, k, opts = calls[name]()
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                out = cf(a, b, k, opts)
                ref = (a * k + b).sin() if opts["sin"] else a * k - b
            assert_close(out, ref, f"{name} call, grad mode {grad}")
            assert out.dtype == ref.dtype and out.requires_grad == ref.requires_grad, name
        if name not in seen:
            seen.append(name)
    # "new tensors" has the base signature; each other name and grad mode is its own
    assert cf.compile_count == 2 * (len(seen) - 1), cf.compile_count


class _MulAdd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(6))

    def forward(self, x, y):
        x.mul_(2)
        return x + y * self.w


@pytest.mark.parametrize("make", ["aot_function", "memory_efficient_fusion", "module"])
def test_inputs_sharing_a_storage_are_not_served_a_program_traced_for_distinct_ones(make):
    """x.mul_(2) is seen through y where y overlaps x: eager's [4, 8, 12, 16, 14, 17] for views
    a[0:6] and a[2:8] of arange(10). A program traced for distinct tensors of the same shapes (the
    signature and the last-call guard looked at shapes, strides and object ids only) gave
    [2, 5, 8, 11, 14, 17]; the storages and offsets of inputs sharing one are now part of the key."""
    def fn(x, y):
        x.mul_(2)
        return x + y

    def overlapping(shift=2):
        a = torch.arange(10.0)
        return a[0:6], a[shift:shift + 6]

    if make == "module":  # a module's parameters lead its leaves and are not looked at: its inputs are
        fn = _MulAdd()
        cf = aotfuse.memory_efficient_fusion(_MulAdd())
    else:
        cf = getattr(aotfuse, make)(fn)
    expect = fn(*overlapping())
    for _ in range(2):  # the second distinct call takes the last-call guard's path
        x, y = torch.arange(6.0), torch.arange(2.0, 8.0)
        assert torch.equal(cf(x, y), fn(torch.arange(6.0), torch.arange(2.0, 8.0)))
    for _ in range(2):
        assert torch.equal(cf(*overlapping()), expect), cf(*overlapping())
    assert torch.equal(cf(*overlapping(1)), fn(*overlapping(1)))  # another offset: another aliasing
    x, y = torch.arange(6.0), torch.arange(2.0, 8.0)
    assert torch.equal(cf(x, y), fn(torch.arange(6.0), torch.arange(2.0, 8.0)))  # distinct again


def test_cache_bound_warns_once_and_stays_correct():
    cf = aotfuse.aot_function(lambda x: x.cos() + 1, max_cache_size=2, dynamic=False)  # no shape family
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 6):
            x = torch.randn(n)
            assert_close(cf(x), x.cos() + 1, f"size {n}")
    assert cf.compile_count == 2
    msgs = [str(w.message) for w in caught if "aotfuse" in str(w.message)]
    assert len(msgs) == 1 and "input signatures" in msgs[0]
    assert "Shapes that vary: argument 0 (1, 2, 3)" in msgs[0], msgs[0]


def test_cache_bound_warning_names_the_keyword_inputs_whose_shapes_vary():
    """Dynamic padding (a batch per length) is the usual way to fill the cache: the warning says
    which inputs vary and how to keep them compiled."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, input_ids, scale):
            return self.lin(self.emb(input_ids)) * scale

    model = Model()
    compiled = aotfuse.memory_efficient_fusion(model, max_cache_size=2, dynamic=False)  # no shape family
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (5, 7, 9, 11):
            ids = torch.randint(0, 10, (2, n))
            assert_close(compiled(input_ids=ids, scale=2.0), model(ids, 2.0), f"length {n}")
    msgs = [str(w.message) for w in caught if "aotfuse" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "Shapes that vary: input_ids (2x5, 2x7, 2x9)" in msgs[0] and "pad_to_multiple_of" in msgs[0], msgs[0]

    compiled = aotfuse.memory_efficient_fusion(model, max_cache_size=2, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:  # positional: counted from the forward's own first
        warnings.simplefilter("always")
        for n in (5, 7, 9):
            compiled(torch.randint(0, 10, (2, n)), 2.0)
    msgs = [str(w.message) for w in caught if "aotfuse" in str(w.message)]
    assert "Shapes that vary: argument 0 (2x5, 2x7, 2x9)" in msgs[0], msgs  # not 2 (the parameters, buffers)


def test_module_state_dict_optimizer_and_modes():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    compiled = aotfuse.memory_efficient_fusion(model)
    assert list(compiled.state_dict().keys()) == list(model.state_dict().keys())
    assert all(a is b for a, b in zip(compiled.parameters(), model.parameters()))
    # an optimizer built on the compiled module trains the original, and the other way round
    opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
    before = model[0].weight.detach().clone()
    compiled.eval()
    assert not model.training and not model[1].training
    x = torch.randn(3, 4)
    out = compiled(x)
    assert_close(out, model(x), "eval output (dropout off)")
    out.sum().backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    compiled.train()
    assert model.training and model[1].training
    compiled.load_state_dict(copy.deepcopy(model.state_dict()))


def test_tied_parameters():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids)).logsumexp(-1).mean()

    model = Tied()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    ids = torch.randint(0, 10, (2, 5))
    out, ref = compiled(ids), model(ids)
    assert_close(out, ref, "tied output")
    out.backward()
    ref.backward()
    assert_close(compiled.emb.weight.grad, model.emb.weight.grad, "tied weight grad")


@pytest.mark.parametrize("change", ["replace", "untie", "retie_behind_hooks", "new_submodule", "prebuilt_submodule",
                                    "nested_parameter", "delete"])
def test_parameters_are_read_fresh_after_the_module_changes(change):
    """The compiled module caches where its tensors live (no tree walk per call) but sees every
    change: a replaced parameter, weights untied or tied again, a new submodule, a deleted one."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            return self.b(x) + (self.extra(x) if hasattr(self, "extra") else 0.0)

    torch.manual_seed(0)
    model = Net()
    model.b.weight = model.a.weight  # tied
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(3, 4)
    compiled(x).sum().backward()
    if change == "replace":
        model.a.bias = nn.Parameter(torch.full((4,), 5.0))
    elif change == "untie":
        model.b.weight = nn.Parameter(model.a.weight.detach().clone() * 2)
    elif change == "retie_behind_hooks":
        model.b._parameters["weight"] = nn.Parameter(model.a.weight.detach().clone() * 3)  # no hook fires
    elif change == "new_submodule":
        model.extra = nn.Linear(4, 4)
    elif change == "prebuilt_submodule":  # its parameters were registered before it joined the tree
        extra = nn.Linear(4, 4)
        extra.bias = nn.Parameter(torch.full((4,), -2.0))
        model.extra = extra
    elif change == "nested_parameter":  # on a submodule that joined after the first call
        model.extra = nn.Linear(4, 4, bias=False)
        compiled(x)
        model.extra.bias = nn.Parameter(torch.full((4,), 7.0))
    else:
        del model.b.bias  # no hook fires either
        model.b.register_parameter("bias", None)
    model.zero_grad()
    out = compiled(x)
    eager = copy.deepcopy(model)
    ref = eager(x)
    assert_close(out, ref, f"output after {change}")
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name} after {change}")


def test_modules_outside_the_compiled_tree_keep_its_tensor_cache():
    """Building a module elsewhere (Hugging Face's forwards build a CrossEntropyLoss per call; a second
    model) registers tensors through the same global hooks: that must not make every compiled call walk
    its module tree again, while a registration inside the tree must."""
    from aotfuse import compile as compile_mod

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(3, 4)
    compiled(x)
    compiled(x)
    version = compile_mod._structure_version[0]
    nn.CrossEntropyLoss()
    nn.Linear(4, 4).register_buffer("extra", torch.ones(1))
    assert compile_mod._structure_version[0] == version
    assert_close(compiled(x), model(x), "output after modules built elsewhere")
    model[1].bias = nn.Parameter(torch.zeros(2))
    assert compile_mod._structure_version[0] != version
    assert_close(compiled(x), model(x), "output after a new bias")


def test_functorch_style_compilers_and_partition():
    from torch._functorch.partitioners import default_partition

    seen = []

    def my_compiler(gm, example_inputs):
        seen.append(len(list(gm.graph.nodes)))
        return gm

    cf = aotfuse.aot_function(lambda x: x.sin().cos(), fw_compiler=my_compiler, bw_compiler=my_compiler,
                              partition_fn=default_partition)
    x = torch.randn(5, requires_grad=True)
    cf(x).sum().backward()
    assert len(seen) == 2
    assert_close(x.grad, -torch.sin(torch.sin(x)) * torch.cos(x), "grad")


def test_explain_report():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    report = aotfuse.explain(model, torch.randn(3, 8))
    assert report.forward_nodes > 0 and report.backward_nodes > 0
    assert report.fused_kernels >= 1  # GELU and its backward are pointwise chains
    assert report.extern_ops.get("aten::mm.default", 0) >= 1
    assert sum(report.extern_ops.values()) < report.forward_nodes + report.backward_nodes
    assert report.saved_bytes == sum(s[3] for s in report.saved) > 0
    text = str(report)
    assert "forward program" in text and "saved for backward" in text and "aten::mm.default" in text


def test_disable_env_runs_eager(monkeypatch):
    cf = aotfuse.aot_function(lambda x: x * 3)
    monkeypatch.setenv("AOTFUSE_DISABLE", "1")
    assert_close(cf(torch.ones(2)), torch.full((2,), 3.0), "disabled")
    assert cf.compile_count == 0


def test_disable_env_runs_torch_compile_graphs_uncompiled(monkeypatch):
    """Under torch.compile(backend="aotfuse") too: Dynamo's graphs run as their own FX code, no C
    program is built, and what aotfuse cannot do (a double backward) works as in eager."""
    import functools

    from aotfuse.dynamo import aotfuse_backend

    torch._dynamo.reset()
    monkeypatch.setenv("AOTFUSE_DISABLE", "1")
    programs = []
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend=functools.partial(aotfuse_backend, collect=programs))
    x = torch.randn(5, 4, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad((g * g).sum(), x)
    xr = x.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(model(xr).sum(), xr, create_graph=True)
    (gr2,) = torch.autograd.grad((gr * gr).sum(), xr)
    assert_close(g, gr, "first derivative")
    assert_close(g2, gr2, "second derivative")
    assert programs == []
    torch._dynamo.reset()


class _SlicedLayers(torch.nn.Module):
    """A forward that registers modules: slicing a ModuleList builds a new one (Hugging Face's Phi and
    Gemma slice their decoder layers so), which runs torch's global registration hooks."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_aotfuse_models_leave_other_torch_compile_graphs_alone():
    """aotfuse's registration hook, traced by Dynamo inside another model's forward, guarded that graph
    on aotfuse's set of watched modules: every aotfuse model compiled later recompiled it (eagerly past
    Dynamo's recompile limit), and a garbage collection during its compile crashed Dynamo's guard
    building (IndexError), whatever the backend."""
    import gc

    torch._dynamo.reset()
    x = torch.randn(2, 8)

    def aotfuse_model():
        m = aotfuse.memory_efficient_fusion(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()))
        m(x).sum().backward()
        return m

    keep, compiles = [aotfuse_model()], []

    def counting(gm, _inputs):
        compiles.append(gm)
        return gm.forward

    model = _SlicedLayers()
    compiled = torch.compile(model, backend=counting)
    for _ in range(4):
        keep.append(aotfuse_model())
        assert_close(compiled(x), model(x), "sliced layers")
    assert len(compiles) == 1

    class Cycle(torch.nn.Module):  # freed only by the collector
        def __init__(self):
            super().__init__()
            self.lin, self.me = torch.nn.Linear(8, 8), [self]

        def forward(self, x):
            return self.lin(x)

    dying = aotfuse.memory_efficient_fusion(Cycle())
    dying(x)
    del dying

    def collecting(gm, _inputs):
        gc.collect()
        return gm.forward

    torch._dynamo.reset()
    model = _SlicedLayers()
    assert_close(torch.compile(model, backend=collecting)(x), model(x), "sliced layers, a collection while compiling")
    torch._dynamo.reset()


class _Residual(nn.Module):
    """A block of the user's own class: Dynamo traces its forward (torch.nn's containers it leaves)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("inner", ["aotfuse", "inductor"])
@pytest.mark.parametrize("form", ["compiled-submodule", "compiled-model"])
def test_memory_efficient_fusion_traces_through_torch_compiled_code(form, inner):
    """A model holding a torch.compile'd block, or memory_efficient_fusion(torch.compile(model)): the
    capture's fake tensors reached Dynamo's backend and the capture failed (aotfuse's backend: 'could
    not read a kernel operand'; inductor's: 'Cannot access data pointer'). Compiled code now runs its
    original Python while aotfuse traces, so it is captured into aotfuse's own program."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _Residual(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    if form == "compiled-submodule":
        model[1] = torch.compile(model[1], backend=inner)
        compiled = aotfuse.memory_efficient_fusion(model)
    else:
        compiled = aotfuse.memory_efficient_fusion(torch.compile(model, backend=inner))
    x = torch.randn(8, 16)
    for step in range(2):
        out, expected = compiled(x), ref(x)
        assert_close(out, expected, f"{form} ({inner}) step {step}: output")
        out.square().mean().backward()
        expected.square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close(q.grad, p.grad, f"{form} ({inner}): gradient of {name}")
    cf = compiled._aotfuse_compiled
    assert cf.compile_count == 1 and all(e.fallback is None for e in cf._cache.values())
    assert cf.records[-1].programs["forward"].program.num_kernels >= 1  # aotfuse's kernels run the GELU
    torch._dynamo.reset()


def test_torch_compile_backend():
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    compiled = torch.compile(copy.deepcopy(model), backend="aotfuse", dynamic=False)
    x = torch.randn(4, 6)
    out, ref = compiled(x), model(x)
    assert_close(out, ref, "torch.compile output")
    torch._dynamo.reset()


def test_torch_compile_backend_takes_python_scalars_in_the_dtype_dynamo_passes_them():
    """Dynamo traces a Python number it passes as a tensor (torch 2.14's `random.random()`, drawn before
    the graph) as `torch.tensor(r)`, float32, then calls the graph with `torch._as_tensor_fullprec(r)`,
    float64. The program refused every call ("dtype code 7, the program was compiled for float32");
    it is now traced in float64, so `r < 0.5` is decided as eager decides it: 0.5 - 1e-12 rounds to
    0.5 in float32. The Dynamo graph is written here as 2.14 makes it, so the test runs on any torch."""
    import types

    from aotfuse.dynamo import aotfuse_backend

    def f(w, x, r):
        return (x @ w) * r, r < 0.5

    gm = torch.fx.symbolic_trace(f)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders[2].meta["grapharg"] = types.SimpleNamespace(pass_arg_as_tensor=True, is_tensor=False)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    run = aotfuse_backend(gm, [w.detach().requires_grad_(), x, torch.tensor(0.25)])
    for value in (0.25, 0.5 - 1e-12, 0.75):
        r = torch._as_tensor_fullprec(value)
        assert r.dtype == torch.float64
        out, below = run(w, x, r)
        ref, ref_below = f(w, x, r)
        assert bool(below) == bool(ref_below) == (value < 0.5), value
        assert_close(out, ref, f"r = {value}")
        out.sum().backward()
        ref_grad = torch.autograd.grad(ref.sum(), w)[0]
        assert_close(w.grad, ref_grad, f"grad at r = {value}")
        w.grad = None


@pytest.mark.parametrize("families", [True, False], ids=["traced-once", "traced-per-shape"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
def test_torch_compile_backend_compiles_each_shape_of_a_dynamic_graph(dynamic, families, monkeypatch):
    """Dynamo hands over graphs with symbolic shapes (after a recompile for a new shape, or with
    dynamic=True); the C core compiles shapes, so each concrete signature gets programs of its own
    (this raised BackendCompilerFailed before), matching eager in values and gradients. By default
    the symbolic graph is traced once and each shape's programs are made from its graphs
    (shapes.PerShape), every shape compiled; with AOTFUSE_DYNAMIC=0 each shape is traced with its
    real inputs, and past AOTFUSE_CACHE_SIZE shapes the graph runs uncompiled, with one warning."""
    import functools
    import warnings

    from aotfuse.dynamo import aotfuse_backend

    torch._dynamo.reset()
    monkeypatch.setenv("AOTFUSE_CACHE_SIZE", "3")
    monkeypatch.setenv("AOTFUSE_DYNAMIC", "auto" if families else "0")
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    seen: list = []
    compiled = torch.compile(twin, backend=functools.partial(aotfuse_backend, collect=seen), dynamic=dynamic)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_batches_train_like_eager(compiled, twin, model, (3, 5, 7, 5, 9, 11), 8)
    uncompiled = [w for w in caught if "run uncompiled" in str(w.message)]
    if families and dynamic is None:  # a forward and a backward program for each of the five shapes
        assert [stage for stage, _low in seen] == ["forward", "backward"] * 5, seen
        assert not uncompiled, [str(w.message) for w in uncompiled]
    else:  # (dynamic=True also passes the layer norm's eps as a tensor read with .item(): per shape)
        # 3, 5, 7 and 9 with dynamic=None (3 is Dynamo's static graph, the others its symbolic
        # one's, whose bound of 3 leaves 11 uncompiled); 3, 5 and 7 with dynamic=True
        shapes = 4 if dynamic is None else 3
        assert [stage for stage, _low in seen] == ["forward", "backward"] * shapes, seen
        assert len(uncompiled) == 1, [str(w.message) for w in caught]
    torch._dynamo.reset()


def test_torch_compile_backend_hands_its_programs_to_a_collector():
    import functools

    from aotfuse.dynamo import aotfuse_backend
    from aotfuse.lower import Lowered

    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    seen: list = []
    compiled = torch.compile(copy.deepcopy(model), backend=functools.partial(aotfuse_backend, collect=seen), dynamic=False)
    x = torch.randn(4, 6)
    out = compiled(x)
    assert_close(out, model(x), "torch.compile output")
    out.sum().backward()
    assert [stage for stage, _low in seen] == ["forward", "backward"], seen
    assert all(isinstance(low, Lowered) and low.program.num_steps > 0 for _stage, low in seen)
    torch._dynamo.reset()


_LINALG_CHECKED = {  # ops whose input check is an effect (with_effects(token, aten._linalg_check_errors, ...))
    "inv": lambda w, x: (torch.linalg.inv(w) @ x).tanh().sum(),
    "solve": lambda w, x: torch.linalg.solve(w, x).sin().sum(),
    "cholesky": lambda w, x: torch.linalg.cholesky(w @ w.mT + torch.eye(4, dtype=w.dtype)).sum() + x.sum(),
    "inverse": lambda w, x: torch.inverse(w).square().sum() + x.sum(),
    "matrix_power": lambda w, x: torch.linalg.matrix_power(w, -2).sum() + x.sum(),
    "eigvals": lambda w, x: torch.linalg.eigvals(w @ w.mT + torch.eye(4, dtype=w.dtype)).real.sum() + x.sum(),
}


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("name", sorted(_LINALG_CHECKED))
def test_linalg_ops_with_checked_inputs_compile_and_still_raise(name, how):
    """linalg's inv, solve, cholesky, ... check their results (a singular matrix raises) through an
    effect-token call, which the programs refused (`with_effects ... cannot pass argument`), with
    fallback="dynamo" and under torch.compile too. The check is now a step of the program: values and
    gradients as eager's and as float64's, and a singular matrix raises eager's LinAlgError."""
    import torch._dynamo

    fn = _LINALG_CHECKED[name]
    g = torch.Generator().manual_seed(3)
    w0, x = torch.randn(4, 4, generator=g) + 3 * torch.eye(4), torch.randn(4, 5, generator=g)
    if how == "torch.compile":
        torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")
    w, we = (w0.clone().requires_grad_() for _ in range(2))
    out = cf(w, x)
    out.backward()
    ref = fn(we, x)
    ref.backward()
    w64d = w0.double().requires_grad_()
    out64 = fn(w64d, x.double())
    out64.backward()
    assert_close(out, ref, f"{name} {how}: value")
    assert_close(w.grad, we.grad, f"{name} {how}: grad of w")
    assert_close(w.grad.double(), w64d.grad, f"{name} {how}: grad of w against float64", atol=1e-4, rtol=1e-3)
    if name in ("inv", "solve", "inverse", "matrix_power"):
        with pytest.raises(torch.linalg.LinAlgError):
            fn(torch.zeros(4, 4), x)
        with pytest.raises(torch.linalg.LinAlgError):
            cf(torch.zeros(4, 4, requires_grad=True), x)


@pytest.mark.parametrize("fallback", ["dynamo", "eager"])
def test_a_fallback_signature_takes_every_later_shape_without_capturing_again(fallback):
    """A function that cannot be captured whole (a branch on a value) called at 12 lengths. Before,
    each length tried the capture again and warned again, and fallback="dynamo" ran under
    torch.compile(dynamic=False): a Dynamo recompile per length, and past its recompile_limit (8) the
    rest ran eagerly (and past 8 signatures aotfuse's own limit did too). Now one warning, later shapes
    go straight to the fallback, and Dynamo's automatic dynamic shapes keep compiling them."""
    import torch._dynamo

    from aotfuse.lower import LIVE

    def fn(x, w):
        h = (x @ w).tanh()
        return h * 2 if h.sum().item() > 0 else h - 1

    torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn, fallback=fallback)
    w = torch.randn(4, 4, requires_grad=True)
    made = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2, 14):
            x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
            before = list(LIVE)  # held, so an earlier test's program collected during the call is no -1
            out = cf(x, w)
            made.append(len(LIVE) - len(before))
            del before
            assert_close(out, fn(x, w), f"length {n}")
    msgs = [str(c.message) for c in caught if "aotfuse" in str(c.message)]
    assert len(msgs) == 1 and "could not capture" in msgs[0], msgs
    if fallback == "dynamo":
        assert all(k > 0 for k in made[-4:]), made  # still compiling at lengths 10-13
    else:
        assert made == [0] * 12, made


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
def test_lazily_negated_and_conjugated_inputs_give_their_values(how):
    """`z.conj().imag` is a view whose data are the negatives of its values (torch's neg bit): the
    kernels read the data and gave the values negated, silently (torch.compile with Inductor still
    does, torch 2.13). Such inputs (and conjugated complex ones) are now read through resolve_neg /
    resolve_conj inside the program, and the signature tells them from plain tensors: values and
    gradients as eager's, and an in-place update of one reaches the caller's tensor. (Under
    torch.compile a graph compiled for plain tensors serves a negated one too: Dynamo's guards do not
    tell them apart, so there the negated call comes first, then a plain one.)"""
    import torch._dynamo

    def fn(x, w, c):
        return (x.sin() * w).sum() + (x * 3).exp().mean(), (c * 2).abs()

    g = torch.Generator().manual_seed(4)
    z0, w0, c0 = torch.randn(3, 5, dtype=torch.cfloat, generator=g), torch.randn(3, 5, generator=g), \
        torch.randn(4, dtype=torch.cfloat, generator=g)
    if how == "torch.compile":
        torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")
    if how == "memory_efficient_fusion":
        cf(torch.randn(3, 10)[:, ::2], w0, c0)  # a plain call of the same shapes and strides first
    for lazy in (True, True, False):
        z, ze = (z0.clone().requires_grad_() for _ in range(2))
        w, we = (w0.clone().requires_grad_() for _ in range(2))
        x, xe = (z.conj().imag, ze.conj().imag) if lazy else (z.imag, ze.imag)
        assert x.is_neg() == lazy
        out, mag = cf(x, w, c0.conj() if lazy else c0)
        ref, mag_ref = fn(xe, we, c0.conj() if lazy else c0)
        out.backward()
        ref.backward()
        assert_close(out, ref, f"{how}: value")
        assert_close(mag, mag_ref, f"{how}: conjugated input's value")
        assert_close(z.grad, ze.grad, f"{how}: grad of z")
        assert_close(w.grad, we.grad, f"{how}: grad of w")


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
def test_in_place_updates_of_conjugated_inputs_reach_the_caller(how):
    """A function updating a conjugated input in place (`v.mul_(2)` on `base.conj()`): the update must
    land in `base` (conjugated), as eager's does."""
    import torch._dynamo

    def fn(v, y):
        v.mul_(2)
        v.add_(y)
        return v.abs().sum()

    if how == "torch.compile":
        torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")
    y = torch.tensor([1j, 2 + 1j])
    for _ in range(2):
        base, base_e = (torch.tensor([1 + 1j, 3 - 1j]) for _ in range(2))
        out, ref = cf(base.conj(), y), fn(base_e.conj(), y)
        assert_close(out, ref, f"{how}: value")
        assert torch.equal(base, base_e), (base, base_e)


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
def test_as_strided_scatter_reads_its_gradient_from_the_storage_offset_it_names(how):
    """as_strided_scatter(x, src, (), (), storage_offset=0) over x at storage offset 1: its backward's
    as_strided(gradient, (), (), 0) means offset 0 of the gradient's storage, which AOTAutograd gives
    at offset 0 where it was traced at 1. A helper's sweep found a change of this session reading it
    relative to the traced offset (offset -1: garbage gradients); the graph's own as_strided calls keep
    ATen's meaning, only the sink's views of sources are relative."""
    import torch._dynamo

    def fn(x, src):
        return torch.as_strided_scatter(x, src, (), (), storage_offset=0) * torch.tensor([3.0], dtype=torch.float64)

    if how == "torch.compile":
        torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")

    def run(f):
        bx, bs = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        x, s = bx[1:].view(1, 2)[..., 0], bs[1:2].view(())  # x: [1], stride 2, offset 1; s: 0-dim, offset 1
        x.copy_(torch.tensor([-4.8]))
        s.copy_(torch.tensor(-0.6))
        x.requires_grad_()
        s.requires_grad_()
        out = f(x, s)
        return (out,) + torch.autograd.grad((out * 0.25).sum(), (x, s))

    for _ in range(2):
        for got, want, what in zip(run(cf), run(fn), ("value", "grad of x", "grad of src")):
            assert_close(got, want, f"{how}: {what}")


def _matches_eager_twice(fn, how: str, z0: torch.Tensor, w0: torch.Tensor, what: str) -> None:
    """fn(z, w) compiled (memory_efficient_fusion or torch.compile with aotfuse), called twice: its
    outputs (one or a tuple, real) and the gradients of z and w through a weighted sum as eager's."""
    import torch._dynamo

    if how == "torch.compile":
        torch._dynamo.reset()
    cf = aotfuse.memory_efficient_fusion(fn) if how == "memory_efficient_fusion" else torch.compile(fn, backend="aotfuse")
    for _ in range(2):
        z, ze = (z0.clone().requires_grad_() for _ in range(2))
        w, we = (w0.clone().requires_grad_() for _ in range(2))
        out, ref = cf(z, w), fn(ze, we)
        out, ref = (out if isinstance(out, tuple) else (out,)), (ref if isinstance(ref, tuple) else (ref,))
        sum((o * torch.arange(o.numel()).view(o.shape)).sum() for o in out).backward()
        sum((r * torch.arange(r.numel()).view(r.shape)).sum() for r in ref).backward()
        for k, (o, r) in enumerate(zip(out, ref)):
            assert_close(o.resolve_neg(), r.resolve_neg(), f"{what} {how}: output {k}")
        assert_close(z.grad, ze.grad, f"{what} {how}: grad of z")
        assert_close(w.grad, we.grad, f"{what} {how}: grad of w")


_LAZY_VIEW_FNS = {
    # `z.conj().imag` traces to _conj and _neg_view: views whose values are the conjugate or the
    # negation of their data; the kernels read the data
    "imag_of_conj": lambda z, w: (z.conj().imag.sin() * w).sum(),
    "real_times_imag": lambda z, w: (z.conj().real * z.conj().imag * w).exp().sum(),
    # the resolve_conj vanished from the graph's meaning: view_as_real refused the unresolved conjugate
    "view_as_real": lambda z, w: (torch.view_as_real(z.conj().resolve_conj()).sum(-1) * w).sum(),
    # an output at storage offset 1 (an imaginary part): its gradient, traced at offset 1, comes at
    # offset 0, and the backward's as_strided of it overran the storage ('setStorage: ... out of bounds')
    "imag_output": lambda z, w: ((z * w).conj().imag, w.neg()),
}


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("name", sorted(_LAZY_VIEW_FNS))
def test_conjugate_and_imaginary_views_inside_graphs_give_eagers_values(name, how):
    g = torch.Generator().manual_seed(5)
    z0, w0 = torch.randn(3, 4, dtype=torch.cfloat, generator=g), torch.randn(3, 4, generator=g)
    _matches_eager_twice(_LAZY_VIEW_FNS[name], how, z0, w0, name)


def test_complex_variance_is_atens():
    """aotfuse's var_mean decomposition squared complex deviations as complex numbers: a complex
    variance came out complex and wrong under no_grad, and failed its capture with gradients on. Complex
    inputs now keep ATen's var_mean (the real mean of |x - mean|^2)."""
    g = torch.Generator().manual_seed(8)
    z0 = torch.randn(3, 5, dtype=torch.complex128, generator=g)
    fn = lambda z: torch.var_mean(z, 1)  # noqa: E731
    with torch.no_grad():
        var, mean = aotfuse.memory_efficient_fusion(fn)(z0)
    assert var.dtype == torch.float64
    assert_close(var, fn(z0)[0], "variance, no_grad")
    assert_close(mean, fn(z0)[1], "mean, no_grad")
    z, ze = (z0.clone().requires_grad_() for _ in range(2))
    out, ref = aotfuse.memory_efficient_fusion(fn)(z), fn(ze)
    (out[0].sum() + out[1].abs().sum()).backward()
    (ref[0].sum() + ref[1].abs().sum()).backward()
    assert_close(out[0], ref[0], "variance")
    assert_close(z.grad, ze.grad, "gradient")


_COMPLEX_SCALAR_FNS = {
    "times_1j": lambda z, w: (z * 1j + (2 - 1j)).abs() * w,
    "masked_fill": lambda z, w: z.masked_fill(z.real > 0, 1 + 2j).abs() * w,
    "vector_norm": lambda z, w: torch.linalg.vector_norm(z, dim=1, keepdim=True) * w,
    "conv1d": lambda z, w: torch.nn.functional.conv1d(z.unsqueeze(0), (w[:2, :3].unsqueeze(-1) + 0.5j).expand(2, 3, 2))
    .abs().sum() * w,
}


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("name", sorted(_COMPLEX_SCALAR_FNS))
def test_complex_python_scalars_pass_to_aten_calls(name, how):
    """A Python complex in a graph (`z * 1j`, a complex fill, the norm's and complex convolution's
    own constants) had no encoding for the C core: a CaptureError where torch's aot_function runs.
    Such arguments now reach the ATen calls (no kernel takes complex numbers)."""
    g = torch.Generator().manual_seed(9)
    z0, w0 = torch.randn(3, 5, dtype=torch.complex128, generator=g), torch.randn(3, 5, dtype=torch.float64, generator=g)
    _matches_eager_twice(_COMPLEX_SCALAR_FNS[name], how, z0, w0, name)


@pytest.mark.parametrize("order", ["restride_then_write", "write_then_restride"])
def test_an_input_view_restrided_and_written_in_place_is_refused_not_corrupted(order):
    """`a.t_()` and a write to `a`, a view of b at storage offset 1: AOTAutograd gives the caller's
    tensor the updated value's shape, strides and storage offset, and a kernel's result starts at 0,
    so the writes landed one element early in b (found by a random aliasing sweep; the second order
    is wrong under torch's own aot_function too). The capture is refused, naming the input; the
    fallbacks and torch.compile give eager's b."""
    def fn(a):
        if order == "restride_then_write":
            a.t_()
            a.select(0, 3).neg_()
        else:
            a.mul_(2)
            a.t_()
        return a + 0

    def call(f):
        b = torch.arange(18.0).view(3, 6)
        out = f(b[..., 1:5])
        return b, out

    assert_refused_but_runs_like_eager(fn, call, "storage offset 1")
    # restrided without a write (the output is a view of the input): compiled, eager's b
    cf = aotfuse.aot_function(lambda a: a.t_())
    b = torch.arange(18.0).view(3, 6)
    out = cf(b[..., 1:5])
    assert out.storage_offset() == 1 and torch.equal(out, torch.arange(18.0).view(3, 6)[..., 1:5].t())


@pytest.mark.parametrize("make", ["aot_function", "memory_efficient_fusion"])
def test_an_output_gradient_in_another_layout_than_traced_is_copied_into_it(make):
    """One tensor requiring grad passed twice, written through a view and transposed in place, then
    returned: AOTAutograd hands the backward its output gradient in the layout the caller's tensor
    has (strides [4, 1]) where the graph was traced for [1, 3], and the program's input check raised
    AF_ERR_INVALID where eager gives the gradient (found by a random aliasing sweep). The gradient is
    copied into the traced layout."""
    def fn(a0, a1):
        a1.view(12).clamp_(-0.5, 0.5)
        a1.t_()
        return a1

    def grad_of(f):
        torch.manual_seed(0)
        leaf = torch.randn(4, 3, requires_grad=True)
        b = leaf.clone()
        out = f(b, b)
        (out * torch.arange(12.0).view(out.shape)).sum().backward()
        return leaf.grad

    assert torch.equal(grad_of(getattr(aotfuse, make)(fn)), grad_of(fn))
