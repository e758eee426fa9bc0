"""Partition functions with torch's partition_fn signature, decided by the C core.

    fw_module, bw_module = min_cut_rematerialization_partition(joint_module, joint_inputs,
                                                               num_fwd_outputs=n)

The joint graph is lowered into the C IR; csrc/partition.c picks the saved set (min cut, or
"save what the backward reads") and the backward's run order. The FX modules are then cut out of
the joint graph around that saved set with torch's own extractor, so that they plug into torch's
aot_function as well as ours.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

from . import _C, checkpoint, config, shapes
from .lower import build_graph, detaches_as_aliases, set_real_dtypes, unwrap_effects
from .rng import share_seeds
from .shapes import same

__all__ = ["min_cut_rematerialization_partition", "default_partition", "PartitionStats"]

ROLE_PRIMAL, ROLE_TANGENT, ROLE_CONSTANT, ROLE_FWD_SEED, ROLE_BWD_SEED, ROLE_PARAM = range(6)


class PartitionStats:
    """What the last partition of a graph decided (kept on the returned forward module as
    `fw_module.meta["aotfuse_partition"]`)."""

    def __init__(self, saved: list[tuple[str, tuple, str, int]], recomputed: list[str], saved_bytes: int,
                 mode: str):
        self.saved = saved            # (name, shape, dtype, bytes) per saved value
        self.recomputed = recomputed  # names of forward nodes the backward recomputes
        self.saved_bytes = saved_bytes
        self.mode = mode

    def __str__(self) -> str:
        lines = [f"{self.mode} partition: saved {len(self.saved)} values, {self.saved_bytes} bytes; "
                 f"recomputed {len(self.recomputed)} nodes in the backward"]
        lines += [f"  saved {n}: {d}{list(s)} {b} B" for n, s, d, b in self.saved]
        if self.recomputed:
            lines.append("  recomputed: " + ", ".join(self.recomputed))
        return "\n".join(lines)


def _role(node: fx.Node, params: set) -> int:
    if node.op == "get_attr":
        return ROLE_CONSTANT
    if node in params:
        return ROLE_PARAM
    name = str(node.target)
    if name.startswith("tangents"):
        return ROLE_TANGENT
    if name.startswith("bwd_seed") or name.startswith("bwd_base_offset"):
        return ROLE_BWD_SEED
    if name.startswith("fwd_seed") or name.startswith("fwd_base_offset"):
        return ROLE_FWD_SEED
    return ROLE_PRIMAL


def _extract(joint_module: fx.GraphModule, saved: list[fx.Node], num_fwd_outputs: int,
             static_lifetime_input_nodes: Any, saved_sym: list[fx.Node] | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    try:
        from torch._functorch.partitioners import _extract_fwd_bwd_modules
    except ImportError as e:  # torch moved its extractor
        raise RuntimeError("aotfuse: this torch has no torch._functorch.partitioners._extract_fwd_bwd_modules; "
                           "use a torch in aotfuse's supported range (2.11 - 2.15)") from e
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if static_lifetime_input_nodes is not None and \
            "static_lifetime_input_nodes" in inspect.signature(_extract_fwd_bwd_modules).parameters:
        kwargs["static_lifetime_input_nodes"] = static_lifetime_input_nodes
    return _extract_fwd_bwd_modules(joint_module, saved, saved_sym_nodes=list(saved_sym or ()), **kwargs)


def _is_sym(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _forward_sizes(joint_module: fx.GraphModule) -> list[fx.Node]:
    """A symbolic joint graph's size nodes the forward can compute (from no output gradient), its size
    inputs included: the forward returns them for the backward (torch's extractor drops those the
    backward never reads)."""
    late: set = set()  # nodes reached from tangents and backward seeds
    for node in joint_module.graph.nodes:
        if node.op == "placeholder":
            if _role(node, set()) in (ROLE_TANGENT, ROLE_BWD_SEED):
                late.add(node)
        elif any(a in late for a in node.all_input_nodes):
            late.add(node)
    # (sizes a Dynamo graph takes as inputs, `s0`, are among them: placeholders of the forward)
    return [n for n in joint_module.graph.nodes if _is_sym(n) and n not in late and n.users]


def _val(node: Any) -> torch.Tensor | None:
    """A node's traced tensor value (meta["val"]), or None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _frozen(a: Any) -> Any:
    """An argument as a hashable key: containers as tuples, constants with their type (1, 1.0 and
    True are equal in Python, not as op arguments); nodes stand for themselves."""
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_frozen(x) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _frozen(v)) for k, v in a.items())
    if isinstance(a, fx.Node):
        return a
    return (type(a), a)


