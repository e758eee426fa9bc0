"""Correctness sweep of aotfuse over Hugging Face model families (CPU, random tiny models).

Every family of transformers' auto mappings for the chosen tasks (causal LM, masked LM, seq2seq LM,
image classification) is built from its config class with defaults overridden by tiny sizes (only
where the config has the field; every dropout-like float set to 0), with random weights (nothing is
downloaded; weight matrices initialized to zeros are drawn too: ZERO_MATRICES below), and trained for
2 SGD steps by `aotfuse.testing.compare_models` (eager vs aotfuse vs a float64 reference) in each
dtype. Each (family, dtype) runs in its own subprocess, single-threaded, so
that a crash or a hang is isolated. A row is one of:

    ok             compare_models found no mismatch
    mismatch       numeric (or structural) mismatches: the first 3 are listed, then the same model
                   compared in float64 (compare_models(dtype=float64): aotfuse's program against
                   eager's with no lower precision's rounding): "float64 run: ... 0 mismatches"
                   says the program computes the same function and the row's differences are
                   rounding the model amplifies (a dtype-specific bug, of 16-bit conversions say,
                   it cannot rule out)
    capture error  memory_efficient_fusion(fallback="error") raised CaptureError; the row then gives
                   the result of a rerun with fallback="dynamo"
    aotfuse error  any other exception from the compiled model (type, message, last aotfuse frame)
    skipped        the tiny build, or eager's forward/backward, fails: not aotfuse's fault
    timeout/crash  the subprocess ran past --timeout or died (rc, last stderr line)

Usage:
    python benchmarks/sweep.py [--tasks causal,masked,seq2seq,image] [--only llama,bert] [--skip x,y]
                               [--dtypes fp32,bf16] [--attn eager] [--jobs 2] [--timeout 300] [--out FILE.md]
                               [--entry mef|torch.compile]
    python benchmarks/sweep.py --one llama fp32 --task causal     # one row, in this process (JSON result)
Results: --out, default benchmarks/results/sweep-cpu-<date>.md (rewritten as rows finish).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import functools
import inspect
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MARK, EAGER_OK = "SWEEP-RESULT ", "SWEEP-EAGER-OK"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}
BATCH, SEQ, TGT, VOCAB = 2, 16, 12, 128
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, ffn_dim=64, n_embd=32, n_layer=2, n_head=4, n_inner=64, max_position_embeddings=64,
            image_size=32, patch_size=4, num_channels=3, head_dim=8, embed_dim=32,
            # mixture-of-experts and low-rank attention sizes, where a family has them
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8,
            # other spellings of the same sizes, and sizes that must agree with them
            emb_dim=32, n_layers=2, n_heads=4, embedding_size=32, intra_bottleneck_size=32, rotary_dim=4,
            mamba_n_heads=4, mamba_d_ssm=64, mamba_d_state=8, state_size=8,
            entity_vocab_size=VOCAB, entity_emb_size=32,  # LUKE's 500k entities: 1 GB copies in compare_models
            num_latents=16, d_latents=32,  # Perceiver's 256 x 1280 latents: 271M parameters, 15 GB in compare_models
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)  # Gemma 3n/4's 262144 x 256 per layer
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers")
# When the tiny build or eager fails, these are tried in turn (each adds to the one before): no
# grouped-query attention, 8 layers (layer patterns that need more than 2 to hold every layer type), the
# default layer counts; each first with the model's own experts (MoE), then with them as plain loops.
VARIANTS = [("", {}), ("kv heads 4", dict(num_key_value_heads=4)),
            ("kv heads 4, 8 layers", dict(num_key_value_heads=4, **dict.fromkeys(LAYER_KEYS, 8))),
            ("kv heads 4, default layers", dict(num_key_value_heads=4, **dict.fromkeys(LAYER_KEYS)))]
LISTS = {"depths": lambda n: [1] * n, "depth": lambda n: [1] * n, "hidden_sizes": lambda n: [16 << i for i in range(n)],
         "embed_dim": lambda n: [16 << i for i in range(n)], "num_heads": lambda n: [2] * n,
         "num_attention_heads": lambda n: [2] * n}
# Families whose tiny sizes do not fit together: fields of their own over TINY's, or (defaults) the
# config's default sizes, dropout zeroed, with the fields given set
FAMILIES = {"swin": dict(window_size=2, image_size=64), "donut-swin": dict(window_size=2, image_size=64),
            "bit": dict(num_groups=4), "cvt": dict(defaults=True), "hgnet_v2": dict(defaults=True),
            "mobilevitv2": dict(defaults=True, image_size=64), "textnet": dict(defaults=True, image_size=[64, 64]),
            "levit": dict(defaults=True, image_size=128), "neomme": dict(head_dim=16),  # NeoMME: 4 rotated dims at least
            "reformer": dict(axial_pos_embds_dim=(16, 16), axial_pos_shape=(4, 4)),  # seq 16, hidden 32
            "dots1": dict(n_shared_experts=1), "mamba2": dict(head_dim=16, n_groups=1),  # heads x dim = 2 x hidden
            "lfm2_moe": dict(layer_types=["full_attention", "conv"]), "zaya": dict(num_experts_per_tok=1),
            # DBRX's attention reads a rope_theta its attention config no longer has (transformers 5.17);
            # xLSTM: training mode in chunks of 8 tokens, no cache (its cache's state is sized for
            # queries as wide as values, which qk_dim_factor 0.5 makes them not)
            "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
            "xlstm": dict(mode="train", chunk_size=8, embedding_dim=32, use_cache=False),
            # smaller images than the configs' 600 or 224 (the CUDA emulation of a 600-pixel step took over
            # 25 minutes); LeViT at 128, as at 64 its last batch norms see 2 tokens, ill-conditioned enough
            # that Inductor's float64 step leaves eager's as far as aotfuse's (loss 4e-3 apart)
            "efficientnet": dict(image_size=64), "pvt_v2": dict(image_size=64),
            # Qwen4-Exp: its default config leaves the sparse attention's indexer unsized, and its n-gram
            # embeddings are 20M rows
            **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), dict(
                layer_types=["linear_attention", "qwen_sparse_attention"], ngram_vocab_size_base=512,
                indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                indexer_compress_ratio=2, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, hc_lowrank=8, ple_embed_dim=32,
                split_ngram_parts=8)),
            # ShieldGemma2: 16 image tokens (4 x 4 pooled from 8 x 8 patches); its special tokens and the
            # yes/no answer tokens it reads (config fields it does not declare) inside the tiny vocabulary
            "shieldgemma2": dict(mm_tokens_per_image=16, boi_token_index=3, eoi_token_index=4, image_token_index=5,
                                 yes_token_index=6, no_token_index=7),
            # Bamba, Granite MoE hybrid: an attention layer beside the Mamba one (their defaults have none
            # at 2 layers, and their cache then cannot tell a sequence length)
            "bamba": dict(attn_layer_indices=[1]),
            "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
            # Cohere Compass: its default config has no rotary parameters for its layers' type
            "cohere_compass_text": dict(rope_parameters={"full_attention": dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])}),
            # "task:family": fields for one task's model only (Reformer's LM head must be a decoder)
            "causal:reformer": dict(is_decoder=True),
            # Perceiver's masked LM decodes one query per position of max_position_embeddings: the sequence's
            "masked:perceiver": dict(max_position_embeddings=SEQ)}
# causal families whose model (Qwen3_5ForCausalLM, ...) is built from a text config, not their composite
# config (which lacks its vocab_size or pad_token_id)
TEXT_CONFIG = {"emu3", "llama4", "musicgen", "musicgen_melody", "qwen3_5", "qwen3_5_moe", "qwen4_exp"}
# seq2seq families whose forward makes no decoder inputs from the labels (FSMT shifts the input ids)
GIVEN_DECODER_IDS = {"fsmt"}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}


# ZERO_MATRICES: weight matrices a family initializes to zeros (Ernie 4.5 MoE's router, zero-init gates)
# are drawn N(0, 0.02) as training would have made them. At zeros, one SGD step gives most of a router's
# rows the same values, and which of the exactly tied experts top-k picks is then decided by rounding
# (eager's float32 picks differ from float64's for 6 of 32 tokens): a row that measures tie-breaking,
# not a compiler (benchmarks/results/sweep-cpu-2026-12-07.md).


def families(tasks: list[str]) -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto
    return [(t, name) for t in tasks for name in sorted(getattr(modeling_auto, MAPPINGS[t]))]


def _tiny_value(key: str, default, tiny: dict, lists: bool = True):
    if lists and isinstance(default, (list, tuple)) and key in LISTS and all(isinstance(v, int) for v in default):
        return LISTS[key](len(default))
    if tiny.get(key) is not None and (isinstance(default, int) and not isinstance(default, bool) or default is None):
        return tiny[key]
    if "drop" in key and isinstance(default, float):  # dropout, *_pdrop, drop_path_rate, layerdrop, ...
        return 0.0
    if "drop" in key and isinstance(default, (list, tuple)) and all(isinstance(v, float) for v in default):
        return [0.0] * len(default)
    if key.endswith("token_id") and isinstance(default, int) and default >= VOCAB:
        return TOKEN_IDS.get(key, 2)
    if key.endswith("token_id") and isinstance(default, list) and any(v >= VOCAB for v in default):
        return [TOKEN_IDS.get(key, 2)]
    return default


def tiny_config(cfg_cls, tiny: dict = TINY, lists: bool = True):
    """cfg_cls with tiny sizes where it has the fields, its sub-configs (text_config, ...) likewise;
    lists=False keeps list fields (stage depths, widths) as they are."""
    default = cfg_cls()
    kw = {}
    for key in inspect.signature(cfg_cls.__init__).parameters:
        try:
            value = getattr(default, key)
        except Exception:  # noqa: BLE001  (absent, or a per-layer attribute that refuses a global read)
            continue
        new = _tiny_value(key, value, tiny, lists)
        if new is not value and new != value:
            kw[key] = new
    params = inspect.signature(cfg_cls.__init__).parameters
    for key in getattr(cfg_cls, "sub_configs", None) or {}:  # by the default's class (AutoConfig ones too)
        sub = getattr(default, key, None)
        if key in params and hasattr(sub, "to_dict") and hasattr(type(sub), "model_type"):
            kw[key] = tiny_config(type(sub), tiny, lists)
    return cfg_cls(**kw)


def _model_cls(task: str, name: str):
    """The transformers class the task's auto mapping names for the family."""
    import transformers
    from transformers.models.auto import modeling_auto
    cls_name = getattr(modeling_auto, MAPPINGS[task])[name]
    return getattr(transformers, cls_name if isinstance(cls_name, str) else cls_name[0])


