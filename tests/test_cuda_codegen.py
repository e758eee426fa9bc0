"""The CUDA backend without a GPU: the generated CUDA C for every op-table expression (fp32, fp16,
bf16; contiguous, broadcast and strided operands), for reductions of each kind, and for the four
seed models' programs compiles with NVRTC for sm_80 and sm_90, and ptxas's registers/spills report
for the biggest kernels is printed. Graphs are traced on the CPU and relabelled to cuda:0
(build_graph(device=...)); the plan and the source are exactly what a CUDA program would compile.
Skipped, with the reason, only where no NVRTC library can be found."""
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse import _C
from aotfuse.lower import build_graph
from aotfuse.nvrtc_check import captured_graphs, compile_report, cuda_sources, nvrtc_available
from test_fusion import OP_CASES, _inputs, window_cases, window_inputs

aten = torch.ops.aten
ARCHS = [80, 90]

_why = nvrtc_available()
needs_nvrtc = pytest.mark.skipif(_why is not None, reason=f"no NVRTC library here: {_why}")


def _cuda_plan(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)


def _all_ops(a, b, c, cases=None):
    return tuple(case(aten.mul.Tensor(a, 1.0), b, c) * 1.0 for case in (cases or OP_CASES).values())


# the op table in kernels of at most 30 outputs: one kernel of all 61 has more operands than a
# vectorized variant takes (AF_CUDA_MAX_VECTOR_OPERANDS, 48)
OP_CHUNKS = [dict(list(OP_CASES.items())[i:i + 30]) for i in range(0, len(OP_CASES), 30)]