def _storage(node: fx.Node) -> Any:
    val = _val(node)
    if val is None:
        return None
    try:
        return torch.multiprocessing.reductions.StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


_PERMUTES = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def _inherit_meta(new: fx.Node, old: fx.Node) -> None:
    """A node a rewrite makes in old's place takes old's meta but its value: the backward's
    `partitioner_tag` and a checkpoint region's `recompute` tag among them (checkpoint.node_policies
    reads a forward node's untagged reader as one outside its region, and saves it)."""
    new.meta.update({key: val for key, val in old.meta.items() if key not in ("val", "tensor_meta")})


def _convert_before_permutes(graph: fx.Graph) -> int:
    """`_to_copy(p(x), dtype=d)`, p a transpose or permute of a dense x, rewritten in place as
    `p(_to_copy(x, dtype=d))`: the same values and strides (a conversion keeps a dense tensor's
    strides), and the conversions of one value read directly and through a transpose become one node
    for _cse. A 16-bit CPU matmul computed in float32 (decompositions._float32_table) converts its
    gradient G for both of the backward's matmuls, `mm(G, W)` and `mm(G^T, X)`: without this, two
    float32 copies of G, 16.8 MB each for Bert's logits at the reduced size. Returns the count."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    done = 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default or len(node.args) != 1
                or set(node.kwargs) != {"dtype"}):
            continue
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _PERMUTES
                and isinstance(src.args[0], fx.Node)):
            continue
        base, val = src.args[0], _val(src.args[0])
        if not isinstance(val, torch.Tensor) or not is_non_overlapping_and_dense_or_false(val):
            continue
        converted = torch.ops.aten._to_copy.default(val, dtype=node.kwargs["dtype"])
        permuted = src.target(converted, *src.args[1:], **src.kwargs)
        old = _val(node)
        if not isinstance(old, torch.Tensor) or not same(tuple(permuted.stride()), tuple(old.stride())):
            continue
        with graph.inserting_before(node):
            conv = graph.call_function(torch.ops.aten._to_copy.default, (base,), dict(node.kwargs))
            new = graph.call_function(src.target, (conv, *src.args[1:]), dict(src.kwargs))
        for made, val in ((conv, converted), (new, permuted)):
            _inherit_meta(made, node)
            made.meta["val"] = val
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not src.users:
            graph.erase_node(src)
        done += 1
    return done


def _sums_of_conversions(graph: fx.Graph) -> int:
    """`sum(x, dims, keepdim)` of a 16-bit x that is also converted to float32, `_to_copy(x,
    dtype=float32)`, rewritten in place as `_to_copy(sum(that conversion, dims, keepdim), dtype=x's)`:
    the same sum (ATen's and aotfuse's 16-bit sums accumulate in float32 and round once), read from
    the float32 value. A 16-bit CPU linear layer computed in float32 (decompositions._float32_table)
    has its bias gradient so beside the two matmuls reading G's conversion, and lm_grads.py's chunks
    take all three: otherwise a language-model head's 16-bit G is made whole for its bias. Returns the
    count."""
    done = 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not torch.ops.aten.sum.dim_IntList or node.kwargs
                or len(node.args) not in (2, 3) or not isinstance(node.args[0], fx.Node)):
            continue
        x, val = node.args[0], _val(node)
        if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float16, torch.bfloat16):
            continue
        conv = next((u for u in x.users if u.op == "call_function" and u.target is torch.ops.aten._to_copy.default
                     and len(u.args) == 1 and u.kwargs == {"dtype": torch.float32}), None)
        if conv is None or _val(x).dtype != val.dtype:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[conv] > order[node]:
            node.prepend(conv)  # the conversion reads only x, made before the sum
        with graph.inserting_before(node):
            total = graph.call_function(torch.ops.aten.sum.dim_IntList, (conv, *node.args[1:]))
            back = graph.call_function(torch.ops.aten._to_copy.default, (total,), {"dtype": val.dtype})
        _inherit_meta(total, node)
        _inherit_meta(back, node)
        total.meta["val"] = torch.ops.aten.sum.dim_IntList(_val(conv), *node.args[1:])
        back.meta["val"] = torch.ops.aten._to_copy.default(total.meta["val"], dtype=val.dtype)
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        done += 1
    return done


def _cse(graph: fx.Graph) -> None:
    """Common subexpressions once, in place, as torch's min-cut partitioner has them before it
    cuts (its fx_graph_cse, without copying the graph or importing Inductor): a call of the same
    op on the same arguments after an earlier one is replaced by it. Never merged: random ops
    (each draws), aten.empty, values sharing storage with a graph output (distinct tensors in
    eager), values with unbacked symbols, and calls on either side of an op that mutates an
    argument (each mutation starts a new region)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    out_storages = {s for s in map(_storage, output.all_input_nodes) if s is not None}
    seen: dict[tuple, fx.Node] = {}
    region = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            region += 1
            continue
        if isinstance(target, torch._ops.OpOverload) and (
                torch.Tag.nondeterministic_seeded in target.tags or target.overloadpacket is torch.ops.aten.empty):
            continue
        if out_storages and _storage(node) in out_storages:
            continue
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        try:
            key = (target, _frozen(node.args), _frozen(node.kwargs), region)
            prev = seen.get(key)
        except TypeError:  # an unhashable argument: kept as it is
            continue
        if prev is None:
            seen[key] = node
        else:
            node.replace_all_uses_with(prev)
            graph.erase_node(node)


