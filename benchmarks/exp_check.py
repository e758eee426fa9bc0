"""The C prelude's exp (af_exp) and its non-positive side (af_exp_nonpos) over every float (or every
--stride-th), and their speed.

    python benchmarks/exp_check.py [--stride 1] [--no-fma] [--width 512]

Takes af_exp_poly, af_exp and af_exp_nonpos from csrc/codegen_c.c as the kernels get them, builds a C
harness with the CPU JIT's flags (csrc/jit_cpu.c's base_flags) and prints af_exp's largest error in
units in the last place of the float result (the spacing of floats at double exp's value, subnormal
spacing below 2^-126; 0 and infinity where double's value rounds to them), how many inputs got a
special value wrong (NaN for NaN, infinity above the overflow edge, 0 at -infinity), how many floats
at most 0 (and NaNs) af_exp_nonpos gives other bits for than af_exp (it must give none: the kernels
call it for arguments never above 0, codegen_common.c's value_sign), and the time per element over 1M
inputs in [-20, 0] of each. --no-fma builds without FMA (fmaf as a product and a sum), --width 256
with 256-bit vectors (x86). Every float takes about a minute here.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from erf_check import ROOT, build_and_run, harness_head, prelude_function  # noqa: E402

HARNESS = r"""
__attribute__((noinline)) static void run_exp(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = af_exp(x[i]); }
__attribute__((noinline)) static void run_nonpos(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = af_exp_nonpos(x[i]); }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double spacing(double a) { /* of floats at a */
  if (a < 1.1754943508222875e-38) return 1.401298464324817e-45;
  int e; frexp(a, &e); return ldexp(1.0, e - 24);
}
static float xs[1 << 16], ya[1 << 16], yb[1 << 16];
int main(int argc, char **argv) {
  const uint64_t stride = strtoull(argv[1], NULL, 10), block = 1 << 16;
  double worst = 0; float where = 0; long bad = 0, differ = 0, nonpos = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += block * stride) {
    for (uint64_t i = 0; i < block; i++) { uint32_t u = (uint32_t)(base + i * stride); memcpy(&xs[i], &u, 4); }
    run_exp(xs, ya, (int)block); run_nonpos(xs, yb, (int)block);
    for (uint64_t i = 0; i < block; i++) {
      float x = xs[i], y = ya[i];
      if (!(x > 0.0f)) { /* af_exp_nonpos's domain, NaN included */
        uint32_t a, b; memcpy(&a, &ya[i], 4); memcpy(&b, &yb[i], 4);
        nonpos++; differ += x != x ? yb[i] == yb[i] : a != b;
      }
      if (x != x) { bad += y == y; continue; }
      double e = exp((double)x);
      float r = (float)e; /* 0 and infinity where the float result is */
      if (r == 0.0f || isinf(r)) { bad += y != r; continue; }
      double d = fabs((double)y - e) / spacing(e);
      if (d > worst) { worst = d; where = x; }
    }
  }
  enum { N = 1 << 20 };
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  if (!x || !y) return 1;
  for (int i = 0; i < N; i++) x[i] = (float)(-20.0 * rand() / RAND_MAX);
  double t[2] = {1e9, 1e9};
  for (int r = 0; r < 40; r++) {
    double t0 = now(); run_exp(x, y, N); double t1 = now(); run_nonpos(x, y, N); double t2 = now();
    if (t1 - t0 < t[0]) t[0] = t1 - t0;
    if (t2 - t1 < t[1]) t[1] = t2 - t1;
  }
  printf("%.4g %.9g %ld %ld %ld %.4f %.4f\n", worst, where, bad, differ, nonpos, t[0] / N * 1e9, t[1] / N * 1e9);
  free(x); free(y);
  return 0;
}
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stride", type=int, default=1, help="check every stride-th float (1: all 2^32)")
    ap.add_argument("--no-fma", action="store_true")
    ap.add_argument("--width", choices=["512", "256"], default="512")
    a = ap.parse_args(argv)
    source = (ROOT / "csrc" / "codegen_c.c").read_text()
    text = harness_head(a.no_fma) + "".join(prelude_function(source, f) for f in ("af_exp_poly", "af_exp", "af_exp_nonpos")) + HARNESS
    out = build_and_run(text, "exp", a.width, [str(a.stride)])
    r = {"ulp": float(out[0]), "at": float(out[1]), "special_failures": int(out[2]), "nonpos_differ": int(out[3]),
         "nonpos_checked": int(out[4]), "ns": float(out[5]), "nonpos_ns": float(out[6])}
    what = f"one float in {a.stride}" if a.stride > 1 else "every float"
    print(f"af_exp, {what}, {a.width}-bit{', no FMA' if a.no_fma else ''}: largest error {r['ulp']:.3f} ulp "
          f"(at {r['at']:.9g}), special values wrong: {r['special_failures']}, {r['ns']:.3f} ns an element in [-20, 0]")
    print(f"af_exp_nonpos: {r['nonpos_differ']} of {r['nonpos_checked']} floats at most 0 (NaN included) differ from "
          f"af_exp in their bits, {r['nonpos_ns']:.3f} ns an element")
    return r


if __name__ == "__main__":
    main()
