"""Buffer reuse: a kernel output, or the result of an extern with an out= overload, takes the
tensor of an intermediate whose storage died earlier in the program (it and every view of it read
for the last time, none an output or an input, none passed to an op that may alias), instead of a
fresh allocation, where keeping the dead tensor until then leaves the program's peak where it was.
Results must be exactly those of the same program without reuse."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
from aotfuse import _C
from aotfuse.bench import _cpu_peak
from aotfuse.lower import build_graph, lower
from helpers import assert_close

aten = torch.ops.aten


def _program(fn, *args, reuse=True):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return _C.Program(build_graph(gm).graph, fuse=True, reuse=reuse)


def _chain(x, w):
    a = aten.mul.Tensor(aten.relu.default(aten.mm.default(x, w)), 2.0)
    b = aten.add.Tensor(aten.sin.default(aten.mm.default(a, w)), 1.0)
    c = aten.mul.Tensor(aten.cos.default(aten.mm.default(b, w)), 3.0)
    d = aten.sub.Tensor(aten.exp.default(aten.mm.default(c, w)), 1.0)
    return (aten.sum.default(d),)


def _chain_inputs():
    torch.manual_seed(0)
    return torch.randn(64, 64) / 8, torch.randn(64, 64) / 8


def _chain_t(x, w):
    """_chain with each kernel making its matmul's result transposed, contiguous: no kernel output
    has its input's layout, so none is written in place, and the matmuls' results take dead tensors."""
    def tc(y):
        return aten.clone.default(aten.t.default(y), memory_format=torch.contiguous_format)
    a = aten.mul.Tensor(aten.relu.default(tc(aten.mm.default(x, w))), 2.0)
    b = aten.add.Tensor(aten.sin.default(tc(aten.mm.default(a, w))), 1.0)
    c = aten.mul.Tensor(aten.cos.default(tc(aten.mm.default(b, w))), 3.0)
    d = aten.sub.Tensor(aten.exp.default(tc(aten.mm.default(c, w))), 1.0)
    return (aten.sum.default(d),)


@pytest.mark.parametrize("chain", [_chain, _chain_t])
def test_kernel_outputs_and_extern_results_take_dead_tensors(chain):
    """_chain: each kernel writes its output into its matmul's result, which dies there (in place);
    _chain_t: kernels and out= externs take tensors dead at earlier steps."""
    x, w = _chain_inputs()
    prog, plain = _program(chain, x, w), _program(chain, x, w, reuse=False)
    assert plain.buffer_reuses == 0 and plain.buffer_donors() == []
    donors = prog.buffer_donors()
    takers = {how for _v, _d, how, _dhow in donors}
    if chain is _chain:
        assert prog.buffer_reuses == len(donors) == 3, donors
        assert all(how == "kernel" and dhow == "aten::mm.default" and d == v - 2 for v, d, how, dhow in donors), donors
    else:
        assert prog.buffer_reuses == len(donors) >= 4, donors
        assert "kernel" in takers and "aten::mm.default" in takers, donors  # kernels and out= externs both take
    assert prog.reused_bytes > 0 and prog.reused_bytes + prog.fresh_bytes == plain.fresh_bytes
    for run in range(3):  # the first run checks each donor's layout; later runs reuse without checks
        got, want = prog.run([x, w]), plain.run([x, w])
        assert torch.equal(got[0], want[0]), f"run {run}: reuse changed the result"
    ref = chain(x.double(), w.double())[0]
    assert_close(got[0].double(), ref, "chain vs float64", atol=1e-4, rtol=1e-5)
    assert prog.reuses_refused == 0 and prog.kernel_fallbacks == 0
    assert prog.reuses_taken == 3 * prog.buffer_reuses, "every planned reuse happens in every run"


def test_values_with_live_views_outputs_or_aliasing_readers_are_never_donors():
    def f(x, w):
        y = aten.mm.default(x, w)
        kept = aten.view.default(aten.mul.Tensor(y, 2.0), [16, 256])  # an output's storage: never reused
        s = aten.add.Tensor(y, 1.0)
        part = aten.split.Tensor(s, 64)[0]  # may alias s (it does: one part, all of s): s is never reused
        t = aten.mul.Tensor(aten.mm.default(aten.sin.default(s), w), 3.0)
        u = aten.exp.default(aten.mm.default(aten.relu.default(t), w))
        v = aten.cos.default(aten.mm.default(aten.tanh.default(u), w))
        return kept, aten.sum.default(v), part

    x, w = _chain_inputs()
    prog = _program(f, x, w)
    donors = prog.buffer_donors()
    donor_ops = {dhow for _v, _d, _how, dhow in donors}
    assert "aten::split.Tensor" not in donor_ops and "aten::view.default" not in donor_ops, donors
    first = prog.run([x, w])
    kept0 = first[0].clone()
    for _ in range(3):  # later runs must not write into what earlier runs returned
        out = prog.run([x, w])
    assert torch.equal(first[0], kept0), "a returned tensor was reused by a later run"
    assert prog.reuses_refused == 0, "the plan gave away a tensor still held (the run-time check refused it)"
    ref = f(x, w)
    for o, r, what in zip(out, ref, ("view output", "sum", "split part")):
        assert_close(o, r, what)


def test_reuse_does_not_raise_the_peak():
    def f(x, w):
        h = x
        for _ in range(6):
            h = aten.mul.Tensor(aten.tanh.default(aten.mm.default(h, w)), 0.5)
        return (aten.sum.default(h),)

    x, w = torch.randn(512, 512), torch.randn(512, 512) / 16
    prog, plain = _program(f, x, w), _program(f, x, w, reuse=False)
    for p in (prog, plain):
        p.run([x, w])
    peak, peak_plain = _cpu_peak(lambda: prog.run([x, w])), _cpu_peak(lambda: plain.run([x, w]))
    assert prog.buffer_reuses >= 5  # the kernels write into their matmuls' dying results
    assert peak <= peak_plain, f"peak with reuse {peak} > without {peak_plain}"
    assert torch.equal(prog.run([x, w])[0], plain.run([x, w])[0])


def test_an_out_overload_that_refuses_falls_back_to_the_plain_call():
    x, w = _chain_inputs()
    prog = _program(_chain_t, x, w)
    assert any(how == "aten::mm.default" for _v, _d, how, _dh in prog.buffer_donors())
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.enable_grad():  # out= refuses inputs that need grad: the plain mm runs
        for _ in range(2):
            got = prog.run([xg, wg])
            assert_close(got[0].detach(), _chain_t(x, w)[0], "chain with grad-requiring inputs")
    assert torch.equal(prog.run([x, w])[0].detach(), _program(_chain_t, x, w, reuse=False).run([x, w])[0])


def test_without_input_checks_runs_allocate_fresh():
    """AOTFUSE_CHECK_INPUTS=0: layouts are not known to repeat, so no run takes a donor."""
    x, w = _chain_inputs()
    prog, plain = _program(_chain, x, w), _program(_chain, x, w, reuse=False)
    prog.check_inputs = False
    for _ in range(2):
        assert torch.equal(prog.run([x, w])[0], plain.run([x, w])[0])
    assert prog.buffer_reuses > 0 and prog.reuses_taken == 0 and prog.reuses_refused == 0
    prog.check_inputs = True
    prog.run([x, w])
    assert prog.reuses_taken == prog.buffer_reuses


def test_reuse_can_be_turned_off(monkeypatch):
    x, w = _chain_inputs()
    gm = make_fx(_chain, tracing_mode="fake")(x, w)
    assert lower(gm, [x, w]).program.buffer_reuses > 0
    monkeypatch.setenv("AOTFUSE_REUSE_BUFFERS", "0")
    low = lower(gm, [x, w])
    assert low.program.buffer_reuses == 0 and low.program.buffer_donors() == []


@pytest.mark.cuda
def test_reuse_on_cuda_matches_no_reuse():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    x, w = (t.cuda() for t in _chain_inputs())
    prog, plain = _program(_chain, x, w), _program(_chain, x, w, reuse=False)
    donors = prog.buffer_donors()  # as on the CPU: each kernel writes into its matmul's dying result
    assert prog.buffer_reuses == len(donors) == 3, donors
    assert all(how == "kernel" and dhow == "aten::mm.default" for _v, _d, how, dhow in donors), donors
    for _ in range(3):
        assert torch.equal(prog.run([x, w])[0], plain.run([x, w])[0])
    assert_close(prog.run([x, w])[0].cpu().double(), _chain(x.cpu().double(), w.cpu().double())[0], "cuda chain vs float64",
                 atol=1e-3, rtol=1e-4)


def _mm_tt(x, w):
    return aten.t.default(aten.t.default(aten.mm.default(x, w)))  # a view with its root's layout (held)


def _index_add_inputs():
    x, w = _chain_inputs()
    return x, w, torch.tensor([3, 0, 3, 63, 7]), torch.randn(5, 64)


def _index_add_donors(prog):
    return [d for d in prog.buffer_donors() if d[2] == "aten::index_add.default"]


def test_index_add_adds_into_its_first_arguments_tensor_where_that_dies():
    """An index_add whose first argument dies at it (read by nothing later, no output, no input)
    writes into that argument's own tensor (its out= overload given the argument itself): no
    fresh tensor, no copy; the results are those of the program without reuse, run after run."""
    def f(x, w, idx, src):
        return (aten.mul.Tensor(aten.index_add.default(_mm_tt(x, w), 0, idx, src), 2.0),)

    args = _index_add_inputs()
    prog, plain = _program(f, *args), _program(f, *args, reuse=False)
    assert _index_add_donors(prog), prog.buffer_donors()
    for run in range(3):
        got, want = prog.run(list(args)), plain.run(list(args))
        assert torch.equal(got[0], want[0])
        if run == 0:  # the first run makes the views through ATen: the kernel after finds the storage shared
            refused, taken = prog.reuses_refused, prog.reuses_taken
    assert_close(got[0], f(*args)[0], "index_add in place vs eager", atol=0, rtol=0)
    assert prog.reuses_refused == refused and prog.reuses_taken == taken + 2 * prog.buffer_reuses


@pytest.mark.parametrize("case", ["also an output", "read later", "source aliases it", "an input"])
def test_index_add_never_writes_into_a_first_argument_still_needed(case):
    """Where the first argument is returned, read by a later step, shares its storage with another
    argument, or is a program input, index_add writes a fresh tensor: the argument keeps its values."""
    def f(x, w, idx, src):
        if case == "an input":
            return (aten.mul.Tensor(aten.index_add.default(x, 0, idx, src), 2.0),)
        y = _mm_tt(x, w)
        if case == "also an output":
            return aten.index_add.default(y, 0, idx, src), y
        if case == "read later":
            return (aten.add.Tensor(aten.index_add.default(y, 0, idx, src), y),)
        return (aten.mul.Tensor(aten.index_add.default(y, 0, idx, aten.slice.Tensor(y, 0, 0, 5)), 2.0),)

    args = _index_add_inputs()
    x0 = args[0].clone()
    prog = _program(f, *args)
    assert not _index_add_donors(prog), prog.buffer_donors()
    for _ in range(2):
        got = prog.run(list(args))
    for g, r, i in zip(got, f(*args), range(9)):
        assert_close(g, r, f"{case}: output {i}", atol=1e-6, rtol=1e-6)
    assert torch.equal(args[0], x0), "an input was written"


def _exp2(x):
    return (aten.mul.Tensor(aten.exp.default(x), 2.0),)


def test_a_kernel_writes_into_a_dying_input_that_nobody_else_holds():
    """A program input read for the last time by a kernel whose output has its layout (each element
    read before it is written) is written in place when the run finds its data held by the run alone
    (the input list emptied, no other reference, no view): the output is the input's tensor; the
    generated pointers of that pair are not restrict."""
    x = torch.randn(64, 128)
    prog = _program(_exp2, x)
    want = _program(_exp2, x, reuse=False).run([x])[0]
    assert [(how, dhow) for _v, _d, how, dhow in prog.buffer_donors()] == [("kernel", "input")], prog.buffer_donors()
    assert "float *q1" in prog.source and "*restrict q0" not in prog.source, prog.source
    for run in range(3):
        mine = x.clone()
        ptr = mine.data_ptr()
        args = [mine]
        del mine
        out = prog.run(args)[0]
        assert args == [] and out.data_ptr() == ptr, f"run {run}: not written in place"
        assert torch.equal(out, want)
    assert prog.reuses_taken == 3 and prog.reuses_refused == 0


def _normalize(x, m, r):
    return (aten.mul.Tensor(aten.sub.Tensor(x, m), r),)


def test_an_in_place_kernels_loop_says_no_iteration_reads_what_another_writes():
    """A norm's output written into its input's tensor, with per-row values (the mean, the inverse
    deviation) read in the row's loop: the pair's pointers are not restrict, so the loop carries
    AF_IVDEP (GCC left such a loop scalar: Bert's GELU and layer norm recomputed for its LM head in
    bf16 took 1.7 ms for 131072 elements, 0.26 ms with it). Written in place, eager's values; a
    kernel with no input of its output's layout has no pragma."""
    torch.manual_seed(0)
    x, m, r = torch.randn(64, 128), torch.randn(64, 1), torch.rand(64, 1) + 0.5
    prog = _program(_normalize, x, m, r)
    want = _normalize(x, m, r)[0]
    assert "*restrict q0" not in prog.source and "AF_IVDEP\n    for (af_idx i" in prog.source, prog.source
    row = x[:1].clone()
    broadcast = _program(_normalize, row, m, r)  # [1, 128] against [64, 1]: nothing to write into
    assert "AF_IVDEP\n    for" not in broadcast.source and "*restrict q0" in broadcast.source, broadcast.source
    assert torch.equal(broadcast.run([row, m, r])[0], _normalize(row, m, r)[0])
    mine = x.clone()
    ptr = mine.data_ptr()
    args = [mine, m, r]
    del mine
    out = prog.run(args)[0]
    assert out.data_ptr() == ptr, "not written in place"
    assert torch.equal(out, want)


