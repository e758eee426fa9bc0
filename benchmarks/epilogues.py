"""Decomposed softmax / log_softmax / layer norm (and backwards) as one phased fused kernel each
(reduction epilogues) against ATen's native kernels: on the CPU one thread, [512 x 8192] fp32; on a GPU
(--device cuda) the seed's Bert shapes (layer norm [2048 x 768], attention softmax [49152 x 512], the
MLM head's log_softmax [2048 x 30522]), fp32 and bf16, plus a residual add fused into the layer norm
and cross entropy (log_softmax + nll_loss, decomposed by default) forward and backward at the
log_softmax's shape.

    python benchmarks/epilogues.py [--device cuda]

Norms are decomposed by default (AOTFUSE_DECOMPOSE_NORMS=0 keeps ATen's): whole models measured as fast
or faster so on the CPU (benchmarks/ab_env.py), though the CPU softmax alone is slower than ATen's; on
a GPU this and the seed benchmark's aotfuse-aten-norms contender tell whether that holds there.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from aotfuse.decompositions import default_decompositions
from aotfuse.lower import lower

aten = torch.ops.aten


def _median_ms(f, args, n=20, cuda=False):
    for _ in range(3):
        f(*args)
    ts = []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        f(*args)
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def _cases(device: str, dtype: torch.dtype, shape: tuple[int, int] | None = None):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if shape is not None:
        rows = cols = sm_rows = ls_rows = shape
    elif device == "cpu":
        rows, cols = (512, 8192), (512, 8192)
        sm_rows = ls_rows = (512, 8192)
    else:  # the seed's Bert: 4 x 512 tokens, hidden 768, 12 heads, vocab 30522
        rows, cols = (2048, 768), (2048, 768)
        sm_rows, ls_rows = (4 * 12 * 512, 512), (2048, 30522)
    x, r = randn(*rows), randn(*rows)
    w, b = randn(cols[1]), randn(cols[1])
    s, gs = randn(*sm_rows), randn(*sm_rows)
    ls, gl = randn(*ls_rows), randn(*ls_rows)
    y, ly = torch.softmax(s, -1), torch.log_softmax(ls, -1)
    t = torch.randint(0, ls_rows[1], (ls_rows[0],), generator=g).to(device)
    gloss, tw = torch.ones((), device=device, dtype=dtype), torch.tensor(float(ls_rows[0]), device=device, dtype=dtype)
    n = cols[1]
    return {
        "softmax": (lambda x: torch.softmax(x, -1), (s,)),
        "log_softmax": (lambda x: torch.log_softmax(x, -1), (ls,)),
        "softmax backward": (lambda g, y: aten._softmax_backward_data(g, y, -1, dtype), (gs, y)),
        "log_softmax backward": (lambda g, y: aten._log_softmax_backward_data(g, y, -1, dtype), (gl, ly)),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (n,), w, b), (x, w, b)),
        "add + layer_norm": (lambda x, r, w, b: F.layer_norm(x + r, (n,), w, b), (x, r, w, b)),
        # the loss (decompositions.py): log_softmax + nll_loss, and their backwards from the log-probs
        "cross entropy": (lambda x, t: F.cross_entropy(x, t), (ls, t)),
        "cross entropy backward": (lambda g, y, t, tw: aten._log_softmax_backward_data(
            aten.nll_loss_backward(g, y, t, None, 1, -100, tw), y, -1, dtype), (gloss, ly, t, tw)),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--shape", default=None, help="ROWSxCOLS for every case (default: 512x8192 on the CPU, "
                    "the seed's Bert shapes on a GPU); small shapes show the host time a call costs")
    a = ap.parse_args(argv)
    shape = tuple(int(v) for v in a.shape.lower().split("x")) if a.shape else None
    cuda = a.device == "cuda"
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    dtypes = [torch.float32, torch.bfloat16] if cuda else [torch.float32]
    where = torch.cuda.get_device_name(0) if cuda else f"CPU, 1 thread, {platform.processor() or platform.machine()}"
    print(f"# Epilogue kernels vs ATen ({where})\n\ntorch {torch.__version__}; `python benchmarks/epilogues.py"
          f"{' --device cuda' if cuda else ''}{' --shape ' + a.shape if a.shape else ''}`; medians of 20 "
          "(CUDA-synchronized on the GPU)\n")
    print("| op | dtype | shape | ATen (ms) | aotfuse phased kernel (ms) | ATen / aotfuse | kernels | phases |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for name, (fn, args) in _cases(a.device, dtype, shape).items():
            low = lower(make_fx(fn, decomposition_table=default_decompositions(norms=True))(*args))
            ours = _median_ms(lambda *t: low(list(t)), args, cuda=cuda)
            aten_ms = _median_ms(fn, args, cuda=cuda)
            src = (low.program.cuda_source if cuda else low.program.source) or ""
            phases = src.split(" phases)")[0].rsplit(", ", 1)[-1] if " phases)" in src else "1"
            shape = "x".join(str(d) for d in max(args, key=lambda a: a.numel()).shape)
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {shape} | {aten_ms:.3f} | {ours:.3f} | {aten_ms / ours:.2f}x | "
                  f"{low.program.num_kernels} | {phases} |")


if __name__ == "__main__":
    main()
