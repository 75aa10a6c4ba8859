"""The porting kit's `run` stage on zosoma's own two engines: how far a float32 port that sums in
another order may land from the kit's figures, and how far a port without the default shaping lands.

    python studies/porting_run.py [--seeds 0 1 2 3 4] [--dir runs/porting-run] [--out FILE]

Trains the run stage's run (zosoma train --optimizer sgd, 300 steps; zosoma.porting.kit_run) with
`--engine native` and `--engine onnxruntime` per seed (a folder that already holds results.json is
reused), prints each run's held-out figure, the largest step-loss gap and held-out gap between the
engines, and writes that spread into zosoma/porting/run_reference.json (the stage's manifest quotes
it). Regenerate the stored figures themselves with `python -m zosoma.porting.kit_run`.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from zosoma.porting import kit_run
from zosoma.training.folder import RESULTS, RunFolder

ENGINES = ("native", "onnxruntime")


def run(run_dir: Path, seed: int, engine: str) -> dict:
    if not (run_dir / RESULTS).exists():
        kit_run.train_reference(run_dir, seed=seed, engine=engine)
    results = json.loads((run_dir / RESULTS).read_text())
    return {"losses": np.array([m["loss"] for m in RunFolder(run_dir).read_metrics()]),
            "heldout": results["heldout"]["overall"], "restarts": len(results["restarts"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--dir", type=Path, default=Path("runs/porting-run"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = [f"# python studies/porting_run.py --seeds {' '.join(map(str, args.seeds))}",
             f"# The porting kit's run stage: zosoma train --optimizer sgd, {kit_run.RUN_STEPS} steps, per seed and engine.",
             "seed  native held-out  onnxruntime held-out  gap      max |step loss gap|  restarts"]
    gaps, loss_gaps = [], []
    for seed in args.seeds:
        a, b = (run(args.dir / f"{e}-{seed}", seed, e) for e in ENGINES)
        gaps.append(abs(a["heldout"] - b["heldout"]))
        loss_gaps.append(float(np.abs(a["losses"] - b["losses"]).max()))
        lines.append(f"{seed:4d}  {a['heldout']:15.4f}  {b['heldout']:20.4f}  {b['heldout'] - a['heldout']:+.5f}  "
                     f"{loss_gaps[-1]:19.1e}  {a['restarts']}, {b['restarts']}")
    spread = {"losses": max(loss_gaps), "heldout": max(gaps)}
    lines.append(f"largest gaps: step loss {spread['losses']:.1e} (tolerance {kit_run.LOSS_ATOL:g}), held-out "
                 f"{spread['heldout']:.1e} (tolerance {kit_run.HELDOUT_ATOL:g})")
    ref = json.loads(kit_run.REFERENCE.read_text())
    lines.append(f"the kit's figures (seed 0, native): held-out {ref['heldout']:.4f}; trained without shaping "
                 f"{ref['unshaped']['heldout']:.4f} ({ref['unshaped']['heldout'] - ref['heldout']:+.4f}), largest step "
                 f"loss gap {np.abs(np.array(ref['unshaped']['losses']) - ref['losses']).max():.3f}")
    ref["spread"] = spread
    kit_run.REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
