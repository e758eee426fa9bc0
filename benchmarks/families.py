"""Model families beyond the seed's four: eager, aotfuse and torch.compile training steps side by side in
one process, on the CPU, with ratios to eager's step time and peak memory.

The seed table (benchmarks/hf_models.py) measures Albert, GPT2, Bert and Longformer. A user brings
other models: decoder-only ones with rotary embeddings, RMS norm and gated SiLU feed-forwards (Llama,
Mistral, Qwen2), encoder-decoders (T5, BART), vision transformers and convolutional networks. Each is
built from its transformers config class with random weights (nothing is downloaded), at one small
size, every dropout of its config set to 1e-8 (drawn, nearly without effect, so the losses compare),
eager attention, fp32 or bf16.

For each model and contender: the median of --steps training steps (gradients set to None, forward,
loss, backward; contenders interleaved, the order rotating), the peak CPU allocation over one step
beyond its start (`aotfuse.bench._cpu_peak`, as the seed table measures it), the first step's time
(the compile), and the loss of a step from the same weights against eager's (the numeric check: the
relative difference must stay below 1e-3 in fp32 and 2e-2 in bf16, else the row says MISMATCH; with
--dropout 1e-3 or more each contender draws its own masks, and the row only says whether the losses are
finite).

    python benchmarks/families.py [--models llama,mistral,...] [--dtype fp32|bf16|fp16] [--steps 10] [--threads 1]
                                  [--contenders eager,aotfuse,torch.compile] [--channels-last] [--dropout 1e-8]
                                  [--attn eager|sdpa] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import math
import copy
import datetime
import os
import platform
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import aotfuse  # noqa: E402
from aotfuse.bench import _cpu_peak, _quiet_dropout  # noqa: E402

H, LAYERS, HEADS, VOCAB, BATCH, SEQ = 256, 4, 4, 8192, 4, 128
IMAGE, IMAGES = 64, 16


def _text(cfg_cls, model_cls, **kw):
    return lambda: (cfg_cls(**kw), model_cls, "text")


def _configs() -> dict:
    import transformers as tf

    dec = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               intermediate_size=688, max_position_embeddings=256)
    return {
        "llama": _text(tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=HEADS, **dec),
        "mistral": _text(tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2, **dec),
        "qwen2": _text(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=2, **dec),
        # mixture of experts (transformers' grouped-matmul experts: one graph since aotfuse/moe.py, 2026-12-06)
        "mixtral": _text(tf.MixtralConfig, tf.MixtralForCausalLM, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2, **dec),
        "gpt-neox": _text(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, vocab_size=VOCAB, hidden_size=H,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=4 * H,
                          max_position_embeddings=256),
        "roberta": _text(tf.RobertaConfig, tf.RobertaForMaskedLM, vocab_size=VOCAB, hidden_size=H,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=4 * H),
        "distilbert": _text(tf.DistilBertConfig, tf.DistilBertForMaskedLM, vocab_size=VOCAB, dim=H,
                            n_layers=LAYERS, n_heads=HEADS, hidden_dim=4 * H),
        "electra": _text(tf.ElectraConfig, tf.ElectraForMaskedLM, vocab_size=VOCAB, embedding_size=H,
                         hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         intermediate_size=4 * H),
        "deberta-v2": _text(tf.DebertaV2Config, tf.DebertaV2ForMaskedLM, vocab_size=VOCAB, hidden_size=H,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=4 * H,
                            max_position_embeddings=256),
        # asks `lengths.max().item() <= slen` of its ids (answered and guarded: aotfuse/decisions.py)
        "flaubert": _text(tf.FlaubertConfig, tf.FlaubertWithLMHeadModel, vocab_size=VOCAB, emb_dim=H, n_layers=LAYERS,
                          n_heads=HEADS, max_position_embeddings=256),
        # reads 0-d position tensors as arange bounds, worked out from the length: each length is traced on
        # its own (its family's trace fails at once since 2026-12-07: decisions.SizeDependentDecision)
        "funnel": _text(tf.FunnelConfig, tf.FunnelForMaskedLM, vocab_size=VOCAB, d_model=H, n_head=HEADS,
                        d_head=H // HEADS, d_inner=4 * H, block_sizes=[LAYERS // 2, LAYERS // 2],
                        num_decoder_layers=1),
        "t5": _text(tf.T5Config, tf.T5ForConditionalGeneration, vocab_size=VOCAB, d_model=H, d_kv=H // HEADS,
                    d_ff=4 * H, num_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0),
        "bart": _text(tf.BartConfig, tf.BartForConditionalGeneration, vocab_size=VOCAB, d_model=H,
                      encoder_layers=LAYERS // 2, decoder_layers=LAYERS // 2, encoder_attention_heads=HEADS,
                      decoder_attention_heads=HEADS, encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H,
                      max_position_embeddings=256),
        "vit": lambda: (tf.ViTConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=4 * H, image_size=IMAGE, patch_size=8, num_labels=10),
                        tf.ViTForImageClassification, "image"),
        "convnext": lambda: (tf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2],
                                               num_labels=10, image_size=IMAGE),
                             tf.ConvNextForImageClassification, "image"),
        "resnet": lambda: (tf.ResNetConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                           embedding_size=32, num_labels=10),
                           tf.ResNetForImageClassification, "image"),
        "swin": lambda: (tf.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=32, depths=[2, 2],
                                       num_heads=[2, 4], window_size=4, num_labels=10),
                         tf.SwinForImageClassification, "image"),
        # depthwise convolutions: MobileNetV2's all 3x3, EfficientNet-B0's 3x3 and 5x5 (2026-12-05)
        "mobilenet-v2": lambda: (tf.MobileNetV2Config(image_size=IMAGE, num_labels=10),
                                 tf.MobileNetV2ForImageClassification, "image"),
        "efficientnet": lambda: (tf.EfficientNetConfig(image_size=IMAGE, width_coefficient=1.0, depth_coefficient=1.0,
                                                       hidden_dim=1280, num_labels=10),
                                 tf.EfficientNetForImageClassification, "image"),
    }


# Families whose forward one graph cannot hold run in Dynamo's pieces, as the seed table runs Longformer:
# none now. BART was one until 2026-12-06 (LayerDrop's `torch.rand([]) < 0.0` read a tensor's value; a
# capture now answers such a test where the probability decides it: aotfuse/draws.py).
FALLBACK: dict[str, str] = {}


def build(name: str, dtype: torch.dtype, channels_last: bool = False, dropout: float = 1e-8,
          attn: str = "eager"):
    """(model, inputs) for one family, seed 0 weights, seed 1 inputs; channels_last: an image model and
    its images in that memory format (what CNN training on a CPU often uses); dropout: every dropout
    probability of the config (0: none drawn, the configs' default for Llama, Mistral, Qwen2); attn: the
    attention implementation where the model takes one ("sdpa": transformers' default)."""
    cfg, cls, kind = _configs()[name]()
    _quiet_dropout(cfg, dropout)
    for key in ("drop_path_rate", "drop_connect_rate", "layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    try:
        model = cls._from_config(cfg, attn_implementation=attn)
    except (ValueError, TypeError):
        model = cls._from_config(cfg)
    model = model.to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    if kind == "image":
        inputs = {"pixel_values": torch.randn(IMAGES, 3, IMAGE, IMAGE, generator=gen).to(dtype),
                  "labels": torch.randint(0, 10, (IMAGES,), generator=gen)}
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            inputs["pixel_values"] = inputs["pixel_values"].contiguous(memory_format=torch.channels_last)
    else:
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
        inputs = {"input_ids": ids, "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)}
    return model, inputs


def _compile(name: str, contender: str, model: torch.nn.Module):
    if contender == "eager":
        return model
    if contender == "aotfuse":
        return aotfuse.memory_efficient_fusion(model, fallback=FALLBACK.get(name, "error"))
    if contender == "torch.compile":
        return torch.compile(model)
    if contender == "aotfuse-dynamo":  # Dynamo's graphs, each lowered by aotfuse (what FALLBACK's "dynamo" runs)
        return torch.compile(model, backend="aotfuse")
    raise ValueError(f"unknown contender {contender!r}")


def _step(model, call, inputs) -> float:
    for p in model.parameters():
        p.grad = None
    loss = call(**inputs).loss
    loss.backward()
    return loss.item()


def run_model(name: str, dtype: torch.dtype, contenders: list[str], steps: int, channels_last: bool = False,
              dropout: float = 1e-8, attn: str = "eager") -> dict:
    # Dynamo's caches are per code object, and every model runs transformers' shared modules: without a
    # reset, a later model's torch.compile hits the recompile limit and runs eagerly (first step 0.1 s)
    torch._dynamo.reset()
    base, inputs = build(name, dtype, channels_last, dropout, attn)
    row = run_built(name, base, inputs, dtype, contenders, steps)
    row["drawn"] = dropout >= 1e-3  # dropout that changes the loss: each contender's draws are its own
    return row


def run_built(name: str, base: torch.nn.Module, inputs: dict, dtype: torch.dtype, contenders: list[str], steps: int) -> dict:
    """One table row: each contender's copy of `base` (its forward takes **inputs and returns an object
    with a `.loss`) trained --steps times, interleaved; medians, one step's peak, the first step's time,
    the loss check against eager's."""
    row = {"model": name, "params": sum(p.numel() for p in base.parameters())}
    models = {c: copy.deepcopy(base) for c in contenders}
    calls, first, losses = {}, {}, {}
    for c in contenders:
        calls[c] = _compile(name, c, models[c])
        t = time.perf_counter()
        losses[c] = _step(models[c], calls[c], inputs)  # same weights, same inputs: the numeric check
        first[c] = time.perf_counter() - t
    for c in contenders:
        _step(models[c], calls[c], inputs)
    times = {c: [] for c in contenders}
    for r in range(steps):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            t = time.perf_counter()
            _step(models[c], calls[c], inputs)
            times[c].append(time.perf_counter() - t)
    peaks = {c: _cpu_peak(lambda c=c: _step(models[c], calls[c], inputs)) for c in contenders}
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    for c in contenders:
        rel = abs(losses[c] - losses["eager"]) / max(abs(losses["eager"]), 1e-6)
        row[c] = {"ms": statistics.median(times[c]) * 1e3, "mb": peaks[c] / 1e6, "first_s": first[c],
                  "loss": losses[c], "ok": rel <= tol, "rel": rel}
    return row


def table(rows: list[dict], contenders: list[str]) -> str:
    others = [c for c in contenders if c != "eager"]
    head = ["model", "eager step (ms)", "eager peak (MB)"]
    for c in others:
        head += [f"{c} step % of eager", f"{c} peak % of eager", f"{c} first step (s)"]
    head.append("loss check")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | " + " | ".join(["-"] * (len(head) - 2)) + f" | error: {r['error']} |")
            continue
        e = r["eager"]
        cells = [r["model"], f"{e['ms']:.1f}", f"{e['mb']:.2f}"]
        for c in others:
            cells += [f"{100 * r[c]['ms'] / e['ms']:.0f}", f"{100 * r[c]['mb'] / e['mb']:.0f}",
                      f"{r[c]['first_s']:.1f}"]
        if r.get("drawn"):  # no loss to compare: only that each is finite
            bad = [f"{c} NON-FINITE loss" for c in others if not math.isfinite(r[c]["loss"])]
            cells.append("; ".join(bad) or "n/a (dropout draws differ; losses finite)")
        else:
            bad = [f"{c} MISMATCH ({r[c]['rel']:.1e})" for c in others if not r[c]["ok"]]
            cells.append("; ".join(bad) or "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(_configs()))
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--channels-last", action="store_true", help="image models and images in channels_last")
    ap.add_argument("--contenders", default="eager,aotfuse,torch.compile",
                    help="comma-separated: eager, aotfuse, torch.compile, aotfuse-dynamo "
                         "(torch.compile(model, backend='aotfuse'))")
    ap.add_argument("--dropout", type=float, default=1e-8,
                    help="every dropout probability of the configs (default 1e-8: drawn, nearly without effect; "
                         "0: none, the default of Llama's, Mistral's and Qwen2's configs)")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="the attention implementation (transformers' default is sdpa)")
    ap.add_argument("--out", default=None, help="also write the table, with machine and versions, to this file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    contenders = args.contenders.split(",")
    if contenders[0] != "eager":
        raise SystemExit("the first contender must be eager (the ratios' base)")
    known = _configs()
    rows = []
    for name in args.models.split(","):
        if name not in known:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(known)}")
        rows.append(row_or_error(name, contenders, lambda: run_model(name, dtype, contenders, args.steps, args.channels_last,
                                                                 args.dropout, args.attn)))
    write_table(rows, contenders, args.threads, f"transformers {transformers.__version__} | {args.dtype}"
                f"{' channels_last' if args.channels_last else ''} | {args.steps} steps | dropout {args.dropout:g}, "
                f"{args.attn} attention", args.out)


def row_or_error(name: str, contenders: list[str], run) -> dict:
    """run()'s row, or an error row where a contender cannot run the model; printed as it comes."""
    try:
        row = run()
    except Exception as exc:  # a contender that cannot run this model: say so and go on
        row = {"model": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    print(table([row], contenders).splitlines()[-1], flush=True)
    return row


def write_table(rows: list[dict], contenders: list[str], threads: int, what: str, out: str | None) -> None:
    """The table under a line naming the machine, versions, `what` and the date; printed, and written to out."""
    head = (f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {threads} torch thread(s) | python "
            f"{platform.python_version()} | torch {torch.__version__} | {what} | date {datetime.date.today()}")
    text = head + "\n\n" + table(rows, contenders) + "\n"
    print("\n" + text)
    if out:
        with open(out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
