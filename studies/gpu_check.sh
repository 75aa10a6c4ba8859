#!/usr/bin/env bash
# The device check for zosoma's CUDA backend (studies/gpu_check.py): validates every kernel against
# the CPU code on fresh random inputs, then times the paper-size forward (dense and EGGROLL) and
# SPSA step against PyTorch's cuDNN LSTM, the step at SOMA's expert sizes (E=16 H=20, 8x12, 32x64,
# 20x40; P=64 B=8 T=32) with its launches counted, and routed top-4 inference on the CPU and the GPU. Needs an
# NVIDIA GPU with CuPy, Numba and PyTorch (CUDA) installed; installs nothing; about 3-6 minutes.
# The table goes to $1, else $OUT/gpu_check.txt, else ./gpu_check.txt.
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}/gpu_check.txt}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" studies/gpu_check.py --out "$out"
