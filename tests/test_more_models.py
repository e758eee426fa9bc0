"""Models beyond the seed's four, at tiny configs with random weights (nothing is downloaded),
trained 2 SGD steps through memory_efficient_fusion against eager and float64 (also at a shape of a
shape family, after two other shapes)
(aotfuse.testing.compare_models): decoder-only models with rotary embeddings, RMS norm, SiLU
gates and grouped-query attention (Llama, Qwen2), an encoder-decoder with relative position
buckets (T5), a vision transformer (ViT), a convolutional network with batch norms (ResNet),
ConvBERT (span-based dynamic convolutions: a softmax over the kernel's 9 taps, [rows, 9, 1]), Bert
with transformers' default attention (SDPA), DeBERTa-v2 (disentangled attention; its scale is
a tensor built in the forward, a constant in both graphs), GPT-NeoX (rotary on half of each head,
parallel residual), MobileBERT (bottlenecks, its NoNorm, stacked feed-forwards), Swin (shifted
windows: rolls, window partitions, a relative position bias table) and ConvNeXt (depthwise
convolutions, a layer norm over channels-last activations, layer scale)."""
from __future__ import annotations

import pytest
import torch

from aotfuse.testing import compare_models

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, S, B = 100, 16, 2
_DEC = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64)


def _ids():
    return torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(1))


def _masked():
    ids = _ids()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -4:] = 0
    return dict(input_ids=ids, labels=ids, attention_mask=mask)


MODELS = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DEC)), _masked),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DEC)), _masked),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0)), lambda: dict(input_ids=_ids(), labels=_ids())),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        lambda: dict(pixel_values=torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
                     labels=torch.tensor([0, 2]))),
    "resnet": (lambda: transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)),
        lambda: dict(pixel_values=torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
                     labels=torch.tensor([0, 2]))),
    "convbert": (lambda: transformers.ConvBertForMaskedLM(transformers.ConvBertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, embedding_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        _masked),
    "bert-sdpa": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _masked),
    "deberta-v2": (lambda: transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)), _masked),
    "gpt-neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)), _masked),
    "mobilebert": (lambda: transformers.MobileBertForMaskedLM(transformers.MobileBertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _masked),
    "swin": (lambda: transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=3,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        lambda: dict(pixel_values=torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
                     labels=torch.tensor([0, 2]))),
    "convnext": (lambda: transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=32)),
        lambda: dict(pixel_values=torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
                     labels=torch.tensor([0, 2]))),
}
VISION = {"vit": 16, "resnet": 32, "swin": 16, "convnext": 32}  # image side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_eager(name, dtype, monkeypatch):
    build, inputs = MODELS[name]

    def make():
        torch.manual_seed(0)
        return build().train()

    if name == "t5" and dtype == torch.bfloat16:
        # T5's decoder ReLU has a unit whose float64 pre-activation on one token is 0.0053 at the second
        # step, within a bf16 rounding of 0: where the matmuls are computed in float32 (the default on CPUs
        # without AVX-512) that rounding switches the unit, and its row of wi's gradient differs from eager's
        # (0.0136 from float64 against eager's 0.0011 there; eager's own worst row 0.0040), a kink no
        # rounding criterion covers. One step there; two with bf16 matmuls, as on AVX-512 CPUs.
        monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "1")
        compare_models(make, inputs, dtype=dtype, steps=1, name=name).assert_ok()
        monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")
    report = compare_models(make, inputs, dtype=dtype, steps=2, name=name)
    report.assert_ok()
    assert report.checked > 50, report


def _shaped(name: str, n: int) -> dict:
    """Inputs of the model's kind at another size: sequence length n (T5: its labels too), or a
    batch of n images (ViT, ResNet); every tensor its own (as compare_models passes them)."""
    g = torch.Generator().manual_seed(n)
    if name in VISION:
        side = VISION[name]
        return dict(pixel_values=torch.randn(n, 3, side, side, generator=g), labels=torch.randint(0, 3, (n,), generator=g))
    ids = torch.randint(3, V, (B, n), generator=g)
    if name == "t5":
        return dict(input_ids=ids, labels=torch.randint(3, V, (B, n - 2), generator=g))
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, -4:] = 0
    return dict(input_ids=ids, labels=ids.clone(), attention_mask=mask)


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in MODELS] + [("llama", torch.bfloat16)],
                         ids=[f"{n}-fp32" for n in MODELS] + ["llama-bf16"])
def test_model_trains_like_eager_at_a_shape_of_its_family(name, dtype):
    """Shape families (aotfuse/shapes.py): trained at two other sizes first (the second makes the
    family), the model's own inputs then run programs made from the family's graphs, no trace."""
    build, inputs = MODELS[name]
    sizes = (3, 5) if name in VISION else (12, 20)
    holder = []

    def make():
        torch.manual_seed(0)
        return build().train()

    def compile_fn(model):
        import aotfuse

        compiled = aotfuse.memory_efficient_fusion(model)
        buffers = {key: b.clone() for key, b in model.named_buffers()}  # batch norms' running statistics
        for n in sizes:
            kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _shaped(name, n).items()}
            out = compiled(**kwargs)
            out.loss.backward()
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():  # as they were: the steps at other sizes are not part of the comparison
            for key, b in model.named_buffers():
                b.copy_(buffers[key])
        holder.append(compiled._aotfuse_compiled)
        return compiled

    report = compare_models(make, inputs, dtype=dtype, steps=2, name=name, compile_fn=compile_fn)
    report.assert_ok()
    cf = holder[0]
    members = sum(e.member for e in cf._cache.values())
    (family,) = cf._families.values()
    if name == "deberta-v2":
        # its relative positions pin the length to the traced one (a guard Eq(length, 20)): the family
        # is marked failed and the model's own inputs were traced on their own
        assert family.failed and cf.compile_count == 3 and members == 0, (cf.compile_count, members)
    else:
        assert not family.failed and cf.compile_count == 2 and members == 1, (cf.compile_count, members)
