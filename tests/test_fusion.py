"""Fused CPU kernels against ATen: every op-table expression on broadcast and non-contiguous inputs
in fp32 and bf16, backward chains, seeded random graphs, the disk cache, and fallbacks."""
import collections
import copy
import os
import platform
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import aotfuse
import aotfuse.erf1p  # noqa: F401  (registers aotfuse::erf1p)
from aotfuse import _C
from aotfuse.lower import lower
from helpers import assert_close

aten, prims = torch.ops.aten, torch.ops.prims
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


def _pos(t):
    return t.abs() + 0.5


# per op-table entry with an expression: how to call it (tensor args first get a `pre` op so
# that the fused group has two nodes), and whether its inputs must be positive
OP_CASES = {
    "aten::abs": lambda a, b, c: aten.abs(a),
    "aten::add": lambda a, b, c: aten.add.Tensor(a, b),
    "aten::sub": lambda a, b, c: aten.sub.Tensor(a, b),
    "aten::rsub": lambda a, b, c: aten.rsub.Scalar(a, 2.5),
    "aten::mul": lambda a, b, c: aten.mul.Tensor(a, b),
    "aten::div": lambda a, b, c: aten.div.Tensor(a, _pos(b)),
    "aten::neg": lambda a, b, c: aten.neg(a),
    "aten::reciprocal": lambda a, b, c: aten.reciprocal(_pos(a)),
    "aten::pow": lambda a, b, c: aten.pow.Tensor_Scalar(_pos(a), 1.7) + aten.pow.Tensor_Scalar(a, 2),
    "aten::sqrt": lambda a, b, c: aten.sqrt(_pos(a)),
    "aten::rsqrt": lambda a, b, c: aten.rsqrt(_pos(a)),
    "aten::exp": lambda a, b, c: aten.exp(a),
    "aten::log": lambda a, b, c: aten.log(_pos(a)),
    "aten::log1p": lambda a, b, c: aten.log1p(_pos(a)),
    "aten::tanh": lambda a, b, c: aten.tanh(a),
    "aten::expm1": lambda a, b, c: aten.expm1(a),
    "aten::exp2": lambda a, b, c: aten.exp2(a),
    "aten::log2": lambda a, b, c: aten.log2(_pos(a)),
    "aten::log10": lambda a, b, c: aten.log10(_pos(a)),
    "aten::sin": lambda a, b, c: aten.sin(a * 3.0),
    "aten::cos": lambda a, b, c: aten.cos(a * 3.0),
    "aten::tan": lambda a, b, c: aten.tan(a),
    "aten::atan": lambda a, b, c: aten.atan(a * 2.0),
    "aten::erfc": lambda a, b, c: aten.erfc(a),
    "aten::floor": lambda a, b, c: aten.floor(a * 4.0),
    "aten::ceil": lambda a, b, c: aten.ceil(a * 4.0),
    "aten::trunc": lambda a, b, c: aten.trunc(a * 4.0),
    "aten::round": lambda a, b, c: aten.round(a * 4.0) + aten.round(aten.full.default(list(a.shape), 2.5, dtype=a.dtype, device=a.device)),
    "aten::frac": lambda a, b, c: aten.frac(a * 4.0),
    "aten::sign": lambda a, b, c: aten.sign(aten.round(a)) + b,
    "aten::sigmoid": lambda a, b, c: aten.sigmoid(a),
    "aten::erf": lambda a, b, c: aten.erf(a),
    "aotfuse::erf1p": lambda a, b, c: torch.ops.aotfuse.erf1p(a),
    "aten::relu": lambda a, b, c: aten.relu(a),
    "aten::maximum": lambda a, b, c: aten.maximum(a, b),
    "aten::minimum": lambda a, b, c: aten.minimum(a, b),
    "aten::clamp_min": lambda a, b, c: aten.clamp_min(a, -0.25),
    "aten::clamp_max": lambda a, b, c: aten.clamp_max(a, 0.25),
    "aten::where": lambda a, b, c: aten.where.self(aten.gt.Scalar(c, 0.0), a, b),
    "aten::eq": lambda a, b, c: aten.where.self(aten.eq.Tensor(aten.round(a), aten.round(b)), a, b),
    "aten::ne": lambda a, b, c: aten.where.self(aten.ne.Scalar(aten.round(a), 0.0), a, b),
    "aten::lt": lambda a, b, c: aten.where.self(aten.lt.Tensor(a, b), a, b),
    "aten::le": lambda a, b, c: aten.where.self(aten.le.Scalar(a, 0.1), a, b),
    "aten::gt": lambda a, b, c: aten.where.self(aten.gt.Tensor(a, b), a, c),
    "aten::ge": lambda a, b, c: aten.where.self(aten.ge.Scalar(a, -0.1), b, c),
    "aten::logical_not": lambda a, b, c: aten.where.self(aten.logical_not(aten.gt.Scalar(a, 0.0)), b, c),
    "aten::logical_and": lambda a, b, c: aten.where.self(aten.logical_and(aten.gt.Scalar(a, 0.0), aten.lt.Scalar(b, 0.3)), b, c),
    "aten::logical_or": lambda a, b, c: aten.where.self(aten.logical_or(aten.gt.Scalar(a, 0.5), aten.lt.Scalar(b, 0.0)), b, c),
    "aten::logical_xor": lambda a, b, c: aten.where.self(aten.logical_xor(aten.gt.Scalar(a, 0.0), aten.gt.Scalar(c, 0.0)), a, b),
    "aten::bitwise_not": lambda a, b, c: aten.where.self(aten.bitwise_not(aten.gt.Scalar(a, 0.0)), a, b),
    "aten::bitwise_and": lambda a, b, c: aten.where.self(aten.bitwise_and.Tensor(aten.gt.Scalar(a, 0.0), aten.lt.Scalar(b, 0.5)), c, a),
    "aten::bitwise_or": lambda a, b, c: aten.where.self(aten.bitwise_or.Tensor(aten.le.Scalar(a, -0.5), aten.ge.Scalar(b, 0.5)), b, c),
    "aten::bitwise_xor": lambda a, b, c: aten.where.self(aten.bitwise_xor.Tensor(aten.gt.Scalar(b, 0.0), aten.gt.Scalar(c, 0.0)), a, c),
    "aten::isnan": lambda a, b, c: aten.where.self(aten.isnan(aten.log(a)), b, c),
    "aten::threshold_backward": lambda a, b, c: aten.threshold_backward(a, b, 0.0),
    "aten::tanh_backward": lambda a, b, c: aten.tanh_backward(a, aten.tanh(b)),
    "aten::sigmoid_backward": lambda a, b, c: aten.sigmoid_backward(a, aten.sigmoid(b)),
    "prims::convert_element_type": lambda a, b, c: prims.convert_element_type(a, torch.float64).to(a.dtype) * 1.0
    if False else prims.convert_element_type(prims.convert_element_type(a, torch.bfloat16), a.dtype),
    "aten::_to_copy": lambda a, b, c: aten._to_copy(aten._to_copy(a, dtype=torch.bfloat16), dtype=a.dtype),
    "aten::clone": lambda a, b, c: aten.clone(a),
    "aten::full": lambda a, b, c: aten.mul.Tensor(aten.full.default(list(a.shape), 0.75, dtype=a.dtype, device=a.device), a),
}


def test_every_expression_has_a_case():
    with_expr = {name for name, _kind, expr in _C.op_table() if expr}
    # the generator reads a seed, not float operands: its bit-exact tests are in test_rng.py
    assert with_expr - {"aotfuse::rng_uniform"} == set(OP_CASES), with_expr ^ set(OP_CASES)


def _inputs(dtype, layout):
    g = torch.Generator().manual_seed(1)
    if layout == "contiguous":
        shapes = [(4, 5, 6)] * 3
        make = lambda s: torch.randn(s, generator=g)  # noqa: E731
    elif layout == "broadcast":
        shapes = [(4, 5, 6), (5, 1), (6,)]
        make = lambda s: torch.randn(s, generator=g)  # noqa: E731
    else:  # non-contiguous: transposed and sliced views
        shapes = [(4, 5, 6)] * 3
        make = lambda s: torch.randn(s[0], s[2], s[1] * 2, generator=g)[:, :, ::2].transpose(1, 2)  # noqa: E731
    return [make(s).to(dtype) for s in shapes]


def _fused_vs_eager(fn, args, dtype):
    def with_pre(a, b, c):
        return fn(aten.mul.Tensor(a, 1.0), b, c) * 1.0  # a pre and a post op: a group of several nodes

    gm = make_fx(with_pre, tracing_mode="fake")(*args)
    lowered = lower(gm)
    got = lowered(list(args))[0]
    ref = with_pre(*args)
    atol, rtol = TOL[dtype]
    assert_close(got, ref, "fused output", atol=atol, rtol=rtol)
    return lowered


@pytest.mark.parametrize("layout", ["contiguous", "broadcast", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", sorted(OP_CASES))
def test_op_table_expression_matches_aten(op, dtype, layout):
    lowered = _fused_vs_eager(OP_CASES[op], _inputs(dtype, layout), dtype)
    assert lowered.program.num_kernels >= 1
    assert lowered.extern_counts() == {}, lowered.extern_counts()  # the op itself is a kernel member
    fused_ops = {o for o, _k, grp in lowered.program.node_groups() if grp >= 0}
    assert op + "." in " ".join(fused_ops) + " " or any(o.startswith(op + ".") or o == op for o in fused_ops), \
        f"{op} did not run in a kernel: {fused_ops}"
    assert lowered.program.kernel_fallbacks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["gelu", "tanh_gelu", "silu", "sigmoid", "tanh", "softplus", "relu", "elu"])
def test_activation_forward_and_backward(act, dtype):
    fn = {"gelu": F.gelu, "tanh_gelu": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
          "sigmoid": torch.sigmoid, "tanh": torch.tanh, "softplus": F.softplus, "relu": F.relu, "elu": F.elu}[act]

    def f(x, w):
        return fn(x * w + 0.1) * w

    x = torch.randn(8, 33, dtype=dtype, requires_grad=True)
    w = torch.randn(33, dtype=dtype, requires_grad=True)
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    cf = aotfuse.memory_efficient_fusion(f)
    out, ref = cf(x, w), f(xr, wr)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    assert_close(out, ref, f"{act} output", atol=atol, rtol=rtol)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    assert_close(x.grad, xr.grad, f"{act} grad x", atol=atol, rtol=rtol)
    assert_close(w.grad, wr.grad, f"{act} grad w", atol=atol * 10, rtol=rtol)
    assert aotfuse.explain(cf, x, w).fused_kernels >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clamps_and_relu6_fuse_forward_and_backward(dtype):
    """ReLU6, hardtanh and clamp with number bounds become clamp_min/clamp_max kernel members, and
    their backwards' masks (bitwise_or/and of bool comparisons) fuse too: no ATen call is left, the
    values and gradients are eager's bits, NaN passes through the forward as in eager. (A NaN's
    gradient is left out: eager's own hardtanh_backward passes it in its scalar loop and zeroes it in
    its vectorized one.)"""
    def f(x, w):
        y = x * w
        return (F.relu6(y) + F.hardtanh(y, -2.0, 1.5) + torch.clamp(y, min=-0.25) + torch.clamp(y, max=0.75)
                + torch.clamp(y, -0.5, 0.5) * w)

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 40, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([6.0, -2.0, 1.5, 0.75])  # values on the bounds
    w = torch.randn(40, generator=g).to(dtype)
    x.requires_grad_(), w.requires_grad_()
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    cf = aotfuse.memory_efficient_fusion(f)
    out, ref = cf(x, w), f(xr, wr)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    cot = torch.randn(ref.shape, generator=g).to(dtype)
    out.backward(cot)
    ref.backward(cot)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0, equal_nan=True)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(w.grad, wr.grad, rtol=rtol, atol=atol, equal_nan=True)  # a sum: another order
    ex = aotfuse.explain(cf, x, w)
    assert not {op for op in ex.extern_ops if any(k in op for k in ("clamp", "hardtanh", "bitwise", "where"))}, ex.extern_ops
    assert ex.fused_kernels >= 2
    def each(v):
        return [F.relu6(v), F.hardtanh(v, -2.0, 1.5), torch.clamp(v, min=-0.25), torch.clamp(v, max=0.75),
                torch.clamp(v, -0.5, 0.5)]

    special = torch.tensor([float("nan"), float("-inf"), float("inf"), 0.5, 7.0, -3.0], dtype=dtype)
    for got, want in zip(aotfuse.memory_efficient_fusion(each)(special), each(special)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


UNARY = [torch.sin, torch.exp, torch.tanh, torch.sigmoid, F.gelu, lambda t: t * t, torch.neg, F.relu]
BINARY = [torch.add, torch.sub, torch.mul, lambda a, b: a / (b.abs() + 1.0), torch.maximum]


def random_graph(seed, max_inner=9):
    """A seeded random program of unary, binary (broadcasting) and reduction steps: its input shapes
    and the function (returns a scalar to differentiate and the last value)."""
    rng = random.Random(seed)
    shape = (rng.randint(1, 6), rng.randint(1, 7), rng.randint(2, max_inner))
    bshapes = [shape, shape[1:], (shape[0], 1, shape[2]), (shape[2],), (1, 1, 1)]
    n_inputs = rng.randint(2, 4)
    in_shapes = [rng.choice(bshapes) for _ in range(n_inputs)]
    program = []
    for _ in range(rng.randint(3, 12)):
        kind = rng.random()
        if kind < 0.45:
            program.append(("u", rng.randrange(len(UNARY)), rng.randrange(1000)))
        elif kind < 0.85:
            program.append(("b", rng.randrange(len(BINARY)), rng.randrange(1000), rng.randrange(1000)))
        else:
            program.append(("r", rng.randrange(3), rng.randrange(1000)))

    def f(*xs):
        vals = list(xs)
        for step in program:
            if step[0] == "u":
                vals.append(UNARY[step[1]](vals[step[2] % len(vals)]))
            elif step[0] == "b":
                vals.append(BINARY[step[1]](vals[step[2] % len(vals)], vals[step[3] % len(vals)]))
            else:
                v = vals[step[2] % len(vals)]
                vals.append(v.sum(dim=-1, keepdim=True) if step[1] == 0 else v.mean() if step[1] == 1 else v.amax(-1, keepdim=True))
        return sum(v.sum() for v in vals[n_inputs:]) + vals[-1].sum() * 0.5, vals[-1]

    return in_shapes, f


@pytest.mark.parametrize("seed", range(12))
def test_random_pointwise_broadcast_reduction_graphs(seed):
    in_shapes, f = random_graph(seed)
    xs = [torch.randn(s, requires_grad=True) for s in in_shapes]
    refs = [x.detach().clone().requires_grad_() for x in xs]
    cf = aotfuse.memory_efficient_fusion(f)
    out, ref = cf(*xs), f(*refs)
    for i, (a, b) in enumerate(zip(out, ref)):
        assert_close(a, b, f"seed {seed} output {i}", atol=1e-4, rtol=1e-4)
    out[0].backward()
    ref[0].backward()
    for i, (a, b) in enumerate(zip(xs, refs)):
        assert_close(a.grad, b.grad, f"seed {seed} grad of input {i}", atol=1e-4, rtol=1e-4)


def test_layout_mismatch_falls_back_to_extern_calls():
    # declare an extern's output contiguous while ATen returns it transposed: the kernel reading it
    # must notice and run its nodes as extern calls, with the right answer
    g = _C.Graph()
    x = g.add_input("x", ("tensor", "float32", "cpu", -1, (4, 6), (6, 1), 0))
    (t,) = g.add_node("aten::t.default", [("v", x)], [], [("tensor", "float32", "cpu", -1, (6, 4), (4, 1), 0)])
    (a,) = g.add_node("aten::mul.Tensor", [("v", t), ("float", 2.0)], [], [("tensor", "float32", "cpu", -1, (6, 4), (4, 1), 0)])
    (b,) = g.add_node("aten::exp.default", [("v", a)], [], [("tensor", "float32", "cpu", -1, (6, 4), (4, 1), 0)])
    g.set_outputs([b])
    prog = _C.Program(g, fuse=True)
    assert prog.num_kernels == 1
    xv = torch.randn(4, 6)
    (out,) = prog.run([xv])
    assert_close(out, (xv.t() * 2).exp(), "fallback result")
    assert prog.kernel_fallbacks == 1


def _run_in_subprocess(code, env):
    full_env = {**os.environ, **env}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env,
                         timeout=300)
    return res


CACHE_SCRIPT = """
    import torch, aotfuse
    f = aotfuse.memory_efficient_fusion(lambda x: (x * 3.0).tanh().exp() - 1.0)
    x = torch.linspace(-1, 1, 50, requires_grad=True)
    y = f(x)
    assert torch.allclose(y, (x * 3.0).tanh().exp() - 1.0, atol=1e-6)
    rec = f.records[-1]
    print("HIT", rec.programs["forward"].program.cache_hit, rec.programs["forward"].program.num_kernels)
"""


def test_disk_cache_is_hit_by_a_second_process_and_survives_corruption(tmp_path):
    env = {"AOTFUSE_CACHE_DIR": str(tmp_path)}
    first = _run_in_subprocess(CACHE_SCRIPT, env)
    assert first.returncode == 0, first.stderr
    assert "HIT False 1" in first.stdout
    second = _run_in_subprocess(CACHE_SCRIPT, env)
    assert second.returncode == 0, second.stderr
    assert "HIT True 1" in second.stdout
    objects = list(tmp_path.glob("*.so"))
    assert objects
    for obj in objects:  # truncate every cached object: the next process must rebuild, not crash
        obj.write_bytes(obj.read_bytes()[:100])
    third = _run_in_subprocess(CACHE_SCRIPT, env)
    assert third.returncode == 0, third.stderr
    assert "HIT False 1" in third.stdout
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