def build(task: str, name: str, attn: str | None, variant: int = 0, experts_eager: bool = False):
    """(make, inputs): make() seeds and returns the model in train mode; variant: of VARIANTS;
    experts_eager: a mixture of experts' experts as plain loops."""
    import torch
    import transformers
    from transformers.models.auto import configuration_auto
    model_cls = _model_cls(task, name)
    cfg_cls = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES[name])
    if name in TEXT_CONFIG:  # the mapping's model takes the composite's text config
        cfg_cls = model_cls.config_class
    own = {**FAMILIES.get(name, {}), **FAMILIES.get(f"{task}:{name}", {})}
    if own.pop("defaults", False):  # the config's own sizes (dropout zeroed), then the family's fields
        cfg = tiny_config(cfg_cls, {}, lists=False)
        for key, value in own.items():
            setattr(cfg, key, value)
    else:  # (sizes through the constructor, TINY's way; other fields, such as tuples, set after it)
        cfg = tiny_config(cfg_cls, {**TINY, **own, **VARIANTS[variant][1]})
        for key, value in own.items():
            # (a bool is an int the constructor skips, as is a field the config does not declare;
            # "attn_config.rope_theta": a sub-config's field)
            if not isinstance(value, int) or isinstance(value, bool) or "." in key or not hasattr(cfg, key):
                *path, last = key.split(".")
                setattr(functools.reduce(getattr, path, cfg), last, value)
    if task == "image":
        cfg.num_labels = 3
    if task != "image" and getattr(cfg, "pad_token_id", 0) is None:  # a padding id some models need (ESM)
        cfg.pad_token_id = 0
    if task == "seq2seq":  # some configs leave these to the generation config; labels need them here
        if getattr(cfg, "decoder_start_token_id", None) is None:  # (composite configs: their text config's)
            text = cfg.get_text_config()
            cfg.decoder_start_token_id = getattr(cfg, "pad_token_id", None) or getattr(text, "pad_token_id", None) or 0
    kw = {"attn_implementation": attn} if attn else {}
    if experts_eager:
        kw["experts_implementation"] = "eager"

    def make():
        torch.manual_seed(0)
        model = model_cls._from_config(cfg, **kw).train()
        if hasattr(model, "set_default_language"):  # X-MOD's adapters: one language's
            model.set_default_language(cfg.languages[0])
        with torch.no_grad():  # zero-initialized matrices (routers, zero-init gates): see ZERO_MATRICES
            for p in model.parameters():
                if p.dim() >= 2 and p.is_floating_point() and not p.any():
                    p.normal_(0.0, 0.02)
        return model

    gen = torch.Generator().manual_seed(1)
    takes = inspect.signature(model_cls.forward).parameters
    if task == "image" and "spatial_shapes" in takes:  # NaFlex (Siglip2): patches of each image, as rows
        vision = getattr(cfg, "vision_config", cfg)
        side, patch = math.isqrt(vision.num_patches), vision.patch_size
        mask = torch.ones(BATCH, side * side, dtype=torch.long)
        mask[1, -side:] = 0  # the second image a row of patches shorter: padding
        inputs = dict(pixel_values=torch.randn(BATCH, side * side, 3 * patch * patch, generator=gen),
                      pixel_attention_mask=mask, spatial_shapes=torch.tensor([[side, side], [side - 1, side]]),
                      labels=torch.randint(0, 3, (BATCH,), generator=gen))
    elif task == "image" and "input_ids" in takes and "pixel_values" in takes:  # ShieldGemma2: a prompt and an image
        size, n_image = cfg.vision_config.image_size, cfg.mm_tokens_per_image
        ids = torch.randint(8, cfg.text_config.vocab_size, (BATCH, SEQ + n_image + 2), generator=gen)
        ids[:, 1] = cfg.boi_token_index  # a text token, the image's tokens between its begin and end tokens
        ids[:, 2:2 + n_image] = cfg.image_token_index
        ids[:, 2 + n_image] = cfg.eoi_token_index
        inputs = dict(input_ids=ids, pixel_values=torch.randn(BATCH, 3, size, size, generator=gen),
                      attention_mask=torch.ones_like(ids), token_type_ids=(ids == cfg.image_token_index).long())
    elif task == "image" and "pixel_values" not in takes:  # ImageGPT: an image as ids of its colour clusters
        inputs = dict(input_ids=torch.randint(0, cfg.vocab_size - 1, (BATCH, SEQ), generator=gen),
                      labels=torch.randint(0, 3, (BATCH,), generator=gen))
    elif task == "image":
        size = getattr(cfg, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        inputs = dict(pixel_values=torch.randn(BATCH, 3, size, size, generator=gen),
                      labels=torch.randint(0, 3, (BATCH,), generator=gen))
    else:
        vocab = getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size", VOCAB)
        ids = torch.randint(3, vocab, (BATCH, SEQ), generator=gen)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -4:] = 0
        # a seq2seq mapping's decoder-only models (audio LMs, text-only here) predict their own ids
        decoder = task == "seq2seq" and getattr(cfg, "is_encoder_decoder", True)
        labels = torch.randint(3, vocab, (BATCH, TGT), generator=gen) if decoder else ids.clone()
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
        if "input_features" in takes and hasattr(cfg, "default_num_delay_tokens"):  # Voxtral Realtime: audio frames
            # added to the tokens' embeddings one to one (the encoder's stride 2, downsample_factor frames a token)
            frames = SEQ * 2 * cfg.downsample_factor
            inputs["input_features"] = torch.randn(BATCH, cfg.audio_config.num_mel_bins, frames, generator=gen)
        codebooks = getattr(cfg, "num_codebooks", None)
        if task == "causal" and codebooks:  # MusicGen: a sample's ids are a row of audio codes per codebook
            ids = torch.randint(3, vocab, (BATCH * codebooks, SEQ), generator=gen)
            inputs.update(input_ids=ids, labels=ids.view(BATCH, codebooks, SEQ).transpose(1, 2).contiguous())
        if decoder and name in GIVEN_DECODER_IDS:  # the labels shifted right, as the others do within
            inputs["decoder_input_ids"] = torch.cat([torch.full((BATCH, 1), cfg.decoder_start_token_id), labels[:, :-1]], 1)
    if not any(p.kind == p.VAR_KEYWORD for p in takes.values()):
        inputs = {k: v for k, v in inputs.items() if k in takes}
    return make, inputs


