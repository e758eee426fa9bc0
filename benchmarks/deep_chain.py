"""Planning time of a deep model whose layers are joined by pointwise work only.

A stack of residual blocks x + gelu(layer_norm(linear(x))): the backward recomputes the residual
stream from the saved linear outputs, a pointwise chain through every layer. Before kernels were
bounded at 256 nodes (fuse.c, AF_GROUP_NODES_MAX) that chain was one kernel, and the code
generators' per-kernel passes grow with its size squared. Since 2026-12-05 the default partition
saves every other stream value (csrc/partition.c, ban_chained_materialized), so its kernels are small;
`AOTFUSE_RECOMPUTE_CHAINS=1 python benchmarks/deep_chain.py` brings the chain back (the case the bound
is for, with the old cut's memory); benchmarks/chain_models.py compares both cuts in one process.

For each depth, in a fresh process with an empty kernel cache: the first training step (trace,
partition, lowering, C compile, run), the seconds spent lowering (the C core's planning and code
generation: aotfuse.lower.lower), the largest kernel's node count, the steady step against
eager's (medians of --steps steps, interleaved), and the peak memory of a step beyond what it began
with (torch's CPU allocation events, as aotfuse.bench measures it), eager's and aotfuse's.

    python benchmarks/deep_chain.py [--layers 25,50,100] [--width 64] [--batch 32] [--steps 20] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time


def child(layers: int, steps: int, width: int, batch: int) -> None:
    import copy
    import statistics
    import warnings

    import torch
    import torch.nn as nn

    import aotfuse
    import aotfuse.lower as lower_mod
    from aotfuse.bench import _cpu_peak

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.norm(self.lin(x)))

    spent = [0.0]
    orig = lower_mod.lower

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    lower_mod.lower = timed
    import aotfuse.compile as compile_mod
    compile_mod.lower = timed

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(layers)])
    eager = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(batch, width)

    def step(m):  # a training step's forward and backward, the gradients set to None first
        for p in m.parameters():
            p.grad = None
        m(x).sum().backward()

    t = time.perf_counter()
    step(compiled)
    first = time.perf_counter() - t
    largest = 0
    for low in compiled._aotfuse_compiled.records[-1].programs.values():
        groups = collections.Counter(g for _op, _k, g in low.program.node_groups() if g >= 0)
        largest = max([largest, *groups.values()])
    times: dict[str, list] = {"eager": [], "aotfuse": []}
    for _ in range(steps):
        for name, m in (("eager", eager), ("aotfuse", compiled)):
            t = time.perf_counter()
            step(m)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    peaks = [_cpu_peak(lambda m=m: step(m)) / 1e6 for m in (eager, compiled)]
    print(f"RESULT {layers} {first:.2f} {spent[0]:.2f} {largest} {med['eager'] * 1e3:.3f} {med['aotfuse'] * 1e3:.3f} "
          f"{peaks[0]:.2f} {peaks[1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="25,50,100")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch

    switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("AOTFUSE_"))
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} CPUs, 1 torch thread | python {platform.python_version()} | "
             f"torch {torch.__version__} | date {datetime.date.today()}", "",
             f"width {args.width}, batch {args.batch}" + (f", {switches}" if switches else ""), "",
             "| layers | first step (s) | lowering (s) | largest kernel (nodes) | eager step (ms) | aotfuse step (ms) "
             "| eager peak (MB) | aotfuse peak (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for layers in [int(v) for v in args.layers.split(",")]:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, AOTFUSE_CACHE_DIR=cache, OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, __file__, "--child", str(layers), str(args.steps), str(args.width),
                                  str(args.batch)], env=env,
                                 capture_output=True, text=True)
        row = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
        if not row:
            lines.append(f"| {layers} | failed: {out.stderr.strip().splitlines()[-1:]} | | | | | | |")
        else:
            _, n, first, low, largest, e, a, pe, pa = row[0].split()
            lines.append(f"| {n} | {first} | {low} | {largest} | {e} | {a} | {pe} | {pa} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
