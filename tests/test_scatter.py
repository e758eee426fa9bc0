"""Nested slice assignments as one window (scatter.py, `aotfuse::box_scatter` / `aotfuse::box_fill`)."""
import pytest
import torch
from torch._functorch.aot_autograd import aot_function

import aotfuse
from aotfuse.lower import lower
from helpers import assert_close


def _assign(x, y, z):
    """Longformer's pattern: a band assembled by slice assignments, three levels deep, and regions zeroed."""
    d = x * 1.5
    d[:, :-1, :, 2:] = y[:, :, :, :4].exp()
    d[:, -1, :, 3:] = z[:, 0, :, :3] * 2
    d[:, 0, 1:3, 1:3] = z[:, 1, 1:, :2]
    d[:, 2:4, 0] = 0
    d[1, :, :, -1] = -2.5
    return (d * 2,)


def _inputs(dtype, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = ((4, 8, 3, 6), (4, 7, 3, 5), (4, 2, 3, 5))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


def _functional_graph(fn, args):
    """fn's graph as AOTAutograd functionalizes it (slice assignments as scatters of copies), with
    its constants folded as lower() folds them (the assigned numbers become `full` nodes)."""
    from aotfuse import constfold

    got = {}

    def compiler(gm, example):
        got["gm"] = gm
        return gm

    aot_function(fn, fw_compiler=compiler)(*args)
    return constfold.fold(got["gm"])


def _lowered(fn, args):
    """fn through AOTAutograd's functionalization, lowered by aotfuse (no partition: inference)."""
    got = {}

    def compiler(gm, example):
        got["low"] = lower(gm, example)
        return lambda *a: got["low"](list(a))

    out = aot_function(fn, fw_compiler=compiler)(*args)
    return out, got["low"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_slice_assignments_are_one_kernel(dtype):
    args = _inputs(dtype)
    (out,), low = _lowered(_assign, args)
    (ref,) = _assign(*args)
    (ref64,) = _assign(*[a.double() for a in args])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert_close(out.float(), ref.float(), f"slice assignments {dtype} vs eager", **tol)
    assert_close(out.double(), ref64, f"slice assignments {dtype} vs float64", **{k: 4 * v for k, v in tol.items()})
    ops = [op for op, _kind, _grp in low.program.node_groups()]
    assert ops.count("aotfuse::box_scatter.default") == 3 and ops.count("aotfuse::box_fill.default") == 2, ops
    # the levels' scatters, their bases' copies and the fills are not made
    assert not any(op.split(".")[0] in ("aten::slice_scatter", "aten::select_scatter", "aten::copy", "aten::clone",
                                        "aten::fill") for op in ops), ops
    # one kernel: the scale, three boxes, two fills, the last scale, and the boxes' computed sources
    # (the exp of the first, the doubled slice the second reads through an unsqueeze: computed from
    # the slice itself, csrc/sink.c), each evaluated at its box's index (shifted members)
    assert low.program.num_kernels == 1 and low.program.num_steps == 1, low.program
    box_group = {grp for op, _k, grp in low.program.node_groups() if op.startswith("aotfuse::box")}
    assert len(box_group) == 1 and box_group != {-1}, low.program.node_groups()


def test_slice_assignment_gradients_match_eager():
    """The backward of the assignments zeroes the regions of the gradient (box_fill) and reads the
    sources' gradients out of it; aotfuse's training step gives eager's gradients."""
    def f(x, y, z):
        return (_assign(x, y, z)[0].sin().sum(),)

    fused = aotfuse.aot_function(f)
    args = _inputs(torch.float32, requires_grad=True)
    (loss,) = fused(*args)
    loss.backward()
    ref_args = _inputs(torch.float32, requires_grad=True)
    (ref,) = f(*ref_args)
    ref.backward()
    assert_close(loss.detach(), ref.detach(), "loss")
    for name, a, b in zip("xyz", args, ref_args):
        assert_close(a.grad, b.grad, f"gradient of {name}")
    rec = fused.records[-1]
    bw_ops = [op for op, _k, _g in rec.programs["backward"].program.node_groups()]
    assert "aotfuse::box_fill.default" in bw_ops, bw_ops


def test_box_ops_own_implementation_and_errors():
    base = torch.arange(24.0).reshape(2, 3, 4)
    src = -torch.ones(1, 2, 2)
    out = torch.ops.aotfuse.box_scatter(base, src, [1, 1, 2])
    ref = base.clone()
    ref[1:2, 1:3, 2:4] = src
    assert torch.equal(out, ref) and torch.equal(base, torch.arange(24.0).reshape(2, 3, 4))
    out = torch.ops.aotfuse.box_fill(base, [0, 2, 1], [2, 1, 2], 7.0)
    ref = base.clone()
    ref[:, 2:3, 1:3] = 7.0
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="outside base"):
        torch.ops.aotfuse.box_scatter(base, src, [2, 0, 0])
    with pytest.raises(ValueError, match="rank"):
        torch.ops.aotfuse.box_fill(base, [0, 0], [1, 1], 0.0)


@pytest.mark.parametrize("env", [{"AOTFUSE_FUSION": "0"}, {"AOTFUSE_BACKEND": "aten"}], ids=["no-fusion", "aten"])
def test_without_kernels_scatters_stay_aten_calls(monkeypatch, env):
    """Without generated kernels no box is made (it would be an ATen-composed call of ours): the
    scatters stay ATen's, with eager's values."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = _inputs(torch.float32)
    (out,), low = _lowered(_assign, args)
    externs = low.extern_counts()
    assert low.program.num_kernels == 0 and not any(op.startswith("aotfuse::box") for op in externs), externs
    assert externs.get("aten::slice_scatter.default", 0) + externs.get("aten::select_scatter.default", 0) >= 5, externs
    assert_close(out, _assign(*args)[0], "slice assignments without kernels", atol=1e-6, rtol=1e-6)


def test_integer_assignments_stay_aten_scatters():
    """Nested assignments into an integer tensor (no window kernel takes it) stay ATen's scatters."""
    def f(x):
        m = x * 2
        m[:, 0, 1:3] = 7
        return (m,)

    x = torch.arange(24).reshape(2, 3, 4)
    (out,), low = _lowered(f, [x])
    ops = [op for op, _k, _g in low.program.node_groups()]
    assert not any(op.startswith("aotfuse::box") for op in ops), ops
    assert torch.equal(out, f(x)[0])


def test_scatters_into_other_regions_stay_scatters():
    """A scatter whose source scatters into another region of the base (not the one scattered back)
    is no box: it stays two scatters, with eager's values."""
    aten = torch.ops.aten

    def f(x, y):
        inner = aten.slice_scatter.default(aten.slice.Tensor(x, 1, 0, 4), y, 2, 1, 3)  # region [0, 4) of dim 1
        return (aten.slice_scatter.default(x, inner, 1, 2, 6) * 3,)  # scattered back at [2, 6)

    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = torch.randn(2, 8, 5), torch.randn(2, 4, 2)
    low = lower(make_fx(f)(x, y))
    ops = [op for op, _k, _g in low.program.node_groups()]
    assert "aotfuse::box_scatter.default" not in ops and ops.count("aten::slice_scatter.default") == 2, ops
    assert_close(low([x, y])[0], f(x, y)[0], "scatters into other regions", atol=1e-6, rtol=1e-6)


def test_boxes_compile_with_nvrtc():
    """The boxes' CUDA kernels (guarded, shifted loads; a fill without a source) compile for sm_80
    and sm_90 without spills."""
    from aotfuse import _C
    from aotfuse.lower import build_graph
    from aotfuse.nvrtc_check import compile_report, nvrtc_available

    why = nvrtc_available()
    if why is not None:
        pytest.skip(f"no NVRTC library here: {why}")
    gm = _functional_graph(_assign, _inputs(torch.bfloat16))
    source, launches = _C.cuda_codegen(build_graph(gm, device="cuda:0").graph)
    assert "aotfuse::box_scatter" in source and "aotfuse::box_fill" in source, source
    assert launches and all(l["kind"] == "pointwise" for l in launches), launches
    for arch in (80, 90):
        for k in compile_report(source, arch):
            assert k["spill_stores"] == k["spill_loads"] == 0, (arch, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_boxes_in_emulated_cuda_kernels_match_eager(dtype):
    """The generated CUDA kernels, run in the host emulation (tests/cuda_emu.py), give eager's
    values for the one box kernel, which computes the boxes' sources in it."""
    import cuda_emu

    why = cuda_emu.unavailable()
    if why is not None:
        pytest.skip(f"no CUDA emulation here: {why}")
    args = _inputs(dtype)
    gm = _functional_graph(_assign, args)
    ran = cuda_emu.check(gm, args, f"boxes {dtype}")
    assert len(ran) == 1 and all(l["kind"] == "pointwise" for l in ran), ran
    source = cuda_emu.source_of(gm)
    assert "aotfuse::box_fill" in source and source.count("its source computed at its index") == 2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_boxes_on_cuda_train_like_eager(dtype):
    """On a GPU: the nested assignments' forward (boxes) and backward (box fills) in CUDA kernels,
    with eager's loss and gradients."""
    def f(x, y, z):
        return (_assign(x, y, z)[0].sin().sum(),)

    args = [a.cuda().requires_grad_() for a in _inputs(dtype)]
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    fused = aotfuse.aot_function(f)
    (loss,) = fused(*args)
    loss.backward()
    (ref,) = f(*ref_args)
    ref.backward()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    assert_close(loss.detach().float(), ref.detach().float(), f"loss {dtype}", **tol)
    for name, a, b in zip("xyz", args, ref_args):
        assert_close(a.grad.float(), b.grad.float(), f"gradient of {name} {dtype}", **tol)
    programs = fused.records[-1].programs
    assert "aotfuse::box_scatter" in (programs["forward"].program.cuda_source or "")
    assert "aotfuse::box_fill" in (programs["backward"].program.cuda_source or "")