NO_OPENMP_SCRIPT = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from aotfuse.lower import lower
x = torch.randn(8, 5000, generator=torch.Generator().manual_seed(5)) * 3 + 100.0
f = lambda x: (x * 1.0).sum(-1)
low = lower(make_fx(f)(x))
err = (low([x])[0].double() - f(x.double())).abs().max().item()
aten = (f(x).double() - f(x.double())).abs().max().item()
print("ERR", err, aten, low.program.num_kernels)
"""


def test_a_compiler_without_openmp_still_vectorizes_row_sums_accurately(tmp_path):
    """A compiler that refuses -fopenmp (Apple's clang has no OpenMP runtime) builds with
    -fopenmp-simd: the row sums keep one float partial sum per vector lane (without it, a 1024-element
    chunk summed as one float was 10x further from float64 than ATen)."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "no OpenMP" >&2; exit 1; }; done\nexec cc "$@"\n')
    cc.chmod(0o755)
    res = _run_in_subprocess(NO_OPENMP_SCRIPT, {"AOTFUSE_CACHE_DIR": str(tmp_path / "cache"), "AOTFUSE_CC": str(cc)})
    assert res.returncode == 0, res.stderr
    err, aten, kernels = res.stdout.split("ERR")[1].split()
    assert int(kernels) == 1
    assert float(err) <= max(3 * float(aten), 4 * torch.finfo(torch.float32).eps * 5000 * 100), res.stdout


def test_missing_compiler_is_a_clear_error_and_fusion_can_be_turned_off(tmp_path):
    env = {"AOTFUSE_CACHE_DIR": str(tmp_path), "AOTFUSE_CC": "/nonexistent/cc"}
    res = _run_in_subprocess(CACHE_SCRIPT, env)
    assert res.returncode != 0
    assert "C compiler" in res.stderr and "AOTFUSE_CC" in res.stderr
    off = _run_in_subprocess(CACHE_SCRIPT.replace('print("HIT"', 'print("OFF"'), {**env, "AOTFUSE_FUSION": "0"})
    assert off.returncode == 0, off.stderr
    assert "OFF False 0" in off.stdout


DYNAMO_NO_CC_SCRIPT = """
import copy, warnings, torch, torch.nn as nn, aotfuse
torch.manual_seed(0)
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(8, 8); self.b = nn.Linear(8, 3)
    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        logits = self.b(h)
        return logits.tanh().sum(), logits * 2
m = M(); ref = copy.deepcopy(m)
x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    c = torch.compile(m, backend="aotfuse")
    for step in range(2):
        loss, logits = c(x)
        loss.backward()
print("warned", sum("runs uncompiled" in str(x.message) for x in w))
for _ in range(2):
    l, _ = ref(x); l.backward()
print("maxdiff", max((p.grad - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters())))
side = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
head = nn.Linear(8, 2)
class Side(nn.Module):
    def __init__(self):
        super().__init__(); self.side, self.head = side, head
    def forward(self, x):
        h = self.side(x)
        return h, self.head(h)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h, _ = torch.compile(Side(), backend="aotfuse")(x)
    h.sum().backward()
print("head grad None", head.weight.grad is None, side[0].weight.grad is not None)
"""


def test_torch_compile_backend_without_a_compiler_runs_forward_and_backward_uncompiled(tmp_path):
    """torch.compile(backend="aotfuse") on a machine whose C compiler fails: a forward whose kernels
    could not be built ran its graph uncompiled (with a warning), but the backward, whose kernels
    compile at its first run, raised there. It now runs uncompiled too, with one warning, and the
    gradients are eager's; an output nobody differentiates (its gradient missing) included."""
    res = _run_in_subprocess(DYNAMO_NO_CC_SCRIPT, {"AOTFUSE_CACHE_DIR": str(tmp_path), "AOTFUSE_CC": "false"})
    assert res.returncode == 0, res.stderr
    assert "warned 2" in res.stdout, res.stdout
    assert float(res.stdout.split("maxdiff")[1].split()[0]) < 1e-5, res.stdout
    assert "head grad None True True" in res.stdout, res.stdout  # no gradient where eager gives none


HANGING_CC_SCRIPT = """
import signal, threading, torch, aotfuse
# Python's KeyboardInterrupt handler, even where the test runs in the background (a shell's
# background job inherits SIGINT ignored, and Python then installs no handler)
signal.signal(signal.SIGINT, signal.default_int_handler)
f = aotfuse.aot_function(lambda x: (x.sin() * 2).exp(), fallback="eager")
# a thread that only waits: a signal the kernel hands to it runs Python's C handler there
ids = []
started = threading.Event()
threading.Thread(target=lambda: (ids.append(threading.get_native_id()), started.set(), threading.Event().wait()),
                 daemon=True).start()
started.wait()
print("thread", ids[0], flush=True)
print("start", flush=True)
try:
    f(torch.randn(8))
    print("returned", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


_TGKILL = {"x86_64": 234, "aarch64": 131}  # Linux's tgkill system call: a signal to one thread


@pytest.mark.parametrize("receiver", ["process", "other thread"])
def test_ctrl_c_stops_a_compiler_that_never_finishes(tmp_path, receiver):
    """A C compiler that hangs (a wedged ccache, a network file system): SIGINT to the process raised
    nothing, since the wait for the compiler retried on EINTR without asking Python. Now Python's
    handler runs, KeyboardInterrupt stops the build, the compilers are killed, and no temporary file
    is left in the cache. "other thread": the kernel may hand a process's SIGINT to any of its threads;
    handed to another one (or before the wait began) it interrupted no wait, and the build hung until
    the compiler ended. The wait now asks Python's handler every 100 ms."""
    import ctypes
    import platform
    import signal
    import time

    if receiver == "other thread" and (platform.system() != "Linux" or platform.machine() not in _TGKILL):
        pytest.skip(f"tgkill's number is written here for Linux on {sorted(_TGKILL)} only")

    cc = tmp_path / "sleeping-cc"
    cc.write_text("#!/bin/sh\nexec sleep 1000\n")
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "AOTFUSE_CACHE_DIR": str(cache), "AOTFUSE_CC": str(cc)}
    proc = subprocess.Popen([sys.executable, "-c", HANGING_CC_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert "start" in lines and any(line.startswith("thread ") for line in lines), lines
        thread = int(next(line for line in lines if line.startswith("thread ")).split()[1])
        deadline = time.time() + 60
        while not list(cache.glob(".*.c")) and time.time() < deadline:  # the compiler is running
            time.sleep(0.05)
        time.sleep(0.5)
        if receiver == "process":
            proc.send_signal(signal.SIGINT)  # the process only, not its group: the compiler does not see it
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.syscall(_TGKILL[platform.machine()], proc.pid, thread, int(signal.SIGINT)) == 0, \
                os.strerror(ctypes.get_errno())
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in out, (out, err)
    assert not list(cache.glob(".*")), list(cache.iterdir())


PARTS_SCRIPT = """
import sys, torch, aotfuse
def f(x, w):
    acts = [torch.tanh, torch.sigmoid, torch.nn.functional.gelu, torch.nn.functional.silu, torch.sin, torch.cos,
            torch.exp, torch.nn.functional.softplus, torch.erf, torch.atan]
    for i in range(2 * len(acts)):
        x = acts[i % len(acts)](x @ w * (0.5 + 0.01 * i)) + x
    return x.sum()
g = torch.Generator().manual_seed(0)
x = torch.randn(16, 32, generator=g, requires_grad=True)
w = (torch.randn(32, 32, generator=g) * 0.1).requires_grad_()
cf = aotfuse.memory_efficient_fusion(f)
y = cf(x, w)
y.backward()
assert cf.records[-1].programs["forward"].program.num_kernels >= 20
torch.save((y.detach(), x.grad, w.grad), sys.argv[1] if len(sys.argv) > 1 else "out.pt")
"""


def test_large_modules_compile_in_parts_at_once_with_the_same_results(tmp_path):
    """With two jobs the JIT compiles a large module as parts at once (`cc -c` each, then one link):
    the results are bit for bit those of the one-file build (AOTFUSE_JIT_JOBS=1), and eager's to
    float rounding; no temporary file stays in the cache."""
    cc = tmp_path / "cc-log"
    cc.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\nexec cc "$@"\n')
    cc.chmod(0o755)
    script = tmp_path / "parts.py"
    script.write_text(PARTS_SCRIPT)
    outs = {}
    for jobs in ("2", "1"):
        (tmp_path / "calls").write_text("")
        env = {**os.environ, "AOTFUSE_CACHE_DIR": str(tmp_path / f"cache{jobs}"), "AOTFUSE_CC": str(cc),
               "AOTFUSE_JIT_JOBS": jobs}
        res = subprocess.run([sys.executable, str(script), str(tmp_path / f"out{jobs}.pt")], capture_output=True,
                             text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        calls = (tmp_path / "calls").read_text().splitlines()
        parts = [c for c in calls if " -c " in c]
        links = [c for c in calls if "-shared" in c and ".o " in c]
        if jobs == "2":
            assert len(parts) >= 2 and len(links) >= 1, calls  # the backward's module at least
        else:
            assert not parts and not links, calls
        assert not list((tmp_path / f"cache{jobs}").glob(".*"))
        outs[jobs] = torch.load(tmp_path / f"out{jobs}.pt")
    for name, a, b in zip(("loss", "grad x", "grad w"), outs["2"], outs["1"]):
        assert torch.equal(a, b), name
    ns = {}
    exec(PARTS_SCRIPT.split("g = torch.Generator")[0], ns)
    runs = {}
    for dtype in (torch.float32, torch.float64):  # eager, and the float64 reference
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 32, generator=g, requires_grad=True)
        w = (torch.randn(32, 32, generator=g) * 0.1).requires_grad_()
        xd, wd = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        y = ns["f"](xd, wd)
        y.backward()
        runs[dtype] = (y.detach(), xd.grad, wd.grad)
    for name, ours, eager, exact in zip(("loss", "grad x", "grad w"), outs["2"], runs[torch.float32],
                                        runs[torch.float64]):
        scale = exact.abs().max().item()
        err, eager_err = ((ours.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item())
        assert err <= 4 * eager_err + 1e-6 * scale, f"{name}: {err} from float64, eager {eager_err}"


def test_cpu_vector_width_follows_torchs_capability_and_keys_the_cache(tmp_path):
    """On x86 the kernels are built for 512-bit vectors unless ATEN_CPU_CAPABILITY asks torch for less;
    the width is part of the disk cache's key, so a process under the other setting never loads them."""
    env = {"AOTFUSE_CACHE_DIR": str(tmp_path)}
    runs, objects = [], []
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "AVX512"}):
        runs.append(_run_in_subprocess(CACHE_SCRIPT, {**env, **extra}))
        objects.append(len(list(tmp_path.glob("*.so"))))
    for r in runs:
        assert r.returncode == 0, r.stderr
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    assert "HIT False 1" in runs[0].stdout
    assert ("HIT False 1" if x86 else "HIT True 1") in runs[1].stdout  # a build of its own on x86
    assert "HIT True 1" in runs[2].stdout  # the default's build again
    assert objects[0] > 0 and objects == [objects[0], objects[0] * (2 if x86 else 1), objects[0] * (2 if x86 else 1)]


REDUCTION_CASES = {
    "row_sum_keepdim": lambda a, b, c: aten.sum.dim_IntList(aten.mul.Tensor(a, b), [-1], True),
    "bias_grad_sum": lambda a, b, c: aten.sum.dim_IntList(aten.mul.Tensor(a, 2.0), [0, 1], False),
    "middle_dim_mean": lambda a, b, c: aten.mean.dim(aten.exp(aten.mul.Tensor(a, 0.5)), [1], False),
    "amax_softmax_piece": lambda a, b, c: aten.amax(aten.add.Tensor(a, c), [-1], True),
    "amin_all": lambda a, b, c: aten.amin(aten.sub.Tensor(a, b), [], False),
    "full_sum": lambda a, b, c: aten.sum.default(aten.mul.Tensor(a, a)),
    "sum_and_pointwise_output": lambda a, b, c: (aten.sum.dim_IntList(aten.tanh(a), [2], False), aten.tanh(a)),
}


@pytest.mark.parametrize("layout", ["contiguous", "broadcast", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(REDUCTION_CASES))
def test_reductions_fused_with_their_prologue(case, dtype, layout):
    fn = REDUCTION_CASES[case]

    def g(a, b, c):
        out = fn(aten.mul.Tensor(a, 1.0), b, c)
        return tuple(o * 1.0 for o in out) if isinstance(out, tuple) else out * 1.0

    args = _inputs(dtype, layout)
    gm = make_fx(g, tracing_mode="fake")(*args)
    lowered = lower(gm)
    got = lowered(list(args))
    ref = g(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, f"{case} output {i}", atol=atol, rtol=rtol)
    fused = [op for op, _k, grp in lowered.program.node_groups() if grp >= 0]
    assert any(op.split(".")[0] in ("aten::sum", "aten::mean", "aten::amax", "aten::amin") for op in fused), fused
    if case == "bias_grad_sum":  # reduces the leading dims: the column kernel (rows outside, columns inside)
        assert "column reductions" in lowered.program.source


# Epilogues: members reading their own group's reductions run as later phases of one kernel (a pass
# over each row per phase), and row members (log(sum), rsqrt(var + eps)) once per row between them.
EPILOGUE_CASES = {
    "softmax": (lambda x, w, b, g: torch.softmax(x * 1.0, -1), 3),
    "log_softmax": (lambda x, w, b, g: torch.log_softmax(x * 1.0, -1), 3),
    "layer_norm": (lambda x, w, b, g: F.layer_norm(x * 1.0, (x.shape[-1],), w, b), 3),
    "softmax_backward": (lambda x, w, b, g: aten._softmax_backward_data(g * 1.0, torch.softmax(x, -1), -1, x.dtype), 4),  # with the softmax
    "center_and_scale": (lambda x, w, b, g: (x - x.mean(-1, keepdim=True)) / (x.amax(-1, keepdim=True) + 3.0), 2),
    "rms_norm": (lambda x, w, b, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(EPILOGUE_CASES))
def test_reduction_epilogues_run_in_one_phased_kernel(case, dtype):
    from aotfuse.decompositions import default_decompositions

    fn, phases = EPILOGUE_CASES[case]
    g = torch.Generator().manual_seed(3)
    x, gr = (torch.randn(37, 200, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(200, generator=g).to(dtype) for _ in range(2))
    gm = make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, w, b, gr)
    lowered = lower(gm)
    got = lowered([x, w, b, gr])[0]
    ref = fn(x, w, b, gr)
    atol, rtol = (2e-6, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    assert_close(got, ref, f"{case} ({dtype})", atol=atol, rtol=rtol)
    src = lowered.program.source
    assert f"{phases} phases)" in src, src[-3000:]
    assert "/* phase 1 */" in src
    if case in ("softmax", "softmax_backward"):  # exp is kept from its pass, not evaluated again
        kernel = src[src.index("/* group 0"):]  # (of x - amax(x), never above 0: af_exp_nonpos)
        assert "aten::exp.default, cached */" in kernel and kernel.count("af_exp_nonpos(") == 1, kernel
        assert "af_exp(" not in kernel, kernel


def test_a_value_one_later_phase_alone_reads_is_computed_there():
    """log_softmax's backward, g - exp(out) * sum(g): exp(out) is read only by the second pass (after the
    sum), so that pass computes it; it is not computed in the first pass, kept in a per-row array and
    read back (which made the kernel 1.26x slower: benchmarks/results/phase-cache-cpu-2026-12-06.md).
    A softmax's exp, which its sum reads in its own pass and the division in the next, is still kept."""
    from aotfuse.decompositions import default_decompositions

    g = torch.Generator().manual_seed(8)
    grad, x = torch.randn(37, 200, generator=g), torch.randn(37, 200, generator=g)
    out = torch.log_softmax(x, -1)
    fn = lambda gr, o: (aten._log_softmax_backward_data(gr, o, -1, torch.float32),)  # noqa: E731
    lowered = lower(make_fx(fn, decomposition_table=default_decompositions(norms=True))(grad, out))
    src = lowered.program.source
    kernel = src[src.index("/* group 0"):]
    assert "2 phases)" in kernel and "cached */" not in kernel and "float c" not in kernel, kernel
    phase1 = kernel[kernel.index("/* phase 1 */"):]
    assert "= af_exp(v" in phase1, kernel
    assert_close(lowered([grad, out])[0], fn(grad, out)[0], "log_softmax backward", atol=1e-6, rtol=1e-5)
    soft = lower(make_fx(lambda x: (torch.softmax(x, -1),), decomposition_table=default_decompositions(norms=True))(x))
    assert "aten::exp.default, cached */" in soft.program.source


@pytest.mark.parametrize("env,decomposed", [({}, True), ({"AOTFUSE_DECOMPOSE_NORMS": "0"}, False),
                                            ({"AOTFUSE_FUSION": "0"}, False), ({"AOTFUSE_BACKEND": "cuda"}, False)],
                         ids=["default", "switched-off", "no-fusion", "cpu-tensors-without-kernels"])
def test_norms_are_decomposed_where_kernels_are_generated(monkeypatch, env, decomposed):
    """Layer norm and softmax (and their backwards) are decomposed by default, into phased kernels
    with the work around them; AOTFUSE_DECOMPOSE_NORMS=0, or a device without generated kernels,
    keeps ATen's (decomposed without kernels they would be many ATen calls)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.ln = torch.nn.Linear(24, 24), torch.nn.LayerNorm(24)

        def forward(self, x):
            return self.ln(torch.softmax(self.lin(x) * 0.5, -1) + x)

    torch.manual_seed(3)
    model = Block()
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(6, 24)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(xc)
    g = torch.randn_like(out)
    out.backward(g)
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(xe)
    ref.backward(g)
    assert_close(out, ref, f"block output ({env})", atol=1e-5, rtol=1e-5)
    assert_close(xc.grad, xe.grad, f"input gradient ({env})", atol=1e-5, rtol=1e-5)
    for (name, p), cg in zip(model.named_parameters(), compiled_grads):
        assert_close(cg, p.grad, f"{name}.grad ({env})", atol=1e-5, rtol=1e-5)
    graphs = compiled._aotfuse_compiled.records[-1].graphs
    targets = {str(n.target) for gm in graphs.values() for n in gm.graph.nodes if n.op == "call_function"}
    natives = {t for t in targets if "native_layer_norm" in t or "_softmax" in t}
    assert (not natives) == decomposed, natives
    # a device without generated kernels gets none (AOTFUSE_BACKEND=cuda built C kernels for CPU
    # tensors before 2026-12-04: the mask of devices left was 0, read as every device)
    kernels = [low.program.num_kernels for low in compiled._aotfuse_compiled.records[-1].programs.values()]
    assert (sum(kernels) > 0) == (env.get("AOTFUSE_FUSION") != "0" and env.get("AOTFUSE_BACKEND") != "cuda"), kernels


def test_random_numbers_a_later_phase_reads_are_kept_not_drawn_again():
    """A dropout inside a decomposed layer norm's kernel (pre-LN residual streams, GPT2 with
    AOTFUSE_DECOMPOSE_NORMS=1): the mean's pass and the normalizing pass both read the random
    numbers; they are drawn once (Threefry is 20 rounds) and kept for the later pass."""
    from aotfuse.decompositions import default_decompositions

    def fn(x, seed):
        u = torch.ops.aotfuse.rng_uniform(seed, [37, 200])
        return F.layer_norm(x + x * (u > 0.1) * 1.11, (200,))

    x, seed = torch.randn(37, 200, generator=torch.Generator().manual_seed(4)), torch.tensor(12345)
    lowered = lower(make_fx(fn, decomposition_table=default_decompositions(norms=True))(x, seed))
    assert_close(lowered([x, seed])[0], fn(x, seed), "layer norm of a dropout's residual", atol=2e-6, rtol=1e-5)
    src = lowered.program.source
    assert "phases)" in src and "aotfuse::rng_uniform.default, cached */" in src, src[-3000:]
    assert src.count("= af_rand(sv") == 1, src[-3000:]


def test_exp_gives_subnormal_results_as_expf_does():
    """The C kernels' exp scaled by 2^n in one factor, so from x = -87 down (n <= -126) it returned 0
    where expf gives values down to 1.4e-45 (found by a bug hunt, 2026-12-04). Now two factors: every
    float of [-110, 89] within 2 ulp of torch.exp where the result is normal, within one subnormal step
    below, 0 where torch's is 0, inf where torch's is inf."""
    x = torch.linspace(-110.0, 89.0, 400001)
    lowered = lower(make_fx(lambda x: torch.exp(x * 1.0))(x))
    assert lowered.program.num_kernels == 1
    got, ref = lowered([x])[0], torch.exp(x)
    assert torch.equal(got.isinf(), ref.isinf()) and torch.equal(got == 0, ref == 0)
    normal = (ref >= 2.0 ** -126) & ~ref.isinf()
    assert ((got - ref).abs() / ref)[normal].max() < 2.5e-7
    sub = (ref < 2.0 ** -126) & (ref > 0)
    assert sub.sum() > 1000 and (got - ref).abs()[sub].max() <= 1.5e-45


def test_helpers_are_inlined_whatever_the_inliners_limits(tmp_path, monkeypatch):
    """Kernels calling the prelude's helpers (af_rand's 20 Threefry rounds, af_exp, af_erf) inline
    every call, so their loops vectorize. GCC's inliner declines calls once a program's source has
    grown past its unit-growth limit: before the helpers were always_inline, Bert's forward program
    (264 KB of C at seed size) called af_rand out of line in its attention kernel, which ran 3x
    slower inside the model than alone (111 against 35 ms at seed size, 1 thread). Here GCC is
    told to decline every inline call it may (max-inline-insns-single=1), which a small program
    shows the same way."""
    import shutil

    from aotfuse.decompositions import default_decompositions

    gcc, nm = shutil.which("gcc"), shutil.which("nm")
    if not gcc or not nm:
        pytest.skip("needs GCC (its inliner's --param limits) and binutils' nm")
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AOTFUSE_CC", f"{gcc} --param early-inlining-insns=0 --param max-inline-insns-single=1")
    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(16, 16, generator=g) * 0.3 for _ in range(4)]

    def fn(x, seed, *ws):
        for w in ws:  # each layer: an mm, then one kernel of a dropout's mask, erf and exp
            h = x @ w
            keep = torch.ops.aotfuse.rng_uniform(seed, [8, 16]) > 0.1
            x = (F.gelu(h) + torch.exp(h * 0.1)) * keep * 1.1 + x
        return x

    x, seed = torch.randn(8, 16, generator=g), torch.tensor(2024)
    lowered = lower(make_fx(fn, decomposition_table=default_decompositions())(x, seed, *ws))
    src = lowered.program.source
    # the four layers' kernels share one body (af_rand inlined once), each with its own stream
    assert lowered.program.num_kernels == 4 and src.count("af_rand(sv") == 1 and "af_erf(" in src and "af_exp(" in src, src
    assert_close(lowered([x, seed, *ws])[0], fn(x, seed, *ws), "dropout layers", atol=1e-5, rtol=1e-5)
    objects = list(tmp_path.glob("*.so"))  # the program's, and rng_uniform's own (the eager call)
    assert any("af_erf(" in o.with_suffix(".c").read_text() for o in objects), list(tmp_path.iterdir())
    for obj in objects:
        symbols = subprocess.run([nm, str(obj)], capture_output=True, text=True, check=True).stdout
        local = {line.split()[-1] for line in symbols.splitlines() if line.split()[-2:-1] == ["t"]}
        helpers = {name for name in local if name.startswith("af_") and not name.startswith("af_kernel_")}
        assert not helpers, f"{obj.name}: helpers called out of line: {sorted(helpers)}"


def test_repeated_layers_share_kernel_bodies_each_with_its_own_dropout_stream(tmp_path, monkeypatch):
    """Kernels that differ only in their nodes' ids and their dropouts' streams (a model's layers)
    are compiled once: one body, called by each kernel's wrapper with that kernel's streams. The
    streams must stay apart: three dropouts of p = 0.5 in a row, one a layer, each behind an mm
    (so each is a kernel of its own, the same kernel), keep an eighth of the elements when their
    masks are independent and a half if a body had drawn one mask for all."""
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))
    eye = torch.eye(64)

    def fn(x, seed, eye):
        for stream in (1, 2, 3):
            keep = torch.ops.aotfuse.rng_uniform(seed, [64, 64], stream) > 0.5
            x = (x * keep * 2.0) @ eye
        return x

    x, seed = torch.ones(64, 64), torch.tensor(99)
    lowered = lower(make_fx(fn)(x, seed, eye))
    src = lowered.program.source
    assert lowered.program.num_kernels == 3, src
    assert src.count("AF_BODY void af_body_") == 1 and src.count("af_rand(sv") == 1, src
    for stream in (1, 2, 3):
        assert f"static const uint64_t s[1] = {{{stream}ull}};" in src, src
    got = lowered([x, seed, eye])[0]
    assert_close(got, fn(x, seed, eye), "three dropouts behind mms", atol=0, rtol=0)
    kept = (got != 0).float().mean().item()
    assert abs(kept - 1 / 8) < 0.03, f"kept {kept:.3f} of the elements: the layers' masks are not independent"
    assert set(got.unique().tolist()) <= {0.0, 8.0}


def test_repeated_window_kernels_share_a_body(tmp_path, monkeypatch):
    """Window kernels (a padding whose source a pointwise node computes in the same kernel) name
    their coordinates after node ids too (s<id>_<dim>, u<id>_<dim>); a model's repeated layers
    still share one body (Longformer at host size: 290 backward kernels, 24 bodies)."""
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(8)
    ws = [torch.randn(14, 12, generator=g) for _ in range(3)]

    def fn(x, *ws):
        for w in ws:  # a pad, a reshape, a pad (Longformer's chunking): one kernel of nested windows
            y = F.pad(torch.tanh(x * 0.5), (0, 1), value=-1.0).reshape(-1)
            x = F.pad(y, (0, 6)).reshape(6, 14) @ w
        return x

    x = torch.randn(6, 12, generator=g)
    lowered = lower(make_fx(fn)(x, *ws))
    src = lowered.program.source
    assert lowered.program.num_kernels == 3 and re.search(r"\bu\d+_1\b", src), src
    assert src.count("AF_BODY void af_body_") == 1, src
    assert_close(lowered([x, *ws])[0], fn(x, *ws), "padded layers", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [37, 1024, 1025, 5000, 30522])
def test_row_sums_add_in_float_chunks_as_accurately_as_aten(width):
    """Row sums (plain, and a phased kernel's) add float partial sums, one a vector lane, over chunks
    of 1024 elements, and the chunks' totals in double: the error against float64 stays within a
    few times ATen's own (or 4 ulps of the result), where one float sum over the row would not."""
    from aotfuse.decompositions import default_decompositions

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, width, generator=g) * 3 + 100.0  # a large mean: accumulation error shows

    def f(x):
        return (x * 1.0).sum(-1), (x * 1.0).mean(-1, keepdim=True), torch.softmax(x * 0.01, -1), torch.var(x * 1.0, -1)

    lowered = lower(make_fx(f, decomposition_table=default_decompositions(norms=True))(x))
    got, ref, eager = lowered([x]), f(x.double()), f(x)
    for name, a, r, e in zip(("sum", "mean", "softmax", "var"), got, ref, eager):
        err, aten_err = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * r.abs().max().item()
        assert err <= max(3 * aten_err, 4 * ulp), f"{name} over rows of {width}: error {err:.3g}, ATen's {aten_err:.3g}"
    src = lowered.program.source
    assert "accf" in src and "+= (double)accf" in src, src[-2000:]
    assert ("i0 += 1024" in src) == (width > 1024), src[-2000:]


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_var_mean_decomposition_is_two_pass_and_matches_aten(dtype, correction):
    from aotfuse.decompositions import _var_mean

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 300, generator=g) * 3 + 1000.0).to(dtype)  # a large mean: one-pass E[x^2]-E[x]^2 fails
    for dims, keep in (([-1], True), ([0, 1], False), ([0], False)):
        var, mean = _var_mean(x, dims, correction=correction, keepdim=keep)
        rvar, rmean = torch.var_mean(x, dims, correction=correction, keepdim=keep)
        assert var.dtype == rvar.dtype and var.shape == rvar.shape
        tol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
        assert_close(mean, rmean, f"mean over {dims}", atol=tol[0] * 1000, rtol=tol[1])
        assert_close(var, rvar, f"var over {dims}", atol=tol[0] * 10, rtol=tol[1])


def test_bias_gradient_sums_keep_their_column_kernel():
    # a row member over a column reduction is not fused in: the column kernel has no phases
    def f(a):
        return aten.sum.dim_IntList(a * 2.0, [0], False) * 0.5

    x = torch.randn(64, 48)
    lowered = lower(make_fx(f)(x))
    assert "column reductions" in lowered.program.source
    assert_close(lowered([x])[0], f(x), "bias-gradient sum", atol=1e-5, rtol=1e-5)


# A reduction of a reshaped value that a kernel computes (a bias gradient over the flattened tokens,
# `grad.view(-1, c).sum(0)`) is emitted on the value itself, right after it, so that it joins the
# value's kernel; where a dim of the value would be split between reduced and kept dims it is not.
# name: (fn of a [4, 6, 10] tensor, joins the mul's kernel)
THROUGH_RESHAPE_CASES = {
    "tokens_sum0": (lambda a: aten.sum.dim_IntList(aten.view(aten.mul.Tensor(a, 2.0), [24, 10]), [0], False), True),
    "tokens_sum0_keepdim": (lambda a: aten.sum.dim_IntList(aten.view(aten.mul.Tensor(a, 2.0), [24, 10]), [0], True), True),
    "two_reshapes": (lambda a: aten.sum.dim_IntList(aten.view(aten._unsafe_view(aten.mul.Tensor(a, 2.0), [4, 60]), [24, 10]),
                                                    [0], True), True),
    "mean_of_split_dims": (lambda a: aten.mean.dim(aten.view(aten.mul.Tensor(a, 2.0), [2, 2, 6, 10]), [0, 1, 2], False), True),
    "amax_of_merged_rows": (lambda a: aten.amax(aten.view(aten.exp(a), [4, 60]), [1], True), True),
    "misaligned": (lambda a: aten.sum.dim_IntList(aten.view(aten.mul.Tensor(a, 2.0), [6, 4, 10]), [0], False), False),
    "partly_reduced_dim": (lambda a: aten.sum.dim_IntList(aten.view(aten.mul.Tensor(a, 2.0), [4, 6, 2, 5]), [0, 1, 3], False),
                           False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(THROUGH_RESHAPE_CASES))
def test_reductions_of_reshaped_kernel_values_join_the_kernel(case, dtype):
    fn, joins = THROUGH_RESHAPE_CASES[case]

    def f(a):
        return fn(a) * 1.0, aten.mul.Tensor(a, 2.0)  # the value is also an output, as a gradient is

    a = torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(7)).to(dtype)
    lowered = lower(make_fx(f)(a))
    got, ref = lowered([a]), f(a)
    exact = f(a.double())
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    for i in range(2):
        assert got[i].shape == ref[i].shape and got[i].dtype == ref[i].dtype, (case, i)
        assert_close(got[i], ref[i], f"{case} output {i} ({dtype})", atol=atol, rtol=rtol)
        assert_close(got[i].double(), exact[i], f"{case} output {i} ({dtype}) vs float64", atol=atol * 4, rtol=rtol * 4)
    groups = lowered.program.node_groups()
    red = [grp for op, kind, grp in groups if kind == "reduction"]
    producer = groups[0][2]  # the kernel computing the reshaped value (the graph's first node)
    assert len(red) == 1, groups
    if joins:
        assert producer >= 0 and red[0] == producer, groups
    else:
        assert red[0] < 0 or red[0] != producer, groups


def test_reductions_join_where_their_columns_merge_and_on_cuda_only_small_values():
    # the kernel reading a permuted copy would reduce through strided columns: the sum does not join it
    # (on the CPU it is a lone column kernel of its own, reading the stored copy; fuse.c lone_column_ok);
    # a big value joins on the CPU (the column kernel is no slower than a kernel beside ATen's sum) but
    # not in a CUDA graph (CUDA's column kernels are untimed against ATen's sum)
    from aotfuse.lower import _reductions_through_reshapes

    def big(a):
        return aten.sum.dim_IntList(aten.view(aten.mul.Tensor(a, 2.0), [-1, 256]), [0], False), aten.mul.Tensor(a, 2.0)

    def transposed(a):  # a permuted copy (attention heads merged back): kept dims 2, 3 stride apart in a
        c = aten.clone.default(aten.permute.default(a, [0, 2, 1, 3]), memory_format=torch.contiguous_format)
        return aten.sum.dim_IntList(aten.view(aten._unsafe_view(c, [4, 8, 32]), [32, 32]), [0], True), c

    for fn, a, joins in ((big, torch.randn(8, 128, 256), True), (transposed, torch.randn(4, 2, 8, 16), False)):
        gm = make_fx(fn)(a)
        lowered = lower(gm)
        for got, ref in zip(lowered([a]), fn(a)):
            assert_close(got, ref, fn.__name__, atol=2e-4, rtol=1e-5)
        groups = lowered.program.node_groups()
        red = [grp for op, kind, grp in groups if kind == "reduction"]
        producer = next(grp for op, kind, grp in groups if kind == "pointwise")
        assert producer >= 0 and (red == [producer] if joins else len(red) == 1 and red[0] not in (-1, producer)), \
            (fn.__name__, groups)
        assert bool(_reductions_through_reshapes(gm, "cpu")) == joins
        assert not _reductions_through_reshapes(gm, "cuda"), fn.__name__


def test_reduced_dims_through_a_reshape():
    from aotfuse.lower import _reduced_dims_through as through

    assert through((4, 8, 64), (32, 64), {0}) == [0, 1]
    assert through((4, 8, 64), (32, 64), {1}) == [2]
    assert through((4, 8, 2, 16), (32, 32), {0}) == [0, 1]
    assert through((4, 1, 8, 64), (32, 64), {0}) == [0, 2]  # a size-1 dim is kept (and reshaped away)
    assert through((32, 64), (4, 8, 64), {0, 1}) == [0]
    assert through((32, 64), (4, 8, 64), {0}) is None  # dim 0 of x would be half reduced
    assert through((6, 4), (4, 6), {0}) is None
    assert through((6, 4), (4, 6), {0, 1}) == [0, 1]


def test_bias_gradients_of_a_token_mlp_run_in_the_gradient_kernels():
    # a Linear over [batch, tokens, features]: its bias gradient sums a view of the gradient
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), torch.nn.Tanh())
    x = torch.randn(3, 5, 16)
    compiled = aotfuse.memory_efficient_fusion(copy_module(model))
    compiled(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        assert_close(q.grad, p.grad, f"token MLP gradient of {name}", atol=1e-5, rtol=1e-5)
    (record,) = compiled._aotfuse_compiled.records
    backward = record.programs["backward"]
    assert "aten::sum.dim_IntList" not in backward.extern_counts(), backward.extern_counts()
    summed = [grp for op, kind, grp in backward.program.node_groups() if op.startswith("aten::sum")]
    assert len(summed) == 2 and all(g >= 0 for g in summed), backward.program.node_groups()


def copy_module(m):
    import copy

    return copy.deepcopy(m)


def nan_phases_case():
    """A softmax, a centring by the max and a min + sum over rows holding a NaN and an inf, decomposed:
    phased kernels whose max/min must propagate NaN as ATen's do. (f, x, traced graph)"""
    from aotfuse.decompositions import default_decompositions

    def f(x):
        return torch.softmax(x * 1.0, -1), (x - x.amax(-1, keepdim=True)) * 2.0, x.amin(-1) + x.sum(-1)

    x = torch.randn(6, 40)
    x[2, 7] = float("nan")
    x[4, 0] = float("inf")
    return f, x, make_fx(f, decomposition_table=default_decompositions(norms=True))(x)


def test_phased_max_propagates_nan_like_aten():
    f, x, gm = nan_phases_case()
    lowered = lower(gm)
    assert "phases)" in lowered.program.source
    for i, (got, ref) in enumerate(zip(lowered([x]), f(x))):
        assert torch.equal(got.isnan(), ref.isnan()), f"output {i}: NaN positions differ"
        keep = ~ref.isnan()
        assert_close(got[keep], ref[keep], f"output {i}", atol=1e-6, rtol=1e-5)


def test_integer_conversions_run_as_aten_to_copy_not_the_python_prim():
    # prims.convert_element_type from int64 (a loss's targets) takes no kernel; as an ATen call it is
    # aten._to_copy (the prim is implemented in Python, about 5x the host time)
    def f(t, x):
        return prims.convert_element_type(t, torch.float32) * x, prims.convert_element_type(x * 2.0, torch.bfloat16)

    t, x = torch.arange(-3, 9), torch.randn(12)
    lowered = lower(make_fx(f)(t, x))
    got, ref = lowered([t, x]), f(t, x)
    for i in range(2):
        assert got[i].dtype == ref[i].dtype and torch.equal(got[i], ref[i]), i
    assert lowered.extern_counts() == {"aten::_to_copy.default": 1}, lowered.extern_counts()
    kernel_ops = [op for op, _k, grp in lowered.program.node_groups() if grp >= 0]
    assert "prims::convert_element_type.default" in kernel_ops, kernel_ops  # a float conversion stays in its kernel


def test_copies_into_fresh_or_sliced_tensors_are_fused_copies_of_the_source():
    # functionalization writes `a.copy_(b)` and slice assignments as aten.copy(a, b) (+ slice_scatter);
    # the copy reads b only, in a's layout and dtype, and the uninitialized `a` is never made
    def f(x, base):
        fresh = aten.new_empty_strided.default(x, [4, 6, 5], [30, 1, 6])  # a permuted layout
        c1 = aten.copy.default(fresh, aten.mul.Tensor(x, 2.0))
        c2 = aten.copy.default(aten.new_empty_strided.default(x, [4, 6, 5], [30, 5, 1], dtype=torch.bfloat16), x)
        region = aten.slice.Tensor(base, 1, 2, 5)
        c3 = aten.slice_scatter.default(base, aten.copy.default(region, aten.exp(x[:, :3])), 1, 2, 5)
        return aten.add.Tensor(c1, 1.0), c2, c3

    x, base = torch.randn(4, 6, 5), torch.randn(4, 8, 5)
    gm = make_fx(f)(x, base)
    lowered = lower(gm)
    got, ref = lowered([x, base]), f(x, base)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert_close(a, b, f"copy case {i}", atol=1e-6, rtol=1e-6)  # exp: the kernel's, within an ulp of ATen's
    assert torch.equal(got[1], ref[1])
    assert got[1].stride() == ref[1].stride() == (30, 5, 1)
    externs = lowered.extern_counts()
    assert externs == {}, externs  # no copy, no empty tensor, no slice view; the slice_scatter is a window member
    groups = lowered.program.node_groups()
    mul_group = next(grp for op, _k, grp in groups if op == "aten::mul.Tensor")
    assert mul_group >= 0 and [op for op, _k, grp in groups if grp == mul_group].count("aten::clone.default") == 1, groups


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_backward_decomposition_is_one_kernel_for_the_input_gradient(dtype, affine):
    from aotfuse.decompositions import default_decompositions

    g = torch.Generator().manual_seed(5)
    x, go = (torch.randn(6, 7, 48, generator=g).to(dtype) for _ in range(2))
    w, b = ((torch.randn(48, generator=g).to(dtype) for _ in range(2)) if affine else (None, None))
    _out, mean, rstd = aten.native_layer_norm(x, [48], w, b, 1e-5)
    mask = [True, affine, affine]

    def f(go, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(go, x, [48], mean, rstd, w, b, mask)

    args = (go, x, mean, rstd, w, b)
    gm = make_fx(f, decomposition_table=default_decompositions(norms=True))(*args)
    lowered = lower(gm)
    got = [t for t in lowered(list(args)) if t is not None]
    ref = [t for t in f(*args) if t is not None]
    exact = [t for t in aten.native_layer_norm_backward(
        go.double(), x.double(), [48], *aten.native_layer_norm(x.double(), [48], None if w is None else w.double(),
                                                                 None if b is None else b.double(), 1e-5)[1:],
        None if w is None else w.double(), None if b is None else b.double(), mask) if t is not None]
    assert len(got) == len(ref) == (3 if affine else 1)
    # bf16: ATen's CPU kernel rounds its weight gradient sums more than ours (0.11 against 0.03 off
    # float64 here), so the float64 criterion decides and the comparison with eager only bounds
    tol = (1e-4, 1e-4) if dtype == torch.float32 else (0.15, 0.1)
    for i, (a, r, e) in enumerate(zip(got, ref, exact)):
        assert a.dtype == r.dtype and a.shape == r.shape, i
        assert_close(a, r, f"layer norm backward output {i} ({dtype}, affine={affine})", atol=tol[0], rtol=tol[1])
        # no worse against float64 than ATen's own kernel, within rounding of the output dtype
        ours, aten_err = (a.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        assert ours <= aten_err * 1.5 + (1e-5 if dtype == torch.float32 else 1e-2), (i, ours, aten_err)
    externs = lowered.extern_counts()
    assert not any(op.startswith(("aten::div", "aten::mul", "aten::native_layer_norm")) for op in externs), externs
    assert "phases)" in lowered.program.source
    if affine:
        # the weight and bias gradients (column sums of go * x_hat and go, x_hat in the row kernel)
        # are one column kernel that recomputes x_hat and the product: no ATen sum, and the row
        # kernel stores the input gradient only
        # (bf16: the upcasts of mean, rstd and the weight are computed by their readers over
        # broadcast views, csrc/sink.c's broadcast reads, not kernels of their own; the two
        # downcasts of the sums are one small kernel)
        assert externs == {}, externs
        assert "(2 column reductions)" in lowered.program.source
        assert "(2 reductions, 2 phases), 5 inputs, 1 outputs" in lowered.program.source
        assert lowered.program.num_kernels == (2 if dtype == torch.float32 else 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_a_selection_gives_exactly_are_not_rounded_again(dtype):
    """A kernel rounds each 16-bit value it computes as if stored, to match op-by-op results; a
    value that is one of its 16-bit operands already (a where between them, a max, a clone) needs
    no rounding (cross entropy's bf16 row kernel: 2.43 -> 2.13 ms alone). A product keeps it.
    (make_fx makes where's scalars 16-bit tensors, rounded where they are made; a scalar argument
    the type cannot hold: tests/c/test_codegen_c.c.) Eager's values to the bit."""
    def f(x, y, c):
        picked = torch.where(c, x, float("-inf"))
        top = torch.maximum(x, y).clone()
        odd = torch.where(c, x, 0.1)
        return picked.amax(-1), top * 3, odd + 1, c.to(dtype) * x, c * y

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, 40, generator=g).to(dtype) for _ in range(2))
    c = torch.rand(8, 40, generator=g) > 0.5
    gm = make_fx(f)(x, y, c)
    lowered = lower(gm)
    for got, ref in zip(lowered([x, y, c]), f(x, y, c)):
        assert got.dtype == ref.dtype and torch.equal(got, ref), (dtype, got, ref)
    rounding = "af_bf16_round" if dtype == torch.bfloat16 else "af_f16_round"
    source = lowered.program.source
    made = re.findall(r"float (v\d+) = .*/\* (aten::\w+\.\w+) \*/", source)
    rounded = set(re.findall(rf"(v\d+) = {rounding}\(v\d+\)", source))
    by_op = {}
    for v, op in made:
        by_op.setdefault(op, []).append(v)
    assert len(by_op["aten::where.self"]) == 2, source
    for op in ("aten::where.self", "aten::maximum.default", "aten::clone.default"):
        assert not rounded & set(by_op[op]), (op, source)
    # products: by 3 and by the bool's 16-bit upcast rounded; by the bool itself (c * y) not
    muls = by_op["aten::mul.Tensor"]
    assert len(muls) == 3 and len(set(muls) & rounded) == 2, source
    assert re.search(rf"float ({'|'.join(sorted(set(muls) - rounded))}) = \(v\d+ \* v\d+\); /\* aten::mul", source), source


def _bf16_norms_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.LayerNorm(96), torch.nn.GELU(), torch.nn.Linear(96, 48),
                               torch.nn.LayerNorm(48))


def test_a_bf16_norms_upcasts_are_computed_in_their_readers_kernels(monkeypatch):
    """A bf16 layer norm's backward reads float upcasts of its weight ([hidden]) and of its saved
    mean and rstd ([rows, 1]): each a kernel of its own, storing a float copy, unless each reader
    computes it over a broadcast view of the bf16 tensor (csrc/sink.c's broadcast reads, on by
    default; AOTFUSE_SINK_BROADCASTS=0 keeps the kernels). Eager's and float64's values either way;
    with them the backward has no kernel over the rows alone and no one-node kernel, 4 fewer."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    from aotfuse.testing import compare_models

    x = torch.randn(4, 16, 48, generator=torch.Generator().manual_seed(1))
    kernels = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_SINK_BROADCASTS", mode)
        compare_models(_bf16_norms_mlp, lambda: x, dtype=torch.bfloat16, steps=2, name=f"broadcasts={mode}").assert_ok()
        compiled = aotfuse.memory_efficient_fusion(_bf16_norms_mlp().to(torch.bfloat16))
        compiled(x.to(torch.bfloat16)).float().sum().backward()
        backward = compiled._aotfuse_compiled.records[-1].programs["backward"].program
        groups = re.findall(r"/\* group \d+: (\d+) nodes.*, (\d+ elements|\d+ x \d+|\d+ columns x \d+ rows) \*/", backward.source)
        kernels[mode] = backward.num_kernels
        if mode == "1":
            assert ("1", "96 elements") not in groups and ("1", "48 elements") not in groups, groups
            assert not any(extent == "64 elements" for _n, extent in groups), groups
    assert kernels["1"] == kernels["0"] - 4, kernels


def _column_sum_of_row_kernel_value(x, w):
    """A row softmax-like kernel beside a column sum of one of its intermediate values."""
    h = (x - x.amax(-1, keepdim=True)).exp()
    y = h / h.sum(-1, keepdim=True)
    z = (x * w).tanh()  # in the row kernel's group (a sibling reading x)
    return y, z.sum(0)


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
def test_a_column_sum_recomputes_its_producers_from_a_row_kernel(device):
    """A reduction under another mask than its input's kernel recomputes the input (the cone of
    pointwise members it depends on) in its own kernel instead of running as an ATen call on a
    stored intermediate; the values match eager and a float64 reference."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 40, generator=g), torch.randn(40, generator=g)
    gm = make_fx(_column_sum_of_row_kernel_value)(x, w)
    if device == "cpu":
        lowered = lower(gm)
        y, s = lowered([x, w])
        assert lowered.extern_counts() == {}, lowered.extern_counts()
        assert lowered.program.num_kernels == 2 and "(1 column reductions)" in lowered.program.source
        ry, rs = _column_sum_of_row_kernel_value(x, w)
        ey, es = _column_sum_of_row_kernel_value(x.double(), w.double())
        assert_close(y, ry, "row kernel output")
        assert_close(s, rs, "column sum")
        assert (s.double() - es).abs().max() <= 4 * (rs.double() - es).abs().max() + 1e-5
        return
    import cuda_emu

    if cuda_emu.unavailable():
        pytest.skip(cuda_emu.unavailable())
    ran = cuda_emu.check(gm, (x, w), "recomputed producers")
    assert sorted(l["kind"] for l in ran) == ["columns", "rows"], ran


