"""Runs the CUDA kernels aotfuse generates on the CPU, for numeric tests without a GPU.

A graph traced on the CPU is planned and code-generated for cuda:0 exactly as a CUDA program would
be (`_C.cuda_codegen`); its source, with the prelude swapped for tests/cuda_emu.h, is compiled as
C++ by the host compiler, and each group's kernels are launched the way the runtime launches them
(runtime.c, launch_cuda): the vectorized variant when there is one and every pointer is 16-byte
aligned, column and split-row reductions as two passes through a float64 workspace. The grid is capped as on a
device with `sm_count` multiprocessors (small by default, so grid-stride loops take several turns).
A kernel with barriers, warp shuffles or shared memory runs each CUDA thread of a block as a fiber
on the calling thread (cuda_emu.h's emu_launch: resumed in increasing, then decreasing, thread order
between barriers, so a missing barrier shows; a barrier some threads never reach returns 4 instead of
hanging); one without them, whose threads never meet, runs its CUDA threads one after another
(emu_launch_serial), which gives the same results without the switches.
Each group reads eager's values of its inputs and its outputs are compared with eager's. A group
whose input layout in eager differs from the graph's metadata is skipped, as the runtime would
run its nodes as ATen calls (its first-run layout checks).

What it cannot show: timing, memory coalescing, NVRTC's own code generation (tests/test_cuda_codegen.py
compiles the same sources with NVRTC), and the hardware's 16-bit conversion instructions.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile

import torch
from torch import fx

from aotfuse import _C, config
from aotfuse.lower import build_graph

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu.h")
_SIG = re.compile(r'extern "C" __global__ void __launch_bounds__\(\d+(?:, \d+)?\) (\w+)\(([^)]*)\) \{')
# each kernel's launch bound and parameter count, as the source declares them
_BOUND = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, \d+)?\) (\w+)\(([^)]*)\) \{')
_built: dict[str, ctypes.CDLL] = {}
_dir = None

TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2),
              torch.float64: (1e-12, 1e-12), torch.bool: (0, 0), torch.int64: (0, 0)}


def unavailable() -> str | None:
    """None when a C++ compiler that can build the emulation is here, else why not."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if not cxx:
        return "no C++ compiler (g++) for the CUDA emulation"
    try:
        _library('extern "C" __global__ void __launch_bounds__(32, 1) af_kernel_0(float *__restrict__ q0) { q0[threadIdx.x] = 1.0f; }\n')
    except RuntimeError as e:
        return str(e)
    return None


def _trampolines(source: str) -> str:
    out = []
    for name, params in _SIG.findall(source):
        casts = []
        for i, p in enumerate(x.strip() for x in params.split(",") if x.strip()):
            ptype = re.match(r"(.*?)\s*\w+$", p).group(1).replace("__restrict__", "").strip()
            casts.append(f"({ptype})a[{i}]")
        out.append(f'extern "C" void emu_{name}(void **a) {{ {name}({", ".join(casts)}); }}\n')
    return "".join(out)


def _library(source: str) -> ctypes.CDLL:
    """Compiles generated CUDA source (prelude replaced) into a shared library, once per source."""
    global _dir
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    if key in _built:
        return _built[key]
    body = source[source.index("#define AF_FN"):] if "#define AF_FN" in source else source
    text = f'#include "{HEADER}"\n{body}\n{_trampolines(body)}'
    if _dir is None:
        _dir = tempfile.mkdtemp(prefix="aotfuse-cuda-emu-")
    src, lib = os.path.join(_dir, f"{key}.cpp"), os.path.join(_dir, f"{key}.so")
    with open(src, "w") as f:
        f.write(text)
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-w",
           src, "-o", lib]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"the CUDA emulation does not compile ({' '.join(cmd)}):\n{r.stderr[:4000]}")
    dll = ctypes.CDLL(lib)
    # each kernel: (its __launch_bounds__, its parameter count, whether its threads never meet: no
    # barrier, shuffle or shared memory in its text, so emu_launch_serial runs it on this thread)
    kernels = list(_BOUND.finditer(body))
    dll.declared = {}
    for m, after in zip(kernels, kernels[1:] + [None]):
        text = body[m.end():after.start() if after else len(body)]
        alone = not any(w in text for w in ("__syncthreads", "__shfl", "__shared__"))
        dll.declared[m.group(2)] = (int(m.group(1)), len([p for p in m.group(3).split(",") if p.strip()]), alone)
    for launch in (dll.emu_launch, dll.emu_launch_serial):
        launch.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
        launch.restype = ctypes.c_int
    _built[key] = dll
    return dll


