"""Training through ONNX Runtime beside the Numba engine: the default run, seed by seed.

    python studies/engine_agreement.py [--seeds 0 1 2] [--dir runs/engines] [--out FILE]

Runs `zosoma train --engine native|onnxruntime --seed S` for each seed (a run folder that already
holds results.json is reused; one its divergence guard stopped is resumed past the guard, the
report naming it), then prints how far apart the two engines' step losses and final
held-out / WikiText-103 figures are, beside how far apart two seeds of one engine are: the two
engines round differently, SPSA amplifies any difference, so a long run can only agree with the
other engine as closely as the run is reproducible under float32 rounding. The control measures
that: the Numba run again with one initial weight one float32 ulp apart.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from shared_data import use_shared_wikitext
from zosoma.corpus import load_text
from zosoma.engines.onnxruntime.onnxrt_ops import OnnxRuntimeOps
from zosoma.engines.ops import Ops
from zosoma.model import reference
from zosoma.model.params import Layout
from zosoma.training.folder import RESULTS, RunFolder
from zosoma.runs.run import engine
from zosoma.runs.single import start_run
from zosoma.workers.placement import Placement

ENGINES = ("native", "onnxruntime")
PAIRS, EPS = 96, 1e-3  # the scalar check: perturbation pairs, at the default eps


def finish(run_dir: Path) -> dict:
    """The run's results, resuming it first if it has none: an interrupted run, or one whose
    divergence guard stopped it (a resumed run goes on past the guard, whose verdict stays in its
    results), so that every seed ends at the default length."""
    if not (run_dir / RESULTS).exists():
        subprocess.run(["zosoma", "train", "--resume", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / RESULTS).read_text())


def train(engine: str, seed: int, run_dir: Path) -> dict:
    if not run_dir.exists():
        cmd = ["zosoma", "train", "--engine", engine, "--seed", str(seed), "--run-dir", str(run_dir)]
        subprocess.run(cmd, stdout=subprocess.DEVNULL)  # a guard's stop exits 1; finish goes on
    return finish(run_dir)


def nudge(run_dir: Path) -> None:
    """Move one recurrent weight of run_dir's step-0 checkpoint one float32 ulp up (a weight every
    byte uses: the first embedding row, for byte 0, never takes part in text)."""
    folder = RunFolder(run_dir)
    start = folder.read_checkpoint()
    assert start.step == 0
    i = Layout(start.model)["lstm0.w_hh"].offset
    start.theta[i] = np.nextafter(start.theta[i], np.float32(np.inf))
    folder.write_checkpoint(start)


def train_nudged(native: Path, run_dir: Path) -> dict:
    """The native run's configuration, its weights nudged (nudge) before step 1."""
    if not RunFolder(run_dir).has_checkpoint:
        ckpt = RunFolder(native).read_checkpoint()
        ops = engine(Placement(), ckpt.train)
        for _ in start_run(run_dir, ckpt.model, ckpt.train, should_stop=lambda: True, ops=ops):
            pass  # stops before step 1, leaving the step-0 checkpoint
        nudge(run_dir)
    return finish(run_dir)


def guard(r: dict) -> str:
    d = r["divergence"]
    return "" if d is None else f"  (guard fired at step {d['step']}: {d['verdict']}; resumed)"


def losses(run_dir: Path) -> np.ndarray:
    folder = RunFolder(run_dir)
    return np.array([r["loss"] for r in folder.read_metrics(folder.read_checkpoint())])


