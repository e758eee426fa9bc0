"""Shape families (aotfuse/shapes.py): one symbolic trace serves the shapes that follow it, each with
a C program of its own made from that trace's graphs. Values are checked against eager (and the
float64 reference, through compare_models); the tests also check that a shape joined its family
(traced nothing) or, where it must not, was traced on its own."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import aotfuse
from aotfuse import shapes
from aotfuse.testing import compare_models
from helpers import assert_batches_train_like_eager, assert_close, assert_grads_match

transformers = pytest.importorskip("transformers")


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _flaubert():
    """Asks `lengths.max().item() <= slen` of its ids (decisions.py answers it, the family's trace too)."""
    from transformers import FlaubertConfig, FlaubertWithLMHeadModel

    return FlaubertWithLMHeadModel(FlaubertConfig(vocab_size=100, emb_dim=32, n_layers=2, n_heads=2, dropout=0.0,
                                                  attention_dropout=0.0, max_position_embeddings=64))


def _funnel():
    """Its relative positions: `torch.arange` between 0-d tensors worked out from the length."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    return FunnelForMaskedLM(FunnelConfig(vocab_size=100, d_model=32, n_head=2, d_head=16, d_inner=64,
                                          block_sizes=[1, 1], num_decoder_layers=1, hidden_dropout=0.0,
                                          attention_dropout=0.0, activation_dropout=0.0))


def _members(cf) -> int:
    return sum(e.member for e in cf._cache.values())


def _warmed(lengths, holder):
    """compile_fn for compare_models: memory_efficient_fusion, trained for one step at each of
    `lengths` first (the first is traced on its own, the second makes the family), grads cleared."""
    def compile_fn(model):
        compiled = aotfuse.memory_efficient_fusion(model)
        for n in lengths:
            ids = torch.randint(0, 100, (2, n))
            compiled(input_ids=ids, labels=ids.clone()).loss.backward()
        for p in model.parameters():
            p.grad = None
        holder.append(compiled._aotfuse_compiled)
        return compiled
    return compile_fn


@pytest.mark.parametrize("make", [_bert, _gpt2, _flaubert], ids=["bert", "gpt2", "flaubert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_models_train_like_eager_at_a_shape_of_their_family(make, dtype):
    """Lengths 16 then 12 make the family; compare_models' three steps at length 10 run programs made
    from the family's graphs (no trace), like eager and the float64 reference."""
    holder = []
    ids = torch.randint(0, 100, (2, 10))
    report = compare_models(make, lambda: dict(input_ids=ids, labels=ids.clone()), dtype=dtype,
                            compile_fn=_warmed((16, 12), holder))
    report.assert_ok()
    cf = holder[0]
    assert cf.compile_count == 2 and _members(cf) == 1, (cf.compile_count, _members(cf))
    (family,) = cf._families.values()
    assert not family.failed and set(family.dims.values()) == {frozenset({1})}
    if make is _flaubert:  # its question answered in the family's trace, its guard replayed at length 10
        assert family.record.decisions is not None and family.record.decisions.sizes, family.record.decisions


def test_a_model_whose_trace_reads_values_made_from_its_length_traces_each_length(monkeypatch):
    """Funnel: a family's trace would fix its relative positions to one length, so it stops at the
    first such value (decisions.SizeDependentDecision, not a trace run to its end) and each length is
    traced on its own, training like eager and the float64 reference."""
    said = []
    monkeypatch.setattr(aotfuse.config, "emit", lambda stage, message: said.append(message))
    holder = []
    ids = torch.randint(0, 100, (2, 10))
    report = compare_models(_funnel, lambda: dict(input_ids=ids, labels=ids.clone()),
                            compile_fn=_warmed((16, 12), holder))
    report.assert_ok()
    cf = holder[0]
    assert cf.compile_count == 3 and _members(cf) == 0, (cf.compile_count, _members(cf))
    (family,) = cf._families.values()
    assert family.failed
    failed = [m for m in said if "no symbolic trace" in m]
    assert len(failed) == 1 and "SizeDependentDecision" in failed[0], failed


def test_new_lengths_join_without_tracing_and_keep_their_own_programs():
    """Dynamic padding: many lengths, one trace after the first; each length's values are eager's,
    also when a length comes back after others (its programs are kept)."""
    torch.manual_seed(0)
    model = _bert()
    compiled = aotfuse.memory_efficient_fusion(model)
    lengths = (16, 12, 9, 7, 13, 12, 5, 16, 9)
    for n in lengths:
        ids = torch.randint(0, 100, (2, n))
        out = compiled(input_ids=ids, labels=ids.clone())
        ref = model(input_ids=ids, labels=ids.clone())
        assert_close(out.logits, ref.logits, f"length {n}: logits")
        assert_close(out.loss, ref.loss, f"length {n}: loss")
    cf = compiled._aotfuse_compiled
    assert cf.compile_count == 2, cf.compile_count  # 16 on its own, then the family at 12
    assert _members(cf) == len(set(lengths)) - 2
    (family,) = cf._families.values()
    assert len(family.stages["forward"].programs) == len(set(lengths)) - 1  # all but the first length


def test_members_do_not_count_toward_the_signature_bound():
    """max_cache_size bounds traces: the lengths of a family compile past it, and nothing falls back
    to eager (no warning)."""
    cf = aotfuse.aot_function(lambda x: (x.sin() * 2).sum(-1), max_cache_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2, 12):
            x = torch.randn(3, n, requires_grad=True)
            out = cf(x)
            assert_close(out, (x.sin() * 2).sum(-1), f"size {n}")
            out.sum().backward()
            assert_close(x.grad, 2 * x.cos(), f"size {n}: grad")
    assert not [w for w in caught if "aotfuse" in str(w.message)]
    assert cf.compile_count == 2 and _members(cf) == 8


def test_dynamic_true_traces_symbolically_at_the_first_call():
    f = lambda x, y: (x.exp() * y).sum(0)  # noqa: E731
    cf = aotfuse.aot_function(f, dynamic=True)
    for n in (5, 9, 3):
        x, y = torch.randn(n, 4, requires_grad=True), torch.randn(n, 4)
        out = cf(x, y)
        assert_close(out, f(x, y), f"rows {n}")
        out.sum().backward()
        assert_close(x.grad, x.exp() * y, f"rows {n}: grad")
    assert cf.compile_count == 1 and _members(cf) == 2
    (family,) = cf._families.values()
    assert family.dims == {0: frozenset({0, 1}), 1: frozenset({0, 1})}


def test_dynamic_false_and_aotfuse_dynamic_0_trace_every_shape(monkeypatch):
    f = lambda x: x.tanh() + 1  # noqa: E731
    cf = aotfuse.aot_function(f, dynamic=False)
    for n in (3, 4, 5):
        x = torch.randn(n)
        assert_close(cf(x), f(x), f"size {n}")
    monkeypatch.setenv("AOTFUSE_DYNAMIC", "0")
    cf0 = aotfuse.aot_function(f)
    for n in (3, 4, 5):
        x = torch.randn(n)
        assert_close(cf0(x), f(x), f"size {n}")
    assert cf.compile_count == 3 and cf0.compile_count == 3
    assert not cf._families and not cf0._families


def test_a_shape_failing_the_family_guards_is_traced_on_its_own():
    """A Python branch on a size: the family's trace guards it (rows > 4), so a call with fewer rows
    takes the other branch in a trace of its own."""
    def f(x):
        return x.sin() if x.shape[0] > 4 else x.cos()

    cf = aotfuse.aot_function(f)
    for n in (8, 6, 7, 3, 5):
        x = torch.randn(n, 2)
        assert_close(cf(x), f(x), f"rows {n}")
    (family,) = cf._families.values()
    assert not family.failed and family.guards == "5 <= L['t0'].size()[0]", family.guards
    assert cf.compile_count == 3 and _members(cf) == 2  # 8; the family at 6 (7 and 5 join); 3 on its own


def test_a_trace_that_pins_its_sizes_makes_no_family():
    """A size read as a Python int (here to size a new tensor) pins the symbol to the traced value:
    the family is marked failed and each shape is traced on its own, with the right values."""
    def f(x):
        n = int(x.shape[1])
        return x * torch.arange(n, dtype=x.dtype)

    cf = aotfuse.aot_function(f)
    for n in (4, 6, 8):
        x = torch.randn(2, n)
        assert_close(cf(x), f(x), f"columns {n}")
    (family,) = cf._families.values()
    assert family.failed
    assert cf.compile_count == 3 and _members(cf) == 0


def test_a_family_keeps_at_most_shape_programs_programs(monkeypatch):
    monkeypatch.setenv("AOTFUSE_SHAPE_PROGRAMS", "2")
    cf = aotfuse.aot_function(lambda x: x.sigmoid() * 3)
    for n in (3, 4, 5, 6, 3, 4):
        x = torch.randn(n, requires_grad=True)
        out = cf(x)
        assert_close(out, x.sigmoid() * 3, f"size {n}")
        out.sum().backward()
        s = x.sigmoid()
        assert_close(x.grad, 3 * s * (1 - s), f"size {n}: grad")
    (family,) = cf._families.values()
    assert set(family.stages) == {"forward", "backward"}
    assert all(len(p.programs) == 2 for p in family.stages.values())


def test_concrete_sets_sizes_keeps_names_and_drops_size_nodes():
    """shapes.concrete on a symbolic graph: the same node names, sizes as numbers in view arguments
    and metadata, no size nodes or symbolic inputs left."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return (x.view(x.shape[0] * x.shape[1]) * 2).view(x.shape[0], x.shape[1]).sum(0)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 5))
    assert shapes.is_symbolic(gm)
    hints = shapes.symbolic_values(gm)
    assert sorted(hints.values()) == [3, 5]
    (a, b) = sorted(hints, key=lambda s: hints[s])
    cg = shapes.concrete(gm, {a: 4, b: 6})
    assert not shapes.is_symbolic(cg)
    names = {n.name for n in gm.graph.nodes}
    assert {n.name for n in cg.graph.nodes} <= names
    for n in cg.graph.nodes:
        val = n.meta.get("val")
        assert not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)), n.name
        if isinstance(val, torch.Tensor):
            assert all(isinstance(s, int) for s in (*val.shape, *val.stride())), n.name
    views = [n for n in cg.graph.nodes if n.op == "call_function" and "view" in str(n.target)]
    assert [list(v.args[1]) for v in views] == [[24], [4, 6]]
    x = torch.randn(4, 6)
    assert_close(cg(x), f(x), "the concrete graph")


def test_per_shape_runs_each_shapes_program_and_drops_size_inputs():
    """PerShape binds symbols from its inputs, makes one program per size set, and leaves symbolic
    (number) inputs out of the program's inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, n):
        return (x * 2).view(n, -1).sum(1)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 6), 8)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert isinstance(placeholders[1].meta["val"], torch.SymInt)
    made = []

    def lower(g: fx.GraphModule):
        made.append(g)
        return lambda args: [g(*args)]

    ps = shapes.PerShape(gm, lower)
    assert ps.numbers == frozenset({1})
    for shape, n in (((4, 6), 8), ((2, 5), 5), ((4, 6), 8)):
        x = torch.randn(*shape)
        (out,) = ps([x, n])
        assert_close(out, f(x, n), f"shape {shape}")
    assert len(made) == 2 and len(ps.programs) == 2
    assert all(len(list(g.graph.find_nodes(op="placeholder"))) == 1 for g in made)


