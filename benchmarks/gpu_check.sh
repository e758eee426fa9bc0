#!/usr/bin/env bash
# The one prepared check for a GPU machine (../shared/GPU_CHECK.md): versions, an in-place build with
# no network, the GPU test subset, the seed benchmark on the seed's shapes; logs and results under
# $OUT (default ./gpu-results); a short table printed last.
#
# A lease is about 15 minutes, a machine's start included, so the check is cut into parts that two runs
# can share:
#   STEPS   comma-separated parts, run in this order: tests, fp32, bf16, diag, ab, profile, epilogues, fp16, tf32
#           (default: all but tf32; fp16 last, so the short diagnostic parts are not starved by a bench;
#           tf32: the fp32 table with TF32 matmuls for every contender, torch's default before 1.12 and so
#           likely the seed's A100 conditions)
#   BUDGET  seconds for the whole run (default 450): every part's timeout is cut to what is left, and a
#           part that would get under 30 s is skipped
#   TESTS   pytest node ids or files to run instead of the whole `-m cuda` subset (a rerun of failures)
#   MODELS  the bench's models (default the four seed models)
#   AB_DTYPE the ab part's dtype (default bf16; fp32 asks what the SDPA rewrite and the phased norm
#           kernels give where the matmuls are not on tensor cores)
# e.g. a first run:  STEPS=tests,fp32 BUDGET=330 bash benchmarks/gpu_check.sh
#      a second one: STEPS=bf16,tests TESTS="tests/test_cuda.py::test_x" BUDGET=300 bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
STEPS=",${STEPS:-tests,fp32,bf16,diag,ab,profile,epilogues,fp16},"
AB_DTYPE="${AB_DTYPE:-bf16}"
BUDGET="${BUDGET:-450}"
MODELS="${MODELS:-AlbertForMaskedLM,GPT2LMHeadModel,BertForMaskedLM,LongformerForMaskedLM}"
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
# cap WANT: WANT seconds, or what is left of the budget (less a margin for the summary) if that is less
cap() { local want=$1 l; l=$(( $(left) - 10 )); (( l < want )) && want=$l; echo "$want"; }
# part NAME WANT: whether NAME was asked for and at least 30 s of it fit
part() {
  [[ $STEPS == *",$1,"* ]] || return 1
  (( $(cap "$2") >= 30 )) && return 0
  echo "== $1 skipped: $(left) s of the budget left"; return 1
}

{
  echo "== $(date -u +%FT%TZ) steps ${STEPS:1:-1}, budget ${BUDGET} s"
  nvidia-smi || true
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" || true
  # which SDPA kernels torch may pick (cuDNN's attention first on sm_90 with a new cuDNN, in newer torch)
  python3 -c "import torch; b = torch.backends; print('cudnn', b.cudnn.version(), 'sdpa flash', b.cuda.flash_sdp_enabled(), 'efficient', b.cuda.mem_efficient_sdp_enabled(), 'cudnn', b.cuda.cudnn_sdp_enabled(), 'math', b.cuda.math_sdp_enabled())" || true
  nproc
} 2>&1 | tee "$OUT/versions.txt"

echo "== build (in place, no network)"
python3 setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build.log" 2>&1 || echo "build_ext failed (see build.log)"
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/build.log" 2>&1 || {
  echo "pip install failed: using PYTHONPATH=python (the torch.compile backend then registers on import aotfuse)"
  export PYTHONPATH="$PWD/python:${PYTHONPATH:-}"; }
python3 -c "import aotfuse, aotfuse._C as C; print('aotfuse', aotfuse.__version__, 'shim', sum(C.bridge_info().values()), 'of', len(C.bridge_info()))" 2>&1 | tee -a "$OUT/versions.txt"
python3 -c "import aotfuse._C as C, aotfuse.lower as L; L._add_nvrtc_search_dirs(); print('nvrtc', C.cuda_info(True))" 2>&1 \
  | tee -a "$OUT/versions.txt"
echo "build done at $(( $(date +%s) - start )) s"

if part tests 60; then
  echo "== pytest -m cuda (at $(( $(date +%s) - start )) s)"
  ARGS=()
  python3 -c "import pytest_timeout" 2>/dev/null && ARGS+=(--timeout 120)
  # the tests are bound by tracing and NVRTC on the host: spread over processes, each with its own context
  python3 -c "import xdist" 2>/dev/null && ARGS+=(-n 8)
  if [[ -n ${TESTS:-} ]]; then read -r -a SEL <<< "$TESTS"; else
    SEL=(tests/test_cuda.py tests/test_scatter.py tests/test_reuse.py tests/test_autocast.py tests/test_shapes.py
         tests/test_checkpointing.py tests/test_distributed.py); fi
  timeout "$(cap 150)" python3 -m pytest "${SEL[@]}" -m cuda -q -rfE -p no:cacheprovider "${ARGS[@]}" \
    > "$OUT/pytest-cuda.log" 2>&1
  echo "pytest rc=$? ($(tail -n 1 "$OUT/pytest-cuda.log"))"
fi

