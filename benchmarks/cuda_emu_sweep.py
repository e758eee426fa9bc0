"""The CUDA path without a GPU, over Hugging Face families: for each (family, dtype) of transformers' auto
mappings (benchmarks/sweep.py's tiny configs and variants), one training step through
memory_efficient_fusion(fallback="dynamo") is recorded (tests/cuda_emu.py's recording_programs), every
program is planned and code-generated for cuda:0, every CUDA group runs in the host emulation against
eager's values of the same nodes (cuda_emu.check), and every program's CUDA source is compiled by NVRTC
for --arch (its ptxas registers and spills). One subprocess per row; a markdown table on stdout, whose
rows also say which of sweep.VARIANTS ran ("-": the first), how many groups were skipped (inputs eager
lays out otherwise: the runtime runs their nodes as ATen calls), how many recomputes with no eager
value no group that ran read (compared with nothing), and which outputs past the tolerance passed
as rounding (cuda_emu.check's float64 criterion: within 4x eager's distance to the graph run in float64).

    python benchmarks/cuda_emu_sweep.py [--tasks causal] [--only llama,gpt2] [--dtypes fp32,bf16] [--jobs 2]

Needs g++ (the emulation) and an NVRTC library (the nvidia-cuda-nvrtc wheel); no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "EMU "


def run_one(task: str, name: str, dt: str, arch: int) -> dict:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import torch
    import aotfuse
    import cuda_emu
    import sweep
    from aotfuse import nvrtc_check
    torch.set_num_threads(1)
    dtype = getattr(torch, sweep.DTYPES[dt])
    res = dict(family=name, dtype=dt)
    t0 = time.time()
    try:
        make, inputs, res["variant"] = sweep.first_runnable(task, name, None, dtype)
    except sweep.NotRunnable as e:
        return dict(res, result=f"skipped: {str(e)[:200]}", s=round(time.time() - t0, 1))
    try:
        model = make().to(dtype)
        kw = {k: x.to(dtype) if x.is_floating_point() else x for k, x in inputs.items()}
        with cuda_emu.recording_programs() as programs:
            out = aotfuse.memory_efficient_fusion(model, fallback="dynamo")(**kw)
            sweep.loss_of(out).backward()
        groups = kernels = regs = spills = skipped = unchecked = 0
        rounding = []  # outputs past the tolerance that the float64 criterion passed
        why: dict[str, int] = {}  # each reason a group was skipped (its value ids left out), how often
        for gm, args in programs:
            ran = cuda_emu.check(gm, args, f"{name} {dt}")
            groups, skipped, unchecked = groups + len(ran), skipped + len(ran.skipped), unchecked + len(ran.unchecked)
            rounding += ran.rounding
            for _, reason in ran.skipped:
                reason = re.sub(r"^input \d+: ", "", reason)
                why[reason] = why.get(reason, 0) + 1
            for k in nvrtc_check.compile_report(cuda_emu.source_of(gm, sm_count=132), arch):
                kernels, regs, spills = kernels + 1, max(regs, k["registers"] or 0), spills + k["spill_stores"]
        worst = max(rounding, key=lambda r: r[2] / max(r[3], 1e-30), default=None)
        res.update(result="ok" + "".join(f"; skipped {k}x: {r}" for r, k in why.items())
                   + (f"; {len(rounding)} outputs past the tolerance passed the float64 criterion (worst: {worst[1]}, "
                      f"{worst[2]:.3g} from float64, eager {worst[3]:.3g})" if rounding else ""),
                   programs=len(programs), groups=groups, skipped=skipped, unchecked=unchecked,
                   kernels=kernels, registers=regs, spills=spills)
    except Exception as e:  # noqa: BLE001 - reported as the row's result
        res.update(result=f"FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                   where=traceback.format_exc().splitlines()[-3][:200])
    return dict(res, s=round(time.time() - t0, 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="causal")
    ap.add_argument("--only", default="")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--one", nargs=3, metavar=("TASK", "NAME", "DTYPE"))
    args = ap.parse_args()
    if args.one:
        print(MARK + json.dumps(run_one(*args.one, args.arch)), flush=True)
        return 0
    sys.path.insert(0, HERE)
    import sweep
    only = set(filter(None, args.only.split(",")))
    todo = [(t, n, d) for t, n in sweep.families(args.tasks.split(",")) if not only or n in only
            for d in args.dtypes.split(",")]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def row(item):
        t, n, d = item
        cmd = [sys.executable, os.path.abspath(__file__), "--one", t, n, d, "--arch", str(args.arch)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
            return json.loads(lines[-1][len(MARK):]) if lines else dict(family=n, dtype=d, result=f"crash rc={p.returncode}")
        except subprocess.TimeoutExpired:
            return dict(family=n, dtype=d, result=f"timeout ({args.timeout} s)")

    print("| family | dtype | variant | result | programs | CUDA groups emulated | groups skipped | "
          "recomputes unchecked | kernels | max registers | spill stores | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    cols = ("programs", "groups", "skipped", "unchecked", "kernels", "registers", "spills", "s")
    with ThreadPoolExecutor(args.jobs) as pool:
        for r in pool.map(row, todo):
            print(f"| {r['family']} | {r['dtype']} | {r.get('variant') or '-'} | {r['result'].replace('|', '/')} | "
                  + " | ".join(str(r.get(c, "")) for c in cols) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
