"""GPU checks (pytest -m cuda): the HF seed models through aotfuse on a CUDA device match eager and a
float64 reference. Today every node runs as an extern ATen call on torch's current stream (fused
CUDA kernels are issue 6); the partitioner, runtime and torch bridge are what these exercise.
Skipped, with that reason, on a machine without a GPU (tests/conftest.py)."""
import pytest
import torch

import aotfuse
from aotfuse.testing import compare_models

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.cuda


def _bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg).cuda()


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 32), generator=g).cuda()
    return (), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bert_on_cuda_matches_eager(dtype):
    report = compare_models(_bert, _inputs, dtype=dtype, steps=3)
    assert report.ok and report.checked > 50, report


def test_compiled_outputs_stay_on_the_device():
    model = aotfuse.memory_efficient_fusion(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).cuda())
    out = model(torch.randn(4, 8, device="cuda"))
    assert out.is_cuda
    out.sum().backward()
    assert all(p.grad.is_cuda for p in model.parameters())
