"""The C core's partitioners against torch's, on the same joint graphs: saved bytes no more
than torch's min-cut, gradients equal to eager (through torch's aot_function and ours)."""
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function as torch_aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition as torch_min_cut

import aotfuse
from helpers import assert_close, check_module

transformers = pytest.importorskip("transformers")


def _nop(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def _saved_bytes(fw, num_fwd_outputs):
    outs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    total = 0
    for o in list(outs)[num_fwd_outputs:]:
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


def _capture_joint(model, args):
    """The joint graph torch's aot_function builds for model(*args), with aotfuse's decompositions."""
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(params)

    def f(*flat):
        return torch.func.functional_call(model, dict(zip(names, flat[:len(names)])), flat[len(names):])

    store = {}

    def grab(joint, inputs, **kw):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():  # joint holds real constants
            store["joint"] = copy.deepcopy(joint)
        store["inputs"], store["kw"] = inputs, kw
        return torch_min_cut(joint, inputs, **kw)

    cf = torch_aot_function(f, _nop, _nop, partition_fn=grab, decompositions=aotfuse.default_decompositions())
    cf(*params.values(), *args)
    return store


def _gpt2_block():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=32, n_head=4, n_layer=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    block = GPT2Block(cfg)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out

    return Wrap(), (torch.randn(2, 8, 32, requires_grad=True),)


def _bert_layer():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    layer = BertLayer(cfg)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            out = self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    return Wrap(), (torch.randn(2, 8, 32, requires_grad=True),)


def _mlp_gelu():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), (torch.randn(8, 16, requires_grad=True),)


def _hf_model(kind):
    from transformers import (AlbertConfig, AlbertForMaskedLM, BertConfig, BertForMaskedLM, GPT2Config,
                              GPT2LMHeadModel)

    common = dict(vocab_size=100, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=2, hidden_size=32)
    if kind == "bert":
        model = BertForMaskedLM(BertConfig(**common))
    elif kind == "albert":
        model = AlbertForMaskedLM(AlbertConfig(embedding_size=16, **common))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 100, (2, 16))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    return Loss(), (ids,)