def _column_sums_of_a_summed_gradient(a, b, c, d, xhat, rstd, w):
    """A layer norm's backward as Bert's gets it: the incoming gradient summed from four tensors
    (too many to recompute beside x_hat), its weight and bias sums between the row sums and dx."""
    go = a + b + c + d
    g = go * w
    row_g = g.sum(-1, keepdim=True) / 32
    row_gx = (g * xhat).sum(-1, keepdim=True) / 32
    gw = (go * xhat).sum([0, 1])
    gb = go.sum([0, 1])
    dx = (g - row_g - xhat * row_gx) * rstd
    return dx, gw * 2, gb


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
def test_a_column_sum_reads_what_it_cannot_recompute(device):
    """Where recomputing a column sum's input would read too many tensors, the column kernel reads
    the gradient the row kernel stores, and runs after that kernel (which still takes dx, a node
    after the sums): two kernels (and the scaling), no ATen sum; values match eager and float64."""
    gen = torch.Generator().manual_seed(5)
    args = [torch.randn(4, 8, 32, generator=gen) for _ in range(5)] + [torch.rand(4, 8, 1, generator=gen) + 0.5,
                                                                        torch.randn(32, generator=gen)]
    gm = make_fx(_column_sums_of_a_summed_gradient)(*args)
    if device == "cpu":
        lowered = lower(gm)
        assert lowered.extern_counts() == {}, lowered.extern_counts()
        assert lowered.program.num_kernels == 3 and "(2 column reductions), 2 inputs" in lowered.program.source
        ref = _column_sums_of_a_summed_gradient(*args)
        exact = _column_sums_of_a_summed_gradient(*[t.double() for t in args])
        for _ in range(2):
            got = lowered(list(args))
            for name, o, r, e in zip(("dx", "gw", "gb"), got, ref, exact):
                assert_close(o, r, name)
                assert (o.double() - e).abs().max() <= 4 * (r.double() - e).abs().max() + 1e-5, name
        return
    import cuda_emu

    if cuda_emu.unavailable():
        pytest.skip(cuda_emu.unavailable())
    ran = cuda_emu.check(gm, tuple(args), "column sums reading a stored gradient")
    assert sorted(l["kind"] for l in ran) == ["columns", "pointwise", "rows"], ran


