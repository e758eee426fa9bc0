"""DistributedDataParallel on the CPU: two gloo processes (tests/distributed_worker.py) train each way of
combining aotfuse with DDP beside eager DDP; gradients are all-reduced (the ranks agree), match eager DDP's
and a float64 single-process step over both ranks' batches. Plus the wrappers aotfuse refuses."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import aotfuse

from helpers import assert_close

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ["ddp_of_compiled", "ddp_of_compiled_buckets", "ddp_of_compiled_no_sync", "ddp_of_compiled_fallback_on_one_rank",
         "compiled_ddp", "compiled_ddp_buckets", "compiled_ddp_overlap_off", "compiled_ddp_comm_hook",
         "compiled_ddp_fallback", "compiled_ddp_fallback_on_one_rank", "compiled_ddp_grad_hooks", "compiled_ddp_join",
         "torch_compile_ddp", "torch_compile_ddp_buckets", "no_sync_accumulation", "no_sync_accumulation_buckets",
         "find_unused_parameters", "hf_bert_compiled_ddp", "hf_bert_compiled_ddp_lengths"]

requires_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                   reason="this torch has no gloo process groups")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(HERE, "distributed_worker.py"), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0 and out.exists(), f"the DDP worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@requires_gloo
@pytest.mark.parametrize("case", CASES)
def test_ddp_trains_like_eager_ddp(worker, case):
    """Each case: three or four SGD steps (two micro-steps a step under no_sync; a Linear used in one step
    only under find_unused_parameters; batch norm buffers DDP broadcasts; under torch.compile, a model of
    several 1 MB buckets, which Dynamo's DDPOptimizer compiles as a graph each), both ranks."""
    if case.startswith("hf_bert") and case not in worker:
        pytest.skip("transformers is not installed")
    result = worker[case]
    assert "exception" not in result, f"{case}: {result.get('exception')}"
    assert result["compiled"] >= 1, f"{case}: nothing was compiled, the step ran eagerly"
    if case == "torch_compile_ddp_buckets":  # Dynamo's DDPOptimizer: a graph per bucket, each fw and bw
        assert result["compiled"] >= 4, f"{case}: {result['compiled']} programs, expected several buckets' graphs"
    # memory_efficient_fusion(DDP(model)) and, from its second call, DDP(memory_efficient_fusion(model)):
    # the synced backward all-reduces its buckets itself, each as
    # soon as its gradients are made (Deep's 3.6 MB of weights in 1 MB buckets: several, all but the
    # last followed by more of the backward; after no_sync accumulation with the accumulated .grads
    # added); under find_unused_parameters, a fallback or AOTFUSE_DDP_OVERLAP=0, DDP's reducer does it
    # after the backward
    if case in ("compiled_ddp", "ddp_of_compiled", "hf_bert_compiled_ddp", "hf_bert_compiled_ddp_lengths",
                "no_sync_accumulation", "ddp_of_compiled_no_sync"):
        assert result["all_reduces"] >= 1, f"{case}: the backward program all-reduces nothing"
    elif case in ("compiled_ddp_buckets", "ddp_of_compiled_buckets", "no_sync_accumulation_buckets"):
        assert result["all_reduces"] >= 3 and result["overlapped"] >= result["all_reduces"] - 1, (
            f"{case}: {result['all_reduces']} all-reduces, {result['overlapped']} before the backward's end")
    elif "all_reduces" in result:
        assert result["all_reduces"] == 0, f"{case}: {result['all_reduces']} all-reduces in the backward program"
    # DDP's reducer stands by where the backward all-reduces (else each gradient would be all-reduced twice,
    # which the values cannot show); DDP(memory_efficient_fusion(model))'s first call is left to it where
    # it is a synced one (not under no_sync)
    if "reducer_prepared" in result:
        expected = 1 if case in ("ddp_of_compiled", "ddp_of_compiled_buckets") else 0
        assert result["reducer_prepared"] == expected, (
            f"{case}: DDP's reducer prepared to all-reduce {result['reducer_prepared']} backwards, expected {expected}")
    assert result["ranks_disagree"] == [], f"{case}: gradients not all-reduced: {result['ranks_disagree']}"
    assert result["pending"] == 0, f"{case}: {result['pending']} collectives not waited for when the backward returned"
    assert result["mismatches"] == [], f"{case}: differs from eager DDP: {result['mismatches']}"
    # against float64: no further from the exact averaged gradient than eager DDP is, up to rounding
    assert result["err"] <= max(4 * result["eager_err"], 1e-6), (
        f"{case}: gradient {result['err']:.3g} from float64, eager DDP's {result['eager_err']:.3g}")


@requires_gloo
def test_fully_sharded_parameters_are_refused(worker):
    kind, message = worker["fsdp2_refused"]["error"]
    assert kind == "NotImplementedError"
    assert "DTensor parameters" in message and "DistributedDataParallel is supported" in message


def test_a_single_device_data_parallel_runs_its_module_compiled():
    """DataParallel on the CPU (no devices) calls its module: the compiled view calls the compiled one;
    keys keep DataParallel's `module.` prefix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    dp = nn.DataParallel(model)
    compiled = aotfuse.memory_efficient_fusion(dp)
    assert isinstance(compiled, aotfuse.AOTDataParallel)
    assert set(compiled.state_dict()) == set(dp.state_dict())
    x = torch.randn(5, 6)
    out, expected = compiled(x), ref(x)
    assert_close(out, expected, "DataParallel output")
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")
    assert compiled.compiled_module._aotfuse_compiled.compile_count == 1
    assert dp.module is model  # the wrapper's own module is back after the call
    compiled.eval()
    assert not model.training and not dp.training


def test_data_parallel_over_several_devices_is_refused():
    dp = nn.DataParallel(nn.Linear(4, 4))
    dp.device_ids = [0, 1]  # what DataParallel holds on a machine with two GPUs
    with pytest.raises(NotImplementedError, match="DataParallel over 2 devices.*DistributedDataParallel"):
        aotfuse.memory_efficient_fusion(dp)
    compiled = aotfuse.memory_efficient_fusion(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="cannot replicate a compiled module"):
        compiled._replicate_for_data_parallel()  # what DataParallel(compiled) does over several devices


def test_a_wrapper_whose_module_was_replaced_is_an_error():
    dp = nn.DataParallel(nn.Linear(4, 4))
    compiled = aotfuse.memory_efficient_fusion(dp)
    dp.module = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="module was replaced after it was compiled"):
        compiled(torch.randn(2, 4))


def _one_process_ddp(backend: str, device: str) -> None:
    """memory_efficient_fusion(DDP(Deep)) and DDP(memory_efficient_fusion(Deep)) in a one-process group:
    their backward programs all-reduce the 1 MB buckets (functional collectives on this backend), the
    synced call after a no_sync() micro-step adding the accumulated .grads to each bucket first, and
    they train like eager DDP."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distributed_worker import Deep, _all_reduces

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        for form in ("compiled_ddp", "ddp_of_compiled"):
            torch.manual_seed(0)
            model = Deep().to(device)
            ref = copy.deepcopy(model)
            ids = [0] if device == "cuda" else None
            fused = (aotfuse.memory_efficient_fusion(DDP(model, device_ids=ids, bucket_cap_mb=1)) if form == "compiled_ddp"
                     else DDP(aotfuse.memory_efficient_fusion(model), device_ids=ids, bucket_cap_mb=1))
            eager = DDP(ref, device_ids=ids, bucket_cap_mb=1)
            x = torch.randn(8, 12, device=device)
            for step in range(4):  # step 2 a no_sync() micro-step, step 3 the synced call after it
                for wrapped in (fused, eager):
                    with wrapped.no_sync() if step == 2 else contextlib.nullcontext():
                        wrapped(x * (step + 1)).square().mean().backward()
                if step == 2:
                    continue
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert_close(p.grad, q.grad, f"{backend} {form} step {step}: grad of {name}")
                    p.grad = q.grad = None
            counts = _all_reduces(fused)
            assert counts["all_reduces"] >= 6, (form, counts)  # the synced program's and the accumulated one's
            inner = fused.compiled_module if form == "compiled_ddp" else fused.module
            adds = sum(n.target is torch.ops.aotfuse.ddp_add_accumulated.default
                       for e in inner._aotfuse_compiled._cache.values() if e.record is not None
                       for gm in [e.record.graphs.get("backward")] if gm is not None for n in gm.graph.nodes)
            assert adds >= 3, (form, adds)
    finally:
        dist.destroy_process_group()


@requires_gloo
def test_compiled_ddp_all_reduces_in_its_backward_in_one_process():
    _one_process_ddp("gloo", "cpu")


@pytest.mark.cuda
def test_compiled_ddp_all_reduces_in_its_backward_with_nccl():
    """The same on a GPU through NCCL (one process: the machine has one GPU): the all-reduces on NCCL's
    stream, waited for on torch's current stream before the gradients are read; both forms, and the
    accumulated .grads added on the GPU."""
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    _one_process_ddp("nccl", "cuda")
