"""What the first call of a compiled training step costs, and how much of it is building kernels.

For each model (built as aotfuse.bench builds it, random weights): one training step in a fresh
process with an empty kernel cache (cold; every C compiler call the JIT makes is timed, through
AOTFUSE_CC), then one more in another fresh process with the cache it left (warm: the kernels are
loaded, not built); the cache's kernels and shared bodies are counted. Where NVRTC loads, the same
programs planned for cuda:0 are compiled for sm_90 and timed too (`aotfuse.nvrtc_check`; no GPU
needed).

    python benchmarks/compile_time.py [--models AlbertForMaskedLM,...] [--size host] [--out FILE.md]

To compare two builds, run it once with each on PYTHONPATH. --models also takes the models of
benchmarks/families.py by their names there (`flaubert`, `llama`, ...), at that script's one size.

With --lengths L1,L2,...: what each new sequence length costs (batches padded to their longest
example bring one per length). One fresh process per run, empty cache, steps at the model's own
length then at each of L1, L2, ...; per length its first step and the C compiler's seconds in it,
with the defaults and with --off (AOTFUSE_KERNEL_TEMPLATES=0 unless given: kernel templates off;
AOTFUSE_DYNAMIC=0: no shape families), runs alternating, --repeats each:

    python benchmarks/compile_time.py --models BertForMaskedLM --size reduced --lengths 120,112,104,96
    python benchmarks/compile_time.py --models BertForMaskedLM --size reduced --lengths 120,112,104,96 --off AOTFUSE_DYNAMIC=0
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

MODELS = ("AlbertForMaskedLM", "GPT2LMHeadModel", "BertForMaskedLM", "LongformerForMaskedLM")
TIMER_LOG = "AOTFUSE_COMPILE_TIME_LOG"


def timed_compiler(argv: list[str]) -> int:
    """The cold run's AOTFUSE_CC: runs the real compiler with the JIT's own arguments and appends
    when it started and ended to $AOTFUSE_COMPILE_TIME_LOG."""
    t = time.time()
    rc = subprocess.run(argv).returncode
    with open(os.environ[TIMER_LOG], "a") as f:
        f.write(f"{t:.4f} {time.time():.4f}\n")
    return rc


def compiler_wall_seconds(path: str) -> float:
    """The seconds in which at least one C compiler ran (the JIT runs a module's parts at once:
    AOTFUSE_JIT_JOBS), from timed_compiler's log."""
    try:
        with open(path) as f:
            spans = sorted(tuple(map(float, line.split())) for line in f if line.strip())
    except FileNotFoundError:
        return 0.0
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _compiler_seconds() -> float:
    """The C compiler's seconds so far in this run (timed_compiler's log)."""
    return compiler_wall_seconds(os.environ[TIMER_LOG]) if TIMER_LOG in os.environ else 0.0


def child(model: str, size: str, nvrtc: bool, lengths: list[int] | None = None) -> None:
    import warnings

    import torch

    from aotfuse import _C, bench, nvrtc_check

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if model in bench.MODELS:
        m, inputs, _ = bench.build_model(model, size, torch.float32, "cpu")
    else:  # a model of benchmarks/families.py (its one size; --size does not apply)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import families

        m, inputs = families.build(model, torch.float32)
    call = bench._make("aotfuse", m, fallback="dynamo" if model == "LongformerForMaskedLM" else None)
    t = time.perf_counter()
    call(**inputs).loss.backward()
    print(f"FIRST_STEP {time.perf_counter() - t:.3f}")
    gen = torch.Generator().manual_seed(2)
    for length in lengths or ():  # a new signature each: its first step
        batch, vocab = inputs["input_ids"].shape[0], m.config.vocab_size
        step = {k: torch.randint(3, vocab, (batch, length), generator=gen) for k in ("input_ids", "labels")}
        cc0, t = _compiler_seconds(), time.perf_counter()
        call(**step).loss.backward()
        print(f"LENGTH {length} {time.perf_counter() - t:.3f} {_compiler_seconds() - cc0:.3f}", flush=True)
    if nvrtc and nvrtc_check.nvrtc_available() is None:
        torch._dynamo.reset()  # Dynamo's pieces are compiled (and lowered) again, not taken from its cache
        again = bench._make("aotfuse", m, fallback="dynamo" if model == "LongformerForMaskedLM" else None)
        total, kernels = 0.0, 0
        for _name, source, _launches in nvrtc_check.cuda_sources(nvrtc_check.captured_graphs(again, **inputs)):
            t = time.perf_counter()
            _C.nvrtc_compile(source, 90)
            total += time.perf_counter() - t
            kernels += source.count("__global__")
        print(f"NVRTC {total:.3f} {kernels}")


