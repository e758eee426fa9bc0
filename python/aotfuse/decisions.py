"""Decisions a traced forward takes on its inputs' values: answered while tracing, guarded after.

A forward may read a value of its inputs as a Python number and branch on it: Longformer and LED
ask `is_index_global_attn.flatten().any().item()` of the attention mask to choose their global
attention path; XLM and Flaubert `assert lengths.max().item() <= slen` of the input ids. A trace
cannot answer such a question (the value is data: DataDependentOutputException), so these models
were not captured whole (the fallbacks split them, Dynamo putting a guard at a graph break).

While a pass traces, `input_decisions` computes the forward's torch calls over the call's tensors
that do not require grad (ids, masks, labels, frozen buffers) a second time, on their real values:
every call whose tensor arguments all have such a "shadow" (and the deterministic factories:
ones, arange, full, ...) is recorded as a step and run for real beside the trace. A question asked
of a shadowed tensor (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`, `torch.equal`,
`x in t`, ...) is answered from its shadow, and the answer becomes a guard: `check` replays the
steps the answers need on each later call's tensors before the compiled program runs, and a call
whose answer differs takes another program, traced for it (compile.py, `_Entry.alternatives`).

`.item()` of a number gives a `DecidedNumber`: comparing it with a Python number answers and
guards only the comparison's truth (`lengths.max().item() <= slen` holds for every batch that
fits), any other use (arithmetic, a size, `int()`, `range()`) specializes on the exact value.
Tensors that require grad (parameters, activations) get no shadow: a question about them stays a
capture error. Random ops get no
shadow (running them twice would move the generator), nor matmuls, convolutions, attention and
embeddings (a guard's steps should be cheap: masks and ids, not a frozen model's activations); a write into a tensor that shares the
caller's storage, or into a shadowed tensor from values without shadows, ends the shadows for the
pass. The fallbacks remain for the rest.

A shape that depends on a shadowed tensor's values is answered the same way: `nonzero`, `argwhere`,
one-argument `where`, `masked_select`, and indexing or assigning through a boolean mask
(`hidden[lang_mask]`, X-MOD's adapters; `logits[attention_mask != 0]`, the audio LMs' loss) ask how
many elements are nonzero (`nonzero_count`, guarded exactly: a count decision), and the trace takes
`nonzero_static(mask, size=count)` where it had `nonzero(mask)`: a mask in an index becomes the
columns of its positions (ATen's own reading of a mask), after a check that its sizes are those of
the dimensions it indexes. The tensor indexed may require grad (its gradient is the positions'
index_put). A call whose count differs runs another program; past COUNT_TRACES (2) other counts of one decision
a function with a fallback (`fallback="dynamo"` or `"eager"`) runs that for every other count
(compile.py, `_decide`): masks that change at every batch (padding) are Dynamo's graph break.

In a shape family's trace (shapes.py) the traced sizes are symbolic: a step's size arguments
(`view(batch, length)`, `arange(length)`) and a comparison's operand (`<= slen`) are kept as the
symbolic sizes they are, run for real at the values they were traced at, and made numbers for each
later call's sizes by `check` (once per shape: `Decisions.at`), so a family's programs are guarded as
one traced for their shape would be. Sizes that are not the inputs' own (unbacked symbols) make no
shadow. A 0-d shadowed tensor given to a factory as a size, bound or fill value (which ATen would read
as a new unbacked symbol there) goes in as its value, exactly guarded; and an exact answer about a
value worked out from the sizes alone (no input's values: Funnel's relative positions) would make
the family's trace one shape's, so it raises SizeDependentDecision and the family fails at once.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Iterator

import sympy
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import shapes

__all__ = ["input_decisions", "real_inputs", "check", "describe", "DecidedNumber", "Decisions"]

_TB = torch._C.TensorBase
_local = threading.local()
_MAX_NUMEL = 1 << 24  # a shadow larger than this (16M elements) is not kept: the questions are of masks and ids
_RANDOM = ("rand", "bernoulli", "dropout", "multinomial", "normal", "poisson", "exponential", "cauchy",
           "geometric", "uniform", "empty", "rrelu", "gumbel", "seed", "shuffle")
# compute-heavy ops get no shadow: a guard replays its steps at every call, and a question about what
# they make (activations of frozen weights) is one about the model, not about its inputs
_HEAVY = ("linear", "matmul", "mm", "einsum", "conv", "attention", "embedding", "lstm", "gru", "rnn", "tensordot")
_FACTORIES = {torch.ones, torch.zeros, torch.full, torch.arange, torch.tensor, torch.as_tensor, torch.eye,
              torch.linspace, torch.logspace, torch.scalar_tensor, torch.tril_indices, torch.triu_indices}
# factories that read a 0-d tensor argument as a number (a size, a bound, a fill value: ATen's int or
# Scalar; linspace and logspace take tensors as they are)
_SCALAR_READERS = {torch.arange, torch.zeros, torch.ones, torch.full, torch.eye, torch.scalar_tensor,
                   torch.tril_indices, torch.triu_indices}
# functions that read a tensor's values into a Python value (a fake tensor refuses them)
_QUESTIONS = {_TB.item, _TB.tolist, _TB.__bool__, _TB.__int__, _TB.__float__, _TB.__index__, _TB.equal,
              _TB.allclose, _TB.is_nonzero, torch.equal, torch.allclose, torch.is_nonzero, torch.Tensor.__contains__}
# functions whose output's shape is a mask's count of nonzero elements
_NONZERO = {torch.nonzero, _TB.nonzero, torch.argwhere, _TB.argwhere}
_MASKED_SELECT = {torch.masked_select, _TB.masked_select}
_INDEXING = {_TB.__getitem__, _TB.__setitem__}
_COUNTED = _NONZERO | _MASKED_SELECT | _INDEXING | {torch.where, _TB.where}
_MASK_DTYPES = (torch.bool, torch.uint8)
_NOT_ANSWERED = object()
COUNT_TRACES = 2  # programs traced for other counts of one count decision, before the fallback runs the rest
_OPS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
        "ne": operator.ne}
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


@contextlib.contextmanager
def real_inputs(tensors: list) -> Iterator[None]:
    """While a signature's first call traces (compile.py, _first_run): the call's own tensors, which
    the passes' input_decisions compute shadows from."""
    before = getattr(_local, "real", None)
    _local.real = tensors
    try:
        yield
    finally:
        _local.real = before