def _eager_check(make, inputs, dtype) -> None:
    """Forward and backward in eager, in dtype (a model that cannot run in float64 is compared against
    eager alone by compare_models, with a note)."""
    for dt in (dtype,):
        model = make().to(dt)
        loss_of(model(**{k: v.to(dt) if v.is_floating_point() else v for k, v in inputs.items()})).backward()


def loss_of(out):
    """The output's loss; where it has none (PP-LCNet's model ignores labels), the sum of its outputs
    that require grad, in float32."""
    from aotfuse.testing import _named_tensors
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = sum(t.float().sum() for t in _named_tensors(out).values() if t.requires_grad)
    return loss


class NotRunnable(Exception):
    """No variant of a family's tiny build runs in eager; the message is the first variant's error."""


def has_experts(task: str, name: str) -> bool:
    """Whether the family's model can run its experts another way (transformers' heuristic: its
    modeling file uses `use_experts_implementation`)."""
    return bool(getattr(_model_cls(task, name), "_can_set_experts_implementation", lambda: False)())


def first_runnable(task: str, name: str, attn: str | None, dtype) -> tuple:
    """(make, inputs, label) of the first of VARIANTS whose tiny build runs forward and backward in eager
    in dtype, and the label saying which (a mixture of experts tries each variant with its own experts
    first, then with them as plain loops); NotRunnable with the first variant's error where none does."""
    first = None
    loops = (False, True) if has_experts(task, name) else (False,)
    # a family built at its config's own sizes takes no variant: one build
    variants = VARIANTS[:1] if FAMILIES.get(name, {}).get("defaults") else VARIANTS
    for variant, (label, _) in enumerate(variants):
        for experts_eager in loops:
            try:
                make, inputs = build(task, name, attn, variant, experts_eager)
                _eager_check(make, inputs, dtype)
                return make, inputs, ", ".join(filter(None, ["experts eager" if experts_eager else "", label]))
            except Exception as e:  # noqa: BLE001 - the tiny config's own errors
                first = first or _first_line(e)
    raise NotRunnable(first)


