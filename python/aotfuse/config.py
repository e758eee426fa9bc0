"""Environment configuration, read when used (so tests can change it).

AOTFUSE_DISABLE=1      run eagerly (for bisecting); torch.compile(backend="aotfuse") graphs run
                       as their own FX code
AOTFUSE_LOG=a,b        log stages: partition, lowering, fusion, codegen, cache (and "all")
AOTFUSE_CACHE_SIZE=N   compiled signatures kept per function (default 8)
AOTFUSE_CHECK_INPUTS=0 skip the C runtime's check of each input against the program
AOTFUSE_FUSION=0       no fused kernels: every node runs as an extern ATen call
AOTFUSE_BACKEND=name   which tensors get generated kernels: auto (default; C for CPU tensors,
                       CUDA through NVRTC for CUDA tensors), c, cuda, or aten (none)
AOTFUSE_NVRTC=path     the libnvrtc to use (else found beside torch, CUDA or the nvidia wheels)
AOTFUSE_CACHE_DIR=dir  where compiled kernels are kept (default $XDG_CACHE_HOME/aotfuse or
                       ~/.cache/aotfuse)
AOTFUSE_CONSTANT_FOLD=0  compute the values no input reaches every run (default: once, when
                       lowering; see constfold.py)
AOTFUSE_FALLBACK_RANDOM=1  dropout with ATen's generator (eager's exact masks, a stored mask)
                       instead of aotfuse's fused counter-based one
AOTFUSE_REUSE_BUFFERS=0  every kernel output freshly allocated (default: a kernel output may take
                       the tensor of an intermediate that died earlier in the program)
AOTFUSE_HUGE_PAGES=N    fresh CPU tensors of N MiB or more that a program allocates (kernel outputs,
                       extern results) get transparent huge pages before their first write
                       (madvise; default 32, where glibc's allocations are their own mmaps; 0: off)
AOTFUSE_DEPTHWISE_GRADS=0  keep ATen's gradients of a CPU depthwise convolution (default: for 5x5
                       to 7x7, and 3x3 on a map smaller than the kernel, the weight's as kh x kw
                       fused column sums over slices of the padded input; a strided bf16/fp16 one's input gradient as float32's transposed
                       convolution, rounded once; decompositions.py)
AOTFUSE_ERF1P=0        keep a float32 `erf(x) + 1` (GELU's) as two ops (default: one, aotfuse::erf1p,
                       computed as 1 + erf without erf's small-argument series; erf1p.py)
AOTFUSE_LM_GRAD_CHUNKS=0  make a language-model head's float32 logits gradient whole, as traced
                       (default: in vocabulary chunks, lm_grads.py)
AOTFUSE_DROP_CLONES=0  keep clones of a value in its own layout (default: dropped before partitioning)
AOTFUSE_FUSE_ATTENTION=auto  eager attention as torch's SDPA (attention.py): auto on CUDA tensors, and
                       on float32/float16 CPU tensors where it has no dropout; 1 also with dropout
                       and in bfloat16 on CPU; 0 never
AOTFUSE_DYNAMIC=auto   shape families (shapes.py): auto (default) traces a signature's second shape with
                       the sizes that differ symbolic, once for all its shapes; 1 from the first call
                       (every size of the non-parameter inputs); 0 never (each shape traced on its own)
AOTFUSE_SHAPE_PROGRAMS=N  programs a family's forward or backward keeps (default 64, least recently
                       used dropped)
AOTFUSE_CUDA_KEEP_RANDOM=0  CUDA phased kernels draw dropout's numbers again in every pass (default:
                       drawn once, each lane keeping its values for the later passes)
AOTFUSE_MERGE_KERNELS=0  independent kernels of one loop stay separate (default: merged into one,
                       fuse.c's merge_independent_groups)
AOTFUSE_DDP_OVERLAP=0  memory_efficient_fusion(DDP(model)): DDP's reducer all-reduces the gradients
                       after the compiled backward (default: the backward program all-reduces them
                       bucket by bucket as it makes them, ddp.py)
AOTFUSE_RECOMPUTE_MATERIALIZED=auto  values the backward writes out anyway (a matmul's operand: a
                       GELU's output, a norm's) recomputed by the min cut where they draw no random
                       numbers (auto, default); 0 never (functorch's rule: saved); 1 wherever the
                       cut prefers
AOTFUSE_CHANNELS_LAST_POOLS=0  keep ATen's max pool on a contiguous CPU input (default: one with 16
                       channels or more runs on a channels-last copy, ATen's vectorized case;
                       decompositions.py)
AOTFUSE_CHANNELS_LAST_CONVS=0  keep CPU convolutions in the traced layout (default: a 2-d float32 or
                       bfloat16 convolution of a contiguous NCHW input runs on a channels-last copy
                       with oneDNN, the layout flowing through the network, outputs given eager's
                       strides back; a trace the layout would change is done again without;
                       decompositions.py)
AOTFUSE_WINDOW_ORDER=0  CPU kernels with windows (pads, crops, slice assignments) loop over the dims
                       in their own order (default: in memory order, as other pointwise kernels;
                       codegen_common.c's loop_order; read in C when a program is generated)
AOTFUSE_SMALL_LOOPS=0  let GCC unroll CPU loops of 4-16 iterations whole, as before (default: kept
                       loops, `#pragma GCC unroll 1`, so that they vectorize with their selects as
                       blends; a column kernel whose columns fit one block loops over constant
                       bounds; codegen_c.c's small_loop; read in C when a program is generated)
AOTFUSE_RECOMPUTE_SCALAR_CALLS=1  let the min cut recompute a CPU value whose op calls a costly
                       function (a libm call GCC does not vectorize: tan, atan, exp2, erfc; or the C
                       prelude's sin and cos, 6x exp's cost; default: saved, since the kernel
                       recomputing it ran scalar whole, or slowly per element of a broadcast:
                       Llama's rotary cos and sin, once per layer)
AOTFUSE_VECTOR_LIBM=0  the C kernels' log, log1p, log2, log10, expm1, sin and cos call libm's scalar
                       functions, as before 2026-12-06 (an A/B; default: the C prelude's branch-free
                       polynomials, which vectorize, within 1.7 ulp; codegen_c.c's vector_log and
                       vector_trig; read in C when a program is generated or partitioned)
AOTFUSE_FLOAT32_COMPUTE=auto  16-bit CPU matmuls, convolutions and flash attention in float32,
                       rounded once (decompositions.py): auto (default) for the dtypes ATen's CPU
                       kernels have no fast path for (oneDNN's queries: float16 without AVX512-FP16 or
                       AMX-FP16, bfloat16 without AVX-512); 1 float16 and bfloat16; 0 never
AOTFUSE_RECOMPUTE_CHAINS=1  under AOTFUSE_RECOMPUTE_MATERIALIZED=auto, also recompute such a value
                       where that makes another one first (default 0: saved; a residual stream of
                       pointwise adds is then saved every other layer, not rebuilt whole at the
                       backward's start)
AOTFUSE_CAT_WINDOWS=0  keep ATen's cat (default: where kernels are generated, a cat of 2 to 8
                       floating inputs of one dtype and the contiguous format is a pad of the first
                       and slice assignments of the others, windows a kernel computes its pointwise
                       inputs in: Llama's rotary cat(-x2, x1) reads x; decompositions._cat_windows)

The README's Configuration table lists every switch, these and the lowering's own
(AOTFUSE_DECOMPOSE_LOSS, AOTFUSE_DECOMPOSE_NORMS, AOTFUSE_DECOMPOSE_ACTIVATIONS, AOTFUSE_SINK_COPIES, AOTFUSE_SINK_READS,
AOTFUSE_WINDOW_SOURCES, AOTFUSE_OVERLAP_SUMS, AOTFUSE_CC).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

log = logging.getLogger("aotfuse")


class ConfigError(ValueError):
    """An AOTFUSE_* variable with a value it cannot take: raised as it is, never a capture failure
    that a fallback would hide."""


_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def switch(name: str, default: bool) -> bool:
    """An on/off variable: 1/true/on/yes or 0/false/off/no, in any case; unset or empty, the default;
    any other value a ConfigError (before 2026-12-04 every value but "" and "0" read as on, so
    AOTFUSE_FUSION=false built kernels and AOTFUSE_DISABLE=no turned aotfuse off)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if not v:
        return default
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ConfigError(f"{name} must be 1 or 0 (or on/off, true/false, yes/no), not {raw!r}")


