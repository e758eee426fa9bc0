"""Kernel templates: a program for a new input shape calls the C kernel bodies earlier programs
compiled wherever its kernels differ from theirs only in sizes (csrc/templates.c). What a new
sequence length costs is then tracing and planning, not compiling; the values must be the new
shape's (a reduction whose length became an argument may add in another order: the same to the
tolerances, and bit for bit under torch.use_deterministic_algorithms, which turns templates off)."""
import copy
import functools
import gc

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse import _C
from helpers import assert_batches_train_like_eager, assert_close, assert_grads_match


class Block(nn.Module):
    """Rows whose length is the sequence length (a softmax over keys), a norm over the hidden size,
    a transpose, broadcast biases and a residual: kernels whose sizes, strides and row counts
    change with the sequence length while the hidden sizes stay."""

    def __init__(self, hidden=24):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc, self.out = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        h = self.norm(x)
        scores = torch.softmax(h @ h.transpose(1, 2) * 0.25, dim=-1)
        h = (scores @ h).transpose(0, 1).contiguous().transpose(0, 1)
        h = self.out(nn.functional.gelu(self.fc(h))) + x
        return (h * h).mean(), h.sum(dim=1)


def _programs(record):
    for low in record.programs.values():
        yield low
        yield from low.variants.values()


def _train_shapes(compiled, model, shapes, double=None):
    """Each shape through the compiled module and eager: outputs and gradients agree (and the loss
    with a float64 copy's, when given)."""
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        x = torch.randn(*shape, generator=g)
        (loss, rows), (ref_loss, ref_rows) = compiled(x), model(x)
        assert_close(loss, ref_loss, f"shape {shape}: loss")
        assert_close(rows, ref_rows, f"shape {shape}: row sums")
        if double is not None:
            assert abs(loss.item() - double(x.double())[0].item()) < 1e-4 * max(1.0, abs(loss.item())), shape
        (loss + rows.sum()).backward()
        (ref_loss + ref_rows.sum()).backward()
        assert_grads_match(compiled, model, f"shape {shape}")


def test_new_shapes_call_the_bodies_earlier_shapes_compiled(monkeypatch):
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")  # keep the softmax over keys in a kernel
    torch.manual_seed(0)
    model = Block()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
    shapes = [(2, 8, 24), (2, 12, 24), (2, 16, 24), (2, 20, 24), (3, 7, 24), (2, 12, 24)]
    _train_shapes(compiled, model, shapes, double=copy.deepcopy(model).double())
    records = compiled._aotfuse_compiled.records
    assert len(records) == 5  # the last shape was the second's
    during = _C.kernel_templates()
    assert during > 0
    for record in records[2:4]:  # sequence lengths 16 and 20: what 8 and 12 taught
        progs = [low.program for low in _programs(record) if low.program.num_kernels]
        assert progs
        reused = sum(p.bodies_reused for p in progs)
        compiled_here = [p for p in progs if p.compiled_source is not None]
        assert reused > 0, [(p.bodies_reused, p.bodies_lifted) for p in progs]
        # most programs compile nothing; what one compiles is less than its whole source
        assert len(compiled_here) < len(progs), [(p.bodies_reused, p.bodies_lifted) for p in progs]
        for p in compiled_here:
            assert p.compiled_source.count("AF_BODY void af_body_") < p.source.count("AF_BODY void af_body_")
    # a template's sizes come from each caller: the bodies lifted for later shapes read af_n
    lifted = [low.program for r in records for low in _programs(r) if low.program.bodies_lifted]
    assert lifted and all("af_n[" in p.compiled_source for p in lifted)
    # templates leave with the last program using them
    del compiled, records, lifted
    gc.collect()
    assert _C.kernel_templates() < during


def test_templates_off_compile_every_body_here(monkeypatch):
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")
    monkeypatch.setenv("AOTFUSE_KERNEL_TEMPLATES", "0")
    torch.manual_seed(1)
    model = Block()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
    before = _C.kernel_templates()
    _train_shapes(compiled, model, [(2, 8, 24), (2, 12, 24), (2, 16, 24)])
    for record in compiled._aotfuse_compiled.records:
        for low in _programs(record):
            p = low.program
            assert p.bodies_reused == 0 and p.bodies_lifted == 0
            if p.num_kernels and p.kernels_loaded:
                assert p.compiled_source == p.source
    assert _C.kernel_templates() == before  # nothing offered to later programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_sizes_and_dtypes_vary_too(dtype):
    """Other hidden sizes and dtypes: bodies whose hidden size differs are templates too (or their
    own kernels), never another size's kernel with the wrong values."""
    torch.manual_seed(2)
    engaged = 0
    for hidden in (16, 24, 40):
        model = Block(hidden).to(dtype)
        compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
        g = torch.Generator().manual_seed(hidden)
        for seq in (6, 10, 14):
            x = torch.randn(2, seq, hidden, generator=g).to(dtype)
            (loss, rows), (ref_loss, ref_rows) = compiled(x), model(x)
            tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
            assert_close(loss, ref_loss, f"hidden {hidden}, seq {seq}, {dtype}: loss", **tol)
            assert_close(rows, ref_rows, f"hidden {hidden}, seq {seq}, {dtype}: row sums", **tol)
        engaged += sum(low.program.bodies_reused + low.program.bodies_lifted
                       for r in compiled._aotfuse_compiled.records for low in _programs(r))
    assert engaged > 0