CASES = {
    "mlp_gelu": _mlp_gelu,
    "bert_layer": _bert_layer,
    "gpt2_block": _gpt2_block,
    "bert": lambda: _hf_model("bert"),
    "albert": lambda: _hf_model("albert"),
    "gpt2": lambda: _hf_model("gpt2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_bytes_no_more_than_torch_min_cut(case):
    torch.manual_seed(0)
    model, args = CASES[case]()
    store = _capture_joint(model, args)
    kw = store["kw"]
    fw_t, _ = torch_min_cut(copy.deepcopy(store["joint"]), store["inputs"], **kw)
    fw_o, _ = aotfuse.min_cut_rematerialization_partition(copy.deepcopy(store["joint"]), store["inputs"], **kw)
    fw_d, _ = aotfuse.default_partition(copy.deepcopy(store["joint"]), store["inputs"], **kw)
    ours, theirs, default = (_saved_bytes(fw, kw["num_fwd_outputs"]) for fw in (fw_o, fw_t, fw_d))
    assert ours <= theirs, f"{case}: aotfuse saves {ours} bytes, torch's min-cut {theirs}"
    assert ours <= default, f"{case}: min-cut saves {ours} bytes, the default partition {default}"
    stats = fw_o.meta["aotfuse_partition"]
    assert stats.saved_bytes == ours


@pytest.mark.parametrize("partition", ["min_cut", "default"])
@pytest.mark.parametrize("case", ["mlp_gelu", "bert_layer", "gpt2_block"])
def test_gradients_match_eager_through_torch_aot_function(case, partition):
    torch.manual_seed(0)
    model, args = CASES[case]()
    pf = aotfuse.min_cut_rematerialization_partition if partition == "min_cut" else aotfuse.default_partition
    params = dict(model.named_parameters())
    names = list(params)

    def f(*flat):
        return torch.func.functional_call(model, dict(zip(names, flat[:len(names)])), flat[len(names):])

    cf = torch_aot_function(f, _nop, _nop, partition_fn=pf, decompositions=aotfuse.default_decompositions())
    x = args[0].detach().clone().requires_grad_()
    out = cf(*params.values(), x)
    ref = model(args[0])
    assert_close(out, ref, f"{case} output")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, [x, *params.values()], g)
    ref_grads = torch.autograd.grad(ref, [args[0], *params.values()], g)
    for name, a, b in zip(["input", *names], grads, ref_grads):
        assert_close(a, b, f"{case} grad of {name}")


@pytest.mark.parametrize("case", ["bert_layer", "gpt2_block", "bert", "gpt2"])
def test_memory_efficient_fusion_uses_min_cut_and_matches_eager(case):
    torch.manual_seed(0)
    model, args = CASES[case]()
    compiled = check_module(model, *args, steps=2)
    assert compiled._aotfuse_compiled.partition_fn is aotfuse.min_cut_rematerialization_partition
    report = aotfuse.explain(compiled, *args)
    assert report.saved_bytes > 0 and report.backward_nodes > 0


def test_min_cut_recomputes_pointwise_work():
    # LayerNorm + GELU in the middle of two matmuls: the default partition saves the GELU input and
    # output; min-cut saves less and recomputes cheap pointwise ops in the backward.
    # (layer norm decomposed, as it will be by default once the fuser handles its epilogue)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.0), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    dec = aotfuse.default_decompositions(norms=True)
    mc = aotfuse.explain(aotfuse.memory_efficient_fusion(copy.deepcopy(model), decompositions=dec), x)
    df = aotfuse.explain(aotfuse.memory_efficient_fusion(copy.deepcopy(model), decompositions=dec,
                                                         partition_fn=aotfuse.default_partition), x)
    assert mc.saved_bytes < df.saved_bytes
    assert mc.recomputed and not df.recomputed


def test_a_gelus_output_is_recomputed_in_its_gradients_kernel(monkeypatch):
    """The GELU's output is written out in the backward anyway (the second linear's weight gradient
    reads it); functorch's rule saves it (AOTFUSE_RECOMPUTE_MATERIALIZED=0). By default it is
    recomputed from the first linear's output, which its gradient reads anyway: the forward saves
    its bytes less. The weight gradient's matmul sinks below the GELU's gradient, so one backward
    kernel computes the GELU, its output and its gradient (one erf, as 1 + erf: aotfuse::erf1p, which
    both add 1 to); eager's values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 32, 64)
    reports = {}
    for mode in ("auto", "0"):
        monkeypatch.setenv("AOTFUSE_RECOMPUTE_MATERIALIZED", mode)
        compiled = check_module(copy.deepcopy(model), x, steps=2)
        reports[mode] = aotfuse.explain(compiled, x)
        if mode == "auto":
            source = compiled._aotfuse_compiled.records[-1].programs["backward"].program.source
            units = [u for u in source.split("//@af-unit") if "af_erf1p(v" in u]
            assert len(units) == 1 and units[0].count("af_erf1p(v") == 1 and "af_exp_nonpos(v" in units[0], source
            assert "af_erf(v" not in source, source
    gelu_out = 8 * 32 * 256 * 4
    assert reports["auto"].saved_bytes == reports["0"].saved_bytes - gelu_out, (reports["auto"].saved, reports["0"].saved)
    monkeypatch.setenv("AOTFUSE_RECOMPUTE_MATERIALIZED", "sometimes")
    for fallback in ("eager", "error"):  # a setting it cannot take is an error, not a reason to fall back
        with pytest.raises(aotfuse.config.ConfigError, match="AOTFUSE_RECOMPUTE_MATERIALIZED must be auto, 0 or 1"):
            aotfuse.memory_efficient_fusion(copy.deepcopy(model), fallback=fallback)(x)


class _GatedMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, width, hidden):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_a_gated_mlps_silu_recompute_and_gradient_are_one_kernel():
    """Without biases autograd puts a linear layer's weight gradient mm(g^T, y) before its input
    gradient mm(g, W^T), and views the product's gradient for the up projection's weight gradient
    right after making it. The partitioner sinks the weight gradient past that one sibling matmul
    and runs the views just before their matmuls (partition.c, sink_matmuls and defer_views), so one
    backward kernel recomputes SiLU and computes its gradient: the sigmoid once, no float32 gate or
    sigmoid stored for a second kernel. Gradients as eager's, and as float64's."""
    torch.manual_seed(0)
    model = _GatedMLP(64, 176)
    x = torch.randn(4, 16, 64)
    compiled = check_module(copy.deepcopy(model), x, steps=2)
    backward = compiled._aotfuse_compiled.records[-1].programs["backward"].program
    groups: dict[int, list[str]] = {}
    for op, _kind, group in backward.node_groups():
        if group >= 0:
            groups.setdefault(group, []).append(op)
    silu = [ops for ops in groups.values() if "aten::sigmoid.default" in ops]
    assert len(silu) == 1, groups
    assert "aten::sub.Tensor" in silu[0] and silu[0].count("aten::mul.Tensor") >= 5, silu  # SiLU's gradient too
    assert sum("aten::sub.Tensor" in ops for ops in groups.values()) == 1, groups  # not split in two kernels
    wide = copy.deepcopy(model).double()
    wide(x.double()).sum().backward()
    step = copy.deepcopy(model)
    aotfuse.memory_efficient_fusion(step)(x).sum().backward()
    for (name, p), q in zip(step.named_parameters(), wide.parameters()):
        assert_close(p.grad, q.grad.float(), f"grad of {name} against float64's")


class _ResidualBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.lin(x)))


def test_a_residual_stream_is_not_rebuilt_whole_at_the_backwards_start(monkeypatch):
    """Blocks x + gelu(norm(linear(x))), no dropout: every stream value is a linear layer's input,
    written out by the backward anyway for its weight gradient. Recomputing the last one needs all
    before it, so the min cut that saved only the linear outputs rebuilt the whole stream at the
    backward's start and held each value until its own layer's gradient: the step peaked above
    eager's (AOTFUSE_RECOMPUTE_CHAINS=1 keeps that cut). By default a recompute makes one stream value:
    every other one is saved, and the peak is below eager's; eager's gradients either way."""
    from aotfuse.bench import _cpu_peak

    torch.manual_seed(0)
    layers, width = 12, 128
    model = nn.Sequential(*[_ResidualBlock(width) for _ in range(layers)])
    x = torch.randn(256, width)

    def step(m):
        for p in m.parameters():
            p.grad = None
        m(x).sum().backward()

    peaks, saved_streams = {}, {}
    for mode in ("eager", "0", "1"):
        if mode == "eager":
            m = copy.deepcopy(model)
        else:
            monkeypatch.setenv("AOTFUSE_RECOMPUTE_CHAINS", mode)
            # one step: the sum's gradients (up to ~500) at SGD's lr 0.1 make a second step chaotic,
            # eager's own float32 rounding then as far from float64's as aotfuse's from eager's
            m = check_module(copy.deepcopy(model), x)
            report = aotfuse.explain(m, x)
            saved_streams[mode] = [s[0] for s in report.saved if re.fullmatch(r"add(_\d+)?", s[0])]
        step(m)
        peaks[mode] = _cpu_peak(lambda: step(m))
    assert len(saved_streams["0"]) == layers // 2 - 1 and not saved_streams["1"], saved_streams
    assert peaks["0"] < peaks["eager"] < peaks["1"], peaks


def test_default_partition_never_reruns_a_forward_node():
    # native_layer_norm kept whole: its mean and rstd outputs, read only by the backward, are saved
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(model, partition_fn=aotfuse.default_partition),
                             torch.randn(4, 32))
    assert not report.recomputed
    assert sum(1 for s in report.saved if s[1] == (4, 1)) == 2  # mean and rstd


def test_random_ops_are_not_recomputed(monkeypatch):
    # ATen's dropout (AOTFUSE_FALLBACK_RANDOM=1): its mask is saved, never redrawn in the backward.
    # (aotfuse's own dropout recomputes its mask from a saved seed: tests/test_rng.py.)
    monkeypatch.setenv("AOTFUSE_FALLBACK_RANDOM", "1")
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.GELU(), nn.Linear(64, 16))
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x = torch.randn(8, 16)
    compiled(x)  # compile outside the RNG comparison
    torch.manual_seed(1)
    out = compiled(x)
    torch.manual_seed(1)
    ref = model(x)
    assert_close(out, ref, "output with dropout (same seed, same mask)")
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(compiled.named_parameters(), model.parameters()):
        # the backward uses the forward's mask, not a fresh draw
        assert_close(p.grad, q.grad, f"grad of {name} with dropout")
    record = compiled._aotfuse_compiled.records[-1]
    bw = record.graphs["backward"]
    assert not any("dropout" in str(n.target) or "bernoulli" in str(n.target) or "rand" in str(n.target)
                   for n in bw.graph.nodes if n.op == "call_function")


class _PreLNChain(nn.Module):
    """A pre-LN residual stream: h = h + dropout(fc(ln(h))) per layer, then a final layer norm."""

    def __init__(self, layers: int = 4, d: int = 16):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers + 1))
        self.fcs = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = x
        for ln, fc in zip(self.lns, self.fcs):
            h = h + self.drop(fc(ln(h)))
        return self.lns[-1](h).pow(2).sum()


@pytest.mark.parametrize("ban", [True, False])
def test_a_residual_stream_is_not_rebuilt_through_every_dropout(ban):
    """With norms decomposed the backward reads the residual stream in kernels, and the min-cut
    would rebuild it from the first layer on, every layer's random numbers drawn again in one kernel
    (GPT2: 25 an element). ban_chained_random (the default) saves a value whose recompute needs two
    or more random nodes instead; the gradients are the same."""
    import collections
    import functools

    from aotfuse.decompositions import default_decompositions

    torch.manual_seed(0)
    model, x = _PreLNChain(), torch.randn(8, 16, requires_grad=True)
    compiled = aotfuse.memory_efficient_fusion(
        model, decompositions=default_decompositions(norms=True),
        partition_fn=functools.partial(aotfuse.min_cut_rematerialization_partition, ban_chained_random=ban))
    torch.manual_seed(1)
    compiled(x).backward()
    record = compiled._aotfuse_compiled.records[-1]
    lowered = record.programs["backward"]
    programs = [lowered.program] + [v.program for v in getattr(lowered, "variants", {}).values()]
    draws = collections.Counter(grp for p in programs for op, _k, grp in p.node_groups()
                                if op == "aotfuse::rng_uniform.default" and grp >= 0)
    assert max(draws.values()) == (1 if ban else 4), draws
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    if ban:  # the same masks (same seed) either way: the same gradients
        torch.manual_seed(0)
        other, x2 = _PreLNChain(), x.detach().clone().requires_grad_()
        plain = aotfuse.memory_efficient_fusion(
            other, decompositions=default_decompositions(norms=True),
            partition_fn=functools.partial(aotfuse.min_cut_rematerialization_partition, ban_chained_random=False))
        torch.manual_seed(1)
        plain(x2).backward()
        for i, (a, b) in enumerate(zip(grads, [x2.grad] + [p.grad for p in other.parameters()])):
            assert_close(a, b, f"gradient {i}, banned against rebuilt", atol=1e-5, rtol=1e-5)  # masks alike; roundings differ


def test_parameters_are_free_to_save():
    """A parameter lives anyway, so saving it costs nothing (torch's treat_parameters_as_free_to_save):
    a linear layer's backward reads its weight, not the transposed view the forward made, which
    the backward would have to make again as a tensor. Saved bytes are the same (a view has its
    base's bytes); gradients match eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    compiled = check_module(model, x, steps=2)
    rec = compiled._aotfuse_compiled.records[-1]
    saved = [name for name, _shape, _dtype, _n in rec.saved]
    # the second layer's weight (primals_3) is what the backward reads for the tanh's gradient
    # (the first one's would serve only the input's, which needs none)
    assert "primals_3" in saved, saved
    assert not [s for s in saved if s.startswith(("t_", "permute"))] and "t" not in saved, saved  # no views of it


def test_backward_constants_come_before_the_nodes_moved_into_the_c_cores_order():
    """The extractor may copy a constant (a tensor the forward built with torch.tensor, as
    DeBERTa-v2's attention scale) anywhere in the backward; the C core's run order may read it
    early. Seen as 'used before it has been defined' on DeBERTa-v2 (tests/test_more_models.py)."""
    import torch.fx as fx

    from aotfuse.partition import _reorder

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    c = graph.get_attr("const")
    b = graph.call_function(torch.ops.aten.add.Tensor, (a, c))
    graph.output((b,))
    root = nn.Module()
    root.const = torch.tensor(3.0)
    bw = fx.GraphModule(root, graph)
    _reorder(bw, [a.name, b.name])  # lints the graph: raised before constants were moved first
    assert [n.op for n in bw.graph.nodes] == ["placeholder", "get_attr", "call_function", "call_function", "output"]
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(bw(x)[0], x * x + 3)


def _graph_of(build):
    import torch.fx as fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    outs = build(graph, x)
    graph.output(tuple(outs))
    return graph


def _targets(graph):
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_cse_merges_repeated_calls_and_keeps_what_differs():
    """The same op on the same arguments is computed once; a different argument, or 1 against 1.0
    (equal in Python, different ops' arguments), keeps its own node."""
    from aotfuse.partition import _cse

    aten = torch.ops.aten

    def build(g, x):
        a = g.call_function(aten.mul.Tensor, (x, x))
        b = g.call_function(aten.mul.Tensor, (x, x))  # a again
        c = g.call_function(aten.add.Tensor, (a, 1))
        d = g.call_function(aten.add.Tensor, (b, 1.0))  # 1.0, not 1
        e = g.call_function(aten.add.Tensor, (b, 1))  # c again, once b is a
        f = g.call_function(aten.sum.dim_IntList, (e, [0]))
        h = g.call_function(aten.sum.dim_IntList, (c, [1]))  # another dim
        return [c, d, e, f, h]

    graph = _graph_of(build)
    _cse(graph)
    graph.lint()
    assert _targets(graph) == ["aten.mul.Tensor", "aten.add.Tensor", "aten.add.Tensor",
                               "aten.sum.dim_IntList", "aten.sum.dim_IntList"]
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    assert out[0] is out[2] and out[1] is not out[0]


def test_cse_keeps_random_ops_and_calls_across_a_mutation():
    from aotfuse.partition import _cse

    aten = torch.ops.aten

    def build(g, x):
        r1 = g.call_function(aten.rand_like.default, (x,))
        r2 = g.call_function(aten.rand_like.default, (x,))  # each draw is its own
        s1 = g.call_function(aten.sin.default, (x,))
        g.call_function(aten.copy_.default, (x, r1))  # x changes here
        s2 = g.call_function(aten.sin.default, (x,))  # not s1
        s3 = g.call_function(aten.sin.default, (x,))  # s2 again
        return [r2, s1, s2, s3]

    graph = _graph_of(build)
    _cse(graph)
    graph.lint()
    assert _targets(graph) == ["aten.rand_like.default", "aten.rand_like.default", "aten.sin.default",
                               "aten.copy_.default", "aten.sin.default"]


def test_cse_keeps_apart_values_sharing_storage_with_the_outputs():
    """Two identical views returned as outputs are two tensors in eager (the caller may mutate
    one); torch's CSE keeps them apart too."""
    from aotfuse.partition import _cse

    aten = torch.ops.aten
    base = torch.zeros(2, 2)

    def build(g, x):
        x.meta["val"] = base
        outs = []
        for _ in range(2):
            v = g.call_function(aten.view.default, (x, [4]))
            v.meta["val"] = base.view(4)
            outs.append(v)
        w1 = g.call_function(aten.cos.default, (x,))
        w2 = g.call_function(aten.cos.default, (x,))  # private values: merged
        w1.meta["val"], w2.meta["val"] = torch.zeros(2, 2), torch.zeros(2, 2)
        return outs + [g.call_function(aten.add.Tensor, (w1, w2))]

    graph = _graph_of(build)
    _cse(graph)
    assert _targets(graph) == ["aten.view.default", "aten.view.default", "aten.cos.default", "aten.add.Tensor"]


def test_identity_clones_are_dropped_and_layout_changing_ones_kept():
    """A clone with its value's own layout is a copy of a value nothing mutates (a functional graph):
    its readers read the value. A clone that makes a value dense, one of an input, and one that is an
    output (a distinct tensor in eager) stay."""
    import torch.fx as fx

    from aotfuse.partition import _drop_identity_clones

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(4, 4)
    a = g.call_function(aten.sin.default, (x,))
    a.meta["val"] = torch.zeros(4, 4)
    c1 = g.call_function(aten.clone.default, (a,))  # identity: dropped
    c1.meta["val"] = torch.zeros(4, 4)
    t = g.call_function(aten.t.default, (a,))
    t.meta["val"] = torch.zeros(4, 4).t()
    c2 = g.call_function(aten.clone.default, (t,), {"memory_format": torch.contiguous_format})  # makes it dense
    c2.meta["val"] = torch.zeros(4, 4)
    c3 = g.call_function(aten.clone.default, (x,))  # of an input
    c3.meta["val"] = torch.zeros(4, 4)
    c4 = g.call_function(aten.clone.default, (a,))  # an output
    c4.meta["val"] = torch.zeros(4, 4)
    s = g.call_function(aten.add.Tensor, (c1, c2))
    s.meta["val"] = torch.zeros(4, 4)
    g.output((s, c3, c4))
    assert _drop_identity_clones(g) == 1
    g.lint()
    assert s.args[0] is a and c2 in g.nodes and c3 in g.nodes and c4 in g.nodes


def test_attention_without_dropout_saves_the_probabilities_once(monkeypatch):
    """Dropout with p = 0 is a clone of the attention probabilities: without dropping it the min cut
    saved the copy and the scores to recompute the probabilities from (176 against 108 KB here).
    torch 2.14's dropout decomposition returns its input at p = 0 where 2.13's made that clone, so
    the clone is written here as 2.13 traced it, and the test reads the same on either."""
    from test_attention import Attention

    dropout = F.dropout
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, inplace=False:
                        x.clone() if p == 0 and training else dropout(x, p, training, inplace))
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")
    x, m = torch.randn(2, 64, 16), torch.zeros(2, 1, 1, 64)
    probs = 2 * 2 * 64 * 64 * 4
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(Attention()), x, m)
    big = [s for s in report.saved if s[3] >= probs]
    assert len(big) == 1, report.saved
    monkeypatch.setenv("AOTFUSE_DROP_CLONES", "0")
    kept = aotfuse.explain(aotfuse.memory_efficient_fusion(Attention()), x, m)
    assert report.saved_bytes <= kept.saved_bytes  # the kept copy, read by a bmm, is recomputed instead
    monkeypatch.setenv("AOTFUSE_RECOMPUTE_MATERIALIZED", "0")  # functorch's rule: then it was saved too
    before = aotfuse.explain(aotfuse.memory_efficient_fusion(Attention()), x, m)
    assert report.saved_bytes < before.saved_bytes


def _pow_in_place(a):
    v = a * 2
    a.pow_(2)
    return v


def _clamp_through_a_view(a):
    a.transpose(0, 1).clamp_(-0.5, 0.5)
    return a @ a.transpose(-1, -2)


def _unsqueeze_in_place(a):
    a.unsqueeze_(0)
    return torch.sigmoid(a).reshape(-1)


@pytest.mark.parametrize("fn,shape", [(_pow_in_place, (3,)), (_clamp_through_a_view, (2, 3)),
                                      (_clamp_through_a_view, (0, 3)), (_unsqueeze_in_place, (4,))],
                         ids=["pow_", "clamp_through_view", "empty", "unsqueeze_"])
@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
def test_an_input_requiring_grad_updated_in_place_is_saved_as_it_was(fn, shape, how):
    """An input requiring grad (a non-leaf) that the function updates in place: AOTAutograd writes
    its new value (or shape) back after the forward, so the min cut's saved input (or a view of it)
    was no longer what the backward was traced with, and autograd refused it as modified in place
    (found by a random aliasing sweep; the first case fails under torch's own min cut too). Such an
    input is saved as a copy made at the forward's start, as updated parameters and buffers were."""
    def grad_of(f):
        torch.manual_seed(0)
        leaf = torch.randn(shape, requires_grad=True)
        a = leaf.clone()
        out = f(a)
        (out * 1.5).sum().backward()
        return leaf.grad, a

    torch._dynamo.reset()
    make = aotfuse.memory_efficient_fusion if how == "memory_efficient_fusion" else \
        (lambda f: torch.compile(f, backend="aotfuse"))
    got, got_a = grad_of(make(fn))
    want, want_a = grad_of(fn)
    assert_close(got, want, f"{fn.__name__} gradient", atol=1e-6, rtol=1e-6)
    assert got_a.shape == want_a.shape and torch.allclose(got_a, want_a, atol=1e-6)


class _Rotary(nn.Module):
    """Llama's pattern: cos and sin of the positions times the inverse frequencies, computed once
    and read by every layer's rotary product."""

    def __init__(self, layers=3, d=32):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.register_buffer("inv", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))

    def forward(self, x):
        t = torch.arange(x.shape[1], dtype=torch.float32)
        emb = torch.cat([torch.outer(t, self.inv)] * 2, -1)
        cos, sin = emb.cos(), emb.sin()
        for lin in self.lins:
            h = lin(x)
            x = x + h * cos + torch.roll(h, 1, -1) * sin
        return x.pow(2).mean()