def test_recomputed_members_fall_back_with_their_kernel():
    """A kernel whose operand has another layout than planned runs its nodes as ATen calls; a
    recomputed member (another kernel's node) is computed there too, and leaves the other
    kernel's values alone."""
    def meta(shape, strides):
        return ("tensor", "float32", "cpu", -1, shape, strides, 0)

    g = _C.Graph()
    x = g.add_input("x", meta((4, 6), (6, 1)))
    # declared contiguous, returned transposed by ATen: every kernel reading t falls back
    (t,) = g.add_node("aten::t.default", [("v", x)], [], [meta((6, 4), (4, 1))])
    (m,) = g.add_node("aten::amax.default", [("v", t), ("list", [("int", 1)]), ("bool", True)], [], [meta((6, 1), (1, 1))])
    (d,) = g.add_node("aten::sub.Tensor", [("v", t), ("v", m)], [], [meta((6, 4), (4, 1))])
    (e,) = g.add_node("aten::exp.default", [("v", d)], [], [meta((6, 4), (4, 1))])
    (c,) = g.add_node("aten::mul.Tensor", [("v", t), ("float", 2.0)], [], [meta((6, 4), (4, 1))])
    (s,) = g.add_node("aten::sum.dim_IntList", [("v", c), ("list", [("int", 0)])], [], [meta((4,), (1,))])
    g.set_outputs([e, s])
    prog = _C.Program(g, fuse=True)
    assert prog.num_kernels == 2
    groups = prog.node_groups()
    assert groups[4][2] != groups[5][2] and groups[5][2] >= 0  # the mul is the row kernel's; the sum's kernel recomputes it
    xv = torch.randn(4, 6)
    for _ in range(2):
        ev, sv = prog.run([xv])
        assert_close(ev, (xv.t() - xv.t().amax(1, keepdim=True)).exp(), "row kernel's value")
        assert_close(sv, (xv.t() * 2).sum(0), "column sum")
    assert prog.kernel_fallbacks == 4


@pytest.mark.parametrize("fuse", [True, False])
def test_an_as_strided_base_has_its_graph_layout_after_a_fallback(fuse):
    """as_strided reads its base's storage as the graph lays it out. A kernel that falls back (its
    operand t has another layout than planned) makes its value with ATen, in ATen's layout: the
    runtime gives that base of an as_strided view the graph's layout (a copy), so the view, read
    by the next kernel or by an ATen call, sees what the kernel would have written; without
    kernels, the same."""
    def meta(shape, strides):
        return ("tensor", "float32", "cpu", -1, shape, strides, 0)

    g = _C.Graph()
    x = g.add_input("x", meta((4, 6), (6, 1)))
    (t,) = g.add_node("aten::t.default", [("v", x)], [], [meta((6, 4), (4, 1))])  # ATen's is transposed
    (e,) = g.add_node("aten::exp.default", [("v", t)], [], [meta((6, 4), (4, 1))])
    (f,) = g.add_node("aten::as_strided.default", [("v", e), ("list", [("int", 24)]), ("list", [("int", 1)]), ("int", 0)], [],
                      [meta((24,), (1,))])
    (y,) = g.add_node("aten::neg.default", [("v", f)], [], [meta((24,), (1,))])
    g.set_outputs([y])
    prog = _C.Program(g, fuse=fuse, min_group=1)
    xv = torch.randn(4, 6)
    for _ in range(2):
        (yv,) = prog.run([xv])
        assert_close(yv, -xv.t().exp().contiguous().view(24), "the graph's flat view")
    if fuse:
        assert prog.num_kernels == 2 and prog.kernel_fallbacks == 2  # exp's kernel, each run


def test_a_value_read_by_a_later_kernel_survives_its_kernels_fallback():
    """The row kernel falls back to ATen calls (an operand with another layout than planned); the
    gradient it stores for the column kernel (which reads it instead of recomputing it) is still
    there, and both results are right."""
    def meta(shape, strides):
        return ("tensor", "float32", "cpu", -1, shape, strides, 0)

    g = _C.Graph()
    a, b, c = (g.add_input(n, meta((6, 4), (4, 1))) for n in "abc")
    xh, w = g.add_input("xh", meta((6, 4), (4, 1))), g.add_input("w", meta((4, 6), (6, 1)))
    (t,) = g.add_node("aten::t.default", [("v", w)], [], [meta((6, 4), (4, 1))])  # ATen's is transposed
    (go1,) = g.add_node("aten::add.Tensor", [("v", a), ("v", b)], [], [meta((6, 4), (4, 1))])
    (go,) = g.add_node("aten::add.Tensor", [("v", go1), ("v", c)], [], [meta((6, 4), (4, 1))])
    (r,) = g.add_node("aten::sum.dim_IntList", [("v", go), ("list", [("int", 1)]), ("bool", True)], [],
                      [meta((6, 1), (1, 1))])
    (p,) = g.add_node("aten::mul.Tensor", [("v", go), ("v", xh)], [], [meta((6, 4), (4, 1))])
    (s,) = g.add_node("aten::sum.dim_IntList", [("v", p), ("list", [("int", 0)])], [], [meta((4,), (1,))])
    (d,) = g.add_node("aten::sub.Tensor", [("v", go), ("v", r)], [], [meta((6, 4), (4, 1))])
    (dx,) = g.add_node("aten::mul.Tensor", [("v", d), ("v", t)], [], [meta((6, 4), (4, 1))])
    g.set_outputs([dx, s])
    prog = _C.Program(g, fuse=True)
    groups = [grp for _op, _kind, grp in prog.node_groups()]
    assert prog.num_kernels == 2 and groups[4] == groups[1] == groups[7] != groups[5] >= 0, groups
    av, bv, cv, xv, wv = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    gov = av + bv + cv
    for _ in range(2):
        dv, sv = prog.run([av, bv, cv, xv, wv])
        assert_close(dv, (gov - gov.sum(1, keepdim=True)) * wv.t(), "row kernel's value (ATen calls)")
        assert_close(sv, (gov * xv).sum(0), "column sum over the stored gradient")
    assert prog.kernel_fallbacks == 2  # the row kernel, each run; the column kernel ran


def test_cats_with_empty_parts_and_splits_make_no_aten_call_of_their_own():
    # a Hugging Face cache's first update is cat([empty, key]); qkv projections are split in three
    def f(x, w):
        qkv = aten.mm.default(x, w)  # an ATen result: its chunks are views the kernels fold
        q, k, v = aten.split.Tensor(qkv, 4, 1)
        empty = torch.tensor([])  # a constant: lift_fresh_copy of it
        only = aten.cat.default([empty, aten.mul.Tensor(k, 2.0)], 0)
        two = aten.cat.default([q, aten.new_zeros.default(q, [6, 0]), v], 1)
        return aten.add.Tensor(q, v), only, two

    x, w = torch.randn(6, 5), torch.randn(5, 12)
    lowered = lower(make_fx(f)(x, w))
    got, ref = lowered([x, w]), f(x, w)
    for i, (a, r) in enumerate(zip(got, ref)):
        assert a.shape == r.shape and a.dtype == r.dtype and torch.equal(a, r), i
    externs = lowered.extern_counts()
    assert externs == {"aten::mm.default": 1, "aten::cat.default": 1}, externs  # the two-part cat
    assert lowered.program.kernel_fallbacks == 0  # the chunks' layouts were right: the kernels read them folded
    kernel_ops = [op for op, _k, grp in lowered.program.node_groups() if grp >= 0]
    assert "aten::clone.default" in kernel_ops, kernel_ops  # the one-part cat: a copy in k's kernel


def test_a_lone_pointwise_op_after_an_aten_call_is_a_kernel():
    # softmax's backward then its scale, or a residual add between two ATen calls
    def f(a, b):
        return aten.mm.default(aten.mul.Tensor(aten.mm.default(a, b), 0.125), b)

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    lowered = lower(make_fx(f)(a, b))
    assert_close(lowered([a, b])[0], f(a, b), "mm, scale, mm", atol=1e-5, rtol=1e-5)
    assert lowered.extern_counts() == {"aten::mm.default": 2}, lowered.extern_counts()


def _qkv_bias_gradients(x, gq, gk, gv, y):
    # three column sums of independent matmul results (the q, k and v bias gradients); exp(y)*3 is
    # independent of exp(x)*2, whose value an mm reads at once; exp(mm)*4 depends on exp(x)*2
    a = aten.mul.Tensor(aten.exp.default(x), 2.0)
    m = aten.mm.default(a, y)
    b = aten.mul.Tensor(aten.exp.default(y), 3.0)
    c = aten.mul.Tensor(aten.exp.default(m), 4.0)
    sums = [aten.sum.dim_IntList(aten.mm.default(x, w), [0]) for w in (gq, gk, gv)]
    return (m, b, c, *sums)


@pytest.mark.parametrize("merge", ["1", "0"])
def test_independent_kernels_of_one_loop_merge(merge, monkeypatch):
    """Kernels of one loop that do not depend on each other run as one kernel (AOTFUSE_MERGE_KERNELS,
    on by default): the three bias sums, and exp(y)*3 beside exp(x)*2 at the earlier step; the kernel
    depending on exp(x)*2 through an ATen call never joins it. The results are eager's."""
    monkeypatch.setenv("AOTFUSE_MERGE_KERNELS", merge)
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(8, 8, generator=g) * 0.3 for _ in range(5)]
    lowered = lower(make_fx(_qkv_bias_gradients)(*args))
    for run in range(2):
        for i, (a, r) in enumerate(zip(lowered(list(args)), _qkv_bias_gradients(*args))):
            assert_close(a, r, f"output {i}, run {run}, merge={merge}", atol=1e-5, rtol=1e-5)
    groups = {}
    for op, _kind, grp in lowered.program.node_groups():
        if grp >= 0:
            groups.setdefault(op, []).append(grp)
    sums, exps = groups["aten::sum.dim_IntList"], groups["aten::exp.default"]
    assert lowered.program.kernel_fallbacks == 0
    if merge == "1":
        assert len(set(sums)) == 1 and exps[0] == exps[1] != exps[2], groups
        # exp(m)*4 joins the sums too (one loop; nothing reads it before their step)
        assert sums[0] == exps[2] and lowered.program.num_kernels == 2, groups
    else:
        assert len(set(sums)) == 3 and len(set(exps)) == 3, groups
        assert lowered.program.num_kernels == 6, groups


def _early_value_then_big_temporaries(x, y, w):
    a = aten.mul.Tensor(x, 2.0)  # a kernel an mm reads at once
    t = aten.mm.default(a, w)
    for _ in range(3):  # the step's peak: temporaries between the two kernels
        t = aten.mm.default(aten.cat.default([t, t], 1), aten.cat.default([w, w], 0))
    b = aten.exp.default(y)  # independent of a's kernel, one loop with it; y exists from the start
    return aten.sum.default(t), aten.mm.default(b, w)


@pytest.mark.parametrize("n", [8, 512])
def test_a_merge_never_keeps_big_values_live_longer(n, monkeypatch):
    """exp(y) could run in x*2's kernel, before the temporaries: its output would then live through
    the step's peak. Small, it merges; big (1 MB), it keeps its own kernel and the peak is the one
    without merging (a merge saves a kernel step, never memory)."""
    from aotfuse.bench import _cpu_peak

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(n, n, generator=g) * 0.1 for _ in range(3)]
    gm = make_fx(_early_value_then_big_temporaries)(*args)
    result = {}
    for merge in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_MERGE_KERNELS", merge)
        lowered = lower(gm)
        for a, r in zip(lowered(list(args)), _early_value_then_big_temporaries(*args)):
            assert_close(a, r, f"n={n}, merge={merge}", atol=1e-4, rtol=1e-4)
        result[merge] = (lowered.program.num_kernels, _cpu_peak(lambda: lowered(list(args))))
    if n == 8:
        assert result["1"][0] == 1 and result["0"][0] == 2, result
    else:
        assert result["1"] == result["0"], result


@pytest.mark.parametrize("rows", [8, 512])
def test_a_big_pointwise_kernel_keeps_its_threads_apart_from_a_reduction(rows):
    """A column sum's kernel parallelizes over its columns only (few here); a pointwise kernel of
    the same loop joins it only where the loop is small (up to 65536 elements), and keeps its own
    kernel, parallel over every element, above that."""
    def f(x, y):
        return aten.exp.default(x), aten.sum.dim_IntList(y, [0])

    g = torch.Generator().manual_seed(1)
    args = [torch.randn(rows, 256, generator=g) for _ in range(2)]
    lowered = lower(make_fx(f)(*args))
    for a, r in zip(lowered(list(args)), f(*args)):
        assert_close(a, r, f"rows={rows}", atol=1e-4, rtol=1e-5)
    assert lowered.program.num_kernels == (1 if rows * 256 <= 65536 else 2)


def window_cases(x, y, s, t):
    """Paddings and slice assignments as AOTAutograd gives them (Longformer's banded attention makes
    all of these): pads on both sides, crops, a fill value, slice_backward (zeros around a
    gradient), a slice_backward of a slice_backward (one pad), slice_scatter over a value the kernel
    computes, windows of one source beside plain reads of another. x, y: [4, 9]; s: [4, 3];
    t: [2, 3, 5] (strided)."""
    e = aten.mul.Tensor(s, 1.5)  # computed in another kernel: the windows read it as an input
    pads = aten.add.Tensor(aten.constant_pad_nd.default(e, [2, 4, 0, 0], 0.0), y)                  # [4, 9]
    crop = aten.mul.Tensor(aten.constant_pad_nd.default(x, [-2, 1, 1, -1], 1.5), 2.0)             # [4, 8]
    grad = aten.add.Tensor(aten.slice_backward.default(e, [4, 9], 1, -5, -2, 1), x)               # [4, 9]
    nested = aten.slice_backward.default(aten.slice_backward.default(s, [4, 6], 1, 1, 4, 1), [7, 6], 0, 3, 9223372036854775807, 1)
    scatter = aten.slice_scatter.default(aten.mul.Tensor(x, 3.0), e, 1, 6)                        # base computed here
    scatter2 = aten.slice_scatter.default(aten.slice_scatter.default(y, s, 1, 0, 3), e, 1, 3, 6)  # chained
    strided = aten.sub.Tensor(aten.constant_pad_nd.default(t, [1, 1, 0, 0, 1, 0]), 0.5)          # [3, 3, 7]
    return pads, crop, grad, aten.mul.Tensor(nested, -1.0), aten.add.Tensor(scatter, 1.0), scatter2, strided


def window_inputs(dtype):
    g = torch.Generator().manual_seed(11)
    x, y, s = (torch.randn(*shape, generator=g).to(dtype) for shape in ((4, 9), (4, 9), (4, 3)))
    t = torch.randn(2, 5, 3, generator=g).to(dtype).transpose(1, 2)  # [2, 3, 5], strides (15, 1, 3)
    return x, y, s, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paddings_and_slice_assignments_are_kernel_members(dtype):
    """constant_pad_nd, slice_backward and slice_scatter read their source at shifted, guarded
    indices inside the kernels that consume them: no ATen call, the values bit-for-bit eager's
    (a window only moves values; the arithmetic around it rounds as eager's ops do)."""
    args = window_inputs(dtype)
    lowered = lower(make_fx(window_cases)(*args))
    for _ in range(2):
        got, ref = lowered(list(args)), window_cases(*args)
        for i, (a, r) in enumerate(zip(got, ref)):
            assert a.shape == r.shape and a.dtype == r.dtype, (i, a.shape, r.shape)
            assert_close(a, r, f"window case {i} ({dtype})", atol=0, rtol=0)
    assert lowered.extern_counts() == {}, lowered.extern_counts()
    ops = [op for op, _k, grp in lowered.program.node_groups()]
    assert "aten::slice_backward.default" not in ops and ops.count("aten::constant_pad_nd.default") == 5, ops
    assert lowered.program.kernel_fallbacks == 0


