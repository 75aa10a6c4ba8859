"""Training seconds per step of each cut-price piece (docs/cut-price.md) on one expert of SOMA's
best shape, E=16 H=20 L=1, P=64, B=8, T=32 (or, with --shape tiny, the default run's E=32 H=64
P=32): 300 steps each, timed after the first 50 (compilation and warm-up), from the run's own step
records. Time it alone: two jobs on two cores distort it.

    python studies/piece_cost.py [--steps 300] [--shape best|tiny] [--pieces NAME ...] [--out FILE]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from zosoma.experiments.price import machine

SHAPES = {"best": ["--embed", "16", "--hidden", "20", "--layers", "1", "-P", "64"], "tiny": []}
PIECES = {  # the rates of cut-price.toml's sweep winners (any rate costs the same)
    "default": ["--lr", "0.3"],
    "orthogonal probes": ["--lr", "0.3", "--probes", "orthogonal"],
    "guided probes": ["--lr", "0.15", "--probes", "guided"],
    "block probes": ["--lr", "0.6", "--probes", "blocks"],
    "P doubling": ["--lr", "0.3", "--queries", "doubling"],
    "ES": ["--optimizer", "es", "--eps", "0.04", "--lr", "0.02"],
    "ES + Adam": ["--optimizer", "es", "--transforms", "adam", "--eps", "0.04", "--lr", "0.004"],
    "one-sided": ["--optimizer", "onesided", "--lr", "0.6"],
    "activity-onesided": ["--optimizer", "activity-onesided", "--lr", "2.0"],
}
PARTS = ("data", "noise", "forward", "update")
WARM = 50


def seconds_a_step(run_dir: Path) -> tuple[float, dict]:
    """(mean seconds of a step after the first WARM, the mean of each timed part in seconds)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][WARM:]
    step = (rows[-1]["wall_s"] - rows[0]["wall_s"]) / (len(rows) - 1)
    return step, {p: sum(r.get(p + "_s", 0.0) for r in rows[1:]) / (len(rows) - 1) for p in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--shape", choices=SHAPES, default="best")
    ap.add_argument("--pieces", nargs="+", choices=PIECES, default=list(PIECES), metavar="NAME",
                    help="the pieces to time (default all; the first is the ratios' base)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    zosoma = Path(sys.executable).with_name("zosoma")
    lines = [f"# studies/piece_cost.py --steps {args.steps} --shape {args.shape} --pieces {' '.join(map(repr, args.pieces))}; {machine()} (BLAS threads: the machine's cores)",
             f"{'piece':18s} {'ms a step':>9s} {'x default':>9s}  " + "  ".join(f"{p:>8s}" for p in PARTS)]
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.pieces:
            options = PIECES[name]
            run_dir = Path(tmp) / name.replace(" ", "-")
            subprocess.run([str(zosoma), "train", *SHAPES[args.shape], *options, "--steps", str(args.steps), "--seed", "0",
                            "--quiet", "--run-dir", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
            step, parts = seconds_a_step(run_dir)
            base = base or step
            lines.append(f"{name:18s} {1e3 * step:9.2f} {step / base:9.2f}  " +
                         "  ".join(f"{1e3 * parts[p]:8.2f}" for p in PARTS))
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
