"""Where a compiled training step spends its host time, step by step (the C runtime's profiler).

    python benchmarks/profile_steps.py [--model BertForMaskedLM] [--size reduced] [--dtype fp32] [--steps 5] [--phases]
    python benchmarks/profile_steps.py --family convnext  # a model of benchmarks/families.py

Longformer (whose `.item()` needs a graph break) runs as `torch.compile(model, backend="aotfuse")`, as the
seed benchmark's fallback does, and every Dynamo graph's programs are profiled (stages g<k> forward/backward).
Runs one warm-up step, turns on `Program.profiling` for the forward and backward programs, runs
--steps training steps and prints the time per op (extern ATen calls by op name, fused kernels
together) against the whole step and against an eager step, then the slowest steps (a kernel named by
its member ops). On a GPU the times are launch (host)
times, not kernel times. Nothing is written; copy what matters into benchmarks/results/.
"""
from __future__ import annotations

import argparse
import copy
import functools
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, "python")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # families.py

import aotfuse  # noqa: E402
from aotfuse.bench import DTYPES, MODELS, build_model  # noqa: E402


def _step(call, opt, inputs, device="cpu"):
    opt.zero_grad(set_to_none=True)
    call(**inputs).loss.backward()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="BertForMaskedLM", choices=MODELS)
    ap.add_argument("--family", default=None,
                    help="profile one of benchmarks/families.py's models (llama, convnext, ...) instead of --model, "
                         "at that benchmark's size (--size ignored)")
    ap.add_argument("--size", default="reduced", choices=("seed", "reduced", "tiny", "host"))
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--phases", action="store_true",
                    help="also time each phase of a step (zero_grad, forward, backward, optimizer step; medians "
                         "over --steps, contenders interleaved) for aotfuse, eager and torch.compile")
    ap.add_argument("--kernels", action="store_true",
                    help="also run one step of each under torch.profiler and list the top device kernels by time "
                         "(CUDA; on the CPU the top ops by self CPU time): where the GPU time goes")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.family:
        import families

        model, inputs = families.build(a.family, DTYPES[a.dtype])
        model, inputs = model.to(a.device), {k: v.to(a.device) for k, v in inputs.items()}
        desc = f"{a.family} (benchmarks/families.py's size), {sum(p.numel() for p in model.parameters())} parameters"
        dynamo = families.FALLBACK.get(a.family) == "dynamo"
    else:
        model, inputs, desc = build_model(a.model, a.size, DTYPES[a.dtype], a.device)
        dynamo = a.model.startswith("Longformer")
    eager = copy.deepcopy(model)
    lowered: list = []
    if dynamo:
        from aotfuse.dynamo import aotfuse_backend

        compiled = torch.compile(model, backend=functools.partial(aotfuse_backend, collect=lowered), dynamic=False)
    else:
        compiled = aotfuse.memory_efficient_fusion(model)
    opt_c = torch.optim.SGD(model.parameters(), lr=1e-4)
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-4)
    _step(compiled, opt_c, inputs, a.device)
    _step(eager, opt_e, inputs, a.device)
    if dynamo:
        stages = [(f"g{k} {stage}", low) for k, (stage, low) in enumerate(lowered)]
    else:
        stages = [(stage, low) for rec in compiled._aotfuse_compiled.records for stage, low in rec.programs.items()]
    programs = {}
    for stage, low in stages:
        programs[stage] = low.program
        for missing, var in getattr(low, "variants", {}).items():  # backwards run without some output gradients
            programs[f"{stage} (no gradient for inputs {list(missing)})"] = var.program
    for p in programs.values():
        p.profiling = True
    t_comp, t_eager = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        _step(compiled, opt_c, inputs, a.device)
        t_comp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _step(eager, opt_e, inputs, a.device)
        t_eager.append(time.perf_counter() - t0)
    by_op: dict[str, list] = {}
    slowest: list[tuple[float, str]] = []
    in_programs = 0.0
    for stage, p in programs.items():
        runs, steps = p.profile()
        if not runs:  # built but not run in these steps (a backward whose variant ran instead)
            continue
        listing = str(p).splitlines()[1:]  # one line per node after the signature
        members = _kernel_members(p, listing)
        for kind, op, index, sec in steps:
            if kind == "extern" and 0 <= index < len(listing):
                slowest.append((sec / max(runs, 1), f"{stage}: {listing[index].strip()[:110]}"))
            elif kind == "kernel":
                slowest.append((sec / max(runs, 1), f"{stage}: kernel {index}: {members.get(index, '?')}"))
            key = "fused kernels" if kind == "kernel" else op
            entry = by_op.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += sec / max(runs, 1)
            in_programs += sec / max(runs, 1)
    step_c, step_e = statistics.median(t_comp), statistics.median(t_eager)
    print(f"{desc} | {a.dtype} | {a.device} | torch {torch.__version__} | {a.threads} thread(s)")
    if a.device == "cuda":
        print("(cuda: the per-op times are host times, launches included; when 'inside the C programs' is close "
              "to the whole step, the step is bound by the host, not the GPU)")
    print(f"step: aotfuse {step_c * 1e3:.1f} ms, eager {step_e * 1e3:.1f} ms ({step_c / step_e * 100:.0f}%); "
          f"inside the C programs {in_programs * 1e3:.1f} ms, outside (AOTAutograd, optimizer, Python) "
          f"{(step_c - in_programs) * 1e3:.1f} ms")
    fallbacks = sum(p.kernel_fallbacks for p in programs.values())
    print(f"kernel calls that ran as ATen calls instead (a layout the plan did not expect): {fallbacks}")
    print(f"{'op':48s} {'steps':>6s} {'ms/step':>9s} {'share':>6s}")
    for op, (n, sec) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{op:48s} {n:6d} {sec * 1e3:9.2f} {sec / step_c * 100:5.1f}%")
    print("slowest steps (extern calls, and kernels by their members' ops and their first output's type):")
    for sec, line in sorted(slowest, reverse=True)[:a.top]:
        print(f"  {sec * 1e3:7.2f} ms  {line}")
    if a.phases:
        for p in programs.values():
            p.profiling = False  # the phases are timed as a user runs them
        inductor_model = copy.deepcopy(eager)
        inductor = torch.compile(inductor_model, backend="inductor", dynamic=False)
        opt_i = torch.optim.SGD(inductor_model.parameters(), lr=1e-4)
        _phase_table([("aotfuse", compiled, opt_c), ("eager", eager, opt_e), ("torch.compile", inductor, opt_i)],
                     inputs, a.steps, a.device)
    if a.kernels:
        for name, call, opt in (("aotfuse", compiled, opt_c), ("eager", eager, opt_e)):
            _kernel_table(name, lambda: _step(call, opt, inputs, a.device), a.device, a.top)


