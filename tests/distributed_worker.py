"""Two-process DistributedDataParallel checks on the CPU (gloo), launched by tests/test_distributed.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py OUT.json

Every rank runs every case; rank 0 writes one JSON object, case name -> what the test asserts on:
- "mismatches": (what, max abs difference) of each parameter's gradient, buffer, loss and output where the
  aotfuse run differs from eager DDP on the same rank beyond the seed's fp32 tolerances;
- "ranks_disagree": gradients that differ between the ranks after a synced backward (a lost all-reduce);
- "err" and "eager_err": the largest gradient difference from a float64 single-process computation of the
  same step on both ranks' batches (what DDP's averaged gradient is), aotfuse's and eager DDP's;
- "compiled": signatures (memory_efficient_fusion) or programs (torch.compile) aotfuse compiled (0 would
  mean it ran eagerly; under torch.compile a forward and a backward per DDP bucket);
- "error": for the cases that must refuse, the exception's type and message;
- "all_reduces", "overlapped": for memory_efficient_fusion(DDP(model)), the all-reduce calls in the
  synced backward program and how many of them are followed by more of the backward's computation.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ATOL, RTOL  # noqa: E402

import aotfuse  # noqa: E402
from aotfuse.dynamo import aotfuse_backend  # noqa: E402

FEATURES, BATCH = 12, 8


class Mlp(nn.Module):
    """Linear, batch norm (buffers DDP broadcasts), GELU, layer norm, Linear; with `extra`, one more Linear
    used only when a call asks (find_unused_parameters)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 24)
        self.bn = nn.BatchNorm1d(24)
        self.ln = nn.LayerNorm(24)
        self.b = nn.Linear(24, 4)
        self.extra = nn.Linear(4, 4) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        y = self.b(self.ln(torch.nn.functional.gelu(self.bn(self.a(x)))))
        return self.extra(y) if use_extra else y


def _loss(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out.square().mean()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=RTOL)


class Case:
    """One model, stepped through `wrap(model)` and through eager DDP (each with SGD), the float64 reference
    in one process on every rank's batch."""

    def __init__(self, make, batches, wrap, ddp_kwargs=None, counter=None, no_sync_every: int = 0,
                 env: dict | None = None, prepare=None, count_reducer: bool = False) -> None:
        self.make, self.batches, self.wrap = make, batches, wrap
        self.count_reducer = count_reducer  # count the calls DDP's reducer was prepared to all-reduce
        self.ddp_kwargs = ddp_kwargs or {}
        self.counter, self.no_sync_every = counter, no_sync_every
        self.env = env or {}
        self.prepare = prepare  # applied to the model and eager DDP's copy of it (hooks)

    def run(self, rank: int, world: int) -> dict:
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            return self._run(rank, world)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _run(self, rank: int, world: int) -> dict:
        torch.manual_seed(0)
        model = self.make()
        eager_model, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
        if self.prepare is not None:
            self.prepare(model, rank)
            self.prepare(eager_model, rank)
        fused = self.wrap(model, self.ddp_kwargs)
        eager = DDP(eager_model, **self.ddp_kwargs)
        prepared = [0]
        if self.count_reducer:
            wrapper = fused.orig_module if isinstance(fused, aotfuse.AOTDataParallel) else fused
            wrapper.reducer = _CountingReducer(wrapper.reducer, prepared)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager_model, ref64)]
        mismatches, disagree, err, eager_err = [], [], 0.0, 0.0
        pending = 0  # collectives not waited for when aotfuse's backward returned
        for step, (args, kwargs) in enumerate(self.batches(rank)):
            sync = not self.no_sync_every or (step + 1) % self.no_sync_every == 0
            losses = []
            for wrapped in (fused, eager):
                with contextlib.nullcontext() if sync else wrapped.no_sync():
                    losses.append(_loss(wrapped(*args, **kwargs)))
                    losses[-1].backward()
                if wrapped is fused:
                    pending = max(pending, torch._C._distributed_c10d._get_work_registry_size())
            if not _close(losses[0].detach(), losses[1].detach()):
                mismatches.append((f"step {step}: loss", (losses[0] - losses[1]).abs().max().item()))
            # float64: every rank's batch in one process, the mean of the ranks' losses (DDP's average
            # at a synced step, of the gradients accumulated since the last one)
            everyone = [self._gathered(args, kwargs, r, world) for r in range(world)]
            (sum(_loss(ref64(*a, **k)) for a, k in everyone) / world).backward()
            eager_params = dict(eager_model.named_parameters())
            for (name, p), q in zip(model.named_parameters(), ref64.parameters()):
                e = eager_params[name]
                if (p.grad is None) != (e.grad is None):
                    mismatches.append((f"step {step}: grad of {name} is None on one side", 0.0))
                    continue
                if p.grad is None:
                    continue
                if not _close(p.grad, e.grad):
                    mismatches.append((f"step {step}: grad of {name}", (p.grad - e.grad).abs().max().item()))
                if sync:
                    ranks = [torch.empty_like(p.grad) for _ in range(world)]
                    dist.all_gather(ranks, p.grad.contiguous())
                    if any(not torch.equal(r, ranks[0]) for r in ranks[1:]):
                        disagree.append(f"step {step}: grad of {name}")
                    if q.grad is not None:
                        err = max(err, (p.grad.double() - q.grad).abs().max().item())
                        eager_err = max(eager_err, (e.grad.double() - q.grad).abs().max().item())
            eager_buffers = dict(eager_model.named_buffers())
            for name, b in model.named_buffers():
                if b.is_floating_point() and not _close(b, eager_buffers[name]):
                    mismatches.append((f"step {step}: buffer {name}", (b - eager_buffers[name]).abs().max().item()))
            if sync:
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        return {"mismatches": mismatches, "ranks_disagree": disagree, "err": err, "eager_err": eager_err,
                "compiled": self.counter(fused) if self.counter else None, "pending": pending, **_all_reduces(fused),
                **({"reducer_prepared": prepared[0]} if self.count_reducer else {})}

    @staticmethod
    def _gathered(args, kwargs, r: int, world: int):
        """Rank r's batch, sent to every rank (the float64 reference sees them all)."""
        def gather(t):
            if not isinstance(t, torch.Tensor):
                return t
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            part = parts[r]
            return part.double() if part.is_floating_point() else part
        return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}