def current_real() -> list | None:
    return getattr(_local, "real", None)


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    """Real computation inside a trace: no dispatch modes (fake, proxy, functional), no torch
    function modes, no autograd."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        yield


def nonzero_count(t: torch.Tensor) -> int:
    """The question a data-dependent shape asks of a shadowed tensor: how many elements are nonzero."""
    return int(torch.count_nonzero(t))


class SizeDependentDecision(RuntimeError):
    """A family's trace reads the exact value of something worked out from the symbolic sizes
    (Funnel's relative positions: `torch.arange(max_dist, ...)`, max_dist from the length): the
    family fails at once, and each shape is traced on its own."""


class _Slot:
    """A tensor of the recorded steps: the call's input `i` (slot < number of inputs) or a result."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Step:
    __slots__ = ("func", "leaves", "spec", "outs", "question", "decisions", "reads", "target", "flat")

    def __init__(self, func, leaves: list, spec, outs: list, question: bool, target: int | None):
        self.func, self.leaves, self.spec, self.outs = func, leaves, spec, outs
        args, kwargs = tree_unflatten(leaves, spec)
        top = sum(isinstance(x, _Slot) for x in (*args, *kwargs.values()))
        # (args, kwargs) with the slots at the top level, for check() to fill without the pytree walk
        self.flat = (list(args), dict(kwargs)) if top == sum(isinstance(x, _Slot) for x in leaves) else None
        self.question = question  # its result is a Python value the decisions below read
        self.decisions: list[tuple[int, str, Any, Any]] = []  # (index, op, operand, expected)
        self.reads = [x.i for x in leaves if isinstance(x, _Slot)]
        self.target = target  # the slot an in-place step writes, or None


class Decisions:
    """A pass's guards: the steps to replay over a call's tensors, and what each answer must be."""

    def __init__(self, inputs: dict[int, int], steps: list[_Step], count: int, sizes: dict | None = None):
        self.inputs = inputs  # slot -> index among the compiled function's tensors
        self.steps = steps
        self.count = count
        self.counts: frozenset[int] = frozenset()  # the answers that are nonzero counts (shapes)
        # a family's trace: each symbol its steps read -> (tensor index, dimension) it is the size of
        self.sizes = sizes if sizes and any(_step_symbolic(s) for s in steps) else None
        self._at: dict[tuple, list[_Step]] = {}  # the steps made numbers, by the call's sizes

    def at(self, tensors: list) -> list[_Step]:
        """The steps with their symbolic sizes made numbers for these tensors' sizes."""
        if self.sizes is None:
            return self.steps
        key = tuple(tensors[i].shape[d] for i, d in self.sizes.values())
        steps = self._at.get(key)
        if steps is None:
            if len(self._at) >= 64:  # (a bound: the family's members are bounded only by its guards)
                self._at.clear()
            vals = {s: sympy.Integer(n) for s, n in zip(self.sizes, key)}
            steps = self._at[key] = [_concrete_step(s, vals) for s in self.steps]
        return steps

    def __repr__(self) -> str:
        return f"Decisions({self.count} answers over {len(self.steps)} steps)"


def _sizes_in(x: Any) -> tuple:
    """The symbolic sizes an argument is or holds (a slice's bounds: `ids[:, :length - 1]`)."""
    if isinstance(x, _SYM):
        return (x,)
    if isinstance(x, slice):
        return tuple(v for v in (x.start, x.stop, x.step) if isinstance(v, _SYM))
    return ()


def _map_sizes(x: Any, fn) -> Any:
    """x with fn applied to each symbolic size it is or holds."""
    if isinstance(x, _SYM):
        return fn(x)
    if isinstance(x, slice) and _sizes_in(x):
        return slice(*(fn(v) if isinstance(v, _SYM) else v for v in (x.start, x.stop, x.step)))
    return x


def _step_symbolic(step: _Step) -> bool:
    return any(_sizes_in(x) for x in step.leaves) or any(isinstance(d[2], _SYM) for d in step.decisions)


def _concrete_step(step: _Step, vals: dict) -> _Step:
    """step with its symbolic sizes (arguments, comparisons' operands) as numbers at vals."""
    if not _step_symbolic(step):
        return step
    def number(x):
        return shapes.value(x, vals)
    out = _Step(step.func, [_map_sizes(x, number) for x in step.leaves], step.spec, step.outs, step.question,
                step.target)
    out.decisions = [(i, op, shapes.value(operand, vals), expected) for i, op, operand, expected in step.decisions]
    return out


def _operand_key(v: Any) -> Any:
    """A comparison's operand as a dictionary key (a symbolic size by its expression: `==` on it would
    add a guard)."""
    return ("size", str(v.node.expr)) if isinstance(v, _SYM) else v


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, (list, tuple)) else v