def _launch(dll, name: str, tensors: list, grid_x: int, grid_y: int, threads: int, streams: list) -> None:
    # the kernel's parameters: its operands' pointers, then its dropout streams by value (the
    # trampoline casts each slot to its parameter's type)
    # what the code generator reports for the launch must fit what the kernel declares: a block no
    # bigger than its __launch_bounds__ (a GPU refuses the launch), one argument per parameter
    bound, n_params, alone = dll.declared[name]
    assert threads <= bound, f"{name}: launched with {threads} threads, declared __launch_bounds__({bound})"
    assert len(tensors) + len(streams) == n_params, f"{name}: {len(tensors) + len(streams)} arguments, {n_params} parameters"
    args = (ctypes.c_void_p * (len(tensors) + len(streams)))(*[t.data_ptr() for t in tensors], *streams)
    fn = ctypes.cast(getattr(dll, f"emu_{name}"), ctypes.c_void_p)
    rc = (dll.emu_launch_serial if alone else dll.emu_launch)(fn, args, grid_x, grid_y, threads)
    assert rc == 0, f"emu_launch({name}) returned {rc}"


def _grid(blocks: int, threads: int, sm_count: int) -> int:
    return max(1, min(blocks, sm_count * (2048 // threads)))  # runtime.c grid_for


def _same_strides(t: torch.Tensor, meta) -> bool:
    """Whether a kernel addressing with meta's strides reads t's elements: the strides of the dims
    longer than 1 agree (as the runtime's operand check, bridge.c check_one; a size-1 dim's stride
    is never used, and an empty tensor is read nowhere)."""
    return t.numel() <= 1 or all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), meta.stride()))


def _stored(t: torch.Tensor, sizes, strides, offset: int) -> torch.Tensor:
    """t's elements in logical order (reshaped, or already of `sizes`) in a fresh storage with the given
    strides and offset; the storage's other elements NaN (zero for integers)."""
    extent = offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides)) if all(sizes) else offset
    buf = torch.full((extent,), float("nan")) if t.dtype.is_floating_point else torch.zeros(extent)
    return torch.as_strided(buf.to(t.dtype), sizes, strides, offset).copy_(t.reshape(sizes))


_CONVERSIONS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _precision(node, want):
    """The dtype whose tolerance an output is compared at: its own, or, for a conversion of a 16-bit
    value to a wider type, the 16-bit one's (the wider copy holds no more than that value: a float32
    difference that rounds the 16-bit value the other way is one 16-bit unit apart in both)."""
    if want is None or not isinstance(node, fx.Node) or node.target not in _CONVERSIONS:
        return getattr(want, "dtype", None)
    src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    low = getattr(src, "dtype", None)
    return low if low in (torch.float16, torch.bfloat16) else want.dtype


def _planned(gm: fx.GraphModule):
    """gm's graph for cuda:0 as a program plans it: (the build, the rewritten graph or None, origins):
    copies and reads of views computed from their sources (`_C.sink_copies`, as the AOTFUSE_*
    switches say)."""
    b = build_graph(gm, device="cuda:0")
    sunk, origin = (_C.sink_copies(b.graph, devices="cuda", reads=config.sink_reads()) if config.sink_copies()
                    else (None, None))
    return b, sunk, origin


def source_of(gm: fx.GraphModule, sm_count: int = 1) -> str:
    """The CUDA source a program would compile for gm's CUDA groups."""
    b, sunk, _origin = _planned(gm)
    return _C.cuda_codegen(sunk or b.graph, sm_count=sm_count, window_sources=config.window_sources(),
                           merge=config.merge_kernels())[0]


