#!/usr/bin/env bash
# Installs what the tests need, builds aotfuse in place, and runs every test:
# the C core's CMocka tests under AddressSanitizer+UBSan and under valgrind, then pytest.
# Usage: bash tests/run.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -f /usr/include/cmocka.h ] || need_apt+=(libcmocka-dev)
command -v valgrind >/dev/null || need_apt+=(valgrind)
command -v cc >/dev/null || need_apt+=(gcc)
command -v g++ >/dev/null || need_apt+=(g++)  # tests/cuda_emu.py: the CUDA kernels, emulated on the host
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

# torch 2.13.0 is the CPU build tested here (an unpinned install would fetch a CUDA build).
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -c "import transformers, pytest, tqdm, accelerate" 2>/dev/null || \
  python3 -m pip install -q transformers==5.17.0 pytest tqdm accelerate
# NVRTC, so that the generated CUDA compiles here too (tests/test_cuda_codegen.py; no GPU needed)
python3 -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1 || python3 -m pip install -q nvidia-cuda-nvrtc==13.0.88
python3 -m pip install -q --no-build-isolation --no-deps -e .

echo "== C core: CMocka under ASan+UBSan"
make -s -C tests/c check
echo "== C core: CMocka under valgrind"
make -s -C tests/c valgrind
echo "== Python: pytest"
python3 -m pytest tests -q "$@"
