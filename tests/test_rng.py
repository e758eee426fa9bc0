"""aotfuse's dropout: a counter-based generator (Threefry-2x32-20) evaluated inside fused kernels,
an 8-byte seed saved instead of a mask, and the mask recomputed in the backward.

The generator is checked bit for bit against a pure-Python Threefry (and Random123's known
answer); the fused kernels against the op's stand-alone program; the statistics of the numbers;
the backward's use of the forward's mask; torch.manual_seed repeatability; ATen's dropout under
AOTFUSE_FALLBACK_RANDOM=1 and where no kernels are generated."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
import aotfuse.rng  # noqa: F401  (registers aotfuse::rng_uniform)
from aotfuse import _C
from aotfuse.lower import build_graph
from aotfuse.nvrtc_check import compile_report, nvrtc_available
from helpers import assert_close

_M = 0xFFFFFFFF
_SEED_HIGH = 2**63 - 1


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & _M


def threefry2x32_20(key, counter):
    """The reference: Random123's Threefry-2x32 with 20 rounds, first output word."""
    k0, k1 = key & _M, (key >> 32) & _M
    ks = [k0, k1, 0x1BD11BDA ^ k0 ^ k1]
    x0, x1 = (counter + k0) & _M, ((counter >> 32) + k1) & _M
    rot = [13, 15, 26, 6, 17, 29, 16, 24]
    for r in range(20):
        x0 = (x0 + x1) & _M
        x1 = _rotl(x1, rot[r % 8]) ^ x0
        if r % 4 == 3:
            s = (r + 1) // 4
            x0 = (x0 + ks[s % 3]) & _M
            x1 = (x1 + ks[(s + 1) % 3] + s) & _M
    return x0


def reference_uniform(seed: int, n: int, start: int = 0) -> torch.Tensor:
    words = [threefry2x32_20(seed, i) for i in range(start, start + n)]
    return (torch.tensor(words, dtype=torch.float64) * 2.0**-32).float()


def test_reference_matches_random123_known_answer():
    assert threefry2x32_20(0, 0) == 0x6B200159  # Random123's kat_vectors: threefry2x32_20, zero key and counter


@pytest.mark.parametrize("seed", [0, 1, 123456789123456789, _SEED_HIGH - 1])
def test_uniform_is_threefry_bit_for_bit(seed):
    u = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [7, 9])
    assert u.dtype == torch.float32 and u.shape == (7, 9)
    assert torch.equal(u.flatten(), reference_uniform(seed, 63))
    # the counter is the row-major index: a later block of a big tensor matches too
    big = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [300, 1000])
    assert torch.equal(big.flatten()[123_000:123_040], reference_uniform(seed, 40, start=123_000))


def test_uniform_statistics():
    u = torch.ops.aotfuse.rng_uniform(torch.tensor(42), [1 << 21]).double()
    n = u.numel()
    assert 0.0 <= u.min() and u.max() <= 1.0
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)  # chi-square over 64 bins, 63 dof
    expected = n / 64
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 130, chi2  # p < 1e-6 for 63 dof
    # neighbouring elements and neighbouring seeds are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01
    v = torch.ops.aotfuse.rng_uniform(torch.tensor(43), [1 << 21]).double()
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.01


def test_bad_seed_is_a_clear_error():
    with pytest.raises(ValueError, match="int64 0-dim"):
        torch.ops.aotfuse.rng_uniform(torch.tensor([1, 2]), [3])
    with pytest.raises(ValueError, match="stream"):
        torch.ops.aotfuse.rng_uniform(torch.tensor(1), [3], -1)


@pytest.mark.parametrize("seed", [0, _SEED_HIGH - 1])
def test_a_stream_is_the_seed_plus_the_stream_as_key(seed):
    for stream in (1, 2, 12345):
        u = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [5, 7], stream)
        assert torch.equal(u.flatten(), reference_uniform((seed + stream) % 2**64, 35)), stream
    a, b = (torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [1 << 18], k).double() for k in (0, 1))
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02  # neighbouring streams: uncorrelated