def test_explain_and_records_on_a_family():
    """explain() on a function with a family reports its programs; records lists each record once."""
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    compiled = aotfuse.memory_efficient_fusion(model)
    for n in (3, 5, 7):
        x = torch.randn(n, 4)
        out = compiled(x)
        assert_close(out, model(x), f"batch {n}")
        out.sum().backward()
    cf = compiled._aotfuse_compiled
    assert _members(cf) == 1 and len(cf.records) == 2
    assert {"forward", "backward"} <= set(cf.records[-1].programs)


@pytest.mark.cuda
def test_a_family_on_cuda_trains_like_eager(dtype=torch.bfloat16):  # one dtype: gpu_check.sh's time is short
    """On the GPU: Bert's lengths 16 and 12 make the family, length 10's CUDA programs come from its
    graphs (eager attention as SDPA inside the family's trace), like eager and float64."""
    holder = []
    ids = torch.randint(0, 100, (2, 10), device="cuda")

    def compile_fn(model):
        compiled = aotfuse.memory_efficient_fusion(model)
        for n in (16, 12):
            x = torch.randint(0, 100, (2, n), device="cuda")
            compiled(input_ids=x, labels=x.clone()).loss.backward()
        for p in model.parameters():
            p.grad = None
        holder.append(compiled._aotfuse_compiled)
        return compiled

    report = compare_models(lambda: _bert().cuda(), lambda: dict(input_ids=ids, labels=ids.clone()), dtype=dtype,
                            compile_fn=compile_fn)
    report.assert_ok()
    assert holder[0].compile_count == 2 and _members(holder[0]) == 1


