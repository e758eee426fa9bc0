"""The C prelude's log, log2, log10, log1p, expm1, sin and cos against double-precision libm, over every
float (or every --stride-th), and their speed against libm's float calls.

    python benchmarks/libm_check.py [--fn log,sin,...] [--stride 1] [--no-fma] [--width 512]

Takes the functions from csrc/codegen_c.c as the kernels get them (the `vector_log` and `vector_trig`
strings, af_exp_poly from the prelude, the 2/pi table from a program the built extension generates), builds one C harness a function with the CPU JIT's flags
(csrc/jit_cpu.c's base_flags), and prints each one's largest error in units in the last place of the
float result (the spacing of floats at the double result, subnormal spacing below 2^-126), where it
is, how many inputs got a special value wrong (NaN where the reference has none or the other way,
an infinity or a zero's sign that differs), and the time per element over 1M inputs in a typical
range (log's (0, 100], log1p's (-0.99, 100], the others' [-10, 10]; sin and cos also [-1e4, 1e4]) against
libm's float function in the same loop (which GCC cannot vectorize). --no-fma builds without FMA
(fmaf as a product and a sum), --width 256 with 256-bit vectors (x86), --march znver3 for a CPU
without AVX-512 (a build this machine can still run). Every float takes about 2.5
minutes a function here (the double-precision reference dominates).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from erf_check import ROOT, build_and_run, harness_head, prelude_function  # noqa: E402

# name: (libm float function, double reference, timing range)
FUNCTIONS = {
    "log": ("logf", "log", (0.0, 100.0)),
    "log2": ("log2f", "log2", (0.0, 100.0)),
    "log10": ("log10f", "log10", (0.0, 100.0)),
    "log1p": ("log1pf", "log1p", (-0.99, 100.0)),
    "expm1": ("expm1f", "expm1", (-10.0, 10.0)),
    "sin": ("sinf", "sin", (-10.0, 10.0)),
    "cos": ("cosf", "cos", (-10.0, 10.0)),
}

HARNESS = r"""
__attribute__((noinline)) static void run_a(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = FN(x[i]); }
__attribute__((noinline)) static void run_b(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = LIB(x[i]); }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double spacing(double r) { /* the floats' spacing at r */
  double a = fabs(r); int e;
  if (a < 1.1754943508222875e-38) return 1.401298464324817e-45;
  if (a > 3.4028234663852886e38) a = 3.4028234663852886e38;
  frexp(a, &e); return ldexp(1.0, e - 24);
}
static float xs[1 << 16], ys[1 << 16];
static void timing(double lo, double hi, double t[2]) {
  enum { N = 1 << 20 };
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  if (!x || !y) exit(1);
  srand(1);
  for (int i = 0; i < N; i++) x[i] = (float)(lo + (hi - lo) * ((double)rand() / RAND_MAX));
  t[0] = t[1] = 1e9;
  for (int r = 0; r < 20; r++) {
    double t0 = now(); run_a(x, y, N); double t1 = now(); run_b(x, y, N); double t2 = now();
    if (t1 - t0 < t[0]) t[0] = t1 - t0;
    if (t2 - t1 < t[1]) t[1] = t2 - t1;
  }
  t[0] *= 1e9 / N; t[1] *= 1e9 / N;
  free(x); free(y);
}
int main(int argc, char **argv) {
  const uint64_t stride = strtoull(argv[1], NULL, 10), block = 1 << 16;
  double worst = 0; float where = 0; long bad = 0; float bad_at = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += block * stride) {
    for (uint64_t i = 0; i < block; i++) { uint32_t u = (uint32_t)(base + i * stride); memcpy(&xs[i], &u, 4); }
    run_a(xs, ys, (int)block);
    for (uint64_t i = 0; i < block; i++) {
      double r = REF((double)xs[i]); float y = ys[i], rf = (float)r;
      int wrong = 0;
      if (r != r || y != y) wrong = (r != r) != (y != y);
      else if (isinf(rf) || isinf(y)) wrong = rf != y && !(isinf(y) && fabs(y - r) < spacing(r)); /* past FLT_MAX by < 1 ulp */
      else if (r == 0) wrong = y != 0 || !signbit(y) != !signbit(r);
      else {
        double d = fabs(y - r) / spacing(r);
        if (d > worst) { worst = d; where = xs[i]; }
      }
      if (wrong) { bad++; bad_at = xs[i]; }
    }
  }
  double t[2], u[2] = {0, 0};
  timing(LO, HI, t);
  if (WIDE) timing(-1e4, 1e4, u);
  printf("%.4f %.9g %ld %.9g %.4f %.4f %.4f %.4f\n", worst, where, bad, bad_at, t[0], t[1], u[0], u[1]);
  return 0;
}
"""


def c_string(source: str, name: str) -> str:
    """The C text of `static const char *const name = "..." "...";` in source."""
    start = source.index(f"static const char *const {name} =")
    end = source.index('";\n', start) + 2
    return "".join(s.encode().decode("unicode_escape") for s in re.findall(r'"((?:[^"\\]|\\.)*)"', source[start:end]))


def trig_table() -> str:
    """The 2/pi table af_sincos reads, as the C code generator emits it (emit_2opi_table) into a
    program calling sin: lowered here, so the extension must be built."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    sys.path.insert(0, str(ROOT / "python"))
    from aotfuse.lower import lower

    source = lower(make_fx(lambda x: torch.sin(x * 1.0))(torch.zeros(8))).program.source
    return "".join(re.findall(r"static const uint32_t af_2opi_w\d\[129\] = \{[^}]*\};\n", source))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fn", default=",".join(FUNCTIONS), help="comma-separated: " + ", ".join(FUNCTIONS))
    ap.add_argument("--stride", type=int, default=1, help="check every stride-th float (1: all 2^32)")
    ap.add_argument("--no-fma", action="store_true")
    ap.add_argument("--width", choices=["512", "256"], default="512")
    ap.add_argument("--march", default="native", help="the target in place of the JIT's -march=native (znver3: AVX2 only)")
    a = ap.parse_args(argv)
    source = (ROOT / "csrc" / "codegen_c.c").read_text()
    head = (harness_head(a.no_fma) + prelude_function(source, "af_exp_poly") + c_string(source, "vector_log") + trig_table() + c_string(source, "vector_trig"))
    what = f"one float in {a.stride}" if a.stride > 1 else "every float"
    print(f"{what}, {a.width}-bit{', no FMA' if a.no_fma else ''}, -march={a.march}: largest error in ulp of the float result, against double libm")
    results = {}
    for name in a.fn.split(","):
        lib, ref, (lo, hi) = FUNCTIONS[name]
        defs = (f"#define FN af_{name}\n#define LIB {lib}\n#define REF {ref}\n#define LO {lo}\n#define HI {hi}\n"
                f"#define WIDE {int(name in ('sin', 'cos'))}\n")
        out = build_and_run(head + defs + HARNESS, name, a.width, [str(a.stride)], march=a.march)
        r = {"ulp": float(out[0]), "at": float(out[1]), "special_failures": int(out[2]), "special_at": float(out[3]),
             "ns": float(out[4]), "libm_ns": float(out[5]), "wide_ns": float(out[6]), "wide_libm_ns": float(out[7])}
        results[name] = r
        wide = (f"; over [-1e4, 1e4] {r['wide_ns']:.3f} against {r['wide_libm_ns']:.3f}" if name in ("sin", "cos") else "")
        example = f" (e.g. at {r['special_at']:.9g})" if r["special_failures"] else ""
        print(f"  {name:6s} {r['ulp']:.3f} ulp (at {r['at']:.9g}); special values wrong: {r['special_failures']}{example}; "
              f"{r['ns']:.3f} ns an element against libm's {r['libm_ns']:.3f}{wide}")
    return results


if __name__ == "__main__":
    main()
