"""Numeric checks of a compiled model against eager and against a float64 reference.

`compare_models` trains three copies of a model with identical weights for a few SGD steps on the
same inputs: eager in `dtype`, compiled (aotfuse by default) in `dtype`, and an eager float64
reference. At every step it compares each output tensor, each parameter's gradient (by name) and
each parameter and buffer after the update, with two criteria:

1. the seed's tolerance, aotfuse vs eager, elementwise: ``|c - e| <= atol + rtol * |e|``
   (`TOLERANCES`, per dtype);
2. the float64 criterion, which tells rounding from bugs: with ``r`` the float64 reference,
   ``max|c - r| <= k * max|e - r| + floor``, ``k = ref_multiple`` (default `REF_MULTIPLE` = 4) and
   ``floor = max(REF_FLOOR_EPS * eps(dtype), atol / 10) * max|r|``, `REF_FLOOR_EPS` = 2.

Why these numbers: eager's own distance to float64 is the rounding noise of this computation in
this dtype. A correct compiled program rounds differently (other reduction orders, decompositions
that round intermediates eager keeps in float32) but not by much more. Measured on Albert, Bert and
GPT2 (fp32 and bf16, train and eval, with and without attention_mask, 3 steps, 2424 tensors):
wherever eager's error was at least eps * max|r|, aotfuse's was at most 2.4x it (fp32; 1.8x in
bf16), so k = 4 leaves headroom while a real error is typically orders of magnitude larger. Where
aotfuse's error exceeded 4x eager's, eager was almost exact (a scalar loss that eager's kernel
accumulates in higher precision and rounds onto the float64 value) and aotfuse was within
0.9 eps * max|r|. The floor covers that case: at least two eps (the other rounding neighbour and
one more) and, in float32, a tenth of the seed's atol (1e-5, about 80 eps, room for a reduction
done in another order). Both are relative to the tensor's own magnitude, or, for gradients (and
parameter updates), to the largest gradient of the step (times lr) when that is larger: a gradient
that is mathematically zero (Longformer's global-attention key bias without global tokens) comes out
as rounding noise of terms that cancel, whose size its own magnitude does not tell; for a buffer,
to the largest of its module's float buffers that the step changed (a BatchNorm running mean that is
mathematically 0, beside its running variance). Far below the
seed's tolerance either way, so the criterion stays the sharper one.

A seed-tolerance failure where eager itself is no closer to float64 than that same tolerance
(``|e - r| <= atol + rtol * |r|`` fails too: whole-model bfloat16 gradients, say) says nothing about
aotfuse: the tolerance is below this computation's rounding noise. If the float64 criterion passes
there, it is recorded as a note, not a mismatch.

Every mismatch is recorded with the model, dtype, step and what it was ("grad of
bert.encoder.layer.0.attention.self.query.weight"); the check keeps going and `Report` lists them
all. A comparison whose eager value is not finite (bfloat16 overflow, say) is skipped and noted, not
failed. Exceptions raised by the compiled model (a `CaptureError`, a C core error) propagate. A model
that cannot run in float64 (XGLM's `torch.full((), finfo(float64).min)` is float32 and overflows) is
compared against eager alone, at the seed's tolerances, with one note saying why. A Hugging Face
mixture-of-experts model's float64 copy runs its experts as plain loops (the grouped matmul has no
float64 kernel), so it keeps its float64 reference.

``dtype=torch.float64`` runs eager and the compiled copy in float64 (the reference is eager itself):
whether the compiled program computes the same function, where rounding of a lower precision cannot
hide anything nor be blamed. It tells a real error from rounding that an ill-conditioned model
amplifies (batch norm over two samples on 1x1 maps: a float32 step's gradients 0.2 from float64
where eager's are 0.001, and the same program in float64 3e-15 from eager). The tolerance is
``1e-9 + 1e-7 * |e|`` elementwise and ``1e-10 * max|e|`` (or the step's largest gradient) as the
criterion: orders of magnitude above float64's reordering noise, far below any wrong term.

Example:
    >>> import torch, aotfuse.testing as T
    >>> report = T.compare_models(lambda: torch.nn.Linear(4, 2), lambda: (torch.randn(3, 4),))
    >>> report.assert_ok()
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import torch
import torch.nn as nn

from .lower import LIVE

__all__ = ["TOLERANCES", "REF_MULTIPLE", "REF_FLOOR_EPS", "Mismatch", "Note", "Report", "compare_models"]

# (atol, rtol) of the seed's check, aotfuse vs eager
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 5e-3),
    torch.float16: (1e-2, 1e-1),
    torch.bfloat16: (1e-2, 1e-1),
    torch.float64: (1e-9, 1e-7),  # the same program in float64: see the module docstring
}
REF_MULTIPLE = 4.0  # k: aotfuse's error vs float64 may be this many times eager's
REF_FLOOR_EPS = 2.0  # the float64 criterion's floor is at least this many eps(dtype), times max|reference|

_SEED = 20240  # each step's forward runs with the same RNG state in all three copies
_MAX_DEPTH = 8  # how deep outputs are searched for tensors inside other objects (HF caches)
_PLAIN = (torch.Tensor, nn.Parameter)  # a compiled model may give one where eager gives the other


@dataclasses.dataclass
class Mismatch:
    """One compared tensor that failed. `failed` names the criteria: "tolerance" (the seed's,
    aotfuse vs eager), "fp64" (aotfuse's error vs float64 beyond k times eager's), "non-finite"
    (aotfuse not finite where eager is) or "structure" (types, shapes, dtypes, missing values).
    `max_abs_err`/`max_rel_err` are aotfuse vs eager (maxima over the tensor, relative error
    elementwise); `aotfuse_err`/`eager_err` are max distances to the float64 reference and
    `allowed` the fp64 criterion's bound (nan where not computed)."""

    model: str
    dtype: torch.dtype
    step: int
    what: str
    failed: str
    max_abs_err: float = math.nan
    max_rel_err: float = math.nan
    aotfuse_err: float = math.nan
    eager_err: float = math.nan
    allowed: float = math.nan
    detail: str = ""


