"""aten.cat as windows (AOTFUSE_CAT_WINDOWS, decompositions._cat_windows) against ATen's cat, on the
patterns models make: one process, 1 thread, medians; each case lowered both ways, and eager.

    python benchmarks/cats.py [--dtypes fp32,bf16] [--repeats 200] [--scale 1.0]

Cases: Llama's rotary embedding of q ([4, 8, 128, 64]: x * cos + cat(-x2, x1) * sin), a cat of three
computed inputs along an outer dim ([4, 13, 128, 64]: exp, a product, tanh, then a scale and shift), and GPT2's
backward join of the q, k, v gradients (each [4, 4, 128, 64] permuted back, copied and viewed as
[4, 128, 256], joined along the features). --scale shrinks the sizes (tests).
"""
from __future__ import annotations

import argparse
import os
import platform

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse.bench import median_ms
from aotfuse.decompositions import default_decompositions
from aotfuse.lower import lower

aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin,)


def outer(x):
    return (torch.cat((x.exp(), x[:, :2] * 2, x[:, 2:5].tanh()), 1) * 0.5 + 1.0,)


def heads(a, b, c):
    parts = [aten._unsafe_view(aten.clone(aten.permute(t, [0, 2, 1, 3]), memory_format=torch.contiguous_format),
                               [t.shape[0], t.shape[2], t.shape[1] * t.shape[3]]) for t in (a, b, c)]
    return (torch.cat(parts, 2),)


def _cases(dtype: torch.dtype, scale: float):
    s = lambda n: max(2, int(n * scale))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    t, d = s(128), 64
    return {
        f"rotary [4, 8, {t}, {d}]": (rotary, [r(4, 8, t, d), r(t, d), r(t, d)]),
        f"cat along dim 1 [4, 13, {t}, {d}]": (outer, [r(4, 8, t, d)]),
        f"q, k, v gradients joined [4, {t}, 768]": (heads, [r(4, 4, t, d) for _ in range(3)]),
    }


def _lowered(fn, args, windows: bool):
    old = os.environ.get("AOTFUSE_CAT_WINDOWS")
    os.environ["AOTFUSE_CAT_WINDOWS"] = "1" if windows else "0"
    try:
        table = default_decompositions(norms=True)
    finally:
        if old is None:
            os.environ.pop("AOTFUSE_CAT_WINDOWS")
        else:
            os.environ["AOTFUSE_CAT_WINDOWS"] = old
    return lower(make_fx(fn, decomposition_table=table, tracing_mode="fake")(*args))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# aten.cat as windows against ATen's cat (CPU, 1 thread, {platform.machine()})\n\n"
          f"torch {torch.__version__}; `python benchmarks/cats.py --dtypes {a.dtypes} --repeats {a.repeats}`; "
          "medians, each case lowered both ways in one process\n")
    print("| case | dtype | eager (ms) | ATen's cat: kernels, ms | windows: kernels, ms | windows / ATen's cat |")
    print("|---|---|---|---|---|---|")
    for name in a.dtypes.split(","):
        dtype = DTYPES[name]
        for case, (fn, args) in _cases(dtype, a.scale).items():
            low = {w: _lowered(fn, args, w) for w in (False, True)}
            ref = fn(*args)[0]
            for w, l in low.items():
                got = l(list(args))[0]
                if not torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2):
                    raise SystemExit(f"{case} {name}: windows={w} differs from eager")
            warm = max(3, a.repeats // 10)
            ms = {w: median_ms(lambda l=l: l(list(args)), a.repeats, warm) for w, l in low.items()}
            eager = median_ms(lambda: fn(*args), a.repeats, warm)
            print(f"| {case} | {name} | {eager:.4f} | {low[False].program.num_kernels}, {ms[False]:.4f} | "
                  f"{low[True].program.num_kernels}, {ms[True]:.4f} | {ms[True] / ms[False]:.2f} |")


if __name__ == "__main__":
    main()
