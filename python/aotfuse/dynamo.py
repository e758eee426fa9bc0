"""torch.compile(model, backend="aotfuse"): Dynamo captures graphs (splitting them where Python
cannot be captured), aotfuse compiles each one. Registered through the torch_dynamo_backends
entry point; `import aotfuse` also registers it."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from .compile import _no_zero_gradients
from .decompositions import default_decompositions
from .lower import Lowered, UnsupportedError, lower
from .partition import min_cut_rematerialization_partition

__all__ = ["aotfuse_backend"]


def _compile_or_fallback(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], saved_from: int | None = None):
    try:
        return lower(gm, example_inputs, saved_from)
    except UnsupportedError as e:
        # Dynamo graphs can carry what the core does not take (symbolic shapes after a
        # recompile, say): that graph runs as torch's own FX code, correctly.
        warnings.warn(f"aotfuse: a Dynamo graph runs uncompiled: {e}", stacklevel=2)
        from torch._functorch.aot_autograd import make_boxed_func

        return make_boxed_func(gm.forward)


def aotfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], collect: list | None = None,
                    **kwargs: Any):
    """The Dynamo backend. Example: torch.compile(model, backend="aotfuse", dynamic=False).
    Each graph is partitioned by the C core's min-cut (as memory_efficient_fusion does). `collect`
    (through functools.partial) receives every lowered program as (stage, Lowered), for profiling."""
    state: dict[str, int] = {}

    def _keep(stage: str, low: Any) -> Any:
        if collect is not None and isinstance(low, Lowered):
            collect.append((stage, low))
        return low

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any):
        state["num_fwd_outputs"] = kw.get("num_fwd_outputs", 0)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw)

    def forward(fw: torch.fx.GraphModule, inputs: Sequence[Any]):
        low = _compile_or_fallback(fw, inputs, state.get("num_fwd_outputs"))
        if isinstance(low, Lowered) and "num_fwd_outputs" in state:  # saved activations may be plain views
            low.program.set_plain_outputs(low.program_outputs_before(state["num_fwd_outputs"]))
        return _keep("forward", low)

    def backward(bw: torch.fx.GraphModule, inputs: Sequence[Any]):
        low = _compile_or_fallback(bw, inputs)
        if isinstance(low, Lowered):  # gradients may be plain views; missing ones run a variant
            low.program.set_plain_outputs(0)
            low.keep_graph_for_missing(bw)
        return _keep("backward", low)

    compiled = aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=forward,
        bw_compiler=backward,
        inference_compiler=lambda g, i: _keep("inference", _compile_or_fallback(g, i)),
        partition_fn=partition,
        decompositions=default_decompositions(),
    )

    @functools.wraps(compiled)  # same calling convention (boxed or not) and attributes
    def run(*args: Any) -> Any:
        outs = compiled(*args)
        _no_zero_gradients(outs)  # outputs nobody differentiates get no dense zero gradient
        return outs

    return run


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "aotfuse" not in _BACKENDS:
        register_backend(name="aotfuse")(aotfuse_backend)
