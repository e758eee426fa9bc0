"""DistributedDataParallel training step, side by side: eager DDP, aotfuse (memory_efficient_fusion of the
DDP), aotfuse under torch.compile (torch.compile(DDP, backend="aotfuse")) and torch.compile (Inductor), in
one process group of N processes (gloo on the CPU, nccl on GPUs), one of the seed's models each; also
aotfuse-no-overlap (memory_efficient_fusion with AOTFUSE_DDP_OVERLAP=0: DDP's reducer all-reduces after the
compiled backward, not the backward's buckets during it) and ddp-of-aotfuse (DDP(memory_efficient_fusion(model)):
its first step eager, the later ones syncing in the compiled backward as aotfuse's). --bucket-cap-mb sets
DDP's bucket size; --accumulate N makes each step N micro-steps, all but the last under no_sync().

    python benchmarks/ddp.py --models BertForMaskedLM,GPT2LMHeadModel --size reduced --nproc 2

launches itself under torchrun. Every contender is its own copy of the model (the same weights), wrapped
in its own DDP; each rank trains on its own batch. Contenders take turns, a few steps each, the order
rotating every round, so the machine's drift hits all alike. Rank 0 prints and writes (markdown, under
benchmarks/results/ unless --out) each contender's median step time and peak memory over one step (torch's
allocations beyond the step's start: the profiler's events on the CPU, max_memory_allocated on a GPU), their
ratios to eager DDP's, the allreduced loss after the last step (the copies take the same steps: it agrees to rounding) and whether
every rank ended with the same weights (the gradients were all-reduced).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("eager", "aotfuse", "aotfuse-dynamo", "torch.compile")
# also: aotfuse-no-overlap, memory_efficient_fusion with AOTFUSE_DDP_OVERLAP=0 (DDP's reducer all-reduces
# after the compiled backward, not its buckets during it); ddp-of-aotfuse, DDP(memory_efficient_fusion(model))


def _wrap(name: str, model: torch.nn.Module, device_ids: list | None, bucket_cap_mb: float = 25) -> torch.nn.Module:
    import aotfuse
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name == "ddp-of-aotfuse":
        return DDP(aotfuse.memory_efficient_fusion(model, fallback="dynamo"), device_ids=device_ids,
                   bucket_cap_mb=bucket_cap_mb)
    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    if name == "eager":
        return ddp
    if name in ("aotfuse", "aotfuse-no-overlap"):
        return aotfuse.memory_efficient_fusion(ddp, fallback="dynamo")
    if name == "aotfuse-dynamo":
        return torch.compile(ddp, backend="aotfuse", dynamic=False)
    if name == "torch.compile":
        return torch.compile(ddp, dynamic=False)
    raise ValueError(name)


def _peak(fn, cuda: bool) -> int:
    """Peak bytes allocated during one step beyond what was allocated when it began (rank 0's)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from aotfuse.bench import _cpu_peak

    return _cpu_peak(fn)


def _same_on_every_rank(model: torch.nn.Module) -> bool:
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return all(torch.equal(p, parts[0]) for p in parts[1:])


def _user_args(argv: list[str]) -> list[str]:
    """The worker's arguments less what main() added (--worker, its --out unless the user gave one)."""
    out = [a for a in argv if a != "--worker"]
    if out[:1] == ["--out"] and "--out" in out[2:]:
        out = out[2:]
    elif out[:1] == ["--out"] and os.path.dirname(os.path.abspath(out[1])) == os.path.join(HERE, "results"):
        out = out[2:]
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from aotfuse.bench import DTYPES, _machine, build_model

    cuda = torch.cuda.is_available() and not args.cpu
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    lines = []
    for name in args.models.split(","):
        base, inputs, desc = build_model(name, args.size, dtype, device)
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, as DDP trains
        inputs = {k: torch.randint(3, int(v.max()) + 1, v.shape, generator=g).to(device) for k, v in inputs.items()}
        contenders, first = {}, {}
        for c in args.contenders.split(","):
            model = copy.deepcopy(base)
            wrapped = _wrap(c, model, [torch.cuda.current_device()] if cuda else None, args.bucket_cap_mb)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            contenders[c] = (model, wrapped, opt)

        def step(c: str) -> float:
            model, wrapped, opt = contenders[c]
            opt.zero_grad(set_to_none=True)
            if c == "aotfuse-no-overlap":  # read at each call (ddp.plan)
                os.environ["AOTFUSE_DDP_OVERLAP"] = "0"
            try:
                for micro in range(args.accumulate):  # gradient accumulation: no_sync() but for the last
                    last = micro == args.accumulate - 1
                    with contextlib.nullcontext() if last else wrapped.no_sync():
                        loss = wrapped(**inputs).loss
                        loss.backward()
            finally:
                os.environ.pop("AOTFUSE_DDP_OVERLAP", None)
            opt.step()
            return loss.detach().float()

        for c in contenders:  # compiles
            t0 = time.perf_counter()
            step(c)
            first[c] = time.perf_counter() - t0
        times: dict[str, list[float]] = {c: [] for c in contenders}
        order = list(contenders)
        losses = {}
        for r in range(args.rounds):
            for c in order[r % len(order):] + order[:r % len(order)]:
                for _ in range(args.warmup):
                    step(c)
                for _ in range(args.steps):
                    if cuda:
                        torch.cuda.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    losses[c] = step(c)
                    if cuda:
                        torch.cuda.synchronize()
                    times[c].append(time.perf_counter() - t0)
        rows = []
        for c, (model, _, _) in contenders.items():
            loss = losses[c].clone()
            dist.all_reduce(loss)
            peak = _peak(lambda: step(c), cuda)
            rows.append((c, statistics.median(times[c]), first[c], peak, loss.item() / world, _same_on_every_rank(model)))
        if rank == 0:
            eager = dict((r[0], r[1]) for r in rows).get("eager")
            lines += [f"### {desc}, {args.dtype}, {world} processes", "",
                      "| contender | step ms (median) | vs eager DDP | first step s | peak MB | vs eager DDP | "
                      "mean loss after | ranks agree |",
                      "|---|---|---|---|---|---|---|---|"]
            eager_peak = dict((r[0], r[3]) for r in rows).get("eager")
            for c, med, f, peak, loss, agree in rows:
                ratio = f"{med / eager:.3f}" if eager else "-"
                peak_ratio = f"{peak / eager_peak:.3f}" if eager_peak else "-"
                lines.append(f"| {c} | {med * 1e3:.1f} | {ratio} | {f:.1f} | {peak / 2**20:.1f} | {peak_ratio} | "
                             f"{loss:.5f} | {agree} |")
            lines.append("")
            print("\n".join(lines[-len(rows) - 5:]), flush=True)
    if rank == 0:
        header = [f"# DDP training step, {datetime.date.today()}", "",
                  f"`python benchmarks/ddp.py {' '.join(_user_args(sys.argv[1:]))}`", "",
                  f"Machine: {_machine('cuda' if cuda else 'cpu')}, {world} processes x {args.threads} threads, "
                  f"{args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps per contender"
                  + (f", each step {args.accumulate} micro-steps (all but the last under no_sync())"
                     if args.accumulate > 1 else "") + ".", ""]
        with open(args.out, "w") as f:
            f.write("\n".join(header + lines))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="BertForMaskedLM,GPT2LMHeadModel,AlbertForMaskedLM")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--size", default="reduced")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU even where there are GPUs")
    ap.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's bucket_cap_mb (default DDP's 25)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-steps a step, all but the last under DDP's no_sync() (gradient accumulation)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"ddp-{'cpu' if args.cpu or not torch.cuda.is_available() else 'cuda'}"
                                f"-{datetime.date.today()}.md")
    if args.worker:
        worker(args)
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.abspath(__file__), "--worker", "--out", args.out, *argv]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
