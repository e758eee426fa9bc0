"""The seed benchmark: a Hugging Face training step under eager, aotfuse, torch.compile and functorch.

Reproduces functorch's memory_efficient_fusion table (model, dtype, name, time, mem, time %, mem %) and adds
a numeric check of every contender against eager. Run it as

    python -m aotfuse.bench [--device cpu|cuda] [--models ...] [--dtypes ...] [--backends ...]
                            [--repeats N] [--out-dir benchmarks/results]

A training step is: optimizer.zero_grad(set_to_none=True), forward with labels, loss.backward(),
optimizer.step() (plain SGD). Contenders run interleaved (one step of each per repetition, the starting
contender rotating), after warm-up steps that are not timed; medians are reported.

Memory: the peak bytes allocated during one step, less what was allocated when it began (so the other
contenders' resident weights do not count): on CUDA torch.cuda.max_memory_allocated() after
reset_peak_memory_stats(), on CPU the running sum of torch's allocation events (torch.profiler with
profile_memory=True), the same measure for every contender. Beside it, the bytes saved for backward
(unique storages of the tensors autograd saves, through torch.autograd.graph.saved_tensors_hooks,
parameters excluded).

Models are built from their config classes with random weights (nothing is downloaded); dropout
probabilities are set to 1e-8 as the seed did, so the dropout computation is there without its noise.
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime
import gc
import os
import platform
import re
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch

from .lower import LIVE

__all__ = ["MODELS", "BACKENDS", "Settings", "Result", "run", "write_results", "main"]

MODELS = ("AlbertForMaskedLM", "GPT2LMHeadModel", "BertForMaskedLM", "LongformerForMaskedLM")
BACKENDS = ("eager", "aotfuse", "torch.compile", "functorch")
# on request only: aotfuse with layer norm and softmax left to ATen's kernels (AOTFUSE_DECOMPOSE_NORMS=0)
EXTRA_BACKENDS = ("aotfuse-aten-norms", "aotfuse-eager-attn", "aotfuse-dynamo", "eager-sdpa")
# aotfuse with AOTFUSE_* variables set around each of its steps (so around its lowering), one process with
# the other contenders: "aotfuse+AOTFUSE_LM_GRAD_CHUNKS=0", "aotfuse+AOTFUSE_FALLBACK_RANDOM=1+AOTFUSE_FUSE_ATTENTION=0"
ENV_BACKEND = re.compile(r"aotfuse(\+AOTFUSE_[A-Z0-9_]+=[^+,=\s]*)+")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# the seed's tolerances: (atol, rtol)
TOLERANCES = {torch.float32: (1e-4, 5e-3), torch.float16: (1e-2, 1e-1), torch.bfloat16: (1e-2, 1e-1)}
SIZES = ("seed", "reduced", "tiny", "host")


# ---------------------------------------------------------------- models and shapes

def _dims(size: str) -> dict:
    """Transformer dimensions for the reduced, tiny and host sizes (the seed size uses each model's
    own). "host" keeps the seed's 12 layers and makes every tensor minimal, so a step is nearly all
    host time (dispatch, launches, Python): the regime of the seed models on a fast GPU, measurable
    on a CPU."""
    if size == "reduced":
        return dict(hidden=256, layers=2, heads=4, inter=1024, vocab=8192)
    if size == "host":
        return dict(hidden=32, layers=12, heads=2, inter=64, vocab=64)
    return dict(hidden=64, layers=1, heads=2, inter=128, vocab=512)


def build_config(name: str, size: str) -> tuple[Any, int, int]:
    """Returns (config, batch, sequence length) for `name` at `size`. The seed size is the seed's
    checkpoints written out by hand (albert-base-v2, gpt2, bert-base-uncased, longformer-base-4096)."""
    import transformers as tf

    d = None if size == "seed" else _dims(size)
    seq = {"seed": 512, "reduced": 128, "tiny": 32, "host": 8}[size]
    if name == "AlbertForMaskedLM":
        if d is None:
            cfg = tf.AlbertConfig(vocab_size=30000, embedding_size=128, hidden_size=768, num_hidden_layers=12,
                                  num_attention_heads=12, intermediate_size=3072, hidden_act="gelu_new")
        else:
            cfg = tf.AlbertConfig(vocab_size=d["vocab"], embedding_size=min(128, d["hidden"]),
                                  hidden_size=d["hidden"], num_hidden_layers=d["layers"],
                                  num_attention_heads=d["heads"], intermediate_size=d["inter"],
                                  hidden_act="gelu_new", max_position_embeddings=max(seq, 64))
        return cfg, 8, seq
    if name == "GPT2LMHeadModel":
        if d is None:
            cfg = tf.GPT2Config()
        else:
            cfg = tf.GPT2Config(vocab_size=d["vocab"], n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
                                n_inner=d["inter"], n_positions=max(seq, 64), bos_token_id=0, eos_token_id=0)
        return cfg, 4, seq
    if name == "BertForMaskedLM":
        if d is None:
            cfg = tf.BertConfig()
        else:
            cfg = tf.BertConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"],
                                num_attention_heads=d["heads"], intermediate_size=d["inter"],
                                max_position_embeddings=max(seq, 64))
        return cfg, 4, seq
    if name == "LongformerForMaskedLM":
        if d is None:
            cfg = tf.LongformerConfig(vocab_size=50265, max_position_embeddings=4098, attention_window=512,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                      layer_norm_eps=1e-5)
        else:
            window = seq // 2
            cfg = tf.LongformerConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"],
                                      num_attention_heads=d["heads"], intermediate_size=d["inter"],
                                      max_position_embeddings=2 * seq + 2, attention_window=window,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
        return cfg, 2, 2 * seq
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _quiet_dropout(cfg: Any, p: float) -> None:
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, p)


def build_model(name: str, size: str, dtype: torch.dtype, device: str, attn: str = "eager",
                dropout: float = 1e-8, attention_mask: bool = False,
                gradient_checkpointing: bool = False, global_attention: int = 0) -> tuple[torch.nn.Module, dict, str]:
    """A freshly initialised model (seed 0), one batch of inputs (seed 1) and a one-line description.
    Inputs are the seed's, input_ids and labels; attention_mask=True adds a mask of ones;
    global_attention=N gives Longformer a global_attention_mask whose first N tokens attend globally
    (as its <s> does in question answering and classification);
    gradient_checkpointing=True checkpoints every layer (transformers' gradient_checkpointing_enable,
    non-reentrant)."""
    import transformers as tf

    cfg, batch, seq = build_config(name, size)
    _quiet_dropout(cfg, dropout)
    torch.manual_seed(0)
    cls = getattr(tf, name)
    model = cls._from_config(cfg, attn_implementation=attn) if name != "LongformerForMaskedLM" \
        else cls._from_config(cfg)
    model = model.to(device=device, dtype=dtype).train()
    if gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise NotImplementedError(f"transformers' {name} does not support gradient checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    labels = torch.randint(3, vocab, (batch, seq), generator=gen)
    inputs = {"input_ids": ids.to(device), "labels": labels.to(device)}
    if attention_mask:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if global_attention and name == "LongformerForMaskedLM":
        glob = torch.zeros_like(inputs["input_ids"])
        glob[:, :global_attention] = 1
        inputs["global_attention_mask"] = glob
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    nparams = sum(p.numel() for p in model.parameters())
    desc = (f"{name}: batch {batch} x seq {seq}, hidden {hidden}, {layers} layers, vocab {vocab}, "
            f"{nparams / 1e6:.1f}M parameters")
    return model, inputs, desc


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The median of `repeats` timed calls of fn, in ms, after `warmup` untimed ones (the micro
    benchmarks under benchmarks/: float16_ops.py, cats.py)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------- contenders

@dataclasses.dataclass
class Contender:
    name: str
    base: torch.nn.Module                # the module whose parameters train (for grads by name)
    call: Callable | None = None         # what a step calls
    opt: torch.optim.Optimizer | None = None
    status: str = "ok"                   # ok | fallback | failed | n/a
    reason: str = ""
    first_step_s: float | None = None
    times: list = dataclasses.field(default_factory=list)
    mem_bytes: int | None = None         # peak allocated during a step
    saved_bytes: int | None = None       # saved for backward by a step
    loss: torch.Tensor | None = None
    grads: dict | None = None
    programs: list = dataclasses.field(default_factory=list)  # aotfuse: the Lowered programs its first step made
    env: dict = dataclasses.field(default_factory=dict)  # AOTFUSE_* variables set around each step


def backend_env(backend: str) -> dict[str, str]:
    """The AOTFUSE_* variables of an "aotfuse+NAME=VALUE+..." contender (none for the others)."""
    if not ENV_BACKEND.fullmatch(backend):
        return {}
    return dict(item.split("=", 1) for item in backend.split("+")[1:])


class _environ:
    """Sets variables for the length of a with block, then puts back what was there."""

    def __init__(self, env: dict[str, str]):
        self.env, self.old = env, {}

    def __enter__(self) -> None:
        self.old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Cause:"):  # aotfuse's CaptureError names its cause on its own line
            text = f"{type(e).__name__}, cause {line[len('Cause:'):].strip()}"
            break
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= 160 else first[:157] + "..."


def _make(backend: str, model: torch.nn.Module, fallback: str | None = None) -> Callable:
    if backend == "eager":
        return model
    if backend == "eager-sdpa":  # what ATen's fused attention alone would give: a yardstick, not a compiler
        model.set_attn_implementation("sdpa")
        if getattr(model.config, "_attn_implementation", None) != "sdpa":
            raise ValueError(f"{type(model).__name__} has no SDPA attention to switch to")
        return model
    if backend in ("aotfuse", "aotfuse-aten-norms", "aotfuse-eager-attn") or ENV_BACKEND.fullmatch(backend):
        import aotfuse
        from aotfuse.decompositions import default_decompositions

        kwargs = {"decompositions": default_decompositions(norms=False)} if backend == "aotfuse-aten-norms" else {}
        if fallback:
            kwargs["fallback"] = fallback
        compiled = aotfuse.memory_efficient_fusion(model, **kwargs)
        if backend == "aotfuse-eager-attn":  # attention left as the model wrote it (AOTFUSE_FUSE_ATTENTION=0)
            compiled._aotfuse_compiled.fuse_attention = "0"
        return compiled
    if backend == "aotfuse-dynamo":  # aotfuse as torch.compile's backend: Dynamo's graphs (may break)
        return torch.compile(model, backend="aotfuse", dynamic=False)
    if backend == "torch.compile":
        return torch.compile(model, backend="inductor", dynamic=False)
    if backend == "functorch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from functorch.compile import memory_efficient_fusion as functorch_mef
        return functorch_mef(model)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS + EXTRA_BACKENDS)} "
                     "or aotfuse+AOTFUSE_NAME=VALUE")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(c: Contender, inputs: dict, before_update: Callable | None = None) -> None:
    """One training step: zero_grad(set_to_none=True), forward with labels, backward, SGD step."""
    with _environ(c.env):
        c.opt.zero_grad(set_to_none=True)
        loss = c.call(**inputs).loss
        loss.backward()
        if before_update is not None:
            before_update(loss)
        c.opt.step()


def _record_first(c: Contender) -> Callable:
    def record(loss: torch.Tensor) -> None:
        c.loss = loss.detach().float().clone()
        c.grads = {n: (None if p.grad is None else p.grad.detach().float().clone())
                   for n, p in c.base.named_parameters()}
    return record


def _first_step(c: Contender, backend: str, model: torch.nn.Module, inputs: dict, device: str,
                fallback: str = "eager") -> None:
    """Builds the contender and runs its first (compiling) step, recording loss and grads. aotfuse
    is rebuilt with memory_efficient_fusion(model, fallback=...) (and says why) when the model cannot be
    captured; other failures mark the contender failed (functorch: n/a)."""
    c.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    try:
        with _environ(c.env):  # decompositions are chosen when the contender is made
            c.call = _make(backend, model)
        _sync(device)
        t0 = time.perf_counter()
        _step(c, inputs, _record_first(c))
        _sync(device)
        c.first_step_s = time.perf_counter() - t0
        return
    except Exception as e:  # noqa: BLE001 - a contender's failure is a row, never the end of the run
        c.reason = _reason(e)
        c.status = "n/a" if backend in ("functorch", "eager-sdpa") else "failed"
        c.call = None
        model.zero_grad(set_to_none=True)
    if not backend.startswith("aotfuse"):
        return
    try:  # the documented way out: run what cannot be captured eagerly
        with _environ(c.env):
            c.call = _make(backend, model, fallback=fallback)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _sync(device)
            t0 = time.perf_counter()
            _step(c, inputs, _record_first(c))
            _sync(device)
        c.first_step_s = time.perf_counter() - t0
        c.status = "fallback"
    except Exception as e:  # noqa: BLE001
        c.reason += f"; fallback={fallback!r} failed too: {_reason(e)}"
        c.call = None


def _cpu_peak(fn: Callable) -> int:
    """Peak bytes torch's CPU allocator held during fn beyond the least it held before that peak (its
    allocation and free events, in order, the running total never below zero): memory fn frees
    before allocating (the gradients a step sets to None) lowers the base, as a CUDA measurement's
    start after zero_grad does. The profiler reports the free of a block allocated before any
    profiling began without its size, and one allocated under an earlier profile with it, so a
    plain running total counted those gradients as freed only where the step before had run under
    the profiler too (Bert, 12 layers at hidden 256: 59.5 or 106.7 MB for one program, by what was
    measured before it). Python's cycle collector is run before and held off during fn: garbage of
    earlier steps freed by a collection inside it moved the peak by a collection's worth."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        if enabled:
            gc.enable()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur = max(0, cur + e.nbytes())
        peak = max(peak, cur)
    return peak


