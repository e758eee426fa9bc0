"""Micro-benchmarks for why aotfuse's Bert fp32 step (seed shapes) trailed eager's on an H200
(2026-12-04: 104% of eager's step, torch.compile 94%), one process, ~30-60 s there; part of
benchmarks/gpu_check.sh's `diag` part. On a CPU it runs too (a smoke test; its times mean nothing).

    python benchmarks/gpu_micro.py [--device cuda] [--iters 20] [--parts attn,lm,rng] [--vocab 30522]

attn: one layer's attention, forward + backward, fp32, [4, 12, 512, 64] (q/k/v as Bert makes them:
      views of [2048, 768] linear outputs), a zero float mask [4, 1, 512, 512], dropout 1e-8:
        eager      matmul * 0.125 + mask -> softmax -> dropout -> matmul, transpose.contiguous (what eager runs)
        memeff     aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 1e-8, scale=0.125)
                   (what aotfuse's SDPA rewrite runs on sm_90 for fp32)
        memeff-nomask / memeff-p0: the same without the mask / without dropout
      x12 = the model's 12 layers.
lm:   the LM head's backward GEMMs: whole (eager) against aotfuse's 8 vocabulary chunks (lm_grads.py:
      width 3840, partial products summed, dW chunks concatenated).
rng:  aotfuse's fused residual-add + dropout + layer norm (forward + backward, [4, 512, 768]) with
      dropout 1e-8 against 0: the cost of Threefry recomputed in each phase of the row kernels.
Times: CUDA events, median of --iters after warm-up, milliseconds.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def timeit(fn, iters, device):
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)
    ts = []
    for _ in range(max(2, iters // 5)):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def attn(device, iters):
    torch.manual_seed(0)
    B, H, L, D = 4, 12, 512, 64
    dev = torch.device(device)

    def qkv():
        # Bert: linear output [2048, 768] -> view [4, 512, 12, 64] -> transpose(1, 2)
        return [torch.randn(B * L, H * D, device=dev).view(B, L, H, D).transpose(1, 2).requires_grad_(True)
                for _ in range(3)]

    mask = torch.zeros(B, 1, L, L, device=dev)
    g = torch.randn(B, L, H * D, device=dev)

    def eager_step(q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
        p = F.dropout(F.softmax(s, dim=-1), p=1e-8, training=True)
        o = torch.matmul(p, v).transpose(1, 2).contiguous().view(B, L, H * D)
        o.backward(g)

    def memeff_step(q, k, v, m, p):
        o = aten._scaled_dot_product_efficient_attention(q, k, v, m, True, p, False, scale=0.125)[0]
        o.transpose(1, 2).reshape(B, L, H * D).backward(g)

    res = {}
    q, k, v = qkv()
    res["eager fwd+bwd"] = timeit(lambda: eager_step(q, k, v), iters, device)
    if device == "cuda":
        res["memeff fwd+bwd"] = timeit(lambda: memeff_step(q, k, v, mask, 1e-8), iters, device)
        res["memeff-nomask fwd+bwd"] = timeit(lambda: memeff_step(q, k, v, None, 1e-8), iters, device)
        res["memeff-p0 fwd+bwd"] = timeit(lambda: memeff_step(q, k, v, mask, 0.0), iters, device)

        def fwd_only():
            with torch.no_grad():
                aten._scaled_dot_product_efficient_attention(q.detach(), k.detach(), v.detach(), mask, False, 1e-8,
                                                             False, scale=0.125)
        res["memeff fwd only (no lse)"] = timeit(fwd_only, iters, device)

        def eager_fwd():
            with torch.no_grad():
                s = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
                torch.matmul(F.dropout(F.softmax(s, dim=-1), p=1e-8, training=True), v).transpose(1, 2).contiguous()
        res["eager fwd only"] = timeit(eager_fwd, iters, device)
    for name, ms in res.items():
        print(f"attn  {name:28s} {ms:8.3f} ms/layer   x12 = {12 * ms:7.2f} ms")


def lm(device, iters, vocab=30522):
    torch.manual_seed(0)
    T, V, Hd, K = 2048, vocab, 768, 8
    dev = torch.device(device)
    G = torch.randn(T, V, device=dev)
    W = torch.randn(V, Hd, device=dev)
    h = torch.randn(T, Hd, device=dev)
    width = -(-(-(-V // K)) // 64) * 64

    def whole():
        G.mm(W)                      # dh: [2048 x 30522] @ [30522 x 768]
        h.t().mm(G)                  # dW^T as eager's AddmmBackward: [768 x 2048] @ [2048 x 30522]
        G.sum(0)

    chunks = [(lo, min(V, lo + width)) for lo in range(0, V, width)]
    Gc = [G[:, lo:hi].contiguous() for lo, hi in chunks]  # aotfuse makes each chunk in its own buffer

    def chunked():
        parts, dws, sums = [], [], []
        for (lo, hi), gc in zip(chunks, Gc):
            parts.append(gc.mm(W[lo:hi]))
            dws.append(gc.t().mm(h))
            sums.append(gc.sum(0, keepdim=True))
        torch.stack(parts).sum(0)    # aotfuse: one fused add kernel of the 8 partial products
        torch.cat(dws, 0)
        torch.cat(sums, 1)

    def chunked_mm_only():
        for (lo, hi), gc in zip(chunks, Gc):
            gc.mm(W[lo:hi])
            gc.t().mm(h)

    def whole_mm_only():
        G.mm(W)
        h.t().mm(G)

    for name, fn in (("whole (eager)", whole), ("8 chunks (aotfuse)", chunked),
                     ("whole, 2 mm only", whole_mm_only), ("8 chunks, 16 mm only", chunked_mm_only)):
        ms = timeit(fn, iters, device)
        print(f"lm    {name:28s} {ms:8.3f} ms   ({2 * 2 * T * V * Hd / ms / 1e9:6.1f} TFLOP/s over the 2 GEMMs)")


def rng(device, iters):
    import os
    import aotfuse
    torch.manual_seed(0)
    dev = torch.device(device)
    x = torch.randn(4, 512, 768, device=dev, requires_grad=True)
    r = torch.randn(4, 512, 768, device=dev, requires_grad=True)
    ln = torch.nn.LayerNorm(768).to(dev)
    g = torch.randn(4, 512, 768, device=dev)
    for p in (1e-8, 0.0):
        class Blk(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ln, self.drop = ln, torch.nn.Dropout(p)

            def forward(self, x, r):
                return self.ln(self.drop(x) + r)
        m = Blk().train()
        from aotfuse.decompositions import default_decompositions
        variants = [("eager", m), ("aotfuse", aotfuse.memory_efficient_fusion(m))]
        if p:  # ATen's dropout (Philox, mask saved) inside aotfuse: AOTFUSE_FALLBACK_RANDOM=1's effect
            variants.append(("aotfuse-fallback-random",
                             aotfuse.memory_efficient_fusion(m, decompositions=default_decompositions(random=False))))
        for name, fn in variants:
            def step():
                fn(x, r).backward(g)
            ms = timeit(step, iters, device)
            print(f"rng   {name:24s} p={p:g}  dropout+add+LN fwd+bwd {ms:8.3f} ms  (x25 sites = {25 * ms:6.2f} ms)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--parts", default="attn,lm,rng")
    ap.add_argument("--vocab", type=int, default=30522, help="the LM head's width (Bert's 30522)")
    a = ap.parse_args()
    print(f"torch {torch.__version__} device {torch.cuda.get_device_name(0) if a.device == 'cuda' else 'cpu'} "
          f"tf32 {torch.backends.cuda.matmul.allow_tf32 if a.device == 'cuda' else '-'}")
    parts = {"attn": attn, "lm": lambda d, n: lm(d, n, a.vocab), "rng": rng}
    for part in a.parts.split(","):
        if part not in parts:
            ap.error(f"unknown part {part!r}: choose from {', '.join(parts)}")
        parts[part](a.device, a.iters)


if __name__ == "__main__":
    main()
