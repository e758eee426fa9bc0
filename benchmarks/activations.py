"""Activations and losses ATen runs as one kernel each, in an MLP block's training step: eager, aotfuse and
torch.compile side by side in one process, on the CPU, with ratios to eager's step time and peak memory.

Each row is x + fc2(act(fc1(x))) over [batch x tokens, dim] with a hidden width of 4 x dim, and a loss:
the mean square against a target for the activations (ELU, SELU, softplus, Mish, log-sigmoid,
hardswish, leaky ReLU, softsign, sin as in Fourier features), the loss itself for the losses (binary
cross entropy with logits, smooth L1, Huber, Poisson NLL) on fc2's output after a GELU. Since
2026-12-06 aotfuse decomposes these (decompositions._ACTIVATIONS) so that they fuse with the bias adds
and the loss around them, and its C kernels' exp, log1p, expm1, tanh and sin are vectorized
polynomials. Measured as benchmarks/families.py measures (its run_built: medians of --steps steps,
contenders interleaved, one step's peak CPU allocation, the loss check against eager's).

    python benchmarks/activations.py [--dtype fp32|bf16] [--steps 20] [--threads 1] [--dim 256]
                                     [--tokens 2048] [--cases elu,mish,...] [--out FILE.md]
                                     [--contenders eager,aotfuse,aotfuse-aten,torch.compile]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402
from families import row_or_error, run_built, write_table  # noqa: E402

import aotfuse  # noqa: E402

Output = collections.namedtuple("Output", ["loss"])

ACTIVATIONS = {
    "elu": F.elu, "selu": F.selu, "softplus": F.softplus, "mish": F.mish, "logsigmoid": F.logsigmoid,
    "hardswish": F.hardswish, "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "softsign": F.softsign,
    "sin": torch.sin,
}
LOSSES = {
    "bce_logits": lambda y, t: F.binary_cross_entropy_with_logits(y, torch.sigmoid(t)),
    "smooth_l1": lambda y, t: F.smooth_l1_loss(y, t, beta=0.5),
    "huber": lambda y, t: F.huber_loss(y, t, delta=0.5),
    "poisson_nll": lambda y, t: F.poisson_nll_loss(y, t.abs()),
}


class Block(nn.Module):
    def __init__(self, dim: int, act, loss):
        super().__init__()
        self.fc1, self.fc2, self.act, self.loss = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), act, loss

    def forward(self, x, target):
        y = x + self.fc2(self.act(self.fc1(x)))
        return Output(self.loss(y, target))


@contextlib.contextmanager
def _aten_activations():
    before = os.environ.get("AOTFUSE_DECOMPOSE_ACTIVATIONS")
    os.environ["AOTFUSE_DECOMPOSE_ACTIVATIONS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AOTFUSE_DECOMPOSE_ACTIVATIONS"]
        else:
            os.environ["AOTFUSE_DECOMPOSE_ACTIVATIONS"] = before


def _compile(name: str, contender: str, model: nn.Module):
    """families' contenders, and aotfuse-aten: aotfuse with ATen's activation and loss kernels
    (AOTFUSE_DECOMPOSE_ACTIVATIONS=0 while it is wrapped and called)."""
    if contender != "aotfuse-aten":
        return families_compile(name, contender, model)
    with _aten_activations():
        compiled = aotfuse.memory_efficient_fusion(model)

    def call(**inputs):
        with _aten_activations():
            return compiled(**inputs)
    call.compiled = compiled
    return call


families_compile, families._compile = families._compile, _compile


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join([*ACTIVATIONS, *LOSSES]))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--contenders", default="eager,aotfuse,torch.compile",
                    help="of eager, aotfuse, aotfuse-aten (ATen's activation kernels: AOTFUSE_DECOMPOSE_ACTIVATIONS=0), torch.compile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    contenders = args.contenders.split(",")
    rows = []
    for name in args.cases.split(","):
        torch._dynamo.reset()
        torch.manual_seed(0)
        act, loss = (ACTIVATIONS[name], F.mse_loss) if name in ACTIVATIONS else (F.gelu, LOSSES[name])
        base = Block(args.dim, act, loss).to(dtype)
        g = torch.Generator().manual_seed(1)
        inputs = {"x": torch.randn(args.tokens, args.dim, generator=g).to(dtype),
                  "target": torch.randn(args.tokens, args.dim, generator=g).to(dtype)}
        rows.append(row_or_error(name, contenders, lambda: run_built(name, base, inputs, dtype, contenders, args.steps)))
    write_table(rows, contenders, args.threads, f"{args.dtype} | [{args.tokens}, {args.dim}] -> [{args.tokens}, "
                f"{4 * args.dim}] | {args.steps} steps", args.out)


if __name__ == "__main__":
    main()
