"""Models beyond the seed's four, at tiny configs with random weights (nothing is downloaded),
trained 2 SGD steps through memory_efficient_fusion against eager and float64
(aotfuse.testing.compare_models): decoder-only models with rotary embeddings, RMS norm, SiLU
gates and grouped-query attention (Llama, Qwen2), an encoder-decoder with relative position
buckets (T5), a vision transformer (ViT), Bert with transformers' default attention (SDPA), and
DeBERTa-v2 (disentangled attention; its scale is a tensor built in the forward, a constant in
both graphs)."""
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
    "bert-sdpa": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _masked),
    "deberta-v2": (lambda: transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)), _masked),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_eager(name, dtype):
    build, inputs = MODELS[name]

    def make():
        torch.manual_seed(0)
        return build().train()

    report = compare_models(make, inputs, dtype=dtype, steps=2, name=name)
    report.assert_ok()
    assert report.checked > 50, report