def eager_values(gm: fx.GraphModule, args) -> dict:
    """Every FX node's eager value (node -> tensor or tuple)."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.run(*args)
    return interp.env


class _Reshaped(str):
    """The name of a value build_graph made by reshaping an FX node's (swapping a reshape and a
    conversion), with the node and the shape, so that `check` can reshape the node's float64 value."""

    def __new__(cls, node, shape):
        self = super().__new__(cls, f"{node} reshaped")
        self.node, self.shape = node, tuple(shape)
        return self


def run_groups(gm: fx.GraphModule, args, sm_count: int = 1, vectorized: bool | None = None):
    """Plans gm for cuda:0 as a program would (copies of views computed from their sources:
    `_C.sink_copies`), runs every CUDA group in the emulation on eager's input values and yields
    (group index, launch facts, [(FX node or a name, emulated, eager)] per output). vectorized:
    None launches as the runtime would, True/False forces the variant (where it exists)."""
    b, sunk, origin = _planned(gm)
    source, launches = _C.cuda_codegen(sunk or b.graph, sm_count=sm_count, window_sources=config.window_sources(),
                           merge=config.merge_kernels())
    dll = _library(source)
    env = eager_values(gm, args)

    def node_of(vid):
        node = b.value_nodes[vid]
        assert node is not None, f"value {vid} has no single FX node"
        return node

    def built_value(vid):  # (eager value, graph meta) of a value of build_graph's graph
        if vid in b.derived:  # a value build_graph made swapping a reshape and a conversion
            x, shape = b.derived[vid]
            return env[x].reshape(shape), x.meta["val"].reshape(shape)
        return env[node_of(vid)], node_of(vid).meta.get("val")

    # the sink's views of sources (as_strided over a source's storage, standing for the source)
    source_views = {int(v) for v in re.findall(r"%v(\d+):[^\n=]*= aten::as_strided\.default\(", str(sunk))} if sunk else set()

    made = {}  # emulated outputs of values no FX node stands for (a recompute one kernel stores for another)

    def value_of(vid):  # (eager value, graph meta) of a value of the graph planned
        if sunk is None:
            return built_value(vid)
        if origin[vid] < 0:  # no eager value: the earlier kernel's own, or (as an output) none
            dtype, sizes, strides, _offset = sunk.value_meta(vid)
            layout = torch.empty_strided(sizes, strides, dtype=getattr(torch, dtype), device="meta")
            return made.get(vid), layout
        t, meta = built_value(origin[vid])
        dtype, sizes, strides, offset = sunk.value_meta(vid)
        if (tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()) == (sizes, strides, offset):
            return t, meta
        layout = torch.empty_strided(sizes, strides, dtype=meta.dtype, device="meta")
        if vid in source_views:  # a source's as_strided view: the same storage, read another way
            # (the graph's storage: eager's elements laid out as the graph's metadata says, where
            # eager's own layout differs)
            same = (t.stride(), t.storage_offset()) == (meta.stride(), meta.storage_offset())
            src = t if same else _stored(t, tuple(meta.shape), meta.stride(), meta.storage_offset())
            return torch.as_strided(src, sizes, strides, offset), layout
        # a value computed in another layout (a copy or a read over a finer shape, a split reader,
        # a broadcast read over the reader's larger shape): the old value's elements in order (or
        # broadcast), stored with the new strides
        return _stored(t if t.numel() == math.prod(sizes) else t.broadcast_to(sizes), sizes, strides, offset), layout

    for gi, l in enumerate(launches):
        if l["kind"] == "none":
            continue
        ins, mismatch = [], None
        for vid in l["inputs"]:
            t, meta = value_of(vid)
            if t is None:  # a recompute an extern call or a skipped group made: no value to give
                mismatch = f"input {vid}: made by no emulated kernel"
            elif meta is not None and isinstance(t, torch.Tensor) and not _same_strides(t, meta):
                mismatch = f"input {vid}: eager strides {t.stride()}, graph {meta.stride()}"
            ins.append(t)
        if mismatch:  # AOTAutograd's meta can disagree with ATen's view; the runtime then runs this group's nodes as ATen calls
            yield gi, {**l, "skipped": mismatch}, []
            continue
        expected = [value_of(vid) for vid in l["outputs"]]
        outs = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype) for _, m in expected]
        for o in outs:  # poison: an element the kernel forgets to write cannot pass
            if o.dtype.is_floating_point:
                o.fill_(float("nan"))
        ops = ins + outs
        name = f"af_kernel_{l['body']}"  # an earlier group's kernels where this group's code is the same
        if l["split"]:  # two passes: columns, split rows
            ws = torch.full((l["workspace"] // 8,), float("nan"), dtype=torch.float64)
            _launch(dll, name, [ws] + ops, _grid(l["blocks"], l["threads"], sm_count), l["split"], l["threads"], l["streams"])
            _launch(dll, name + "_f", [ws] + ops, _grid(l["finish_blocks"], 256, sm_count), 1, 256, l["streams"])
        else:
            aligned = l["vec_blocks"] > 0 and all(t.data_ptr() % 16 == 0 for t in ops)
            use_v = aligned if vectorized is None else (vectorized and l["vec_blocks"] > 0)
            if use_v:
                assert aligned, f"group {gi}: the vectorized variant asked for unaligned operands"
            blocks = l["vec_blocks"] if use_v else l["blocks"]
            _launch(dll, name + ("_v" if use_v else ""), ops, _grid(blocks, l["threads"], sm_count), 1, l["threads"], l["streams"])
        built = [vid if sunk is None else origin[vid] for vid in l["outputs"]]
        names = [f"v{vid} (no FX node)" if bv < 0 else b.value_nodes[bv] if bv not in b.derived
                 else _Reshaped(*b.derived[bv]) for vid, bv in zip(l["outputs"], built)]
        nodes = [None if bv < 0 else b.value_nodes[bv] if bv not in b.derived else b.derived[bv][0] for bv in built]
        for vid, o in zip(l["outputs"], outs):
            if sunk is not None and origin[vid] < 0:
                made[vid] = o
        # outputs with no eager value (want None): checked only through the groups that read them
        yield gi, {**l, "made": [vid for vid, (e, _) in zip(l["outputs"], expected) if e is None]}, \
            [(n, o, e, _precision(node, e)) for n, node, o, (e, _) in zip(names, nodes, outs, expected)]


class Checked(list):
    """The launches `check` ran, with what it did not compare: `skipped`, [(group, why)] for the groups
    whose inputs eager lays out otherwise (the runtime runs their nodes as ATen calls); `unchecked`,
    the values no FX node stands for (a recompute one kernel stores for another) that no group that
    ran read, so that nothing compared them with eager, even indirectly; `rounding`, [(group, output,
    emulated's and eager's max distance to float64)] for outputs past the tolerance that the float64
    criterion passed (`_rounding_only`)."""

    def __init__(self):
        super().__init__()
        self.skipped: list[tuple[int, str]] = []
        self.unchecked: list[int] = []
        self.rounding: list[tuple[int, str, float, float]] = []


_LOW = (torch.float32, torch.float16, torch.bfloat16)


def float64_values(gm: fx.GraphModule, args) -> dict | None:
    """Every FX node's value with the graph run in float64: floating inputs widened, and every dtype
    argument of a lower float precision (conversions, factories) made float64, so no node rounds
    below it. None where the graph cannot run so (an op without a float64 kernel)."""
    def wide(x):
        if isinstance(x, torch.Tensor) and x.dtype in _LOW:
            return x.double()
        return torch.float64 if isinstance(x, torch.dtype) and x in _LOW else x

    class Wide(fx.Interpreter):
        def run_node(self, n):
            with self._set_current_node(n):
                a, k = self.fetch_args_kwargs_from_env(n)
                if n.op in ("call_function", "call_method"):
                    a, k = fx.node.map_aggregate(a, wide), fx.node.map_aggregate(k, wide)
                return getattr(self, n.op)(n.target, a, k)

    try:
        interp = Wide(gm, garbage_collect_values=False)
        interp.run(*[wide(a) for a in args])
        return interp.env
    except Exception:  # noqa: BLE001 - no reference: the tolerance alone decides
        return None


def _rounding_only(got: torch.Tensor, want: torch.Tensor, ref, precision) -> tuple[float, float] | None:
    """testing.py's float64 criterion for an output past the tolerance: (emulated's, eager's max
    distance to float64) where the emulated value is within 4x eager's distance (plus a floor of
    max(2 eps, atol / 10) of the largest value) and eager itself is no closer to float64 than the
    tolerance, or both are within it on either side; else None (a wrong value, or no reference)."""
    if not isinstance(ref, torch.Tensor) or ref.shape != want.shape or precision not in _LOW:
        return None
    r, c, e = ref.double(), got.double(), want.double()
    if not bool(torch.isfinite(r).all()):
        return None
    atol, rtol = TOLERANCES[precision]
    err_c, err_e = float((c - r).abs().max()), float((e - r).abs().max())
    floor = max(2 * torch.finfo(precision).eps, atol / 10) * float(r.abs().max())
    bound = atol + rtol * r.abs()
    if err_c > 4 * err_e + floor:
        return None
    if bool(((e - r).abs() <= bound).all()) and not bool(((c - r).abs() <= bound).all()):
        return None  # eager is within the tolerance of float64 and the emulation is not
    return err_c, err_e


def check(gm: fx.GraphModule, args, what: str = "", **kw) -> Checked:
    """Asserts every emulated group output equals eager's within its dtype's tolerance (a wider copy of
    a 16-bit value: the 16-bit dtype's; NaN where eager has NaN), or, past it, that the float64
    criterion finds only rounding (the graph run in float64: `_rounding_only`; a batch norm's gradient
    sums that cancel leave eager and the kernel equally far from float64); returns the launches that
    ran (a `Checked`, which also says what was not compared and what passed as rounding)."""
    ran, made, read = Checked(), [], set()
    wide: list = []  # the float64 values, made at the first output past the tolerance
    for gi, l, results in run_groups(gm, args, **kw):
        if "skipped" in l:
            ran.skipped.append((gi, l["skipped"]))
            continue
        ran.append(l)
        made += l["made"]
        read.update(l["inputs"])
        for node, got, want, precision in results:
            if want is None:
                continue
            atol, rtol = TOLERANCES.get(precision, (1e-5, 1e-4))
            try:
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True,
                                           msg=lambda m, n=node, g=gi, k=l["kind"]: f"{what} group {g} ({k}) output {getattr(n, 'name', n)}: {m}")
            except AssertionError as e:
                if not wide:
                    wide.append(float64_values(gm, args))
                ref = None
                if wide[0] is not None and isinstance(node, fx.Node):
                    ref = wide[0].get(node)
                elif wide[0] is not None and isinstance(node, _Reshaped) and isinstance(wide[0].get(node.node), torch.Tensor):
                    ref = wide[0][node.node].reshape(node.shape)
                errs = None if ref is None else _rounding_only(got, want, ref, precision)
                if errs is None:
                    raise AssertionError(f"{e}\n(float64 criterion: " + ("no float64 value)" if ref is None else
                                         f"emulated {float((got.double() - ref.double()).abs().max()):.3g} from "
                                         f"float64, eager {float((want.double() - ref.double()).abs().max()):.3g})")) from None
                ran.rounding.append((gi, getattr(node, "name", str(node)), *errs))
    ran.unchecked = [vid for vid in made if vid not in read]
    return ran


@contextlib.contextmanager
def recording_programs():
    """Within it, every program aotfuse lowers (one capture or Dynamo's pieces) is recorded with the
    real inputs of its first run: yields the list of (FX graph, inputs) it fills."""
    from unittest import mock

    from aotfuse import compile as compile_mod, dynamo as dynamo_mod, lower as lower_mod

    graphs, runs = {}, []
    lower, call = lower_mod.lower, lower_mod.Lowered.__call__

    def lowering(gm, example_inputs=None, saved_from=None, lazy=False):
        low = lower(gm, example_inputs, saved_from, lazy=lazy)
        graphs[id(low)] = (low, gm)
        return low

    def calling(self, args):
        # a backward without some output gradients (None) runs a variant program, recorded itself
        if id(self) in graphs and all(a is not None for a in args) and not any(low is self for low, _gm, _a in runs):
            runs.append((self, graphs[id(self)][1], list(args)))  # references: the program may drop its own
        return call(self, args)

    out: list = []
    with mock.patch.object(compile_mod, "lower", lowering), mock.patch.object(dynamo_mod, "lower", lowering), \
            mock.patch.object(lower_mod, "lower", lowering), mock.patch.object(lower_mod.Lowered, "__call__", calling):
        yield out
    out.extend((gm, args) for _low, gm, args in runs)