def _phase_table(contenders: list, inputs: dict, steps: int, device: str) -> None:
    """Median time of each phase of a step per contender (two warm-up steps each, then `steps`
    rounds with the contenders interleaved): where a compiled step gains or loses against another."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = {name: {"zero_grad": [], "forward": [], "backward": [], "optimizer": []} for name, _c, _o in contenders}
    for rnd in range(steps + 2):
        for name, call, opt in contenders:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            sync()
            t1 = time.perf_counter()
            loss = call(**inputs).loss
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
            opt.step()
            sync()
            t4 = time.perf_counter()
            if rnd >= 2:
                for key, dt in zip(times[name], (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[name][key].append(dt)
    print(f"phases (ms, medians of {steps} steps): " + ", ".join(times[contenders[0][0]]))
    for name, phases in times.items():
        print(f"  {name:14s} " + "  ".join(f"{k} {statistics.median(v) * 1e3:7.3f}" for k, v in phases.items()))


def _kernel_members(program, listing: list[str]) -> dict[int, str]:
    """Per kernel (group index): its member ops in program order, shortened (`mul x3`), and the
    type of the value its first member makes, as the program's listing prints it."""
    ops: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for i, (op, _kind, group) in enumerate(program.node_groups()):
        if group < 0:
            continue
        ops.setdefault(group, []).append(op.replace("aten::", "").split(".")[0])
        if group not in first and i < len(listing) and "=" in listing[i]:
            first[group] = listing[i].split("=", 1)[0].split(":", 1)[-1].strip()
    out = {}
    for group, names in ops.items():
        runs = [(name, len(list(same))) for name, same in itertools.groupby(names)]
        text = ", ".join(n if c == 1 else f"{n} x{c}" for n, c in runs)
        out[group] = f"{first.get(group, '')} [{len(names)} nodes] {text}"[:150]
    return out


def _kernel_table(name: str, step, device: str, top: int) -> None:
    """One step under torch.profiler: total device (or CPU) time and the top kernels (ops) by it.
    Our kernels are af_kernel_<group> (the program's group index; `_v` vectorized, `_f` a two-pass
    reduction's finish); groups whose code is the same but for node ids (a model's layers) launch the
    first such group's kernel, so one row sums them."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()  # warm
    with profile(activities=acts) as prof:
        step()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) if device == "cuda" else e.self_cpu_time_total
        if t is None and device == "cuda":
            t = getattr(e, "self_cuda_time_total", 0)
        if t and t > 0:
            rows.append((t, e.count, e.key))
    total = sum(t for t, _c, _k in rows)
    what = "device kernel" if device == "cuda" else "self CPU"
    print(f"{name}: one step, {what} time {total / 1e3:.2f} ms over {sum(c for _t, c, _k in rows)} calls; top {top}:")
    for t, c, k in sorted(rows, reverse=True)[:top]:
        print(f"  {t / 1e3:8.3f} ms {c:5d}x  {k[:100]}")


if __name__ == "__main__":
    main()