def test_a_window_never_joins_its_source_s_kernel_nor_a_reduction():
    """The source is read at other indices than the window's own: it must be materialized first
    (so a window of a value computed in the same chain starts a new kernel), and a window's kernel
    has no reductions (the reduction kernels have no guarded loads)."""
    def f(x):
        h = aten.mul.Tensor(x, 2.0)
        p = aten.constant_pad_nd.default(h, [0, 0, 1, -1])  # shifted by one row: same shape as h
        q = aten.add.Tensor(p, h)
        return aten.sum.dim_IntList(q, [1]), q

    x = torch.randn(6, 8)
    lowered = lower(make_fx(f)(x))
    got, ref = lowered([x]), f(x)
    for a, r in zip(got, ref):
        assert_close(a, r, "shifted sum", atol=1e-5, rtol=1e-5)
    groups = {}
    for op, _k, grp in lowered.program.node_groups():
        groups.setdefault(grp, []).append(op.split(".")[0])
    pad_group = next(g for g, ops in groups.items() if "aten::constant_pad_nd" in ops)
    assert "aten::mul" not in groups[pad_group] and "aten::sum" not in groups[pad_group], groups


def test_pads_that_crop_inside_are_not_composed():
    # crop then pad loses what the crop removed: pad(pad(x, -1), +1) is not pad(x, 0)
    def f(x):
        inner = aten.constant_pad_nd.default(aten.mul.Tensor(x, 1.0), [-1, 0])
        return (aten.constant_pad_nd.default(inner, [1, 0]),)

    x = torch.randn(3, 5)
    lowered = lower(make_fx(f)(x))
    assert_close(lowered([x])[0], f(x)[0], "crop then pad", atol=0, rtol=0)
    assert [op for op, _k, _g in lowered.program.node_groups()].count("aten::constant_pad_nd.default") == 2


# shapes and pads GCC 12 vectorized wrongly (a guarded load if-converted into an AVX-512 masked load
# lost elements) before kernels with windows kept their guarded loads as branches
_MISCOMPILED_PADS = [((6, 4), [2, 2, 2, 1]), ((6, 5), [0, 2, 1, 1]), ((5, 6), [0, 2, 1, 3]), ((6, 4), [2, 2, 1, 3]),
                     ((5, 6), [2, 0, 1, 3]), ((5, 3), [3, 3, 2, 1]), ((3, 4), [2, 0, 2, 2]), ((16, 2), [0, 0, 1, 3]),
                     ((8, 2), [0, 0, 2, 1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_pads_of_many_small_shapes_match_eager_exactly(dtype, monkeypatch):
    """Pads of small values (fully unrolled and vectorized by the C compiler): the shapes GCC 12
    once miscompiled, and 40 random ones, in one program (one compile), each its own kernel."""
    monkeypatch.setenv("AOTFUSE_WINDOW_SOURCES", "0")  # the pad alone in its kernel, as it was miscompiled
    monkeypatch.setenv("AOTFUSE_MERGE_KERNELS", "0")  # the products of equal shapes apart too
    rng = random.Random(3)
    cases = list(_MISCOMPILED_PADS)
    for _ in range(40):
        shape = tuple(rng.choice([1, 2, 3, 4, 5, 6, 8, 16]) for _ in range(rng.randint(1, 3)))
        cases.append((shape, [rng.randint(0, 3) for _ in range(2 * len(shape))]))
    gen = torch.Generator().manual_seed(8)
    args = [torch.randn(*shape, generator=gen).to(dtype) for shape, _ in cases]

    def f(*xs):
        return tuple(aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), pads, 0.0) for x, (_s, pads) in zip(xs, cases))

    lowered = lower(make_fx(f, tracing_mode="fake")(*args))
    assert lowered.program.num_kernels == 2 * len(cases)
    for i, (got, ref) in enumerate(zip(lowered(list(args)), f(*args))):
        assert_close(got, ref, f"pad of {cases[i][0]} by {cases[i][1]} ({dtype})", atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_channels_last_windows_walk_the_channels(dtype):
    """Pads and crops of channels-last tensors (MobileNetV2's TF padding and its backward's crop,
    with the ReLU6 mask's `where`) walk memory: the inner loop runs over the channels (stride 1), not
    over W at a stride of C (a gather and a scatter an element: 4-5 ns each, the kernels' time
    tripled). Random shapes and pads, positive, negative and mixed, against eager's bits."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    cases = [((2, 96, 7, 7), [0, 1, 0, 1]), ((2, 96, 8, 8), [0, -1, 0, -1]), ((3, 32, 6, 5), [1, 1, 1, 1]),
             ((2, 16, 5, 6), [-1, 2, 1, -2])]
    for _ in range(6):
        shape = (rng.randint(1, 3), rng.choice([8, 16, 24, 40]), rng.randint(3, 7), rng.randint(3, 7))
        cases.append((shape, [rng.randint(-2, 2) for _ in range(4)]))
    xs = [torch.randn(*shape, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
          for shape, _ in cases]
    masks = [(x > 0.5).contiguous(memory_format=torch.channels_last) for x in xs]

    def f(*args):
        n = len(args) // 2
        outs = []
        for x, m, (_s, pads) in zip(args[:n], args[n:], cases):
            y = aten.where.self(m, aten.mul.Tensor(x, 0.0), aten.mul.Tensor(x, 3.0))
            outs.append(aten.constant_pad_nd.default(y, pads, 0.0))
        return tuple(outs)

    lowered = lower(make_fx(f, tracing_mode="fake")(*xs, *masks))
    for i, (got, ref) in enumerate(zip(lowered(xs + masks), f(*xs, *masks))):
        assert got.stride() == ref.stride(), (i, got.stride(), ref.stride())
        assert_close(got, ref, f"window of {cases[i][0]} by {cases[i][1]} ({dtype}, channels-last)", atol=0, rtol=0)
    src = lowered.program.source
    # the first case: [2, 96, 8, 8] written channels-last; its inner loop's stores step by 1
    body = src[src.index("/* group 0:"):src.index("/* group 1:")] if "/* group 1:" in src else src
    assert "i < 96" in body and "i * 96" not in body, body
    # the second, a crop: its loads need no guard, so its loop keeps GCC's if-conversion (the `where`
    # branch-free; AF_GUARDED_LOADS made it a branch on the mask: 4 ns an element)
    crop = src[src.index("/* group 1:"):src.index("/* group 2:")]
    assert "constant_pad_nd" in crop and "AF_GUARDED_LOADS" not in crop, crop


@pytest.mark.parametrize("channels", [8, 12, 16, 24])
def test_few_channels_last_channels_stay_a_vectorized_loop(channels, monkeypatch):
    """A channels-last kernel whose inner loop runs over 4-16 channels (a constant trip count) keeps
    that loop (AF_NO_UNROLL): GCC unrolled it whole before vectorizing, and the unrolled selects (a
    ReLU, its backward's mask, a `where`) became branches on random data. ResNet's batch norm
    backward over [16, 8, 16, 16] took 0.29-0.34 ms a kernel, 0.61 ms at 16 channels, and 0.06-0.11
    with the loop kept. A column kernel whose columns fit one block loops over constant bounds.
    Batch norm + ReLU forward and backward, and a pointwise kernel with a per-channel operand,
    against eager and float64; 24 channels (no longer a small loop) and AOTFUSE_SMALL_LOOPS=0 (an
    A/B) keep GCC's unrolling, with the same values."""
    gen = torch.Generator().manual_seed(channels)
    x64 = torch.randn(4, channels, 6, 5, dtype=torch.float64, generator=gen)
    w64, b64 = torch.randn(channels, dtype=torch.float64, generator=gen), torch.randn(channels, dtype=torch.float64, generator=gen)
    cot = torch.randn(4, channels, 6, 5, dtype=torch.float64, generator=gen)

    def norm(x, w, b):
        return torch.relu(F.batch_norm(x, None, None, w, b, training=True)) * 1.5

    def gate(x, w, b):
        return torch.where(x > 0.0, x * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1), x * 0.25)

    def run(f, dtype):
        x = x64.to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        w, b = w64.to(dtype).requires_grad_(), b64.to(dtype).requires_grad_()
        out = f(x, w, b)
        return (out.detach(), *torch.autograd.grad((out * cot.to(dtype)).sum(), (x, w, b)))

    names = ("output", "x gradient", "weight gradient", "bias gradient")
    for fn in (norm, gate):
        ref, eager = run(fn, torch.float64), run(fn, torch.float32)
        sources = {}
        for switch in ("1", "0"):
            monkeypatch.setenv("AOTFUSE_SMALL_LOOPS", switch)
            compiled = aotfuse.aot_function(fn)
            got = run(compiled, torch.float32)
            for what, a, e, r in zip(names, got, eager, ref):
                what = f"{fn.__name__} over {channels} channels-last channels, AOTFUSE_SMALL_LOOPS={switch}: {what}"
                assert_close(a, e, what, atol=1e-5, rtol=1e-5)
                err, eager_err = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
                assert err <= 2 * eager_err + 1e-6, (what, err, eager_err)
            sources[switch] = "".join(low.program.source for low in compiled.records[-1].programs.values())
        assert "AF_NO_UNROLL for" in sources["1"] if channels <= 16 else "AF_NO_UNROLL for" not in sources["1"], fn
        assert "AF_NO_UNROLL for" not in sources["0"] and f"c0 = 0, c1 = {channels};" not in sources["0"], fn
        if fn is norm:  # its statistics: column-phased, one block of constant bounds
            assert "column-phased" in sources["1"], sources["1"]
            assert (f"c0 = 0, c1 = {channels};" in sources["1"]) == (channels <= 16), channels
        else:  # its forward: a pointwise kernel looping over the channels inside the rows
            loop = f"for (af_idx i = 0; i < {channels}; i++)"
            assert loop in sources["1"] and loop in sources["0"], sources["1"]
            assert (f"AF_NO_UNROLL {loop}" in sources["1"]) == (channels <= 16), channels


def test_fills_are_kernel_members_that_read_no_tensor(monkeypatch):
    """zeros_like / ones_like / full_like / new_zeros / new_ones / new_full of a contiguous result are
    aten.full, a pointwise member without a tensor read: Longformer's zeros assigned into a slice
    become part of the kernels around them; a fill in another layout stays ATen's (with constant
    folding off: folding would make it a constant, test_constant_folding.py)."""
    monkeypatch.setenv("AOTFUSE_CONSTANT_FOLD", "0")
    def f(x, y):
        h = aten.mul.Tensor(x, 2.0)
        z = aten.clone.default(aten.zeros_like.default(h, memory_format=torch.contiguous_format))
        scattered = aten.slice_scatter.default(y, z, 1, 1, 7)               # zeros into a slice of y
        mask = aten.new_ones.default(x, [4, 6], dtype=torch.bool)
        filled = aten.where.self(mask, aten.full_like.default(h, -2.5), h)
        grown = aten.add.Tensor(aten.new_full.default(x, [4, 6], 0.25), aten.new_zeros.default(y, [4, 6]))
        kept = aten.zeros_like.default(aten.t.default(h), memory_format=torch.preserve_format)  # strided: ATen
        return scattered, filled, grown, aten.add.Tensor(kept, 1.0)

    x, y = torch.randn(4, 6), torch.randn(4, 9)
    lowered = lower(make_fx(f)(x, y))
    for _ in range(2):
        for i, (a, r) in enumerate(zip(lowered([x, y]), f(x, y))):
            assert a.shape == r.shape and a.dtype == r.dtype and a.stride() == r.stride(), i
            assert_close(a, r, f"fill case {i}", atol=0, rtol=0)
    assert lowered.extern_counts() == {"aten::zeros_like.default": 1}, lowered.extern_counts()


def select_cases(x, s, g):
    """select_scatter and select_backward (Longformer assigns and differentiates single rows of its
    chunks): x [4, 8, 5]; s [4, 5]; g [8, 5]."""
    h = aten.mul.Tensor(x, 0.5)
    first = aten.select_scatter.default(h, aten.mul.Tensor(s, 2.0), 1, 0)
    last = aten.select_scatter.default(first, s, 1, -1)
    grad = aten.add.Tensor(aten.select_backward.default(g, [4, 8, 5], 0, 2), x)
    inner = aten.mul.Tensor(aten.select_backward.default(g, [8, 3, 5], 1, -2), 3.0)
    return aten.add.Tensor(last, 1.0), grad, inner


def select_inputs(dtype):
    gen = torch.Generator().manual_seed(5)
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for shape in ((4, 8, 5), (4, 5), (8, 5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_assignments_and_their_gradients_are_windows(dtype):
    args = select_inputs(dtype)
    lowered = lower(make_fx(select_cases)(*args))
    for _ in range(2):
        for i, (a, r) in enumerate(zip(lowered(list(args)), select_cases(*args))):
            assert a.shape == r.shape and a.dtype == r.dtype, i
            assert_close(a, r, f"select case {i} ({dtype})", atol=0, rtol=0)
    assert lowered.extern_counts() == {}, lowered.extern_counts()
    ops = [op for op, _k, _g in lowered.program.node_groups()]
    assert ops.count("aten::slice_scatter.default") == 2 and ops.count("aten::constant_pad_nd.default") == 2, ops


def random_window_graph(seed: int):
    """A seeded random window graph and its inputs: a pad (sides from -2 to 3, size-1 dims included)
    or a slice assignment (any start and end, negative ones too) of a pointwise value only the window
    reads (computed in the window's kernel, at the source's index: shifted members), then pointwise
    ops in the window's shape. bf16 for every third seed."""
    rng = random.Random(seed)
    nd = rng.randint(1, 4)
    shape = [rng.choice([1, 2, 3, 5, 7]) for _ in range(nd)]
    dtype = torch.bfloat16 if seed % 3 == 1 else torch.float32
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if rng.random() < 0.5:
        pads = []
        for d in range(nd):
            lo, hi = rng.randint(-2, 3), rng.randint(-2, 3)
            lo = max(lo, -shape[d] + 1)
            # every dim at least 1 long, and ATen's crop before the pad (by the negative sides) not
            # longer than the dim (it refuses `pad(x[1], [3, -2])`)
            hi = max(hi, -shape[d] + 1 - lo, -(shape[d] + min(lo, 0)))
            pads = [lo, hi] + pads
        value = rng.choice([0.0, 1.5, float("-inf")])

        def f(x):
            p = aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), pads, value)
            return (aten.add.Tensor(aten.mul.Tensor(p, 0.5), 1.0),)
        return f, (x,), f"pad {shape} {pads} {value}"
    dim = rng.randrange(nd)
    n = shape[dim]
    start = rng.randint(-n - 1, n)
    end = rng.choice([None, rng.randint(-n - 1, n + 2)])
    lo = min(max(start + n if start < 0 else start, 0), n)
    hi = n if end is None else min(max(end + n if end < 0 else end, 0), n)
    src_shape = list(shape)
    src_shape[dim] = max(hi - lo, 0)
    s = torch.randn(*src_shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)

    def f(x, s):
        base = aten.mul.Tensor(x, 3.0)
        out = aten.slice_scatter.default(base, aten.mul.Tensor(s, -1.0), dim, start, end)
        return (aten.sub.Tensor(out, 0.25),)
    return f, (x, s), f"slice_scatter {shape} dim {dim} [{start}:{end}]"


@pytest.mark.parametrize("seed", range(40))
def test_random_windows_match_eager_exactly(seed):
    f, args, what = random_window_graph(seed)
    lowered = lower(make_fx(f)(*args))
    (got,), (ref,) = lowered(list(args)), f(*args)
    assert got.shape == ref.shape, what
    assert_close(got, ref, what, atol=0, rtol=0)
    window_ops = [op for op, _k, grp in lowered.program.node_groups()
                  if op.split(".")[0] in ("aten::constant_pad_nd", "aten::slice_scatter")]
    assert window_ops and all(grp >= 0 for op, _k, grp in lowered.program.node_groups()
                              if op.split(".")[0] in ("aten::constant_pad_nd", "aten::slice_scatter")), what
    # the source's mul is computed in the window's kernel: one kernel for the whole graph
    assert lowered.program.num_kernels == 1, (what, str(lowered.program))


def _windows_of_computed_sources(dtype):
    """A pad of exp(x) * y (cropping a row, padding the last dim) and a slice assignment of tanh(s)
    into it, then a scale: (function, inputs)."""
    def f(x, s, y):
        p = aten.constant_pad_nd.default(aten.mul.Tensor(aten.exp.default(x), y), [1, 2, -1, 0], -0.5)
        out = aten.slice_scatter.default(p, aten.tanh.default(s), 1, 2, 5)
        return (aten.add.Tensor(out, 1.0),)

    gen = torch.Generator().manual_seed(16)
    return f, [torch.randn(4, 5, generator=gen).to(dtype), torch.randn(3, 3, generator=gen).to(dtype),
               torch.randn(5, generator=gen).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shifted", [True, False])
def test_a_windows_source_is_computed_in_its_kernel(shifted, dtype, monkeypatch):
    """A pad and a slice assignment of pointwise values only they read compute those values in
    their own kernel, at the source's index inside the guard (shifted members: one kernel, the
    sources never stored; AOTFUSE_WINDOW_SOURCES=0: a kernel per source besides); eager's values,
    and within float64's rounding."""
    monkeypatch.setenv("AOTFUSE_WINDOW_SOURCES", "1" if shifted else "0")

    f, args = _windows_of_computed_sources(dtype)
    lowered = lower(make_fx(f)(*args))
    assert lowered.program.num_kernels == (1 if shifted else 3), str(lowered.program)
    (got,), (ref,) = lowered(list(args)), f(*args)
    (exact,) = f(*[a.double() for a in args])
    if dtype == torch.float32:
        assert_close(got, ref, "windows' sources computed in their kernel", atol=1e-6, rtol=1e-6)
    else:  # exp and tanh in float, each value rounded to bfloat16 as stored
        assert_close(got.float(), ref.float(), "windows' sources computed in their kernel (bf16)", atol=1e-2, rtol=1e-2)
    assert (got.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-6
    assert lowered.program.kernel_fallbacks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_windows_sources_in_an_emulated_cuda_kernel(dtype):
    """The same windows in CUDA (the host emulation): one kernel computing both sources at their
    windows' indices gives eager's values."""
    import cuda_emu

    if cuda_emu.unavailable():
        pytest.skip(cuda_emu.unavailable())
    f, args = _windows_of_computed_sources(dtype)
    gm = make_fx(f)(*args)
    ran = cuda_emu.check(gm, tuple(args), f"windows' computed sources {dtype}")
    assert len(ran) == 1 and cuda_emu.source_of(gm).count("its source computed at its index") == 2, ran


def pads_through_views(x, b):
    """Longformer's chunked attention in backward: a pad, a view merging the padded dim into the one
    before it, a pad of that, a view splitting it again, and a crop. x [4, 8, 2, 6], b [6]."""
    p1 = aten.constant_pad_nd.default(aten.mul.Tensor(x, b), [0, 1], 0.0)            # [4, 8, 2, 7]
    p2 = aten.constant_pad_nd.default(aten.view.default(p1, [4, 8, 14]), [0, 2], 0.0)  # [4, 8, 16]
    p3 = aten.constant_pad_nd.default(aten.view.default(p2, [4, 8, 2, 8]), [0, -3])    # [4, 8, 2, 5]
    return (aten.add.Tensor(p3, 1.0),)


def pads_through_views_inputs(dtype):
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(4, 8, 2, 6, generator=gen).to(dtype), torch.randn(6, generator=gen).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("remapped", [True, False])
def test_pads_read_through_views_are_one_kernel(remapped, dtype, monkeypatch):
    """A window whose source views another window's value (nothing else reading either) computes
    that window in its own kernel, at the element of its storage the view's element is: nested
    windows and remapped members, the views only index arithmetic (AOTFUSE_WINDOW_SOURCES=0: a
    kernel per pad). Eager's values to the bit; no closer to float64 needed, pads only move them."""
    monkeypatch.setenv("AOTFUSE_WINDOW_SOURCES", "1" if remapped else "0")
    args = pads_through_views_inputs(dtype)
    lowered = lower(make_fx(pads_through_views)(*args))
    assert lowered.program.num_kernels == (1 if remapped else 4), str(lowered.program)
    for _ in range(2):
        (got,), (ref,) = lowered(list(args)), pads_through_views(*args)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert_close(got, ref, f"pads read through views ({dtype})", atol=0, rtol=0)
    (exact,) = pads_through_views(*[a.double() for a in args])
    assert (got.double() - exact).abs().max() <= (ref.double() - exact).abs().max()
    assert lowered.program.kernel_fallbacks == 0
    assert lowered.extern_counts() == {}, lowered.extern_counts()
    groups = {g for _op, _k, g in lowered.program.node_groups()}
    assert (groups == {0}) == remapped, lowered.program.node_groups()  # the views too are the kernel's


def test_a_copy_of_views_of_a_pad_is_one_kernel():
    """Longformer's chunks before a matmul: clone(permute(view(pad(x * 2)))). The copy is a window that
    pads nothing (fuse.c, copy_window), which computes the pad at the element its view's element is:
    one kernel, the pad never stored, eager's values to the bit."""
    def f(x, w):
        p = aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), [0, 0, 1, 1], 0.0)  # [4, 8, 6]
        v = aten.permute.default(aten.view.default(p, [4, 2, 4, 6]), [0, 2, 1, 3])
        c = aten.clone.default(v, memory_format=torch.contiguous_format)
        return (aten.mm.default(aten.view.default(c, [32, 6]), w),)

    args = (torch.randn(4, 6, 6), torch.randn(6, 3))
    lowered = lower(make_fx(f, tracing_mode="fake")(*args))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    groups = [g for op, _k, g in lowered.program.node_groups() if op in ("aten::constant_pad_nd.default", "aten::clone.default")]
    assert len(groups) == 2 and groups[0] == groups[1] >= 0, lowered.program.node_groups()
    for _ in range(2):
        (got,), (ref,) = lowered(list(args)), f(*args)
        assert_close(got, ref, "mm of a copy of views of a pad", atol=0, rtol=0)
    assert lowered.program.kernel_fallbacks == 0


def random_remapped_window_graph(seed: int):
    """A seeded random chain of windows read through views: x * 2 padded, then one to three times a
    chain of one to three views of the last window's value (a reshape merging or splitting dims,
    permute, transpose, slice, select, unsqueeze, expand) padded or cropped again (pads from -1 to
    2 on every dim), assigned into a slice of another input times 3, or copied (a clone of views of
    a window's value is a window that pads nothing); then + 1. Every view is a
    view of its input, so the graph is one kernel: each window evaluates the one before at the
    coordinates its view's element has there. bf16 for every third seed."""
    rng = random.Random(seed)
    dtype = torch.bfloat16 if seed % 3 == 0 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*[rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 3))], generator=gen).to(dtype)
    steps, bases = [], []

    def apply(t, st, base=None):
        kind = st[0]
        if kind == "pad":
            return aten.constant_pad_nd.default(t, st[1], st[2])
        if kind == "scatter":
            return aten.slice_scatter.default(aten.mul.Tensor(base, 3.0), t, st[1], st[2], st[2] + t.shape[st[1]])
        if kind == "view":
            return aten.view.default(t, st[1])
        if kind == "clone":
            return aten.clone.default(t, memory_format=torch.contiguous_format)
        if kind == "permute":
            return aten.permute.default(t, st[1])
        if kind == "transpose":
            return aten.transpose.int(t, st[1], st[2])
        if kind == "slice":
            return aten.slice.Tensor(t, st[1], st[2], st[3])
        if kind == "select":
            return aten.select.int(t, st[1], st[2])
        if kind == "unsqueeze":
            return aten.unsqueeze.default(t, st[1])
        return aten.expand.default(t, st[1])

    def pad_step(t):
        pads = []
        for d in range(t.dim()):
            lo, hi = rng.randint(-1, 2), rng.randint(-1, 2)
            lo, hi = max(lo, -t.shape[d] + 1), max(hi, -t.shape[d] + 1 - lo)  # every dim at least 1 long
            pads = [lo, hi] + pads
        return ("pad", pads, rng.choice([0.0, 1.5, float("-inf")]))

    def view_step(t):
        n, shape = t.dim(), list(t.shape)
        kind = rng.choice(["merge", "split", "permute", "transpose", "slice", "select", "unsqueeze", "expand"])
        if kind == "merge" and n >= 2:
            d = rng.randrange(n - 1)
            return ("view", shape[:d] + [shape[d] * shape[d + 1]] + shape[d + 2:])
        if kind == "split" and n < 5:
            d = rng.randrange(n)
            k = next((k for k in (2, 3) if shape[d] % k == 0), shape[d])
            return ("view", shape[:d] + [k, shape[d] // k] + shape[d + 1:])
        if kind == "permute":
            perm = list(range(n))
            rng.shuffle(perm)
            return ("permute", perm)
        if kind == "transpose" and n >= 2:
            return ("transpose", *rng.sample(range(n), 2))
        if kind == "slice":
            d = rng.randrange(n)
            lo = rng.randrange(shape[d])
            return ("slice", d, lo, rng.randint(lo + 1, shape[d]))
        if kind == "select" and n >= 2:
            d = rng.randrange(n)
            return ("select", d, rng.randrange(shape[d]))
        if kind == "expand" and 1 in shape:
            shape[shape.index(1)] = 3
            return ("expand", shape)
        return ("unsqueeze", rng.randint(0, n)) if n < 5 else ("permute", list(range(n))[::-1])

    first = ("pad0",) + pad_step(x)[1:]
    steps.append(first)
    t = aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), first[1], first[2])
    for _ in range(rng.randint(1, 3)):
        for _ in range(rng.randint(1, 3)):
            st = view_step(t)
            try:
                t2 = apply(t, st)
            except RuntimeError:  # not a view of this layout: left out
                continue
            steps.append(st)
            t = t2
        if rng.random() < 0.3:
            d = rng.randrange(t.dim())
            grow = rng.randint(0, 2)
            shape = list(t.shape)
            shape[d] += grow
            bases.append(torch.randn(*shape, generator=gen).to(dtype))
            st = ("scatter", d, rng.randint(0, grow), len(bases) - 1)
            t = apply(t, st, bases[-1])
        elif rng.random() < 0.3 and not any(st[0] == "clone" for st in steps):  # a copy: a window padding nothing
            # (not a copy of a copy: csrc/sink.c makes that one copy over a finer shape, viewed back)
            st = ("clone",)
            t = apply(t, st)
        else:
            st = pad_step(t)
            t = apply(t, st)
        steps.append(st)

    def f(x, *bases):
        t = None
        for st in steps:
            if st[0] == "pad0":
                t = aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), st[1], st[2])
            else:
                t = apply(t, st, bases[st[3]] if st[0] == "scatter" else None)
        return (aten.add.Tensor(t, 1.0),)

    return f, (x, *bases), f"{list(x.shape)} {dtype} -> {steps}"


