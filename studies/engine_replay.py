"""Why some ONNX Runtime runs take loss bumps: engine_agreement's runs replayed step by step.

    python studies/engine_replay.py [--seeds 0 1 2] [--dir runs/engines] [--jobs 2] [--out FILE]

Each run studies/engine_agreement.py left in --dir (native, onnxruntime and native-ulp, per seed) is
trained again from its configuration, recording every step's P SPSA scalars (L+ - L-) / (2 eps);
the replay must reproduce the run's step losses exactly. In an ONNX Runtime replay the Numba
engine also evaluates each step's population from the same weights and batch, so the two engines
are compared at every state the ONNX Runtime run went through, not along two trajectories that
rounding has pulled apart. The report gives, per run, the steps whose scalars' spread is over ten
times the run's median (the steps whose update is an outlier) and the loss change around each;
and, at the largest such step, the loss along its worst direction in float64 and the bytes that
carry it. A replay's record is kept beside the run (<run>.replay.npz), so the report reruns free.
"""

import argparse
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from unittest import mock

import numpy as np
from scipy.stats import mannwhitneyu

from engine_agreement import emit, nudge
from zosoma.engines.cpu import forward
from zosoma.engines.ops import Ops, perturbed
from zosoma.model import reference
from zosoma.model.params import Layout
from zosoma.training.folder import RunFolder
from zosoma.training.records import Diverged, Finished, Step, Stopped
from zosoma.workers.placement import Placement
from zosoma.runs.run import engine
from zosoma.runs.single import resume_run, start_run
from zosoma.strategies import make_strategy

CLIFF = 10.0  # a step whose scalars' sd exceeds CLIFF x the run's median sd is an outlier step
RUNS = ("native", "onnxruntime", "native-ulp")


def replay(run_dir: Path, steps: int | None = None) -> Path:
    """Train run_dir's run again in a scratch folder, recording each step's scalars (see the
    module docstring); returns the record's path."""
    out = run_dir.with_name(run_dir.name + ".replay.npz")
    if out.exists() and steps is None:
        return out
    ckpt = RunFolder(run_dir).read_checkpoint()
    steps = steps or ckpt.train.steps
    ops = engine(Placement(), ckpt.train)  # the engine the run trained on
    native = Ops() if ckpt.train.engine != "native" else None
    original = Ops.perturbed_losses
    own, other, worst = [], [], {"sd": -1.0}

    def recording(ops, theta, layout, batch, pop, pairs=None, timings=None):
        # every engine's perturbed_losses ends here (ForwardOnlyOps calls it through super())
        plus, minus = original(ops, theta, layout, batch, pop, pairs, timings)
        s = (plus - minus) / (2 * pop.scale)
        own.append(s)
        if native is not None:
            p, m = original(native, theta, layout, batch, pop, pairs)
            other.append((p - m) / (2 * pop.scale))
        if pop.step > 100 and s.std() > worst["sd"]:  # the first steps' spread is the init's
            worst.update(sd=s.std(), step=pop.step, theta=np.array(ops.to_numpy(theta)), batch=batch,
                         pair=int(np.abs(s).argmax()))
        return plus, minus

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(Ops, "perturbed_losses", recording):
        work, replayed = Path(tmp) / "run", []
        for _ in start_run(work, ckpt.model, ckpt.train, should_stop=lambda: True, ops=ops):
            pass  # the step-0 checkpoint, as engine_agreement makes it
        if run_dir.name.startswith("native-ulp"):
            nudge(work)
        while len(replayed) < steps:  # a resume goes on past the divergence guard's stop
            records = resume_run(work, should_stop=lambda: len(own) >= steps, ops=ops)
            for record in records:
                if isinstance(record, Step):
                    replayed.append(record.metrics["loss"])
                if isinstance(record, (Finished, Stopped, Diverged)):
                    break  # before the final evaluation, which the replay does not need
            records.close()
    losses = np.array([r["loss"] for r in RunFolder(run_dir).read_metrics(ckpt)])[:steps]
    if not np.array_equal(np.array(replayed[:steps]), losses):
        raise SystemExit(f"{run_dir}: the replay's losses differ from the run's; nothing to compare")
    arrays = dict(own=np.array(own[:steps]), losses=losses, worst_step=worst["step"],
                  worst_theta=worst["theta"], worst_batch=worst["batch"], worst_pair=worst["pair"])
    if native is not None:
        arrays["native"] = np.array(other[:steps])
    path = out if steps == ckpt.train.steps else out.with_suffix(f".{steps}.npz")
    np.savez(path, **arrays)
    return path


def outliers(sd: np.ndarray) -> list[int]:
    """The steps (0-based, from step 101) whose scalars' sd exceeds CLIFF x the run's median."""
    return [i for i in np.flatnonzero(sd > CLIFF * np.median(sd[100:])) if i >= 100]


