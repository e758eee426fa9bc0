"""Layout-changing copies and batch norm on the CPU: aotfuse's kernel against eager's ATen call, one
thread, side by side in one process (medians of --repeats calls, forward only).

    python benchmarks/copies.py [--dtype fp32|bf16|both] [--repeats 50] [--scale 1.0]

The copies are the transposes a pointwise kernel's loop order decides (codegen_common.c,
loop_order: the order with the fewest loads and stores off the inner loop, a far one counting most,
a store more than a load); the batch norm is the training statistics and normalization that
decompositions._batch_norm_table makes one nested phased kernel.
--scale shrinks every shape's batch dim (tests run it small).
"""
from __future__ import annotations

import argparse
import copy
import platform
import time

import torch

import aotfuse


def _median_ms(f, x, n):
    for _ in range(3):
        f(x)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f(x)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def _both_layouts(x):
    """A channels-first normalization's shape (ConvNeXt's layer norm in its backward): one value
    stored channels-last and an NCHW product of it, from an NCHW input."""
    y = x * 0.5 + 1.0
    return torch.relu(y).contiguous(memory_format=torch.channels_last), y * 2.0


def _cases(scale: float):
    def b(n):
        return max(1, int(n * scale))

    return [
        ("relu into channels-last", (b(16), 32, 32, 32),
         lambda x: torch.relu(x).contiguous(memory_format=torch.channels_last)),
        ("last two dims, stride 512", (b(96), 64, 512), lambda x: x.transpose(-1, -2).contiguous()),
        ("last two dims, stride 64", (b(96), 512, 64), lambda x: x.transpose(-1, -2).contiguous()),
        ("permute (0, 2, 3, 1)", (b(4), 128, 4, 64), lambda x: x.permute(0, 2, 3, 1).contiguous()),
        ("NCHW into channels-last and NCHW", (b(16), 32, 16, 16), _both_layouts),
        ("batch norm, training", (b(16), 32, 32, 32), "bn"),
    ]


def main(argv=None) -> list[tuple]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}[a.dtype]
    print(f"{platform.processor() or platform.machine()} | torch {torch.__version__} | 1 thread | medians of {a.repeats}")
    print("| case | shape | dtype | aotfuse (ms) | eager (ms) | aotfuse / eager |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, shape, case_fn in _cases(a.scale):
        for dt in dtypes:
            fn = case_fn
            x = torch.randn(shape).to(dt)
            if fn == "bn":  # a module: its weight, bias and running statistics are its own
                fn = torch.nn.BatchNorm2d(shape[1]).to(dt)
                compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(fn))
            else:
                compiled = aotfuse.memory_efficient_fusion(fn)
            got, ref = compiled(x), fn(x)
            tol = 1e-5 if dt == torch.float32 else 2e-2
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=f"{name} {dt}")
            ours, eager = _median_ms(compiled, x, a.repeats), _median_ms(fn, x, a.repeats)
            rows.append((name, shape, dt, ours, eager))
            print(f"| {name} | {list(shape)} | {str(dt)[6:]} | {ours:.3f} | {eager:.3f} | {ours / eager:.2f} |")
    return rows


if __name__ == "__main__":
    main()