def _softmax_parts(x):
    m = aten.amax.default(x, [1], True)
    e = aten.exp.default(aten.sub.Tensor(x, m))
    return (aten.mul.Tensor(e, aten.reciprocal.default(aten.sum.dim_IntList(e, [1], True))),)


def test_a_phased_kernels_in_place_pass_says_no_iteration_reads_what_another_writes():
    """A row kernel of three passes (max; exp and sum; scale) writing its output into its input's
    tensor: the storing pass has no `omp simd` (no reduction), and GCC vectorized it only behind a
    run-time overlap check, which the in-place pair fails (Bert's bf16 cross entropy backward 4.08
    -> 3.89 ms with the pragma); so that pass carries AF_IVDEP too. Written in place, the values
    of the kernel writing a fresh tensor, and softmax's."""
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    prog = _program(_softmax_parts, x)
    assert "AF_IVDEP\n    for (af_idx i = i0; i < i1; i++) { /* phase 2 */" in prog.source, prog.source
    assert prog.source.count("AF_IVDEP\n    for") == 1, prog.source  # phases 0 and 1 have omp simd
    want = _program(_softmax_parts, x, reuse=False).run([x])[0]
    mine = x.clone()
    ptr = mine.data_ptr()
    args = [mine]
    del mine
    out = prog.run(args)[0]
    assert out.data_ptr() == ptr, "not written in place"
    assert torch.equal(out, want)
    assert_close(out, torch.softmax(x, 1), "in-place softmax")