class DecidedNumber:
    """`.item()` of a shadowed tensor holding a number: comparisons with Python numbers answer and
    guard their truth; every other use guards the exact value (module docstring)."""

    __slots__ = ("_mode", "_step", "value")

    def __init__(self, mode: "input_decisions", step: _Step, value: int | float):
        self._mode, self._step, self.value = mode, step, value

    def exact(self) -> int | float:
        self._mode.decide(self._step, "eq", None, self.value)
        return self.value

    def _cmp(self, op: str, other: Any) -> Any:
        if isinstance(other, DecidedNumber):
            other = other.exact()
        if isinstance(other, torch.SymInt) and self._mode.bound(other):  # `<= slen` in a family's trace
            truth = _OPS[op](self.value, shapes.hint(other))
            self._mode.decide(self._step, op, other, truth)
            return truth
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return _OPS[op](self.exact(), other)
        truth = _OPS[op](self.value, other)
        self._mode.decide(self._step, op, other, truth)
        return truth

    def __lt__(self, o): return self._cmp("lt", o)  # noqa: E704
    def __le__(self, o): return self._cmp("le", o)  # noqa: E704
    def __gt__(self, o): return self._cmp("gt", o)  # noqa: E704
    def __ge__(self, o): return self._cmp("ge", o)  # noqa: E704
    def __eq__(self, o): return self._cmp("eq", o)  # noqa: E704
    def __ne__(self, o): return self._cmp("ne", o)  # noqa: E704
    def __bool__(self): return self._cmp("ne", 0)  # noqa: E704
    def __hash__(self): return hash(self.exact())  # noqa: E704
    def __int__(self): return int(self.exact())  # noqa: E704
    def __float__(self): return float(self.exact())  # noqa: E704
    def __index__(self): return operator.index(self.exact())  # noqa: E704
    def __repr__(self): return repr(self.exact())  # noqa: E704
    def __str__(self): return str(self.exact())  # noqa: E704
    def __format__(self, spec): return format(self.exact(), spec)  # noqa: E704
    def __neg__(self): return -self.exact()  # noqa: E704
    def __pos__(self): return +self.exact()  # noqa: E704
    def __abs__(self): return abs(self.exact())  # noqa: E704
    def __round__(self, n=None): return round(self.exact(), n)  # noqa: E704


def _binary(name: str, reflected: bool = False):
    op = getattr(operator, name)

    def method(self: DecidedNumber, other: Any) -> Any:
        if isinstance(other, DecidedNumber):
            other = other.exact()
        return op(other, self.exact()) if reflected else op(self.exact(), other)
    return method


for _n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift", "rshift"):
    _dunder = _n.rstrip("_")
    setattr(DecidedNumber, f"__{_dunder}__", _binary(_n))
    setattr(DecidedNumber, f"__r{_dunder}__", _binary(_n, reflected=True))