def _run_child(model: str, size: str, cache: str, nvrtc: bool, cc: str | None, lengths: str = "-",
               env_extra: dict | None = None) -> str:
    env = dict(os.environ, AOTFUSE_CACHE_DIR=cache, **(env_extra or {}))
    if cc:
        env.update(AOTFUSE_CC=f"{sys.executable} {os.path.abspath(__file__)} --timed-cc {cc}",
                   **{TIMER_LOG: os.path.join(cache, "compile-times")})
    out = subprocess.run([sys.executable, __file__, "--child", model, size, "nvrtc" if nvrtc else "-", lengths], env=env,
                         capture_output=True, text=True)
    if not re.search(r"FIRST_STEP ([0-9.]+)", out.stdout) or out.returncode:
        raise RuntimeError(f"{model}: a step failed:\n{out.stderr[-2000:]}")
    return out.stdout


def first_step(model: str, size: str, cache: str, nvrtc: bool = False, cc: str | None = None) -> tuple[float, str]:
    """(seconds, NVRTC's cell: seconds and CUDA kernels compiled, or why not). With cc, every C
    compile of the JIT goes through timed_compiler (its seconds in cache/compile-times)."""
    stdout = _run_child(model, size, cache, nvrtc, cc)
    m = re.search(r"FIRST_STEP ([0-9.]+)", stdout)
    n = re.search(r"NVRTC ([0-9.]+) (\d+)", stdout)
    return float(m.group(1)), f"{float(n.group(1)):.2f} ({n.group(2)} kernels)" if n else "no NVRTC"


def cache_facts(cache: str) -> dict:
    sources = sorted(f for f in os.listdir(cache) if f.endswith(".c"))
    text = [open(os.path.join(cache, f)).read() for f in sources]
    compile_s = compiler_wall_seconds(os.path.join(cache, "compile-times"))
    return {"programs": len(sources), "kernels": sum(len(re.findall(r"\bvoid af_kernel_\d+\(", s)) for s in text),
            "bodies": sum(s.count("AF_BODY void af_body_") for s in text), "c_kb": sum(map(len, text)) / 1e3,
            "so_kb": sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".so")) / 1e3,
            "cc_s": compile_s}


def _write(lines: list[str], out: str | None) -> None:
    """The table, to `out` too (markdown) when given."""
    if out:
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        print("written:", out)