class _CountingReducer:
    """DDP's reducer behind a proxy that counts its prepare_for_backward calls (each a backward it will
    all-reduce after: DDP's forward makes that call for each synced call it does not leave to aotfuse)."""

    def __init__(self, reducer, count: list) -> None:
        self._reducer, self._count = reducer, count

    def prepare_for_backward(self, *args):
        self._count[0] += 1
        return self._reducer.prepare_for_backward(*args)

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


class Deep(nn.Module):
    """Six 384-wide layers (0.6 MB of weights each): with 1 MB buckets DDP all-reduces them in several
    buckets, and Dynamo's DDPOptimizer compiles one graph per bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 384)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(384, 384), nn.GELU(), nn.LayerNorm(384)) for _ in range(6))
        self.out = nn.Linear(384, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def _mlp_batches(rank: int, steps: int = 3, extra_at: int | None = None):
    g = torch.Generator().manual_seed(100 + rank)
    return [((torch.randn(BATCH, FEATURES, generator=g),), {"use_extra": s == extra_at}) for s in range(steps)]


def _programs(view) -> int:
    return view._aotfuse_compiled.compile_count


_COMMS = ("_c10d_functional.all_reduce_.default", "aotfuse.ddp_wait.default")
_FREE = ("aten.reshape.default", "aten.view.default", "aten.slice.Tensor", "aten.cat.default", "aten.div.Tensor")


def _all_reduces(view) -> dict:
    """The all-reduce calls in the backward programs of memory_efficient_fusion(DDP(model)) (or of
    DDP(memory_efficient_fusion(model))), and how many
    are followed by more of the backward's own computation (started while it computes, not after)."""
    if isinstance(view, aotfuse.AOTDataParallel):
        inner = view.compiled_module
    elif isinstance(view, DDP) and isinstance(view.module, aotfuse.AOTModule):  # DDP(memory_efficient_fusion(m))
        inner = view.module
    else:
        return {}
    count = overlapped = 0
    for entry in inner._aotfuse_compiled._cache.values():
        gm = entry.record.graphs.get("backward") if entry.record is not None else None
        if gm is None:
            continue
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        for k, t in enumerate(targets):
            if t == _COMMS[0]:
                count += 1
                overlapped += any(u not in _COMMS and u not in _FREE for u in targets[k + 1:])
    return {"all_reduces": count, "overlapped": overlapped}


