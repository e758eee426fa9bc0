"""aotfuse's random numbers: a counter-based generator that fused kernels evaluate per element.

Dropout decomposes (decompositions.py) into an 8-byte seed drawn from torch's generator
(`aten.randint`, so `torch.manual_seed` makes runs repeatable) and `aotfuse::rng_uniform(seed,
size)`: uniform floats on [0, 1], element i (row-major) being Philox4x32-10 of counter i under
the seed as key (the generator text is in csrc/codegen_common.c). The numbers are a pure function
of the seed, so the op is pointwise for the partitioner and the fuser: the mask is computed inside
the kernel that applies it and recomputed in the backward from the saved seed, never stored.

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


def _program(size: tuple, device: torch.device):
    key = (size, str(device))
    prog = _programs.get(key)
    if prog is None:
        from . import _C
        from .lower import _add_nvrtc_search_dirs, build_graph

        g = fx.Graph()
        seed = g.placeholder("seed")
        seed.meta["val"] = torch.empty((), dtype=torch.int64, device=device)
        out = g.call_function(torch.ops.aotfuse.rng_uniform.default, (seed, list(size)))
        out.meta["val"] = torch.empty(size, dtype=torch.float32, device=device)
        g.output(out)
        _add_nvrtc_search_dirs()
        prog = _C.Program(build_graph(fx.GraphModule({}, g)).graph, fuse=True, devices="all")
        with _lock:
            prog = _programs.setdefault(key, prog)
    return prog


@torch.library.custom_op("aotfuse::rng_uniform", mutates_args=())
def rng_uniform(seed: torch.Tensor, size: list[int]) -> torch.Tensor:
    """Uniform floats on [0, 1] of shape `size` on seed's device; seed: an int64 0-dim tensor."""
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(f"aotfuse::rng_uniform: the seed must be an int64 0-dim tensor, got {seed.dtype}{list(seed.shape)}")
    return _program(tuple(int(s) for s in size), seed.device).run([seed.contiguous()])[0]


@rng_uniform.register_fake
def _(seed: torch.Tensor, size: list[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32, device=seed.device)