def new_lengths(args) -> None:
    import aotfuse
    import torch

    var, _, value = args.off.partition("=")
    settings = (("default", {}), ("off", {var: value}))
    from aotfuse import bench

    size = f"{args.size} size" if all(m in bench.MODELS for m in args.models.split(",")) else \
        "benchmarks/families.py's size"
    lines = [f"# A new sequence length's first step, {size} ({datetime.date.today()})", "",
             f"machine: {platform.machine()} {platform.processor()} | {os.cpu_count()} CPUs | AOTFUSE_JIT_JOBS={os.environ.get('AOTFUSE_JIT_JOBS', 'unset')} | torch {torch.__version__} | "
             f"1 thread | aotfuse from {os.path.dirname(aotfuse.__file__)} | `python benchmarks/compile_time.py "
             f"--models {args.models} --size {args.size} --lengths {args.lengths} --repeats {args.repeats} --off {args.off}`", "",
             "| model | length | first step, default (s) | C compiler, default (s) | first step, off (s) | C compiler, off (s) |",
             "|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
        for _ in range(args.repeats):
            for name, env in settings:
                cache = tempfile.mkdtemp(prefix="aotfuse-new-lengths-")
                try:
                    stdout = _run_child(model, args.size, cache, False, args.cc, args.lengths, env)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                row = {"first": (float(re.search(r"FIRST_STEP ([0-9.]+)", stdout).group(1)), None)}
                for length, secs, cc_s in re.findall(r"LENGTH (\d+) ([0-9.]+) ([0-9.]+)", stdout):
                    row[length] = (float(secs), float(cc_s))
                runs[name].append(row)

        def cell(name: str, key: str, i: int) -> str:
            vals = [r[key][i] for r in runs[name] if r.get(key) and r[key][i] is not None]
            return "-" if not vals else f"{min(vals):.2f}" if len(set(vals)) == 1 else f"{min(vals):.2f}-{max(vals):.2f}"

        for key in ["first"] + args.lengths.split(","):
            label = "model's own (cold)" if key == "first" else key
            lines.append(f"| {model} | {label} | {cell('default', key, 0)} | {cell('default', key, 1)} | "
                         f"{cell('off', key, 0)} | {cell('off', key, 1)} |")
            print(lines[-1], flush=True)
    lines += ["", "Each run a fresh process and an empty kernel cache; a length's first step includes tracing, "
              f"partitioning, lowering and the kernels it compiles (C compiler: the seconds of the C compiler calls "
              f"made in that step, timed through AOTFUSE_CC). off: {args.off}. Ranges over the runs."]
    _write(lines, args.out)


def main() -> None:
    if sys.argv[1:2] == ["--timed-cc"]:
        sys.exit(timed_compiler(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--size", default="host")
    ap.add_argument("--cc", default=os.environ.get("AOTFUSE_CC", "cc"), help="the C compiler the JIT calls (timed)")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    ap.add_argument("--lengths", default=None, help="L1,L2,...: each new sequence length's first step (see above)")
    ap.add_argument("--repeats", type=int, default=2, help="with --lengths: runs per setting")
    ap.add_argument("--off", default="AOTFUSE_KERNEL_TEMPLATES=0",
                    help="with --lengths: VAR=VALUE of the runs compared with the default ones (AOTFUSE_DYNAMIC=0: "
                         "without shape families)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        lengths = [int(n) for n in args.child[3].split(",")] if args.child[3] != "-" else None
        child(args.child[0], args.child[1], args.child[2] == "nvrtc", lengths)
        return
    if args.lengths:
        new_lengths(args)
        return
    import aotfuse
    import torch

    lines = [f"# First call: cold and warm kernel cache, {args.size} size ({datetime.date.today()})", "",
             f"machine: {platform.machine()} {platform.processor()} | {os.cpu_count()} CPUs | AOTFUSE_JIT_JOBS={os.environ.get('AOTFUSE_JIT_JOBS', 'unset')} | torch {torch.__version__} | "
             f"aotfuse from {os.path.dirname(aotfuse.__file__)} | `python benchmarks/compile_time.py --size {args.size}`", "",
             "| model | programs | kernels | bodies | C source (KB) | .so (KB) | C compiler (s) | first step cold (s) | warm (s) | NVRTC sm_90 (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        cache = tempfile.mkdtemp(prefix="aotfuse-compile-time-")
        try:
            cold, _ = first_step(model, args.size, cache, cc=args.cc)
            f = cache_facts(cache)  # before the warm run, which must compile nothing
            warm, nvrtc = first_step(model, args.size, cache, nvrtc=True, cc=args.cc)  # the same AOTFUSE_CC: cache hits
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        lines.append(f"| {model} | {f['programs']} | {f['kernels']} | {f['bodies']} | {f['c_kb']:.0f} | {f['so_kb']:.0f} | "
                     f"{f['cc_s']:.2f} | {cold:.1f} | {warm:.1f} | {nvrtc} |")
        print(lines[-1], flush=True)
    lines += ["", "C compiler: the seconds in which a C compiler the JIT started in the cold run was running (timed through "
              "AOTFUSE_CC; calls running at once, a module's parts, counted once); "
              "bodies: kernels compiled once for kernels that differ only in node ids and dropout streams; "
              "NVRTC: the same programs planned for cuda:0 (aotfuse.nvrtc_check), compiled for sm_90, summed "
              "(kernels: __global__ functions compiled, vectorized variants and finishing passes included)."]
    _write(lines, args.out)


if __name__ == "__main__":
    main()
