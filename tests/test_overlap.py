"""The gradient of an overlapping as_strided (Longformer's chunks) as a sum of windows in one kernel,
not a zero fill and an ATen index_add (python/aotfuse/overlap.py)."""
import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse.lower import lower
from aotfuse.overlap import overlap_plan, rewrite_overlap_sums
from helpers import assert_close


def test_overlap_plan_reads_longformers_geometries():
    # chunks of 6 rows every 2 rows, batch outermost: three classes of chunks that do not overlap
    plan = overlap_plan([4, 8, 6, 16], [320, 32, 16, 1], 0, 1280)
    assert plan == {"order": [0, 1, 2, 3], "pair": (1, 2, 2), "classes": 3, "extent": 1280,
                    "axes": {3: 16, 2: 20, 0: 4}}
    # chunks of 4 every 2, the batch inside a row (a transposed storage): two classes
    plan = overlap_plan([4, 7, 4, 16], [16, 128, 64, 1], 0, 1024)
    assert plan["order"] == [1, 2, 0, 3] and plan["pair"] == (1, 2, 2) and plan["classes"] == 2
    assert plan["extent"] == 1024


def test_overlap_plan_takes_tilings_only():
    assert overlap_plan([3, 4], [4, 1], 0, 12)["pair"] is None  # no overlap: one class, a permuted copy
    assert overlap_plan([3, 4], [4, 1], 2, 20)["extent"] == 12  # an offset and a tail: zeros around it
    assert overlap_plan([3, 4], [8, 2], 0, 24) is None  # gaps between elements
    assert overlap_plan([3, 4], [1, 1], 0, 12)["pair"] == (0, 1, 1)  # windows of 4 every row: 4 classes
    assert overlap_plan([3, 4, 2], [1, 1, 1], 0, 12) is None
    assert overlap_plan([3, 4, 5], [3, 2, 1], 0, 60) is None  # overlaps of overlaps
    assert overlap_plan([3, 4], [3, 1], 0, 8) is None  # past the storage's end
    assert overlap_plan([3, 4], [3, -1], 0, 12) is None


def _scatter(n, sizes, strides, offset):
    def f(g):
        index = torch.arange(n, device=g.device).as_strided(sizes, strides, offset).reshape(-1)
        return torch.zeros(n, dtype=g.dtype, device=g.device).index_add(0, index, g.reshape(-1))
    return f


