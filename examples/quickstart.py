"""Quickstart: train a small transformer block with aotfuse and with eager, side by side.

    python examples/quickstart.py
Prints the loss of both at each step (they agree), what aotfuse compiled, and step times.
"""
import copy
import statistics
import time

import torch
import torch.nn as nn

import aotfuse


class Block(nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x, labels):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        logits = self.head(x.mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def main():
    torch.manual_seed(0)
    eager = Block()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(eager))
    x, labels = torch.randn(8, 16, 64), torch.randint(0, 10, (8,))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    times = {"eager": [], "aotfuse": []}
    for step in range(8):
        losses = []
        for name, model, opt in (("eager", eager, opts[0]), ("aotfuse", compiled, opts[1])):
            t0 = time.perf_counter()
            out = model(x, labels)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            times[name].append(time.perf_counter() - t0)
            losses.append(out["loss"].item())
        print(f"step {step}: eager loss {losses[0]:.6f}  aotfuse loss {losses[1]:.6f}")
    print(aotfuse.explain(compiled, x, labels))
    for name, t in times.items():
        print(f"{name:8s} median step {statistics.median(t[2:]) * 1e3:.2f} ms (after compile)")


if __name__ == "__main__":
    main()