def test_torch_compile_backend_shapes_share_bodies():
    """Under torch.compile(backend="aotfuse"), a graph Dynamo made dynamic is compiled per shape
    (dynamo._per_shape); those programs find the bodies too."""
    from aotfuse.dynamo import aotfuse_backend

    torch._dynamo.reset()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    seen: list = []
    compiled = torch.compile(twin, backend=functools.partial(aotfuse_backend, collect=seen), dynamic=True)
    assert_batches_train_like_eager(compiled, twin, model, (3, 5, 7, 9), 8)
    progs = [low.program for _stage, low in seen if low.program.num_kernels]
    assert sum(p.bodies_reused for p in progs[-2:]) > 0, [(p.bodies_reused, p.bodies_lifted) for p in progs]
    torch._dynamo.reset()


def test_deterministic_algorithms_compile_each_shape_as_itself(monkeypatch):
    """Under torch.use_deterministic_algorithms a shape's values never depend on which shapes came
    before: bit for bit those of a model that saw only that shape."""
    monkeypatch.setenv("AOTFUSE_FUSE_ATTENTION", "0")
    torch.manual_seed(4)
    model = Block()
    x8, x12 = torch.randn(2, 8, 24), torch.randn(2, 12, 24)

    def run(compiled, x):
        loss, rows = compiled(x)
        (loss + rows.sum()).backward()
        out = [loss.detach(), rows.detach()] + [p.grad.clone() for p in compiled.parameters()]
        compiled.zero_grad()
        return out

    with monkeypatch.context() as m:  # compiled as itself, whatever earlier tests left registered
        m.setenv("AOTFUSE_KERNEL_TEMPLATES", "0")
        fresh = run(aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False), x12)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        seasoned = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
        run(seasoned, x8)
        after = run(seasoned, x12)
        for record in seasoned._aotfuse_compiled.records:
            for low in _programs(record):
                assert low.program.bodies_reused == 0 and low.program.bodies_lifted == 0
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(after, fresh):
        assert torch.equal(a, b)


def test_another_compiler_finds_no_template(monkeypatch, tmp_path):
    """A body is found only by programs compiled with the same compiler and flags: with AOTFUSE_CC
    pointing elsewhere the program compiles (here: fails to) instead of calling a loaded body."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16))
    first = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
    x = torch.randn(4, 8)
    first(x).sum().backward()  # its bodies are registered (and kept alive by `first`)
    again = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
    again(x).sum().backward()
    fw = again._aotfuse_compiled.records[-1].programs["forward"].program
    assert fw.bodies_reused > 0 and fw.compiled_source is None  # same compiler: all found
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AOTFUSE_CC", str(tmp_path / "no-such-cc"))
    third = aotfuse.memory_efficient_fusion(copy.deepcopy(model), dynamic=False)
    with pytest.raises(Exception, match="C compiler"):
        third(x)
    del first, again


def test_a_column_kernel_of_one_block_is_a_template_only_for_one_block_shapes():
    """A column-phased kernel whose columns fit one block loops over constant bounds (codegen_c.c,
    small_loop), its arrays a block long: its text differs from the general kernel's, so a body lifted
    for 8 and 12 columns is never called for 40 or 200 (the key keeps them apart), where its one
    block would run past its arrays. Softmax over dim 1 (the columns the contiguous last dim) at
    several widths, each against eager."""
    f = lambda x: torch.softmax(x * 2.0, dim=1)  # noqa: E731
    compiled = aotfuse.aot_function(f, dynamic=False)
    lifted = 0
    for columns in (8, 12, 200, 40, 16, 8):
        x = torch.randn(3, 37, columns, generator=torch.Generator().manual_seed(columns))
        assert_close(compiled(x), f(x), f"softmax over dim 1 of [3, 37, {columns}]", atol=1e-6, rtol=1e-5)
        p = compiled.records[-1].programs["inference"].program
        assert "column-phased" in p.source
        assert ("c0 = 0, c1 = " in p.source) == (columns <= 16), columns
        lifted += p.bodies_lifted + p.bodies_reused
    assert lifted > 0  # the widths shared bodies