@dataclasses.dataclass
class Note:
    """Something that is not a mismatch but should be seen: a comparison skipped (eager or the
    float64 reference not finite) or a seed-tolerance failure that rounding explains."""

    step: int
    what: str
    reason: str


@dataclasses.dataclass
class Report:
    """What compare_models found. `ok` is True when nothing mismatched; str(report) is a table."""

    model: str
    dtype: torch.dtype
    steps: int
    ref_multiple: float
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)
    notes: list[Note] = dataclasses.field(default_factory=list)
    checked: int = 0  # tensors compared
    worst_fp64: float = 0.0  # max over comparisons of aotfuse_err / allowed (<= 1 passes)
    worst_fp64_what: str = ""
    autocast: bool = False  # dtype is the autocast dtype (parameters in float32 or as given)
    # kernel calls that ran as ATen calls instead (a layout the plan did not expect), summed over the
    # programs the compiled copy made: not wrong answers, but each is slow on every run
    kernel_fallbacks: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def assert_ok(self) -> None:
        """Raises AssertionError with the summary table when anything mismatched."""
        if not self.ok:
            raise AssertionError("\n" + str(self))

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "") + (" autocast" if self.autocast else "")
        lines = [f"{self.model} {dt}, {self.steps} steps: {self.checked} tensors compared, "
                 f"{len(self.mismatches)} mismatches, {len(self.notes)} notes, {self.kernel_fallbacks} kernel "
                 f"fallbacks; worst aotfuse error vs "
                 f"fp64 = {self.worst_fp64:.2f} of allowed ({self.worst_fp64_what or '-'}; k={self.ref_multiple:g})"]
        if self.mismatches:
            header = ("step", "what", "failed", "max abs err", "max rel err", "aotfuse vs fp64", "eager vs fp64",
                      "allowed")
            rows = [header] + [(str(m.step), m.what + (f" ({m.detail})" if m.detail else ""), m.failed,
                                _fmt(m.max_abs_err), _fmt(m.max_rel_err), _fmt(m.aotfuse_err), _fmt(m.eager_err),
                                _fmt(m.allowed)) for m in self.mismatches]
            widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
            for i, r in enumerate(rows):
                lines.append("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
                if i == 0:
                    lines.append("  " + "-+-".join("-" * w for w in widths))
        by_reason: dict[str, list[Note]] = {}
        for n in self.notes:
            by_reason.setdefault(n.reason if "seed tolerance" not in n.reason else "", []).append(n)
        for reason, notes in by_reason.items():
            if reason:  # one line per reason: a non-finite reference makes hundreds of notes
                whats = ", ".join(f"step {n.step} {n.what}" for n in notes[:3])
                more = f" and {len(notes) - 3} more" if len(notes) > 3 else ""
                lines.append(f"  note: {reason}: {whats}{more}")
            else:
                lines.extend(f"  note: step {n.step} {n.what}: {n.reason}" for n in notes)
        return "\n".join(lines)


def _fmt(x: float) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.3g}"