class _TwoDrops(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = nn.functional.dropout(x, 0.3, training=True) * 2.0
        return nn.functional.dropout(torch.tanh(self.fc(h)), 0.5, training=True) * 3.0


def test_dropouts_share_one_seed_each_on_its_stream():
    """One seed draw per step however many dropouts (an ATen call and a saved tensor each
    before): the k-th dropout uses stream k; the backward recomputes the same masks."""
    torch.manual_seed(0)
    model = _TwoDrops()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x = torch.randn(16, 64, requires_grad=True)
    report = aotfuse.explain(compiled, x)
    assert report.forward_program.count("aten::randint") == 1, report.forward_program
    assert sum(1 for s in report.saved if s[1] == () and "int64" in str(s[2])) == 1, report.saved
    torch.manual_seed(9)
    out = compiled(x)
    torch.manual_seed(9)
    (seed,) = _seeds_drawn(1)
    keep0 = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [16, 64]) > 0.3
    keep1 = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [16, 64], 1) > 0.5
    xr = x.detach().requires_grad_()
    ref = torch.tanh(nn.functional.linear(xr * keep0 / 0.7 * 2.0, model.fc.weight, model.fc.bias)) * keep1 / 0.5 * 3.0
    assert_close(out, ref, "two dropouts on streams 0 and 1")
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), xr)
    assert_close(g, g_ref, "the backward recomputes both masks")
    assert not torch.equal(keep0, keep1), "the two dropouts drew the same mask"


def test_inference_graphs_share_seeds_too():
    torch.manual_seed(0)
    model = _TwoDrops()
    compiled = aotfuse.memory_efficient_fusion(model)
    with torch.no_grad():
        compiled(torch.randn(4, 64))
    prog = compiled._aotfuse_compiled.records[-1].programs["inference"].program
    assert str(prog).count("aten::randint") == 1, str(prog)


class _DropMLP(nn.Module):
    def __init__(self, p=0.3, d=64):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))


def _compiled_mlp(rows, p=0.5):
    """A dropout MLP, its compiled copy (already compiled) and an input of `rows` rows."""
    torch.manual_seed(0)
    model = _DropMLP(p=p)
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x = torch.randn(rows, 64)
    compiled(x)
    return model, compiled, x


def _seeds_drawn(n):
    """The seeds the next n dropouts of a compiled function draw from torch's generator."""
    return [int(torch.randint(0, _SEED_HIGH, ())) for _ in range(n)]


def test_fused_dropout_mask_is_the_generator_and_backward_reuses_it():
    torch.manual_seed(0)
    p = 0.3
    drop = aotfuse.memory_efficient_fusion(lambda x: nn.functional.dropout(x, p, training=True) * 2.0)
    x = torch.randn(64, 300, requires_grad=True)
    drop(x)  # compile
    torch.manual_seed(7)
    out = drop(x)
    torch.manual_seed(7)
    (seed,) = _seeds_drawn(1)
    keep = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [64, 300]) > p
    assert_close(out, x.detach() * keep / (1 - p) * 2.0, "fused dropout against the generator's mask")
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(g != 0, keep), "the backward's mask is not the forward's"
    assert_close(g, keep.float() * (2.0 / (1 - p)), "dropout gradient")
    kept = keep.float().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5


def test_dropout_saves_a_seed_not_a_mask_and_recomputes_it():
    torch.manual_seed(0)
    model = _DropMLP()
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(model), torch.randn(32, 64, requires_grad=True))
    saved_dtypes = [s[2] for s in report.saved]
    assert "torch.bool" not in saved_dtypes and not any("b8" in str(d) or "bool" in str(d) for d in saved_dtypes), report
    assert any(s[1] == () and "int64" in str(s[2]) for s in report.saved), report  # the seed
    assert any("rng_uniform" in line for line in report.backward_program.splitlines()), report.backward_program
    assert "native_dropout" not in report.forward_program
    # the generator runs inside kernels, forward and backward
    for prog in (report.forward_program, report.backward_program):
        assert "rng_uniform" in prog


def test_dropout_training_matches_eager_statistically_and_repeats_under_manual_seed():
    model, compiled, x = _compiled_mlp(rows=16)
    torch.manual_seed(3)
    a = compiled(x)
    torch.manual_seed(3)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b), "same torch seed, different dropout masks"
    assert not torch.equal(b, c), "two calls drew the same mask"
    # the expectation over masks is the eval output (dropout is unbiased): average many calls
    with torch.no_grad():
        mean = torch.stack([compiled(x) for _ in range(400)]).mean(0)
        ref = model.eval()(x)
    assert (mean - ref).abs().mean() < 0.05 * ref.abs().mean() + 1e-3