def _ops_below_float64(make, inputs) -> int:
    """How many ATen ops of the model's eager float64 forward give floating tensors of a lower
    precision: a model that casts to float32 itself (Qwen3.5's gated delta rule and gated RMS norm)
    runs those parts in float32 in the float64 run too, so differences of float32's size are expected
    there."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += sum(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                          for t in tree_leaves(out))
            return out

    model = make().double()
    with torch.no_grad(), Count() as count:
        model(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
    return count.n


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _aotfuse_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}aotfuse{os.sep}" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("testing.py")] or frames  # not the harness's own
    return f"{os.path.relpath(frames[-1].filename, os.path.join(HERE, '..'))}:{frames[-1].lineno} " \
           f"in {frames[-1].name}" if frames else "-"


def _report(report) -> dict:
    def line(m):
        return (f"{m.model} {str(m.dtype)[6:]} step {m.step} {m.what}: {m.failed} (abs {m.max_abs_err:.3g}, "
                f"rel {m.max_rel_err:.3g}, aotfuse-vs-fp64 {m.aotfuse_err:.3g}, eager-vs-fp64 {m.eager_err:.3g}, "
                f"allowed {m.allowed:.3g}{'; ' + m.detail if m.detail else ''})")
    return dict(ok=report.ok, mismatches=len(report.mismatches), first=[line(m) for m in report.mismatches[:3]],
                summary=str(report).splitlines()[0], notes=len(report.notes))


def run_one(task: str, name: str, dtype_name: str, attn: str | None, entry: str = "mef") -> dict:
    """One row, in this process; entry: how the model is compiled ("mef": memory_efficient_fusion with
    fallback="error", and Dynamo's fallback where it cannot capture; "torch.compile":
    torch.compile(model, backend="aotfuse"), Dynamo's graphs each compiled by aotfuse)."""
    import torch
    import aotfuse
    from aotfuse.testing import compare_models
    torch.set_num_threads(1)
    dtype = getattr(torch, DTYPES[dtype_name])
    try:
        make, inputs, label = first_runnable(task, name, attn, dtype)
    except NotRunnable as e:
        return dict(cls="skipped", detail=str(e))
    print(EAGER_OK, flush=True)  # what runs from here on is aotfuse's

    def compare(compile_fn=None):
        try:
            return _report(compare_models(make, inputs, dtype=dtype, steps=2, name=name, compile_fn=compile_fn))
        except Exception as e:  # noqa: BLE001
            cause = [ln for ln in str(e).splitlines() if ln.startswith("Cause:")]  # CaptureError's own line
            return dict(error=_first_line(e) + (f" {cause[0][:200]}" if cause else ""), frame=_aotfuse_frame(e),
                        capture=isinstance(e, aotfuse.CaptureError))

    res = compare(None if entry == "mef" else lambda m: torch.compile(m, backend="aotfuse"))
    if res.get("capture"):
        res = dict(cls="capture error", detail=res["error"],
                   dynamo=compare(lambda m: aotfuse.memory_efficient_fusion(m, fallback="dynamo")))
    elif "error" in res:
        res = dict(cls="aotfuse error", detail=f"{res['error']} [at {res['frame']}]")
    else:
        res["cls"] = "ok" if res["ok"] else "mismatch"
    if res["cls"] == "mismatch" and dtype != torch.float64:  # the same program in float64: a bug or rounding?
        try:
            res["float64"] = _report(compare_models(make, inputs, dtype=torch.float64, steps=2, name=name))
            res["float64"]["below"] = _ops_below_float64(make, inputs)
        except Exception as e:  # noqa: BLE001
            res["float64"] = dict(error=_first_line(e))
    return dict(res, variant=label)


def run_sub(task: str, name: str, dtype: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, dtype, "--task", task, "--entry", args.entry]
    cmd += ["--attn", args.attn] if args.attn else []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    def limit_memory():  # a MemoryError in the child, not the OOM killer's pick of either job
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (args.mem_gb << 30, args.mem_gb << 30))

    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                           preexec_fn=limit_memory if args.mem_gb else None)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
        err = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        if lines:
            res = json.loads(lines[-1][len(MARK):])
        elif EAGER_OK in p.stdout:
            res = dict(cls="crash", detail=f"rc={p.returncode}: {err[-1][:300] if err else ''}")
        else:
            res = dict(cls="skipped", detail=f"tiny build / eager check crashed, rc={p.returncode}: "
                                              f"{err[-1][:300] if err else ''}")
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        res = (dict(cls="timeout", detail=f"over {args.timeout} s") if EAGER_OK in out else
               dict(cls="skipped", detail=f"tiny build / eager check over {args.timeout} s"))
    return dict(res, task=task, name=name, dtype=dtype, seconds=time.time() - start)