@pytest.mark.parametrize("seed", range(60))
def test_random_windows_read_through_views_match_eager_exactly(seed):
    """Traced from fake tensors (as AOTAutograd traces), the metadata is ATen's: one kernel. make_fx's
    real mode records a slice's storage offset as 0: the links that disagree with ATen's rule are
    not remapped (fuse.c trusts no metadata it cannot check; a kernel reading such a view as an
    input falls back to ATen's ops at run time), and the values stay eager's."""
    f, args, what = random_remapped_window_graph(seed)
    (ref,) = f(*args)
    for mode in ("fake", "real"):
        lowered = lower(make_fx(f, tracing_mode=mode)(*args))
        (got,) = lowered(list(args))
        assert got.shape == ref.shape and got.dtype == ref.dtype, what
        assert_close(got, ref, f"{what} ({mode})", atol=0, rtol=0)
        if mode == "fake":  # (real mode: a kernel reading such a view falls back to ATen's ops)
            assert lowered.program.num_kernels == 1, (what, str(lowered.program))
            assert lowered.program.kernel_fallbacks == 0, what


def random_view_read_graph(seed: int):
    """A seeded random graph of a pointwise value read through a random chain of views (permute,
    transpose, slice, unsqueeze/squeeze, expand, reshape: a view where the layout allows, else
    a copy) by a pointwise reader, whose result an extern (mm) or the graph reads: what csrc/sink.c
    rewrites as copies, reads and split readers. Exact ops only (mul, add, neg), so the values are
    eager's to the bit."""
    rng = random.Random(seed)
    nd = rng.randint(2, 4)
    shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(nd)]
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=gen)
    b = torch.randn(shape[-1], generator=gen)
    steps = []
    cur = list(shape)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["permute", "transpose", "slice", "unsqueeze", "expand", "reshape"])
        if kind == "permute":
            perm = list(range(len(cur)))
            rng.shuffle(perm)
            steps.append(("permute", perm))
            cur = [cur[p] for p in perm]
        elif kind == "transpose" and len(cur) >= 2:
            d0, d1 = rng.sample(range(len(cur)), 2)
            steps.append(("transpose", d0, d1))
            cur[d0], cur[d1] = cur[d1], cur[d0]
        elif kind == "slice":
            d = rng.randrange(len(cur))
            lo = rng.randrange(cur[d])
            steps.append(("slice", d, lo))
            cur[d] -= lo
        elif kind == "unsqueeze" and len(cur) < 5:
            d = rng.randint(0, len(cur))
            steps.append(("unsqueeze", d))
            cur.insert(d, 1)
        elif kind == "expand" and 1 in cur:
            d = cur.index(1)
            steps.append(("expand", d, 3))
            cur[d] = 3
        elif kind == "reshape" and len(cur) >= 2:
            steps.append(("reshape", [cur[0] * cur[1]] + cur[2:]))
            cur = [cur[0] * cur[1]] + cur[2:]
    c = torch.randn(*cur, generator=gen)
    to_mm = rng.random() < 0.5
    w = torch.randn(cur[-1], 3, generator=gen)

    def f(a, b, c, w):
        v = -(a * 1.5 + b)
        for st in steps:
            if st[0] == "permute":
                v = v.permute(st[1])
            elif st[0] == "transpose":
                v = v.transpose(st[1], st[2])
            elif st[0] == "slice":
                v = v.narrow(st[1], st[2], v.shape[st[1]] - st[2])
            elif st[0] == "unsqueeze":
                v = v.unsqueeze(st[1])
            elif st[0] == "expand":
                sizes = list(v.shape)
                sizes[st[1]] = st[2]
                v = v.expand(sizes)
            else:
                v = v.reshape(st[1])
        y = v + c
        return (torch.mm(y.reshape(-1, y.shape[-1]), w),) if to_mm else (y * 0.5,)

    return f, (a, b, c, w), f"{shape} -> {steps} -> {'mm' if to_mm else 'scale'}"


@pytest.mark.parametrize("seed", range(40))
def test_random_view_reads_match_eager_exactly(seed):
    """Random views of a pointwise value read by a pointwise member (csrc/sink.c's copies, reads and
    split readers): eager's values to the bit, with the reads on and off."""
    f, args, what = random_view_read_graph(seed)
    (ref,) = f(*args)
    for reads in ("1", "0"):
        os.environ["AOTFUSE_SINK_READS"] = reads
        try:
            lowered = lower(make_fx(f, tracing_mode="fake")(*args))
        finally:
            os.environ.pop("AOTFUSE_SINK_READS")
        (got,) = lowered(list(args))
        assert got.shape == ref.shape, what
        assert_close(got, ref, f"{what} (reads {reads})", atol=0, rtol=0)
        assert lowered.program.kernel_fallbacks == 0, what


def _windows_of_a_scaled_projection(proj, bias):
    """Longformer's query chunking: a projection plus its bias, scaled (pointwise), split into heads
    (views), cut into overlapping windows (as_strided) and copied for a bmm; and a plain transpose
    copy of the same kind beside it (the heads of a second projection)."""
    q = (proj.view(16, 2, 32) + bias) / 4.0
    q = q.view(16, 2, 2, 16).transpose(0, 1).transpose(1, 2).reshape(4, 16, 16).view(4, 4, 4, 16)
    stride = list(q.stride())
    stride[1] //= 2
    chunks = q.as_strided((4, 7, 4, 16), stride).contiguous().view(28, 4, 16)
    k = (proj.view(16, 2, 32) * bias).tanh().transpose(0, 1).contiguous()
    return torch.bmm(chunks, chunks.transpose(1, 2)), k.view(2, 16, 2, 16).sum(-1)


@pytest.mark.parametrize("sink", [True, False])
def test_a_copy_of_a_view_of_a_pointwise_value_is_computed_from_its_sources(sink, monkeypatch):
    """A copy of overlapping windows of (proj + bias) / 4 (and one of a transposed tanh) is computed
    from proj and bias through one as_strided view each (csrc/sink.c), in one kernel with the
    pointwise nodes, instead of a kernel storing the value and a kernel copying its windows; the
    values match eager and float64 (AOTFUSE_SINK_COPIES=0: the kernels as before)."""
    monkeypatch.setenv("AOTFUSE_SINK_COPIES", "1" if sink else "0")
    gen = torch.Generator().manual_seed(11)
    args = [torch.randn(32, 32, generator=gen), torch.randn(32, generator=gen)]
    gm = make_fx(_windows_of_a_scaled_projection)(*args)
    lowered = lower(gm)
    assert lowered.program.copies_sunk == (2 if sink else 0)
    # with the copies computed from the sources: the windows' kernel and the tanh's (with its sum);
    # without: the scaled value's kernel, its windows' copy, the tanh's and its transposed copy's
    assert lowered.program.num_kernels == (2 if sink else 4), str(lowered.program)
    assert "aten::clone" not in str(lowered.program) if sink else "aten::clone" in str(lowered.program)
    ref = _windows_of_a_scaled_projection(*args)
    exact = _windows_of_a_scaled_projection(*[t.double() for t in args])
    for _ in range(2):
        for name, o, r, e in zip(("scores", "heads"), lowered(list(args)), ref, exact):
            assert_close(o, r, name)
            assert (o.double() - e).abs().max() <= 4 * (r.double() - e).abs().max() + 1e-5, name
    assert lowered.program.kernel_fallbacks == 0


def test_copies_of_views_in_emulated_cuda_kernels():
    """The CUDA kernels computing the copies from their sources (the graph a CUDA program runs,
    which the emulation plans too), run in the host emulation: eager's values, in two kernels of
    two pointwise nodes each (no lone copy)."""
    import cuda_emu

    if cuda_emu.unavailable():
        pytest.skip(cuda_emu.unavailable())
    gen = torch.Generator().manual_seed(13)
    args = (torch.randn(32, 32, generator=gen), torch.randn(32, generator=gen))
    gm = make_fx(_windows_of_a_scaled_projection)(*args)
    ran = cuda_emu.check(gm, args, "copies of views computed from their sources")
    assert [(l["kind"], l["nodes"]) for l in ran] == [("pointwise", 2), ("pointwise", 2)], ran


def _reads_of_views(g, a, b):
    """Longformer's backward in small: a permuted copy of an extern's result, read by an add through
    a reshape that merges the copy's dims (its reader, which only an extern reads, is computed over
    the finer shape); a transposed pointwise value read by a mul (at its own shape); a pad of a
    copy of a crop (the pad reads the crop)."""
    x = torch.mm(g, a)
    c = x.view(2, 16, 2, 16).permute(0, 2, 1, 3).contiguous()
    y = c.view(4, 8, 2, 16) + b.view(4, 8, 2, 16)
    z = torch.mm(y.view(64, 16), a[:16, :16])
    t = (g * 2).t() * a
    p = torch.nn.functional.pad(z[:, 2:10].clone(), (1, 1))
    return z, t, p


@pytest.mark.parametrize("reads", [True, False])
def test_kernel_members_reads_of_views_are_computed_from_their_sources(reads, monkeypatch):
    """Kernel members reading a view of a pointwise value that nothing else needs compute it from
    its sources themselves (csrc/sink.c, reads): the copy, the doubled value and the crop's copy
    are not made (3 kernels against 5 with AOTFUSE_SINK_READS=0); values match eager and
    float64."""
    monkeypatch.setenv("AOTFUSE_SINK_READS", "1" if reads else "0")
    gen = torch.Generator().manual_seed(14)
    args = [torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen), torch.randn(1024, generator=gen)]
    lowered = lower(make_fx(_reads_of_views, tracing_mode="fake")(*args))
    # without the reads: the copy, the add, the doubled value, the mul, and the pad (computing the
    # crop's copy in its kernel, as a shifted member)
    assert (lowered.program.copies_sunk, lowered.program.num_kernels) == ((3, 3) if reads else (0, 5)), str(lowered.program)
    ref = _reads_of_views(*args)
    exact = _reads_of_views(*[t.double() for t in args])
    for _ in range(2):
        for name, o, r, e in zip(("mm", "transposed", "padded"), lowered(list(args)), ref, exact):
            assert_close(o, r, name)
            assert (o.double() - e).abs().max() <= 4 * (r.double() - e).abs().max() + 1e-5, name
    assert lowered.program.kernel_fallbacks == 0


def _box_of_a_merged_view(a, w):
    """Longformer's zeroed corners in small: box_fill of a view that merges the dims of a pointwise
    value (row 2, columns 1-3: inside one step of the merged dim's outer piece), then an extern."""
    import aotfuse.scatter  # noqa: F401  (registers aotfuse::box_fill)

    v = (a * 1.5 - 1.0).permute(1, 0, 2).reshape(6, 4)
    return (torch.mm(torch.ops.aotfuse.box_fill(v, [2, 1], [1, 3], 0.0), w),)


@pytest.mark.parametrize("reads", [True, False])
def test_a_box_fill_of_a_merged_view_is_computed_over_the_finer_shape(reads, monkeypatch):
    """The box fill reads the value through a view that merges its dims: with the reads on it runs
    over the finer shape, its box cut onto it, computing the value from its source (one kernel
    against two); eager's values and float64's."""
    monkeypatch.setenv("AOTFUSE_SINK_READS", "1" if reads else "0")
    gen = torch.Generator().manual_seed(17)
    args = [torch.randn(3, 2, 4, generator=gen), torch.randn(4, 5, generator=gen)]
    lowered = lower(make_fx(_box_of_a_merged_view, tracing_mode="fake")(*args))
    assert lowered.program.num_kernels == (1 if reads else 2), str(lowered.program)
    (got,), (ref,) = lowered(list(args)), _box_of_a_merged_view(*args)
    (exact,) = _box_of_a_merged_view(*[t.double() for t in args])
    assert_close(got, ref, "a box fill of a merged view")
    assert (got.double() - exact).abs().max() <= 4 * (ref.double() - exact).abs().max() + 1e-5
    assert lowered.program.kernel_fallbacks == 0


def test_reads_of_views_in_emulated_cuda_kernels():
    """The same reads in CUDA kernels (the graph a CUDA program runs), run in the host emulation:
    eager's values from three kernels; and the box fill over the finer shape, one kernel."""
    import cuda_emu

    if cuda_emu.unavailable():
        pytest.skip(cuda_emu.unavailable())
    gen = torch.Generator().manual_seed(15)
    args = (torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen), torch.randn(1024, generator=gen))
    ran = cuda_emu.check(make_fx(_reads_of_views, tracing_mode="fake")(*args), args, "reads of views computed from their sources")
    assert sorted(l["nodes"] for l in ran) == [1, 2, 2], ran
    args = (torch.randn(3, 2, 4, generator=gen), torch.randn(4, 5, generator=gen))
    ran = cuda_emu.check(make_fx(_box_of_a_merged_view, tracing_mode="fake")(*args), args, "a box fill over the finer shape")
    assert len(ran) == 1, ran


def test_a_sunk_copy_reads_sources_whose_layout_is_checked():
    """A copy computed from its sources reads them through as_strided views, which take the graph's
    layout of each source as given (also where the kernel falls back to ATen calls): so the sources
    are ones whose layout the program checks, like this graph input, and an input of another
    layout is refused with the layout in the error, never read wrongly."""
    gen = torch.Generator().manual_seed(12)
    args = [torch.randn(32, 32, generator=gen), torch.randn(32, generator=gen)]
    gm = make_fx(_windows_of_a_scaled_projection)(*args)
    lowered = lower(gm)
    assert lowered.program.copies_sunk == 2
    with pytest.raises(Exception, match="stride|layout"):  # an input of another layout is refused
        lowered([args[0].t().contiguous().t(), args[1]])
    ref = _windows_of_a_scaled_projection(*args)
    for name, o, r in zip(("scores", "heads"), lowered(list(args)), ref):
        assert_close(o, r, name)


