#!/usr/bin/env bash
# The one prepared check for a GPU machine (../shared/GPU_CHECK.md): versions, an in-place build with
# no network, the GPU test subset, the seed benchmark on the seed's shapes; logs and results under
# $OUT (default ./gpu-results); a short table printed last. Budget: well inside 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
start=$(date +%s)
{
  echo "== $(date -u +%FT%TZ)"
  nvidia-smi || true
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" || true
} 2>&1 | tee "$OUT/versions.txt"

echo "== build (in place, no network)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 || {
  echo "pip install failed, building the extension in place"; python3 setup.py build_ext --inplace >> "$OUT/build.log" 2>&1
  export PYTHONPATH="$PWD/python:${PYTHONPATH:-}"; }
python3 -c "import aotfuse, aotfuse._C as C; print('aotfuse', aotfuse.__version__, 'shim', sum(C.bridge_info().values()), 'of', len(C.bridge_info()))" | tee -a "$OUT/versions.txt"

python3 -c "import aotfuse._C as C, aotfuse.lower as L; L._add_nvrtc_search_dirs(); print('nvrtc', C.cuda_info(True))" \
  | tee -a "$OUT/versions.txt"

echo "== pytest -m cuda"
PER_TEST=""
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout 90"
timeout 170 python3 -m pytest tests/test_cuda.py tests/test_scatter.py tests/test_reuse.py tests/test_autocast.py tests/test_shapes.py tests/test_checkpointing.py -m cuda -q -rfE -p no:cacheprovider $PER_TEST > "$OUT/pytest-cuda.log" 2>&1
echo "pytest rc=$? ($(tail -n 1 "$OUT/pytest-cuda.log"))"

echo "== seed benchmark (cuda: seed shapes; fp32 then bf16; eager, aotfuse, torch.compile, eager-sdpa)"
# eager-sdpa: eager with torch's fused attention, no compile (seconds): how much of Inductor's bf16 lead
# is its attention rewrite (fuse_attention: SDPA on CUDA in fp16/bf16, skipped in fp32 without TF32)
# groups run dtype by dtype and results are written after each one; no new group after 140 s
timeout 215 python3 -m aotfuse.bench --device cuda --dtypes fp32,bf16 --backends eager,aotfuse,torch.compile,eager-sdpa \
  --repeats 10 --time-budget 140 --no-progress --out-dir "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"

echo "== bf16, Bert and GPT2: layer norm and softmax left to ATen (AOTFUSE_DECOMPOSE_NORMS=0's effect), and attention left eager (AOTFUSE_FUSE_ATTENTION=0's)"
timeout 75 python3 -m aotfuse.bench --device cuda --models BertForMaskedLM,GPT2LMHeadModel --dtypes bf16 \
  --backends eager,aotfuse-aten-norms,aotfuse-eager-attn --repeats 10 --time-budget 40 --no-progress --out-dir "$OUT" \
  --name hf-cuda-aten-norms-eager-attn > "$OUT/bench-aten-norms.log" 2>&1
echo "aten-norms bench rc=$?"

echo "== host-time profile (Bert, seed shapes, fp32): is the step bound by the host? and the top GPU kernels"
timeout 50 python3 benchmarks/profile_steps.py --device cuda --size seed --model BertForMaskedLM --steps 5 --threads 16 \
  --kernels > "$OUT/profile-bert-cuda.txt" 2>&1
echo "profile rc=$?"; sed -n 1,4p "$OUT/profile-bert-cuda.txt"; grep -A 4 -E "^(aotfuse|eager): one step" "$OUT/profile-bert-cuda.txt"

echo "== epilogue kernels (decomposed softmax / layer norm, seed Bert shapes) against ATen's"
timeout 35 python3 benchmarks/epilogues.py --device cuda > "$OUT/epilogues-cuda.md" 2>&1
echo "epilogues rc=$?"; grep -E '^\| (layer_norm|add|softmax \||cross)' "$OUT/epilogues-cuda.md" | cut -c1-140

echo "== summary ($(( $(date +%s) - start )) s)"
for f in "$OUT"/hf-cuda*.md; do [ -f "$f" ] && grep -E '^\| (model|[A-Za-z]+For|GPT2)' "$f" | cut -c1-200; done
grep -E "^(FAILED|ERROR)" "$OUT/pytest-cuda.log" | cut -c1-200 | head -n 20
tail -n 3 "$OUT/pytest-cuda.log"
