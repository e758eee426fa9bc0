"""The seed benchmark table: HF models' training step under eager, aotfuse, torch.compile and functorch.

A thin wrapper over aotfuse.bench (also `python -m aotfuse.bench`); every flag is aotfuse.bench's:
    python benchmarks/hf_models.py                         # CPU: reduced configs, fp32, a few minutes
    python benchmarks/hf_models.py --dtypes fp32,bf16      # also bf16
    python benchmarks/hf_models.py --device cuda           # the seed's shapes, fp32/fp16/bf16
    python benchmarks/hf_models.py --models BertForMaskedLM --backends eager,aotfuse --repeats 20
Results: benchmarks/results/hf-<device>-<date>.{md,csv,png}.
"""
from __future__ import annotations

import os
import sys

from aotfuse.bench import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out-dir" or a.startswith("--out-dir=") for a in argv):  # results/ beside this file
        argv += ["--out-dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    main(argv)
