"""torch.compile(model, backend="aotfuse"): Dynamo captures graphs (splitting them where Python
cannot be captured), aotfuse compiles each one. Registered through the torch_dynamo_backends
entry point; `import aotfuse` also registers it."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import torch
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import aot_module_simplified
from .compile import _no_zero_gradients, _pass_layouts
from .decompositions import default_decompositions, layout_begin, layout_end, upstream_fixes
from . import shapes
from .lower import Lowered, UnsupportedError, lower, separate_aliased_gradients
from .partition import min_cut_rematerialization_partition

__all__ = ["aotfuse_backend"]


def _compile_or_fallback(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], saved_from: int | None = None,
                         lazy: bool = False):
    from . import config

    try:
        with config.compile_lock():  # a backward is lowered at its first call, on any thread
            return lower(gm, example_inputs, saved_from, lazy=lazy)
    except UnsupportedError as e:
        # Dynamo graphs can carry what the core does not take: that graph runs as torch's own FX
        # code, correctly. (Symbolic shapes never get here: _per_shape.)
        warnings.warn(f"aotfuse: a Dynamo graph runs uncompiled: {e}", stacklevel=2)
        from torch._functorch.aot_autograd import make_boxed_func

        return make_boxed_func(gm.forward)


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo handed over a graph with symbolic shapes (dynamic=True, or its automatic
    dynamic shapes after a recompile for a new shape)."""
    for x in example_inputs:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
            return True
    return False


def _scalar_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the inputs gm reads with `.item()`: Dynamo's unspecialized floats (dynamic=True
    passes a module's float, a layer norm's eps, as a 0-dim tensor)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = {n.args[0] for n in gm.graph.nodes if n.op == "call_method" and n.target == "item"
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"}
    return [i for i, p in enumerate(placeholders) if p in read]


def _scalars_in_full_precision(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list:
    """example_inputs with Dynamo's Python scalars passed as tensors in the dtype the call passes them.
    Dynamo traces such an input (a `random.random()` it draws before the graph, an unspecialized
    float) as `torch.tensor(value)`, float32, but calls the graph with `torch._as_tensor_fullprec(value)`:
    float64 (int64 for an int). A program compiled for the traced dtype would refuse every call (torch
    2.14 passes `random.random()` so), and one fed a float32 copy would compare `r < 0.5` rounded, so
    the graph is traced with the dtype it will get, as eager computes it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return list(example_inputs)
    out = list(example_inputs)
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        arg = node.meta.get("grapharg")
        if (arg is None or not getattr(arg, "pass_arg_as_tensor", False) or getattr(arg, "is_tensor", True)
                or not isinstance(x, torch.Tensor) or x.dim() != 0 or x.dtype == torch.bool):
            continue
        dtype = torch.float64 if x.dtype.is_floating_point else torch.int64
        if x.dtype != dtype:
            out[i] = x.to(dtype)
            for key in ("example_value", "val"):
                if isinstance(node.meta.get(key), torch.Tensor):
                    node.meta[key] = out[i]
    return out


def _with_scalars(gm: torch.fx.GraphModule, values: dict[int, Any]) -> torch.fx.GraphModule:
    """gm with each `.item()` of input i replaced by values[i] (a number in the graph)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in list(graph.nodes):
        if node.op == "call_method" and node.target == "item" and node.args[0] in placeholders:
            value = values[placeholders.index(node.args[0])]
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
            graph.erase_node(node)
    from . import config

    return config.graph_module(gm, graph)


def _per_shape(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], collect: list | None,
               options: dict | None = None):
    """A graph with symbolic shapes runs as programs compiled for each concrete signature its calls
    bring (the C core compiles shapes, not formulas for them): the first call of a signature traces
    gm again with its real inputs, so every size is a number (and every float Dynamo left as an
    input is the call's value), and compiles it as Dynamo's static graphs are; up to
    AOTFUSE_CACHE_SIZE signatures, then (one warning) gm runs uncompiled."""
    from . import config

    programs: dict[tuple, Any] = {}
    warned: list[bool] = []
    scalars = _scalar_inputs(gm)
    # what tells one call's signature from another's: the tensors with symbolic sizes or strides
    # (parameters have none) and the non-tensor inputs (the symbols' values); dtypes, devices and
    # requires_grad are Dynamo's guards (a change compiles a new graph)
    shaped = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and _symbolic([x])]
    plain = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]

    def run(*args: Any) -> Any:
        values = {i: args[i].item() for i in scalars}
        key = (tuple((args[i].shape, args[i].stride()) for i in shaped), tuple(args[i] for i in plain),
               tuple(values.values()))
        fn = programs.get(key)
        if fn is None:
            with config.compile_lock():  # at run time, on any thread
                fn = programs.get(key) or _compile_shape(key, args, values)
        return fn(*args)  # aot_module_simplified's convention: unboxed

    def _compile_shape(key: tuple, args: tuple, values: dict) -> Any:
        if len(programs) >= config.cache_size():
            if not warned:
                warned.append(True)
                warnings.warn(f"aotfuse: a Dynamo graph with symbolic shapes met more than {config.cache_size()} "
                              "shapes (AOTFUSE_CACHE_SIZE); new ones run uncompiled. Each shape compiles once: "
                              "padding batches to a few fixed lengths (a data collator's pad_to_multiple_of, "
                              "say) keeps them compiled, or raise the limit.", stacklevel=4)
            return gm
        fn = programs[key] = aotfuse_backend(_with_scalars(gm, values) if values else gm, list(args), collect,
                                             options=options)
        return fn

    return run