def _measure_memory(c: Contender, inputs: dict, device: str) -> tuple[int, int]:
    """One step: (peak bytes allocated beyond the step's start, bytes saved for backward)."""
    params = {p.untyped_storage().data_ptr() for p in c.base.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step() -> None:
        with _environ(c.env):
            c.opt.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = c.call(**inputs).loss
            loss.backward()
            c.opt.step()

    if device == "cuda":
        c.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        c.opt.zero_grad(set_to_none=True)
        peak = _cpu_peak(step)
    return peak, sum(saved.values())


# ---------------------------------------------------------------- results

@dataclasses.dataclass
class Result:
    model: str
    dtype: str
    name: str
    status: str
    time_s: float | None
    mem_bytes: int | None
    time_pct: float | None
    mem_pct: float | None
    first_step_s: float | None
    loss_diff: float | None
    grad_diff: float | None
    grad_worst: str
    check: str
    reason: str
    saved_bytes: int | None = None
    kernel_fallbacks: int = 0  # aotfuse: kernel calls that ran as ATen calls (a layout the plan did not expect)


def _compare(c: Contender, ref: Contender, dtype: torch.dtype) -> tuple[float | None, float | None, str, str]:
    """Max abs diff of the first step's loss and gradients against eager, and pass/fail against the
    seed's tolerance for the dtype (|a - b| <= atol + rtol * |b|, elementwise)."""
    if c.loss is None or ref.loss is None:
        return None, None, "", "-"
    atol, rtol = TOLERANCES[dtype]
    loss_diff = (c.loss - ref.loss).abs().item()
    ok = loss_diff <= atol + rtol * ref.loss.abs().item()
    grad_diff, worst, worst_excess = 0.0, "", -float("inf")
    for name, g_ref in ref.grads.items():
        g = c.grads.get(name)
        if g is None or g_ref is None:
            if (g is None) != (g_ref is None):
                ok, worst, worst_excess = False, f"{name} (grad missing on one side)", float("inf")
            continue
        diff = (g - g_ref).abs()
        grad_diff = max(grad_diff, diff.max().item())
        excess = (diff - (atol + rtol * g_ref.abs())).max().item()
        if excess > worst_excess:
            worst, worst_excess = name, excess
        ok = ok and excess <= 0
    return loss_diff, grad_diff, worst, "pass" if ok else "FAIL"


@dataclasses.dataclass
class Settings:
    """How a run is made (the command line's options)."""
    device: str = "cpu"
    size: str = "reduced"
    repeats: int = 10
    warmup: int = 2
    attn: str = "eager"
    dropout: float = 1e-8
    attention_mask: bool = False
    gradient_checkpointing: bool = False  # every contender's model checkpoints each layer
    global_attention: int = 0  # Longformer: its first N tokens attend globally
    aotfuse_fallback: str = "eager"  # memory_efficient_fusion(fallback=...) where capture fails
    tf32: bool = False  # CUDA float32 matmuls and convolutions on TF32 tensor cores, for every contender
    load: tuple[float, float] | None = None  # 1-minute load average at start and end (CPU noise)


def run(models: list[str], dtypes: list[str], backends: list[str], settings: Settings,
        progress: bool = True, on_group: Callable | None = None,
        time_budget: float | None = None) -> tuple[list[Result], list[str]]:
    """Runs every (model, dtype) group with every backend; returns the rows and the model descriptions.
    Groups run dtype by dtype (every model in the first dtype, then the next). `on_group(rows,
    descriptions)` is called after each group (to write partial results); past `time_budget`
    seconds no new group starts (the skipped ones are printed).

    Example:
        >>> rows, _ = run(["BertForMaskedLM"], ["fp32"], ["eager", "aotfuse"], Settings(size="tiny", repeats=2))
    """
    device, repeats, warmup = settings.device, settings.repeats, settings.warmup
    if "eager" not in backends:
        backends = ["eager"] + list(backends)  # the reference for ratios and numeric checks
    bar = _progress(len(models) * len(dtypes) * len(backends) * (warmup + repeats + 1), progress)
    results: list[Result] = []
    descriptions: list[str] = []
    start = time.perf_counter()
    for dtype_name in dtypes:
        for model_name in models:
            if time_budget is not None and time.perf_counter() - start > time_budget:
                print(f"aotfuse.bench: time budget ({time_budget:.0f} s) spent; skipped {model_name} {dtype_name}",
                      file=sys.stderr)
                continue
            dtype = DTYPES[dtype_name]
            bar.set_description(f"{model_name} {dtype_name}")
            torch._dynamo.reset()
            try:
                base, inputs, desc = build_model(model_name, settings.size, dtype, device, settings.attn,
                                                 settings.dropout, settings.attention_mask,
                                                 settings.gradient_checkpointing, settings.global_attention)
            except NotImplementedError as e:  # a model without gradient checkpointing
                print(f"aotfuse.bench: skipped {model_name}: {e}", file=sys.stderr)
                if f"{model_name}: skipped: {e}" not in descriptions:
                    descriptions.append(f"{model_name}: skipped: {e}")
                continue
            if desc not in descriptions:
                descriptions.append(desc)
            contenders = []
            for backend in backends:
                c = Contender(backend, copy.deepcopy(base), env=backend_env(backend))
                bar.set_postfix_str(f"compiling {backend}")
                made_before = set(LIVE)
                _first_step(c, backend, c.base, inputs, device, settings.aotfuse_fallback)
                c.programs = list(set(LIVE) - made_before)
                bar.update(1)
                contenders.append(c)
            del base
            _measure_group(contenders, inputs, settings, bar)
            results.extend(_rows(model_name, dtype, contenders))
            del contenders
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            if on_group is not None:
                on_group(results, descriptions)
    bar.close()
    return results, descriptions


def _guarded(c: Contender, what: str, fn: Callable) -> bool:
    """Runs one step of `c`; a failure marks the contender failed (with the reason) instead of raising."""
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - a contender's failure is a row, never the end of the run
        c.status, c.call = "failed", None
        c.reason = (c.reason + "; " if c.reason else "") + f"{what}: {_reason(e)}"
        c.times.clear()
        c.mem_bytes = c.saved_bytes = None
        return False


def _measure_group(contenders: list[Contender], inputs: dict, settings: Settings, bar: Any) -> None:
    """Warm-up, one memory step, then interleaved timed steps of every contender still running."""
    device = settings.device
    per_contender = settings.warmup + settings.repeats  # after the first step
    done = {id(c): 0 for c in contenders}

    def tick(c: Contender) -> None:
        done[id(c)] += 1
        bar.update(1)

    bar.set_postfix_str("warm-up")
    for _ in range(settings.warmup - 1):
        for c in [c for c in contenders if c.call is not None]:
            _guarded(c, "warm-up step", lambda: _step(c, inputs))
            tick(c)
    bar.set_postfix_str("memory")
    for c in [c for c in contenders if c.call is not None]:
        def measure() -> None:
            c.mem_bytes, c.saved_bytes = _measure_memory(c, inputs, device)
        _guarded(c, "memory step", measure)
        tick(c)
    bar.set_postfix_str("timing")
    gc.collect()
    for rep in range(settings.repeats):  # interleaved: one step of each contender per repetition
        live = [c for c in contenders if c.call is not None]
        k = rep % len(live) if live else 0
        for c in live[k:] + live[:k]:
            def timed() -> None:
                _sync(device)
                t0 = time.perf_counter()
                _step(c, inputs)
                _sync(device)
                c.times.append(time.perf_counter() - t0)
            _guarded(c, "timed step", timed)
            tick(c)
    for c in contenders:
        bar.update(per_contender - done[id(c)])


def _rows(model_name: str, dtype: torch.dtype, contenders: list[Contender]) -> list[Result]:
    ref = contenders[0]
    ref_time = statistics.median(ref.times) if ref.times else None
    rows = []
    for c in contenders:
        t = statistics.median(c.times) if c.times else None
        if c is ref:
            loss_diff, grad_diff, worst, check = (0.0, 0.0, "", "reference") if ref.loss is not None else \
                (None, None, "", "-")
        else:
            loss_diff, grad_diff, worst, check = _compare(c, ref, dtype)
        rows.append(Result(
            model=model_name, dtype=str(dtype).replace("torch.", ""), name=c.name, status=c.status, time_s=t,
            mem_bytes=c.mem_bytes,
            time_pct=100.0 * t / ref_time if t is not None and ref_time else None,
            mem_pct=100.0 * c.mem_bytes / ref.mem_bytes if c.mem_bytes is not None and ref.mem_bytes else None,
            first_step_s=c.first_step_s, loss_diff=loss_diff, grad_diff=grad_diff, grad_worst=worst, check=check,
            reason=c.reason, saved_bytes=c.saved_bytes,
            kernel_fallbacks=sum(low.program.kernel_fallbacks for low in c.programs)))
    return rows


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, s: str) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        print("aotfuse.bench: tqdm is not installed, running without a progress bar", file=sys.stderr)
        return _NoBar()
    return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------- output

