"""Training step (forward + backward) of common blocks on the CPU: eager vs aotfuse vs
torch.compile (inductor), interleaved in one process, medians and ratios, plus compile times and
op counts (eager's top-level ATen ops in torch's profiler against aotfuse's kernels + ATen calls;
views that make no ATen call apart).

    python benchmarks/blocks.py [--repeats 30] [--threads N] [--out benchmarks/results/blocks-cpu.md]

Cold compile: the first call (trace, partition, lower, generate and build kernels) with an empty
aotfuse disk cache (a fresh temporary AOTFUSE_CACHE_DIR); warm: the same in a second process-like
state (fresh compiled function, kernels found in the disk cache). Inductor's cold/warm are its
first call with its own caches as they are (it has an in-process cache too; read warm as a lower
bound for it).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import aotfuse


class MLPBlock(nn.Module):
    """LayerNorm + Linear + GELU + dropout + Linear, residual."""

    def __init__(self, d=256, p=0.1):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(nn.functional.gelu(self.fc1(self.ln(x))))))


def bert_layer(d=256):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(hidden_size=d, num_attention_heads=4, intermediate_size=4 * d, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)
    cfg._attn_implementation = "eager"
    return _First(BertLayer(cfg))


def gpt2_block(d=256):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=d, n_head=4, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    cfg._attn_implementation = "eager"
    return _First(GPT2Block(cfg))


class _First(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        out = self.m(x)
        return out[0] if isinstance(out, tuple) else out


def step_fn(model, x):
    def step():
        out = model(x)
        out.sum().backward()
    return step


def eager_aten_ops(step) -> int:
    """ATen ops one call of `step` dispatches at the top level (ops called by other ATen ops, such
    as addmm inside linear, not counted), as torch's profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    count = 0
    for e in prof.events():
        parent = e.cpu_parent
        count += e.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::"))
    return count


def timed_first_call(make, x):
    t0 = time.perf_counter()
    m = make()
    step_fn(m, x)()
    return time.perf_counter() - t0, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    blocks = {"mlp_ln_gelu_dropout": lambda: MLPBlock(args.dim), "bert_layer": lambda: bert_layer(args.dim),
              "gpt2_block": lambda: gpt2_block(args.dim)}
    rows = []
    for name, make in blocks.items():
        base = make()
        x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
        compile_times = {}
        with tempfile.TemporaryDirectory() as cache:
            old = os.environ.get("AOTFUSE_CACHE_DIR")
            os.environ["AOTFUSE_CACHE_DIR"] = cache
            try:
                compile_times["aotfuse cold"], aot = timed_first_call(
                    lambda: aotfuse.memory_efficient_fusion(copy.deepcopy(base)), x)
                compile_times["aotfuse warm"], _ = timed_first_call(
                    lambda: aotfuse.memory_efficient_fusion(copy.deepcopy(base)), x)
                contenders = {"eager": copy.deepcopy(base), "aotfuse": aot}
                if not args.no_inductor:
                    torch._dynamo.reset()
                    compile_times["inductor cold"], ind = timed_first_call(
                        lambda: torch.compile(copy.deepcopy(base), dynamic=False), x)
                    torch._dynamo.reset()
                    compile_times["inductor warm"], ind = timed_first_call(
                        lambda: torch.compile(copy.deepcopy(base), dynamic=False), x)
                    contenders["torch.compile"] = ind
                steps = {n: step_fn(m, x) for n, m in contenders.items()}
                for fn in steps.values():
                    for _ in range(3):
                        fn()
                times = {n: [] for n in steps}
                for _ in range(args.repeats):
                    for n, fn in steps.items():
                        t0 = time.perf_counter()
                        fn()
                        times[n].append(time.perf_counter() - t0)
            finally:
                if old is None:
                    os.environ.pop("AOTFUSE_CACHE_DIR", None)
                else:
                    os.environ["AOTFUSE_CACHE_DIR"] = old
        med = {n: statistics.median(t) for n, t in times.items()}
        report = aotfuse.explain(aot, x)
        report.eager_ops = eager_aten_ops(steps["eager"])
        rows.append((name, med, compile_times, report))
        print(f"{name}: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in med.items()), flush=True)
    names = list(rows[0][1])
    lines = [
        "# Training step (fwd+bwd) of blocks on the CPU",
        "",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads | torch {torch.__version__} | "
        f"{datetime.date.today()} | batch {args.batch}, seq {args.seq}, dim {args.dim}, dropout 0.1 | median of "
        f"{args.repeats} interleaved steps",
        "",
        "| block | " + " | ".join(f"{n} (ms)" for n in names) + " | eager / aotfuse | "
        + ("torch.compile / aotfuse | " if "torch.compile" in names else "")
        + "eager ATen ops | aotfuse kernels + ATen calls | views without an ATen call |",
        "|---|" + "---|" * (len(names) + 4 + ("torch.compile" in names)),
    ]
    for name, med, _ct, rep in rows:
        cells = [f"{med[n] * 1e3:.2f}" for n in names]
        ratio = f"{med['eager'] / med['aotfuse']:.2f}x"
        ind = f" {med['torch.compile'] / med['aotfuse']:.2f}x |" if "torch.compile" in med else ""
        calls = sum(rep.extern_ops.values())
        ours = rep.fused_kernels + calls
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |{ind} {rep.eager_ops} | "
                     f"{rep.fused_kernels} + {calls} = {ours} ({rep.eager_ops / max(ours, 1):.1f}x fewer) | "
                     f"{sum(rep.views.values())} |")
    lines += ["", "| block | " + " | ".join(f"{k} (s)" for k in rows[0][2]) + " |",
              "|---|" + "---|" * len(rows[0][2])]
    for name, _m, ct, _r in rows:
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ct.values()) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