def batch_norm_dtypes() -> tuple:
    """The input dtypes whose batch norms are decomposed on the CPU (decompositions._batch_norm_table),
    from AOTFUSE_DECOMPOSE_BATCH_NORM: unset, empty or auto float32 only (ATen's CPU batch norm in
    bf16 is about 5x its float32 speed, and ResNet's step in bf16 ran 4% slower decomposed, where in
    float32 it ran 15% faster: benchmarks/results/batch-norm-cpu-2026-12-05.md); 1 float16 and bfloat16
    too; 0 none."""
    import torch

    raw = os.environ.get("AOTFUSE_DECOMPOSE_BATCH_NORM", "").strip().lower()
    if raw in ("", "auto"):
        return (torch.float32,)
    if switch("AOTFUSE_DECOMPOSE_BATCH_NORM", True):
        return (torch.float32, torch.float16, torch.bfloat16)
    return ()


def onednn_fast(dtype) -> bool:
    """Whether ATen's CPU matmuls and convolutions of this 16-bit dtype take oneDNN's fast path on this
    CPU (its own queries: float16 needs AVX512-FP16 or AMX-FP16, bfloat16 AVX-512)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    query = mkldnn._is_mkldnn_fp16_supported if dtype == torch.float16 else mkldnn._is_mkldnn_bf16_supported
    return bool(query())


def float32_compute() -> tuple:
    """The 16-bit dtypes whose CPU matmuls (mm, addmm, bmm, baddbmm), convolutions (and their
    backward) and flash attention (and its backward) run in float32, rounded once to the dtype
    (decompositions._float32_table), from AOTFUSE_FLOAT32_COMPUTE: unset, empty or auto, those
    ATen's CPU kernels have no fast path for, by oneDNN's own queries (float16 without AVX512-FP16
    or AMX-FP16, bfloat16 without AVX-512: ATen's generic loops, 4-70x slower than float32's); 1
    both; 0 none."""
    import torch

    raw = os.environ.get("AOTFUSE_FLOAT32_COMPUTE", "").strip().lower()
    if raw in ("", "auto"):
        return tuple(dtype for dtype in (torch.float16, torch.bfloat16) if not onednn_fast(dtype))
    if switch("AOTFUSE_FLOAT32_COMPUTE", True):
        return (torch.float16, torch.bfloat16)
    return ()


def _count(name: str, default: int) -> int:
    """A positive integer variable; unset or empty, the default; anything else a ConfigError."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name} must be a positive integer, not {raw!r}")
    return n


