"""The C prelude's vectorized log, log2, log10, log1p, expm1, sin and cos (csrc/codegen_c.c: vector_log,
vector_trig): their values in generated kernels against float64 on the inputs that are hard for them
(special values, subnormals, powers of two, values next to 1 and 0, arguments next to multiples of pi/2
up to the largest float), their loops vectorized, and AOTFUSE_VECTOR_LIBM=0's libm calls.
benchmarks/libm_check.py checks every float the same way (the figures in codegen_c.c)."""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import math
import pathlib
import re
import shutil
import subprocess

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse.lower import lower

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPS = {"log": torch.log, "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "expm1": torch.expm1,
       "sin": torch.sin, "cos": torch.cos}
# the largest error allowed, in units in the last place of the float result (benchmarks/libm_check.py:
# every float with FMA at most 1.67, one in 16 without FMA 2.01, 256-bit as 512; ATen's Sleef functions
# are within 1)
MAX_ULP = 2.5


def _hard_inputs(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 2.0 ** -149, -(2.0 ** -149), 2.0 ** -126 - 2.0 ** -149,
               2.0 ** -126, 3.4028234663852886e38, -3.4028234663852886e38, 0.5, 2.0, 1e-8, -1e-8]
    powers = [2.0 ** e for e in range(-149, 128)]
    parts = [torch.tensor(special + powers + [-p for p in powers], dtype=torch.float32),
             # every exponent and sign: random bit patterns, NaNs among them
             torch.randint(-2 ** 31, 2 ** 31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32),
             # the floats next to 1 (log's and log1p's cancellations) and next to 0
             1.0 + torch.arange(-1000, 1000) * 2.0 ** -24,
             torch.linspace(-1e-3, 1e-3, 20001)]
    if name in ("log", "log2", "log10"):
        parts.append(torch.linspace(1e-6, 10.0, 100001))
    elif name == "log1p":
        parts += [torch.linspace(-1.0, 10.0, 100001), torch.tensor([-1.0, -1.0 + 2.0 ** -24, -0.5, 1e30])]
    elif name == "expm1":
        parts += [torch.linspace(-30.0, 89.0, 100001), torch.tensor([88.72, 88.7228, 88.73, -17.0, -20.0, -104.0])]
    else:
        # the floats nearest k pi / 2 (where the reduction cancels), from small k to the float range's top
        k = torch.cat([torch.arange(1, 100_001, dtype=torch.float64), torch.logspace(5, 38, 20_000, dtype=torch.float64).round()])
        near = (k * (math.pi / 2)).to(torch.float32)
        parts += [near, torch.nextafter(near, torch.full_like(near, math.inf)), torch.linspace(-100.0, 100.0, 100001),
                  torch.tensor([1.02076823e15, 1.03881677e26, 1.59242097e16, 1.09487236e36, 486068.0, 9.21140844e35])]
    return torch.cat([p.to(torch.float32).flatten() for p in parts])


def _ulp_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the floats' spacing at ref (float64), subnormal spacing below 2^-126."""
    _, e = torch.frexp(ref.abs().clamp(max=3.4028234663852886e38))
    spacing = torch.ldexp(torch.ones_like(ref), (e - 24).clamp(min=-149))
    return (got.double() - ref).abs() / spacing