def _masked_residual(x, g, mask):
    out = aten.mul.Tensor(aten.add.Tensor(x, g), mask)
    return out, aten.sum.dim_IntList(aten.mul.Tensor(out, g), [0])


def test_a_column_kernels_in_place_loop_says_no_iteration_reads_what_another_writes():
    """A column reduction (a bias gradient's sum over rows) whose pointwise output is written into an
    input's tensor: the pair's pointers are not restrict, and GCC kept its column loop scalar (an
    invariant load in it had "no vectype"): T5's bf16 residual-gradient kernels with their dropout
    masks took 2.6-6.1 ms, 0.23-0.47 with AF_IVDEP. Written in place, the values of the kernel writing
    a fresh tensor, and eager's."""
    torch.manual_seed(0)
    x, g = torch.randn(512, 256), torch.randn(512, 256)
    mask = (torch.rand(512, 256) > 0.1).float()
    prog = _program(_masked_residual, x, g, mask)
    assert "column reductions)" in prog.source and "column-phased" not in prog.source, prog.source
    assert "*restrict q0" not in prog.source, prog.source
    assert "AF_IVDEP\n      for (af_idx c = c0; c < c1; c++)" in prog.source, prog.source
    fresh = _program(_masked_residual, x, g, mask, reuse=False)
    want = fresh.run([x, g, mask])
    mine = x.clone()
    ptr = mine.data_ptr()
    args = [mine, g, mask]
    del mine
    out, sums = prog.run(args)
    assert out.data_ptr() == ptr, "not written in place"
    assert torch.equal(out, want[0]) and torch.equal(sums, want[1])
    ref = _masked_residual(x, g, mask)
    assert_close(out, ref[0], "masked residual, in place")
    assert_close(sums, ref[1], "its column sums")


