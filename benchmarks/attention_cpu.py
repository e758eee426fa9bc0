"""One attention layer on the CPU, written as eager attention (matmul, scale, causal mask, float32
softmax, matmul), compiled two ways side by side in one process: as written (aotfuse's softmax kernel
between ATen's matmuls, AOTFUSE_FUSE_ATTENTION=0) and as torch's SDPA (ATen's CPU flash kernel,
AOTFUSE_FUSE_ATTENTION=1), with eager beside them; inference (no_grad) and a training step (forward and
backward), bf16 and fp32, over sequence lengths. What attention.py's rule for short bf16 CPU attention
rests on.

    python benchmarks/attention_cpu.py [--lengths 128,256,512,1024] [--dtypes bf16,fp32] [--repeats 20]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import aotfuse  # noqa: E402


class Attention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + mask
        return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(q.dtype), v)


def bench(b: int, h: int, length: int, e: int, dtype: torch.dtype, train: bool, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, e, generator=g).to(dtype) for _ in range(3))
    mask = torch.triu(torch.full((length, length), -1e4), 1).to(dtype)[None, None].expand(b, 1, length, length)
    mask = mask.contiguous()
    contenders = {"eager": Attention()}
    for name, mode in (("as written", "0"), ("sdpa", "1")):
        compiled = aotfuse.memory_efficient_fusion(Attention())
        compiled._aotfuse_compiled.fuse_attention = mode
        contenders[name] = compiled
    ins = [t.clone().requires_grad_(train) for t in (q, k, v)]
    grad = torch.randn(b, h, length, e, generator=g).to(dtype)

    def run(f):
        if train:
            f(*ins, mask).backward(grad)
        else:
            with torch.no_grad():
                f(*ins, mask)

    times = {name: [] for name in contenders}
    for f in contenders.values():
        run(f)
        run(f)
    for r in range(repeats):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in order:
            t0 = time.perf_counter()
            run(contenders[name])
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,256,512,1024")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(f"torch {torch.__version__}, {args.threads} thread(s); batch 4, 64-wide heads (4 heads, 2 from 1024 on); "
          f"medians of {args.repeats} interleaved runs, ms")
    print("| dtype | pass | L | eager | aotfuse as written | aotfuse as SDPA (flash) | SDPA / as written |")
    print("|---|---|---|---|---|---|---|")
    for dt in args.dtypes.split(","):
        for train in (False, True):
            for length in (int(x) for x in args.lengths.split(",")):
                m = bench(4, 4 if length <= 512 else 2, length, 64, dtypes[dt], train,
                          args.repeats if length < 512 else max(args.repeats // 2, 5))
                print(f"| {dt} | {'training step' if train else 'inference'} | {length} | {m['eager']:.2f} | "
                      f"{m['as written']:.2f} | {m['sdpa']:.2f} | {m['sdpa'] / m['as written']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
