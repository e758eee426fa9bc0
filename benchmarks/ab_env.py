"""A/B of one aotfuse switch (an AOTFUSE_* environment variable) in one process: two compiled copies
of a seed model, one lowered with the variable at its A value and one at its B value, trained in
alternating steps (the order flips each repetition), so that the machine's drift hits both alike.

    python benchmarks/ab_env.py --env AOTFUSE_SINK_COPIES --model LongformerForMaskedLM --size host
    python benchmarks/ab_env.py --env AOTFUSE_COLUMN_PHASED --family swin --dtype bf16 --repeats 20
    python benchmarks/ab_env.py --env AOTFUSE_CHANNELS_LAST_CONVS --family resnet --dtype bf16 --torch-compile

prints each side's median step time, their ratio, each side's peak CPU allocation over one step
(torch's allocation events, as `python -m aotfuse.bench` measures it), each side's loss after the
last step (the two copies start from the same weights and take the same steps, so the losses agree to
rounding) and the programs and fused kernels each side lowered (none: that side ran programs lowered
before, and the A/B says nothing).
The variable is read when a program is lowered (each copy's first steps, Dynamo's pieces included),
so it must be one read then (AOTFUSE_SINK_COPIES, AOTFUSE_REUSE_BUFFERS, AOTFUSE_CONSTANT_FOLD, ...).
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # families.py
import aotfuse  # noqa: E402
from aotfuse.bench import DTYPES, SIZES, _cpu_peak, build_model  # noqa: E402
from aotfuse.dynamo import aotfuse_backend  # noqa: E402
from aotfuse.lower import LIVE  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="the AOTFUSE_* variable to switch")
    ap.add_argument("--a", default="1", help="its value for side A (default 1)")
    ap.add_argument("--b", default="0", help="its value for side B (default 0)")
    ap.add_argument("--model", default="BertForMaskedLM")
    ap.add_argument("--family", default=None,
                    help="one of benchmarks/families.py's models (llama, swin, ...) instead of --model, at that "
                         "benchmark's size (--size ignored)")
    ap.add_argument("--size", default="host", choices=SIZES)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=200, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=1e-8,
                    help="every dropout probability of the config (default aotfuse.bench's 1e-8: drawn, nearly no effect)")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="the attention implementation of a --family model (transformers' default is sdpa)")
    ap.add_argument("--torch-compile", action="store_true",
                    help="each side is torch.compile(model, backend='aotfuse') instead of memory_efficient_fusion")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="the model checkpoints each layer (gradient_checkpointing_enable, non-reentrant)")
    ap.add_argument("--split", action="store_true",
                    help="also time each side's steps inside its programs (the C runtime's profiler): fused kernels "
                         "and extern calls apart, per step, and their A/B ratios. A change to kernels alone moves "
                         "a few percent of a step that matmuls dominate, below the step's spread; the kernels' "
                         "own sum shows it")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.family:
        import families

        model, inputs = families.build(args.family, DTYPES[args.dtype], dropout=args.dropout, attn=args.attn)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        desc = f"{args.family} (benchmarks/families.py's size)"
    else:
        model, inputs, desc = build_model(args.model, args.size, DTYPES[args.dtype], "cpu", attn=args.attn, dropout=args.dropout,
                                          gradient_checkpointing=args.gradient_checkpointing)
    saved = os.environ.get(args.env)
    sides = {}
    programs = {}
    profiled: dict[str, list] = {}
    try:
        for side, value in (("A", args.a), ("B", args.b)):
            os.environ[args.env] = value
            # Dynamo keeps compiled graphs per code object (the model's forward and the functions it
            # calls after a graph break), guarded on the backend but not on the module instance: with
            # one backend, side B would run the graphs side A lowered (Longformer, which needs
            # fallback="dynamo"). A backend object of its own per side keeps them apart.
            if args.torch_compile:
                m = torch.compile(copy.deepcopy(model), backend=functools.partial(aotfuse_backend), dynamic=False)
            else:
                m = aotfuse.memory_efficient_fusion(copy.deepcopy(model), fallback="dynamo")
                compiled = m._aotfuse_compiled
                compiled._dynamo_fn = torch.compile(compiled.fallback_fn, backend=functools.partial(aotfuse_backend),
                                                    dynamic=False)
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)
            made_before = set(LIVE)
            for _ in range(args.warmup):  # lowers every program with the variable at this value
                opt.zero_grad(set_to_none=True)
                m(**inputs).loss.backward()
                opt.step()
            made = list(set(LIVE) - made_before)  # this side's own programs (held by its module)
            sides[side] = (m, opt)
            profiled[side] = [p for low in made for p in [low.program] + [v.program for v in
                                                                           getattr(low, "variants", {}).values()]]
            for p in profiled[side] if args.split else ():
                p.profiling = True
            programs[side] = (len(made), sum(low.program.num_kernels for low in made))
    finally:
        if saved is None:
            os.environ.pop(args.env, None)
        else:
            os.environ[args.env] = saved
    times: dict[str, list[float]] = {s: [] for s in sides}
    losses = {}
    for rep in range(args.repeats):
        for side in ("A", "B") if rep % 2 == 0 else ("B", "A"):
            m, opt = sides[side]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            times[side].append(time.perf_counter() - t0)
            losses[side] = loss.item()
    split = {}
    for side in sides:
        kernels = externs = 0.0
        for p in profiled[side] if args.split else ():
            runs, steps = p.profile()  # totals over the timed steps (and the peak's step below: not yet run)
            p.profiling = False
            for kind, _op, _index, sec in steps:
                if kind == "kernel":
                    kernels += sec
                else:
                    externs += sec
        split[side] = (kernels / args.repeats, externs / args.repeats)
    peaks = {}
    for side, (m, opt) in sides.items():
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            m(**inputs).loss.backward()
            opt.step()

        peaks[side] = _cpu_peak(step)
    gc = ", gradient checkpointing" if args.gradient_checkpointing else ""
    gc += f", dropout {args.dropout:g}, {args.attn} attention" + (", torch.compile(backend='aotfuse')" if args.torch_compile else "")
    print(f"{desc}{gc} | {args.dtype} | torch {torch.__version__} | {args.repeats} steps a side, {args.threads} thread(s)")
    for side, value in (("A", args.a), ("B", args.b)):
        print(f"  {args.env}={value}: step median {statistics.median(times[side]) * 1e3:.3f} ms, peak "
              f"{peaks[side] / 1e6:.3f} MB, last loss {losses[side]:.6f}, {programs[side][0]} programs, "
              f"{programs[side][1]} fused kernels")
    print(f"  A/B: {statistics.median(times['A']) / statistics.median(times['B']):.3f}")
    if args.split:
        for side, value in (("A", args.a), ("B", args.b)):
            print(f"  {args.env}={value}: in fused kernels {split[side][0] * 1e3:.3f} ms a step, in extern calls "
                  f"{split[side][1] * 1e3:.3f} ms (means over the timed steps)")
        print(f"  A/B: fused kernels {split['A'][0] / split['B'][0]:.3f}, extern calls "
              f"{split['A'][1] / split['B'][1]:.3f}")


if __name__ == "__main__":
    main()