def test_exp_is_accurate_and_keeps_special_values():
    """af_exp (the C prelude's polynomial, special values from its arithmetic, no selects): within 2
    ulps of the exact value over a sweep of the normal range, ATen's value for infinities, NaN and the
    overflow edge, and below about -87 ATen's subnormal values to a subnormal step (0 there before
    2026-12-04: test_exp_gives_subnormal_results_as_expf_does)."""
    sweep = torch.linspace(-86.9, 88.72, 200_003, dtype=torch.float64).float()
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 88.7228, 88.72283, 88.722839, 89.0, 89.1, 100.0,
                             1e30, -1e30, 0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 1.0])
    flushed = torch.tensor([-87.0, -87.3, -87.31, -88.0, -100.0, -103.0, -104.0])
    every = torch.cat([sweep, specials, flushed])
    out = lower(make_fx(lambda x: torch.exp(x * 1.0))(every))([every])[0]
    got, got_s, got_f = out.split([len(sweep), len(specials), len(flushed)])
    exact = torch.exp(sweep.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs()  # an ulp of the result (2^-23 of it: at most two of its own)
    err = ((got.double() - exact).abs() / ulp).max().item()
    assert err <= 2.0, f"exp: {err:.2f} ulps from the exact value"
    ref_s = torch.exp(specials)
    assert torch.equal(got_s.isnan(), ref_s.isnan()), (got_s, ref_s)
    keep = ~ref_s.isnan()
    assert torch.equal(got_s[keep].isinf(), ref_s[keep].isinf()), (got_s, ref_s)
    assert_close(got_s[keep], ref_s[keep], "exp of special values", atol=0, rtol=2.5e-7)
    ref_f = torch.exp(flushed)
    assert ((got_f - ref_f).abs() <= torch.maximum(ref_f * 2.5e-7, torch.tensor(1.5e-45))).all(), (got_f, ref_f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_transposed_operand_read_at_a_power_of_two_stride_vectorizes(dtype, tmp_path):
    """GCC 12 keeps a loop scalar where one of its loads steps by a constant power of two of 64 bytes
    or more (attention's k gradient read back transposed: 128 elements). The kernel reads such a
    stride, 64 to 512 bytes, from a variable the compiler cannot see through (AF_OPAQUE): the loop
    vectorizes (GCC's report, with the JIT's flags), with eager's values to the bit; a 2 KB stride
    keeps its constant (gathers there measured no faster than the scalar loop)."""
    import shutil

    gcc = shutil.which("gcc")
    g = torch.Generator().manual_seed(4)
    a, b, d = (torch.randn(4, 4, 128, 64, generator=g).to(dtype) for _ in range(3))
    k = torch.randn(4, 4, 64, 128, generator=g).to(dtype)

    def fn(a, b, k, d):
        return ((a + b) + k.transpose(-1, -2) * d,)

    low = lower(make_fx(fn, tracing_mode="fake")(a, b, k, d))
    src = low.program.source
    assert "af_st2 = 128; AF_OPAQUE(af_st2);" in src and "i * af_st2;" in src, src[-2500:]
    assert torch.equal(low([a, b, k, d])[0], fn(a, b, k, d)[0])
    wide = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
    far = lower(make_fx(lambda x, y: (x * y.t(),), tracing_mode="fake")(wide, wide)).program.source
    assert "AF_OPAQUE(af_st" not in far and "i * 1024;" in far, far[-1500:]
    if not gcc or platform.machine() != "x86_64":
        pytest.skip("the vectorizer's report needs GCC on x86-64")
    c = tmp_path / "kernel.c"
    c.write_text(src)
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("erf_check", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "erf_check.py")
    erf_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(erf_check)  # the JIT's flags (csrc/jit_cpu.c's base_flags)
    report = subprocess.run([gcc, *erf_check.jit_flags(), "-mprefer-vector-width=512", "-fopenmp", "-fopt-info-vec-optimized", "-c", str(c),
                             "-o", str(tmp_path / "k.o")], capture_output=True, text=True, check=True).stderr
    loop = next(i for i, line in enumerate(src.splitlines(), 1) if "for (af_idx i = 0; i < 64; i++)" in line)
    assert re.search(rf"kernel\.c:{loop}:\d+: optimized: loop vectorized", report), report


def test_exp_of_a_nonpositive_argument_keeps_af_exps_bits():
    """An exp whose argument is never above 0 (codegen_common.c's value_sign) calls af_exp_nonpos, the
    prelude's exp without the overflow side (one clamp, 2^n in one normal factor and one rounding
    product): a negated square, a softmax's x - amax(x) and GELU's backward. Its bits are af_exp's for
    every argument (benchmarks/exp_check.py checks every float): here exp(-(x * x)) against af_exp of
    the same -(x * x) made by torch, over the subnormal results, 0, -0.0, -inf and NaN."""
    x = torch.cat([torch.linspace(-10.5, 10.5, 300_001), torch.tensor([0.0, -0.0, 1e-30, 14.0, 1e20, float("inf"),
                                                                        float("-inf"), float("nan")])])
    neg_square = lower(make_fx(lambda x: torch.exp(-(x * x)))(x))
    plain = lower(make_fx(lambda z: torch.exp(z * 1.0))(x))
    assert "= af_exp_nonpos(v" in neg_square.program.source and "= af_exp(v" not in neg_square.program.source
    assert "= af_exp(v" in plain.program.source and "af_exp_nonpos(v" not in plain.program.source
    z = -(x * x)
    assert (z < -87.4).sum() > 1000 and (z < -103.9).sum() > 0  # subnormal results, and 0 below
    got, want = neg_square([x])[0], plain([z])[0]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    from aotfuse.decompositions import default_decompositions

    table = default_decompositions(norms=True)
    rows = torch.randn(16, 300) * 30
    rows[3, 7], rows[5] = float("nan"), float("-inf")  # a NaN row and a row of -inf: NaN, as ATen's
    soft = lower(make_fx(lambda r: torch.softmax(r, -1), decomposition_table=table)(rows))
    assert "= af_exp_nonpos(v" in soft.program.source and "= af_exp(v" not in soft.program.source
    out, ref = soft([rows])[0], torch.softmax(rows, -1)
    assert torch.equal(out.isnan(), ref.isnan())
    assert_close(out[~ref.isnan()], ref[~ref.isnan()], "softmax", atol=1e-9, rtol=1e-6)
    g, h = torch.randn(64, 128), torch.randn(64, 128) * 4
    gelu_bw = lower(make_fx(lambda g, h: aten.gelu_backward(g, h), decomposition_table=table)(g, h))
    assert "= af_exp_nonpos(v" in gelu_bw.program.source
    assert_close(gelu_bw([g, h])[0], aten.gelu_backward(g, h), "gelu_backward", atol=1e-6, rtol=1e-5)


def _same_special_values(got, ref, what):
    """NaN where ref is NaN, elsewhere ref's values within 2.5e-7 relative and its signs (of zeros too)."""
    assert torch.equal(got.isnan(), ref.isnan()), (what, got, ref)
    keep = ~ref.isnan()
    assert_close(got[keep], ref[keep], what, atol=0, rtol=2.5e-7)
    assert torch.equal(torch.signbit(got[keep]), torch.signbit(ref[keep])), (what, got, ref)


def _check_unary_kernel(op, exact_op, sweep, specials, name):
    """op lowered into a kernel (`op(x * 1.0)`): within 2.5e-7 of exact_op's float64 value relative to
    it over sweep (0 where that is 0), and op's ATen values at the specials (_same_special_values)."""
    every = torch.cat([sweep, specials])
    out = lower(make_fx(lambda x: op(x * 1.0))(every))([every])[0]
    got, got_s = out.split([len(sweep), len(specials)])
    exact = exact_op(sweep.double())
    nonzero = exact != 0
    rel = ((got.double() - exact).abs()[nonzero] / exact.abs()[nonzero]).max().item()
    assert rel <= 2.5e-7, f"{name}: relative error {rel:.3g}"
    assert got[~nonzero].eq(0).all()
    _same_special_values(got_s, op(specials), f"{name} of special values")


def test_erf_is_accurate_and_keeps_special_values():
    """af_erf (Taylor below 0.5, exp(-a^2 - h(a)) with a fitted polynomial h above, no division): within
    2.5e-7 of the exact value relative to it over [-6, 6], the signs of zeros, +-1 at the infinities,
    NaN for NaN."""
    sweep = torch.linspace(-6.0, 6.0, 400_001, dtype=torch.float64).float()
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 0.5, -0.5, 3.93, -3.93,
                             1e-30, -1e-30, 1e30, -1e30])
    _check_unary_kernel(torch.erf, torch.special.erf, sweep, specials, "erf")


def test_erf1p_is_within_1_5e_7_of_one_plus_erf_and_keeps_special_values(monkeypatch):
    """af_erf1p (1 + erf: 2 - erfc(|x|) at x >= 0, erfc(|x|) below, erfc from one fitted exponential)
    within 1.5e-7 of 1 + erf in float64 over [-6, 6] (1.42e-7 at most over every float), to 1% of it
    where it is above 1e-6 on the negative side (where 1 + af_erf cancels: checked worse below),
    2 and 0 at +-inf, NaN for NaN, and both sides of the join at +-3.93."""
    sweep = torch.linspace(-6.0, 6.0, 400_001, dtype=torch.float64).float()
    joins = 3.93 + torch.tensor([-2, -1, 0, 1, 2]) * 3.93 * 2**-23
    every = torch.cat([sweep, joins, -joins])
    exact = 1 + torch.special.erf(every.double())
    got = lower(make_fx(lambda x: torch.ops.aotfuse.erf1p(x * 1.0))(every))([every])[0]
    err = (got.double() - exact).abs()
    assert err.max().item() <= 1.5e-7, f"erf1p: absolute error {err.max().item():.3g} at {every[err.argmax()].item()}"
    tail = (every < -0.5) & (exact > 1e-6)
    rel = (err[tail] / exact[tail]).max().item()
    assert rel <= 0.01, f"erf1p: relative error {rel:.3g} in the negative tail"
    # the two ops it replaces (kept as two with the switch off) lose that tail to cancellation
    monkeypatch.setenv("AOTFUSE_ERF1P", "0")
    two = lower(make_fx(lambda x: aten.add.Tensor(torch.erf(x * 1.0), 1))(every))([every])[0]
    assert ((two.double() - exact).abs()[tail] / exact[tail]).max().item() > 2 * rel
    monkeypatch.delenv("AOTFUSE_ERF1P")
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30])
    got_s = lower(make_fx(lambda x: torch.ops.aotfuse.erf1p(x * 1.0))(specials))([specials])[0]
    want = 1 + torch.special.erf(specials.double())
    assert torch.equal(got_s.isnan(), want.isnan()), got_s
    keep = ~want.isnan()
    assert (got_s[keep].double() - want[keep]).abs().max().item() <= 1.5e-7, got_s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelus_erf_plus_one_is_one_kernel_expression(dtype, monkeypatch):
    """An exact GELU's forward and backward lowered with `erf(x) + 1` as aotfuse::erf1p (no erf left),
    values and gradients as eager's within the dtype's tolerance and as near float64's as eager is;
    AOTFUSE_ERF1P=0 keeps erf."""
    torch.manual_seed(0)
    x = (torch.randn(16, 64) * 3).to(dtype)
    w = torch.randn(64, dtype=torch.float64)

    def f(x, w):
        return (F.gelu(x) * w.to(x.dtype)).sum()

    def run(flag):
        monkeypatch.setenv("AOTFUSE_ERF1P", flag)
        xx = x.clone().requires_grad_()
        fn = aotfuse.memory_efficient_fusion(f)
        fn(xx, w).backward()
        ops = [op for low in fn.records[-1].programs.values() for op, _k, _g in low.program.node_groups()]
        return xx.grad, " ".join(ops)

    g1, ops1 = run("1")
    _, ops0 = run("0")
    xe = x.clone().requires_grad_()
    f(xe, w).backward()
    x64 = x.double().requires_grad_()
    (F.gelu(x64) * w).sum().backward()
    atol, rtol = TOL[dtype]
    assert_close(g1, xe.grad, f"GELU {dtype} input gradient", atol=atol, rtol=rtol)
    far = (g1.double() - x64.grad).abs().max().item()
    eager_far = (xe.grad.double() - x64.grad).abs().max().item()
    assert far <= 4 * eager_far + 1e-7, (dtype, far, eager_far)
    assert ops1.count("aotfuse::erf1p") >= 2 and "aten::erf." not in ops1, ops1  # forward and backward
    assert "aten::erf." in ops0 and "aotfuse::erf1p" not in ops0, ops0


@pytest.mark.parametrize("env", [{"AOTFUSE_FUSION": "0"}, {"AOTFUSE_BACKEND": "cuda"}], ids=["no-kernels", "cuda-only"])
def test_erf_plus_one_stays_two_aten_ops_where_no_kernel_computes_it(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x = torch.randn(64)
    lowered = lower(make_fx(lambda x: aten.add.Tensor(torch.erf(x * 1.0), 1), tracing_mode="fake")(x))
    ops = [op for op, _k, _g in lowered.program.node_groups()]
    assert any(op.startswith("aten::erf") for op in ops) and not any("erf1p" in op for op in ops), ops
    torch.testing.assert_close(lowered([x])[0], torch.erf(x) + 1)


def test_tanh_is_accurate_and_keeps_special_values():
    """af_tanh (Taylor below 0.3, 1 - 2 / (exp(2|x|) + 1) above through af_exp_normal, 1 from 9 up):
    within 2.5e-7 of the exact value relative to it over [-12, 12], both sides of its two joins, the
    signs of zeros, +-1 at the infinities, NaN for NaN. af_exp_normal (2026-12-05) gave the same bits
    as the af_exp call it replaced for every float."""
    sweep = torch.linspace(-12.0, 12.0, 400_001, dtype=torch.float64).float()
    joins = torch.tensor([0.3, 9.0]).repeat_interleave(5) + torch.tensor([-2, -1, 0, 1, 2]).repeat(2) * torch.tensor(
        [0.3, 9.0]).repeat_interleave(5) * 2**-23
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30])
    _check_unary_kernel(torch.tanh, torch.tanh, torch.cat([sweep, joins, -joins]), specials, "tanh")