def _machine(device: str, load: tuple[float, float] | None = None) -> str:
    import transformers

    parts = [f"{platform.system()} {platform.machine()} ({platform.processor() or 'cpu'}), "
             f"{os.cpu_count()} CPUs"]
    if device == "cuda":
        parts.append(f"GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    parts += [f"python {platform.python_version()}", f"torch {torch.__version__}",
              f"transformers {transformers.__version__}", _source_version(), f"date {datetime.date.today()}"]
    if device == "cpu":
        parts.insert(1, f"torch threads {torch.get_num_threads()}")
        if load is not None:
            parts.insert(2, "load average at start/end {:.2f}/{:.2f}".format(*load))
    return " | ".join(parts)


def _source_version() -> str:
    """aotfuse's version and, in a git checkout, its commit (+dirty when the tree has changes)."""
    import subprocess

    import aotfuse

    here = os.path.dirname(os.path.abspath(aotfuse.__file__))
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"aotfuse {aotfuse.__version__}" + (f" ({commit})" if commit else "")


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _check_cell(r: Result) -> str:
    if r.check in ("reference", "-"):
        return r.check
    return f"{r.check} (loss {_fmt(r.loss_diff, '.1e')}, grads {_fmt(r.grad_diff, '.1e')})"


def _status_cell(r: Result, fallback: str) -> str:
    slow = f" ({r.kernel_fallbacks} kernel calls ran as ATen calls)" if r.kernel_fallbacks else ""
    if r.status == "ok":
        return "ok" + slow
    what = {"fallback": f"fallback ({fallback})", "failed": "failed", "n/a": "n/a"}[r.status]
    return f"{what}{slow}: {r.reason}".replace("|", "\\|")


