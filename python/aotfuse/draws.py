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
   ``np.random.random() > self.layerdrop`` in the adapters of Wav2Vec2, WavLM and Data2VecAudio,
   ``np.random.uniform(0, 1)`` in VITS, SpecAugment's ``np.random`` time masks in Wav2Vec2 and
   HuBERT). Tracing runs that Python once, so the graph would keep the first call's numbers for
   every later call: a frozen mask, a layer always kept or always skipped. `python_draws` answers the
   LayerDrop form as (1) does: while a pass traces, ``random.random()``, ``random.uniform(a, b)``,
   ``np.random.random()``, ``np.random.rand()``, ``np.random.random_sample()`` and
   ``np.random.uniform(a, b)`` drawing one number return a `PythonDraw`, a number the trace does not
   know, whose comparison with a Python number that decides it answers and whose every other use
   raises UndecidedDrawError; each such call is recorded, and every run of the compiled program
   makes it again (`replay`), so Python's and NumPy's generators move as eager's calls move them.
   Other draws (arrays, ``from random import random``, other generators' methods) are left as they
   are: `python_rng_state` is compared before and after a pass, and a change refuses the capture
   (compile.RandomStateError), as does an undecided draw; the fallback (Dynamo runs such Python each
   call, or eager) takes the function.
"""
from __future__ import annotations

import random
import sys
import threading
from typing import Any, Callable

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


def _decide(op: str, p: float, closed: bool, lo: float = 0.0, hi: float = 1.0) -> bool | None:
    """The truth of `u <op> p` for every u in [lo, hi) ([lo, hi] where `closed`), or None where it
    depends on u."""
    top = p > hi or (p == hi and not closed)  # p above every u
    if op == "lt":
        return False if p <= lo else True if top else None
    if op == "le":
        return False if p < lo else True if p >= hi else None
    if op == "gt":
        return True if p < lo else False if p >= hi else None
    return True if p <= lo else False if top else None  # ge


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


class UndecidedDrawError(RuntimeError):
    """A Python or NumPy draw met while tracing was used otherwise than compared with a number that
    decides the comparison for every value it can take: the graph cannot draw it anew each call."""


class PythonDraw:
    """One number from Python's or NumPy's global generator, drawn while a forward is traced
    (`python_draws`), uniform in [lo, hi) ([lo, hi] where `closed`); the trace does not know its
    value. `draw < p` (any comparison, either side) with a Python number p answers where p decides it
    for every value (a draw in [0, 1) is taken as never exactly 0.0, which comes once in 2**53
    draws: `u > 0` is true); anything else (an undecided comparison, arithmetic, float(), an ``if``) raises
    UndecidedDrawError, so no value of the trace's own leaks into a graph that every call would reuse."""

    __slots__ = ("lo", "hi", "closed", "where", "unit")

    def __init__(self, lo: float, hi: float, closed: bool, where: str) -> None:
        self.lo, self.hi, self.closed, self.where = lo, hi, closed, where
        self.unit = (lo, hi, closed) == (0.0, 1.0, False)  # the generator's own 53-bit draw in [0, 1)

    def __repr__(self) -> str:
        return f"<{self.where}: a draw in [{self.lo}, {self.hi}{']' if self.closed else ')'} being traced>"

    def _compare(self, op: str, p: Any) -> bool:
        if _number(p) and p == 0 and self.unit and op in ("gt", "le"):
            # the adapters' `np.random.random() > layerdrop` at 0: exactly 0.0 comes once in 2**53
            # draws; taken as above 0, as the model means it (eager would skip a layer then)
            return op == "gt"
        truth = _decide(op, float(p), self.closed, self.lo, self.hi) if _number(p) else None
        if truth is None:
            raise UndecidedDrawError(f"{self.where} is compared with {p!r}, which does not decide the comparison "
                                     f"for every draw, so each call may take another branch")
        return truth

    def __lt__(self, p: Any) -> bool:
        return self._compare("lt", p)

    def __le__(self, p: Any) -> bool:
        return self._compare("le", p)

    def __gt__(self, p: Any) -> bool:
        return self._compare("gt", p)

    def __ge__(self, p: Any) -> bool:
        return self._compare("ge", p)

    def __eq__(self, p: Any) -> bool:  # type: ignore[override]
        if _number(p) and (not self.lo <= p <= self.hi or (p == 0 and self.unit)):
            return False
        raise UndecidedDrawError(f"{self.where} is compared for equality with {p!r}")

    def __ne__(self, p: Any) -> bool:  # type: ignore[override]
        return not self.__eq__(p)

    __hash__ = object.__hash__  # of the object, not of a value


def _refused(name: str) -> Callable:
    def use(self: PythonDraw, *args: Any) -> Any:
        raise UndecidedDrawError(f"{self.where}'s value is used ({name}), which a graph would keep from the "
                                 f"traced call for every later one")
    use.__name__ = name
    return use


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod",
              "rmod", "pow", "rpow", "neg", "pos", "abs", "float", "int", "index", "bool", "round", "trunc", "floor",
              "ceil", "complex", "format", "divmod", "rdivmod"):
    setattr(PythonDraw, f"__{_name}__", _refused(f"__{_name}__"))
