"""SPSA's loss differences with tensor-core GEMMs (TF32, bf16), measured on the CPU before a device
runs them (zosoma.experiments.gemm_precision): SOMA's best expert (E=16 H=20), the tiny preset and
the paper's expert, eps in 1, 4, 16, 64 steps of the format and at the default 1e-3.

    python studies/gemm_precision.py --out results/gemm-precision.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from zosoma.config import PRESETS, ModelConfig  # noqa: E402
from zosoma.experiments.gemm_precision import format_study, study  # noqa: E402

MODELS = {"SOMA E=16 H=20": ModelConfig(embed=16, hidden=20, layers=1), "tiny E=32 H=64": PRESETS["tiny"][0]}
PAPER = {"paper E=508 H=496 L=2": PRESETS["paper"][0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("-P", type=int, default=8)
    args = parser.parse_args(argv)
    t0 = time.process_time()
    parts = [format_study(study(MODELS, P=args.P, B=8, T=64), args.P, 8, 64),
             format_study(study(PAPER, P=args.P // 2, B=4, T=32), args.P // 2, 4, 32)]
    text = "\n\n".join(parts) + f"\n\n({time.process_time() - t0:.0f} CPU-s)\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