_HELD = ["the tensor", "a view of it", "its storage through another tensor", "its storage object", "numpy memory"]


@pytest.mark.parametrize("held", _HELD)
def test_a_kernel_never_writes_into_an_input_someone_holds(held):
    """The caller keeps the input, a view of it, another tensor on its storage, its storage object
    (a saved-tensor hook packing `t.untyped_storage()`), or the numpy array the input was made from:
    the kernel's output is a fresh tensor and what the caller holds is unchanged. (The last two were
    written into in a first version, found by a review.)"""
    x = torch.randn(64, 128)
    prog = _program(_exp2, x)
    want = _program(_exp2, x, reuse=False).run([x])[0]
    for _ in range(2):
        if held == "numpy memory":
            arr = x.numpy().copy()
            mine = torch.from_numpy(arr)
            keep = torch.from_numpy(arr[:])  # another tensor on the same memory, outside torch's counts
            del arr
        else:
            mine = x.clone()
        if held == "the tensor":
            keep = mine
        elif held == "a view of it":
            keep = mine[3]
        elif held == "its storage through another tensor":
            keep = mine.view(128, 64)
        elif held == "its storage object":
            storage = mine.untyped_storage()
            keep = torch.empty(0).set_(storage, 0, mine.shape, mine.stride())
            del storage
            storage = keep.untyped_storage()  # kept as a hook keeps it
            keep = None
        before = (keep if keep is not None else torch.empty(0).set_(storage, 0, x.shape, x.stride())).clone()
        args = [mine]
        del mine
        out = prog.run(args)[0]
        assert torch.equal(out, want)
        seen = keep if keep is not None else torch.empty(0).set_(storage, 0, x.shape, x.stride())
        assert torch.equal(seen, before), "an input someone holds was written"
        assert out.data_ptr() != seen.data_ptr()
    assert prog.reuses_taken == 0 and prog.reuses_refused == 2