def test_inference_calls_and_batch_norm_statistics_in_a_family():
    """Evaluation under no_grad (the inference program, its own family) and training with a batch
    norm (AOTAutograd's input mutation: the running statistics) at batch sizes of a family."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(twin)
    assert_batches_train_like_eager(compiled, twin, model, (4, 6, 9, 5), 6)
    assert_close(twin[1].running_mean, model[1].running_mean, "running mean")
    assert_close(twin[1].running_var, model[1].running_var, "running var")
    compiled.eval()
    model.eval()
    with torch.no_grad():
        for n in (3, 7, 11):
            x = torch.randn(n, 6)
            assert_close(compiled(x), model(x), f"batch {n}: evaluation")
    cf = compiled._aotfuse_compiled
    assert len(cf._families) == 2 and _members(cf) == 2 + 1, (len(cf._families), _members(cf))
    inference = [f for f in cf._families.values() if "inference" in f.stages]
    assert len(inference) == 1 and len(inference[0].stages["inference"].programs) == 2


def test_sizes_equal_at_the_traced_shape_stay_separate_symbols():
    """A batch and a length that happen to be equal when the family is traced are two symbols (no
    duck sizing): a later shape where they differ joins the family."""
    f = lambda x: (x.cumsum(1) * 2).sum()  # noqa: E731
    cf = aotfuse.aot_function(f, dynamic=True)
    for shape in ((5, 5), (3, 7), (6, 2)):
        x = torch.randn(*shape, requires_grad=True)
        out = cf(x)
        assert_close(out, f(x), f"shape {shape}")
    assert cf.compile_count == 1 and _members(cf) == 2


def test_the_backward_lowered_at_partition_time_is_the_one_that_runs(monkeypatch):
    """The partitioner lowers the backward at the first forward (so an unsupported one fails there);
    the backward compiler takes that program instead of lowering the same graph again: one lowering
    each for the forward and the backward of a traced signature (also the family's, at its traced
    sizes), and of a shape that joins a family."""
    import aotfuse.compile as compile_mod

    calls = []
    real = compile_mod.lower

    def counted(gm, *args, **kwargs):
        calls.append(kwargs.get("lazy", False))
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compile_mod, "lower", counted)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = aotfuse.memory_efficient_fusion(model)
    for n in (3, 5, 7):
        calls.clear()
        x = torch.randn(n, 4)
        out = compiled(x)
        assert_close(out, model(x), f"batch {n}")
        out.sum().backward()
        assert sorted(calls) == [False, True], (n, calls)  # one forward, one (lazy) backward lowering
    assert _members(compiled._aotfuse_compiled) == 1


def test_a_function_that_falls_back_makes_no_family():
    """A data-dependent branch cannot be captured whole (fallback="eager" runs it eagerly): a new
    shape of it tries no symbolic trace (which would fail the same way) and no capture of its own
    (since 2026-12-04: one warning, not one a shape), and runs eagerly too."""
    def f(x):
        return x.sin() if x.sum() > 0 else x.cos()

    cf = aotfuse.aot_function(f, fallback="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4, 5):
            x = torch.randn(n, requires_grad=True)  # (a value without grad would be answered: decisions.py)
            assert_close(cf(x), f(x), f"size {n}")
    assert not cf._families
    assert sum("could not capture" in str(w.message) for w in caught) == 1


def test_torch_compile_traces_a_symbolic_graph_with_size_inputs_once(monkeypatch):
    """Under torch.compile, Dynamo's graph for a second length takes the length as an input (`s0`)
    that the backward reads (a view's size): the forward returns it for the backward, and the graph
    is traced once (no per-shape tracing) for every later length, like eager. (The partition failed
    with "Node embedding_dense_backward was invalid, but is output" before.)"""
    import aotfuse.dynamo as dynamo_mod

    per_shape = []
    real = dynamo_mod._per_shape
    monkeypatch.setattr(dynamo_mod, "_per_shape", lambda *a, **k: per_shape.append(1) or real(*a, **k))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(100, 32), nn.Linear(32, 100)

        def forward(self, ids):
            return nn.functional.cross_entropy(self.lin(self.emb(ids)).flatten(0, 1), ids.flatten())

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = M()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aotfuse")
    for n in (12, 20, 16, 9):
        ids = torch.randint(0, 100, (2, n))
        loss, ref = compiled(ids), model(ids)
        assert_close(loss, ref, f"length {n}: loss")
        loss.backward()
        ref.backward()
        assert_grads_match(twin, model, f"length {n}")
    assert not per_shape
    torch._dynamo.reset()


def test_batch_and_length_both_symbolic_train_like_eager():
    """dynamic=True makes Bert's batch and length symbolic: its backward's saved values have sizes
    like [batch * length, hidden] only, so each symbol is an input of the trace too (as Dynamo's
    graphs have them) and reaches the backward; before, the backward failed at its first call ("no
    input of the graph gives the value of ...")."""
    torch.manual_seed(0)
    model = _bert()
    twin = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(twin, dynamic=True)
    for b, n in ((2, 16), (3, 12), (4, 20), (2, 9)):
        ids = torch.randint(0, 100, (b, n))
        out, ref = compiled(input_ids=ids, labels=ids.clone()), model(input_ids=ids, labels=ids.clone())
        assert_close(out.loss, ref.loss, f"{b}x{n}: loss")
        out.loss.backward()
        ref.loss.backward()
        assert_grads_match(twin, model, f"{b}x{n}")
    cf = compiled._aotfuse_compiled
    (family,) = cf._families.values()
    assert not family.failed and cf.compile_count == 1 and _members(cf) == 3
    assert set(family.dims.values()) == {frozenset({0, 1})}


def test_explain_reports_a_members_own_programs_and_saved_values():
    """explain() on a shape that joins a family reports that shape's programs and what it saves (the
    family's record holds the traced shape's), the same as a trace of its own would, and says how the
    family served it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    family = aotfuse.memory_efficient_fusion(__import__("copy").deepcopy(model))
    for n in (3, 5):
        family(torch.randn(n, 4)).sum().backward()
    x = torch.randn(7, 4)
    member = aotfuse.explain(family, x)
    alone = aotfuse.explain(aotfuse.memory_efficient_fusion(__import__("copy").deepcopy(model), dynamic=False), x)
    assert _members(family._aotfuse_compiled) == 1
    assert "joined one symbolic trace" in member.shape_family and "=7" in member.shape_family, member.shape_family
    assert alone.shape_family == ""
    assert [(s, d, b) for _n, s, d, b in member.saved] == [(s, d, b) for _n, s, d, b in alone.saved]
    assert member.saved_bytes == alone.saved_bytes and member.saved_bytes > 0
    assert (member.forward_nodes, member.backward_nodes, member.fused_kernels) == \
        (alone.forward_nodes, alone.backward_nodes, alone.fused_kernels)


@pytest.mark.parametrize("route", ["first_call", "family", "torch_compile_dynamic"])
def test_batches_without_elements_train_like_eager(route):
    """A size-0 dim (an empty batch or sequence) in the middle of the shape: the output gradient of a
    sum is then an expanded tensor (strides 0) torch calls contiguous, and a bias gradient's sum over a
    reshape of it has no stride ranges to tell the reduced dims by. Before: the backward's first run
    failed a view ('shape [1, 32] is invalid for input of size 64'), and after a family or under
    dynamic=True the C program refused the gradient ('AF_ERR_INVALID: input tangents_1: stride 0')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    twin = copy.deepcopy(model)
    if route == "torch_compile_dynamic":
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend="aotfuse", dynamic=True)
    else:
        compiled = aotfuse.memory_efficient_fusion(twin)
    shapes_ = {"first_call": [(2, 0, 16), (0, 3, 16)], "family": [(2, 4, 16), (2, 6, 16), (0, 6, 16), (2, 0, 16)],
               "torch_compile_dynamic": [(2, 4, 16), (2, 0, 16), (0, 5, 16)]}[route]
    for shape in shapes_:
        x = torch.randn(shape)
        out, ref = compiled(x), model(x)
        assert_close(out, ref, f"{route} {shape}: output")
        (out.sum() + out.square().sum()).backward()
        (ref.sum() + ref.square().sum()).backward()
        assert_grads_match(twin, model, f"{route} {shape}")