def _mode(name: str, extra: dict) -> str:
    """A variable taking auto, 1/0 (and the switches' synonyms) or the names in `extra` (name -> mode)."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in _ON:
        return "1"
    if v in _OFF:
        return "0"
    if v in extra:
        return extra[v]
    raise ConfigError(f"{name} must be auto, 1 or 0{''.join(', ' + k for k in extra)}, not {v!r}")


def disabled() -> bool:
    return switch("AOTFUSE_DISABLE", False)


def logs(stage: str) -> bool:
    wanted = {s.strip() for s in os.environ.get("AOTFUSE_LOG", "").split(",") if s.strip()}
    return stage in wanted or "all" in wanted


def cache_size() -> int:
    return _count("AOTFUSE_CACHE_SIZE", 8)


def dynamic() -> str:
    """AOTFUSE_DYNAMIC: "auto" (default), "1" or "0" (shapes.py)."""
    return _mode("AOTFUSE_DYNAMIC", {})


def ban_materialized() -> int:
    """AOTFUSE_RECOMPUTE_MATERIALIZED as the C partitioner's ban_materialized_bw: auto -> 2 (ban where
    recomputing draws random numbers), 0 -> 1 (ban all), 1 -> 0 (ban none)."""
    v = os.environ.get("AOTFUSE_RECOMPUTE_MATERIALIZED", "auto").strip().lower()
    if v in ("", "auto"):
        return 2
    if v in ("0", "off", "false", "never"):
        return 1
    if v in ("1", "on", "true", "always"):
        return 0
    raise ConfigError(f"AOTFUSE_RECOMPUTE_MATERIALIZED must be auto, 0 or 1, not {v!r}")


def shape_programs() -> int:
    return _count("AOTFUSE_SHAPE_PROGRAMS", 64)


def check_inputs() -> bool:
    return switch("AOTFUSE_CHECK_INPUTS", True)


def fusion() -> bool:
    return switch("AOTFUSE_FUSION", True) and backend() != "aten"


def constant_fold() -> bool:
    return switch("AOTFUSE_CONSTANT_FOLD", True)


def huge_pages() -> int:
    """Bytes from which fresh CPU tensors a program allocates get transparent huge pages (0: off)."""
    raw = os.environ.get("AOTFUSE_HUGE_PAGES", "32").strip()
    try:
        mib = float(raw) if raw else 32.0
    except ValueError:
        mib = float("nan")
    if not 0 <= mib <= 2**40:  # NaN fails too
        raise ConfigError(f"AOTFUSE_HUGE_PAGES must be a size in MiB from 0 (off) to 2^40, not {raw!r}")
    return int(mib * 2**20)


def lm_grad_chunks() -> bool:
    return switch("AOTFUSE_LM_GRAD_CHUNKS", True)


def one_hot_picks() -> bool:
    return switch("AOTFUSE_ONE_HOT_PICKS", True)


def erf1p() -> bool:
    return switch("AOTFUSE_ERF1P", True)


def reuse_buffers() -> bool:
    return switch("AOTFUSE_REUSE_BUFFERS", True)


def sink_copies() -> bool:
    return switch("AOTFUSE_SINK_COPIES", True)


def sink_reads() -> bool:
    return switch("AOTFUSE_SINK_READS", True)


def sink_broadcasts() -> bool:
    return switch("AOTFUSE_SINK_BROADCASTS", True)


def window_sources() -> bool:
    return switch("AOTFUSE_WINDOW_SOURCES", True)


def recompute_scalar_calls() -> bool:
    """AOTFUSE_RECOMPUTE_SCALAR_CALLS=1: the min cut may recompute a CPU value whose op calls a costly
    function (a libm call GCC does not vectorize, tan, atan, ..., or the C prelude's sin and cos;
    default 0: such a value is saved, since the kernel recomputing it ran scalar whole, or at 6x exp's
    cost per element of a broadcast)."""
    return switch("AOTFUSE_RECOMPUTE_SCALAR_CALLS", False)


def recompute_chains() -> bool:
    """AOTFUSE_RECOMPUTE_CHAINS=1: the min cut may recompute a value the backward writes out anyway
    by making another such value first (default 0: such a value is saved)."""
    return switch("AOTFUSE_RECOMPUTE_CHAINS", False)


def merge_kernels() -> bool:
    return switch("AOTFUSE_MERGE_KERNELS", True)


def kernel_templates() -> bool:
    return switch("AOTFUSE_KERNEL_TEMPLATES", True)


def overlap_sums() -> bool:
    return switch("AOTFUSE_OVERLAP_SUMS", True)


def embedding_grads() -> bool:
    return switch("AOTFUSE_EMBEDDING_GRADS", True)


def drop_clones() -> bool:
    return switch("AOTFUSE_DROP_CLONES", True)


def memory_budget() -> float:
    """AOTFUSE_MEMORY_BUDGET in [0, 1] (else torch._functorch.config.activation_memory_budget, as
    torch.compile reads it; 1 by default): below 1 the min cut may recompute matmuls and other extern
    calls to save fewer activations (partition.h, memory_budget)."""
    v = os.environ.get("AOTFUSE_MEMORY_BUDGET", "").strip()
    if v:
        try:
            budget = float(v)
        except ValueError:
            raise ValueError(f"AOTFUSE_MEMORY_BUDGET={v!r}: a number in [0, 1]") from None
    else:
        import torch._functorch.config as functorch_config

        budget = float(getattr(functorch_config, "activation_memory_budget", 1.0))
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"the activation memory budget must be in [0, 1], not {budget}")
    return budget


def ddp_overlap() -> bool:
    """AOTFUSE_DDP_OVERLAP: memory_efficient_fusion(DDP(model))'s backward all-reduces the gradients
    bucket by bucket as it makes them (default 1, ddp.py); 0 leaves it to DDP's reducer, after the
    compiled backward."""
    return switch("AOTFUSE_DDP_OVERLAP", True)


def checkpoint_regions() -> bool:
    """AOTFUSE_CHECKPOINT_REGIONS: torch.utils.checkpoint regions recomputed in the backward (default 1);
    0 traces through them and lets the partitioner save what it likes (as before 2026-12-04)."""
    return switch("AOTFUSE_CHECKPOINT_REGIONS", True)


def decisions() -> bool:
    """AOTFUSE_DECISIONS: a traced forward's questions about its inputs' values (`.item()` of an
    attention mask, an assert on the ids) answered from those values and guarded at each call
    (default 1, decisions.py); 0: such a forward is not captured whole (CaptureError, or the
    fallback), as before 2026-12-07."""
    return switch("AOTFUSE_DECISIONS", True)


def fuse_attention() -> str:
    """AOTFUSE_FUSE_ATTENTION: "auto" (default), "1" (also CPU attention with dropout or in bf16), "0" (never)."""
    return _mode("AOTFUSE_FUSE_ATTENTION", {"force": "1"})


def fallback_random() -> bool:
    return switch("AOTFUSE_FALLBACK_RANDOM", False)


def kernels_for(device) -> bool:
    """Whether tensors on `device` (a torch.device) get generated kernels."""
    return fusion() and kernel_devices() in ("all", device.type)


_BACKENDS = {"auto": "all", "c": "cpu", "cpu": "cpu", "cuda": "cuda", "aten": "all"}


def backend() -> str:
    """AOTFUSE_BACKEND, checked: auto, c, cuda or aten."""
    name = os.environ.get("AOTFUSE_BACKEND", "auto").strip().lower() or "auto"
    if name not in _BACKENDS:
        raise ConfigError(f"AOTFUSE_BACKEND={name!r}: expected one of auto, c, cuda, aten")
    return "c" if name == "cpu" else name


def kernel_devices() -> str:
    """The devices whose tensors get generated kernels, as the C core names them."""
    return _BACKENDS[backend()]


def nvrtc_dirs() -> list[str]:
    """Folders where a libnvrtc may lie: the nvidia-cuda-nvrtc wheels (CUDA 13 and 12 layouts),
    torch's own library folder, CUDA_HOME and the usual toolkit place."""
    import sys

    dirs = []
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            d = os.path.join(base, sub)
            if os.path.isdir(d):
                dirs.append(d)
    try:
        import torch

        dirs.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "lib64"))
    dirs.append("/usr/local/cuda/lib64")
    return [d for d in dirs if os.path.isdir(d)]


