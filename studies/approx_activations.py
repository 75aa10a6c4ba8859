"""What approximate activations cost in training: `zosoma train`'s default run (one-sided SPSA, seed 0)
with every forward's sigmoid and tanh replaced by PLAN or ONNX's HardSigmoid
(zosoma.porting.approx_activations), trained by zosoma's own trainer, evaluated held-out with the
same activations (the device's) and with the exact ones (the trained weights moved to another
runtime), beside the exact run.

    python studies/approx_activations.py [--steps 3540] [--modes exact plan hard] [--dir runs/approx] [--out FILE]

A folder that already holds results.json is reused. The precision study's protocol
(docs/precision.md) is the default run and a SOMA run per format; this script runs the single model.
"""

import argparse
import json
import sys
from pathlib import Path

from zosoma.corpus import load_corpus
from zosoma.engines.ops import Ops
from zosoma.model.params import Layout
from zosoma.porting.approx_activations import MODES, ApproxOps
from zosoma.training.folder import RESULTS, RunFolder
from zosoma.strategies.settings import resolve
from zosoma.runs.single import evaluate_run, start_run


def run(run_dir: Path, steps: int, mode: str | None) -> dict:
    """Train (unless done) and return held-out overall with the run's own activations and the exact ones."""
    model, cfg = resolve("tiny", {"steps": steps})
    ops = ApproxOps(mode) if mode else Ops()
    if not (run_dir / RESULTS).exists():
        for _ in start_run(run_dir, model, cfg, ops=ops):
            pass
    results = json.loads((run_dir / RESULTS).read_text())
    ckpt = RunFolder(run_dir).read_checkpoint()  # scored again by the same protocol, with the exact functions
    exact = evaluate_run(ckpt.theta, Layout(ckpt.model), load_corpus(None, split="heldout"), ops=Ops())
    return {"own": results["heldout"]["overall"], "exact": exact["heldout"]["overall"],
            "restarts": len(results["restarts"]), "step": ckpt.step}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3540)
    parser.add_argument("--modes", nargs="+", default=["exact", *MODES], choices=["exact", *MODES])
    parser.add_argument("--dir", type=Path, default=Path("runs/approx"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = [f"# python studies/approx_activations.py --steps {args.steps} --modes {' '.join(args.modes)}",
             f"# zosoma train's default run (one-sided SPSA, tiny preset, seed 0), {args.steps} steps",
             "activations  held-out (own)  held-out (exact functions)  restarts  final step"]
    for mode in args.modes:
        r = run(args.dir / f"{mode}-{args.steps}", args.steps, None if mode == "exact" else mode)
        lines.append(f"{mode:11s}  {r['own']:14.4f}  {r['exact']:26.4f}  {r['restarts']:8d}  {r['step']:10d}")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
