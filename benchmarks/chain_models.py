"""Chains of recomputed values the backward writes out anyway: eager against aotfuse with its default
partition and with AOTFUSE_RECOMPUTE_CHAINS=1, side by side in one process, on dropout-free models.

A value the backward writes out anyway (a linear layer's input) recomputed from another such value
makes that one early too: a residual stream of pointwise adds, or a post-norm transformer's norm
outputs, was rebuilt whole at the backward's start. By default (csrc/partition.c,
ban_chained_materialized) a recompute makes one such value; AOTFUSE_RECOMPUTE_CHAINS=1 keeps the cut
that rebuilt the chain. Models, fp32, training steps with the gradients set to None first:

  stack     N blocks x + gelu(layer_norm(linear(x))) (benchmarks/deep_chain.py's), width 256, batch 512
  bert, albert, gpt2, llama, t5   transformers' models at hidden 256, N layers, 4 heads, batch 4 x 128,
            every dropout 0, eager attention, random weights

For each: the median step of each contender (--steps steps, interleaved, the order rotating) and its
peak memory over one step beyond what it began with (torch's CPU allocation events, as aotfuse.bench
measures it), with ratios to eager's.

    python benchmarks/chain_models.py [--models stack,bert,albert,gpt2,llama,t5] [--layers 12] [--steps 5]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import aotfuse  # noqa: E402
from aotfuse.bench import _cpu_peak  # noqa: E402

MODELS = ("stack", "bert", "albert", "gpt2", "llama", "t5")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.lin(x)))


def build(name: str, layers: int):
    """(model, inputs as kwargs or a tuple, loss of the output)."""
    torch.manual_seed(0)
    if name == "stack":
        return nn.Sequential(*[Block(256) for _ in range(layers)]), (torch.randn(512, 256),), lambda out: out.sum()
    import transformers as tf

    h, vocab = 256, 8192
    if name == "bert":
        cfg, cls = tf.BertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=4,
                                 intermediate_size=1024, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0), tf.BertForMaskedLM
    elif name == "albert":
        cfg, cls = tf.AlbertConfig(vocab_size=vocab, embedding_size=128, hidden_size=h, num_hidden_layers=layers,
                                   num_attention_heads=4, intermediate_size=1024, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                                   hidden_act="gelu_new"), tf.AlbertForMaskedLM
    elif name == "gpt2":
        cfg, cls = tf.GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=4, n_inner=1024, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0, n_positions=256), tf.GPT2LMHeadModel
    elif name == "llama":
        cfg, cls = tf.LlamaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=688), tf.LlamaForCausalLM
    elif name == "t5":
        cfg, cls = tf.T5Config(vocab_size=vocab, d_model=h, d_kv=64, d_ff=1024, num_layers=layers, num_heads=4,
                               dropout_rate=0.0), tf.T5ForConditionalGeneration
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    model = cls._from_config(cfg, attn_implementation="eager").train()
    ids = torch.randint(3, vocab, (4, 128), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if name == "t5":
        inputs["decoder_input_ids"] = ids.clone()
    return model, inputs, lambda out: out.loss


def measure(name: str, layers: int, steps: int) -> dict:
    model, inputs, loss_of = build(name, layers)
    contenders = {"eager": copy.deepcopy(model)}
    saved_env = os.environ.get("AOTFUSE_RECOMPUTE_CHAINS")
    try:  # the variable is read when a program is lowered: each copy's first step
        for label, value in (("aotfuse", "0"), ("chains=1", "1")):
            os.environ["AOTFUSE_RECOMPUTE_CHAINS"] = value
            contenders[label] = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
            _step(contenders[label], inputs, loss_of)
    finally:
        if saved_env is None:
            os.environ.pop("AOTFUSE_RECOMPUTE_CHAINS", None)
        else:
            os.environ["AOTFUSE_RECOMPUTE_CHAINS"] = saved_env
    _step(contenders["eager"], inputs, loss_of)
    times = {k: [] for k in contenders}
    names = list(contenders)
    for rep in range(steps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            t = time.perf_counter()
            _step(contenders[k], inputs, loss_of)
            times[k].append(time.perf_counter() - t)
    return {k: (statistics.median(times[k]), _cpu_peak(lambda m=m: _step(m, inputs, loss_of)))
            for k, m in contenders.items()}


def _step(m, inputs, loss_of) -> None:
    for p in m.parameters():
        p.grad = None
    loss = loss_of(m(**inputs) if isinstance(inputs, dict) else m(*inputs))  # the outputs freed before the backward
    loss.backward()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.layers} layers, {args.steps} steps a contender, {args.threads} thread(s)")
    print("| model | eager step (ms) | aotfuse step (ms) | chains=1 step (ms) | eager peak (MB) | aotfuse peak (MB) "
          "| chains=1 peak (MB) | aotfuse/eager peak | chains=1/eager peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        r = measure(name, args.layers, args.steps)
        e, a, c = r["eager"], r["aotfuse"], r["chains=1"]
        print(f"| {name} | {e[0] * 1e3:.1f} | {a[0] * 1e3:.1f} | {c[0] * 1e3:.1f} | {e[1] / 1e6:.2f} | {a[1] / 1e6:.2f} "
              f"| {c[1] / 1e6:.2f} | {a[1] / e[1]:.3f} | {c[1] / e[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
