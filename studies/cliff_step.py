"""The engine replay's worst outlier step under each coefficient shaping.

    python studies/cliff_step.py [--seed 4] [--step 1148] [--engine onnxruntime] [--dir runs/cliff] [--out FILE]

The default run (`zosoma train --engine onnxruntime --seed 4`, plain SPSA) took its largest step
of the ten engine-agreement seeds at step 1,148: one sequence on a loss cliff, the scalars' sd 64
times the steps' before (results/engine-replay.txt). This trains that run again to the step before,
recording the step's scalars of every step, and then, for plain SPSA and each shaping (its state replayed
from the same scalars, as if it had shaped them all along without changing the run):

- how large the cliff-step is: the norm of lr * ghat against the median of the 100 steps before,
  and the held-out loss (8 KB of each held-out file) before and after taking it;
- does the run go on: training continues from that state with the shaping to the run's end, and
  the report gives the guard's verdict (if any) and the final held-out nats/byte.
"""

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from zosoma.corpus import Corpus, load_corpus
from zosoma.engines.ops import Ops
from zosoma.config import PRESETS, TrainConfig
from zosoma.model.params import Layout
from zosoma.training.folder import RunFolder
from zosoma.training.records import Evaluated
from zosoma.runs.run import engine
from zosoma.runs.single import evaluate_run, resume_run, start_run
from zosoma.training.trainer import Trainer
from zosoma.strategies import make_strategy
from zosoma.strategies.base import learning_rate
from zosoma.strategies.settings import resolve
from zosoma.strategies.shaping import Chain
from zosoma.workers.placement import Placement

SHAPINGS = {"plain SPSA": (), "clip": ("clip",), "normalize": ("normalize",), "clip+normalize": ("clip", "normalize")}


def to_step(run: Path, cfg: TrainConfig, step: int) -> list[np.ndarray]:
    """Train `cfg` in `run` to `step` steps (a checkpoint there); the step's scalars of every step."""
    scalars, original = [], Ops.perturbed_losses

    def recording(ops, theta, layout, batch, pop, pairs=None, timings=None):
        plus, minus = original(ops, theta, layout, batch, pop, pairs, timings)
        scalars.append((plus - minus) / (2 * pop.scale))
        return plus, minus

    model, _ = PRESETS["tiny"]
    with mock.patch.object(Ops, "perturbed_losses", recording):
        for _ in start_run(run, model, cfg, should_stop=lambda: len(scalars) >= step, ops=engine(Placement(), cfg)):
            pass
    return scalars[:step]


def step_norm(ops, layout, coeffs, pop, lr) -> float:
    return float(np.linalg.norm(lr * ops.to_numpy(ops.noise_sum(np.asarray(coeffs, np.float64), layout.size, pop))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--step", type=int, default=1148, help="the cliff-step (1-based, as records' step)")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--dir", type=Path, default=Path("runs/cliff"))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    # the run the replay took apart: plain SPSA (then the default), each shaping only replayed on top
    _, cfg = resolve("tiny", {"engine": a.engine, "seed": a.seed, "on_divergence": "continue", "shaping": ()})
    base_run = a.dir / f"{a.engine}-seed{a.seed}-to{a.step - 1}"
    record = base_run.with_suffix(".scalars.npy")
    if not record.exists():
        np.save(record, np.array(to_step(base_run, cfg, a.step - 1)))
    history = list(np.load(record))
    ckpt = RunFolder(base_run).read_checkpoint()
    assert ckpt.step == a.step - 1, ckpt.step
    heldout = load_corpus(None, split="heldout")
    small = Corpus(heldout.names, tuple(d[:8192] for d in heldout.docs))
    trainer = Trainer(tempfile.mkdtemp(), ckpt.model, ckpt.train, _sampler(ckpt), _state(ckpt),
                      engine(Placement(), ckpt.train))
    ops, layout = trainer.ops, Layout(ckpt.model)
    plus, minus = trainer.losses()  # the cliff-step's population, on its batch
    cliff = (plus - minus) / (2 * cfg.eps)
    before = evaluate_run(ckpt.theta, layout, small, ops=ops)["heldout"]["overall"]
    lines = [f"{a.engine} run, seed {a.seed}, step {a.step}: scalars' sd {cliff.std():.3g}, the median of the "
             f"100 steps before {np.median([g.std() for g in history[-100:]]):.3g}; held-out (8 KB per file) "
             f"before the step {before:.4f}", "",
             "| shaping | step norm | / median of the 100 steps before | held-out after the step | "
             "the run goes on to step 4000: guard | held-out at the end |", "| --- | --- | --- | --- | --- | --- |"]
    for name, pieces in SHAPINGS.items():
        shaped_cfg = dataclasses.replace(cfg, shaping=pieces)
        chain, state = Chain(shaped_cfg), Chain(shaped_cfg).init()
        norms = []
        for k, g in enumerate(history):
            g, state, _ = chain(g, state)
            if k >= len(history) - 100:
                pop = make_strategy(cfg).ask(0, k)
                norms.append(step_norm(ops, layout, g, pop, learning_rate(k, cfg.lr, cfg.steps, cfg.warmup,
                                                                           cfg.schedule)))
        g, _, _ = chain(cliff, state)
        pop = make_strategy(cfg).ask(0, a.step - 1)
        lr = learning_rate(a.step - 1, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule)
        norm = step_norm(ops, layout, g, pop, lr)
        after = ckpt.theta - lr * ops.to_numpy(ops.noise_sum(np.asarray(g, np.float64), layout.size, pop)).astype(np.float32)
        held = evaluate_run(after, layout, small, ops=ops)["heldout"]["overall"]
        end = _go_on(a.dir / f"{a.engine}-seed{a.seed}-{name.replace('+', '-').replace(' ', '-')}", ckpt, shaped_cfg,
                     state)
        verdict = end["divergence"]
        lines.append(f"| {name} | {norm:.3g} | {norm / np.median(norms):.1f}x | {held:.4f} | "
                     + (f"fired at step {verdict['step']}" if verdict else "no verdict")
                     + f" | {end['heldout']['overall']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(f"$ python studies/cliff_step.py --seed {a.seed} --step {a.step} --engine {a.engine}\n\n{text}")


def _sampler(ckpt):
    from zosoma.corpus import BatchSampler
    return BatchSampler(load_corpus(None, split="train"), ckpt.train.seq_len + 1)


def _state(ckpt):
    from zosoma.training.trainer import from_checkpoint
    return from_checkpoint(ckpt)


def _go_on(run: Path, ckpt, cfg: TrainConfig, shaping: dict) -> dict:
    """Training from the cliff-step's state with `cfg` (its shaping at `shaping`) to the end."""
    folder = RunFolder(run)
    if (run / "results.json").exists():
        return json.loads((run / "results.json").read_text())
    if not folder.has_checkpoint:
        start = dataclasses.replace(ckpt, train=cfg, extra={**ckpt.extra, "shaping": shaping})
        folder.make()
        folder.write_checkpoint(start)
    for r in resume_run(run, ops=engine(Placement(), cfg)):
        if isinstance(r, Evaluated):
            return r.results
    raise SystemExit(f"{run}: no evaluation")


if __name__ == "__main__":
    main()
