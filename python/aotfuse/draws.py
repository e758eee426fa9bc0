"""Random draws met while a capture traces a forward.

Two things a traced forward may do with random numbers, beside drawing dropout masks (which the
graph redraws every call):

1. Test a uniform draw against a probability, as LayerDrop does in BART, Pegasus, Marian, M2M100,
   Whisper and Wav2Vec2: ``if torch.rand([]) < self.layerdrop: skip the layer``. Tracing cannot
   branch on the draw (it is data), so such a model was never captured whole, though its default
   probability is 0 and the test then always fails. `decided_draws` tells such tests where the
   probability decides them whatever the draw: ``torch.rand`` is in [0, 1) (in [0, 1] in 16-bit
   dtypes, which may round up), so ``u < p`` is false for every p <= 0 and true for p > 1 (p >= 1
   in float32 and float64). The comparison is still traced, as the draw is (the graph draws it each
   call, as eager does); only its truth value, asked by ``if``, ``and``, ``not`` or ``.item()``, is
   answered. Anything else (a probability strictly inside the range, arithmetic on the draw) stays
   data, and the capture fails as before: a LayerDrop that can skip layers runs under the fallback.

2. Draw Python or NumPy random numbers (``random.uniform(0, 1) < self.layerdrop`` in MusicGen,
   SpecAugment's ``np.random`` time masks in Wav2Vec2 and HuBERT). Tracing runs that Python once, so
   the graph would keep the first call's numbers for every later call: a frozen mask, a layer always
   kept or always skipped. `python_rng_state` is compared before and after a trace; a change refuses
   the capture (compile.RandomStateError), and the fallback (Dynamo runs such Python each call, or
   eager) takes the function.
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TB = torch._C.TensorBase


def _comparisons() -> dict:
    """Comparison functions and methods -> the operator, written draw-first ("lt": draw < p)."""
    out = {}
    for op, aliases in (("lt", ("less",)), ("le", ("less_equal",)), ("gt", ("greater",)), ("ge", ("greater_equal",))):
        for name in (op, *aliases):
            out[getattr(torch, name)] = out[getattr(_TB, name)] = op
        out[getattr(_TB, f"__{op}__")] = op
    return out


_CMP = _comparisons()
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}  # p < u is u > p
_TRUTH = (_TB.__bool__, _TB.item)


def _decide(op: str, p: float, closed: bool) -> bool | None:
    """The truth of `u <op> p` for every u in [0, 1) ([0, 1] where `closed`), or None where it
    depends on u."""
    if op == "lt":
        return False if p <= 0 else True if (p > 1 or (p == 1 and not closed)) else None
    if op == "le":
        return False if p < 0 else True if p >= 1 else None
    if op == "gt":
        return True if p < 0 else False if p >= 1 else None
    return True if p <= 0 else False if p > 1 or (p == 1 and not closed) else None  # ge


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class decided_draws(TorchFunctionMode):
    """While a forward is traced: the truth of `torch.rand(...) <op> p` (one element, p a Python
    number) where p decides it for every draw (module docstring). `decided` counts the answers."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (draw, closed range)
        self.known: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (comparison, its truth)
        self.decided = 0
        self.undecided = 0  # comparisons of a draw with a number that the number does not decide

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRUTH and len(args) == 1 and not kwargs:
            known = self.known.get(id(args[0]))
            if known is not None and known[0] is args[0]:
                self.decided += 1
                return known[1]
        out = func(*args, **kwargs)
        if func is torch.rand and isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point():
            self.draws[id(out)] = (out, out.dtype not in (torch.float32, torch.float64))
        elif func in _CMP and len(args) == 2 and not kwargs and isinstance(out, torch.Tensor):
            a, b = args
            op = _CMP[func]
            if not _number(b):
                a, b, op = b, a, _FLIP[op]
            draw = self.draws.get(id(a)) if isinstance(a, torch.Tensor) else None
            if draw is not None and draw[0] is a and _number(b):
                truth = _decide(op, float(b), draw[1])
                if truth is not None:
                    self.known[id(out)] = (out, truth)
                else:
                    self.undecided += 1
        return out


def restore_python_rng_state(state: tuple) -> None:
    """Sets the states python_rng_state() read back (a refused capture leaves the caller's generators
    as it found them, so the fallback's call draws what eager's would)."""
    random.setstate(state[0])
    np = sys.modules.get("numpy")
    if np is not None and len(state) > 1:
        kind, keys, pos, has_gauss, gauss = state[1]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, gauss))


def python_rng_state() -> tuple:
    """The global states of Python's `random` and (where imported) NumPy's legacy `np.random`, as a
    comparable value."""
    state: list = [random.getstate()]
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
            state.append((kind, keys.tobytes(), pos, has_gauss, gauss))
        except Exception:  # noqa: BLE001 - an unusual NumPy: only Python's state is compared
            pass
    return tuple(state)