def scalar_noise(run_dir: Path, seed: int = 0) -> list[str]:
    """What each engine's rounding adds to the SPSA scalars (L+ - L-) / (2 eps): its losses against
    float64 NumPy (zosoma.model.reference) at the same perturbed weights, the run's final weights
    and the default batch shape (8 x 32 bytes of the shipped corpus)."""
    ckpt = RunFolder(run_dir).read_checkpoint()
    layout, theta = Layout(ckpt.model), ckpt.theta.astype(np.float32)
    text = load_text(Path(__file__).parent.parent / "data/corpus/train/drama.txt.gz")
    rng = np.random.default_rng(seed)
    members = []  # (batch, perturbed weights, float64 losses), the same for both engines
    for _ in range(PAIRS // 32):
        starts = rng.integers(0, len(text) - 33, 8)
        batch = np.stack([text[s:s + 33] for s in starts])
        delta = EPS * rng.standard_normal((32, theta.size)).astype(np.float32)
        thetas = np.concatenate([theta + delta, theta - delta])
        members.append((batch, thetas, np.array([reference.loss(t.astype(np.float64), layout, batch) for t in thetas])))
    exact = np.concatenate([(ref[:32] - ref[32:]) / (2 * EPS) for _, _, ref in members])
    lines = []
    for name, ops in (("native", Ops()), ("onnxruntime", OnnxRuntimeOps())):
        got = [ops.population_loss(thetas, layout, batch) for batch, thetas, _ in members]
        e = np.concatenate([(g[:32] - g[32:]) / (2 * EPS) for g in got]) - exact
        lines.append(f"{name:12s} scalar error mean {e.mean():+.1e}, sd {e.std():.1e}; the scalars' own sd {exact.std():.2f}")
    return lines


def first_above(diff: np.ndarray, bound: float) -> str:
    above = np.flatnonzero(diff > bound)
    return str(above[0] + 1) if above.size else "never"


def emit(lines: list[str], out: Path | None) -> None:
    """Print the report, and write it to `out` if given."""
    report = "\n".join(lines)
    print(report)
    if out:
        out.write_text(report + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dir", type=Path, default=Path("runs/engines"))
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    use_shared_wikitext()

    lines = ["# The default `zosoma train` run (tiny preset) on the Numba and the ONNX Runtime engine, same seed.",
             "seed  engine        held-out  WikiText-103  wall s  last-100 train loss",
             ]
    final = {e: [] for e in ENGINES + ("native-ulp",)}
    traces = []
    for seed in args.seeds:
        runs = {e: args.dir / f"{e}-seed{seed}" for e in ENGINES}
        results = {e: train(e, seed, run) for e, run in runs.items()}
        runs["native-ulp"] = args.dir / f"native-ulp-seed{seed}"
        results["native-ulp"] = train_nudged(runs["native"], runs["native-ulp"])
        curves = {e: losses(run) for e, run in runs.items()}  # each checkpoint read once
        for e, r in results.items():
            final[e].append((r["heldout"]["overall"], r["wikitext103"]))
            label = "native, ulp" if e == "native-ulp" else e
            lines.append(f"{seed:4d}  {label:12s}  {r['heldout']['overall']:8.4f}  {r['wikitext103']:12.4f}  "
                         f"{r['wall_s']:6.0f}  {curves[e][-100:].mean():.4f}{guard(r)}")
        a, b, c = (curves[e] for e in ("native", "onnxruntime", "native-ulp"))
        traces.append((seed, np.abs(a - b), np.abs(a - c)))

    for i, other in ((1, "onnxruntime"), (2, "native with one weight one ulp apart")):
        lines += ["", f"step losses, native vs {other}, same seed:",
                  "seed  max|diff| 1-100  max|diff| 1-500  first step >1e-3  first step >1e-2"]
        for seed, *diffs in traces:
            diff = diffs[i - 1]
            lines.append(f"{seed:4d}  {diff[:100].max():15.1e}  {diff[:500].max():15.1e}  "
                         f"{first_above(diff, 1e-3):>16s}  {first_above(diff, 1e-2):>16s}")

    held = {e: np.array([h for h, _ in final[e]]) for e in final}
    wiki = {e: np.array([w for _, w in final[e]]) for e in final}
    lines.append("")
    for other in ("onnxruntime", "native-ulp"):
        gap = held[other] - held["native"]
        lines += [f"held-out overall, {other} - native, per seed: " + ", ".join(f"{g:+.4f}" for g in gap),
                  f"  mean {gap.mean():+.4f}, max |gap| {np.abs(gap).max():.4f}"]
    if len(args.seeds) > 1:
        for e in final:
            lines.append(f"{e}: held-out across seeds {held[e].mean():.4f} +- {held[e].std(ddof=1):.4f} (sd), "
                         f"WikiText-103 {wiki[e].mean():.4f} +- {wiki[e].std(ddof=1):.4f}")
    lines += ["", f"SPSA scalars' rounding error against float64, {PAIRS} pairs at eps {EPS:g}, "
              f"native seed {args.seeds[0]}'s final weights:"] + scalar_noise(args.dir / f"native-seed{args.seeds[0]}")
    emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
