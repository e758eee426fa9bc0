"""Decomposed softmax / log_softmax / layer norm (and backwards) as one phased fused kernel each
(reduction epilogues) against ATen's native kernels, one thread, [512 x 8192] fp32.

    python benchmarks/epilogues.py

This is what decides AOTFUSE_DECOMPOSE_NORMS's default: it stays off while the fused kernels are
slower than ATen's.
"""
from __future__ import annotations

import platform
import time

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse.decompositions import default_decompositions
from aotfuse.lower import lower

aten = torch.ops.aten


def _median_ms(f, args, n=20):
    for _ in range(3):
        f(*args)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, gr = torch.randn(512, 8192, generator=g), torch.randn(512, 8192, generator=g)
    w, b = torch.randn(8192, generator=g), torch.randn(8192, generator=g)
    y, ly = torch.softmax(x, -1), torch.log_softmax(x, -1)
    cases = {
        "softmax": (lambda x: torch.softmax(x, -1), (x,)),
        "log_softmax": (lambda x: torch.log_softmax(x, -1), (x,)),
        "softmax backward": (lambda g, y: aten._softmax_backward_data(g, y, -1, torch.float32), (gr, y)),
        "log_softmax backward": (lambda g, y: aten._log_softmax_backward_data(g, y, -1, torch.float32), (gr, ly)),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (8192,), w, b), (x, w, b)),
    }
    print(f"# Epilogue kernels vs ATen (CPU, 1 thread, [512 x 8192] fp32)\n\n{platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; `python benchmarks/epilogues.py`\n")
    print("| op | ATen (ms) | aotfuse phased kernel (ms) | ATen / aotfuse | kernels | phases |")
    print("|---|---|---|---|---|---|")
    for name, (fn, args) in cases.items():
        low = lower(make_fx(fn, decomposition_table=default_decompositions(norms=True))(*args))
        ours = _median_ms(lambda *a: low(list(a)), args)
        aten_ms = _median_ms(fn, args)
        src = low.program.source or ""
        phases = src.split(" phases)")[0].rsplit(", ", 1)[-1] if " phases)" in src else "1"
        print(f"| {name} | {aten_ms:.2f} | {ours:.2f} | {aten_ms / ours:.2f}x | {low.program.num_kernels} | {phases} |")


if __name__ == "__main__":
    main()
