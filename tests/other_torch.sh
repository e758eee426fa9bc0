#!/usr/bin/env bash
# Runs the pytest suite against another torch release, in a virtual environment of its own, beside the
# tested one (tests/run.sh). The C core does not link torch, so the same build serves every torch.
# Usage: bash tests/other_torch.sh VERSION [pytest args]   e.g. bash tests/other_torch.sh 2.15.0 -x
# VERSION is a PyPI torch release (its CUDA build: it runs on the CPU too). This machine's pip
# constraints cap torch at the releases on its disk; OTHER_TORCH_NO_PIP_CONFIG=1 installs without
# pip's configuration files (PyPI only), for a newer release.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash tests/other_torch.sh VERSION [pytest args]}
shift
venv=${OTHER_TORCH_VENV:-/tmp/aotfuse-torch-$version}
pip_env=()
[ "${OTHER_TORCH_NO_PIP_CONFIG:-0}" = 1 ] && pip_env=(env PIP_CONFIG_FILE=/dev/null)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "${pip_env[@]}" "$venv/bin/pip" install -q "torch==$version" transformers==5.17.0 pytest tqdm accelerate \
    pytest-xdist expecttest numpy setuptools wheel
  "$venv/bin/python" -c "import nvidia.cuda_nvrtc" 2>/dev/null || \
    "${pip_env[@]}" "$venv/bin/pip" install -q nvidia-cuda-nvrtc || true  # newer torch ships its own NVRTC
fi
python3 setup.py -q build_ext --inplace
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest tests -q -p no:cacheprovider "$@"