# -- walking outputs and inputs --

def _named_tensors(tree: Any) -> dict[str, torch.Tensor]:
    """Every tensor in an output, by path: "loss", "logits", "[0]", "past_key_values.layers[0].keys".
    Looks into dicts (ModelOutput), sequences, dataclasses and, for other objects (HF caches),
    their public attributes, so that a tensor hidden in an object is compared too."""
    out: dict[str, torch.Tensor] = {}
    _walk(tree, "", out, set(), 0)
    return out


def _walk(x: Any, path: str, out: dict, seen: set, depth: int) -> None:
    if isinstance(x, torch.Tensor):
        out[path] = x
        return
    if depth > _MAX_DEPTH or id(x) in seen or x is None:
        return
    if isinstance(x, (str, bytes, int, float, complex, bool, type, nn.Module, torch.dtype, torch.device)):
        return
    seen.add(id(x))
    if isinstance(x, dict):
        for k, v in x.items():
            _walk(v, f"{path}.{k}" if path else str(k), out, seen, depth + 1)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", out, seen, depth + 1)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            _walk(getattr(x, f.name, None), f"{path}.{f.name}" if path else f.name, out, seen, depth + 1)
    elif hasattr(x, "__dict__") and not callable(x):
        for k, v in vars(x).items():
            if not k.startswith("_"):
                _walk(v, f"{path}.{k}" if path else k, out, seen, depth + 1)