def describe(r: dict) -> str:
    if "text" in r:  # a row read back by --resume
        return r["text"]
    return (f"[{r['variant']}] " if r.get("variant") else "") + _describe(r)


def _describe(r: dict) -> str:
    if r["cls"] == "ok":
        return r["summary"].split(": ", 1)[-1]
    if r["cls"] == "mismatch":
        f64 = r.get("float64")
        verdict = ("" if f64 is None else f"<br>float64 run: ERROR {f64['error']}" if "error" in f64
                   else f"<br>float64 run: {f64['summary'].split(': ', 1)[-1]}" if f64["ok"]
                   else f"<br>float64 run: {f64['mismatches']} MISMATCHES"
                   + (f" (the model's own float64 forward runs {f64['below']} ops in lower precision: differences of"
                      f" that size are expected)" if f64.get("below") else "") + ": " + "<br>".join(f64["first"]))
        return f"{r['mismatches']} mismatches: " + "<br>".join(r["first"]) + verdict
    if r["cls"] == "capture error":
        d = r["dynamo"]
        dyn = (f"dynamo: {'ok' if d['ok'] else 'MISMATCH ' + '<br>'.join(d['first'])}" if "ok" in d
               else f"dynamo: ERROR {d['error']} [at {d['frame']}]")
        return f"{r['detail']}<br>{dyn}"
    return r["detail"]