@pytest.mark.parametrize("name", list(OPS))
def test_each_function_is_within_a_few_ulp_of_float64_on_hard_inputs(name):
    fn = OPS[name]
    x = _hard_inputs(name)
    low = lower(make_fx(lambda x: fn(x * 1.0))(x))
    src = low.program.source
    assert low.program.num_kernels == 1 and re.search(rf"= af_{name}\(v", src), src[-1500:]
    assert ("af_2opi_w0" in src) == (name in ("sin", "cos"))  # the reduction's table only where it is called
    got, ref = low([x])[0], fn(x.double())
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan), f"{name}: NaN at {x[got.isnan() != nan][:5].tolist()}"
    inf = ref.float().isinf()  # past the float range: infinity, as float's own function gives
    bad = (got.isinf() != inf) | (inf & (got != ref.float()))
    assert not bad.any(), f"{name}: infinities differ at {x[bad][:5].tolist()}: {got[bad][:5].tolist()}"
    zero = ref == 0
    assert torch.equal(got[zero], ref[zero].float()) and torch.equal(got[zero].signbit(), ref[zero].signbit()), name
    finite = ~nan & ~inf
    err = _ulp_errors(got[finite], ref[finite])
    worst = int(err.argmax())
    assert err.max() <= MAX_ULP, (f"{name}: {err.max().item():.3f} ulp at x = {x[finite][worst].item()!r} "
                                  f"(got {got[finite][worst].item()!r}, float64 {ref[finite][worst].item()!r})")
    # and as near eager's float function (Sleef's, within 1 ulp) as that bound allows
    eager = fn(x)
    assert (_ulp_errors(got[finite], eager[finite].double()) <= MAX_ULP + 1.0).all(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tensors_round_each_function_as_eager_does_within_one_step(dtype):
    """In bf16 and fp16 each function computes in float and rounds once: within one step of the dtype
    of eager's value (their float values differ by at most a few ulp)."""
    x = torch.linspace(0.01, 20.0, 4001).to(dtype)
    for name, fn in OPS.items():
        arg = x if name != "expm1" else x - 10.0
        got = lower(make_fx(lambda x: fn(x * 1.0))(arg))([arg])[0]
        eager = fn(arg * 1.0)
        assert got.dtype == dtype
        step = torch.finfo(dtype).eps * eager.float().abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((got.float() - eager.float()).abs() <= step).all(), name


def _jit_flags() -> list[str]:
    spec = importlib.util.spec_from_file_location("erf_check", ROOT / "benchmarks" / "erf_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.jit_flags()


def test_a_kernel_calling_them_vectorizes(tmp_path):
    """The point of the polynomials: a loop calling any of them vectorizes (GCC's own report on the
    program's source, built with the CPU JIT's flags), where libm's calls kept it scalar."""
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("needs GCC (its -fopt-info report)")
    x = torch.rand(4096) + 0.5

    def f(x):
        return (torch.log(x) + torch.log2(x) * torch.log10(x) + torch.log1p(x) * torch.expm1(x) + torch.sin(x) * torch.cos(x),)

    src = lower(make_fx(f)(x)).program.source
    c = tmp_path / "kernel.c"
    c.write_text(src)
    report = subprocess.run([gcc, *_jit_flags(), "-fopt-info-vec-optimized", "-c", str(c), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, check=True).stderr
    lines = src.splitlines()
    loop = next(i for i, line in enumerate(lines, 1) if "for (af_idx i = lo; i < hi; i++)" in line)
    assert all(f"af_{name}(v" in src for name in OPS), src[-2000:]
    assert re.search(rf"kernel\.c:{loop}:\d+: optimized: loop vectorized", report), report


def test_vector_libm_off_calls_libm(monkeypatch):
    """AOTFUSE_VECTOR_LIBM=0 (an A/B): the same kernels call libm's functions, with libm's values to the bit."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    monkeypatch.setenv("AOTFUSE_VECTOR_LIBM", "0")
    x = torch.linspace(-50.0, 50.0, 2001)
    for name, fn in OPS.items():
        arg = x.abs() if name.startswith("log") else x
        low = lower(make_fx(lambda x: fn(x * 1.0))(arg))
        src = low.program.source
        call = getattr(libm, name + "f")
        call.restype, call.argtypes = ctypes.c_float, [ctypes.c_float]
        assert f"return {name}f(x);" in src and "af_2opi_w0" not in src and "af_log_m" not in src
        got = low([arg])[0]
        assert torch.equal(got, torch.tensor([call(v) for v in arg.tolist()])), name