del _name


def _no_args(args: tuple, kwargs: dict) -> tuple | None:
    return (0.0, 1.0, False) if not args and not kwargs else None


def _no_size(args: tuple, kwargs: dict) -> tuple | None:  # np.random.random(size=None)
    size = args[0] if args else kwargs.get("size")
    return (0.0, 1.0, False) if len(args) + len(kwargs) <= 1 and set(kwargs) <= {"size"} and size is None else None


def _between(args: tuple, kwargs: dict, size: bool) -> tuple | None:
    """(lo, hi, closed) of uniform(a, b) for one number; a + (b - a) * u may round to b: closed."""
    names = ("low", "high", "size") if size else ("a", "b")
    try:
        bound = dict(zip(names, args), **kwargs)
    except TypeError:
        return None
    if len(args) > len(names) or not set(bound) <= set(names) or bound.get("size") is not None:
        return None
    a, b = bound.get(names[0], 0.0 if size else None), bound.get(names[1], 1.0 if size else None)
    if not (_number(a) and _number(b)):
        return None
    if a == 0 and b == 1:  # 0 + 1 * u is u exactly: [0, 1) as the generator's own
        return (0.0, 1.0, False)
    return (float(min(a, b)), float(max(a, b)), True)


def _targets() -> list[tuple[Any, str, Callable]]:
    """(module, function name, its bounds(args, kwargs) -> (lo, hi, closed) or None where the call
    does not draw one uniform number) for the draws `python_draws` answers."""
    out: list = [(random, "random", _no_args), (random, "uniform", lambda a, k: _between(a, k, False))]
    np = sys.modules.get("numpy")
    if np is not None:
        out += [(np.random, "random", _no_size), (np.random, "random_sample", _no_size), (np.random, "rand", _no_args),
                (np.random, "uniform", lambda a, k: _between(a, k, True))]
    return out


_local = threading.local()  # .recorder: the python_draws of the pass this thread traces, or None
_installed: list = []  # (module, name, the original, our function) while some pass traces
_install_lock = threading.Lock()
_install_depth = [0]


def _drawing(module: Any, name: str, original: Callable, bounds: Callable) -> Callable:
    label = f"{'numpy.random' if module is not random else 'random'}.{name}"

    def draw(*args: Any, **kwargs: Any) -> Any:
        recorder = getattr(_local, "recorder", None)
        b = bounds(args, kwargs) if recorder is not None else None
        if b is None:  # another thread, or not one number: drawn (a pass's state check refuses it)
            return original(*args, **kwargs)
        recorder.calls.append((original, args, kwargs))
        caller = sys._getframe(1)
        return PythonDraw(*b, f"{label}() at {caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}")
    draw.__name__ = draw.__qualname__ = name
    draw.__doc__ = original.__doc__
    return draw


class python_draws:
    """While a forward is traced (module docstring, 2): the scalar draws of Python's and NumPy's
    global generators return PythonDraws and are recorded in `calls` ((function, args, kwargs), in
    order), for `replay` at each run of the compiled program. The functions are swapped in their
    modules for the pass; other threads calling them meanwhile get real numbers."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable, tuple, dict]] = []

    def __enter__(self) -> "python_draws":
        with _install_lock:
            if _install_depth[0] == 0:
                for module, name, bounds in _targets():
                    original = getattr(module, name)
                    ours = _drawing(module, name, original, bounds)
                    setattr(module, name, ours)
                    _installed.append((module, name, original, ours))
            _install_depth[0] += 1
        self._outer = getattr(_local, "recorder", None)
        _local.recorder = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.recorder = self._outer
        with _install_lock:
            _install_depth[0] -= 1
            if _install_depth[0] == 0:
                for module, name, original, ours in reversed(_installed):
                    if getattr(module, name) is ours:  # not swapped again by someone else meanwhile
                        setattr(module, name, original)
                _installed.clear()


def replay(calls: list[tuple[Callable, tuple, dict]]) -> None:
    """Makes the draws a trace recorded (python_draws.calls) again, as eager's call makes them."""
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


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
