"""The C prelude's erf (or erf1p) against float64's, over every float (or every --stride-th), and its speed.

    python benchmarks/erf_check.py [--fn erf|erf1p] [--stride 1] [--against "c6 c5 ... c0"] [--no-fma] [--width 512]

Takes `af_exp_normal` (with `af_exp_poly`) and `af_erf` from csrc/codegen_c.c as the kernels get them, builds a C harness
with the CPU JIT's flags (csrc/jit_cpu.c's base_flags), and prints erf's largest relative error over
the normal floats (subnormal inputs round in the Taylor side's product, as they always did) and its
time per element over 1M inputs in [-5, 5]. --against takes another h polynomial (its coefficients, highest first) for the
same erf, to compare a refit with the current one: both errors, both times, and how many floats
differ in their bits. --no-fma builds without FMA (fmaf as a product and a sum), --width 256 with
256-bit vectors (x86; elsewhere the compiler's own width).

--fn erf1p checks `af_erf1p` (1 + erf, GELU's; python/aotfuse/erf1p.py) the same way, by what counts
for it: its largest absolute error against 1 + erf in double over every float, and its largest relative
one where x < -0.5 and 1 + erf > 1e-6 (the tail, which 1 + erf(x) in float loses to cancellation); the
two ops it replaces, `1.0f + af_erf(x)`, are measured beside it (or --against's h for erf1p instead).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import re
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# FN_A and FN_B: the two functions measured; ERF1P: measure them as 1 + erf (absolute error, and the
# relative one in the negative tail), else as erf (relative error over the normal floats)
HARNESS = r"""
__attribute__((noinline)) static void run_a(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = FN_A(x[i]); }
__attribute__((noinline)) static void run_b(const float *x, float *y, int n) { for (int i = 0; i < n; i++) y[i] = FN_B(x[i]); }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static float xs[1 << 16], ya[1 << 16], yb[1 << 16];
int main(int argc, char **argv) {
  const uint64_t stride = strtoull(argv[1], NULL, 10), block = 1 << 16;
  double worst[2] = {0, 0}, tail[2] = {0, 0}; float where[2] = {0, 0}, twhere[2] = {0, 0}; long differ = 0, bad = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += block * stride) {
    for (uint64_t i = 0; i < block; i++) { uint32_t u = (uint32_t)(base + i * stride); memcpy(&xs[i], &u, 4); }
    run_a(xs, ya, (int)block); run_b(xs, yb, (int)block);
    for (uint64_t i = 0; i < block; i++) {
      float x = xs[i];
      if (x != x) { bad += ya[i] == ya[i]; continue; } /* NaN in, NaN out */
      uint32_t a, b; memcpy(&a, &ya[i], 4); memcpy(&b, &yb[i], 4); differ += a != b;
      float y[2] = {ya[i], yb[i]};
#if ERF1P
      double e = 1.0 + erf((double)x);
      for (int k = 0; k < 2; k++) {
        double d = fabs(y[k] - e);
        if (d > worst[k]) { worst[k] = d; where[k] = x; }
        if (x < -0.5f && e > 1e-6 && d / e > tail[k]) { tail[k] = d / e; twhere[k] = x; }
      }
#else
      double e = erf((double)x);
      if (e == 0) { bad += ya[i] != 0 || signbit(ya[i]) != signbit(x); continue; }
      if (fabsf(x) < 1.17549435e-38f) continue; /* subnormal inputs */
      for (int k = 0; k < 2; k++) {
        double r = fabs(y[k] - e) / fabs(e);
        if (r > worst[k]) { worst[k] = r; where[k] = x; }
      }
#endif
    }
  }
  enum { N = 1 << 20 };
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  if (!x || !y) return 1;
  for (int i = 0; i < N; i++) x[i] = (float)(((double)rand() / RAND_MAX - 0.5) * 10.0);
  double t[2] = {1e9, 1e9};
  for (int r = 0; r < 40; r++) {
    double t0 = now(); run_a(x, y, N); double t1 = now(); run_b(x, y, N); double t2 = now();
    if (t1 - t0 < t[0]) t[0] = t1 - t0;
    if (t2 - t1 < t[1]) t[1] = t2 - t1;
  }
  printf("%.4g %.9g %.4g %.9g %ld %ld %.4f %.4f %.4g %.9g %.4g %.9g\n", worst[0], where[0], worst[1], where[1], differ, bad,
         t[0] / N * 1e9, t[1] / N * 1e9, tail[0], twhere[0], tail[1], twhere[1]);
  free(x); free(y);
  return 0;
}
"""


def jit_flags() -> list[str]:
    """The CPU JIT's base compiler flags (csrc/jit_cpu.c's base_flags), less those for a shared library."""
    source = (ROOT / "csrc" / "jit_cpu.c").read_text()
    body = re.search(r"base_flags\[\] = \{(.*?)\};", source, re.S).group(1)
    return [f for f in re.findall(r'"([^"]*)"', body) if f not in ("-shared", "-fPIC")]


def harness_head(no_fma: bool) -> str:
    """The start of a C harness for the prelude's functions: the headers, AF_INLINE and AF_FMA (fmaf, or
    a product and a sum for --no-fma)."""
    fma = "#define AF_FMA(a, b, c) ((a) * (b) + (c))\n" if no_fma else "#define AF_FMA(a, b, c) fmaf(a, b, c)\n"
    return ("#define _POSIX_C_SOURCE 200112L\n#include <math.h>\n#include <stdint.h>\n#include <stdio.h>\n"
            "#include <stdlib.h>\n#include <string.h>\n#include <time.h>\n"
            "#define AF_INLINE static inline __attribute__((always_inline))\n" + fma)


def build_and_run(text: str, name: str, width: str, args: list[str], march: str | None = None) -> list[str]:
    """Compiles the harness `text` with the JIT's flags (its vector width flag, which it passes on x86
    only: jit_cpu.c's vector_width_flag; -march=<march> for -march=native where given), runs it with
    args and returns its output's words."""
    width_flag = [f"-mprefer-vector-width={width}"] if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else []
    flags = [f"-march={march}" if march and f == "-march=native" else f for f in jit_flags()]
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, name)
        pathlib.Path(c).write_text(text)
        subprocess.run(os.environ.get("AOTFUSE_CC", "cc").split() + flags + width_flag + [c, "-o", exe, "-lm"], check=True)
        return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout.split()