class Branchy(nn.Module):
    """A forward that reads a value (`.item()`) on the ranks given (all by default): no one graph there,
    memory_efficient_fusion's fallback runs it; the other ranks run it compiled."""

    def __init__(self, ranks: tuple | None = None) -> None:
        super().__init__()
        self.body = Deep()
        self.ranks = ranks

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        y = self.body(x)
        if self.ranks is None or dist.get_rank() in self.ranks:  # the same values either way
            return y if y.sum().item() > -1e30 else -y
        return y


def _dynamo_wrap(collected: list):
    def wrap(model, kw):
        torch._dynamo.reset()
        collected.clear()
        return torch.compile(DDP(model, **kw), backend=functools.partial(aotfuse_backend, collect=collected),
                             dynamic=False)
    return wrap


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


def _bert_batches(rank: int, lengths: tuple = (16, 16)):
    g = torch.Generator().manual_seed(200 + rank)
    out = []
    for n in lengths:
        ids = torch.randint(5, 64, (4, n), generator=g)
        labels = torch.where(torch.rand(4, n, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]
        out.append(((), {"input_ids": ids, "labels": labels}))
    return out


def _clamp_grads(model, rank: int) -> None:
    """A hook on every parameter's gradient: DDP averages the clamped local gradients."""
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-2e-3, 2e-3))


