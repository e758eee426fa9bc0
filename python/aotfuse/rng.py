"""aotfuse's random numbers: a counter-based generator that fused kernels evaluate per element.

Dropout decomposes (decompositions.py) into an 8-byte seed drawn from torch's generator
(`aten.randint`, so `torch.manual_seed` makes runs repeatable) and `aotfuse::rng_uniform(seed,
size, stream=0)`: uniform floats on [0, 1] (the float rounding of words near 2^32 gives 1.0), element i (row-major) being the first word of
Threefry-2x32-20 of counter i under the key seed + stream (the generator text is in
csrc/codegen_common.c), times 2^-32. The numbers are a pure function of the seed, so the op is
pointwise for the partitioner and the fuser: the mask is computed inside the kernel that applies
it and recomputed in the backward from the saved seed, never stored.

share_seeds() gives every dropout of a graph the one seed its first dropout draws, each on its own
stream (key), so a 12-layer model draws one seed per step instead of 36 (an ATen call and a
saved tensor each).

The masks differ from eager's (another generator); AOTFUSE_FALLBACK_RANDOM=1 keeps ATen's dropout
and its exact masks. The op's own implementation (used when it runs outside a fused kernel) is a
one-node program of the C core, so every path computes the same bits.
"""
from __future__ import annotations

import threading

import torch
import torch.fx as fx

__all__ = ["rng_uniform"]

_programs: dict = {}
_lock = threading.Lock()


def _program(size: tuple, device: torch.device, stream: int):
    key = (size, str(device), stream)
    prog = _programs.get(key)
    if prog is None:
        from . import _C
        from .lower import _add_nvrtc_search_dirs, build_graph

        g = fx.Graph()
        seed = g.placeholder("seed")
        seed.meta["val"] = torch.empty((), dtype=torch.int64, device=device)
        out = g.call_function(torch.ops.aotfuse.rng_uniform.default, (seed, list(size), stream) if stream else (seed, list(size)))
        out.meta["val"] = torch.empty(size, dtype=torch.float32, device=device)
        g.output(out)
        _add_nvrtc_search_dirs()
        prog = _C.Program(build_graph(fx.GraphModule({}, g)).graph, fuse=True, devices="all")
        with _lock:
            prog = _programs.setdefault(key, prog)
    return prog


@torch.library.custom_op("aotfuse::rng_uniform", mutates_args=())
def rng_uniform(seed: torch.Tensor, size: list[int], stream: int = 0) -> torch.Tensor:
    """Uniform floats on [0, 1] of shape `size` on seed's device; seed: an int64 0-dim tensor;
    stream: added to the seed as the generator's key (0 <= stream < 2^31)."""
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(f"aotfuse::rng_uniform: the seed must be an int64 0-dim tensor, got {seed.dtype}{list(seed.shape)}")
    if not 0 <= stream < 2**31:
        raise ValueError(f"aotfuse::rng_uniform: stream must be in [0, 2^31), got {stream}")
    return _program(tuple(int(s) for s in size), seed.device, int(stream)).run([seed.contiguous()])[0]


@rng_uniform.register_fake
def _(seed: torch.Tensor, size: list[int], stream: int = 0) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32, device=seed.device)


def _is_seed(node: fx.Node, high: int) -> bool:
    """A dropout's seed draw (decompositions._native_dropout) read only by rng_uniform nodes as
    their seed, without a stream yet."""
    if node.op != "call_function" or node.target is not torch.ops.aten.randint.low or tuple(node.args[:3]) != (0, high, []):
        return False
    return bool(node.users) and all(
        u.op == "call_function" and u.target is torch.ops.aotfuse.rng_uniform.default and u.args[0] is node
        and len(u.args) == 2 and not u.kwargs for u in node.users)


def share_seeds(gm: fx.GraphModule) -> int:
    """Rewrites gm in place so that its dropouts share the first one's seed, each on a stream of its
    own (stream k for the k-th seed draw per device); returns how many draws were removed. A seed
    the graph returns (saved for a backward) is left alone; call this on the joint graph."""
    from .decompositions import _SEED_HIGH

    first: dict = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if not _is_seed(node, _SEED_HIGH):
            continue
        device = node.kwargs.get("device")
        if device not in first:
            first[device] = [node, 0]
            continue
        keep = first[device]
        keep[1] += 1
        for user in list(node.users):
            user.args = (keep[0], user.args[1], keep[1])
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        gm.recompile()
    return removed