@needs_nvrtc
@pytest.mark.parametrize("layout", ["contiguous", "broadcast", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_every_op_table_expression_compiles(dtype, layout):
    for cases in OP_CHUNKS:
        source, launches = _cuda_plan(lambda a, b, c: _all_ops(a, b, c, cases), *_inputs(dtype, layout))
        assert launches and all(l["kind"] == "pointwise" for l in launches), launches
        for op in cases:  # every op ran inside a kernel: its member line is in the source
            assert f"/* {op}." in source, f"{op} is not in a CUDA kernel ({dtype}, {layout})"
        if layout == "contiguous":
            assert any(l["vec_blocks"] > 0 for l in launches), "no vectorized variant for contiguous operands"
        for arch in ARCHS:
            kernels = compile_report(source, arch)
            # groups whose code is the same (but for node ids) launch one kernel (`body`)
            assert {f"af_kernel_{l['body']}" for l in launches} <= {k["name"] for k in kernels}, (arch, kernels)
            assert all(k["registers"] for k in kernels), kernels


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reductions_of_each_kind_compile(dtype):
    def f(x, b, y, big):
        h = x * b + 1.0
        rows = h.sum(-1, keepdim=True), h.amax(-1), h.mean(-1), h.amin(-1, keepdim=True)  # warp per row
        cols = (y * 0.5 + 1.0).sum(0)  # bias-gradient shape: two-pass column reduction
        long_rows = (big * 2.0).exp().sum(-1)  # a block per row (rows over 2048)
        total = (x * y).sum()  # everything into one value
        split = (big * big).sum()  # one long row: chunks, a block each, then a finishing pass
        return rows + (cols, long_rows, total, split)

    x, y = torch.randn(64, 96, dtype=dtype), torch.randn(64, 96, dtype=dtype)
    b, big = torch.randn(96, dtype=dtype), torch.randn(3, 50000, dtype=dtype)
    source, launches = _cuda_plan(f, x, b, y, big)
    kinds = sorted(l["kind"] for l in launches)
    assert "rows" in kinds and "columns" in kinds and "split_rows" in kinds, kinds
    col = next(l for l in launches if l["kind"] == "columns")
    assert col["workspace"] > 0 and col["split"] >= 1
    assert "__shfl_xor_sync" in source and "_f(double" in source
    # threads accumulate in float (a few dozen terms each); only the chunks' totals add in double
    assert "float acc" in source and "__shared__ float sh" in source and "__shared__ double" not in source
    for kernel in source.split("__global__")[1:]:
        name = re.search(r"\b(af_kernel_\w+)\(", kernel).group(1)
        assert "double acc" not in kernel or name.endswith("_f"), f"{name}: a double accumulator outside a finishing pass"
    for arch in ARCHS:
        kernels = compile_report(source, arch)
        assert {k["name"] for k in kernels} >= {"af_kernel_0"}, kernels


def test_cuda_codegen_leaves_cpu_graphs_alone():
    gm = make_fx(lambda x: (x * 2).exp())(torch.randn(4, 4))
    source, launches = _C.cuda_codegen(build_graph(gm).graph)
    assert "__global__" not in source and all(l["kind"] == "none" for l in launches)


@needs_nvrtc
def test_compile_error_names_the_architecture_and_log():
    with pytest.raises(_C.Error, match=r"sm_90.*(?s:.*)error"):
        _C.nvrtc_compile('extern "C" __global__ void k() { this is not cuda; }', 90)


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["AlbertForMaskedLM", "GPT2LMHeadModel", "BertForMaskedLM", "LongformerForMaskedLM"])
def test_seed_model_programs_compile(model, dtype, capsys):
    from aotfuse import memory_efficient_fusion
    from aotfuse.bench import DTYPES, build_model

    m, inputs, _ = build_model(model, "tiny", DTYPES[dtype], "cpu")
    torch._dynamo.reset()  # Longformer runs as Dynamo pieces: no graphs reused from an earlier test
    compiled = memory_efficient_fusion(m, fallback="dynamo" if model.startswith("Longformer") else "error")
    programs = cuda_sources(captured_graphs(compiled, **inputs))
    assert len(programs) >= 2  # a forward and a backward at least
    assert sum(len(l) for _n, _s, l in programs) >= 8, "too few fused groups for a transformer"
    report = []
    for name, source, _launches in programs:
        for arch in ARCHS:
            for k in compile_report(source, arch):
                report.append((k["registers"], k["spill_stores"] + k["spill_loads"], k["smem"], arch, name, k["name"]))
    assert report
    with capsys.disabled():  # the registers/spills report, in the test log
        print(f"\n[nvrtc] {model} {dtype}: {len(report)} kernels compiled; biggest (registers, spill bytes, smem):")
        for regs, spill, smem, arch, name, kname in sorted(report, reverse=True)[:3]:
            print(f"[nvrtc]   sm_{arch} {name} {kname}: {regs} registers, {spill} spill bytes, {smem} bytes smem")
    assert all(spill == 0 for _r, spill, *_ in report), "a kernel spills registers"


@needs_nvrtc
@pytest.mark.parametrize("width", [200, 3000], ids=["warp_rows", "block_rows"])
def test_phased_epilogue_kernels_compile(width, capsys):
    """Softmax, log_softmax, layer and RMS norm and the softmax backward, decomposed: one phased
    kernel each (numbers: tests/test_cuda_emulated.py), compiled for sm_80 and sm_90 without spills."""
    from aotfuse.decompositions import default_decompositions
    from test_fusion import EPILOGUE_CASES

    for case, (fn, phases) in sorted(EPILOGUE_CASES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            x, g = torch.randn(37, width, dtype=dtype), torch.randn(37, width, dtype=dtype)
            w, b = torch.randn(width, dtype=dtype), torch.randn(width, dtype=dtype)
            gm = make_fx(fn, decomposition_table=default_decompositions(norms=True), tracing_mode="fake")(x, w, b, g)
            source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
            assert [l["kind"] for l in launches] == ["rows"] and f"{phases} phases)" in source, (case, launches)
            for arch in ARCHS:
                (k,) = compile_report(source, arch)
                assert k["spill_stores"] == k["spill_loads"] == 0, (case, dtype, arch, k)
                with capsys.disabled():
                    if dtype == torch.float32 and arch == 90:
                        print(f"\n[nvrtc] phased {case} width {width} sm_{arch}: {k['registers']} registers, {k['smem']} bytes smem", end="")


@needs_nvrtc
def test_window_members_compile():
    source, launches = _cuda_plan(window_cases, *window_inputs(torch.bfloat16))
    assert source.count("aten::constant_pad_nd") == 5 and source.count("aten::slice_scatter") == 3, source
    assert launches and all(l["kind"] == "pointwise" for l in launches), launches
    for arch in ARCHS:
        kernels = compile_report(source, arch)
        assert len(kernels) >= len(launches) and all(k["registers"] for k in kernels), (arch, kernels)


@needs_nvrtc
def test_folded_constants_and_fills_compile():
    """What constant folding leaves (constfold.py): constants as program inputs, full members, and a
    fill too big to keep, permuted to its layout, read through the permute."""
    from aotfuse import constfold
    from test_constant_folding import band_masks

    def f(x, y):
        big = aten.full_like.default(aten.t.default(y), -2.0, memory_format=torch.preserve_format)  # 1.44 MB
        return band_masks(x) + (aten.add.Tensor(big, aten.t.default(y)),)

    gm = constfold.fold(make_fx(f)(torch.randn(3, 5, 5), torch.randn(600, 600)))
    targets = [n.target for n in gm.graph.nodes]
    # fills: the big one (permuted), the where's -1.0 (one node for both), the extended mask's -0.0
    assert targets.count(aten.full.default) == 3 and aten.permute.default in targets and aten.flip.default not in targets
    b = build_graph(gm, device="cuda:0")
    assert len(b.constants) == 1
    source, launches = _C.cuda_codegen(b.graph)
    assert "aten::full.default" in source and "-0.0f" in source, source
    for arch in ARCHS:
        kernels = compile_report(source, arch)
        assert len(kernels) >= len(launches) and all(k["registers"] for k in kernels), (arch, kernels)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_of_views_computed_from_their_sources_compile(dtype):
    """The CUDA a program compiles once copies of views are computed from their sources
    (csrc/sink.c): the windows' copy and the transposed copy fuse with their pointwise nodes (two
    kernels instead of four), and compile for sm_80 and sm_90 without spills."""
    from test_fusion import _windows_of_a_scaled_projection

    args = (torch.randn(32, 32, dtype=dtype), torch.randn(32, dtype=dtype))
    gm = make_fx(_windows_of_a_scaled_projection, tracing_mode="fake")(*args)
    graph = build_graph(gm, device="cuda:0").graph
    sunk, _origin = _C.sink_copies(graph, devices="cuda")
    source, launches = _C.cuda_codegen(sunk)
    _, before = _C.cuda_codegen(graph)
    assert len(launches) == 2 and len(before) == 4, (launches, before)
    # before: two kernels of two pointwise nodes and two lone copies; after: the two pointwise pairs
    assert [l["nodes"] for l in before].count(1) == 2 and [l["nodes"] for l in launches] == [2, 2], (launches, before)
    for arch in ARCHS:
        kernels = compile_report(source, arch)
        assert kernels and all(k["spill_stores"] == k["spill_loads"] == 0 for k in kernels), (arch, kernels)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_of_views_computed_from_their_sources_compile(dtype):
    """The CUDA a program compiles once kernel members' reads of views are computed from their
    sources (csrc/sink.c, reads): the split reader, the transposed read and the pad reading its crop
    directly, three kernels instead of five, compiled for sm_80 and sm_90 without spills."""
    from test_fusion import _reads_of_views

    args = (torch.randn(32, 32, dtype=dtype), torch.randn(32, 32, dtype=dtype), torch.randn(1024, dtype=dtype))
    graph = build_graph(make_fx(_reads_of_views, tracing_mode="fake")(*args), device="cuda:0").graph
    sunk, _origin = _C.sink_copies(graph, devices="cuda")
    copies_only, _origin = _C.sink_copies(graph, devices="cuda", reads=False)
    source, launches = _C.cuda_codegen(sunk)
    _, before = _C.cuda_codegen(copies_only or graph)
    assert (len(launches), len(before)) == (3, 5), (launches, before)
    for arch in ARCHS:
        kernels = compile_report(source, arch)
        assert len(kernels) >= 3 and all(k["spill_stores"] == k["spill_loads"] == 0 for k in kernels), (arch, kernels)


def _flash(q, k, v, g):
    out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.1, True)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(g, q, k, v, out, lse, cq, ck, mq, mk, 0.1, True,
                                                                   seed, off)
    return out, dq, dk, dv


def _efficient(q, k, v, g):
    out, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.1, True)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(g, q, k, v, None, out, lse, seed, off, 0.1,
                                                                          [True, True, True, False], True)
    return out, dq, dk, dv


