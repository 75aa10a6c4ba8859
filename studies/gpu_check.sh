#!/usr/bin/env bash
# The device check for zosoma's CUDA backend (studies/gpu_check.py, with studies/gpu_check_extra.py):
# validates every kernel against the CPU code on fresh random inputs (routing on the device and the
# default path of each shape included), then times the paper-size forward (dense, EGGROLL, tensor
# cores) and SPSA step against PyTorch's cuDNN LSTM, the step at SOMA's expert sizes (E=16 H=20,
# 8x12, 32x64, 20x40; P=64 B=8 T=32) and the SOMA step of N = 1, 16, 64 experts on each path with
# their launches counted, routed top-4 inference N=8 vs N=256 with rows computed, and a short price
# of zero-order (zosoma compare price-quick --device cuda). Needs an NVIDIA GPU with CuPy, Numba and
# PyTorch (CUDA) installed; installs nothing; at most about 5 minutes on an H200 (the table says
# each part's seconds). The table goes to $1, else $OUT/gpu_check.txt, else ./gpu_check.txt; the
# price runs beside it (price-quick/).
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}/gpu_check.txt}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
"$py" studies/gpu_check.py --out "$out"
rc=$?

# SOMA training with every expert in one population on the device (issue 47 item 2: --executor
# together, the default on a device, named here so the table says so). It appends the run's wall
# time and routed figure to the table.
SOMA_FLAGS="--executor together"
if [ "$rc" -ne 2 ] && [ -n "$SOMA_FLAGS" ]; then
    run="$(dirname "$out")/soma4-cuda"
    rm -rf "$run"
    start=$(date +%s%N)
    # shellcheck disable=SC2086  # SOMA_FLAGS holds several words
    if "$py" -c 'import sys; from zosoma.cli.main import main; sys.exit(main())' train --experts 4 --device cuda \
            $SOMA_FLAGS --run-dir "$run" --quiet > "$run.log" 2>&1; then
        ms=$(( ($(date +%s%N) - start) / 1000000 ))
        echo "zosoma train --experts 4 --device cuda $SOMA_FLAGS: $((ms / 1000)).$(printf %03d $((ms % 1000))) s wall (2026-12-04: 38.7 s; goal <= 10 s); $(grep -m1 -i routed "$run.log")" | tee -a "$out"
    else
        echo "FAIL zosoma train --experts 4 --device cuda $SOMA_FLAGS (see $run.log)" | tee -a "$out" >&2
        rc=1
    fi
fi
exit "$rc"