class input_decisions(TorchFunctionMode):
    """One tracing pass's shadows, steps and answers (module docstring). `finish()` gives the
    pass's Decisions (None when it answered nothing)."""

    def __init__(self, traced: list | tuple, real: list | None):
        super().__init__()
        # (a family's symbolic sizes compared by the values they were traced at: `==` would pin them)
        self.active = (real is not None and len(real) == len(traced)
                       and all(isinstance(r, torch.Tensor) and _traced_shape(t.shape) == tuple(r.shape)
                               for t, r in zip(traced, real)))
        self.sizes: dict = {}  # symbol -> (input, dimension) whose size it is (a family's trace)
        self.shadow: dict[int, int] = {}  # id(traced tensor) -> slot
        self.keep: list = []  # the traced tensors the ids above name (so that no id is reused meanwhile)
        self.values: list[torch.Tensor] = []  # slot -> its real tensor, this pass only
        self.storages: list[int] = []  # slot -> its storage's address
        self.steps: list[_Step] = []
        self.inputs: dict[int, int] = {}
        self.count = 0
        self.counts: set[int] = set()  # the decisions that are nonzero counts
        # steps already recorded, by (func, arguments): the same call again (each layer asking the
        # same questions of the same mask: Longformer's 12 layers) reuses their slots and answers
        # while the tensors they read are unchanged (their version counters); a write into a slot two
        # traced tensors share gives the written one a copy first (shared: slot -> how many share it),
        # and any other write into a storage they share ends the pass
        self.memo: dict[tuple, tuple] = {}
        # ids of views of shadowed tensors that have no shadow (`h.view_as(x)`, x an activation): a write
        # through one is a write into the shadowed base, and ends the pass's shadows
        self.escaped: set[int] = set()
        self.shared: dict[int, int] = {}
        self.shared_storages: set[int] = set()
        self.last_question: _Step | None = None
        self.input_storages: set[int] = set()
        # a family's trace: the slots worked out from symbolic sizes alone (no input's values: Funnel's
        # positions, `arange(length)`), and those that read an input's values
        self.sized: set[int] = set()
        self.data: set[int] = set()
        if not self.active:
            return
        for i, (t, r) in enumerate(zip(traced, real)):
            for d, n in enumerate(t.shape):
                if isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol):
                    self.sizes.setdefault(n.node.expr, (i, d))
            if r.layout is not torch.strided or r.is_nested:
                continue
            self.input_storages.add(_storage(r))
            if not r.requires_grad and r.numel() <= _MAX_NUMEL:
                slot = self._new_slot(t, r)
                self.inputs[slot] = i
                self.data.add(slot)

    def _new_slot(self, traced: torch.Tensor, real: torch.Tensor) -> int:
        slot = len(self.values)
        self.values.append(real)
        self.storages.append(_storage(real))
        self.shadow[id(traced)] = slot
        self.keep.append(traced)
        return slot

    def __enter__(self) -> "input_decisions":
        # FunctionalTensor.tolist is Python that reads its inner tensor's items, past every torch
        # function mode: while this pass runs, a shadowed tensor's `.tolist()` is asked here
        # (`torch.split(x, sizes.tolist())`, TAPAS's segment sizes)
        self._tolist = None
        if self.active:
            from torch._subclasses.functional_tensor import FunctionalTensor

            own = FunctionalTensor.__dict__.get("tolist")
            if own is not None:
                mode = self

                def tolist(t: torch.Tensor) -> Any:
                    if mode.active and id(t) in mode.shadow:
                        answered = mode._answer(_TB.tolist, [t], tree_flatten(((t,), {}))[1])
                        if answered is not None:
                            return answered[0]
                    return own(t)

                self._tolist = (FunctionalTensor, own)
                FunctionalTensor.tolist = tolist
        try:
            return super().__enter__()
        except BaseException:
            self._restore_tolist()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore_tolist()

    def _restore_tolist(self) -> None:
        if getattr(self, "_tolist", None) is not None:
            cls, own = self._tolist
            cls.tolist = own
            self._tolist = None

    def bound(self, x: Any) -> bool:
        """Whether a symbolic size is worked out from the inputs' sizes alone (check can make it a
        number at each call)."""
        try:
            return x.node.expr.free_symbols <= self.sizes.keys()
        except AttributeError:
            return False

    def decide(self, step: _Step, op: str, operand: Any, expected: Any) -> None:
        if self.sizes and op == "eq" and operand is None and not isinstance(expected, bool) and \
                any(r in self.sized for r in step.reads) and not any(r in self.data for r in step.reads):
            # a family's trace would be one shape's: a later size would answer otherwise and be traced
            # on its own anyway, after a symbolic trace that costs several static ones
            raise SizeDependentDecision(
                f"{_name(step.func)}() of a value worked out from the inputs' sizes ({expected!r}) decides the "
                f"trace: each shape is traced on its own")
        key = (op, _operand_key(operand), _hashable(expected))
        if not any((x[1], _operand_key(x[2]), x[3]) == key for x in step.decisions):
            step.decisions.append((self.count, op, operand, key[2]))
            self.count += 1

    def finish(self) -> Decisions | None:
        if not self.count:
            return None
        out = Decisions(self.inputs, _needed(self.steps, self.storages), self.count, self.sizes)
        out.counts = frozenset(self.counts)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        if func in _COUNTED:
            out = self._counted(func, args, kwargs)
            if out is not _NOT_ANSWERED:
                return out
        return self._call(func, args, kwargs)

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        shadow = self.shadow
        top = (*args, *kwargs.values())
        if any(isinstance(a, torch.Tensor) and id(a) not in shadow for a in top) and \
                not any(type(a) is DecidedNumber for a in top):
            # (the common case, an activation: no pytree walk) a call with a tensor without shadow
            try:
                out = func(*args, **kwargs)
            except Exception as e:
                # a shadowed 0-d tensor where a number goes, beside an activation (Longformer's
                # `key_vectors.new_zeros(batch, max_num_global_attn_indices, ...)`): its value
                if "DataDependent" not in type(e).__name__:
                    raise
                leaves, spec = tree_flatten((args, kwargs))
                numbers = self._as_numbers(leaves, func in _INDEXING)
                if numbers is None:
                    raise
                args, kwargs = tree_unflatten(numbers, spec)
                out = func(*args, **kwargs)
            if (args and isinstance(args[0], torch.Tensor) and (id(args[0]) in shadow or id(args[0]) in self.escaped)
                    or "out" in kwargs) and \
                    any(id(t) in shadow or id(t) in self.escaped for t in _written(func, args, kwargs)):
                self.active = False  # a shadowed tensor written from values without shadows: its shadow is stale
            else:
                self._escape(out, [a for a in top if isinstance(a, torch.Tensor) and
                                   (id(a) in shadow or id(a) in self.escaped)])
            return out
        leaves, spec = tree_flatten((args, kwargs))
        if any(isinstance(x, DecidedNumber) for x in leaves):  # a decided number used as an argument
            leaves = [x.exact() if isinstance(x, DecidedNumber) else x for x in leaves]
            args, kwargs = tree_unflatten(leaves, spec)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        shadowed = bool(tensors) and all(id(t) in self.shadow for t in tensors)
        if shadowed and func in _QUESTIONS:
            answered = self._answer(func, leaves, spec)
            if answered is not None:
                return answered[0]
        if shadowed and self.sizes and func in _SCALAR_READERS and "out" not in kwargs:
            # a family's trace: a fake mode with symbolic sizes reads such a 0-d tensor as an unbacked
            # symbol instead of raising (a size no later shape can give), so its value goes in first
            numbers = self._as_numbers(leaves)
            if numbers is not None:
                leaves = numbers
                args, kwargs = tree_unflatten(leaves, spec)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if not shadowed or "DataDependent" not in type(e).__name__:
                raise
            # a 0-d tensor where a number goes (Funnel's `torch.arange(max_dist, min_dist - 1, ...)`):
            # its value, guarded exactly
            leaves = self._as_numbers(leaves, func in _INDEXING)
            if leaves is None:
                raise
            args, kwargs = tree_unflatten(leaves, spec)
            out = func(*args, **kwargs)
        if shadowed or (not tensors and func in _FACTORIES):
            self._shadow(func, leaves, spec, out)
        elif tensors and any(id(t) in self.shadow or id(t) in self.escaped for t in _written(func, args, kwargs)):
            self.active = False  # a shadowed tensor written from values without shadows: its shadow is stale
        return out

    def _escape(self, out: Any, bases: list) -> None:
        """Remember the results of `out` without a shadow that alias a shadowed (or escaped) tensor of `bases`."""
        if not bases:
            return
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and id(o) not in self.shadow and \
                    any(torch._C._is_alias_of(o, b) for b in bases):
                self.escaped.add(id(o))
                self.keep.append(o)

    def _is_mask(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.dtype in _MASK_DTYPES and x.dim() > 0 and id(x) in self.shadow

    def _counted(self, func, args: tuple, kwargs: dict) -> Any:
        """A data-dependent shape of a shadowed tensor (module docstring): the call with the mask's
        positions as `nonzero_static` of its guarded count; _NOT_ANSWERED where it is not such a call
        or cannot be answered (the trace then raises as before)."""
        if func in _INDEXING:
            if len(args) < 2 or kwargs or not any(self._is_mask(i) for i in (
                    args[1] if isinstance(args[1], tuple) else (args[1],))):
                return _NOT_ANSWERED
            # an assignment of values that require grad: its backward reads them at the mask's positions
            # (`hidden[mask] = adapted`); others may need no positions at all (`x[mask] = 0.0` is a
            # masked_fill) and are tried as they are first: no shape to answer, nothing to guard
            if not (len(args) == 3 and isinstance(args[2], torch.Tensor) and args[2].requires_grad):
                try:
                    return self._call(func, args, kwargs)
                except Exception as e:
                    if "DynamicOutputShape" not in type(e).__name__ and "DataDependent" not in type(e).__name__:
                        raise
            index = self._mask_index(args[0], args[1])
            if index is None:
                return _NOT_ANSWERED
            return self._call(func, (args[0], index, *args[2:]), {})
        if func in _MASKED_SELECT:
            x = args[0] if args else kwargs.get("input")
            mask = args[1] if len(args) > 1 else kwargs.get("mask")
            if len(args) > 2 or set(kwargs) - {"input", "mask"} or not isinstance(x, torch.Tensor) or \
                    not self._is_mask(mask) or mask.dtype != torch.bool:
                return _NOT_ANSWERED
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            mask = self._traced(_TB.expand, mask, shape)
            if id(mask) not in self.shadow:
                return _NOT_ANSWERED
            return self._counted(_TB.__getitem__, (self._traced(_TB.expand, x, shape), mask), {})
        if func in (torch.where, _TB.where):  # where(condition): nonzero(condition, as_tuple=True)
            if len(args) != 1 or kwargs:
                return _NOT_ANSWERED
            as_tuple = True
        else:
            if len(args) != 1 or set(kwargs) - {"as_tuple"}:
                return _NOT_ANSWERED
            as_tuple = bool(kwargs.get("as_tuple", False))
        positions = self._positions(args[0])
        if positions is None:
            return _NOT_ANSWERED
        return tuple(self._traced(_TB.unbind, positions, 1)) if as_tuple else positions

    def _positions(self, mask: Any) -> torch.Tensor | None:
        """`nonzero(mask)` in the trace as `nonzero_static(mask, size=count)`, the count answered and
        guarded exactly; None where the mask has no shadow or the count cannot be answered."""
        if not isinstance(mask, torch.Tensor) or mask.dim() == 0 or id(mask) not in self.shadow or mask.is_complex():
            return None
        answered = self._answer(nonzero_count, [mask], tree_flatten(((mask,), {}))[1])
        if answered is None:
            return None
        self.counts.update(d[0] for d in self.last_question.decisions)
        return self._traced(torch.nonzero_static, mask, size=answered[0])

    def _traced(self, func, *args: Any, **kwargs: Any) -> Any:
        """func(*args, **kwargs) in the trace (this mode is off within its own handler), shadowed
        where its tensors are."""
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        if self.active and all(id(t) in self.shadow for t in leaves if isinstance(t, torch.Tensor)):
            self._shadow(func, leaves, spec, out)
        return out

    def _mask_index(self, x: Any, index: Any) -> tuple | None:
        """index with each shadowed boolean mask replaced by the columns of its positions (a k-d mask
        by k index tensors, as ATen reads it), or None where it holds no such mask, holds an item of
        a kind not read here, or a mask's sizes are not those of the dimensions it indexes (eager
        raises there; the trace then does too)."""
        items = index if isinstance(index, tuple) else (index,)
        if not isinstance(x, torch.Tensor):
            return None
        used = 0  # the dimensions of x the items index
        for it in items:
            if isinstance(it, torch.Tensor):
                used += it.dim() if it.dtype in _MASK_DTYPES else 1
            elif isinstance(it, (int, slice, torch.SymInt)) and not isinstance(it, bool):
                used += 1
            elif it is not None and it is not Ellipsis:
                return None  # lists, Python bools, arrays: ATen's own reading
        if used > x.dim() or sum(it is Ellipsis for it in items) > 1:
            return None
        out, dim = [], 0
        for it in items:
            if it is Ellipsis:
                dim += x.dim() - used
            elif self._is_mask(it):
                sizes = x.shape[dim:dim + it.dim()]
                if len(sizes) != it.dim() or not all(a == b for a, b in zip(it.shape, sizes)):
                    return None
                positions = self._positions(it)
                if positions is None:
                    return None
                out.extend(self._traced(_TB.unbind, positions, 1))
                dim += it.dim()
                continue
            elif isinstance(it, torch.Tensor):
                dim += it.dim() if it.dtype in _MASK_DTYPES else 1
            elif it is not None:
                dim += 1
            out.append(it)
        return tuple(out)

    def _real(self, leaves: list, spec) -> tuple:
        real = [self.values[self.shadow[id(x)]] if isinstance(x, torch.Tensor) else
                _map_sizes(x, shapes.traced_value) for x in leaves]
        return tree_unflatten(real, spec)

    def _unbound(self, leaves: list) -> bool:
        """Whether an argument is or holds a symbolic size check could not make a number."""
        return any(not self.bound(v) for x in leaves for v in _sizes_in(x))

    def _template(self, leaves: list) -> list:
        return [_Slot(self.shadow[id(x)]) if isinstance(x, torch.Tensor) else x for x in leaves]

    def _memo_key(self, func, template: list, spec, question: bool) -> tuple | None:
        try:
            key = (func, question, spec, tuple(("slot", x.i) if isinstance(x, _Slot) else
                                               (float, x.hex()) if type(x) is float else (type(x), x)
                                               for x in template))
            hash(key)
            return key
        except Exception:  # noqa: BLE001 - unhashable arguments (SymInts, slices): recorded anew
            return None

    def _answer(self, func, leaves: list, spec) -> tuple | None:
        """(the answer,) of a question about shadowed tensors, or None (the trace asks it: an error)."""
        if self._unbound(leaves) or any(isinstance(x, torch.Tensor) and id(x) not in self.shadow for x in leaves):
            return None
        template = self._template(leaves)
        key = self._memo_key(func, template, spec, True)
        seen = self.memo.get(key) if key is not None else None
        if seen is not None and seen[2] == self._versions(template):
            step, value = seen[0], seen[1]
        else:
            try:
                with _plain():
                    a, k = self._real(leaves, spec)
                    value = func(*a, **k)
            except Exception:  # noqa: BLE001 - the traced call raises what it raises
                return None
            step = _Step(func, template, spec, [], True, None)
            self.steps.append(step)
            if key is not None:
                self.memo[key] = (step, value, self._versions(template))
        self.last_question = step
        if func is _TB.item and not isinstance(value, bool):
            return (DecidedNumber(self, step, value),)
        self.decide(step, "eq", None, value)
        return (value,)

    def _versions(self, template: list) -> tuple:
        return tuple(_version(self.values[x.i]) for x in template if isinstance(x, _Slot))

    def _copy_on_write(self, written: torch.Tensor, target: int) -> int | None:
        """A write into `written`, whose slot other traced tensors share through the memo: `written`
        gets a copy of its own (a recorded clone step) and the write goes there; views of that
        storage lose their shadows (which tensor they view is not known). None where `written` is a
        view of a shared storage, not one of the sharers."""
        if self.shared.get(target, 0) < 1:
            return None
        storage = self.storages[target]
        for tid, slot in list(self.shadow.items()):
            if slot != target and self.storages[slot] == storage:
                del self.shadow[tid]
        with _plain():
            real = self.values[target].clone()
        self.shared[target] -= 1
        if not self.shared[target]:  # the last sharer: the slot is its own again
            del self.shared[target]
            if not any(self.storages[s] == storage for s in self.shared):
                self.shared_storages.discard(storage)
        slot = self._new_slot(written, real)
        self.steps.append(_Step(torch.clone, [_Slot(target)], tree_flatten(((written,), {}))[1], [slot], False, None))
        if self.sizes and target in self.data:  # (the copy depends on what its original depends on)
            self.data.add(slot)
        elif self.sizes and target in self.sized:
            self.sized.add(slot)
        return slot

    def _as_numbers(self, leaves: list, index: bool = False) -> list | None:
        """leaves with each shadowed 0-d tensor replaced by its value (an exact decision), or None
        where there is none or one cannot be answered. Only where the traced call needs a value:
        ATen converts such a tensor to that Scalar itself. In an index (`index`), a 0-d integer
        tensor is read as that integer, but a 0-d bool or uint8 one is a mask (it adds a dimension):
        None."""
        out, swapped = [], False
        for x in leaves:
            if index and isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype in _MASK_DTYPES:
                return None
            if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_complex():
                answered = self._answer(_TB.item, [x], tree_flatten(((x,), {}))[1])
                if answered is None:
                    return None
                x, swapped = answered[0].exact() if isinstance(answered[0], DecidedNumber) else answered[0], True
            out.append(x)
        return out if swapped else None

    def _shadow(self, func, leaves: list, spec, out: Any) -> None:
        name = _name(func).lower()
        written = _written(func, *tree_unflatten(leaves, spec))
        if any(r in name for r in _RANDOM + _HEAVY) or self._unbound(leaves):
            if written:
                self.active = False  # a shadowed tensor written with values no shadow has
            return
        outs = tree_flatten(out)[0]
        if not written and not any(isinstance(o, torch.Tensor) for o in outs):
            return  # metadata (sizes, dtypes): the signature fixes it
        target = self.shadow.get(id(written[0])) if written else None
        if written and target is not None and self.storages[target] in self.shared_storages:
            target = self._copy_on_write(written[0], target)
        if written and (target is None or self.storages[target] in self.input_storages):
            self.active = False  # a replay would write the caller's tensor, or one another traced tensor shares
            return
        template = self._template(leaves)
        versions = self._versions(template)
        if written:
            self.memo.clear()
        elif template and any(isinstance(x, _Slot) for x in template):  # (factories: each call a tensor of its own)
            key = self._memo_key(func, template, spec, False)
            seen = self.memo.get(key) if key is not None else None
            if seen is not None and len(seen[0]) == len(outs) and seen[1] == versions:
                read = {self.storages[x.i] for x in template if isinstance(x, _Slot)}
                for o, slot in zip(outs, seen[0]):  # the same call again: its results' slots
                    if isinstance(o, torch.Tensor) and slot is not None:
                        self.shadow[id(o)] = slot
                        self.keep.append(o)
                        if self.storages[slot] not in read:  # (a view of what it reads shares it in the trace too)
                            self.shared_storages.add(self.storages[slot])
                            self.shared[slot] = self.shared.get(slot, 0) + 1
                    elif isinstance(o, torch.Tensor):
                        self.shadow.pop(id(o), None)
                        self._escape(o, [x for x in leaves if isinstance(x, torch.Tensor)])
                return
        try:
            with _plain():
                a, k = self._real(leaves, spec)
                real = func(*a, **k)
        except Exception:  # noqa: BLE001 - no shadow for its results
            if written:
                self.active = False  # a failed write: the shadow's state is unknown
            return
        if not written and self._versions(template) != versions:
            # an in-place op its name does not tell: the memo's answers about what it wrote are stale,
            # a storage the memo shares cannot be copied now, and the step is kept as the write it is
            self.memo.clear()
            changed = [x.i for x, v in zip((x for x in template if isinstance(x, _Slot)), versions)
                       if _version(self.values[x.i]) != v]
            if any(self.storages[i] in self.shared_storages or self.storages[i] in self.input_storages for i in changed):
                self.active = False
                return
            target = changed[0]
        reals = tree_flatten(real)[0]
        if len(reals) != len(outs) or any(isinstance(o, torch.Tensor) != isinstance(r, torch.Tensor)
                                          for o, r in zip(outs, reals)):
            return
        slots = []  # (template: made before the outputs' slots, as an in-place op returns its argument)
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and r.numel() <= _MAX_NUMEL and _traced_shape(o.shape) == tuple(r.shape):
                slots.append(self._new_slot(o, r))
            else:
                slots.append(None)
                if isinstance(o, torch.Tensor):
                    self.shadow.pop(id(o), None)
                    self._escape(o, [x for x in leaves if isinstance(x, torch.Tensor)])
        step = _Step(func, template, spec, slots, False, target)
        if target is None and any(isinstance(x, _Slot) for x in template):  # (a write is never the same call again)
            key = self._memo_key(func, template, spec, False)
            if key is not None:
                self.memo[key] = (tuple(slots), self._versions(template))
        if self.sizes:
            made = [s for s in slots if s is not None] + ([target] if target is not None else [])
            if any(r in self.data for r in step.reads):
                self.data.update(made)  # (mixed with sizes: `arange(length) < lengths[:, None]`, its sum
                self.sized.difference_update(made)  # can be one number at every length past the longest)
            elif _step_symbolic(step) or any(r in self.sized for r in step.reads):
                self.sized.update(made)
        self.steps.append(step)


def _traced_shape(shape: Any) -> tuple | None:
    """A (maybe symbolic) shape as the numbers it was traced at; None where a size has no such value."""
    try:
        return tuple(shapes.hint(n) for n in shape)
    except (TypeError, KeyError, ValueError):
        return None


def _version(t: torch.Tensor) -> Any:
    """t's version counter (bumped by every in-place op on its storage); an object equal to nothing
    where it has none (inference tensors)."""
    try:
        return t._version
    except Exception:  # noqa: BLE001
        return object()


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors a call writes in place: its first argument for `x.op_(...)` and `x[i] = v`, and
    its `out=`."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    name = _name(func)
    inplace = name == "__setitem__" or (name.startswith("__i") and name.endswith("__")) or (
        name.endswith("_") and not name.endswith("__")) or kwargs.get("inplace") is True  # F.relu(x, inplace=True)
    return [args[0]] if inplace and args and isinstance(args[0], torch.Tensor) else []


def _needed(steps: list[_Step], storages: list[int]) -> list[_Step]:
    """The steps the answers need, in order: those making a tensor a later kept step reads, and the
    in-place ones writing a storage such a tensor lives in."""
    needed: set[int] = set()
    kept = []
    for step in reversed(steps):
        if step.question:
            keep = bool(step.decisions)
        else:
            live = {storages[s] for s in needed}
            keep = any(s is not None and s in needed for s in step.outs) or (
                step.target is not None and storages[step.target] in live)
        if keep:
            kept.append(step)
            needed.update(step.reads)
    kept.reverse()
    return kept


def check(decisions: Decisions, tensors: list) -> tuple | None:
    """None where this call's tensors give every recorded answer; else (index, the answer they give)
    of the first that differs ("error", message) where a step raises: the key of another program."""
    values = {slot: tensors[i] for slot, i in decisions.inputs.items()}
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for step in decisions.at(tensors):
                if step.flat is not None:
                    a = [values[x.i] if type(x) is _Slot else x for x in step.flat[0]]
                    k = {n: values[x.i] if type(x) is _Slot else x for n, x in step.flat[1].items()}
                else:
                    a, k = tree_unflatten([values[x.i] if isinstance(x, _Slot) else x for x in step.leaves], step.spec)
                out = step.func(*a, **k)
                if step.question:
                    for index, op, operand, expected in step.decisions:
                        got = _hashable(out) if op == "eq" and operand is None else _OPS[op](out, operand)
                        if got != expected:
                            return (index, got)
                    continue
                if len(step.outs) == 1 and isinstance(out, torch.Tensor):
                    if step.outs[0] is not None:
                        values[step.outs[0]] = out
                    continue
                for o, slot in zip(tree_flatten(out)[0], step.outs):
                    if slot is not None:
                        values[slot] = o
    except Exception as e:  # noqa: BLE001 - a program traced for this call will say what fails
        return ("error", f"{type(e).__name__}: {e}")
    return None


def is_count(decisions: Decisions, outcome: tuple) -> bool:
    """Whether check's outcome is a nonzero count (a data-dependent shape) that differs."""
    return outcome[0] in decisions.counts


def describe(decisions: Decisions, outcome: tuple) -> str:
    """One line for AOTFUSE_LOG=cache: which answer differed and how."""
    if outcome[0] == "error":
        return f"replaying the steps failed ({outcome[1]})"
    if outcome[0] == "count":
        return f"a nonzero count (a data-dependent shape) differs from the {COUNT_TRACES} traced"
    for step in decisions.steps:
        for index, op, operand, expected in step.decisions:
            if index == outcome[0]:
                what = f"{_name(step.func)}()" + ("" if operand is None else f" {op} {operand!r}")
                return f"{what} was {expected!r}, is {outcome[1]!r}"
    return repr(outcome)