def header(args) -> str:
    import torch
    import transformers
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                   .stdout.splitlines() if ln.startswith("Model name"))
    except (StopIteration, OSError):
        cpu = platform.processor()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return (f"{platform.node()}, {cpu}, {os.cpu_count()} cores, avx512 {'yes' if 'avx512f' in flags else 'no'}, "
            f"{platform.platform()}; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"{datetime.date.today()}; `python {' '.join(sys.argv)}`")


def write(path: str, head: str, rows: list[dict], total: int, elapsed: float) -> None:
    classes = ["ok", "mismatch", "capture error", "aotfuse error", "skipped", "timeout", "crash"]
    counts = {c: sum(r["cls"] == c for r in rows) for c in classes}
    out = ["# aotfuse correctness sweep over HF model families (CPU)", "", head, "",
           f"{len(rows)} of {total} rows done in {elapsed / 60:.1f} min. compare_models, 2 SGD steps, batch {BATCH}, "
           f"seq {SEQ} (seq2seq labels {TGT}), tiny configs, dropout 0.", "",
           "| class | rows |", "| --- | --- |"] + [f"| {c} | {n} |" for c, n in counts.items()]
    out += ["", "| task | model | dtype | class | s | detail |", "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["task"], r["name"], r["dtype"])):
        detail = describe(r).replace("|", "\\|").replace("\n", " ")
        out.append(f"| {r['task']} | {r['name']} | {r['dtype']} | {r['cls']} | {r['seconds']:.0f} | {detail} |")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def read_rows(path: str) -> tuple[str, float, list[dict]]:
    """(header line, minutes, rows) of a results file that write() made, for --resume."""
    lines = open(path).read().splitlines()
    minutes = float(lines[4].split(" done in ")[1].split(" min")[0])
    rows = []
    for ln in lines:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
        if len(cells) == 6 and cells[0] in MAPPINGS:
            rows.append(dict(task=cells[0], name=cells[1], dtype=cells[2], cls=cells[3], seconds=float(cells[4]),
                             text=cells[5].replace("\\|", "|")))
    return lines[2], minutes, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="causal,masked,seq2seq,image")
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--attn", default=None, help="attn_implementation (default: transformers' own choice)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--mem-gb", type=int, default=10, help="address-space limit of each row's process (0: none)")
    ap.add_argument("--resume", action="store_true", help="keep --out's rows (but crashes), run the rest")
    ap.add_argument("--out", default=os.path.join(HERE, "results", f"sweep-cpu-{datetime.date.today()}.md"))
    ap.add_argument("--one", nargs=2, metavar=("NAME", "DTYPE"))
    ap.add_argument("--task", default="causal", help="with --one")
    ap.add_argument("--entry", choices=("mef", "torch.compile"), default="mef",
                    help="memory_efficient_fusion (fallback 'error', then 'dynamo') or torch.compile(backend='aotfuse')")
    args = ap.parse_args(argv)
    if args.one:
        import warnings
        warnings.filterwarnings("ignore")
        print(MARK + json.dumps(run_one(args.task, args.one[0], args.one[1], args.attn, args.entry)), flush=True)
        return

    from tqdm import tqdm
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    todo = [(t, n, d) for t, n in families(args.tasks.split(",")) if (not only or n in only) and n not in skip
            for d in args.dtypes.split(",")]
    head, rows, start = header(args), [], time.time()
    if args.resume and os.path.exists(args.out):
        old_head, minutes, rows = read_rows(args.out)
        rows = [r for r in rows if r["cls"] != "crash" and (r["task"], r["name"], r["dtype"]) in todo]
        head, start = f"{old_head}; resumed: `python {' '.join(sys.argv)}`", start - 60 * minutes
        done = {(r["task"], r["name"], r["dtype"]) for r in rows}
        todo = [key for key in todo if key not in done]
        total = len(todo) + len(rows)
    else:
        total = len(todo)
    with cf.ThreadPoolExecutor(args.jobs) as pool, tqdm(total=total, initial=total - len(todo), unit="row") as bar:
        for fut in cf.as_completed([pool.submit(run_sub, t, n, d, args) for t, n, d in todo]):
            r = fut.result()
            rows.append(r)
            bar.set_postfix_str(f"{r['task']}/{r['name']} {r['dtype']}: {r['cls']}")
            bar.update()
            if r["cls"] not in ("ok", "skipped"):
                tqdm.write(f"{r['task']}/{r['name']} {r['dtype']}: {r['cls']}: {describe(r)[:300]}")
            write(args.out, head, rows, total, time.time() - start)
    counts = {c: sum(r["cls"] == c for r in rows) for c in dict.fromkeys(r["cls"] for r in rows)}
    print(f"{len(rows)} rows in {(time.time() - start) / 60:.1f} min: {counts}; wrote {args.out}")


if __name__ == "__main__":
    main()