def random_overlap_geometry(seed: int):
    """A seeded random overlapping chunking (chunk length 2-6 starting every q < length rows, 1-5
    chunks, batch 1-3, width 1-4), its storage in batch-major order or with the batch inside a row
    (Longformer's two), sometimes an offset, a tail and a size-1 dim; every fifth seed strides with
    gaps, which do not tile (the index_add stays)."""
    rng = random.Random(seed)
    b, length, chunks, width = rng.randint(1, 3), rng.randint(2, 6), rng.randint(1, 5), rng.randint(1, 4)
    q = rng.randint(1, length - 1)
    rows = q * (chunks - 1) + length
    if rng.random() < 0.5:
        sizes, strides = [b, chunks, length, width], [rows * width, q * width, width, 1]
    else:
        sizes, strides = [b, chunks, length, width], [width, q * b * width, b * width, 1]
    if seed % 5 == 4:
        strides = [s * 2 for s in strides]
    offset, tail = (rng.randint(0, 3), rng.randint(0, 3)) if rng.random() < 0.4 else (0, 0)
    if rng.random() < 0.3:
        sizes.insert(1, 1)
        strides.insert(1, 7)
    n = offset + sum((s - 1) * t for s, t in zip(sizes, strides)) + 1 + tail
    return sizes, strides, offset, n, -(-length // q) if chunks > 1 else 1, offset or tail


@pytest.mark.parametrize("seed", range(40))
def test_random_overlapping_scatters_are_one_kernel(seed):
    """index_add of a gradient onto zeros at an as_strided index: one kernel, no ATen call, eager's
    values to the bit where at most two chunks overlap, within one rounding of eager's distance from
    float64 elsewhere (another order of summation)."""
    sizes, strides, offset, n, overlap, margin = random_overlap_geometry(seed)
    dtype = torch.bfloat16 if seed % 3 == 0 else torch.float32
    g = torch.randn(sizes, generator=torch.Generator().manual_seed(seed)).to(dtype)
    f = _scatter(n, sizes, strides, offset)
    gm = make_fx(f, tracing_mode="fake")(g)
    what = f"seed {seed}: sizes {sizes} strides {strides} offset {offset} into {n} ({dtype})"
    tiles = overlap_plan(sizes, strides, offset, n) is not None
    assert tiles == (seed % 5 != 4), what
    lowered = lower(gm)
    assert ("aten::index_add.default" in lowered.extern_counts()) != tiles, (what, lowered.extern_counts())
    if tiles:
        calls = set(lowered.extern_counts()) - {"aten::view.default"}  # the returned flat view is made
        # zeros around the tiled part (an offset, a tail) pad the flat sum: a kernel of its own then
        kernels = 2 + overlap if margin else 1
        assert lowered.program.num_kernels <= kernels and not calls, (what, str(lowered.program))
    (got,), ref = lowered([g]), f(g)
    exact = f(g.double())
    if overlap <= 2 or not tiles:
        assert_close(got, ref, what, atol=0, rtol=0)
    else:
        # summed in another order than index_add's: one rounding of the dtype apart at most
        ulp = torch.finfo(dtype).eps * exact.abs().max().item()
        assert (got.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + ulp, what
    assert lowered.program.kernel_fallbacks == 0


def test_switch_keeps_the_index_add(monkeypatch):
    monkeypatch.setenv("AOTFUSE_OVERLAP_SUMS", "0")
    f = _scatter(80, [2, 3, 6, 4], [40, 8, 4, 1], 0)
    g = torch.randn(2, 3, 6, 4)
    lowered = lower(make_fx(f, tracing_mode="fake")(g))
    assert lowered.extern_counts().get("aten::index_add.default") == 1
    assert_close(lowered([g])[0], f(g), "switched off", atol=0, rtol=0)


def test_a_scatter_onto_something_else_stays():
    """Only a scatter onto zeros is a sum of windows (a base of ones is another sum)."""
    def f(g):
        index = torch.arange(80).as_strided([2, 3, 6, 4], [40, 8, 4, 1]).reshape(-1)
        return torch.ones(80).index_add(0, index, g.reshape(-1))
    g = torch.randn(2, 3, 6, 4)
    gm = make_fx(f, tracing_mode="fake")(g)
    assert rewrite_overlap_sums(gm) == 0
    lowered = lower(gm)
    assert lowered.extern_counts().get("aten::index_add.default") == 1
    assert_close(lowered([g])[0], f(g), "onto ones", atol=0, rtol=0)


def _chunked(x, w, y):
    """Longformer's _chunk: [B, L, H] as overlapping chunks of w rows every w // 2, times y."""
    b, length, h = x.shape
    chunks = x.as_strided((b, 2 * length // w - 1, w, h), (length * h, w * h // 2, h, 1))
    return (chunks * y).sum() + (x * x).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_of_overlapping_chunks_is_one_kernel(dtype):
    """Through AOTAutograd: the backward of an overlapping as_strided (ATen's index_add) runs as one
    fused kernel; the gradient is eager's to the bit (two chunks overlap) and within rounding of
    float64."""
    x = torch.randn(2, 16, 3, dtype=dtype, requires_grad=True)
    y = torch.randn(2, 7, 4, 3, dtype=dtype)
    compiled = aotfuse.memory_efficient_fusion(lambda x, y: _chunked(x, 4, y))
    for _ in range(2):
        x.grad = None
        compiled(x, y).backward()
    got = x.grad.clone()
    x.grad = None
    _chunked(x, 4, y).backward()
    assert_close(got, x.grad, f"x.grad ({dtype})", atol=0, rtol=0)
    x64 = x.detach().double().requires_grad_()
    _chunked(x64, 4, y.double()).backward()
    assert (got.double() - x64.grad).abs().max() <= (x.grad.double() - x64.grad).abs().max() + 1e-6
    (record,) = compiled.records
    backward = record.programs["backward"]
    assert "aten::index_add.default" not in backward.extern_counts(), backward.extern_counts()
    assert backward.program.num_kernels == 1, str(backward.program)