def line_scan(run_dir: Path, rec) -> list[str]:
    """The loss along the largest outlier step's worst direction, in float64, and its bytes."""
    ckpt = RunFolder(run_dir).read_checkpoint()
    layout, theta, batch = Layout(ckpt.model), rec["worst_theta"], rec["worst_batch"]
    pop = make_strategy(ckpt.train).ask(0, int(rec["worst_step"]))
    k = int(rec["worst_pair"])
    plus, minus = perturbed(theta, pop, range(k, k + 1))
    delta = perturbed(np.zeros_like(theta), replace(pop, scale=1.0), range(k, k + 1))[0].astype(np.float64)
    lines = [f"{run_dir.name}, step {int(rec['worst_step']) + 1}, pair {k}: "
             "loss (float64) at theta + t * eps * delta_k"]
    for t in (-4, -2, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 2, 4):
        at = theta.astype(np.float64) + t * pop.scale * delta
        lines.append(f"  t {t:+5.2f}  {reference.loss(at, layout, batch):.6f}")
    tokens, targets = batch[:, :-1], batch[:, 1:]
    a, _ = forward.nll_stream(plus, layout, tokens, targets)
    b, _ = forward.nll_stream(minus, layout, tokens, targets)
    d = (a - b).astype(np.float64)
    row, col = np.unravel_index(np.abs(d).argmax(), d.shape)
    share = np.abs(d[row]).sum() / np.abs(d).sum()
    lines.append(f"  L+ - L- summed over the batch's bytes: {d.sum():+.3f} nats; its sequence {row} carries "
                 f"{share:.0%} of |L+ - L-|, byte {col} alone {d[row, col]:+.3f}")
    lines.append(f"  that sequence: {bytes(batch[row])!r}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dir", type=Path, default=Path("runs/engines"))
    ap.add_argument("--jobs", type=int, default=2, help="replays at once, one thread each")
    ap.add_argument("--steps", type=int, help="replay only the first STEPS steps (a quick check)")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    runs = [args.dir / f"{e}-seed{s}" for s in args.seeds for e in RUNS]
    os.environ["NUMBA_NUM_THREADS"] = "1"  # the spawned workers read it at import
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        records = dict(zip(runs, pool.map(replay, runs, [args.steps] * len(runs))))

    lines = ["# Each run of studies/engine_agreement.py trained again, every step's P SPSA scalars recorded; "
             "each replay reproduced its run's step losses exactly.",
             f"# Outlier steps: the scalars' sd over {CLIFF:g} x the run's median (steps 101 on); "
             "loss change: mean of the 20 steps after minus the 20 before.",
             "seed  engine        median sd  outlier steps (step: sd, loss change)"]
    recs = {run: dict(np.load(path)) for run, path in records.items()}  # each record read once
    sds = {run: rec["own"].std(axis=1) for run, rec in recs.items()}  # each step's scalars' sd
    peaks = {e: [] for e in RUNS}  # per run: its largest outlier's sd / the median sd before it
    largest = []  # (sd, engine, seed, step, sd / median before, loss change)
    for run, rec in recs.items():
        sd, losses = sds[run], rec["losses"]
        change = lambda i: losses[i + 1:i + 21].mean() - losses[i - 20:i].mean()  # noqa: E731
        marks = ", ".join(f"{i + 1}: {sd[i]:.1f}, {change(i):+.2f}" for i in outliers(sd)) or "none"
        engine, seed = run.name.rsplit("-seed", 1)
        lines.append(f"{seed:>4s}  {engine:12s}  {np.median(sd[100:]):9.2f}  {marks}")
        i = 100 + int(sd[100:].argmax())
        peaks[engine].append(sd[i] / np.median(sd[100:i]))
        largest.append((sd[i], engine, seed, i + 1, peaks[engine][-1], change(i)))
    lines += ["", "The ten largest outlier steps of the runs (each run's largest):",
              "    sd  engine        seed  step  sd / median before  loss change"]
    lines += [f"{sd:6.1f}  {e:12s}  {seed:>4s}  {step:4d}  {ratio:18.0f}  {ch:+11.2f}"
              for sd, e, seed, step, ratio, ch in sorted(largest, reverse=True)[:10]]
    lines += ["", "Each run's largest outlier, its sd / the median sd of the steps before it:"]
    lines += [f"  {e:12s} " + ", ".join(f"{p:.0f}" for p in peaks[e]) for e in RUNS]
    if len(args.seeds) > 1:
        numba = peaks["native"] + peaks["native-ulp"]
        p = mannwhitneyu(peaks["onnxruntime"], numba).pvalue
        lines.append(f"  onnxruntime against the {len(numba)} Numba runs: Mann-Whitney p = {p:.2f}")

    lines += ["", "The Numba engine at every state of the ONNX Runtime runs (same weights, batch and perturbations):",
              "seed  max |scalar difference|  at the outlier steps  the scalars' median sd"]
    ort = [run for run, rec in recs.items() if "native" in rec]  # the replays with Numba beside
    for run in ort:
        diff = np.abs(recs[run]["own"] - recs[run]["native"]).max(axis=1)
        steps, sd = outliers(sds[run]), sds[run]
        at = f"{diff[steps].max():.1e}" if steps else "-"
        seed = run.name.rsplit("-seed", 1)[1]
        lines.append(f"{seed:>4s}  {diff.max():23.1e}  {at:>20s}  {np.median(sd[100:]):21.2f}")
    if ort:
        worst = max(ort, key=lambda run: sds[run][100:].max())
        lines += ["", "The largest outlier step of the ONNX Runtime runs:"] + line_scan(worst, recs[worst])
    emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