def emit(stage: str, message: str) -> None:
    """Prints a log line for `stage` when AOTFUSE_LOG asks for it."""
    if logs(stage):
        if not log.handlers and not logging.getLogger().handlers:
            logging.basicConfig(format="[aotfuse] %(message)s")
        log.warning("%s: %s", stage, message)


def lazy_graph_modules() -> Any:
    """While compiling, GraphModules write their Python code only when something first needs it
    (torch's `_use_lazy_graph_module`, as torch.compile's own stack does): aotfuse runs the C
    programs, not the graphs' code, and every graph pass (partitioning, folding, the rewrites)
    made a GraphModule that generated its code at once (a third or later sequence length's first
    step, Bert at the reduced size: 0.98 -> 0.86 s, benchmarks/results/lazy-graph-modules-2026-12-02.md)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - torch without it
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def graph_module(root: Any, graph: Any, class_name: str = "GraphModule") -> Any:
    """fx.GraphModule(root, graph, class_name), lazy under lazy_graph_modules()."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError:  # pragma: no cover
        import torch.fx as fx
        return fx.GraphModule(root, graph, class_name)
    return _make_graph_module(root, graph, class_name)


def compile_lock() -> Any:
    """The process-wide lock every capture and lowering holds: tracing swaps process-wide state
    (fake tensor modes, oneDNN's flag, a module's Python attributes), so two threads compiling at
    once would mix their traces. It is Dynamo's own compile lock (an RLock) where torch has one, so a
    signature falling back to torch.compile while compiling, and Dynamo calling aotfuse's backend
    under that lock, take the locks in one order; a Python RLock otherwise."""
    global _compile_lock
    if _compile_lock is None:
        try:
            from torch._dynamo.convert_frame import compile_lock as dynamo_lock
        except ImportError:  # pragma: no cover - torch without Dynamo
            import threading

            dynamo_lock = threading.RLock()
        _compile_lock = dynamo_lock
    return _compile_lock


_compile_lock = None