@pytest.mark.parametrize("vector_libm, recompute", [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")])
def test_values_of_unvectorized_libm_calls_are_saved_not_recomputed(vector_libm, recompute, monkeypatch):
    """A CPU value whose op calls a costly function is never recomputed (ban_scalar_calls): a libm
    call GCC does not vectorize ran the kernel recomputing it scalar whole, once per layer (Llama's
    rotary cos and sin as libm's cosf and sinf, 8 backward kernels of 1.3 ms each at [4, 128, 4, 64]
    in bf16, 10 ns an element). Since 2026-12-06 cos and sin are the C prelude's vectorized af_cos and
    af_sin (AOTFUSE_VECTOR_LIBM=0 makes them libm's calls again), still 6x exp's cost and recomputed
    per element of the broadcast that reads them (Llama bf16's step 3% longer), so still saved:
    the backward calls neither, unless AOTFUSE_RECOMPUTE_SCALAR_CALLS=1 lets the cut recompute them
    as other pointwise work. Each way trains like eager and float64."""
    from aotfuse.testing import compare_models

    monkeypatch.setenv("AOTFUSE_VECTOR_LIBM", vector_libm)
    monkeypatch.setenv("AOTFUSE_RECOMPUTE_SCALAR_CALLS", recompute)
    x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))
    holder = []

    def compile_fn(model):
        compiled = aotfuse.memory_efficient_fusion(model)
        holder.append(compiled)
        return compiled

    def make():
        torch.manual_seed(0)
        return _Rotary()

    report = compare_models(make, lambda: (x,), steps=2, compile_fn=compile_fn,
                            name=f"rotary, vector libm={vector_libm}, recompute={recompute}")
    report.assert_ok()
    programs = holder[0]._aotfuse_compiled.records[-1].programs
    backward = "".join(low.program.source for stage, low in programs.items() if stage.startswith("backward"))
    calls = lambda src: (re.search(r"= af_cos\(v", src) is not None, re.search(r"= af_sin\(v", src) is not None)
    assert calls(backward) == (recompute == "1", recompute == "1")
    assert calls(programs["forward"].program.source) == (True, True)
    # the prelude gives them libm's calls or the vectorized polynomials (with the reduction's table)
    forward = programs["forward"].program.source
    assert ("return cosf(x);" in forward, "af_2opi_w0" in forward) == ((vector_libm == "0"), (vector_libm == "1"))
