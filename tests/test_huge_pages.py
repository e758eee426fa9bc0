"""Transparent huge pages for large CPU tensors a program allocates (hugepages.h): kernel outputs,
and extern results written through their out= overloads, of at least `huge_pages` bytes are
marked MADV_HUGEPAGE before their first write, so their first touch faults 2 MiB pages instead of
4 KiB ones. Results must be exactly those of the same program without it."""
import os
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse import _C, config
from aotfuse.lower import build_graph

aten = torch.ops.aten
MIB = 1 << 20


def _program(fn, *args, huge_pages):
    """Without buffer reuse: the kernel output here would otherwise be written into the mm's dying
    result (kernels in place) and allocate nothing."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return _C.Program(build_graph(gm).graph, fuse=True, huge_pages=huge_pages, reuse=False)


def _f(x, w):
    y = aten.mm.default(x, w)  # an extern result: 1024 x 1024 float32, 4 MiB
    z = aten.mul.Tensor(aten.sin.default(y), 2.0)  # a kernel output, 4 MiB
    return (z, aten.sum.default(y))


def _inputs():
    torch.manual_seed(0)
    return torch.randn(1024, 64), torch.randn(64, 1024) / 8


def _thp_supported() -> bool:
    return os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_outputs_get_huge_pages_with_unchanged_results():
    x, w = _inputs()
    prog, plain = _program(_f, x, w, huge_pages=2 * MIB), _program(_f, x, w, huge_pages=0)
    for run in range(3):
        got, want = prog.run([x, w]), plain.run([x, w])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"run {run}: huge pages changed a result"
    ref = torch.mul(torch.sin(x.double() @ w.double()), 2.0)
    torch.testing.assert_close(got[0].double(), ref, atol=1e-4, rtol=1e-5)
    assert plain.huge_page_tensors == 0
    if not _thp_supported():
        pytest.skip("this kernel has no transparent huge pages (no /sys/kernel/mm/transparent_hugepage): madvise "
                    "refuses, and the outputs are allocated as before (checked above)")
    # both the kernel output and the mm's result (allocated here, written by mm's out= overload), every run
    assert prog.huge_page_tensors == 2 * 3, prog.huge_page_tensors
    z = got[0]
    first_page = (z.data_ptr() + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
    assert first_page + 2 * MIB <= z.data_ptr() + z.numel() * 4, "a 4 MiB tensor holds a whole 2 MiB page"
    assert "hg" in _vm_flags(first_page), "the kernel output's pages are not marked MADV_HUGEPAGE"


def test_small_outputs_and_cuda_are_left_alone():
    x, w = _inputs()
    prog = _program(_f, x, w, huge_pages=64 * MIB)  # above every tensor here
    out = prog.run([x, w])
    assert prog.huge_page_tensors == 0
    assert torch.equal(out[0], _program(_f, x, w, huge_pages=0).run([x, w])[0])
    with pytest.raises(ValueError, match="huge_pages must be >= 0"):
        _program(_f, x, w, huge_pages=-1)


def test_an_extern_refusing_out_runs_its_plain_call():
    # mm's out= overload refuses an input that requires grad under grad mode (autograd has no
    # out= formula): the program then makes the plain call, every later run too
    x, w = _inputs()
    wg = w.clone().requires_grad_(True)
    prog = _program(_f, x, w, huge_pages=2 * MIB)
    got = prog.run([x, wg])
    want = _program(_f, x, w, huge_pages=0).run([x, wg])
    assert torch.equal(got[0].detach(), want[0].detach()) and torch.equal(got[1].detach(), want[1].detach())
    prog.run([x, wg])
    if _thp_supported():
        # the kernel output in each run, and the tensor the first run allocated for mm before the refusal
        assert prog.huge_page_tensors == 3, prog.huge_page_tensors


def test_config_reads_mib(monkeypatch):
    monkeypatch.delenv("AOTFUSE_HUGE_PAGES", raising=False)
    assert config.huge_pages() == 32 * MIB
    monkeypatch.setenv("AOTFUSE_HUGE_PAGES", "0")
    assert config.huge_pages() == 0
    monkeypatch.setenv("AOTFUSE_HUGE_PAGES", "0.5")
    assert config.huge_pages() == MIB // 2
    monkeypatch.setenv("AOTFUSE_HUGE_PAGES", "lots")
    with pytest.raises(ValueError, match="AOTFUSE_HUGE_PAGES"):
        config.huge_pages()


def test_programs_without_kernels_allocate_large_extern_results_too():
    """An extern result of the threshold's size in a program with no fused kernels (no fusion, or
    nothing to fuse): allocated, marked and written through out= like any other."""
    x, w = _inputs()

    def f(x, w):
        return (aten.mm.default(x, w),)

    for fuse in (False, True):
        gm = make_fx(f, tracing_mode="fake")(x, w)
        prog = _C.Program(build_graph(gm).graph, fuse=fuse, huge_pages=2 * MIB)
        for _ in range(2):
            assert torch.equal(prog.run([x, w])[0], x @ w)
        if _thp_supported():
            assert prog.huge_page_tensors == 2, (fuse, prog.huge_page_tensors)


def test_a_bias_free_linear_under_no_grad_at_the_default_threshold():
    import aotfuse

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 8192, bias=False)  # a 32 MiB result, one mm, no kernel
    x = torch.randn(1024, 1024)
    with torch.no_grad():
        got = aotfuse.memory_efficient_fusion(lin)(x)
        want = lin(x)
    torch.testing.assert_close(got, want)
