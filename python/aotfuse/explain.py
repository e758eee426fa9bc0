"""aotfuse.explain: what aotfuse makes of a function or module, for one set of inputs."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.nn as nn

__all__ = ["explain", "Explanation"]


@dataclasses.dataclass
class Explanation:
    """A report on one compiled signature. print() it for a readable summary."""

    forward_nodes: int
    backward_nodes: int
    extern_ops: dict[str, int]  # op name -> ATen calls, forward and backward together
    views: dict[str, int]       # op name -> views that make no ATen call (folded into kernels, or reinterpreted)
    fused_kernels: int          # kernels launched per forward+backward
    saved_bytes: int            # bytes the forward saves for the backward
    saved: list[tuple[str, tuple, str, int]]  # (name, shape, dtype, bytes) of each saved value
    recomputed: list[str]       # forward nodes the backward recomputes (min-cut partition)
    forward_program: str
    backward_program: str
    shape_family: str = ""      # how a shape family served this signature (shapes.py), or ""

    def __str__(self) -> str:
        lines = [
            "aotfuse explain",
            f"  forward program:  {self.forward_nodes} nodes",
            f"  backward program: {self.backward_nodes} nodes",
            f"  fused kernels:    {self.fused_kernels}",
            f"  extern calls:     {sum(self.extern_ops.values())} ({len(self.extern_ops)} distinct ops)",
            f"  views without an ATen call: {sum(self.views.values())} (folded into kernels or reinterpreted)",
            f"  saved for backward: {len(self.saved)} tensors, {self.saved_bytes} bytes",
        ]
        for name, shape, dtype, nbytes in self.saved:
            lines.append(f"    {name}: {dtype}{list(shape)} {nbytes} B")
        lines.append(f"  recomputed in backward: {len(self.recomputed)} nodes"
                     + (f" ({', '.join(self.recomputed)})" if self.recomputed else ""))
        if self.shape_family:
            lines.append(f"  shape family: {self.shape_family}")
        lines.append("  extern ops:")
        for op, n in sorted(self.extern_ops.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"    {n:5d}  {op}")
        return "\n".join(lines)


def explain(fn_or_module: Callable | nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """Compiles `fn_or_module` for these inputs (running it once, forward only) and reports on it.

    Example:
        >>> print(aotfuse.explain(model, x))
    """
    from .compile import AOTModule, CompiledFunction, memory_efficient_fusion

    compiled = fn_or_module
    if not isinstance(compiled, (AOTModule, CompiledFunction)):
        compiled = memory_efficient_fusion(fn_or_module)
    cf = compiled._aotfuse_compiled if isinstance(compiled, AOTModule) else compiled
    before = {id(r) for r in cf.records}
    compiled(*args, **kwargs)
    records = cf.records
    fresh = [r for r in records if id(r) not in before]
    if not fresh and not records:
        raise RuntimeError("aotfuse.explain: the function ran eagerly (disabled, or a fallback); nothing to explain")
    record = (fresh or records)[-1]
    fw = record.programs.get("forward") or record.programs.get("inference")
    bw = record.programs.get("backward")
    family, how = getattr(cf.last_entry, "family", None), ""
    saved, saved_bytes = list(record.saved), record.saved_bytes
    if family is not None and family.stages and not family.failed:
        # a family's record holds the programs of the shape it made last: take this call's own
        stage = family.stages.get("forward") or family.stages.get("inference")
        vals = stage.last_vals if stage is not None else {}
        fw = stage.program_at(vals) if stage is not None else fw
        bw = family.stages["backward"].program_at(vals) if "backward" in family.stages and bw is not None else bw
        if "forward" in family.stages:  # what this shape saves (the record has the traced shape's)
            from .shapes import saved_at

            saved = saved_at(family.stages["forward"].gm, record.num_fwd_outputs, vals)
            saved_bytes = sum(b for *_, b in saved)
        sizes = ", ".join(f"{s}={v}" for s, v in sorted(vals.items(), key=lambda kv: str(kv[0])))
        how = (f"{'joined' if cf.last_entry.member else 'traced'} one symbolic trace ({sizes}; "
               f"symbolic dims by input: {dict(sorted((i, sorted(d)) for i, d in family.dims.items()))})")
    counts: dict[str, int] = {}
    views: dict[str, int] = {}
    for prog in (fw, bw):
        for op, n in (prog.extern_counts() if prog else {}).items():
            counts[op] = counts.get(op, 0) + n
        for op, n in (prog.view_counts() if prog else {}).items():
            views[op] = views.get(op, 0) + n
    return Explanation(
        forward_nodes=fw.program.num_nodes if fw else 0,
        backward_nodes=bw.program.num_nodes if bw else 0,
        extern_ops=counts,
        views=views,
        fused_kernels=sum(p.program.num_kernels for p in (fw, bw) if p),
        saved_bytes=saved_bytes if bw else 0,
        saved=saved if bw else [],
        recomputed=list(record.recomputed) if bw else [],
        forward_program=str(fw) if fw else "",
        backward_program=str(bw) if bw else "",
        shape_family=how,
    )