# bench DTYPE BACKENDS: the seed table for one dtype; a (model, dtype) group takes up to ~100 s on a cold
# machine (torch.compile's first step), so no new group starts in the last 100 s of its timeout
bench() {
  local t name="hf-cuda-$1${3:+-tf32}"; t=$(cap 300)
  echo "== seed benchmark $1 ($2${3:+, TF32}; at $(( $(date +%s) - start )) s, timeout $t s)"
  PYTHONUNBUFFERED=1 timeout "$t" python3 -m aotfuse.bench --device cuda --models "$MODELS" --dtypes "$1" --backends "$2" \
    --repeats 10 --time-budget $(( t > 130 ? t - 100 : 30 )) --no-progress --out-dir "$OUT" --name "$name" ${3:+--tf32} \
    > "$OUT/bench-$1${3:+-tf32}.log" 2>&1
  echo "bench $1${3:+ tf32} rc=$?"
}
# eager-sdpa: eager with torch's fused attention, no compile (seconds): how much of Inductor's 16-bit lead
# is its attention rewrite (fuse_attention: SDPA on CUDA in fp16/bf16, not in fp32 without TF32)
part fp32 120 && bench fp32 eager,aotfuse,torch.compile
part bf16 120 && bench bf16 eager,aotfuse,torch.compile,eager-sdpa

# diag: why Bert's fp32 step trailed eager's (2026-12-04: 104%, torch.compile 94%): micro-benchmarks of the
# suspects (fp32 attention through SDPA's memory-efficient kernel against eager's bmm + softmax, the LM
# head's gradient in vocabulary chunks, Threefry dropout in row kernels), then aotfuse with each switch
# side by side in one process (dropout through ATen's generator on both sides of the attention switch:
# without the rewrite the attention's dropout would otherwise be Threefry's in aotfuse's kernels)
if part diag 60; then
  echo "== fp32 diagnosis, Bert (at $(( $(date +%s) - start )) s)"
  timeout "$(cap 100)" python3 benchmarks/gpu_micro.py --device cuda --iters 20 > "$OUT/micro-cuda.txt" 2>&1
  echo "micro rc=$?"; cat "$OUT/micro-cuda.txt"
  timeout "$(cap 150)" python3 -m aotfuse.bench --device cuda --models BertForMaskedLM --dtypes fp32 --backends \
    eager,aotfuse,aotfuse+AOTFUSE_LM_GRAD_CHUNKS=0,aotfuse+AOTFUSE_FALLBACK_RANDOM=1,aotfuse+AOTFUSE_FALLBACK_RANDOM=1+AOTFUSE_FUSE_ATTENTION=0,aotfuse+AOTFUSE_RECOMPUTE_MATERIALIZED=0,aotfuse+AOTFUSE_DECOMPOSE_NORMS=0,aotfuse+AOTFUSE_CUDA_KEEP_RANDOM=0 \
    --repeats 10 --time-budget 60 --no-progress --out-dir "$OUT" --name hf-cuda-fp32-switches > "$OUT/bench-switches.log" 2>&1
  echo "switches bench rc=$?"
fi

if part ab 60; then
  echo "== $AB_DTYPE, Bert and GPT2: layer norm and softmax left to ATen (AOTFUSE_DECOMPOSE_NORMS=0's effect), attention left eager (AOTFUSE_FUSE_ATTENTION=0's)"
  timeout "$(cap 75)" python3 -m aotfuse.bench --device cuda --models BertForMaskedLM,GPT2LMHeadModel --dtypes "$AB_DTYPE" \
    --backends eager,aotfuse-aten-norms,aotfuse-eager-attn --repeats 10 --time-budget 30 --no-progress --out-dir "$OUT" \
    --name "hf-cuda-aten-norms-eager-attn-$AB_DTYPE" > "$OUT/bench-aten-norms.log" 2>&1
  echo "aten-norms bench rc=$?"
fi

if part profile 40; then
  echo "== host-time profile (Bert, seed shapes, fp32): is the step bound by the host? and the top GPU kernels"
  timeout "$(cap 50)" python3 benchmarks/profile_steps.py --device cuda --size seed --model BertForMaskedLM --steps 5 \
    --threads 16 --kernels > "$OUT/profile-bert-cuda.txt" 2>&1
  echo "profile rc=$?"; sed -n 1,4p "$OUT/profile-bert-cuda.txt"; grep -A 4 -E "^(aotfuse|eager): one step" "$OUT/profile-bert-cuda.txt"
fi

if part epilogues 30; then
  echo "== epilogue kernels (decomposed softmax / layer norm, seed Bert shapes) against ATen's"
  timeout "$(cap 35)" python3 benchmarks/epilogues.py --device cuda > "$OUT/epilogues-cuda.md" 2>&1
  echo "epilogues rc=$?"; grep -E '^\| (layer_norm|add|softmax \||cross)' "$OUT/epilogues-cuda.md" | cut -c1-140
fi

part fp16 120 && bench fp16 eager,aotfuse,torch.compile
part tf32 120 && bench fp32 eager,aotfuse,torch.compile tf32

echo "== summary ($(( $(date +%s) - start )) s)"
for f in "$OUT"/hf-cuda*.md; do [ -f "$f" ] && grep -E '^\| (model|[A-Za-z]+For|GPT2)' "$f" | cut -c1-220; done
for f in "$OUT"/bench-*.log; do [ -f "$f" ] && grep -E "Traceback|Error|budget" "$f" | head -n 5; done
if [ -f "$OUT/pytest-cuda.log" ]; then
  grep -E "^(FAILED|ERROR)" "$OUT/pytest-cuda.log" | cut -c1-240 | head -n 30
  tail -n 1 "$OUT/pytest-cuda.log"
fi

# the device tool brings back at most 8 files: every file in one archive, and beside it the tables, the
# versions and the test log
tar czf /tmp/gpu-check.tar.gz -C "$OUT" . 2>/dev/null && mv /tmp/gpu-check.tar.gz "$OUT/" && \
  find "$OUT" -maxdepth 1 -type f ! -name 'gpu-check.tar.gz' ! -name 'hf-cuda-*.md' ! -name versions.txt \
    ! -name pytest-cuda.log -delete
ls "$OUT"
