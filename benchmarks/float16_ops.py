"""ATen's 16-bit CPU matmuls, convolutions and attention against the float32 op with conversions, the
way aotfuse runs them where oneDNN has no path for the dtype (AOTFUSE_FLOAT32_COMPUTE,
decompositions._float32_table): one process, 1 thread, medians, and the ratio.

    python benchmarks/float16_ops.py [--dtype fp16|bf16] [--repeats 5] [--scale 1.0]

Rows: mm [512 x 8192] @ [8192 x 256] with each operand contiguous or transposed (the layouts a linear
layer's forward and backward give), bmm [16, 128, 64] @ [16, 64, 128], a 3x3 convolution's training step
([16, 64, 32, 32]) and SDPA's ([4, 4, 128, 64]). "16-bit" is ATen's call on the 16-bit tensors; "float32"
converts the operands, runs float32's op and rounds the results once (what aotfuse's kernels and ATen's
float32 call do, the conversions as separate ATen calls here). --scale shrinks the sizes (tests).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from aotfuse.bench import median_ms


def _cases(dtype: torch.dtype, scale: float):
    s = lambda n: max(8, int(n * scale))  # noqa: E731
    f32 = torch.float32
    m, k, n = s(512), s(8192), s(256)
    for ta in (False, True):
        for tb in (False, True):
            a = (torch.randn(k, m).t() if ta else torch.randn(m, k)).to(dtype)
            b = (torch.randn(n, k).t() if tb else torch.randn(k, n)).to(dtype)
            name = f"mm {'a^T' if ta else 'a'} @ {'b^T' if tb else 'b'}"
            yield name, (lambda a=a, b=b: torch.mm(a, b)), (lambda a=a, b=b: torch.mm(a.to(f32), b.to(f32)).to(dtype))
    a, b = torch.randn(16, s(128), s(64)).to(dtype), torch.randn(16, s(64), s(128)).to(dtype)
    yield "bmm", (lambda: torch.bmm(a, b)), (lambda: torch.bmm(a.to(f32), b.to(f32)).to(dtype))
    x, w = torch.randn(16, s(64), s(32), s(32)), torch.randn(s(64), s(64), 3, 3) * 0.05

    def conv_step(dt, wide):
        xi, wi = x.to(dt).requires_grad_(), w.to(dt).requires_grad_()
        if wide:
            y = F.conv2d(xi.to(f32), wi.to(f32), padding=1).to(dtype)
        else:
            y = F.conv2d(xi, wi, padding=1)
        y.float().sum().backward()
    yield "conv 3x3 step", (lambda: conv_step(dtype, False)), (lambda: conv_step(dtype, True))
    q = torch.randn(4, 4, s(128), s(64))

    def sdpa_step(wide):
        qi = q.to(dtype).requires_grad_()
        y = F.scaled_dot_product_attention(*(qi.to(f32),) * 3).to(dtype) if wide else \
            F.scaled_dot_product_attention(qi, qi, qi)
        y.float().sum().backward()
    yield "sdpa step", (lambda: sdpa_step(False)), (lambda: sdpa_step(True))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"torch {torch.__version__} | {args.dtype} | {args.threads} thread(s) | oneDNN float16 path: "
          f"{torch.ops.mkldnn._is_mkldnn_fp16_supported()}, bfloat16 path: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print("| op | 16-bit (ms) | float32 with conversions (ms) | 16-bit / float32 |")
    print("|---|---|---|---|")
    for name, narrow, wide in _cases(dtype, args.scale):
        t16, t32 = median_ms(narrow, args.repeats), median_ms(wide, args.repeats)
        print(f"| {name} | {t16:.3g} | {t32:.3g} | {t16 / t32:.3g} |")  # significant digits: tiny scales stay > 0


if __name__ == "__main__":
    main()
