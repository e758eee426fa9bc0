"""Shape families: one trace with symbolic sizes, a C program per concrete shape.

The C core compiles shapes, not formulas for them: every program has its sizes as numbers. What a
new shape used to cost was mostly tracing (the model's Python, autograd, decompositions and
functionalization run once per signature), then partitioning and lowering. A family saves the
tracing and the partitioning:

- A call whose inputs differ from an earlier signature's only in some tensor sizes (batches padded
  to their longest example bring a new sequence length each) traces the function once more, with
  those sizes symbolic (torch's ShapeEnv, through AOTAutograd as Dynamo uses it), and partitions
  the joint graph once, deciding at the sizes of that call (`concrete`, then the C partitioner).
- Every later call of the family whose sizes pass the trace's guards (a length within the position
  table, say) gets its programs from the symbolic forward and backward graphs: `PerShape` makes
  the graph concrete for its sizes (every symbol a number, metadata propagated by FakeTensorProp,
  symbolic inputs and outputs dropped) and lowers it; kernel templates serve the kernels from the
  bodies earlier shapes compiled.

`aot_function(dynamic=...)` and AOTFUSE_DYNAMIC choose: `auto` (default) makes a family at a
signature's second shape, from the dimensions that differ; `1` (dynamic=True) at the first call,
with every dimension of the non-parameter inputs symbolic; `0` (dynamic=False) never. Where the
symbolic trace fails or pins every symbolic size to its value (a model that branches on a length),
the signature is compiled as before, on its own.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from . import config

__all__ = ["Family", "PerShape", "binders", "concrete", "is_symbolic", "saved_at", "symbolic_values", "traced_value",
           "value"]

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
# nodes that only check symbolic facts: dropped once the facts are numbers (and hold)
_ASSERTS = tuple(getattr(torch.ops.aten, n).default for n in ("_assert_scalar", "sym_constrain_range",
                                                               "sym_constrain_range_for_size")
                 if hasattr(torch.ops.aten, n))


def value(x: Any, vals: dict) -> Any:
    """x (a number or a symbolic size: SymInt, SymFloat or SymBool) as a number, its symbols set to
    vals (sympy numbers)."""
    if not isinstance(x, _SYM):
        return x
    e = sympy.sympify(x.node.expr.xreplace(vals))
    if isinstance(x, torch.SymBool):
        return bool(e)
    if isinstance(x, torch.SymFloat):
        return float(e)
    if not e.is_number:
        raise RuntimeError(f"aotfuse: the size {x.node.expr} has symbols without a value ({e.free_symbols})")
    return int(e)


def traced_value(x: Any) -> Any:
    """A symbolic size, SymInt, SymFloat or SymBool, as the number it was traced at (no guard added)."""
    return value(x, _hints(x.node.shape_env)) if isinstance(x, _SYM) else x


def _numbers(val: Any) -> tuple:
    """The sizes a value's metadata holds: a number's itself, a tensor's sizes, strides and offset."""
    if isinstance(val, _SYM):
        return (val,)
    if isinstance(val, torch.Tensor):
        return (*val.shape, *val.stride(), val.storage_offset())
    return ()


def _free(val: Any) -> set:
    return {s for x in _numbers(val) if isinstance(x, _SYM) for s in x.node.expr.free_symbols}


def _hints(env: Any) -> dict:
    """A ShapeEnv's symbols to the values they were traced at (torch 2.13 renamed the map)."""
    hints = getattr(env, "backed_var_to_val", None)
    return env.var_to_val if hints is None else hints