def test_pow_keeps_atens_special_values_for_scalar_and_tensor_exponents():
    """ATen takes a scalar exponent's special cases (0.5 as sqrt, -0.5 as rsqrt, -2 as 1/(x*x)) and
    a tensor's exponents through pow itself: pow(-inf, 0.5) is inf for a tensor exponent, NaN for a
    scalar one. The kernels' pow used sqrt for a tensor's 0.5 too (NaN, and -0 for -0), and pow for
    -0.5 (0 at -inf where rsqrt gives NaN: x.pow(0.5)'s gradient there)."""
    x = torch.tensor([float("-inf"), -0.0, 0.0, 4.0, -4.0, float("inf"), float("nan"), 0.3, -2.5, 7.0])

    same = _same_special_values
    for e in (0.5, -0.5, 2.0, 3.0, -1.0, -2.0, 1.3, 0.0):
        exps = torch.full_like(x, e)
        same(lower(make_fx(lambda a, b: torch.pow(a * 1.0, b))(x, exps))([x, exps])[0], torch.pow(x, exps),
             f"pow(x, tensor of {e})")
        same(lower(make_fx(lambda a: torch.pow(a * 1.0, e))(x))([x])[0], torch.pow(x, e), f"pow(x, {e})")


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_gradient_keeps_nan_like_aten(dtype, eps):
    """logit's backward with eps: ATen gives 0 outside [eps, 1 - eps] and NaN for a NaN input; torch's
    decomposition tested `lo <= x <= hi` and gave 0 for NaN (Inductor too). aotfuse's own
    decomposition keeps ATen's NaN."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 0.3, 0.7, 1.0, 2.0, 1e-4], dtype=dtype)

    def f(a):
        return torch.logit(a * 1.0, eps=eps) * 2.0

    a, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    (g,) = torch.autograd.grad(aotfuse.aot_function(f)(a).sum(), a)
    (r,) = torch.autograd.grad(f(ref).sum(), ref)
    assert torch.equal(g.isnan(), r.isnan()), (g, r)
    keep = ~r.isnan()
    assert_close(g[keep], r[keep], f"logit gradient ({dtype}, eps {eps})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_divides_rows_by_one_reciprocal(dtype, monkeypatch):
    """A phased kernel dividing a later phase's elements by a row value (softmax's sum) multiplies by
    the value's reciprocal, computed once a row: the source says so, and the result is as close to
    float64's as eager's within two ulps, masked (-inf) entries exactly 0."""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    from aotfuse.decompositions import default_decompositions

    x = torch.randn(64, 200) * 4
    x[3, :150] = float("-inf")  # a masked row
    x = x.to(dtype)
    f = lambda x: torch.softmax(x, -1)
    low = lower(make_fx(f, decomposition_table=default_decompositions(norms=True))(x))
    src = low.program.source
    assert re.search(r"const float rc(\d+) = 1\.0f / v\1;", src) and "by the reciprocal" in src, src
    got = low([x])[0]
    ref = torch.softmax(x.double(), -1)
    assert torch.equal(got[3, :150], torch.zeros_like(got[3, :150]))
    if dtype == torch.float32:  # exp's argument x - max carries its rounding, as eager's does
        rel = lambda t: ((t.double() - ref).abs() / ref.clamp_min(1e-30)).max().item()
        ours, eager = rel(got), rel(f(x))
        assert ours <= eager + 2 * torch.finfo(torch.float32).eps, f"softmax float32: relative error {ours:.3g}, eager's {eager:.3g}"
    else:  # the eager bf16 softmax rounds once at the end, as the kernel does
        assert_close(got.float(), f(x).float(), "softmax bfloat16", atol=0, rtol=2 ** -7)
    # rc<id> is named by a node id, as v<id> is: two softmaxes of one shape still share one body
    y = torch.randn(64, 64, dtype=dtype)
    two = lower(make_fx(lambda y: torch.softmax(torch.softmax(y, -1) @ y, -1),
                        decomposition_table=default_decompositions(norms=True))(y))
    assert two.program.num_kernels == 2 and two.program.source.count("AF_BODY void") == 1, two.program.source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rounding_in_kernels_matches_eager_bit_for_bit(dtype):
    """A float32 value rounded to bf16/f16 in a kernel (af_bf16_round/af_f16_round, in 32-bit lanes)
    and a rounded bf16 value stored as its upper half (af_bf16_bits) give eager's bits: every upper
    half of a float32 with lower halves at the rounding boundaries (ties to even, just above and below,
    f16's 13-bit boundary and subnormals included), infinities, overflow to infinity; NaN stays NaN."""
    hi = torch.arange(-32768, 32768, dtype=torch.int32).mul(65536)
    lows = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    x = (hi[:, None] | lows[None, :]).reshape(-1).view(torch.float32)
    for f, what in ((lambda x: (x * 1.0).to(dtype), "rounded and stored"),
                    (lambda x: (x * 1.0).to(dtype) * 3, "rounded, multiplied, rounded, stored")):
        low = lower(make_fx(f)(x))
        src = low.program.source
        name = "bf16" if dtype == torch.bfloat16 else "f16"
        assert f"af_{name}_round(" in src and f"af_{name}_load(af_{name}_store(" not in src, src
        if dtype == torch.bfloat16:
            assert "af_bf16_bits(" in src, src
        got, ref = low([x])[0], f(x)
        assert torch.equal(got.isnan(), ref.isnan()), f"{dtype} {what}: NaN where eager has none, or none where it has"
        keep = ~ref.isnan()
        bad = (got[keep].view(torch.int16) != ref[keep].view(torch.int16)).nonzero()
        assert bad.numel() == 0, (f"{dtype} {what}: {bad.numel()} of {int(keep.sum())} values differ from eager's, "
                                  f"first at x = {x[keep][bad[0]].item()!r}")


def test_every_half_loads_and_stores_as_eager_converts_it_without_branches():
    """fp16 loads and stores in C kernels are branch-free, so that loops over fp16 tensors vectorize
    (a GPT2 fp16 GELU backward kernel: 35 -> 4.7 ms; its training step went from 140% to 92% of
    eager's): every one of the 2^16 halves (subnormals, infinities, NaNs) loads as eager converts it,
    and stores back to its own bits."""
    h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    f = lambda h: (h.float() * 1.0, (h.float() * 1.0).to(torch.float16))
    low = lower(make_fx(f)(h))
    src = low.program.source
    for fn in ("af_f16_load", "af_f16_store"):
        body = src[src.index(f"AF_INLINE {'float' if fn == 'af_f16_load' else 'uint16_t'} {fn}("):]
        body = body[:body.index("\n}\n")]
        assert "if (" not in body, body
    loaded, stored = low([h])
    ref_loaded, ref_stored = f(h)
    nan = ref_loaded.isnan()
    assert torch.equal(loaded.isnan(), nan) and torch.equal(stored.isnan(), nan)
    assert torch.equal(loaded[~nan].view(torch.int32), ref_loaded[~nan].view(torch.int32))
    assert torch.equal(stored[~nan].view(torch.int16), h[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_windows_fill_is_the_value_its_dtype_holds(dtype):
    """A pad of a bf16/f16 tensor with 0.1 holds 0.1 as the dtype rounds it (0.10009765625 in bf16),
    also where the kernel reads the padded value on in float (found by a review: it used 0.1 itself)."""
    x = torch.randn(8, 30).to(dtype)
    f = lambda x: torch.nn.functional.pad(x, (1, 2), value=0.1).float() * 3.0
    got = lower(make_fx(f)(x))([x])[0]
    assert torch.equal(got, f(x)), (got[:, 0], f(x)[:, 0])


def _kernel_text(src: str, index: int) -> str:
    """Kernel `index`'s text in a program's C source: from its group comment to the next one."""
    start = src.index(f"/* group {index}: ")
    nxt = src.find("/* group ", start + 1)
    return src[start:nxt if nxt >= 0 else len(src)]


def _inner_loops(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"for \(af_idx i = (\d+); i < (\d+); i\+\+\)", text)]


def _padded_rows(x, y):
    return (aten.add.Tensor(aten.constant_pad_nd.default(aten.mul.Tensor(aten.add.Tensor(x, 0.5), y), [3, 5], -1.0), 1.0),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_padded_rows_inside_is_a_loop_without_branches(dtype):
    """A pad along the rows splits the kernel's inner loop where its guard changes: the left pad,
    the inside (the guard holds throughout: no comparison, and no AF_GUARDED_LOADS, so it
    vectorizes), the right pad (the fill alone, the source not even computed). Eager's values."""
    gen = torch.Generator().manual_seed(31)
    x, y = torch.randn(4, 37, generator=gen).to(dtype), torch.randn(37, generator=gen).to(dtype)
    lowered = lower(make_fx(_padded_rows)(x, y))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert _inner_loops(text) == [(0, 3), (3, 40), (40, 45)], text
    assert "AF_GUARDED_LOADS" not in text and " >= " not in text, text
    assert text.count("outside its source") == 2, text
    (got,), (ref,) = lowered([x, y]), _padded_rows(x, y)
    assert_close(got, ref, f"padded rows ({dtype})", atol=0, rtol=0)


def _nested_pads(x):
    inner = aten.mul.Tensor(aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), [2, 1], 0.5), 3.0)  # [5, 9]
    return (aten.sub.Tensor(aten.constant_pad_nd.default(inner, [1, 4], -2.0), 1.0),)                  # [5, 14]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_pads_split_the_row_at_every_guards_edge(dtype):
    """A pad of a pad computed in one kernel (nested windows): the inner pad's guard, in its
    source's frame, cuts the row at its edges moved by the outer pad: [0, 1) fill, [1, 3) the inner
    fill, [3, 9) x, [9, 10) the inner fill, [10, 14) fill. Eager's values to the bit."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(32)).to(dtype)
    lowered = lower(make_fx(_nested_pads)(x))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert _inner_loops(text) == [(0, 1), (1, 3), (3, 9), (9, 10), (10, 14)], text
    assert "AF_GUARDED_LOADS" not in text, text
    (got,), (ref,) = lowered([x]), _nested_pads(x)
    assert_close(got, ref, f"nested pads ({dtype})", atol=0, rtol=0)


def _many_slices(base, *parts):
    out = aten.mul.Tensor(base, 0.5)
    for j, p in enumerate(parts):  # six slices of the row: more edges than a kernel splits at
        out = aten.slice_scatter.default(out, aten.mul.Tensor(p, 2.0), 1, 4 * j + 1, 4 * j + 3)
    return (aten.add.Tensor(out, 1.0),)


def test_more_guard_edges_than_a_split_takes_keep_one_guarded_loop():
    """Six slice assignments into a row have twelve edges, more than AF_CG_MAX_CUTS: the kernel
    keeps one inner loop with its comparisons (and AF_GUARDED_LOADS), and eager's values."""
    gen = torch.Generator().manual_seed(33)
    base = torch.randn(3, 26, generator=gen)
    parts = [torch.randn(3, 2, generator=gen) for _ in range(6)]
    lowered = lower(make_fx(_many_slices)(base, *parts))
    src = lowered.program.source
    kernels = [_kernel_text(src, i) for i in range(lowered.program.num_kernels)]
    windows = [t for t in kernels if "slice_scatter" in t]
    assert len(windows) == 1 and _inner_loops(windows[0]) == [(0, 26)], kernels
    assert "AF_GUARDED_LOADS" in windows[0] and windows[0].count(" >= ") == 6, windows[0]
    (got,), (ref,) = lowered([base, *parts]), _many_slices(base, *parts)
    assert_close(got, ref, "six slice assignments", atol=0, rtol=0)


def _pad_of_a_regrouped_view(a, b):
    x = aten.mul.Tensor(a, b)                                          # [2, 4, 16, 5]
    v = aten.view.default(x, [8, 4, 4, 5])                               # x's dims 0-2 regrouped
    return (aten.add.Tensor(aten.constant_pad_nd.default(v, [0, 3], 0.0), 1.0),)  # [8, 4, 4, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_view_regrouping_dims_reads_its_rows_without_division_by_a_row(dtype):
    """A pad of a view that regroups the dims before the last (Longformer's [8, 8, 32, 65] view of
    its [2, 4, 256, 65] scores): the source's coordinates are quotients and remainders of the view's
    own, never of an offset along the row (x's first coordinate is s0 / 4, not (s0 * 80 + s1 * 20 +
    s2 * 5 + s3) / 320), so a row is contiguous and its inside vectorizes. Eager's values."""
    gen = torch.Generator().manual_seed(34)
    a, b = torch.randn(2, 4, 16, 5, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)
    lowered = lower(make_fx(_pad_of_a_regrouped_view, tracing_mode="fake")(a, b))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert re.search(r"s\d+_0 \* 1\) / 4;", text) and "/ 320" not in text, text
    assert _inner_loops(text) == [(0, 5), (5, 8)] and "AF_GUARDED_LOADS" not in text, text
    (got,), (ref,) = lowered([a, b]), _pad_of_a_regrouped_view(a, b)
    assert_close(got, ref, f"pad of a regrouped view ({dtype})", atol=0, rtol=0)


def _pad_of_rows_cut_in_chunks(a, b):
    x = aten.mul.Tensor(a, b)                                                    # [2, 32]
    v = aten.view.default(x, [8, 8])                                              # rows of 8: 4 per row of x
    return (aten.add.Tensor(aten.constant_pad_nd.default(v, [0, 3], 0.0), 1.0),)  # [8, 11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_view_cutting_rows_in_chunks_reads_each_chunk_contiguously(dtype):
    """A pad of a view cutting x's rows into chunks (Longformer's [.., 96, 64] chunks of its 256
    positions): x's column for chunk element (s0, s1) is (s0 % 4) * 8 + s1, a row's step 1, not
    (s0 * 8 + s1) % 32; its row s0 / 4. Eager's values."""
    gen = torch.Generator().manual_seed(35)
    a, b = torch.randn(2, 32, generator=gen).to(dtype), torch.randn(32, generator=gen).to(dtype)
    lowered = lower(make_fx(_pad_of_rows_cut_in_chunks, tracing_mode="fake")(a, b))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert re.search(r"s\d+_0 \* 1\) % 4\) \* 8 \+ s\d+_1 \* 1;", text) and "% 32" not in text, text
    assert re.search(r"s\d+_0 \* 1\) / 4;", text), text
    assert _inner_loops(text) == [(0, 8), (8, 11)] and "AF_GUARDED_LOADS" not in text, text
    (got,), (ref,) = lowered([a, b]), _pad_of_rows_cut_in_chunks(a, b)
    assert_close(got, ref, f"pad of rows cut in chunks ({dtype})", atol=0, rtol=0)


def _pad_of_rows_before_the_row(x):
    return (aten.add.Tensor(aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), [0, 0, 2, 1], -1.5), 1.0),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_guard_the_row_does_not_move_splits_the_rows(dtype):
    """A pad of the dim before the row: its guard is the same along a row, so the rows split where
    it changes (one comparison a row, `if (b<k> < 2)`), and each part's loop has the guard as a
    constant: the padded rows write the fill without computing the source, the inside loads
    without a comparison (no AF_GUARDED_LOADS, no choice after loads). Eager's values to the bit."""
    x = torch.randn(6, 37, generator=torch.Generator().manual_seed(36)).to(dtype)
    lowered = lower(make_fx(_pad_of_rows_before_the_row)(x))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert _inner_loops(text) == [(0, 37)] * 3, text
    assert re.search(r"if \(b\d+ < 2\) \{", text) and re.search(r"\} else if \(b\d+ < 8\) \{", text), text
    assert "AF_GUARDED_LOADS" not in text and "chosen after its loads" not in text, text
    assert text.count("mul.Tensor") == 1, text  # the source computed in the inside's part only
    (got,), (ref,) = lowered([x]), _pad_of_rows_before_the_row(x)
    assert_close(got, ref, f"pad before the row ({dtype})", atol=0, rtol=0)


def _pad_of_two_outer_dims(x):
    return (aten.add.Tensor(aten.constant_pad_nd.default(aten.mul.Tensor(x, 2.0), [0, 0, 2, 1, 1, 0], -1.5), 1.0),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_guards_on_two_outer_dims_are_chosen_after_their_loads(dtype):
    """A pad of two dims before the row: no one dim splits the rows, so the kernel loads at offset
    0 where the guard fails and chooses the value after (no load behind a branch, no
    AF_GUARDED_LOADS: the row vectorizes), one loop over the row. Eager's values to the bit."""
    x = torch.randn(3, 6, 37, generator=torch.Generator().manual_seed(36)).to(dtype)
    lowered = lower(make_fx(_pad_of_two_outer_dims)(x))
    assert lowered.program.num_kernels == 1, str(lowered.program)
    text = _kernel_text(lowered.program.source, 0)
    assert _inner_loops(text) == [(0, 37)] and "chosen after its loads" in text, text
    assert "AF_GUARDED_LOADS" not in text and re.search(r"\[g\d+ \? \(", text), text
    (got,), (ref,) = lowered([x]), _pad_of_two_outer_dims(x)
    assert_close(got, ref, f"pad of two outer dims ({dtype})", atol=0, rtol=0)


def test_layers_whose_guards_are_chosen_after_their_loads_share_a_body(tmp_path, monkeypatch):
    """A model's layers, each padding two dims before its row (a guard chosen after its loads, its
    variable g<id> named by a node id), still share one kernel body: g<id> is a local the sharing
    renames (it was not at first, and Longformer at host size went from 60 to 170 bodies)."""
    monkeypatch.setenv("AOTFUSE_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(37)
    ws = [torch.randn(12, 12, generator=g) for _ in range(3)]

    def fn(x, *ws):
        for w in ws:  # [2, 6, 12] -> pad two outer dims -> [3, 9, 12] -> crop back -> matmul
            x = F.pad(torch.tanh(x * 0.5), (0, 0, 2, 1, 1, 0), value=-1.0)[1:, 1:7] @ w
        return x

    x = torch.randn(2, 6, 12, generator=g)
    lowered = lower(make_fx(fn)(x, *ws))
    src = lowered.program.source
    assert lowered.program.num_kernels == 3 and src.count("chosen after its loads") == 1, src
    assert src.count("AF_BODY void af_body_") == 1 and src.count("the body of group 0") == 2, src
    assert_close(lowered([x, *ws])[0], fn(x, *ws), "padded layers", atol=1e-5, rtol=1e-5)


def test_a_long_pointwise_chain_makes_kernels_of_bounded_size(monkeypatch):
    """A residual stream with nothing between its layers but pointwise work (each layer's matmul output
    saved, the stream recomputed for the backward's weight gradients) made one kernel of every layer's
    nodes: 421 nodes at 25 layers, about 1700 at 100, and the code generators' per-kernel passes grow
    with a kernel's size squared (a 100-layer model's first step took 116 s, 104 of it lowering:
    benchmarks/deep_chain.py).
    Groups now stop taking nodes at 256 (the seed models' largest kernels hold 28): values and
    gradients as eager's. The default partition now saves every other stream value
    (ban_chained_materialized); AOTFUSE_RECOMPUTE_CHAINS=1 keeps the cut that recomputes the chain."""
    monkeypatch.setenv("AOTFUSE_RECOMPUTE_CHAINS", "1")
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.norm(self.lin(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(40)])
    ref = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(8, 16)
    out, expected = compiled(x), ref(x)
    out.sum().backward()
    expected.sum().backward()
    assert_close(out, expected, "output")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")
    sizes = []
    for low in compiled._aotfuse_compiled.records[-1].programs.values():
        groups = collections.Counter(grp for _op, _k, grp in low.program.node_groups() if grp >= 0)
        sizes += groups.values()
    assert max(sizes) <= 256, sorted(sizes)[-5:]
    assert max(sizes) > 100  # the chain still fuses: a kernel takes many layers' nodes


def _memory_order_cases():
    g = torch.Generator().manual_seed(5)
    cl = torch.randn(4, 24, 6, 5, generator=g).to(memory_format=torch.channels_last)
    w = torch.randn(1, 24, 1, 1, generator=g)
    t = torch.randn(40, 48, generator=g).t()  # [48, 40] with strides [1, 48]
    return {
        # a batch norm's ReLU and its mask over a channels-last activation, a per-channel scale
        "channels_last": ((lambda x, w: ((x * w).relu(), (x * w).relu() <= 0)), (cl, w)),
        # a transposed operand: the output follows its layout (TensorIterator's rule)
        "transposed": ((lambda x: ((x * 2.0).sigmoid(), x.tanh() + 1.0)), (t,)),
    }


@pytest.mark.parametrize("case", ["channels_last", "transposed"])
def test_pointwise_kernels_walk_memory_in_their_inner_loop(case):
    """A pointwise kernel's loops take the dims in its first output's memory order, so that the inner
    loop walks memory: a channels-last activation was walked along W at a stride of C (a ReLU and its
    mask at [16, 64, 16, 16]: 1.46 ms, against 0.035 in memory order). Operands of one dense layout
    then make one flat loop; the values are eager's, in the C kernels and in the CUDA emulation."""
    fn, args = _memory_order_cases()[case]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    lowered = lower(gm)
    got, ref = lowered(list(args)), fn(*args)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.stride() == b.stride(), (i, a.stride(), b.stride())
        assert_close(a, b, f"{case} output {i}", atol=1e-6, rtol=1e-6)
    src = lowered.program.source
    kernel = src[src.index("/* group 0"):]
    inner = re.findall(r"af_idx o\d+ = (?:b\d+ \+ )?i \* (\d+);", kernel)
    assert inner and set(inner) <= {"0", "1"}, kernel[:1500]  # every operand walked in memory order
    if case == "transposed":  # one dense layout: one flat loop
        assert "af_idx lo = c * 4096" in kernel, kernel[:1500]
    import cuda_emu

    if cuda_emu.unavailable() is None:
        cuda_emu.check(make_fx(fn, tracing_mode="fake")(*args), args, case)


def test_dropout_over_a_channels_last_activation_draws_each_elements_own_numbers():
    """The loop order follows memory; the dropout mask follows the element: the counter is each
    element's logical index, so the mask of a channels-last tensor is the mask of its contiguous
    copy (the backward, or another layout's kernel, recomputes the same bits)."""
    from aotfuse.decompositions import default_decompositions

    x = torch.randn(2, 16, 4, 4)

    def f(seed, x):
        keep = torch.ops.aotfuse.rng_uniform(seed, list(x.shape)) > 0.5
        return x * 2.0 * keep  # the first operand's layout (TensorIterator's rule)

    from aotfuse import rng  # noqa: F401  (registers aotfuse::rng_uniform)

    seed = torch.tensor(1234)
    outs = []
    for inp in (x, x.to(memory_format=torch.channels_last)):
        gm = make_fx(f, decomposition_table=default_decompositions())(seed, inp)
        outs.append(lower(gm)([seed, inp])[0])
    assert outs[1].stride() != outs[0].stride()
    assert torch.equal(outs[0], outs[1])
    assert 0.3 < (outs[0] != 0).float().mean() < 0.7


def _column_phased_cases():
    def channels_first_norm(x):  # ConvNeXt's channels-first layer norm: mean and variance over dim 1
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return (x - u) / torch.sqrt(s + 1e-6) * 1.5 + 0.25

    return {
        # Swin's patch embedding: a layer norm over the 32 channels of a [16, 32, 16, 16] image, read
        # as [16, 256, 32] at a stride of 256
        "layer-norm-transposed": (lambda x: F.layer_norm(x.flatten(2).transpose(1, 2), (32,)) * 1.5 + 0.25,
                                  (16, 32, 16, 16)),
        "softmax-dim1": (lambda x: torch.softmax(x * 2.0, dim=1), (8, 32, 64)),
        "channels-first-norm": (channels_first_norm, (4, 16, 8, 8)),
        "mean-dim1": (lambda x: x.mean(1) * 3.0, (4, 16, 8, 8)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_column_phased_cases()))
def test_reductions_over_a_strided_dim_run_column_phased(case, dtype, monkeypatch):
    """A reduction group whose rows run along a strided dim while a kept dim is contiguous (a layer
    norm over the channels of a transposed tensor, a softmax or mean over dim 1) runs its phases
    column-phased: blocks of columns in the inner, contiguous loop, each with its own accumulators
    and row values (codegen_c.c, emit_column_phased_kernel). A row kernel read each row's elements at
    the stride, one at a time: Swin's patch-embedding layer norm forward 1.70 -> 0.45 ms in bf16, the
    bf16 Swin step 105 -> 87% of eager's. Its backward stays a row kernel (the output gradient is
    contiguous along the channels) that gathers the transposed input's row into an array first, so
    its loops vectorize (codegen_c.c, row_gathers: 2.1 -> 0.35 ms). Forward and backward values against
    eager and a float64 reference; AOTFUSE_COLUMN_PHASED=0 keeps plain row kernels, with the same values."""
    fn, shape = _column_phased_cases()[case]
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(shape, dtype=torch.float64, generator=g)
    w64 = torch.randn(fn(x64).shape, dtype=torch.float64, generator=g)

    def run(f, dt):
        x = x64.to(dt).requires_grad_()
        out = f(x)
        (gx,) = torch.autograd.grad((out * w64.to(dt)).sum(), x)
        return out.detach(), gx

    ref = run(fn, torch.float64)
    eager = run(fn, dtype)
    sources = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("AOTFUSE_COLUMN_PHASED", switch)
        compiled = aotfuse.aot_function(fn)
        got = run(compiled, dtype)
        for what, a, e, r in zip(("output", "input gradient"), got, eager, ref):
            assert_close(a, e, f"{case} {dtype} AOTFUSE_COLUMN_PHASED={switch}: {what} against eager",
                         atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
            err, eager_err = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
            assert err <= 2 * eager_err + (1e-2 if dtype == torch.bfloat16 else 1e-5), (case, dtype, switch, what, err, eager_err)
        sources[switch] = "".join(low.program.source for low in compiled.records[-1].programs.values())
    assert "column-phased" in sources["1"] and "column-phased" not in sources["0"], case
    if case == "layer-norm-transposed":  # its backward: a row kernel gathering the transposed input's rows
        assert "gathered once" in sources["1"] and "gathered once" not in sources["0"]


def test_a_column_phased_softmax_keeps_eagers_nans_and_infinities():
    """A column-phased max takes the double path (af_maxd, NaN-propagating): a NaN makes its
    column NaN, a column of -inf is NaN, an inf is the column's only weight, as eager's softmax."""
    f = lambda x: torch.softmax(x * 2.0, dim=1)  # noqa: E731
    x = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(0))
    x[2, 5, 7], x[4, 3, 11] = float("nan"), float("inf")
    x[3, :, 9] = float("-inf")
    compiled = aotfuse.aot_function(f)
    got, ref = compiled(x), f(x)
    assert "column-phased" in compiled.records[-1].programs["inference"].program.source
    assert torch.equal(got.isnan(), ref.isnan()) and got[2, :, 7].isnan().all() and got[3, :, 9].isnan().all()
    assert_close(got.nan_to_num(), ref.nan_to_num(), "softmax over dim 1 with NaN and inf", atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_sum_with_a_scalar_rounds_it_as_eager_on_the_cpu(dtype):
    """ATen's CPU add, sub and rsub round a Python scalar to a bf16 or fp16 tensor's dtype first (a bf16
    `a + 0.1` adds 0.10009765625), where its mul and div take the scalar in float: the C kernels give
    eager's bits both ways (before 2026-12-06 they added 0.1 in float, and a bf16 -0.10009765625 + 0.1
    came out -9.8e-05 where eager's is 0)."""
    v = torch.tensor(0.1, dtype=dtype).item()
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.tensor([-v, v, 0.3, -0.7]), torch.randn(4000, generator=g)]).to(dtype)

    def f(x):
        y = x * 1.0
        return y + 0.1, y - 0.3, 0.7 - y, torch.add(y, -0.1), y * 0.1 + 0.1, y / 0.3 - 0.2

    low = lower(make_fx(f)(x))
    assert low.program.num_kernels >= 1 and not low.extern_counts(), low.extern_counts()
    for i, (got, want) in enumerate(zip(low([x]), f(x))):
        assert torch.equal(got, want), (f"{dtype} output {i}: {int((got != want).sum())} of {want.numel()} differ from "
                                        f"eager's, first at x = {x[got != want][0].item()!r}")