def _drop_identity_clones(graph: fx.Graph) -> int:
    """A clone in a functional graph copies a value nothing mutates: where the copy has the value's own
    layout (sizes and strides) and is not a graph output (distinct tensors in eager), its readers read
    the value. Dropout with p = 0 in training mode is such a clone (ATen's `dropout` returns
    `input.clone()`), between the attention probabilities and the matmul reading them: kept, the
    partitioner saved the copy and the values to recompute the probabilities from. Returns the count."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = set(output.all_input_nodes)
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.clone.default or node in outs:
            continue
        if len(node.args) != 1 or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        src = node.args[0]
        a, b = _val(node), _val(src)
        if a is None or b is None or src.op == "placeholder" or not same(a.shape, b.shape) \
                or not same(a.stride(), b.stride()) or a.dtype != b.dtype or a.device != b.device:
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        dropped += 1
    return dropped




def _merge_duplicate_getitems(graph: fx.Graph) -> None:
    """One FX node per value: a second getitem of the same output (AOTAutograd emits them for
    the backward) would make the extractor re-run the producer to get it."""
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem:
            key = (node.args[0], node.args[1])
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node


def _reorder(bw_module: fx.GraphModule, order: list[str]) -> None:
    """Moves the backward's nodes into the C core's run order (getitems right after their source)."""
    by_name = {n.name: n for n in bw_module.graph.nodes}
    placeholders = [n for n in bw_module.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return
    cursor = placeholders[-1]
    # constants (get_attr: tensors a model builds with torch.tensor in its forward) go first,
    # wherever the extractor copied them, since the C core's order may use them at any point
    for node in [n for n in bw_module.graph.nodes if n.op == "get_attr"]:
        cursor.append(node)
        cursor = node
    placed: set = set()
    in_order = set(order)

    def place_sizes(node: fx.Node) -> None:
        # nodes in no order of the C core's: a symbolic graph's size nodes and the whole slices its
        # concrete copy dropped (shapes.concrete) go before their first reader
        nonlocal cursor
        for a in node.all_input_nodes:
            if a.op == "call_function" and a not in placed and a.name not in in_order:
                place_sizes(a)
                placed.add(a)
                cursor.append(a)
                cursor = a

    for name in order:
        node = by_name.get(name)
        if node is None or node.op != "call_function":
            continue
        place_sizes(node)
        placed.add(node)
        cursor.append(node)
        cursor = node
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                cursor.append(user)
                cursor = user
    # The extractor copies every node whose inputs are available; DCE keeps ops it considers
    # impure (attention with a dropout argument, say) even when nothing reads them. Only what
    # the C core put in the backward runs there.
    keep = set(order)
    for node in reversed(list(bw_module.graph.nodes)):
        if node.op == "call_function" and not node.users and node.name not in keep \
                and node.target is not operator.getitem:
            bw_module.graph.erase_node(node)
    bw_module.graph.lint()
    bw_module.recompile()


def _params(joint_module: fx.GraphModule, static: Any) -> set:
    """The joint graph's primal placeholders at the forward input positions `static` (parameters
    and buffers: AOTAutograd's static-lifetime inputs, or the first N for aot_function's N
    parameters and buffers): free to save, since they live anyway."""
    if not static:
        return set()
    primals = [n for n in joint_module.graph.nodes if n.op == "placeholder" and _role(n, set()) == ROLE_PRIMAL]
    return {primals[i] for i in static if 0 <= i < len(primals)}


def _mutated_statics(joint_module: fx.GraphModule, params: set, num_fwd_outputs: int) -> set:
    """The parameters and buffers the forward may update in place (`self.step += 1`, a clamp_ under
    no_grad): AOTAutograd returns each such input's new value as a forward output (the first ones) and
    writes it back after the forward, so the input itself no longer holds the value the backward was
    traced with. Told from the graph: a forward output of an input's shape and dtype computed from it
    (an output that only looks so costs a copy where it is saved, never a wrong value)."""
    if not params:
        return set()
    out = next(n for n in reversed(joint_module.graph.nodes) if n.op == "output")
    outs = list(out.args[0])[:num_fwd_outputs]
    found: set = set()
    for o in outs:
        ov = _val(o)
        if ov is None or o in params:
            continue
        cands = [p for p in params if p not in found and (v := _val(p)) is not None and v.shape == ov.shape
                 and v.dtype == ov.dtype]
        if not cands:
            continue
        seen, stack = set(), [o]
        while stack:  # o's ancestors
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        found.update(p for p in cands if p in seen)
    return found


def _save_copies_of(joint_module: fx.GraphModule, mutated: list, backward_names: set) -> dict:
    """For each input in `mutated` that the cut saves (or view of one): a clone of it made at the
    forward's start (where the view is made), which the backward reads instead (what it was traced
    with: the input is overwritten by the forward's write-back, and autograd would refuse it as
    modified in place). {input: clone}."""
    graph = joint_module.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    clones = {}
    for p in mutated:
        with graph.inserting_after(last if p.op == "placeholder" else p):  # a view of one: where it is made
            c = graph.call_function(torch.ops.aten.clone.default, (p,))
        c.meta = dict(p.meta)
        for user in list(p.users):
            if user is not c and user.name in backward_names:
                user.replace_input_with(p, c)
        clones[p] = c
        if p.op == "placeholder":
            last = c
    return clones


def _view_of(node: fx.Node, roots: set) -> bool:
    """Whether node is one of roots or a view (through views) of one."""
    while node not in roots:
        if node.op != "call_function" or not getattr(node.target, "is_view", False) or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]
    return True


def _partition(joint_module: fx.GraphModule, num_fwd_outputs: int, min_cut: bool,
               static_lifetime_input_nodes: Any = None, static_inputs: Any = None,
               **options: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    unwrap_effects(joint_module)  # before dead-code elimination, which keeps the effectful calls
    detaches_as_aliases(joint_module)
    joint_module.graph.eliminate_dead_code()
    if min_cut:
        _convert_before_permutes(joint_module.graph)
        _cse(joint_module.graph)
        if _sums_of_conversions(joint_module.graph):
            joint_module.graph.lint()
    if config.drop_clones():
        _drop_identity_clones(joint_module.graph)
    _merge_duplicate_getitems(joint_module.graph)
    share_seeds(joint_module)  # one seed draw for all dropouts, before the seeds are saved
    set_real_dtypes(joint_module)  # the forward's outputs and the backward's inputs as they run
    # a symbolic graph (a shape family's, shapes.py) is decided at the sizes it was traced at, on a
    # concrete copy whose nodes have the same names, and cut out around the same nodes
    symbolic = shapes.is_symbolic(joint_module)
    if not symbolic:  # the cross entropy backward's row sum of its one-hot gradient (picks.py)
        from .picks import rewrite_one_hot_picks

        rewrite_one_hot_picks(joint_module, scaled_only=True)
    work = shapes.concrete(joint_module, shapes.symbolic_values(joint_module)) if symbolic else joint_module
    build = build_graph(work, exact=True)
    params = _params(work, static_inputs)
    roles = bytes(_role(n, params) for n in build.input_nodes)
    # graph outputs skip None entries: count the forward's among the real ones
    nfwd = sum(1 for t in build.out_template[:num_fwd_outputs] if t is None)
    if min_cut:
        options.setdefault("ban_materialized_bw", config.ban_materialized())
        options.setdefault("ban_chained_materialized", 0 if config.recompute_chains() else 1)
        options.setdefault("ban_scalar_calls", 0 if config.recompute_scalar_calls() else 1)
        options.setdefault("memory_budget", config.memory_budget())
    budget = options.get("memory_budget", 1.0) < 1.0
    policies = checkpoint.node_policies(joint_module.graph, budget)  # activation checkpointing's regions
    if policies:
        options["node_policy"] = bytes(policies.get(n.name, checkpoint.NONE) for n in build.ir_nodes)
    res = _C.partition(build.graph, roles, nfwd, min_cut=min_cut, **options)
    by_name = {n.name: n for n in joint_module.graph.nodes} if symbolic else None
    saved_nodes, saved_vals = [], []
    for vid in res["saved"]:
        node = build.value_nodes[vid]
        if node is None:
            raise RuntimeError(f"aotfuse partition: saved value {vid} has no FX node")
        if node.op != "get_attr":  # constants are copied into both graphs, never saved
            saved_nodes.append(by_name[node.name] if symbolic else node)
            saved_vals.append(node.meta.get("val"))
    # inputs the step updates after the forward, parameters and buffers (found from the graph) and
    # any other (AOTAutograd's output descs: an input requiring grad written in place, whose saved
    # value autograd refused in the backward as modified, found by a random aliasing sweep)
    names = {n.name for n in _mutated_statics(work, params, num_fwd_outputs)}
    names |= {n.name for n in checkpoint.mutated_placeholders(joint_module.graph)}
    if names:
        # the inputs themselves, and views of them (an input unsqueezed in place: the saved view)
        roots = {n for n in joint_module.graph.nodes if n.op == "placeholder" and n.name in names}
        copied = [n for n in saved_nodes if _view_of(n, roots)]
        if copied:
            clones = _save_copies_of(joint_module, copied, {build.ir_nodes[i].name for i in res["backward"]})
            saved_nodes = [clones.get(n, n) for n in saved_nodes]
    fw, bw = _extract(joint_module, saved_nodes, num_fwd_outputs, static_lifetime_input_nodes,
                      _forward_sizes(joint_module) if symbolic else None)
    _reorder(bw, [build.ir_nodes[i].name for i in res["backward"]])
    fw_names = {build.ir_nodes[i].name for i in res["forward"]}
    bw_names = {n.name for n in bw.graph.nodes if n.op == "call_function"}
    saved_info = []
    for node, val in zip(saved_nodes, saved_vals):
        shape = tuple(val.shape) if hasattr(val, "shape") else ()
        dtype = str(getattr(val, "dtype", "")).replace("torch.", "")
        nbytes = val.numel() * val.element_size() if hasattr(val, "numel") else 0
        saved_info.append((node.name, shape, dtype, nbytes))
    stats = PartitionStats(saved_info, sorted(fw_names & bw_names), res["saved_bytes"],
                           "min-cut" if min_cut else "default")
    fw.meta["aotfuse_partition"] = stats
    config.emit("partition", str(stats))
    return fw, bw


def min_cut_rematerialization_partition(joint_module: fx.GraphModule, _joint_inputs: Any, compiler: Any = None, *,
                                        num_fwd_outputs: int, static_lifetime_input_indices: Any = None,
                                        **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's partition_fn signature: saves the min-cut set of activations (chosen in C) and
    recomputes cheap pointwise work in the backward.

    Example:
        >>> from torch._functorch.aot_autograd import aot_function
        >>> f = aot_function(fn, nop, partition_fn=aotfuse.min_cut_rematerialization_partition)
    Options (keyword): max_dist_from_bw, reduction_ratio, ban_materialized_bw, ban_chained_random,
    ban_chained_materialized. Parameters and buffers (static_lifetime_input_indices, or
    aotfuse_static_inputs) cost nothing to save.
    ban_materialized_bw: a value the backward writes out anyway (a matmul's operand) is recomputed
    0: wherever the cut prefers, 1 (True): never (functorch's rule), 2: unless recomputing it draws
    random numbers again (default, from AOTFUSE_RECOMPUTE_MATERIALIZED) or, under that default with
    ban_chained_materialized (default 1; 0 from AOTFUSE_RECOMPUTE_CHAINS=1), makes another such value
    at least a quarter its size first.
    ban_scalar_calls: a CPU value whose op calls a costly function (a libm call GCC does not
    vectorize, tan, atan, ..., or the C prelude's sin and cos) is never recomputed (default 1; 0 from
    AOTFUSE_RECOMPUTE_SCALAR_CALLS=1).
    memory_budget: 1 (default, from AOTFUSE_MEMORY_BUDGET or torch._functorch.config.
    activation_memory_budget): the cut above; below 1, matmuls, attention and other extern calls may
    be recomputed too, the fewest and cheapest that bring the saved activations down to
    S_min + budget x (S_max - S_min) bytes (0: as few as recomputing everything allows).
    """
    options = {k: kwargs.pop(k) for k in ("max_dist_from_bw", "reduction_ratio", "ban_materialized_bw", "ban_chained_random",
                                          "ban_chained_materialized", "ban_scalar_calls", "memory_budget")
               if k in kwargs}
    if "memory_budget" in options and not 0.0 <= float(options["memory_budget"]) <= 1.0:
        raise ValueError(f"memory_budget must be in [0, 1], not {options['memory_budget']}")
    return _partition(joint_module, num_fwd_outputs, True, kwargs.get("static_lifetime_input_nodes"),
                      kwargs.get("aotfuse_static_inputs", static_lifetime_input_indices), **options)


def default_partition(joint_module: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: Any = None, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's partition_fn signature: the forward saves every value the backward reads;
    nothing is recomputed."""
    return _partition(joint_module, num_fwd_outputs, False, kwargs.get("static_lifetime_input_nodes"),
                      kwargs.get("aotfuse_static_inputs", static_lifetime_input_indices))