def test_a_phased_kernels_earlier_pass_output_is_never_written_in_place():
    """softmax-like: exp(x) stored in the first pass, then divided by its row sum in the second: the
    first pass's output may not take x (the second pass reads x's row after it is written); the
    second pass's output may."""
    def f(x):
        e = aten.exp.default(x)
        s = aten.sum.dim_IntList(e, [1], True)
        return e, aten.div.Tensor(aten.exp.default(aten.mul.Tensor(x, 0.5)), s)

    x = torch.randn(64, 128)
    prog = _program(f, x)
    want = _program(f, x, reuse=False).run([x])
    donors = prog.buffer_donors()
    assert len(donors) == 1 and donors[0][0] == prog_output_value(prog, 1), donors
    for _ in range(2):
        args = [x.clone()]
        got = prog.run(args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert prog.reuses_taken == 2


def prog_output_value(prog, k):
    """The value id of the program's k-th output (the graph listing's return)."""
    ret = str(prog).strip().splitlines()[-1]
    names = ret[ret.index("(") + 1:ret.rindex(")")].split(", ")
    return int(names[k].lstrip("%v"))


class _LMHead(torch.nn.Module):
    """bf16 logits and cross entropy, as a language model's head (no logits-gradient chunks in 16-bit)."""

    def __init__(self, keep_logits):
        super().__init__()
        self.proj = torch.nn.Linear(32, 4000).to(torch.bfloat16)
        self.keep_logits = keep_logits

    def forward(self, h, y):
        logits = self.proj(h)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return (loss, logits) if self.keep_logits else (loss,)


def _head_step(keep_logits, monkeypatch, reuse="1"):
    import aotfuse
    monkeypatch.setenv("AOTFUSE_REUSE_BUFFERS", reuse)
    torch.manual_seed(0)
    model = _LMHead(keep_logits)
    h, y = torch.randn(256, 32, dtype=torch.bfloat16), torch.randint(0, 4000, (256,))
    m = aotfuse.memory_efficient_fusion(model)
    out = m(h, y)
    kept = out[1].detach().clone() if keep_logits else None
    out[0].backward()
    if keep_logits:
        assert torch.equal(out[1], kept), "the logits the caller holds were written by the backward"
    grads = [p.grad.clone() for p in model.parameters()]

    def step():
        model.zero_grad(set_to_none=True)
        m(h, y)[0].backward()

    return grads, _cpu_peak(step), m._aotfuse_compiled.records[-1].programs["backward"]


def test_the_loss_gradient_is_written_into_the_dying_logits(monkeypatch):
    """The backward's loss-gradient kernel reads the saved bf16 logits for the last time and writes
    the gradient, of their layout, into their tensor: the peak falls by about the logits' size, the
    gradients are bit for bit those without reuse; where the caller still holds the logits (returned
    by the forward) they are left as they were and the gradient gets a tensor of its own."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    grads, peak, bw = _head_step(False, monkeypatch)
    grads_off, peak_off, _ = _head_step(False, monkeypatch, reuse="0")
    held_grads, _peak, held_bw = _head_step(True, monkeypatch)
    logits_bytes = 256 * 4000 * 2
    assert peak <= peak_off - 0.5 * logits_bytes, (peak, peak_off)  # the forward's logits are the new peak
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_off))
    assert all(torch.equal(a, b) for a, b in zip(held_grads, grads_off))
    variants = [bw] + list(bw.variants.values())
    assert sum(v.program.reuses_taken for v in variants) > 0
    held = [held_bw] + list(held_bw.variants.values())
    assert sum(v.program.reuses_refused for v in held) > 0


def test_retain_graph_with_a_hook_keeping_the_storage_gives_the_same_second_backward():
    """A saved-tensor hook packing `t.untyped_storage()` and retain_graph=True: the first backward
    must not write into the saved activations the second reads (found by a review)."""
    import aotfuse

    def pack(t):
        return (t.untyped_storage(), t.size(), t.stride(), t.storage_offset(), t.dtype)

    def unpack(p):
        s, size, stride, off, dtype = p
        return torch.empty(0, dtype=dtype).set_(s, off, size, stride)

    def f(x, w):
        return (torch.softmax(x @ w, -1) * 3.0).logsumexp(-1).sum()

    x, w = torch.randn(64, 32), torch.randn(32, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = aotfuse.memory_efficient_fusion(f)(x, w)
    g1, = torch.autograd.grad(loss, w, retain_graph=True)
    g2, = torch.autograd.grad(loss, w)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("how", ["aot_function", "memory_efficient_fusion", "torch.compile"])
def test_a_donor_at_another_storage_offset_than_traced_is_not_taken(how):
    """ATen's functional copy keeps its argument's storage offset (copy(v, v) of a view at offset 4
    of a 20-element base: a fresh 20-element storage, offset 4) where the trace says 0. A kernel
    output that took that tensor as its donor then sat at offset 4, and an output viewing it with
    as_strided(..., storage_offset=1) read the copy of the base, [1, 2], not the kernel's zeros
    (inputs overlapping views of one base, one updated in place by a self-copy: found by a random
    aliasing sweep). A donor is now taken only at its traced storage offset."""
    def fn(a0, a1):
        a1.copy_(a1)
        m = a0 * 0
        return m.as_strided((2,), (1,), 1), m + 1

    make = {"aot_function": aotfuse.aot_function, "memory_efficient_fusion": aotfuse.memory_efficient_fusion,
            "torch.compile": lambda f: torch.compile(f, backend="aotfuse")}[how]
    torch._dynamo.reset()
    cf = make(fn)
    for _ in range(2):
        b = torch.arange(20.0)
        out, plus = cf(b[:16].view(4, 4), b[4:].view(4, 4))
        assert out.tolist() == [0.0, 0.0] and torch.equal(plus, torch.ones(4, 4))
        assert torch.equal(b, torch.arange(20.0))