def write_results(results: list[Result], descriptions: list[str], out_dir: str, settings: Settings,
                  stem: str | None = None) -> dict[str, str]:
    """Writes <stem>.md, <stem>.csv and (with matplotlib) <stem>.png; returns {kind: path}."""
    device, repeats, warmup = settings.device, settings.repeats, settings.warmup
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or f"hf-{device}-{datetime.date.today()}"
    paths = {"md": os.path.join(out_dir, stem + ".md"), "csv": os.path.join(out_dir, stem + ".csv")}
    cpu = device == "cpu"
    mem_head = "mem (MB)" if cpu else "mem (GB)"
    mem_scale = 1e6 if cpu else 1e9
    fields = [f.name for f in dataclasses.fields(Result)]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in results:
            w.writerow([("" if v is None else v) for v in dataclasses.astuple(r)])

    lines = [f"# Seed benchmark: Hugging Face training step ({device})", "", f"machine: {_machine(device, settings.load)}", "",
             f"| model | dtype | name | time (s) | {mem_head} | time % | mem % | saved {mem_head[4:]} | first step (s) "
             "| numeric check | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.model} | {r.dtype} | {r.name} | {_fmt(r.time_s, '.4f')} | "
            f"{_fmt(None if r.mem_bytes is None else r.mem_bytes / mem_scale, '.3f')} | "
            f"{_fmt(r.time_pct, '.0f')} | {_fmt(r.mem_pct, '.0f')} | "
            f"{_fmt(None if r.saved_bytes is None else r.saved_bytes / mem_scale, '.3f')} | {_fmt(r.first_step_s, '.1f')} | "
            f"{_check_cell(r)} | {_status_cell(r, settings.aotfuse_fallback)} |")
    mem_note = ("mem = peak bytes allocated during one training step, less those allocated when the step "
                "began (weights of all contenders): the running sum of torch's CPU allocation events "
                "(torch.profiler, profile_memory=True), in MB (1e6 bytes)" if cpu else
                "mem = torch.cuda.max_memory_allocated() over one training step after reset_peak_memory_stats(), "
                "less the memory allocated when the step began (weights of all contenders), in GB (1e9 bytes)")
    mem_note += ("; saved = bytes saved for backward in that step: unique storages of the tensors autograd saves "
                 "(torch.autograd.graph.saved_tensors_hooks), parameters excluded")
    notes = [
        "", "## Notes", "",
        "- step = optimizer.zero_grad(set_to_none=True) + forward with labels + loss.backward() + "
        "optimizer.step() (SGD, lr 1e-4); each contender trains its own copy of the same initial weights.",
        f"- time = median of {repeats} steps per contender, run interleaved (one step of each contender per "
        f"repetition, starting contender rotating); {warmup} warm-up step(s) per contender excluded "
        f"(the first one compiles: 'first step (s)'; torch.compile's on-disk caches make a rerun's first step "
        f"faster)" + ("; CUDA-synchronized" if not cpu else "") + ".",
        f"- {mem_note}.",
        "- time % and mem % are relative to eager (100).",
        "- numeric check: max abs difference of the loss and of all parameter gradients against eager after "
        "the first step; pass when every element is within atol + rtol * |eager| (fp32: atol 1e-4, rtol 5e-3; "
        "fp16/bf16: atol 1e-2, rtol 1e-1).",
        "- contenders: eager; aotfuse = aotfuse.memory_efficient_fusion(model) (where it cannot capture the model "
        f"it is rebuilt with fallback={settings.aotfuse_fallback!r} and marked fallback); torch.compile = torch.compile(model, backend='inductor', "
        "dynamic=False); functorch = functorch.compile.memory_efficient_fusion(model), n/a where it does "
        "not run on this torch; aotfuse-aten-norms (on request) = aotfuse with layer norm and softmax left to "
        "ATen's kernels (decompositions=default_decompositions(norms=False)); aotfuse-eager-attn (on request) = "
        "aotfuse without its attention rewrite (AOTFUSE_FUSE_ATTENTION=0); aotfuse-dynamo (on request) = "
        "torch.compile(model, backend='aotfuse', dynamic=False); eager-sdpa (on request) = eager "
        "with the model's attention switched to torch's scaled_dot_product_attention "
        "(model.set_attn_implementation('sdpa'); n/a for Longformer): a yardstick for what fused attention "
        "kernels (flash or memory-efficient on CUDA) alone give; aotfuse+NAME=VALUE (on request) = aotfuse "
        "with those AOTFUSE_* variables set around each of its steps (its lowering included).",
        f"- models ({settings.size} size; random weights from config classes, nothing downloaded; config "
        f"defaults except: dropout probabilities {settings.dropout:g}, attention implementation "
        f"'{settings.attn}' (Longformer: its own); inputs: random input_ids and labels"
        + (", attention_mask of ones" if settings.attention_mask else " (as the seed; no attention_mask)")
        + (f"; Longformer's first {settings.global_attention} tokens attend globally (global_attention_mask)"
           if settings.global_attention else "")
        + ("; every contender's model with gradient checkpointing (gradient_checkpointing_enable, "
           "use_reentrant=False): the eager reference recomputes each layer too" if settings.gradient_checkpointing
           else "") + "):",
    ]
    if settings.tf32:
        notes.insert(-1, "- TF32: every contender's CUDA float32 matmuls and convolutions on TF32 tensor cores "
                         "(torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32; torch's default before 1.12).")
    notes += [f"  - {d}" for d in descriptions]
    if any(r.model == "GPT2LMHeadModel" for r in results):
        notes.append("- GPT2LMHeadModel keeps its config default use_cache=True (as the seed): its outputs also "
                     "carry a KV cache, which the step does not use.")
    problems = [r for r in results if r.status != "ok" or r.check == "FAIL"]
    if problems:
        notes += ["- failures, fallbacks and n/a:"]
        for r in problems:
            what = r.reason or f"numeric check failed (worst gradient: {r.grad_worst})"
            if r.check == "FAIL" and r.reason:
                what += f"; numeric check failed (worst gradient: {r.grad_worst})"
            notes.append(f"  - {r.model} {r.dtype} {r.name}: {r.status}: {what}")
    with open(paths["md"], "w") as f:
        f.write("\n".join(lines + notes) + "\n")

    png = os.path.join(out_dir, stem + ".png")
    if _chart(results, png, device):
        paths["png"] = png
    return paths


