"""One depthwise convolution's training step on the CPU: eager, aotfuse, and aotfuse with ATen's
gradients (AOTFUSE_DEPTHWISE_GRADS=0), side by side in one process.

    python benchmarks/depthwise.py [--dtype bf16] [--shapes convnext|imagenet|mobilenet] [--kernel 7] [--stride 1]
                                   [--input-grad] [--steps 20]

Each contender trains its own copy of a k x k depthwise `nn.Conv2d` (--kernel, default 7; --stride,
default 1; bias, padding k // 2, channels-last weights and input, as ConvNeXt's and MobileNet's blocks make them) for --steps steps of forward, `(y * g).sum()` and
backward, interleaved, and prints each one's median step time, its peak CPU allocation over one step
(`aotfuse.bench._cpu_peak`) and the largest difference of its weight gradient from float64's (with
--input-grad the input needs its gradient too, as in a network, and that gradient's distance is
printed: a strided bf16/fp16 layer's input gradient is float32's transposed convolution in aotfuse).
Shapes: `convnext` is benchmarks/families.py's ConvNeXt (16 images, 64 x 64 pixels: 16x16 to 2x2
maps), `imagenet` ConvNeXt-T's stages at 8 images of 224 x 224 (56x56 to 7x7), `mobilenet`
MobileNetV2's expanded depthwise layers at 16 images of 64 x 64 (96 channels at 32x32 to 576 at 4x4).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import aotfuse  # noqa: E402
from aotfuse.bench import DTYPES, _cpu_peak  # noqa: E402

SHAPES = {"convnext": [(16, 32, 16), (16, 64, 8), (16, 128, 4), (16, 256, 2)],
          "imagenet": [(8, 96, 56), (8, 192, 28), (8, 384, 14), (8, 768, 7)],
          "mobilenet": [(16, 96, 32), (16, 144, 16), (16, 192, 8), (16, 384, 4), (16, 576, 4)],
          "tiny": [(2, 8, 6)]}
CL = torch.channels_last


def run(n: int, c: int, hw: int, dtype: torch.dtype, steps: int, k: int = 7, stride: int = 1,
        input_grad: bool = False) -> list[dict]:
    torch.manual_seed(0)
    base = nn.Conv2d(c, c, k, stride=stride, padding=k // 2, groups=c).to(dtype).to(memory_format=CL)
    x = torch.randn(n, c, hw, hw).to(dtype).contiguous(memory_format=CL)
    out = (hw + 2 * (k // 2) - k) // stride + 1
    g = torch.randn(n, c, out, out).to(dtype).contiguous(memory_format=CL)
    exact = copy.deepcopy(base).double()
    x64 = x.double().requires_grad_(input_grad)
    (exact(x64) * g.double()).sum().backward()
    x.requires_grad_(input_grad)  # as in a network: the layer's input needs its gradient
    sides = []
    for name, env in (("eager", None), ("aotfuse", "1"), ("aotfuse, ATen's gradients", "0")):
        conv = copy.deepcopy(base)
        if env is not None:
            os.environ["AOTFUSE_DEPTHWISE_GRADS"] = env  # read when the backward is traced (the first call)
            call = aotfuse.memory_efficient_fusion(conv)
        else:
            call = conv

        def step(conv=conv, call=call):
            conv.weight.grad = conv.bias.grad = x.grad = None
            (call(x) * g).sum().backward()

        step()
        os.environ.pop("AOTFUSE_DEPTHWISE_GRADS", None)
        far = (conv.weight.grad.double() - exact.weight.grad).abs().max().item()
        far_in = (x.grad.double() - x64.grad).abs().max().item() if input_grad else float("nan")
        sides.append({"name": name, "step": step, "times": [], "far": far, "far_in": far_in})
    for r in range(steps):
        for s in sides[r % len(sides):] + sides[:r % len(sides)]:
            t0 = time.perf_counter()
            s["step"]()
            s["times"].append(time.perf_counter() - t0)
    for s in sides:
        s["ms"] = statistics.median(s["times"]) * 1e3
        s["peak"] = _cpu_peak(s["step"])
    return sides


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="convnext")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernel", type=int, default=7)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--input-grad", action="store_true",
                    help="the input needs its gradient too (as in a network); adds its distance from float64")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"{a.kernel}x{a.kernel} depthwise convolution, stride {a.stride}, training step"
          f"{' with the input gradient' if a.input_grad else ''} | {a.dtype} | torch {torch.__version__} | "
          f"{a.threads} thread(s)")
    extra = " | input grad's distance from float64: eager / aotfuse" if a.input_grad else ""
    print("| input | eager ms | aotfuse ms | aotfuse, ATen's gradients, ms | peak MB: eager / aotfuse / ATen's "
          f"| weight grad's distance from float64: eager / aotfuse{extra} |")
    print("|---|---|---|---|---|---|" + ("---|" if a.input_grad else ""))
    rows = []
    for n, c, hw in SHAPES[a.shapes]:
        e, ours, aten_side = run(n, c, hw, DTYPES[a.dtype], a.steps, a.kernel, a.stride, a.input_grad)
        tail = f" {e['far_in']:.3g} / {ours['far_in']:.3g} |" if a.input_grad else ""
        print(f"| {n}x{c}x{hw}x{hw} | {e['ms']:.3f} | {ours['ms']:.3f} | {aten_side['ms']:.3f} | "
              f"{e['peak'] / 1e6:.2f} / {ours['peak'] / 1e6:.2f} / {aten_side['peak'] / 1e6:.2f} | "
              f"{e['far']:.3g} / {ours['far']:.3g} |{tail}")
        rows.append({"shape": (n, c, hw), "eager": e, "aotfuse": ours, "aten": aten_side})
    return rows


if __name__ == "__main__":
    main()