def _join_case(rank: int, world: int) -> dict:
    """Uneven inputs under DDP's join(): rank 0 takes three steps, rank 1 two; aotfuse's step beside eager
    DDP's on each rank, the same gradients, the ranks' weights equal after."""
    torch.manual_seed(0)
    model = Mlp()
    eager_model = copy.deepcopy(model)
    fused, eager = aotfuse.memory_efficient_fusion(DDP(model)), DDP(eager_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager_model)]
    mismatches = []
    for wrapped in (fused, eager):
        opt = opts[0] if wrapped is fused else opts[1]
        with wrapped.join():
            for args, kwargs in _mlp_batches(rank, steps=3 if rank == 0 else 2):
                _loss(wrapped(*args, **kwargs)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        if not _close(p, q):
            mismatches.append((f"weight {name}", (p - q).abs().max().item()))
    disagree = []
    for name, p in model.named_parameters():
        ranks = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(ranks, p.detach().contiguous())
        if any(not torch.equal(r, ranks[0]) for r in ranks[1:]):
            disagree.append(f"weight {name}")
    return {"mismatches": mismatches, "ranks_disagree": disagree, "err": 0.0, "eager_err": 0.0,
            "compiled": _programs(fused), "pending": 0, **_all_reduces(fused)}


def _with_comm_hook(model, kw):
    """DDP with a Python comm hook (plain all-reduce, so eager DDP's values): its reducer syncs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrapper = DDP(model, **kw)
    wrapper.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    return aotfuse.memory_efficient_fusion(wrapper)


def _refusals() -> dict:
    """What aotfuse must refuse with a clear error: FSDP2's sharded (DTensor) parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Mlp()
    fully_shard(model, mesh=mesh)
    try:
        aotfuse.memory_efficient_fusion(model)
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return {"error": [type(e).__name__, str(e)]}
    return {"error": None}


def main(out_path: str) -> None:
    # a collective the ranks do not both issue fails within the timeout instead of hanging the test
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    collected: list = []
    cases = {
        "ddp_of_compiled": Case(Mlp, _mlp_batches, lambda m, kw: DDP(aotfuse.memory_efficient_fusion(m), **kw),
                                counter=lambda v: _programs(v.module), count_reducer=True),
        # the first call runs eagerly (DDP's reducer prepared it before the compiled module saw the DDP), the
        # later ones through a backward that all-reduces its buckets itself
        "ddp_of_compiled_buckets": Case(Deep, _mlp_batches, lambda m, kw: DDP(aotfuse.memory_efficient_fusion(m), **kw),
                                        ddp_kwargs={"bucket_cap_mb": 1}, counter=lambda v: _programs(v.module), count_reducer=True),
        "ddp_of_compiled_no_sync": Case(Mlp, functools.partial(_mlp_batches, steps=4),
                                        lambda m, kw: DDP(aotfuse.memory_efficient_fusion(m), **kw),
                                        counter=lambda v: _programs(v.module), no_sync_every=2, count_reducer=True),
        "ddp_of_compiled_fallback_on_one_rank": Case(
            functools.partial(Branchy, ranks=(0,)), _mlp_batches,
            lambda m, kw: DDP(aotfuse.memory_efficient_fusion(m, fallback="eager"), **kw),
            ddp_kwargs={"bucket_cap_mb": 1}, counter=lambda v: 1),
        "compiled_ddp": Case(Mlp, _mlp_batches, lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                             counter=_programs, count_reducer=True),
        "torch_compile_ddp": Case(Mlp, _mlp_batches, _dynamo_wrap(collected), counter=lambda v: len(collected)),
        "torch_compile_ddp_buckets": Case(Deep, _mlp_batches, _dynamo_wrap(collected), ddp_kwargs={"bucket_cap_mb": 1},
                                          counter=lambda v: len(collected)),
        "compiled_ddp_buckets": Case(Deep, _mlp_batches, lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                     ddp_kwargs={"bucket_cap_mb": 1}, counter=_programs, count_reducer=True),
        "compiled_ddp_overlap_off": Case(Deep, _mlp_batches,
                                         lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                         ddp_kwargs={"bucket_cap_mb": 1}, counter=_programs,
                                         env={"AOTFUSE_DDP_OVERLAP": "0"}),
        "compiled_ddp_comm_hook": Case(Mlp, _mlp_batches, _with_comm_hook, counter=_programs),
        "compiled_ddp_grad_hooks": Case(Mlp, _mlp_batches, lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                        counter=_programs, prepare=_clamp_grads),
        "compiled_ddp_fallback": Case(Branchy, _mlp_batches,
                                      lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw), fallback="eager"),
                                      ddp_kwargs={"bucket_cap_mb": 1}, counter=lambda v: 1),
        # rank 0 runs it eagerly (the fallback), rank 1 compiled: the same buckets all-reduced in one order
        "compiled_ddp_fallback_on_one_rank": Case(
            functools.partial(Branchy, ranks=(0,)), _mlp_batches,
            lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw), fallback="eager"),
            ddp_kwargs={"bucket_cap_mb": 1}, counter=lambda v: 1),
        "no_sync_accumulation": Case(Mlp, functools.partial(_mlp_batches, steps=4),
                                     lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)), counter=_programs,
                                     no_sync_every=2, count_reducer=True),
        # three micro-steps a step, 1 MB buckets: each bucket's accumulated .grads join it
        "no_sync_accumulation_buckets": Case(Deep, functools.partial(_mlp_batches, steps=6),
                                             lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                             ddp_kwargs={"bucket_cap_mb": 1}, counter=_programs, no_sync_every=3,
                                             count_reducer=True),
        "find_unused_parameters": Case(functools.partial(Mlp, extra=True), functools.partial(_mlp_batches, extra_at=1),
                                       lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                       ddp_kwargs={"find_unused_parameters": True}, counter=_programs),
    }
    try:
        import transformers  # noqa: F401
        cases["hf_bert_compiled_ddp"] = Case(_bert, _bert_batches,
                                             lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                             counter=_programs)
        # three lengths: the third through the shape family the second traced (its own programs, synced)
        cases["hf_bert_compiled_ddp_lengths"] = Case(_bert, functools.partial(_bert_batches, lengths=(16, 12, 8)),
                                                     lambda m, kw: aotfuse.memory_efficient_fusion(DDP(m, **kw)),
                                                     counter=_programs)
    except ImportError:
        pass
    results = {}
    try:
        results["compiled_ddp_join"] = _join_case(rank, world)
    except Exception:  # noqa: BLE001 - reported to the test, which fails naming the case
        results["compiled_ddp_join"] = {"exception": traceback.format_exc()}
    dist.barrier()
    for name, case in cases.items():
        try:
            results[name] = case.run(rank, world)
        except Exception:  # noqa: BLE001 - reported to the test, which fails naming the case
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    results["fsdp2_refused"] = _refusals()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