def _chart(results: list[Result], path: str, device: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("aotfuse.bench: matplotlib is not installed, chart skipped (pip install matplotlib)", file=sys.stderr)
        return False
    groups = list(dict.fromkeys((r.model, r.dtype) for r in results))
    names = list(dict.fromkeys(r.name for r in results))
    by = {(r.model, r.dtype, r.name): r for r in results}
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.6 * len(groups) + 2), 7), sharex=True)
    width = 0.8 / max(1, len(names))
    colors = {name: f"C{j}" for j, name in enumerate(names)}
    for ax, attr, label in ((axes[0], "time_pct", "step time, % of eager"),
                            (axes[1], "mem_pct", "memory, % of eager")):
        for j, name in enumerate(names):
            xs, ys, hatches = [], [], []
            for i, g in enumerate(groups):
                r = by.get((g[0], g[1], name))
                value = getattr(r, attr) if r is not None else None
                if value is not None:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(value)
                    hatches.append("//" if r.status == "fallback" else "")
            legend = name if xs else f"{name} (failed or n/a everywhere)"
            if not xs:  # keep the legend entry, draw nothing
                ax.bar([0], [0], width, color=colors[name], label=legend)
                continue
            bars = ax.bar(xs, ys, width, color=colors[name], label=legend)
            for bar, hatch in zip(bars, hatches):
                bar.set_hatch(hatch)
        ax.axhline(100, color="gray", linewidth=0.8)
        ax.set_ylabel(label)
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels([f"{m.replace('For', chr(10) + 'For').replace('LMHead', chr(10) + 'LMHead')}\n{d}"
                             for m, d in groups], fontsize=8)
    axes[0].legend(fontsize=8, ncol=len(names))
    axes[0].set_title(f"HF training step, {device} (lower is better; hatched = fell back to eager; "
                      f"missing = failed or n/a)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- command line

def _csv_list(choices: tuple | dict, pattern: re.Pattern | None = None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices and not (pattern is not None and pattern.fullmatch(s))]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m aotfuse.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", type=_csv_list(MODELS), default=list(MODELS),
                    help=f"comma-separated, default all: {','.join(MODELS)}")
    ap.add_argument("--dtypes", type=_csv_list(DTYPES), default=None,
                    help="comma-separated from fp32,fp16,bf16 (default: cpu fp32, a few minutes on 2 cores; "
                         "cuda fp32,fp16,bf16)")
    ap.add_argument("--backends", type=_csv_list(BACKENDS + EXTRA_BACKENDS, ENV_BACKEND), default=list(BACKENDS),
                    help=f"comma-separated, default all: {','.join(BACKENDS)} (eager is always run: the reference); "
                         f"also {','.join(EXTRA_BACKENDS)}, and aotfuse+AOTFUSE_NAME=VALUE[+...] (aotfuse with "
                         "those variables set around its steps)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per contender (default cpu 10, cuda 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contender, the compiling one included")
    ap.add_argument("--size", choices=("auto",) + SIZES, default="auto",
                    help="model shapes: seed (the seed's, default on cuda), reduced (default on cpu), tiny (smoke)")
    ap.add_argument("--attn", choices=("eager", "sdpa"), default="eager",
                    help="HF attention implementation (eager = the seed's explicit softmax attention)")
    ap.add_argument("--dropout", type=float, default=1e-8, help="every dropout probability (the seed: ~0)")
    ap.add_argument("--attention-mask", action="store_true",
                    help="also pass an attention_mask of ones (the seed passed input_ids and labels only)")
    ap.add_argument("--global-attention", type=int, default=0, metavar="N",
                    help="Longformer: a global_attention_mask whose first N tokens attend globally")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="every contender checkpoints each layer (model.gradient_checkpointing_enable())")
    ap.add_argument("--aotfuse-fallback", default="dynamo",
                    help="memory_efficient_fusion(model, fallback=...) for a model aotfuse cannot capture "
                         "(dynamo, the default: Dynamo splits the graph and aotfuse compiles the pieces; or eager)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default on cpu: 1, steadier on a shared machine, as "
                         "benchmarks/overhead.py; on cuda: torch's)")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--name", default=None, help="file stem (default hf-<device>-<date>)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--tf32", action="store_true",
                    help="CUDA: let every contender's float32 matmuls and convolutions use TF32 tensor cores "
                         "(torch's default before 1.12, so likely the seed's A100 conditions; off by default)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no new (model, dtype) group starts; results are written after "
                         "every group either way")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.dtypes is None:
        args.dtypes = ["fp32"] if args.device == "cpu" else ["fp32", "fp16", "bf16"]
    if args.device == "cpu" and "fp16" in args.dtypes:
        print("aotfuse.bench: fp16 training on CPU is slow and rarely meaningful; measuring it anyway",
              file=sys.stderr)
    if args.repeats is None:
        args.repeats = 10 if args.device == "cpu" else 20
    if args.repeats < 1 or args.warmup < 1:
        ap.error("--repeats and --warmup must be at least 1")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.size == "auto":
        args.size = "seed" if args.device == "cuda" else "reduced"
    return args


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Command line entry: runs the benchmark, prints the markdown table, writes md/csv/png."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    backends = ["eager"] + [b for b in args.backends if b != "eager"]
    settings = Settings(device=args.device, size=args.size, repeats=args.repeats, warmup=args.warmup,
                        attn=args.attn, dropout=args.dropout, attention_mask=args.attention_mask,
                        gradient_checkpointing=args.gradient_checkpointing, aotfuse_fallback=args.aotfuse_fallback,
                        tf32=args.tf32, global_attention=args.global_attention)
    load_start = _load()
    def partial(rows: list, descs: list) -> None:
        write_results(rows, descs, args.out_dir, settings, stem=args.name)

    results, descriptions = run(args.models, args.dtypes, backends, settings, progress=not args.no_progress,
                                on_group=partial, time_budget=args.time_budget)
    load_end = _load()
    if load_start is not None and load_end is not None:
        settings.load = (load_start, load_end)
    paths = write_results(results, descriptions, args.out_dir, settings, stem=args.name)
    with open(paths["md"]) as f:
        print(f.read())
    print("written: " + ", ".join(paths.values()))
    return paths


if __name__ == "__main__":
    main()