def prelude_function(source: str, name: str) -> str:
    """The C text of the prelude's `AF_INLINE float name(float x) { ... }` (a string literal in source)."""
    start = re.search(rf'"AF_INLINE float {name}\(float \w+\) {{\\n"', source).start()
    end = source.index('"}\\n"', start) + len('"}\\n"')
    return "".join(s.encode().decode("unicode_escape") for s in re.findall(r'"((?:[^"\\]|\\.)*)"', source[start:end]))


def with_polynomial(erf: str, coefficients: list[str]) -> str:
    """erf's C text with its h polynomial (`float hq = ...; hq = AF_FMA(hq, ac, ...); ...`) replaced."""
    old = re.search(r"  float hq = [^\n]*\n(?:  hq = AF_FMA\(hq, ac, [^\n]*\n)+", erf).group(0)
    new = f"  float hq = {coefficients[0]}f;\n" + "".join(f"  hq = AF_FMA(hq, ac, {c}f);\n" for c in coefficients[1:])
    return erf.replace(old, new)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fn", choices=["erf", "erf1p"], default="erf")
    ap.add_argument("--stride", type=int, default=1, help="check every stride-th float (1: all 2^32)")
    ap.add_argument("--against", default=None, help="another h polynomial, coefficients highest first")
    ap.add_argument("--no-fma", action="store_true")
    ap.add_argument("--width", choices=["512", "256"], default="512")
    a = ap.parse_args(argv)
    source = (ROOT / "csrc" / "codegen_c.c").read_text()
    exp_normal = prelude_function(source, "af_exp_poly") + prelude_function(source, "af_exp_normal")
    erf = prelude_function(source, "af_erf")
    head = harness_head(a.no_fma) + exp_normal + erf
    if a.fn == "erf1p":
        erf1p = prelude_function(source, "af_erf1p")
        if a.against:
            other = with_polynomial(erf1p, a.against.split()).replace("af_erf1p(", "af_erf1p_b(")
            text = head + erf1p + other + "#define FN_B af_erf1p_b\n"
        else:
            text = head + erf1p + "#define FN_B(x) (1.0f + af_erf(x))\n"
        text += "#define ERF1P 1\n#define FN_A af_erf1p\n" + HARNESS
    else:
        other = with_polynomial(erf, a.against.split()) if a.against else erf
        text = head + other.replace("af_erf(", "af_erf_b(") + "#define ERF1P 0\n#define FN_A af_erf\n#define FN_B af_erf_b\n" + HARNESS
    out = build_and_run(text, "erf", a.width, [str(a.stride)])
    r = {"error": float(out[0]), "at": float(out[1]), "other_error": float(out[2]), "other_at": float(out[3]),
         "differ": int(out[4]), "special_failures": int(out[5]), "ns": float(out[6]), "other_ns": float(out[7])}
    what = f"one float in {a.stride}" if a.stride > 1 else "every float"
    if a.fn == "erf1p":
        r.update(tail=float(out[8]), tail_at=float(out[9]), other_tail=float(out[10]), other_tail_at=float(out[11]))
        other = f"h = [{a.against}]" if a.against else "1.0f + af_erf(x)"
        print(f"af_erf1p, {what}, {a.width}-bit{', no FMA' if a.no_fma else ''}: largest absolute error {r['error']:.3g} "
              f"(at {r['at']:.9g}), relative below -0.5 where 1 + erf > 1e-6 {r['tail']:.3g} (at {r['tail_at']:.9g}), "
              f"{r['ns']:.3f} ns an element; NaN wrong: {r['special_failures']}")
        print(f"{other}: {r['other_error']:.3g} (at {r['other_at']:.9g}), {r['other_tail']:.3g} (at "
              f"{r['other_tail_at']:.9g}), {r['other_ns']:.3f} ns an element; {r['differ']} floats differ in their bits")
        return r
    print(f"af_erf, {what}, {a.width}-bit{', no FMA' if a.no_fma else ''}: largest relative error {r['error']:.3g} "
          f"(at {r['at']:.9g}), {r['ns']:.3f} ns an element; NaN, zeros and infinities wrong: {r['special_failures']}")
    if a.against:
        print(f"against h = [{a.against}]: {r['other_error']:.3g} (at {r['other_at']:.9g}), {r['other_ns']:.3f} ns "
              f"an element; {r['differ']} floats differ in their bits")
    return r


if __name__ == "__main__":
    main()