def _cudnn(q, k, v, g):
    out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.1, True,
                                                                                       False)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(g, q, k, v, out, lse, seed, off, None, cq, ck, mq, mk,
                                                                   0.1, True)
    return out, dq, dk, dv


@pytest.mark.parametrize("kernel", [_flash, _efficient, _cudnn], ids=["flash", "efficient", "cudnn"])
def test_cuda_attention_kernels_graphs_lower(kernel):
    """The graphs of SDPA's CUDA kernels (flash, memory-efficient, cuDNN), forward and backward with
    dropout, as AOTAutograd gives them on a GPU: traced on fake CUDA tensors here (a CPU torch has no
    CUDA kernels, so nothing else here sees them). Flash attention's random state is a uint64 tensor
    the forward saves for the backward: the programs take it (an opaque dtype only extern calls
    carry), and the kernels around the attention are planned and, where NVRTC is here, compiled."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(q, k, v, g):
        out, dq, dk, dv = kernel(q * 2.0, k, v, g)
        return out.float().sum(-1), dq * 3.0, dk, dv

    with FakeTensorMode():
        q, k, v, g = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        gm = make_fx(f)(q, k, v, g)
    attention = [n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
    assert len(attention) == 2, attention  # the forward and the backward kernel
    source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
    assert len(launches) >= 2, launches  # q * 2 before it, the float sum and dq * 3 after it
    if nvrtc_available() is None:
        assert compile_report(source, 90)


@needs_nvrtc
def test_nvrtc_keeps_a_multiply_and_an_add_two_roundings():
    """NVRTC runs with --fmad=false: x * y + 1 stays a rounded multiply and a rounded add (.rn), as
    ATen's separate kernels, the C backend (-ffp-contract=off) and the host emulation compute it, so
    the CUDA kernels give the bits the CPU checks saw; no fused multiply-add."""
    from aotfuse.lower import _add_nvrtc_search_dirs

    _add_nvrtc_search_dirs()
    src = 'extern "C" __global__ void k(const float* a, const float* b, float* c) { int i = threadIdx.x; c[i] = a[i] * b[i] + 1.0f; }'
    ptx, _log = _C.nvrtc_compile(src, 90, ptx=True)
    text = bytes(ptx).decode(errors="replace")
    assert "mul.rn.f32" in text and "add.rn.f32" in text and "fma" not in text, text


@needs_nvrtc
@pytest.mark.parametrize("width", [512, 768, 2048])
def test_kept_random_numbers_stay_in_local_memory_without_spills(width):
    """A dropout before a layer norm (Bert's residual stream, rows of 768): the numbers drawn in the
    first pass are kept per lane (c<id>[i / 32]) for the later passes. With every pass unrolled, ptxas
    held the array in registers and spilled (64 registers, 564 bytes of spill stores at 768); the
    drawing pass stays a loop, so the array lives in local memory (ceil(width / 32) floats) and
    nothing spills."""
    import aotfuse.rng  # noqa: F401  (registers aotfuse::rng_uniform)
    from aotfuse.decompositions import default_decompositions

    def fn(x, r, seed):
        u = torch.ops.aotfuse.rng_uniform(seed, [64, width])
        return torch.nn.functional.layer_norm(x * (u > 0.1) * 1.11 + r, (width,))

    x, r, seed = torch.randn(64, width), torch.randn(64, width), torch.tensor(12345)
    gm = make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, r, seed)
    source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
    assert [l["kind"] for l in launches] == ["rows"] and source.count("= af_rand(sv") == 1, source
    for arch in ARCHS:
        (k,) = compile_report(source, arch)
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (arch, k)
        assert k["stack"] >= 4 * -(-width // 32), (arch, k)  # the kept array, in local memory


def test_keeping_random_numbers_can_be_turned_off_and_leaves_other_kernels_alone(monkeypatch):
    """AOTFUSE_CUDA_KEEP_RANDOM=0 draws in every pass (the kernel before 2026-12-04, for an A/B on a
    GPU); a phased kernel with nothing to keep (a layer norm without dropout) gets no unroll pragmas."""
    import aotfuse.rng  # noqa: F401
    from aotfuse.decompositions import default_decompositions

    def with_dropout(x, r, seed):
        u = torch.ops.aotfuse.rng_uniform(seed, [64, 768])
        return torch.nn.functional.layer_norm(x * (u > 0.1) * 1.11 + r, (768,))

    def plain(x, r, seed):
        return torch.nn.functional.layer_norm(x + r, (768,)) * seed

    x, r, seed = torch.randn(64, 768), torch.randn(64, 768), torch.tensor(12345)
    src = {}
    for name, fn in (("dropout", with_dropout), ("plain", plain)):
        gm = make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, r, seed)
        for keep in ("1", "0"):
            monkeypatch.setenv("AOTFUSE_CUDA_KEEP_RANDOM", keep)
            src[name, keep] = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)[0]
    assert src["dropout", "1"].count("= af_rand(sv") == 1 and "#pragma unroll 1" in src["dropout", "1"]
    assert src["dropout", "0"].count("= af_rand(sv") == 3 and "kept from its phase" not in src["dropout", "0"]
    assert "#pragma unroll 4" not in src["dropout", "0"] and "#pragma unroll 1" not in src["dropout", "0"]
    assert src["plain", "1"] == src["plain", "0"] and "#pragma unroll 4" not in src["plain", "1"]


@needs_nvrtc
def test_a_compile_error_names_ptxas_error_past_every_kernels_report():
    """With ptxas's verbose report (`compile_report`) the log of a failed compile holds every kernel's
    figures but not ptxas's error (ConvNeXt's 51.7 KB of shared memory read only "ptxas info ..."):
    the failed compile is run again without the report, and its error is in the message."""
    fine = "".join(f'extern "C" __global__ void ok{i}(float *x) {{ x[threadIdx.x] *= {i}.0f; }}\n' for i in range(40))
    source = fine + ('extern "C" __global__ void big(float *x) { __shared__ float a[13000]; a[threadIdx.x] = x[0];'
                     ' __syncthreads(); x[threadIdx.x] = a[threadIdx.x ^ 1]; }\n')
    with pytest.raises(_C.Error, match="uses too much shared data") as e:
        compile_report(source, 90)
    assert "ptxas info" not in str(e.value)


def _sum_of_products(*xs):
    out = xs[0] * xs[1]
    for a, b in zip(xs[2::2], xs[3::2]):
        out = out + a * b
    return (out,)


@pytest.mark.parametrize("inputs,vectorized", [(40, True), (100, False)])
def test_a_pointwise_kernel_of_many_operands_has_no_vectorized_variant(inputs, vectorized):
    """The vectorized variant keeps a 16-byte vector per contiguous operand live across its unrolled loop:
    Perceiver's fp32 backward has a 114-operand pointwise kernel whose vectorized variant spilled 1,652
    stores at 64 registers (its scalar variant 4). Above 48 such operands only the scalar variant is
    generated (launch vec_blocks 0, so the runtime launches it); 40 keep both. Where NVRTC is here, the
    100-operand kernel compiles with at most a few spill stores."""
    xs = [torch.randn(64, 128) for _ in range(inputs)]
    source, launches = _cuda_plan(_sum_of_products, *xs)
    assert [l["kind"] for l in launches] == ["pointwise"], launches
    assert (launches[0]["vec_blocks"] > 0) == vectorized and ("af_kernel_0_v(" in source) == vectorized, launches
    if not vectorized and nvrtc_available() is None:
        (k,) = compile_report(source, 90)
        assert k["spill_stores"] <= 16, k
