"""Per-call overhead of a compiled call against eager, for a small MLP where op time is tiny.

Runs the contenders interleaved in one process and prints medians (microseconds) and ratios:
    python benchmarks/overhead.py [--repeats 2000] [--out benchmarks/results/overhead-cpu.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import torch.nn as nn

import aotfuse


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write a markdown table here")
    ap.add_argument("--no-inductor", action="store_true", help="leave torch.compile out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(8, 16)
    contenders = {"eager": model, "aotfuse": aotfuse.memory_efficient_fusion(model)}
    if not args.no_inductor:
        contenders["torch.compile"] = torch.compile(model, dynamic=False)

    def fwd(m):
        return lambda: m(x)

    def fwd_bwd(m):
        def step():
            m(x).sum().backward()
        return step

    def fwd_nograd(m):
        def step():
            with torch.no_grad():
                m(x)
        return step

    cases = {"forward (grad on)": fwd, "forward+backward": fwd_bwd, "forward (no_grad)": fwd_nograd}
    results: dict[tuple[str, str], list[float]] = {}
    for case, make in cases.items():
        fns = {name: make(m) for name, m in contenders.items()}
        for fn in fns.values():  # warm up: compile and load outside the numbers
            for _ in range(20):
                fn()
        for _ in range(args.rounds):  # interleaved rounds
            for name, fn in fns.items():
                results.setdefault((case, name), []).extend(_time(fn, args.repeats // args.rounds))
    lines = [
        f"# Per-call overhead, small MLP (8x16 -> 32 -> 16), CPU, 1 thread",
        "",
        f"machine: {platform.machine()} {platform.processor() or ''} | torch {torch.__version__} | "
        f"python {platform.python_version()} | {datetime.date.today()} | median of {args.repeats} calls",
        "",
        "| case | " + " | ".join(f"{n} (us)" for n in contenders) + " | aotfuse - eager (us) | aotfuse / eager |",
        "|---|" + "---|" * (len(contenders) + 2),
    ]
    for case in cases:
        med = {n: statistics.median(results[(case, n)]) for n in contenders}
        lines.append(f"| {case} | " + " | ".join(f"{med[n]:.1f}" for n in contenders)
                     + f" | {med['aotfuse'] - med['eager']:+.1f} | {med['aotfuse'] / med['eager']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