def _has_active_dropout(gm: torch.fx.GraphModule) -> bool:
    """Whether gm calls dropout with a literal p > 0 in training (Dynamo keeps functional calls)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (torch.nn.functional.dropout, torch.dropout):
            continue
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        train = n.kwargs.get("training", n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True))
        if isinstance(p, (int, float)) and p > 0 and train is True:
            return True
    return False


def _own_overlapping_outputs(gm: torch.fx.GraphModule) -> dict:
    """Dynamo's graph with each output that is a self-overlapping view of an intermediate replaced by
    its base, which the compiled call makes the view of, as memory_efficient_fusion's traced function
    does (compile._BaseView: AOTAutograd's view of the base gave the input a wrong gradient, Inductor's
    too); cloned where the base is no value of the graph or the sizes are symbolic. Returns {output
    position: compile._BaseView}."""
    from .compile import _BaseView, _out_kind, _overlapping_view_of_intermediate, _shares_an_input_storage

    def value(node: Any) -> Any:
        return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None

    inputs = [value(n) for n in gm.graph.find_nodes(op="placeholder")]
    out = gm.graph.output_node()
    flat = len(out.args) == 1 and isinstance(out.args[0], (tuple, list))
    bases: dict = {}
    changed = False

    def own(arg: Any, i: int | None) -> Any:
        nonlocal changed
        val = value(arg)
        if not _overlapping_view_of_intermediate(val, inputs) or _shares_an_input_storage(val, inputs):
            return arg  # (a view of an input: its own, or _input_views_made_by_the_call's)
        kind = _out_kind(val, inputs, set()) if i is not None else None
        base = next((n for n in gm.graph.nodes if value(n) is val._base), None) if isinstance(kind, _BaseView) else None
        changed = True
        if base is not None:
            bases[i] = kind
            return base
        with gm.graph.inserting_before(out):
            return gm.graph.call_method("clone", (arg,))

    if flat:
        out.args = (type(out.args[0])(own(a, i) for i, a in enumerate(out.args[0])),)
    else:
        out.args = torch.fx.node.map_arg(out.args, lambda a: own(a, None))
    if changed:
        gm.recompile()
    return bases


def _input_views_made_by_the_call(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict:
    """Dynamo's graph without its outputs that are views of an input sharing its storage with
    another input, which the compiled call makes from the caller's tensor instead, as
    memory_efficient_fusion does (compile._out_kind: AOTAutograd replays such a view on the synthetic
    base it merges the inputs into, and torch 2.13 crashed the process there). Returns {output
    position: compile._InputView}; gm is rewritten only where that is not empty."""
    from .compile import _InputView, _out_kind

    # Dynamo's fake values (the outputs' are views of the placeholders' fake storages)
    tensors = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    tensors = [t if isinstance(t, torch.Tensor) else None for t in tensors]
    if len(tensors) != len(example_inputs):
        return {}
    by: dict = {}
    for k, t in enumerate(tensors):
        if t is not None:
            try:
                by.setdefault(t.untyped_storage()._cdata, []).append(k)
            except (RuntimeError, NotImplementedError, TypeError):
                pass
    shared = {k for ks in by.values() if len(ks) > 1 for k in ks}
    out = gm.graph.output_node()
    if not shared or len(out.args) != 1 or not isinstance(out.args[0], (tuple, list)):
        return {}
    views = {}
    for i, node in enumerate(out.args[0]):
        val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
        kind = _out_kind(val, tensors, shared) if isinstance(val, torch.Tensor) else None
        if isinstance(kind, _InputView):
            views[i] = kind
    if views:
        # (no dead-code elimination: Dynamo's in-place method calls on inputs would count as dead)
        out.args = (type(out.args[0])(n for i, n in enumerate(out.args[0]) if i not in views),)
        gm.recompile()
    return views


def _attention_as_sdpa(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[torch.fx.GraphModule, list | None]:
    """gm with its eager attention chains as scaled_dot_product_attention (attention.py), traced at the
    pre-dispatch level, or gm as it is. As memory_efficient_fusion: on CUDA, and on the CPU without
    dropout but for short bf16 attention, whose SDPA calls become matmuls (AOTFUSE_FUSE_ATTENTION). Also returns, for a traced graph, the positions of AOTAutograd's
    inputs that live anyway (else None: AOTAutograd reads them off Dynamo's graph, see _static_inputs)."""
    from . import config
    from .attention import fused_graph

    mode = config.fuse_attention()
    called = {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    chains = any("softmax" in t for t in called) and any("matmul" in t or "bmm" in t for t in called)
    # SDPA calls that short bf16 CPU attention makes matmuls again (attention.unfuse_attention)
    sdpa = mode == "auto" and any("scaled_dot_product_attention" in t for t in called) and any(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in example_inputs)
    if mode == "0" or not (chains or sdpa):
        return gm, None  # no softmax between matmuls (torch.matmul, @, bmm), no SDPA to undo: nothing to trace for
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return gm, None  # held by the graph, not inputs (Dynamo lifts them): a trace would bake them in
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    if not on_cuda and mode == "auto" and _has_active_dropout(gm) and not sdpa:
        return gm, None
    fused = fused_graph(gm, list(example_inputs), mode)
    return (gm, None) if fused is None else (fused, _static_inputs(gm, fused))


def _static_inputs(dynamo_gm: torch.fx.GraphModule, traced: torch.fx.GraphModule) -> list[int]:
    """AOTAutograd's inputs that live anyway (free for the partitioner to save) when it traces `traced`,
    a trace of Dynamo's graph with the same inputs: the constants the trace holds (AOTAutograd puts
    them first) and the inputs Dynamo marked static (parameters, buffers). AOTAutograd finds the
    latter through Dynamo's metadata on its own graph only (_try_get_metadata_from_dynamo)."""
    held = sum(1 for _ in traced.parameters()) + sum(1 for _ in traced.buffers())
    marked = [held + i for i, node in enumerate(dynamo_gm.graph.find_nodes(op="placeholder"))
              if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    return list(range(held)) + marked


_OPTIONS = {"memory_budget": "a number in [0, 1]: the min cut's activation memory budget (below 1 matmuls and attention "
                             "may be recomputed to save less), as AOTFUSE_MEMORY_BUDGET or memory_efficient_fusion's "
                             "partition_fn=partial(min_cut_rematerialization_partition, memory_budget=...)"}
_warned_modes: set = set()


def _backend_options(mode: str | None, options: dict | None) -> dict:
    """torch.compile's `mode=` and `options=`, as Dynamo hands them to a backend: the partition's keyword
    arguments they set. A mode other than "default" warns once (aotfuse has none: no autotuning, no CUDA
    graphs; it compiles as by default); an unknown option or a bad value is a ValueError naming the known
    ones (Inductor's options mean nothing here: silently dropped, a user would think them applied)."""
    if mode not in (None, "default") and mode not in _warned_modes:
        _warned_modes.add(mode)
        warnings.warn(f"aotfuse: torch.compile mode={mode!r} has no meaning for the aotfuse backend (it autotunes "
                      f"nothing and launches without CUDA graphs); it compiles as mode='default'", stacklevel=3)
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        known = "; ".join(f"{k!r}: {v}" for k, v in _OPTIONS.items())
        raise ValueError(f"aotfuse backend: unknown option(s) {unknown} (the known ones: {known}; the other settings "
                         f"are AOTFUSE_* environment variables, README's Configuration)")
    kw = {}
    if "memory_budget" in options:
        budget = options["memory_budget"]
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0:
            raise ValueError(f"aotfuse backend: options['memory_budget'] must be a number in [0, 1], not {budget!r}")
        kw["memory_budget"] = float(budget)
    return kw


def aotfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], collect: list | None = None,
                    mode: str | None = None, options: dict | None = None):
    """The Dynamo backend. Example: torch.compile(model, backend="aotfuse").
    Each graph is partitioned by the C core's min-cut (as memory_efficient_fusion does); a graph with
    symbolic shapes is traced once as it is, and each concrete shape it meets gets programs made from
    its graphs (shapes.PerShape); where that trace fails, with `.item()` inputs (Dynamo's unspecialized
    floats) or AOTFUSE_DYNAMIC=0, each shape is traced with its real inputs (_per_shape). Eager attention becomes
    scaled_dot_product_attention first where it applies (_attention_as_sdpa). `collect` (through
    functools.partial) receives every lowered program as (stage, Lowered), for profiling.
    AOTFUSE_DISABLE=1 (read when Dynamo compiles a graph) runs the graph as torch's own FX code."""
    from . import config

    partition_kw = _backend_options(mode, options)
    if config.disabled():
        return gm.forward
    example_inputs = _scalars_in_full_precision(gm, example_inputs)
    bases = _own_overlapping_outputs(gm)
    views = _input_views_made_by_the_call(gm, example_inputs)
    symbolic = _symbolic(example_inputs)
    if symbolic and (config.dynamic() == "0" or _scalar_inputs(gm)):
        return _per_shape(gm, example_inputs, collect, options)
    state: dict[str, int] = {}

    def _keep(stage: str, low: Any) -> Any:
        if collect is not None and isinstance(low, Lowered):
            collect.append((stage, low))
        return low

    traced, static = _attention_as_sdpa(gm, example_inputs)

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any):
        state["num_fwd_outputs"] = kw.get("num_fwd_outputs", 0)
        if static is not None and not kw.get("static_lifetime_input_indices"):
            kw["aotfuse_static_inputs"] = static
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw, **partition_kw)

    def forward(fw: torch.fx.GraphModule, inputs: Sequence[Any] = ()):
        low = _compile_or_fallback(fw, inputs, state.get("num_fwd_outputs"))
        if isinstance(low, Lowered) and "num_fwd_outputs" in state:  # saved activations may be plain views
            low.program.set_plain_outputs(low.program_outputs_before(state["num_fwd_outputs"]))
        return _keep("forward", low)

    def backward(bw: torch.fx.GraphModule, inputs: Sequence[Any] = ()):
        separate_aliased_gradients(bw)
        low = _compile_or_fallback(bw, inputs, lazy=True)  # kernels compiled at its first run, if any
        if isinstance(low, Lowered):  # gradients may be plain views; missing ones run a variant
            low.program.set_plain_outputs(0)
            low.keep_graph_for_missing(bw)
            low.uncompiled_if_unbuildable = True
        return _keep("backward", low)

    def inference(g: torch.fx.GraphModule, inputs: Sequence[Any] = ()):
        return _keep("inference", _compile_or_fallback(g, inputs))

    def per_shape(make):
        # a graph with symbolic shapes, traced once: each concrete shape's program made from its
        # graphs (shapes.PerShape), as memory_efficient_fusion's shape families do
        return (lambda g, _inputs: shapes.PerShape(g, make)) if symbolic else make

    # Dynamo's DDPOptimizer (torch.compile of a DistributedDataParallel: one graph per gradient bucket)
    # counts AOTAutograd's invocations by this counter, as torch's own aot_autograd backends bump it, to
    # pair each bucket's lazily compiled backward with its forward's metadata
    counters["aot_autograd"]["total"] += 1
    layouts = _LayoutRecord(traced, symbolic, set(bases))

    def capture():
        # (the graphs made while tracing write their code only if read)
        with config.lazy_graph_modules(), upstream_fixes(), layouts:
            return aot_module_simplified(
                traced,
                example_inputs,
                fw_compiler=per_shape(forward),
                bw_compiler=per_shape(backward),
                inference_compiler=per_shape(inference),
                partition_fn=partition,
                decompositions=default_decompositions(),
            )

    try:
        compiled = None
        while compiled is None:
            try:
                compiled = capture()
            except Exception as e:  # noqa: BLE001
                why = f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                if layouts.layout_fired:
                    config.emit("cache", f"a Dynamo graph is traced again without channels-last convolutions {why}")
                    layouts.on, layouts.layout_fired = False, False
                elif traced is not gm:  # a rewrite of its attention the graph behind it cannot take: as it is
                    config.emit("cache", f"a Dynamo graph is traced again without its attention rewritten {why}")
                    traced, static, on = gm, None, layouts.on
                    layouts = _LayoutRecord(traced, symbolic, set(bases))
                    layouts.on = on
                else:
                    raise
    except Exception as e:  # noqa: BLE001
        if not symbolic:
            raise
        # the symbolic capture failed: each concrete shape traced with its real inputs, as before
        config.emit("cache", f"a Dynamo graph with symbolic shapes is traced per shape ({type(e).__name__}: {e})")
        return _per_shape(gm, example_inputs, collect, options)

    @functools.wraps(compiled)  # same calling convention (boxed or not) and attributes
    def run(*args: Any) -> Any:
        if views:  # the inputs, boxed (one list, which the call empties) or not (Dynamo calls it so)
            inputs = list(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
        outs = compiled(*args)
        _no_zero_gradients(outs)  # outputs nobody differentiates get no dense zero gradient
        if views:
            it = iter(outs)
            outs = [views[i].of(inputs) if i in views else next(it) for i in range(len(outs) + len(views))]
        if bases:  # (positions in Dynamo's outputs, as the input views')
            outs = [bases[i].of(o) if i in bases else o for i, o in enumerate(outs)]
        return outs

    return run


class _LayoutRecord:
    """Channels-last convolutions (decompositions.py) in a Dynamo graph's capture: while it is traced
    (`with` it), the graph runs its nodes between layout_begin and layout_end (AOTAutograd interprets
    a GraphModule node by node, so they are nodes of it, taken out again afterwards), and a pass
    that changed a layout gives its outputs the layouts of the pass without decompositions
    (compile._pass_layouts). Not on symbolic graphs."""

    def __init__(self, gm: torch.fx.GraphModule, symbolic: bool, bases: set) -> None:
        self.gm, self.on, self.bases = gm, not symbolic, bases  # bases: outputs the call makes views of
        self.out_layouts: list | None = None
        self.layout_fired = False
        self._nodes: tuple | None = None

    def begin(self) -> None:
        layout_begin(self.on)

    def end(self, outs: Any) -> Any:
        fired = layout_end()
        self.layout_fired |= fired
        fixed = _pass_layouts(self, tuple(outs), fired, self.bases)
        return fixed if isinstance(outs, tuple) else type(outs)(fixed)

    def __enter__(self) -> None:
        g = self.gm.graph
        out = g.output_node()
        if not self.on or not isinstance(out.args[0], (tuple, list)):
            return
        places = [n for n in g.nodes if n.op == "placeholder"]
        with g.inserting_after(places[-1]) if places else g.inserting_before(next(iter(g.nodes))):
            begin = g.call_function(self.begin, ())
        with g.inserting_before(out):
            end = g.call_function(self.end, (out.args[0],))
        self._nodes = (begin, end, out.args)
        out.args = (end,)

    def __exit__(self, *exc: Any) -> None:
        self.layout_fired |= layout_end()  # (a trace that raised between the two nodes)
        if self._nodes is not None:
            begin, end, args = self._nodes
            self.gm.graph.output_node().args = args
            self.gm.graph.erase_node(end)
            self.gm.graph.erase_node(begin)
            self._nodes = None


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "aotfuse" not in _BACKENDS:
        register_backend(name="aotfuse")(aotfuse_backend)