def _has_sym(val: Any) -> bool:
    return any(isinstance(x, _SYM) for x in _numbers(val))


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether a graph's inputs have symbolic sizes or are symbolic numbers (also where the trace
    pinned the symbols to numbers: their values are still SymInts)."""
    return any(_has_sym(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder"))


def symbolic_values(gm: fx.GraphModule) -> dict:
    """The sizes a symbolic graph was traced at: each symbol of its inputs to its hint."""
    vals: dict = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        for x in _numbers(n.meta.get("val")):
            if isinstance(x, torch.SymInt):
                hints = _hints(x.node.shape_env)
                for s in x.node.expr.free_symbols:
                    vals.setdefault(s, hints[s])
    return vals


class _Sizes:
    """Symbolic sizes to numbers for one set of symbol values, each expression worked out once."""

    def __init__(self, vals: dict):
        self.vals = {k: sympy.Integer(v) for k, v in vals.items()}
        self.done: dict = {}

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, _SYM):
            return x
        e = x.node.expr
        v = self.done.get(e)
        if v is None:
            v = self.done[e] = value(x, self.vals)
        return v


def saved_at(fw: fx.GraphModule, num_fwd_outputs: int, vals: dict) -> list[tuple[str, tuple, str, int]]:
    """(name, shape, dtype, bytes) of each tensor a family's symbolic forward saves for its backward,
    at these symbol values."""
    size = _Sizes(vals)
    (outs,) = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args
    saved = []
    for node in list(outs)[num_fwd_outputs:]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            shape = tuple(size(d) for d in val.shape)
            saved.append((node.name, shape, str(val.dtype).replace("torch.", ""),
                          math.prod(shape) * val.element_size()))
    return saved


def _fake(val: torch.Tensor, size: _Sizes, mode: Any) -> torch.Tensor:
    """A fake tensor of val's dtype and device with its sizes, strides and offset as numbers (made
    from a meta tensor: no dispatch through the fake mode)."""
    shape = [size(s) for s in val.shape]
    stride = [size(s) for s in val.stride()]
    offset = size(val.storage_offset())
    if offset:
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        meta = torch.empty(offset + extent, dtype=val.dtype, device="meta").as_strided(shape, stride, offset)
    else:
        meta = torch.empty_strided(shape, stride, dtype=val.dtype, device="meta")
    if val.requires_grad and (val.is_floating_point() or val.is_complex()):
        meta.requires_grad_(True)
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, val.device)


def _concrete_val(val: Any, size: _Sizes, mode: Any) -> Any:
    if isinstance(val, torch.Tensor):  # static ones too: every value of the graph in one fake mode
        return _fake(val, size, mode)
    if isinstance(val, _SYM):
        return size(val)
    if isinstance(val, (list, tuple)):
        return type(val)(_concrete_val(v, size, mode) for v in val)
    return val


def concrete(gm: fx.GraphModule, vals: dict) -> fx.GraphModule:
    """A copy of the symbolic graph gm with its symbols set to vals: every node keeps its name and
    its metadata with the sizes as numbers, and the nodes computing sizes (and the inputs that are
    sizes) are gone, their users reading the numbers. Views made this way share no storage with
    their bases (nothing lowering reads looks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    new = config.graph_module(gm, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    size = _Sizes(vals)
    symbolic = []
    # (the partitioner calls this inside the trace's fake mode: the meta tensors are made without it,
    # which made each one a fake dispatch, 90% of this function's time)
    with unset_fake_temporarily():
        for node in graph.nodes:
            if node.op == "output" or "val" not in node.meta:
                continue
            val = node.meta["val"]
            if isinstance(val, _SYM):
                symbolic.append((node, size(val)))
            node.meta["val"] = _concrete_val(val, size, mode)

    def number(node: fx.Node, value: Any) -> Callable:
        return lambda a: value if a is node else a

    for node, value in symbolic:
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, number(node, value))
            user.kwargs = fx.node.map_arg(user.kwargs, number(node, value))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.all_input_nodes:
            if node.target is _ASSERTS[0] and node.args and node.args[0] is not True:
                raise RuntimeError(f"aotfuse: {node.args[1:] or node.name} fails at these sizes")
            graph.erase_node(node)
    for node, _ in reversed(symbolic):
        graph.erase_node(node)
    _drop_whole_slices(graph)
    new.recompile()
    return new


def _drop_whole_slices(graph: fx.Graph) -> None:
    """Slices a symbolic trace keeps because it could not tell they take everything (`slice(x, d, 0,
    INT_MAX)`, and the backward's `slice_backward` of the same): with numbers for sizes, those that
    do take a whole dimension read their input (as a trace with these sizes has them: no op, or an
    alias). Graph outputs are left as they are (their aliasing is AOTAutograd's)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = set(output.all_input_nodes)
    for node in list(graph.nodes):
        if node.op != "call_function" or node in outs or not node.args:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
            continue
        val, before = node.meta.get("val"), src.meta["val"]
        if not isinstance(val, torch.Tensor) or val.shape != before.shape or val.dtype != before.dtype:
            continue
        if node.target is torch.ops.aten.slice.Tensor:
            args = list(node.args) + [None] * (5 - len(node.args))
            dim, start, end, step = (args[1] or 0), args[2], args[3], (args[4] or 1)
            if start not in (None, 0) or step != 1 or (end is not None and end < before.shape[dim]):
                continue
            if val.stride() != before.stride() or val.storage_offset() != before.storage_offset():
                continue
        elif node.target is torch.ops.aten.slice_backward.default:
            if list(node.args[1]) != list(before.shape) or val.stride() != before.stride():
                continue
        else:
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)


def binders(gm: fx.GraphModule) -> tuple[list[tuple[int, int | None, Any]], set]:
    """Where a symbolic graph's inputs give each symbol's value: (input, dim or None for a number
    input, symbol) per place, and the symbols its inputs use. Raises where some symbol has no place
    (only products of it appear): no program could be made from such a graph."""
    found: list[tuple[int, int | None, Any]] = []
    free: set = set()
    for i, n in enumerate(gm.graph.find_nodes(op="placeholder")):
        v = n.meta.get("val")
        free |= _free(v)
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            found.append((i, None, v.node.expr))
        elif isinstance(v, torch.Tensor):
            found += [(i, d, s.node.expr) for d, s in enumerate(v.shape)
                      if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)]
    unbound = free - {s for _, _, s in found}
    if unbound:
        raise RuntimeError(f"aotfuse: no input of the graph gives the value of {sorted(map(str, unbound))}")
    return found, free


class PerShape:
    """What a family's forward or backward compiler returns: called with concrete inputs, runs the
    program made for their sizes (made at the first call with them: concrete(), then `lower`),
    keeping the `limit` last used (AOTFUSE_SHAPE_PROGRAMS). The symbolic inputs (sizes AOTAutograd
    passes a backward) are dropped from the program's inputs; symbolic outputs are numbers in the
    program's outputs (the concrete graph returns them as constants)."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, lower: Callable[[fx.GraphModule], Any], limit: int | None = None):
        self.gm = gm
        self.lower = lower
        self.limit = limit or config.shape_programs()
        self.programs: collections.OrderedDict = collections.OrderedDict()
        self.last_vals: dict = {}  # the symbol values of the last call
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.numbers = frozenset(i for i, n in enumerate(placeholders) if isinstance(n.meta.get("val"), _SYM))
        found, free = binders(gm)
        self.symbols = sorted(free, key=str)
        # the call path reads one place per symbol: a number input where there is one (never None),
        # else every tensor dim giving it (a missing output gradient is None: the next one then)
        numbers = {s: (i, d, s) for i, d, s in found if d is None}
        self.binders = [b for b in found if b[2] not in numbers] + [numbers[s] for s in sorted(numbers, key=str)]

    def seed(self, vals: dict, program: Any) -> None:
        """Keeps `program` as the one for the symbol values `vals` (made elsewhere from this graph)."""
        self.programs[tuple(int(vals[s]) for s in self.symbols)] = program

    def values(self, args: Sequence[Any]) -> dict:
        vals: dict = {}
        for i, d, s in self.binders:
            if s not in vals and args[i] is not None:
                vals[s] = int(args[i]) if d is None else args[i].shape[d]
        return vals

    def program(self, args: Sequence[Any]) -> Any:
        return self.program_at(self.values(args))

    def program_at(self, vals: dict) -> Any:
        """The program for these symbol values (made now if it is not kept)."""
        self.last_vals = vals
        key = tuple(vals.get(s) for s in self.symbols)
        prog = self.programs.get(key)
        if prog is not None:
            self.programs.move_to_end(key)
            return prog
        with config.compile_lock():  # a run on any thread may make one (Dynamo's lock is not held then)
            prog = self.programs.get(key)  # made meanwhile by another thread
            if prog is None:
                config.emit("cache", f"shape family: a program for {dict(zip(map(str, self.symbols), key))}")
                with config.lazy_graph_modules():
                    prog = self.lower(concrete(self.gm, vals))
                self.programs[key] = prog
                while len(self.programs) > self.limit:
                    self.programs.popitem(last=False)
        return prog

    def __call__(self, args: list) -> list:
        prog = self.program(args)
        numbers = self.numbers
        rest = [a for i, a in enumerate(args) if i not in numbers] if numbers else list(args)
        if isinstance(args, list):
            args.clear()  # boxed: the program drops each input after its last use
        return prog(rest)


class Family:
    """Signatures that differ only in the sizes of some dimensions of contiguous tensors (`dims`:
    tensor position -> dimensions), served by one symbolic trace (`compiled`, AOTAutograd's
    callable, whose compilers are PerShape). `shapes`: the sizes it was traced at; a call joins
    when its other sizes are these and the trace's guards hold for it."""

    def __init__(self, dims: dict[int, frozenset], shapes: list[tuple]):
        self.dims = dims
        self.shapes = shapes
        self.compiled: Callable | None = None
        self.record: Any = None
        self.fakes: list = []
        self.shape_env: Any = None
        self.guards: str | None = None
        self.failed = False  # traced without symbols (failed, or every size pinned): no members
        self.refused: set = set()  # shapes whose programs failed: traced on their own
        self.stages: dict[str, PerShape] = {}  # "forward", "backward", "inference"

    def admits(self, tensors: Sequence[torch.Tensor]) -> bool:
        if self.failed or self.compiled is None or len(tensors) != len(self.shapes):
            return False
        if self.refused and tuple(tuple(t.shape) for t in tensors) in self.refused:
            return False
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if t.dim() != len(shape):
                return False
            dyn = self.dims.get(i, ())
            if any(a != b and d not in dyn for d, (a, b) in enumerate(zip(t.shape, shape))):
                return False
        return self.guards is None or bool(self.shape_env.evaluate_guards_expression(self.guards, list(tensors)))

    def inputs(self, tensors: Sequence[torch.Tensor]) -> list:
        """Fake tensors for a symbolic trace: the family's dimensions symbolic, the rest static."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        # no duck sizing: two sizes equal at the traced shape (a batch of 8 and a length of 8) stay
        # two symbols, unless the graph itself ties them (then a guard does)
        self.shape_env = ShapeEnv(duck_shape=False)
        mode = FakeTensorMode(shape_env=self.shape_env)
        fakes = []
        for i, t in enumerate(tensors):
            dyn = self.dims.get(i, ())
            ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dyn else DimDynamic.STATIC
                                                          for d in range(t.dim())])
            fakes.append(mode.from_tensor(t, symbolic_context=ctx))
        self.fakes = fakes
        return fakes

    def seal(self) -> bool:
        """After the trace: the guards its calls must pass; False (and failed) where the trace pinned
        every symbolic size to the traced one."""
        env = self.shape_env
        free = set()
        for f in self.fakes:
            for s in f.shape:
                if isinstance(s, torch.SymInt):
                    e = env.replace(s.node.expr)
                    free |= e.free_symbols
        if not free:
            self.failed = True
            return False
        self.guards = env.produce_guards_expression(self.fakes, ignore_static=True)
        return True


def flat_module(fn: Callable) -> torch.nn.Module:
    """fn(*tensors) as a module without parameters, for aot_module_simplified."""

    class Flat(torch.nn.Module):
        def forward(self, *tensors: Any) -> Any:
            return fn(*tensors)

    return Flat()


def trace(family: Family, fn: Callable, tensors: Sequence[torch.Tensor], *, fw: Callable, bw: Callable,
          inference: Callable, partition: Callable, decompositions: dict, keep_inference_input_mutations: bool,
          fuse_attention: str | None) -> Callable:
    """Traces fn symbolically for the family (AOTAutograd's aot_module_simplified, as Dynamo's
    graphs are) and returns the compiled callable; eager attention becomes SDPA first where
    `fuse_attention` says so (attention.py)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import TracingContext, tracing

    fakes = family.inputs(tensors)
    mode = fakes[0].fake_mode if fakes else None
    target = fn
    if fuse_attention is not None:
        from .attention import fused_graph

        with torch._guards.tracing(None):
            gm = fused_graph(fn, fakes, fuse_attention)
        if gm is not None:
            target = gm
    # each symbol is also an input of its own (a size, as Dynamo's graphs take them): torch's extractor
    # then hands the backward every symbol its saved values need, even where those only have products
    # of them ([batch * length, hidden]), so PerShape can bind them
    slots, seen = [], set()
    for i, f in enumerate(fakes):
        for d, size in enumerate(f.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) and size.node.expr not in seen:
                seen.add(size.node.expr)
                slots.append((i, d))
    n = len(fakes)
    module = flat_module(lambda *args: target(*args[:n]))
    with tracing(TracingContext(mode)):
        compiled = aot_module_simplified(module, fakes + [fakes[i].shape[d] for i, d in slots], fw_compiler=fw,
                                         bw_compiler=bw, partition_fn=partition, decompositions=decompositions,
                                         keep_inference_input_mutations=keep_inference_input_mutations,
                                         inference_compiler=inference)

    def run(*ts: torch.Tensor) -> Any:
        return compiled(*ts, *[ts[i].shape[d] for i, d in slots])

    return run


def hint(x: Any) -> int:
    """A size as the number it was traced at (a SymInt's hint), without adding a guard."""
    if isinstance(x, torch.SymInt):
        return int(x.node.expr.xreplace(_hints(x.node.shape_env)))
    return int(x)


def same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two size lists are known equal for every value of their symbols (no guard added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if len(a) != len(b):
        return False
    return all(x == y if not isinstance(x, _SYM) and not isinstance(y, _SYM) else statically_known_true(x == y)
               for x, y in zip(a, b))

