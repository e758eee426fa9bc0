"""A tied embedding's gradient added into its weight's other gradient (python/aotfuse/embedding_grads.py):
`add(X, embedding_dense_backward(g, ids, V, pad, False))` becomes `index_add(X, 0, ids, g)` on the
CPU, the padding index's rows masked, writing into X's own tensor (runtime.c's in-place results).
Gradients are checked against eager and against float64 (the rows add onto X instead of onto zeros,
so they may round differently)."""
import copy

import pytest
import torch

import aotfuse
from helpers import assert_close

V, H = 97, 24


class Tied(torch.nn.Module):
    """Input embedding and output projection sharing one weight, as Hugging Face's LM heads do."""

    def __init__(self, padding_idx=None, scale_grad_by_freq=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.proj = torch.nn.Linear(H, H)

    def forward(self, ids, labels):
        h = torch.tanh(self.proj(self.emb(ids)))
        logits = h @ self.emb.weight.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 11), generator=g)
    ids[0, :4] = 0  # padding tokens (index 0), and a repeated token
    ids[1, 2:5] = 5
    return ids, torch.randint(0, V, (3, 11), generator=g)


def _grads(model, dtype, compiled):
    m = copy.deepcopy(model).to(dtype)
    run = aotfuse.memory_efficient_fusion(m) if compiled else m
    run(*_batch()).backward()
    return {n: p.grad for n, p in m.named_parameters()}, run


def _backward_programs(cf):
    rec = cf._aotfuse_compiled.records[-1]
    bw = rec.programs["backward"]
    return [bw.program] + [v.program for v in bw.variants.values()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding_idx", [None, 0], ids=["no padding", "padding 0"])
def test_tied_embedding_gradient_adds_into_the_other_gradient(dtype, padding_idx):
    torch.manual_seed(0)
    model = Tied(padding_idx)
    ours, cf = _grads(model, dtype, True)
    eager, _ = _grads(model, dtype, False)
    exact, _ = _grads(model, torch.float64, False)
    for name in exact:
        err = (ours[name].double() - exact[name]).abs().max().item()
        eager_err = (eager[name].double() - exact[name]).abs().max().item()
        scale = exact[name].abs().max().item()
        eps = torch.finfo(dtype).eps
        assert err <= 4 * eager_err + 4 * eps * scale, f"Tied {dtype} {name}: {err} from float64, eager {eager_err}"
    if padding_idx is not None:  # the padding row gets the projection's gradient alone
        assert_close(ours["emb.weight"][0].float(), eager["emb.weight"][0].float(), f"Tied {dtype} padding row",
                     atol=4 * torch.finfo(dtype).eps * scale, rtol=0)
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(copy.deepcopy(model).to(dtype)), *_batch())
    assert report.extern_ops.get("aten::index_add.default") == 1, report.extern_ops
    assert "aten::embedding_dense_backward.default" not in report.extern_ops, report.extern_ops
    took = [d for p in _backward_programs(cf) for d in p.buffer_donors() if d[2] == "aten::index_add.default"]
    assert took, "the index_add writes a fresh tensor instead of adding into the other gradient's"


@pytest.mark.parametrize("how", ["scale_grad_by_freq", "AOTFUSE_EMBEDDING_GRADS=0"])
def test_embedding_backward_kept_where_not_rewritten(how, monkeypatch):
    torch.manual_seed(0)
    model = Tied(0, scale_grad_by_freq=how == "scale_grad_by_freq")
    if how != "scale_grad_by_freq":
        monkeypatch.setenv("AOTFUSE_EMBEDDING_GRADS", "0")
    ours, _ = _grads(model, torch.float32, True)
    eager, _ = _grads(model, torch.float32, False)
    for name in eager:
        assert_close(ours[name], eager[name], f"Tied ({how}) {name}")
    report = aotfuse.explain(aotfuse.memory_efficient_fusion(copy.deepcopy(model)), *_batch())
    assert report.extern_ops.get("aten::embedding_dense_backward.default") == 1, report.extern_ops
    assert "aten::index_add.default" not in report.extern_ops, report.extern_ops


@pytest.mark.parametrize("variant", ["sum", "per_sample_weights", "include_last_offset"])
def test_a_bfloat16_embedding_bag_trains_like_eager(variant):
    """ATen's CPU kernel sums a bfloat16 table's bags on its fast path, as float's and half's, and
    leaves offset2bag empty; torch's meta function (2.13) gives bfloat16 an offset2bag of an entry per
    index, so the traced forward held the kernel's empty one to that size and the first step failed
    (AF_ERR_BRIDGE). FakeTensor's _embedding_bag is corrected while aotfuse traces
    (decompositions.upstream_fixes), also after torch's own aot_function traced the same call first
    (FakeTensor's shared results cache). Output and gradient as eager's, and as close to float64's."""
    from functorch.compile import aot_function, nop

    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(50, 8, mode="sum", include_last_offset=variant == "include_last_offset")
    ids, offsets = torch.randint(0, 50, (12,)), torch.tensor([0, 3, 7, 12] if variant == "include_last_offset" else [0, 3, 7])
    psw = torch.rand(12) if variant == "per_sample_weights" else None
    args = (ids, offsets) + ((psw.bfloat16(),) if psw is not None else ())
    ref64 = copy.deepcopy(bag).double()
    out64 = ref64(ids, offsets, *((psw.double(),) if psw is not None else ()))
    out64.square().sum().backward()
    bag = bag.bfloat16()
    eager = copy.deepcopy(bag)
    aot_function(lambda w, *a: torch.nn.functional.embedding_bag(a[0], w, a[1], mode="sum", per_sample_weights=(
        a[2] if len(a) > 2 else None), include_last_offset=variant == "include_last_offset"), nop)(
        bag.weight, *args).float().sum().backward()  # torch's own trace of the same call first
    bag.weight.grad = None
    compiled = aotfuse.memory_efficient_fusion(bag)
    for step in range(2):
        out, ref = compiled(*args), eager(*args)
        assert_close(out, ref, f"{variant} step {step}: output")
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        assert_close(bag.weight.grad, eager.weight.grad, f"{variant} step {step}: weight gradient", atol=1e-2, rtol=1.6e-2)
        if step == 0:
            err = (bag.weight.grad.double() - ref64.weight.grad).abs().max()
            err_eager = (eager.weight.grad.double() - ref64.weight.grad).abs().max()
            assert err <= 2 * err_eager + 1e-2, (variant, err, err_eager)
        bag.weight.grad = eager.weight.grad = None
