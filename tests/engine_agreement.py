"""Training through ONNX Runtime beside the Numba engine: the default run, seed by seed.

    python tests/engine_agreement.py [--seeds 0 1 2] [--dir runs/engines] [--out FILE]

Runs `zosoma train --engine native|onnxruntime --seed S` for each seed (a run folder that already
holds results.json is reused), then prints how far apart the two engines' step losses and final
held-out / WikiText-103 figures are, beside how far apart two seeds of one engine are: the two
engines round differently, SPSA amplifies any difference, so a long run can only agree with the
other engine as closely as the run is reproducible under float32 rounding.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from zosoma.runs.folder import RESULTS, RunFolder

ENGINES = ("native", "onnxruntime")


def train(engine: str, seed: int, run_dir: Path) -> dict:
    if not (run_dir / RESULTS).exists():
        cmd = ["zosoma", "train", "--engine", engine, "--seed", str(seed), "--run-dir", str(run_dir)]
        if run_dir.exists():  # an interrupted run: it keeps its engine and seed
            cmd = ["zosoma", "train", "--resume", str(run_dir)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / RESULTS).read_text())


def losses(run_dir: Path) -> np.ndarray:
    return np.array([r["loss"] for r in RunFolder(run_dir).read_checkpoint().metrics])


def first_above(diff: np.ndarray, bound: float) -> str:
    above = np.flatnonzero(diff > bound)
    return str(above[0] + 1) if above.size else "never"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dir", type=Path, default=Path("runs/engines"))
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    lines = ["# The default `zosoma train` run (tiny preset) on the Numba and the ONNX Runtime engine, same seed.",
             "seed  engine        held-out  WikiText-103  wall s  last-100 train loss",
             ]
    final = {e: [] for e in ENGINES}
    traces = []
    for seed in args.seeds:
        runs = {e: args.dir / f"{e}-seed{seed}" for e in ENGINES}
        for e, run in runs.items():
            r = train(e, seed, run)
            final[e].append((r["heldout"]["overall"], r["wikitext103"]))
            lines.append(f"{seed:4d}  {e:12s}  {r['heldout']['overall']:8.4f}  {r['wikitext103']:12.4f}  "
                         f"{r['wall_s']:6.0f}  {losses(run)[-100:].mean():.4f}")
        a, b = (losses(runs[e]) for e in ENGINES)
        traces.append((seed, np.abs(a - b)))

    lines += ["", "step losses, native vs onnxruntime, same seed:",
              "seed  max|diff| 1-100  max|diff| 1-500  first step >1e-3  first step >1e-2"]
    for seed, diff in traces:
        lines.append(f"{seed:4d}  {diff[:100].max():15.1e}  {diff[:500].max():15.1e}  "
                     f"{first_above(diff, 1e-3):>16s}  {first_above(diff, 1e-2):>16s}")

    held = {e: np.array([h for h, _ in final[e]]) for e in ENGINES}
    wiki = {e: np.array([w for _, w in final[e]]) for e in ENGINES}
    gap = held["onnxruntime"] - held["native"]
    lines += ["", "held-out overall, onnxruntime - native, per seed: " + ", ".join(f"{g:+.4f}" for g in gap),
              f"  mean {gap.mean():+.4f}, max |gap| {np.abs(gap).max():.4f}"]
    if len(args.seeds) > 1:
        for e in ENGINES:
            lines.append(f"{e}: held-out across seeds {held[e].mean():.4f} +- {held[e].std(ddof=1):.4f} (sd), "
                         f"WikiText-103 {wiki[e].mean():.4f} +- {wiki[e].std(ddof=1):.4f}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    sys.exit(main())
