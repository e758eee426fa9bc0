"""aotfuse's partitioner (C core) against torch's min_cut_rematerialization_partition, on the same
joint graphs: saved bytes and time, side by side, interleaved, medians and ratios.

    python benchmarks/partition.py [--layers 12] [--repeats 3] [--out benchmarks/results/partition-cpu.md]

Three timings per graph, each the median of --repeats interleaved runs on fresh copies:
  full      the whole partition_fn call (joint graph in, forward and backward GraphModules out);
            both use torch's FX extraction for the modules, under lazy GraphModule recompilation
  decision  choosing the saved set: torch's classify_nodes + choose_saved_values_set, against
            aotfuse's lowering of the joint graph into the C IR + the C min-cut
  C solve   the C min-cut alone, on an already lowered graph
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time

import torch
import torch.nn as nn
from torch._functorch import partitioners as torch_partitioners
from torch._functorch.aot_autograd import aot_function
from torch.fx._lazy_graph_module import _use_lazy_graph_module

import aotfuse
from aotfuse import _C
from aotfuse.lower import build_graph
from aotfuse.partition import _role


def _nop(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def capture(model: nn.Module, args: tuple) -> dict:
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(params)

    def f(*flat):
        return torch.func.functional_call(model, dict(zip(names, flat[:len(names)])), flat[len(names):])

    store: dict = {}

    def grab(joint, inputs, **kw):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            store["joint"] = copy.deepcopy(joint)
        store["inputs"], store["kw"] = inputs, kw
        return torch_partitioners.default_partition(joint, inputs, **kw)

    aot_function(f, _nop, _nop, partition_fn=grab, decompositions=aotfuse.default_decompositions())(
        *params.values(), *args)
    return store


def saved_bytes(fw, nfwd: int) -> int:
    outs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    vals = [o.meta.get("val") for o in list(outs)[nfwd:] if isinstance(o, torch.fx.Node)]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def torch_decision(joint, kw) -> None:
    info = torch_partitioners.classify_nodes(joint, [], kw["num_fwd_outputs"])
    for node in reversed(joint.graph.nodes):
        if node.op == "output" or info.is_required_fw(node):
            node.dist_from_bw = int(1e9)
            for user in (node.users if node.op != "output" else ()):
                node.dist_from_bw = min(node.dist_from_bw, user.dist_from_bw + 1)
        else:
            node.dist_from_bw = 0
    torch_partitioners.choose_saved_values_set(joint.graph, info, memory_budget=1.0)


def ours_decision(joint, kw):
    b = build_graph(joint)
    roles = bytes(_role(n) for n in b.input_nodes)
    nfwd = sum(1 for t in b.out_template[:kw["num_fwd_outputs"]] if t is None)
    return _C.partition(b.graph, roles, nfwd), (b.graph, roles, nfwd)


def models(layers: int):
    from transformers import (AlbertConfig, AlbertForMaskedLM, BertConfig, BertForMaskedLM, GPT2Config,
                              GPT2LMHeadModel)
    from transformers.models.bert.modeling_bert import BertLayer

    out = {"mlp_gelu": (nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
                        (torch.randn(32, 64, requires_grad=True),))}
    bcfg = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    bcfg._attn_implementation = "eager"

    class Stack(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.ModuleList([BertLayer(bcfg) for _ in range(n)])

        def forward(self, x):
            for layer in self.layers:
                o = layer(x)
                x = o[0] if isinstance(o, tuple) else o
            return x

    x = torch.randn(2, 16, 64, requires_grad=True)
    out["bert_layer"] = (Stack(1), (x,))
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    class Loss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss

    ids = torch.randint(0, 128, (2, 32))
    out["bert"] = (Loss(BertForMaskedLM(BertConfig(**common))), (ids,))
    out["albert"] = (Loss(AlbertForMaskedLM(AlbertConfig(embedding_size=32, **common))), (ids,))
    out["gpt2"] = (Loss(GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))), (ids,))
    out[f"bert_stack_{layers}"] = (Stack(layers), (x,))
    return out


def med(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (model, inputs) in models(args.layers).items():
        store = capture(model, inputs)
        joint, jin, kw = store["joint"], store["inputs"], store["kw"]
        fresh = lambda: copy.deepcopy(joint)  # noqa: E731
        res = {}
        with _use_lazy_graph_module(True):
            fw_t, _ = torch_partitioners.min_cut_rematerialization_partition(fresh(), jin, **kw)
            fw_o, _ = aotfuse.min_cut_rematerialization_partition(fresh(), jin, **kw)
            res["torch_bytes"], res["ours_bytes"] = saved_bytes(fw_t, kw["num_fwd_outputs"]), saved_bytes(fw_o, kw["num_fwd_outputs"])
            full = {"torch": [], "ours": []}
            dec = {"torch": [], "ours": []}
            for _ in range(args.repeats):  # interleaved
                for who, fn in (("torch", torch_partitioners.min_cut_rematerialization_partition),
                                ("ours", aotfuse.min_cut_rematerialization_partition)):
                    j = fresh()
                    t0 = time.perf_counter()
                    fn(j, jin, **kw)
                    full[who].append(time.perf_counter() - t0)
                for who, fn in (("torch", torch_decision), ("ours", ours_decision)):
                    j = fresh()
                    t0 = time.perf_counter()
                    fn(j, kw)
                    dec[who].append(time.perf_counter() - t0)
        _, (graph, roles, nfwd) = ours_decision(fresh(), kw)
        solve = med(lambda: _C.partition(graph, roles, nfwd), max(5, args.repeats))
        rows.append((name, len(joint.graph.nodes), res["torch_bytes"], res["ours_bytes"],
                     statistics.median(full["torch"]), statistics.median(full["ours"]),
                     statistics.median(dec["torch"]), statistics.median(dec["ours"]), solve))
        print(f"{name}: done", flush=True)
    lines = [
        "# Partitioner: aotfuse (C core) vs torch's min_cut_rematerialization_partition",
        "",
        f"machine: {platform.machine()}, {__import__('os').cpu_count()} CPUs | torch {torch.__version__} | "
        f"{datetime.date.today()} | medians of {args.repeats} interleaved runs",
        "",
        "| joint graph | nodes | saved bytes torch | saved bytes aotfuse | full torch (ms) | full aotfuse (ms) | "
        "full ratio | decision torch (ms) | decision aotfuse (ms) | decision ratio | C solve (ms) | torch decision / C solve |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name, nodes, tb, ob, ft, fo, dt, do, cs = r
        lines.append(f"| {name} | {nodes} | {tb} | {ob} | {ft * 1e3:.1f} | {fo * 1e3:.1f} | {ft / fo:.1f}x | "
                     f"{dt * 1e3:.1f} | {do * 1e3:.1f} | {dt / do:.1f}x | {cs * 1e3:.2f} | {dt / cs:.0f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
