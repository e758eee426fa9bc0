"""The generated CUDA kernels' numbers, without a GPU: each CUDA group runs in the host emulation of
tests/cuda_emu.py (the generated source with its prelude swapped, threads as real threads,
barriers and warp shuffles emulated) on eager's input values, and its outputs must equal eager's.
This checks the kernels' index math, loop skeletons, reductions and vectorized variants in CI;
the GPU itself is checked by `pytest -m cuda` (tests/test_cuda.py)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse.rng  # noqa: F401  (registers aotfuse::rng_uniform)
from aotfuse import _C
import cuda_emu
from test_fusion import (EPILOGUE_CASES, OP_CASES, _inputs, nan_phases_case, pads_through_views, pads_through_views_inputs,
                         random_remapped_window_graph, random_view_read_graph, random_window_graph,
                         select_cases, select_inputs, window_cases, window_inputs)

aten = torch.ops.aten
_why = cuda_emu.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no CUDA emulation here: {_why}")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


from test_cuda_codegen import OP_CHUNKS, _all_ops  # noqa: E402  (the op table in kernels of 30 outputs)


@pytest.mark.parametrize("vectorized", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("layout", ["contiguous", "broadcast", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_op_table_expression_matches_eager(dtype, layout, vectorized):
    args = _inputs(dtype, layout)
    for cases in OP_CHUNKS:
        gm = make_fx(lambda a, b, c: _all_ops(a, b, c, cases))(*args)
        ran = cuda_emu.check(gm, args, f"{dtype} {layout}", vectorized=vectorized)
        assert ran and all(l["kind"] == "pointwise" for l in ran), ran
        if vectorized and layout == "contiguous":
            assert any(l["vec_blocks"] > 0 for l in ran), "no vectorized variant ran"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reductions_of_each_kind_match_eager(dtype):
    def f(x, b, y, big):
        h = x * b + 1.0
        rows = h.sum(-1, keepdim=True), h.amax(-1), h.mean(-1), h.amin(-1, keepdim=True)  # a warp per row
        cols = (y * 0.5 + 1.0).sum(0)  # bias-gradient shape: two-pass column reduction
        long_rows = (big * 2.0).exp().sum(-1)  # a block per row (rows over 2048)
        total = (x * y).sum()  # everything into one value
        return rows + (cols, long_rows, total)

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 96, generator=g).to(dtype), torch.randn(64, 96, generator=g).to(dtype)
    b, big = torch.randn(96, generator=g).to(dtype), torch.randn(3, 5000, generator=g).to(dtype)
    ran = cuda_emu.check(make_fx(f)(x, b, y, big), (x, b, y, big), str(dtype))
    kinds = sorted(l["kind"] for l in ran)
    assert "rows" in kinds and "columns" in kinds, kinds
    assert any(l["kind"] == "rows" and l["threads"] == 512 for l in ran), "no block-per-row kernel ran"


def test_kernels_whose_threads_never_meet_run_serially_and_the_others_as_threads():
    """cuda_emu.h's emu_launch_serial runs a kernel one CUDA thread after another on the calling thread
    (no thread and barrier per CUDA thread: EfficientNet's emulation spent minutes there); only kernels
    with no barrier, shuffle or shared memory take it, and they still equal eager (every output poisoned
    with NaN first, so a thread left out cannot pass)."""
    def f(x, y, z):
        return (z * 3.0 + 1.0).sigmoid(), (x * 2.0).sum(-1), (y - 1.0).sum(0)

    g = torch.Generator().manual_seed(5)
    x, y, z = torch.randn(40, 300, generator=g), torch.randn(40, 300, generator=g), torch.randn(7, 13, generator=g)
    gm = make_fx(f)(x, y, z)
    ran = cuda_emu.check(gm, (x, y, z), "serial")
    declared = cuda_emu._library(cuda_emu.source_of(gm)).declared
    alone = {k: v[2] for k, v in declared.items()}
    by_kind = {l["kind"]: [alone[n] for s in ("", "_v", "_f") if (n := f"af_kernel_{l['body']}{s}") in alone]
               for l in ran}
    assert set(by_kind) == {"pointwise", "rows", "columns"}, by_kind
    assert all(by_kind["pointwise"]) and by_kind["pointwise"], by_kind
    assert not any(by_kind["rows"]), by_kind
    # the column kernel's first pass shares tiles; its finishing pass (one thread per column) does not
    assert by_kind["columns"].count(False) == 1 and by_kind["columns"].count(True) == 1, by_kind


def _emu_run(body: str, threads: int, n: int) -> tuple[int, torch.Tensor]:
    """emu_launch of a hand-written kernel over one float32 output of n elements, 1 block."""
    import ctypes
    src = f'extern "C" __global__ void __launch_bounds__({threads}, 1) af_kernel_0(float *__restrict__ q0) {{ {body} }}\n'
    dll = cuda_emu._library(src)
    out = torch.full((n,), float("nan"))
    args = (ctypes.c_void_p * 1)(out.data_ptr())
    rc = dll.emu_launch(ctypes.cast(dll.emu_af_kernel_0, ctypes.c_void_p), args, 1, 1, threads)
    return rc, out


def test_the_emulation_reports_a_barrier_some_threads_never_reach():
    """A __syncthreads that only the first warp reaches, or a shuffle only half a warp makes, hangs a GPU;
    cuda_emu.h's fibers return 4 from emu_launch instead of waiting forever, and the next launch
    runs normally."""
    rc, _ = _emu_run("if (threadIdx.x < 32) __syncthreads(); q0[threadIdx.x] = 1.0f;", 64, 64)
    assert rc == 4
    rc, _ = _emu_run("float v = 1.0f; if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1); "
                     "q0[threadIdx.x] = v;", 64, 64)
    assert rc == 4
    rc, out = _emu_run("__shared__ float s[128]; s[threadIdx.x] = (float)threadIdx.x; __syncthreads(); "
                       "q0[threadIdx.x] = s[127 - threadIdx.x];", 128, 128)
    assert rc == 0 and torch.equal(out, torch.arange(127, -1, -1, dtype=torch.float32))


def test_the_emulation_lets_a_missing_barrier_show():
    """The fibers run between barriers in increasing thread order, then decreasing, so a read of another
    thread's shared-memory write with no barrier between them reads the stale value whichever way the
    two threads face: after an odd number of barriers the even threads read stale values (thread 2k
    runs before 2k+1), after an even number the odd ones. With the barrier, none does."""
    init = "__shared__ float s[64]; s[threadIdx.x] = -1.0f; __syncthreads(); "
    write, read = "s[threadIdx.x] = (float)threadIdx.x; ", "q0[threadIdx.x] = s[threadIdx.x ^ 1];"
    partner = (torch.arange(64) ^ 1).float()
    rc, out = _emu_run(init + write + "__syncthreads(); " + read, 64, 64)
    assert rc == 0 and torch.equal(out, partner), out
    stale = {}
    for barriers in (1, 2):
        rc, out = _emu_run(init + "__syncthreads(); " * (barriers - 1) + write + read, 64, 64)
        assert rc == 0
        stale[barriers] = set((out == -1.0).nonzero().flatten().tolist())
        assert torch.equal(out[out != -1.0], partner[out != -1.0])
    assert stale[1] == set(range(1, 64, 2)) and stale[2] == set(range(0, 64, 2)), stale


def test_a_cancelling_column_sum_past_the_tolerance_passes_as_rounding_and_a_wrong_one_does_not():
    """Column sums of 20000 values near 1000 that cancel to about 0: the kernel's sums and eager's are
    0.035 and 0.033 from the float64 sums, past the 1e-5 absolute tolerance (LeViT's, HGNetV2's and
    MobileNetV2's batch norm gradient sums stopped the emulation sweep so). `check` now runs the graph
    in float64 for such an output and passes it as rounding (testing.py's criterion: within 4x eager's
    distance); an output a real error away fails, with both distances in the message."""
    def f(x):
        return (x * 1.0).sum(0), (x * x).sum(0)

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(20000, 8, generator=g, dtype=torch.float64) * 1000
    x = (x64 - x64.mean(0)).float()
    gm = make_fx(f)(x)
    ran = cuda_emu.check(gm, (x,), "cancelling sums", sm_count=8)
    assert [l["kind"] for l in ran] == ["columns"] and [r[1] for r in ran.rounding] == ["sum_1"], ran.rounding
    _, _, err_c, err_e = ran.rounding[0]
    assert 1e-5 < err_c <= 4 * err_e, ran.rounding
    ref = cuda_emu.float64_values(gm, (x,))
    node = next(n for n in gm.graph.nodes if n.name == "sum_1")
    assert ref[node].dtype == torch.float64 and torch.allclose(ref[node], x.double().sum(0))
    want = x.sum(0)
    assert cuda_emu._rounding_only(want + 0.5, want, ref[node], torch.float32) is None
    assert cuda_emu._rounding_only(want, want, ref[node], torch.float32) is not None


def test_a_column_kernel_with_more_sums_than_shared_tiles_takes_turns_over_them():
    """50 column reductions in one kernel (ConvNeXt's 7x7 depthwise weight gradient is 49): a shared
    tile each was 52.8 KB of static shared memory, past the 48 KB ptxas allows (NVRTC refused the
    program); now 32 tiles serve them in rounds. Sums, maxima and minima match eager in the
    emulation, and NVRTC compiles the source for sm_90."""
    from aotfuse.nvrtc_check import compile_report, nvrtc_available

    def f(x, w):
        outs = []
        for i in range(50):
            h = x * w[i]
            outs.append(h.amax(0) if i % 7 == 3 else h.amin(0) if i % 11 == 5 else h.sum(0))
        return tuple(outs)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 96, generator=g), torch.randn(50, 1, 96, generator=g)
    gm = make_fx(f)(x, w)
    ran = cuda_emu.check(gm, (x, w), "50 column reductions")
    assert [l["kind"] for l in ran] == ["columns"], ran
    source = cuda_emu.source_of(gm, sm_count=132)
    assert "__shared__ float sh[32][8][33];" in source and "sh[17][l][tx]" in source
    why = nvrtc_available()
    if why:
        pytest.skip(f"no NVRTC to compile the source: {why}")
    assert len(compile_report(source, 90)) == 2  # the partials' kernel and the finishing one


def test_reductions_propagate_nan_and_inf():
    x = torch.randn(40, 300)
    x[3, 7] = float("nan")
    x[5, :] = float("-inf")
    x[9, 2] = float("inf")

    y = x.t().contiguous()

    def f(x, y):
        h = x * 1.0
        return h.amax(-1), h.amin(-1), h.sum(-1), (y + 1.0).amax(0), (y * 2.0).amin(0)

    ran = cuda_emu.check(make_fx(f)(x, y), (x, y), "nan/inf")
    assert {l["kind"] for l in ran} == {"rows", "columns"}, ran


@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (5, 2049), (257, 31), (2, 3, 70)])
def test_odd_shapes(shape):
    """Shapes that leave lanes, warps and vector tails idle, and rows longer than a warp's limit."""
    x = torch.randn(*shape)
    w = torch.randn(shape[-1])

    def f(x, w):
        h = (x * w).tanh()
        return h, h.sum(-1), (x - w).sum(0)

    cuda_emu.check(make_fx(f)(x, w), (x, w), f"shape {shape}")


@pytest.mark.parametrize("kind", ["pointwise", "rows", "columns"])
def test_dropout_generator_matches_the_cpu_generator(kind):
    """The counter-based dropout in CUDA kernels gives the bits of the op's CPU program."""
    from aotfuse.decompositions import default_decompositions

    from aotfuse.rng import share_seeds

    def f(x, g):  # two dropouts: after share_seeds, one seed on streams 0 and 1
        y = torch.ops.aten.native_dropout(torch.ops.aten.native_dropout(x * 2.0, 0.1, True)[0], 0.4, True)[0] * g
        return y if kind == "pointwise" else y.sum(-1) if kind == "rows" else y.sum(0)

    x, g = torch.randn(64, 256), torch.randn(64, 256)
    gm = make_fx(f, decomposition_table=default_decompositions(random=True))(x, g)
    assert share_seeds(gm) == 1
    ran = cuda_emu.check(gm, (x, g), f"dropout {kind}")
    assert [l["kind"] for l in ran] == [kind], ran
    # the streams are the kernel's parameters (af_cg_share), its launch passing 0 and 1
    assert ran[0]["streams"] == [0, 1] and "+ af_s1, iv" in cuda_emu.source_of(gm), ran


@pytest.mark.parametrize("width", [200, 768, 3000], ids=["warp_rows", "bert_rows", "block_rows"])
def test_random_numbers_a_later_phase_reads_are_drawn_once_per_cuda_lane(width):
    """A dropout before a decomposed layer norm (a residual stream): the mean's, the variance's and
    the normalizing pass all read its random numbers. A warp's lane draws each of its elements' numbers
    once (Threefry's 20 rounds) and keeps them in c<id>[i / 32] for the later passes; rows of a block
    (over 2048 elements) draw them again. The values are the CPU generator's either way."""
    from aotfuse.decompositions import default_decompositions

    def fn(x, seed):
        u = torch.ops.aotfuse.rng_uniform(seed, [37, width])
        return torch.nn.functional.layer_norm(x + x * (u > 0.1) * 1.11, (width,))

    x, seed = torch.randn(37, width, generator=torch.Generator().manual_seed(4)), torch.tensor(12345)
    gm = make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, seed)
    ran = cuda_emu.check(gm, (x, seed), f"dropout + layer norm, width {width}")
    assert [l["kind"] for l in ran] == ["rows"], ran
    src = cuda_emu.source_of(gm)
    kernel = src[src.index("phases)"):]
    draws = kernel.count("= af_rand(sv")
    if width <= 2048:
        assert draws == 1 and f"float c" in kernel and f"[{-(-width // 32)}]; /* kept from its phase" in kernel, kernel
        assert "[i / 32]; /* aotfuse::rng_uniform.default, cached */" in kernel, kernel
    else:
        assert draws == 3 and "cached */" not in kernel, kernel


@pytest.mark.parametrize("width", [200, 3000], ids=["warp_rows", "block_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(EPILOGUE_CASES))
def test_reduction_epilogues_run_in_one_phased_cuda_kernel(case, dtype, width):
    """Softmax, norms and their backwards (decomposed) as one phased kernel: a warp or a block per row."""
    from aotfuse.decompositions import default_decompositions

    fn, phases = EPILOGUE_CASES[case]
    g = torch.Generator().manual_seed(3)
    x, gr = (torch.randn(37, width, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(width, generator=g).to(dtype) for _ in range(2))
    gm = make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, w, b, gr)
    ran = cuda_emu.check(gm, (x, w, b, gr), f"{case} {dtype} width {width}")
    assert [l["kind"] for l in ran] == ["rows"], ran
    assert ran[0]["threads"] == (256 if width <= 2048 else 512), ran
    source = cuda_emu.source_of(gm)
    assert f"{phases} phases)" in source and "/* phase 1 */" in source, source[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_softmax_before_a_trailing_size_one_dim_is_one_phased_cuda_kernel(dtype):
    """ConvBERT's dynamic convolution takes a softmax over dim 1 of [rows, 9, 1]. The fusion planner
    reads the group as rows (the innermost dim that is not 1 is the reduced one) and gives it the
    division as a later phase; the CUDA code generator took the trailing 1 for a kept innermost
    dim and emitted a column reduction, which has no phases: the division read a sum it never
    declared, and NVRTC refused the whole program (the C backend, which checks phases first, was
    right). Now phases come first there too, and such a group is rows in both."""
    from aotfuse.decompositions import default_decompositions

    x = torch.randn(32, 9, 1, generator=torch.Generator().manual_seed(4)).to(dtype)
    gm = make_fx(lambda x: torch.softmax(x * 2.0, 1), decomposition_table=default_decompositions(norms=True))(x)
    ran = cuda_emu.check(gm, (x,), f"softmax over dim 1 of [32, 9, 1] {dtype}")
    assert [l["kind"] for l in ran] == ["rows"], ran
    assert "phases)" in cuda_emu.source_of(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpas_math_path_safe_softmax_is_one_phased_cuda_kernel(dtype):
    """_safe_softmax (SDPA's math path), decomposed: the masked scores' softmax with rows masked whole
    set to 0, one phased row kernel whose CUDA code matches eager, the whole-row -inf rows included."""
    from aotfuse.decompositions import default_decompositions

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 8, 40, generator=g).to(dtype)
    keep = torch.rand(2, 1, 8, 40, generator=g) > 0.3
    keep[1, :, 2] = False  # a query no key is kept for

    def f(x, keep):
        return aten._safe_softmax.default(torch.where(keep, x.float() * 0.125, float("-inf")), -1).to(x.dtype)

    gm = make_fx(f, decomposition_table=default_decompositions(norms=True))(x, keep)
    assert "_safe_softmax" not in str(gm.graph)
    ran = cuda_emu.check(gm, (x, keep), f"safe softmax {dtype}")
    assert [l["kind"] for l in ran] == ["rows"], ran
    assert "phases)" in cuda_emu.source_of(gm)
    assert bool((f(x, keep)[1, :, 2] == 0).all())


def test_phased_cuda_kernel_propagates_nan_like_aten():
    _f, x, gm = nan_phases_case()
    ran = cuda_emu.check(gm, (x,), "nan in phases")
    assert ran and "phases)" in cuda_emu.source_of(gm), ran


def test_layer_norm_forward_and_backward_graphs_as_aotautograd_gives_them():
    """A residual + layer norm block's joint graph, decomposed and partitioned as training sees it:
    every CUDA group of the forward and the backward matches eager."""
    import os
    from unittest import mock

    import aotfuse

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.ln = torch.nn.Linear(96, 96), torch.nn.LayerNorm(96)

        def forward(self, x):
            return self.ln(torch.nn.functional.gelu(self.lin(x)) + x)

    x = torch.randn(4, 16, 96, requires_grad=True)
    with mock.patch.dict(os.environ, {"AOTFUSE_DECOMPOSE_NORMS": "1"}), cuda_emu.recording_programs() as programs:
        y = aotfuse.memory_efficient_fusion(Block())(x)
        y.backward(torch.randn_like(y))
    assert len(programs) == 2, "a forward and a backward program ran"
    phased = 0
    for gm, args in programs:
        assert cuda_emu.check(gm, args, gm.__class__.__name__)
        phased += "phases)" in cuda_emu.source_of(gm)
    assert phased == 2, "the forward and the backward each have a phased layer-norm kernel"


@pytest.mark.parametrize("classes", [500, 5000], ids=["warp_rows", "block_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_forward_and_backward_programs(dtype, classes, monkeypatch):
    """The default cross entropy (decompositions.py), as training records it: Hugging Face's upcast
    and flatten, the row kernel forward (no log-probabilities stored) and the gradient kernel."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    from unittest import mock

    import aotfuse
    from aotfuse import picks

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, classes)

        def forward(self, x, y):
            logits = self.proj(x)
            return torch.nn.functional.cross_entropy(logits.float().view(-1, classes), y.view(-1))

    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 9, 16, generator=g).to(dtype)
    y = torch.randint(0, classes, (3, 9), generator=g)
    y[0, 2] = -100
    # the graphs recorded are the CPU's: as on a GPU, the backward's one-hot row sum stays a sum
    # (picks.py rewrites it for CPU tensors only), so its gradient kernel is a phased row kernel
    with cuda_emu.recording_programs() as programs, mock.patch.object(picks, "_SCALED_DEVICES", ()):
        aotfuse.memory_efficient_fusion(Head().to(dtype))(x, y).backward()
    assert len(programs) == 2, "a forward and a backward program ran"
    threads = 256 if classes <= 2048 else 512
    for gm, args in programs:
        ran = cuda_emu.check(gm, args, f"cross entropy {gm.__class__.__name__}")
        assert any(l["kind"] == "rows" and l["threads"] == threads for l in ran), ran
        assert "phases)" in cuda_emu.source_of(gm)


@pytest.mark.parametrize("sm_count", [2, 132])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_and_few_long_row_reductions_split_across_blocks(dtype, sm_count):
    """A full reduction is one row: split into chunks, a block each, and a finishing pass."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70000, generator=g).to(dtype)
    y = torch.randn(3, 70000, generator=g).to(dtype)

    def f(x, y):
        h = (x * 2.0).tanh()
        return h.sum(), h.amax(), (x * x).mean(), (y * 0.5).exp().sum(-1), (y - 1.0).amin(-1, keepdim=True)

    ran = cuda_emu.check(make_fx(f)(x, y), (x, y), f"split rows, {sm_count} SMs", sm_count=sm_count)
    assert [l["kind"] for l in ran] == ["split_rows", "split_rows"], ran
    assert all(l["split"] > 1 and l["workspace"] > 0 for l in ran), ran


@pytest.mark.parametrize("dtype,aten_norms", [("fp32", False), ("bf16", False), ("fp32", True)],
                         ids=["fp32", "bf16", "fp32-aten-norms"])
@pytest.mark.parametrize("model", ["AlbertForMaskedLM", "GPT2LMHeadModel", "BertForMaskedLM", "LongformerForMaskedLM"])
def test_seed_model_programs_cuda_kernels_match_eager(model, dtype, aten_norms, monkeypatch):
    """Every CUDA group of the four seed models' forward and backward programs (tiny configs),
    on the real values of a training step, matches eager's values of the same nodes; the norms and
    softmax are phased kernels among them (by default), or ATen calls (AOTFUSE_DECOMPOSE_NORMS=0)."""
    import aotfuse
    from aotfuse.bench import DTYPES, build_model

    if aten_norms:
        monkeypatch.setenv("AOTFUSE_DECOMPOSE_NORMS", "0")
    m, inputs, _ = build_model(model, "tiny", DTYPES[dtype], "cpu")
    torch._dynamo.reset()  # Longformer runs as Dynamo pieces: no graphs reused from an earlier test
    with cuda_emu.recording_programs() as programs:
        compiled = aotfuse.memory_efficient_fusion(m, fallback="dynamo" if model.startswith("Longformer") else "error")
        compiled(**inputs).loss.backward()
    assert len(programs) >= 2, "a forward and a backward at least"
    kinds = []
    for gm, args in programs:
        kinds += [l["kind"] for l in cuda_emu.check(gm, args, f"{model} {dtype} {gm.__class__.__name__}")]
    assert len(kinds) >= 8 and "pointwise" in kinds, kinds
    aten_ops = {str(n.target) for gm, _ in programs for n in gm.graph.nodes if n.op == "call_function"}
    natives = {t for t in aten_ops if "native_layer_norm" in t or "_softmax" in t}
    if aten_norms:
        assert natives, "AOTFUSE_DECOMPOSE_NORMS=0 keeps ATen's layer norm and softmax"
    else:
        assert not natives and any("phases)" in cuda_emu.source_of(gm) for gm, _ in programs), natives


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_members_match_eager(dtype):
    """Paddings and slice assignments as guarded, shifted loads (coordinate operands) in scalar
    CUDA kernels."""
    args = window_inputs(dtype)
    gm = make_fx(window_cases)(*args)
    ran = cuda_emu.check(gm, args, f"windows {dtype}")
    launches = _C.cuda_codegen(cuda_emu.build_graph(gm, device="cuda:0").graph)[1]
    assert len(ran) == len(launches) and all(l["kind"] == "pointwise" for l in ran), (ran, launches)  # none skipped
    source = cuda_emu.source_of(gm)
    assert source.count("aten::constant_pad_nd") == 5 and source.count("aten::slice_scatter") == 3, source
    args = select_inputs(dtype)
    assert len(cuda_emu.check(make_fx(select_cases)(*args), args, f"selects {dtype}")) >= 3


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_random_windows_match_eager(seed):
    f, args, what = random_window_graph(seed)
    assert cuda_emu.check(make_fx(f)(*args), args, what), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pads_read_through_views_match_eager(dtype):
    """Nested windows and remapped members (Longformer's pads through reshapes) in one CUDA kernel:
    the views' elements unravelled to the inner pads' coordinates."""
    args = pads_through_views_inputs(dtype)
    gm = make_fx(pads_through_views)(*args)
    ran = cuda_emu.check(gm, args, f"pads through views {dtype}")
    assert len(ran) == 1 and "const int u" in cuda_emu.source_of(gm), ran


@pytest.mark.parametrize("seed", range(0, 60, 4))
def test_random_windows_read_through_views_match_eager(seed):
    f, args, what = random_remapped_window_graph(seed)
    ran = cuda_emu.check(make_fx(f, tracing_mode="fake")(*args), args, what)
    assert len(ran) == 1, (what, ran)


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_random_view_reads_match_eager(seed):
    """Random views of a pointwise value read by a pointwise member, as the CUDA plan rewrites them
    (copies, reads, split readers): every group's values eager's."""
    f, args, what = random_view_read_graph(seed)
    assert cuda_emu.check(make_fx(f, tracing_mode="fake")(*args), args, what), what


def _permuted_sum_of_pads(a, b, x, mean, rstd):
    """Fuyu's bf16 q/k layer norm backward behind its partial rotary: the gradient is a sum of two
    pads, permuted and upcast; a row kernel (the input's gradient) and a column kernel (the weight's)
    both read it, so the plan computes the sum once, in the permuted shape's dense layout, for both."""
    aten, prims = torch.ops.aten, torch.ops.prims
    g = aten.add.Tensor(aten.constant_pad_nd.default(a, [0, 4]), aten.constant_pad_nd.default(b, [4, 0]))
    gp = prims.convert_element_type.default(aten.permute.default(g, [0, 2, 1, 3]), torch.float32)
    xn = aten.mul.Tensor(aten.sub.Tensor(prims.convert_element_type.default(x, torch.float32), mean), rstd)
    rows = aten.sum.dim_IntList(aten.mul.Tensor(gp, xn), [3], True)
    return (aten.sum.dim_IntList(aten.mul.Tensor(gp, xn), [0, 1, 2]), aten.sum.dim_IntList(gp, [0, 1, 2]),
            aten.mul.Tensor(aten.sub.Tensor(gp, rows), rstd))


def test_a_value_the_plan_stores_in_another_layout_reaches_the_next_kernel_as_eagers():
    """A value the plan computes in a layout of its own (a read of a permuted view, over the view's
    shape) is one kernel's output and another's input: the emulation gives that input eager's
    elements in the plan's layout (it reinterpreted eager's storage before, and Fuyu's bf16 column
    kernel seemed wrong in a 2026-12-07 sweep; the CUDA code was right)."""
    gen = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    args = [torch.randn(2, 4, 16, 4, generator=gen).to(bf), torch.randn(2, 4, 16, 4, generator=gen).to(bf),
            torch.randn(2, 16, 4, 8, generator=gen).to(bf), torch.randn(2, 16, 4, 1, generator=gen),
            torch.rand(2, 16, 4, 1, generator=gen) + 0.5]
    gm = make_fx(_permuted_sum_of_pads, tracing_mode="fake")(*args)
    _b, sunk, _origin = cuda_emu._planned(gm)
    _source, launches = _C.cuda_codegen(sunk, sm_count=1)
    (rows,) = [l for l in launches if l["kind"] == "rows"]
    (columns,) = [l for l in launches if l["kind"] == "columns"]
    handed = set(rows["outputs"]) & set(columns["inputs"])
    assert handed and all(sunk.value_meta(v)[2] == (512, 32, 8, 1) for v in handed), (rows, columns)
    assert [l["kind"] for l in cuda_emu.check(gm, args, "a sum of pads, permuted")] == \
        ["pointwise", "pointwise", "rows", "columns"]


def test_check_says_which_groups_it_skipped():
    """A group whose input eager lays out otherwise than the traced graph (here a transposed input
    where the trace had a contiguous one; not a size-1 dim's stride) is not run (the runtime would run its nodes as ATen calls):
    `check` returns no launch for it and names it with the reason in `skipped` (it dropped it silently
    before)."""
    def f(x):
        return torch.sin(x) * 2.0 + 1.0

    gm = make_fx(f)(torch.randn(8, 16))
    x = torch.randn(16, 8).t()
    ran = cuda_emu.check(gm, (x,), "a transposed input")
    assert len(ran) == 0 and len(ran.skipped) == 1 and "eager strides (1, 8)" in ran.skipped[0][1], (ran, ran.skipped)
    ran = cuda_emu.check(gm, (x.contiguous(),), "a contiguous input")
    assert len(ran) == 1 and ran.skipped == [] and ran.unchecked == [], ran
    # a size-1 dim's stride is never used: such a group runs (the runtime's operand check ignores it;
    # Longformer's attention had two groups skipped so before)
    gm = make_fx(f)(torch.randn(8, 1, 16))
    x = torch.randn(8, 16).as_strided((8, 1, 16), (16, 999, 1))
    ran = cuda_emu.check(gm, (x,), "a size-1 dim's other stride")
    assert len(ran) == 1 and ran.skipped == [], ran.skipped


def test_check_names_recomputes_that_nothing_compared(monkeypatch):
    """A value with no FX node (a recompute one kernel stores for another: the emulation has no eager
    value for it) is compared only through the groups that read it; where no group that ran reads it,
    `check` lists it in `unchecked`. The launches are stand-ins for run_groups' (the bookkeeping alone)."""
    def groups(reads):  # group 0 makes values 7 and 8; group 1 (skipped) reads 8; group 2 reads `reads`
        def run_groups(gm, args, **kw):
            yield 0, dict(kind="rows", inputs=[1], made=[7, 8]), []
            yield 1, dict(kind="pointwise", inputs=[8], skipped="input 3: eager strides (1, 8), graph (8, 1)"), []
            yield 2, dict(kind="pointwise", inputs=reads, made=[]), [("add", torch.ones(2), torch.ones(2), torch.float32)]
        return run_groups

    monkeypatch.setattr(cuda_emu, "run_groups", groups([7]))
    ran = cuda_emu.check(None, (), "stand-ins")
    assert [l["kind"] for l in ran] == ["rows", "pointwise"] and len(ran.skipped) == 1, ran
    assert ran.unchecked == [8], ran.unchecked  # its one reader was skipped: nothing compared it
    monkeypatch.setattr(cuda_emu, "run_groups", groups([7, 8]))
    assert cuda_emu.check(None, (), "stand-ins").unchecked == []


def test_a_float32_copy_of_a_16_bit_value_is_compared_at_the_16_bit_tolerance():
    """ProphetNet bf16 (2026-12-07 sweep): a layer norm computed in float32, rounded to bf16, then
    converted back to float32 for a matmul. One element's float32 norm, a hair from eager's, rounded
    to the neighbouring bf16 value; the bf16 output passed at bf16's tolerance, its float32 copy (the
    same bf16 value, one bf16 unit from eager's) failed at float32's. The copy holds no more than the
    bf16 value: it is compared at bf16's tolerance, and a plain float32 value at float32's."""
    def f(x, w):
        y = torch.nn.functional.layer_norm(x.float(), (32,), w).to(torch.bfloat16)
        return y.float() * 1.0, (x.float() * 3.0).exp()

    args = (torch.randn(6, 32).to(torch.bfloat16), torch.randn(32))
    gm = make_fx(f)(*args)
    conversions = {n.name: cuda_emu._precision(n, n.meta["val"]) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target == aten._to_copy.default}
    # x.float() twice, .to(bf16), y.float(): each holds a bf16 value
    assert list(conversions.values()) == [torch.bfloat16] * 4, conversions
    computed = [n for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.exp.default)]
    assert len(computed) == 3 and all(cuda_emu._precision(n, n.meta["val"]) == torch.float32 for n in computed)
    assert cuda_emu.check(gm, args, "float32 copies of bf16 values")


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_overlapping_scatters_as_sums_of_windows_match_eager(seed):
    """index_add of a gradient at an overlapping as_strided index, rewritten into a sum of windows
    (aotfuse.overlap), as one CUDA kernel: eager's values."""
    from aotfuse.overlap import rewrite_overlap_sums
    from test_overlap import _scatter, random_overlap_geometry

    sizes, strides, offset, n, _overlap, margin = random_overlap_geometry(seed)
    f = _scatter(n, sizes, strides, offset)
    g = torch.randn(sizes, generator=torch.Generator().manual_seed(seed))
    gm = make_fx(f, tracing_mode="fake")(g)
    what = f"seed {seed}: sizes {sizes} strides {strides} offset {offset} into {n}"
    rewritten = rewrite_overlap_sums(gm)
    assert rewritten == (seed % 5 != 4), what
    ran = cuda_emu.check(gm, (g,), what)
    assert (len(ran) == 1 or (margin and ran)) if rewritten else not ran, (what, ran)  # else ATen's index_add


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["convbert", "resnet", "llama"])
def test_more_families_programs_cuda_kernels_match_eager(family, dtype):
    """Beyond the seed's four: every CUDA group of a training step's programs matches eager's values
    for ConvBERT (a softmax over [rows, 9, 1], which made NVRTC refuse the program before), ResNet
    (batch norms, pooling) and Llama (rotary embeddings, RMS norm, grouped-query attention)."""
    pytest.importorskip("transformers")
    import aotfuse
    from test_more_models import MODELS

    build, inputs = MODELS[family]
    torch.manual_seed(0)
    model = build().train().to(dtype)
    kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs().items()}
    with cuda_emu.recording_programs() as programs:
        aotfuse.memory_efficient_fusion(model)(**kwargs).loss.backward()
    assert len(programs) >= 2, "a forward and a backward at least"
    kinds = []
    for gm, args in programs:
        kinds += [l["kind"] for l in cuda_emu.check(gm, args, f"{family} {dtype} {gm.__class__.__name__}")]
    assert len(kinds) >= 8 and "pointwise" in kinds and "rows" in kinds, kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decomposed_activations_and_losses_cuda_kernels_match_eager(dtype):
    """The activations and losses decomposed since 2026-12-06 (tests/test_activations.py's cases: ELU,
    softplus, Mish, log-sigmoid, binary cross entropy, ...) become CUDA kernels on a GPU too, calling
    the CUDA prelude's af_log1p, af_expm1, af_log, ...: each group of the forward and backward
    programs, in the emulation, against eager's values."""
    import aotfuse
    from test_activations import CASES

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x) * 2.0
            return sum(fn(h).mean(-1) for fn in CASES.values())

    torch.manual_seed(0)
    model = Model().to(dtype)
    x = (torch.randn(6, 16, generator=torch.Generator().manual_seed(2)) * 2.0).to(dtype).requires_grad_()
    with cuda_emu.recording_programs() as programs:
        aotfuse.memory_efficient_fusion(model)(x).sum().backward()
    assert len(programs) == 2, "a forward and a backward program ran"
    calls = set()
    for gm, args in programs:
        ran = cuda_emu.check(gm, args, f"activations {dtype} {gm.__class__.__name__}")
        assert ran, "no CUDA group ran"
        calls |= {f for f in ("af_log1p(", "af_expm1(", "af_log(", "af_exp(", "af_tanh(") if f in cuda_emu.source_of(gm)}
    assert {"af_log1p(", "af_expm1(", "af_log("} <= calls, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cats_as_windows_match_eager(dtype):
    """aten.cat as windows (decompositions._cat_windows) in CUDA kernels: rotate_half's cat along
    the row, and a cat of three computed inputs along an outer dim, each one kernel."""
    from aotfuse.decompositions import default_decompositions
    from test_cat import _outer, _rotary, _rotary_inputs

    decomp = default_decompositions(norms=True)
    for f, args in ((_rotary, _rotary_inputs(dtype)),
                    (_outer, [torch.randn(2, 8, 4, 32, generator=torch.Generator().manual_seed(4)).to(dtype)])):
        gm = make_fx(f, decomposition_table=decomp, tracing_mode="fake")(*args)
        ran = cuda_emu.check(gm, args, f"{f.__name__} {dtype}")
        assert len(ran) == 1 and ran[0]["kind"] == "pointwise", ran
        source = cuda_emu.source_of(gm)
        assert "aten::slice_scatter" in source and "aten::constant_pad_nd" in source, source