@pytest.mark.parametrize("dim", [-1, 0], ids=["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dropout_dtypes_and_reductions_in_one_kernel(dtype, dim):
    """Dropout inside a kernel that also reduces (row sums, or column sums as for bias gradients)."""
    p = 0.25

    def f(x):
        y = torch.ops.aten.native_dropout(x, p, True)[0] * 3.0
        return y.sum(dim)

    compiled = aotfuse.aot_function(f)
    x = torch.randn(48, 130, dtype=dtype)
    compiled(x)
    torch.manual_seed(11)
    s = compiled(x)
    torch.manual_seed(11)
    (seed,) = _seeds_drawn(1)
    keep = torch.ops.aotfuse.rng_uniform(torch.tensor(seed), [48, 130]) > p
    ref = ((keep.to(dtype) * x) * (1 / (1 - p))) * 3.0
    prog = compiled.records[-1].programs["inference"].program
    groups = {op.split(".")[0]: group for op, _kind, group in prog.node_groups()}
    assert groups["aotfuse::rng_uniform"] >= 0 and groups["aotfuse::rng_uniform"] == groups["aten::sum"], groups
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert_close(s.float(), ref.float().sum(dim), f"sums of the dropout over dim {dim}", atol=tol, rtol=tol)


def test_eval_and_p0_have_no_generator():
    model = _DropMLP(p=0.0)
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(model), torch.randn(4, 64, requires_grad=True))
    assert "rng_uniform" not in report.forward_program and "randint" not in report.forward_program
    model = _DropMLP(p=0.5).eval()
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(model), torch.randn(4, 64, requires_grad=True))
    assert "rng_uniform" not in report.forward_program


_why = nvrtc_available()


@pytest.mark.skipif(_why is not None, reason=f"no NVRTC library here: {_why}")
@pytest.mark.parametrize("kind", ["pointwise", "rows", "columns"])
def test_dropout_cuda_source_compiles(kind):
    from aotfuse.decompositions import default_decompositions

    def f(x, g):  # native_dropout, as AOTAutograd's graphs have it (make_fx alone lowers F.dropout otherwise)
        y = torch.ops.aten.native_dropout(x * 2.0, 0.1, True)[0] * g
        return y if kind == "pointwise" else y.sum(-1) if kind == "rows" else y.sum(0)

    from aotfuse.rng import share_seeds

    x, g = torch.randn(64, 256), torch.randn(64, 256)
    gm = make_fx(f, decomposition_table=default_decompositions(random=True), tracing_mode="fake")(x, g)
    source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
    assert [l["kind"] for l in launches] == [kind], launches
    assert source.count("= af_rand(sv") == 1, source
    if kind == "pointwise":  # a second dropout on stream 1 of the same seed
        gm = make_fx(lambda x, g: f(torch.ops.aten.native_dropout(x, 0.2, True)[0], g),
                     decomposition_table=default_decompositions(random=True), tracing_mode="fake")(x, g)
        assert share_seeds(gm) == 1
        source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
        assert source.count("= af_rand(sv") == 2 and "+ af_s1, iv" in source, source  # streams: kernel parameters
        assert [l["streams"] for l in launches] == [[0, 1]], launches
    for arch in (80, 90):
        kernels = compile_report(source, arch)
        assert kernels and all(k["registers"] for k in kernels)


@pytest.mark.parametrize("env", [{"AOTFUSE_FALLBACK_RANDOM": "1"}, {"AOTFUSE_FUSION": "0"}, {"AOTFUSE_BACKEND": "aten"},
                                 {"AOTFUSE_BACKEND": "cuda"}],
                         ids=["fallback-random", "no-fusion", "aten-backend", "cpu-tensors-without-kernels"])
def test_aten_dropout_where_asked_or_without_kernels(monkeypatch, env):
    """Eager's masks for the same seed (the backward with ATen's mask: test_partition.py)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model, compiled, x = _compiled_mlp(rows=8)
    torch.manual_seed(2)
    out = compiled(x)
    torch.manual_seed(2)
    assert_close(out, model(x), f"ATen's dropout ({env}): eager's masks")
    fw = compiled._aotfuse_compiled.records[-1].graphs["forward"]
    assert not any("rng_uniform" in str(n.target) for n in fw.graph.nodes)