def _cast_inputs(tree: Any, dtype: torch.dtype) -> Any:
    """A fresh copy of the inputs, floating tensors in `dtype` (new leaves, requires_grad kept)."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach().to(dtype) if tree.is_floating_point() else tree.detach()
        return t.clone().requires_grad_(tree.requires_grad)
    if isinstance(tree, dict):
        return {k: _cast_inputs(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        vals = [_cast_inputs(v, dtype) for v in tree]
        return type(tree)(*vals) if hasattr(type(tree), "_fields") else type(tree)(vals)
    return tree


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (list, tuple)) and not hasattr(type(inputs), "_fields"):
        return tuple(inputs), {}
    return (inputs,), {}


# -- comparing one tensor --

class _Checker:
    """Compares one tensor at a time (aotfuse, eager, float64 reference) into a Report."""

    def __init__(self, report: Report, dtype: torch.dtype, ref_multiple: float):
        self.report = report
        self.dtype = dtype
        self.atol, self.rtol = TOLERANCES[dtype]
        self.k = ref_multiple
        self.floor = max(REF_FLOOR_EPS * torch.finfo(dtype).eps, self.atol / 10)
        self.tiny = torch.finfo(dtype).tiny
        # Scale of the quantities a tensor is computed from, when its own magnitude says nothing
        # (a gradient that is mathematically zero comes out as rounding noise of the terms that
        # cancel): the largest gradient of the step for gradients, that times lr for updates.
        self.context_scale = 0.0
        self.without_ref = False  # the float64 copy failed: the seed's tolerances alone (one note says so)

    def mismatch(self, step: int, what: str, failed: str, **fields: Any) -> None:
        self.report.mismatches.append(Mismatch(self.report.model, self.report.dtype, step, what, failed, **fields))

    def note(self, step: int, what: str, reason: str) -> None:
        self.report.notes.append(Note(step, what, reason))

    def structure(self, step: int, what: str, detail: str) -> None:
        self.mismatch(step, what, "structure", detail=detail)

    def compare(self, step: int, what: str, c: torch.Tensor | None, e: torch.Tensor | None,
                r: torch.Tensor | None) -> None:
        if c is None or e is None:
            if (c is None) != (e is None):
                self.structure(step, what, f"{'missing' if c is None else 'present'} in aotfuse, "
                                           f"{'missing' if e is None else 'present'} in eager")
            return
        self.report.checked += 1
        if type(c) is not type(e) and not (type(c) in _PLAIN and type(e) in _PLAIN):
            self.structure(step, what, f"aotfuse gave a {type(c).__module__}.{type(c).__name__}, eager a "
                                       f"{type(e).__name__}")
            return
        if c.shape != e.shape or c.dtype != e.dtype:
            self.structure(step, what, f"aotfuse {c.dtype} {tuple(c.shape)}, eager {e.dtype} {tuple(e.shape)}")
            return
        c, e = c.detach(), e.detach()
        if c.numel() == 0:
            return
        if not e.is_floating_point():  # ids, masks, counters: exactly equal
            if not torch.equal(c, e):
                self.structure(step, what, f"{int((c != e).sum())} of {e.numel()} {e.dtype} elements differ")
            return
        c64, e64 = c.double(), e.double()
        if not bool(torch.isfinite(e64).all()):
            bad = int((~torch.isfinite(e64)).sum())
            self.note(step, what, f"eager is not finite ({bad} of {e.numel()} elements); comparison skipped")
            return
        if not bool(torch.isfinite(c64).all()):
            bad = int((~torch.isfinite(c64)).sum())
            self.mismatch(step, what, "non-finite", max_abs_err=math.inf, max_rel_err=math.inf,
                          detail=f"{bad} of {e.numel()} elements not finite in aotfuse only")
            return

        diff = (c64 - e64).abs()
        max_abs = float(diff.max())
        nonzero = e64 != 0
        rel = torch.where(nonzero, diff / e64.abs().where(nonzero, 1.0), torch.where(diff > 0, math.inf, 0.0))
        max_rel = float(rel.max())
        failed = []
        tolerance_failed = not bool((diff <= self.atol + self.rtol * e64.abs()).all())
        err_c = err_e = allowed = math.nan
        r64 = None if r is None else r.detach().double()
        if self.without_ref:
            pass
        elif r64 is None or r64.shape != e64.shape:
            self.note(step, what, "no float64 reference value; fp64 check skipped")
        elif not bool(torch.isfinite(r64).all()):
            self.note(step, what, "float64 reference is not finite; fp64 check skipped")
        else:
            err_c = float((c64 - r64).abs().max())
            err_e = float((e64 - r64).abs().max())
            allowed = self.k * err_e + self.floor * max(float(r64.abs().max()), self.context_scale) + self.tiny
            if err_c > allowed:
                failed.append("fp64")
            if err_c / allowed > self.report.worst_fp64:
                self.report.worst_fp64 = err_c / allowed
                self.report.worst_fp64_what = f"step {step} {what}"
            bound = self.atol + self.rtol * r64.abs()
            eager_within_tolerance = bool(((e64 - r64).abs() <= bound).all())
            if tolerance_failed and err_c <= allowed and not eager_within_tolerance:
                tolerance_failed = False  # the tolerance is below this computation's rounding noise
                self.note(step, what, f"seed tolerance exceeded (max abs err {max_abs:.3g}) but eager is no closer "
                                      f"to float64 than it ({err_e:.3g}); aotfuse vs float64 {err_c:.3g} <= "
                                      f"{allowed:.3g}")
            elif tolerance_failed and err_c <= allowed and bool(((c64 - r64).abs() <= bound).all()):
                # both within the seed's tolerance of float64, on either side of it: two roundings
                # that differ from each other by up to twice the tolerance
                tolerance_failed = False
                self.note(step, what, f"seed tolerance exceeded (max abs err {max_abs:.3g}) but aotfuse is within it "
                                      f"of float64, as eager is; aotfuse vs float64 {err_c:.3g} <= {allowed:.3g}")
        if tolerance_failed:
            failed.insert(0, "tolerance")
        if failed:
            self.mismatch(step, what, ", ".join(failed), max_abs_err=max_abs, max_rel_err=max_rel,
                          aotfuse_err=err_c, eager_err=err_e, allowed=allowed)


# -- the driver --

def _cotangent(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # random cotangents, not ones: sum() would zero the gradient through a softmax or a LayerNorm
    # and hide errors there; divided by numel like a mean-reduced loss, so gradients keep the scale
    # of training (the scale the seed's tolerances were set for). A scalar (a loss) gets 1.
    if t.numel() == 1:
        return torch.ones_like(t)
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float64) / t.numel()
    return noise.to(device=t.device, dtype=t.dtype)


def _backward(outs: dict[str, torch.Tensor], cots: dict[str, torch.Tensor]) -> None:
    tensors = [outs[k] for k in cots if k in outs and outs[k].requires_grad]
    grads = [cots[k].to(outs[k].dtype) for k in cots if k in outs and outs[k].requires_grad]
    if tensors:
        torch.autograd.backward(tensors, grads)


def compare_models(make_model: Callable[[], nn.Module] | nn.Module, make_inputs: Callable[[], Any] | Any, *,
                   dtype: torch.dtype = torch.float32, steps: int = 3, name: str | None = None,
                   compile_fn: Callable[[nn.Module], Callable] | None = None, lr: float = 1e-3,
                   ref_multiple: float = REF_MULTIPLE, autocast: torch.dtype | None = None) -> Report:
    """Trains eager, compiled and float64 copies of a model for `steps` SGD steps on the same inputs
    and compares outputs, gradients by parameter name, and parameters and buffers after each update.

    make_model: a module, or a function returning one (random weights; its train/eval mode is kept).
    make_inputs: the inputs, or a function returning them: a dict (keyword arguments), a tuple or list
        (positional arguments) or one tensor. Floating tensors are cast to `dtype` (float64 for the
        reference); integer tensors (ids, labels, masks) are used as they are.
    compile_fn: module -> callable that trains that module's own parameters; defaults to
        aotfuse.memory_efficient_fusion. E.g. lambda m: torch.compile(m, backend="aotfuse").
    ref_multiple: k of the float64 criterion (see the module docstring).
    autocast: mixed precision: eager and the compiled copy run their forwards under
        torch.autocast(<the model's device>, dtype=autocast) with `dtype` parameters (the float64
        reference runs without it), and the tolerances are those of the autocast dtype.

    The backward pass of each copy is the sum over differentiable output tensors of <output,
    cotangent>: 1 for scalars (a loss), otherwise a fixed random tensor divided by its numel (the
    scale of a mean-reduced loss), the same in all three copies.
    Returns a Report; exceptions of the compiled model propagate.

    Example:
        >>> from transformers import BertConfig, BertForMaskedLM
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        ...                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> report = compare_models(lambda: BertForMaskedLM(cfg), lambda: dict(input_ids=ids, labels=ids),
        ...                         dtype=torch.bfloat16)
        >>> report.assert_ok()  # or print(report): the summary table
    """
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {list(TOLERANCES)}, got {dtype}")
    if autocast is not None and autocast not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast must be torch.float16 or torch.bfloat16, got {autocast}")
    if compile_fn is None:
        from .compile import memory_efficient_fusion as compile_fn
    # the caller's RNG state is left as it was (make_model may seed; each step reseeds)
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        base = make_model if isinstance(make_model, nn.Module) else make_model()
        if not isinstance(base, nn.Module):
            raise TypeError(f"make_model must give an nn.Module, got {type(base).__name__}")
        inputs = make_inputs() if callable(make_inputs) and not isinstance(make_inputs, torch.Tensor) else make_inputs
        report = Report(name or type(base).__name__, autocast or dtype, steps, ref_multiple, autocast=autocast is not None)
        _train_and_compare(base, inputs, compile_fn, lr, steps, _Checker(report, autocast or dtype, ref_multiple),
                           dtype, autocast)
    return report


def _train_and_compare(base: nn.Module, inputs: Any, compile_fn: Callable, lr: float, steps: int,
                       check: _Checker, dtype: torch.dtype, autocast: torch.dtype | None) -> None:
    before = set(LIVE)  # programs made before: not this model's
    eager = copy.deepcopy(base).to(dtype)
    ref = copy.deepcopy(eager).double()  # the same (rounded) weights, computed in float64
    _plain_experts(ref)
    compiled_base = copy.deepcopy(eager)
    compiled = compile_fn(compiled_base)
    # (module whose parameters train, what is called)
    copies = {"eager": (eager, eager), "aotfuse": (compiled_base, compiled), "ref": (ref, ref)}
    ins = {tag: _split_inputs(_cast_inputs(inputs, torch.float64 if tag == "ref" else dtype))
           for tag in copies}
    opts = {tag: torch.optim.SGD(mod.parameters(), lr=lr) for tag, (mod, _) in copies.items()}
    device = next((p.device.type for p in eager.parameters()), "cpu")

    for step in range(steps):
        outs, trees = {}, {}
        ref_buffers = {k: b.detach().clone() for k, b in ref.named_buffers() if b.is_floating_point()}
        for tag, (_, fn) in copies.items():
            opts[tag].zero_grad(set_to_none=True)
            torch.manual_seed(_SEED + step)  # the same dropout masks, where the RNG is used alike
            args, kwargs = ins[tag]
            try:
                with torch.autocast(device, dtype=autocast, enabled=autocast is not None and tag != "ref"):
                    trees[tag] = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only the float64 copy's: eager's and aotfuse's propagate
                if tag != "ref":
                    raise
                _drop_reference(check, step, "forward", e)
                trees[tag] = None
            outs[tag] = _named_tensors(trees[tag])
        if type(trees["aotfuse"]) is not type(trees["eager"]):
            check.structure(step, "output", f"aotfuse returned {type(trees['aotfuse']).__name__}, eager "
                                            f"{type(trees['eager']).__name__}")
        oe, oc, orf = outs["eager"], outs["aotfuse"], outs["ref"]
        for key in sorted(oc.keys() - oe.keys()):
            check.structure(step, f"output {key}" if key else "output", "only in aotfuse's output")
        for key, e in oe.items():
            what = f"output {key}" if key else "output"
            if key not in oc:
                check.structure(step, what, "missing from aotfuse's output")
                continue
            check.compare(step, what, oc[key], e, orf.get(key))
            if e.requires_grad and isinstance(oc[key], torch.Tensor) and not oc[key].requires_grad:
                check.structure(step, what, "does not require grad in aotfuse, does in eager")

        # the same cotangents in all three copies, over the outputs that are differentiable in
        # eager and in aotfuse alike; an output aotfuse gets wrong (another type, a tensor
        # leaked from the trace, no grad) is already recorded and left out of every backward,
        # so that the gradients still compare like for like
        gen = torch.Generator().manual_seed(_SEED + step)
        cots = {k: _cotangent(t, gen) for k, t in oe.items()
                if t.requires_grad and t.is_floating_point() and k in oc
                and type(oc[k]) in _PLAIN and oc[k].requires_grad and oc[k].shape == t.shape}
        for tag in copies:
            try:
                _backward(outs[tag], cots)
            except Exception as e:  # noqa: BLE001
                if tag != "ref" or check.without_ref:
                    raise
                _drop_reference(check, step, "backward", e)

        named = {tag: dict(mod.named_parameters()) for tag, (mod, _) in copies.items()}
        ref_grads = [p.grad for p in named["ref"].values() if p.grad is not None]
        grad_scale = max((float(g.abs().max()) for g in ref_grads if g.numel() and bool(torch.isfinite(g).all())),
                         default=0.0)
        check.context_scale = grad_scale
        for pname, p in named["eager"].items():
            if pname not in named["aotfuse"]:
                check.structure(step, f"parameter {pname}", "missing from the compiled model")
                continue
            rp = named["ref"].get(pname)
            check.compare(step, f"grad of {pname}", named["aotfuse"][pname].grad, p.grad,
                          None if rp is None else rp.grad)
        for iname, (ce, cc, cr) in _input_leaves(ins).items():
            check.compare(step, f"grad of input {iname}", cc.grad, ce.grad, cr.grad)

        for opt in opts.values():
            opt.step()
        check.context_scale = grad_scale * lr
        for pname, p in named["eager"].items():
            if pname in named["aotfuse"]:
                check.compare(step, f"{pname} after the update", named["aotfuse"][pname], p,
                              named["ref"].get(pname))
        bufs = {tag: dict(mod.named_buffers()) for tag, (mod, _) in copies.items()}
        # a buffer's context: its module's float buffers that the step changed (a running mean that is
        # mathematically 0 comes out as rounding noise of activations its running variance measures;
        # a constant buffer, a -1e4 mask value, says nothing about them)
        owner_scale: dict[str, float] = {}
        for bname, rb in bufs["ref"].items():
            old = ref_buffers.get(bname)
            if (old is not None and rb.numel() and not torch.equal(old, rb.detach())
                    and bool(torch.isfinite(rb).all())):
                owner = bname.rpartition(".")[0]
                owner_scale[owner] = max(owner_scale.get(owner, 0.0), float(rb.detach().abs().max()))
        for bname, b in bufs["eager"].items():
            check.context_scale = owner_scale.get(bname.rpartition(".")[0], 0.0)
            check.compare(step, f"buffer {bname} after the step", bufs["aotfuse"].get(bname), b,
                          bufs["ref"].get(bname))
        check.context_scale = 0.0
    # while the compiled copy (and so its programs) is alive
    check.report.kernel_fallbacks = sum(low.program.kernel_fallbacks for low in set(LIVE) - before)


def _plain_experts(ref: nn.Module) -> None:
    """A Hugging Face mixture-of-experts model's float64 copy runs its experts as plain loops of matmuls
    (`experts_implementation="eager"`): the grouped matmul the others run (ATen's `_grouped_mm`,
    transformers' fallback op) has no float64 kernel, and the loops compute the same sums, so the copy
    stays a float64 reference instead of being dropped (`_drop_reference`). transformers' setter passes
    the choice on to sub-models (a wrapper's MoE text model), so any module that can take it is asked.
    Where the setter refuses (a load-time choice, such as MegaMoE) or fails, the copy runs as it is:
    if its forward then fails, the reference is dropped with a note."""
    get = getattr(ref, "get_experts_implementation", None)
    if get is None or not any(getattr(m, "_can_set_experts_implementation", lambda: False)() for m in ref.modules()):
        return
    try:
        if all(impl == "eager" for impl in get().values()):
            return
        ref.set_experts_implementation("eager")
    except Exception:  # noqa: BLE001 - the copy runs as it is (see above)
        pass


def _drop_reference(check: _Checker, step: int, where: str, e: BaseException) -> None:
    """The float64 copy failed (a model written for 16- and 32-bit floats only): compared against eager
    alone from here on, at the seed's tolerances."""
    if not check.without_ref:
        check.without_ref = True
        first = str(e).splitlines()[0] if str(e) else ""
        check.note(step, "float64 reference", f"the model's float64 {where} failed ({type(e).__name__}: {first}); "
                                              f"compared against eager at the seed's tolerances only")


def _input_leaves(ins: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Input tensors that require grad, by path ("[0]", "x"), as (eager, aotfuse, ref) triples."""
    named = {}
    for tag, (args, kwargs) in ins.items():
        found = {**_named_tensors(list(args)), **_named_tensors(kwargs)}
        named[tag] = {k: t for k, t in found.items() if t.requires_grad}
    return {k: (t, named["aotfuse"][k], named["ref"][k]) for k, t in named["eager"].items()}
