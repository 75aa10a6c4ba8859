"""The porting kit's stages of one-sided SPSA's default run (`zosoma train --optimizer onesided`: its rate
the preset's times 1.4142): `run_onesided`, that run shortened to 300 steps, and `run_restart`, a
short run of it that restarts once and shows what a restart costs: the steps it re-runs count
against --steps, so the step counter ends short of them. Its first course runs at a rate that
diverges at once (the guard's verdict comes at the earliest step it can, in any port), and its
restart factor brings the rate back to about the default's, so the course after the rollback trains
as stably as `run_onesided` and a port's figures can be held to the same tolerances. Both name
their optimizer, so they keep their figures whichever estimator `zosoma train` defaults to
(activity perturbation's run is kit_activity_run's). PORTING.md ("A whole run") is the
specification they serve.

Their reference figures come from training with zosoma and are stored in default_run_reference.json
beside this module (`python -m zosoma.porting.kit_default_run` measures them again, with the engines'
spread: the Numba engine against ONNX Runtime; `python -m zosoma.porting.kit_activity_run` measures
run_activity's);
tests/test_porting_run.py trains them afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.porting.kit_run import HELDOUT_ATOL, LOSS_ATOL, corpus_sha256s
from zosoma.porting.stage import Out, Stage
from zosoma.training.records import Evaluated, Restarted, Step
from zosoma.training.stepper import stream
from zosoma.training.trainer import Trainer
from zosoma.strategies.settings import DEFAULT_OPTIMIZER, resolve
from zosoma.runs.run import Run, Spec
from zosoma.runs.single import start_run

STEPS = 300  # every run: the cosine laid out over these steps
ONESIDED = {"steps": STEPS, "optimizer": "onesided"}  # by name: not whatever `zosoma train` defaults to
# lr 20 diverges at once: the verdict at step 87, the first the guard can give (window 37 after the first 50),
# rolled back to step 0 (the checkpoint at 50 is past the best already); then lr 20 x 0.01 = 0.2 trains
RESTART = {"lr": 20.0, "restart_lr_factor": 0.01, "checkpoint_every": 50}
REFERENCE = Path(__file__).with_name("default_run_reference.json")
ENGINES = ("native", "onnxruntime")
TODAY = DEFAULT_OPTIMIZER == "onesided"  # the stages' lines call it the default only while it is


def onesided_config() -> tuple[ModelConfig, TrainConfig]:
    """run_onesided's run: `zosoma train --optimizer onesided --steps 300` (every other setting the
    strategy's default)."""
    return resolve("tiny", ONESIDED)


def restart_config() -> tuple[ModelConfig, TrainConfig]:
    """run_restart's run: `zosoma train --optimizer onesided --steps 300 --lr 20 --restart-lr-factor 0.01
    --checkpoint-every 50`."""
    return resolve("tiny", {**ONESIDED, **RESTART})


def train_reference(run_dir, which: str, engine: str = "native", budget: bool = True) -> dict:
    """Train `which` run ("onesided" or "restart") in the new folder run_dir: every attempted
    step's loss in the order attempted (a restart's rolled-back steps included), the restarts
    (step of the verdict, step rolled back to), the step counter at the end and the held-out
    nats/byte. budget=False trains as the old reading of PORTING.md did (the counter runs on to
    --steps after a rollback: the steps a restart re-runs are not counted)."""
    model, cfg = onesided_config() if which == "onesided" else restart_config()
    return train_run(run_dir, model, dataclasses.replace(cfg, engine=engine), budget=budget)


def train_run(run_dir, model: ModelConfig, cfg: TrainConfig, ops=None, budget: bool = True) -> dict:
    """train_reference's figures of any run's configuration, on the engine it names (Run.start) or on `ops`."""
    losses, restarts, results = [], [], None
    old_reading = mock.patch.object(Trainer, "spent", property(lambda self: False))
    with old_reading if not budget else contextlib.nullcontext():
        # on the engine cfg names, or a reference's own (kit_activity_run's ReferenceSteps)
        records = Run.start(Spec(model, cfg), run_dir=run_dir) if ops is None else start_run(run_dir, model, cfg, ops=ops)
        for r in records:
            if isinstance(r, Step):
                losses.append(float(r.metrics["loss"]))
                final = r.metrics["step"]
            elif isinstance(r, Restarted):
                restarts.append([r.step, r.to])
                final = r.to
            elif isinstance(r, Evaluated):
                results = r.results
    return {"losses": losses, "restarts": restarts, "final_step": final,
            "heldout": float(results["heldout"]["overall"])}


def batch_indices(cfg: TrainConfig, streams) -> tuple[np.ndarray, np.ndarray]:
    """(doc, start), each (len(streams), steps, B) int64: the default run's windows of every step
    on each stream (zosoma.corpus.BatchSampler.positions)."""
    sampler = BatchSampler(load_corpus(None, split="train"), cfg.seq_len + 1)
    found = [[sampler.positions(cfg.seed, s, t, cfg.batch) for t in range(cfg.steps)] for s in streams]
    doc = np.array([[d for d, _ in rows] for rows in found], np.int64)
    start = np.array([[s for _, s in rows] for rows in found], np.int64)
    return doc, start


def _settings(model: ModelConfig, cfg: TrainConfig, lines: dict | None = None) -> dict:
    """The stage's settings, each (value, a line saying what it is); `lines` replaces some lines."""
    found = {"embed": (model.embed, "E"), "hidden": (model.hidden, "H"), "layers": (model.layers, "L"),
            **{k: (getattr(cfg, k), what) for k, what in (
                ("steps", "the run's length: the cosine is laid out over it, and the steps attempted in all"),
                ("batch", "B"), ("seq_len", "T"), ("perturbations", "P: 2P members, each along a direction of its own"),
                ("eps", "the perturbation scale"), ("noise", "the directions' kind"),
                ("optimizer", "one-sided SPSA" + (", zosoma train's default" if TODAY else "")),
                ("lr", "the peak rate"),
                ("schedule", "after the warm-up"), ("warmup", "warm-up steps"), ("weight_decay", "none"),
                ("normalize_window", "W"), ("seed", "init, batches, noise"), ("checkpoint_every", "K"),
                ("on_divergence", "restart: roll back, halve the rate, a fresh stream"),
                ("restart_lr_factor", "the rate's factor per restart"), ("max_restarts", "then drop"))},
            "shaping": (",".join(cfg.shaping), "zosoma's default shaping"), "expert": (0, "a single model: stream 0")}
    return {k: (v, (lines or {}).get(k, line)) for k, (v, line) in found.items()}


def _spread(stored: dict, which: str) -> str:
    s = stored[which]["spread"]
    losses = f"step losses {s['losses']:.1e} apart at most" if s["losses"] is not None else "restarts differing"
    return f"zosoma's Numba and ONNX Runtime engines on this run, seed 0: {losses}, held-out {s['heldout']:.1e}"


def run_inputs(cfg: TrainConfig) -> dict:
    """A whole-run stage's inputs: the run's batches on stream 0 and the corpus files' digests."""
    doc, start = batch_indices(cfg, [0])
    return {"batch_doc": (doc[0], "(steps, B) int64 each window's train document (manifest order), stream 0"),
            "batch_start": (start[0], "(steps, B) int64 each window's first byte in its document"),
            "sha256": (corpus_sha256s(), "the corpus files' sha256 (uncompressed): train, then held-out, "
                                         "manifest order")}


def onesided_stage() -> Stage:
    model, cfg = onesided_config()
    stored = json.loads(REFERENCE.read_text())
    ref = stored["onesided"]
    inputs = run_inputs(cfg)
    outputs = {
        "losses": Out(np.array(ref["losses"]), "run_losses", tuple(inputs) + ("the shipped corpus",),
                      "each step's loss (the mean of the 2P members' losses, one-sided SPSA: member j = theta + eps "
                      "delta_j, j = 0..2P-1), training from init(seed, 0) at lr 1.4142 x the preset's, shaped by "
                      "normalize over the 2P scalars (L_j - mean) / eps"),
        "heldout": Out(np.float64(ref["heldout"]), "run_heldout", ("losses",),
                       "the overall held-out nats/byte of the final theta by the evaluation protocol"),
    }
    tol = {"run_losses": (LOSS_ATOL, 0.0, _spread(stored, "onesided") + "; the `run` stage's tolerance"),
           "run_heldout": (HELDOUT_ATOL, 0.0, "the `run` stage's: the engines' largest held-out gap over a full run")}
    paper = json.loads(Path(__file__).with_name("run_reference.json").read_text())
    misreadings = {"losses": [("the paper's estimator at its rate (antithetic pairs, lr 0.15: the `run` stage's)",
                               np.array(paper["losses"]))],
                   "heldout": [("the paper's estimator at its rate (antithetic pairs, lr 0.15: the `run` stage's)",
                                np.float64(paper["heldout"]))]}
    run = "today's default run (zosoma train: one-sided SPSA)" if TODAY else \
        "one-sided SPSA's default run (zosoma train --optimizer onesided)"
    return Stage("run_onesided", f"{run} shortened to {cfg.steps} steps on "
                                 "the shipped corpus: every step's loss and the held-out nats/byte", inputs, outputs,
                 settings=_settings(model, cfg), misreadings=misreadings, tol=tol)


def restart_stage() -> Stage:
    model, cfg = restart_config()
    stored = json.loads(REFERENCE.read_text())
    ref, old = stored["restart"], stored["restart"]["old_reading"]
    (verdict, to), = ref["restarts"]
    doc, start = batch_indices(cfg, [stream(0, 0), stream(0, 1)])
    inputs = {"batch_doc": (doc, "(2, steps, B) int64 each window's train document at every step counter, on "
                                 "stream 0 (row 0) and stream 65536, a first restart's (row 1)"),
              "batch_start": (start, "(2, steps, B) int64 each window's first byte in its document, as batch_doc"),
              "sha256": (corpus_sha256s(), "the corpus files' sha256 (uncompressed): train, then held-out, "
                                           "manifest order")}
    run = tuple(inputs) + ("the shipped corpus",)
    budget = ("the steps attempted in all, both courses, are `steps`: the run ends when they are spent, the counter "
              "at steps - (verdict_step - rollback_to), short of `steps`")
    outputs = {
        "verdict_step": Out(np.int64(verdict), "exact", run,
                            "the step counter at the guard's verdict (stage 8: window 37; the smoothed loss over "
                            "1.25 x its best for 37 steps after the first 50)"),
        "rollback_to": Out(np.int64(to), "exact", ("verdict_step (kit's)", "checkpoint_every") + run,
                           "the newest kept checkpoint of the course before the window at a healthy step, else the "
                           "course's oldest (stage 8; checkpoints at 0 and every checkpoint_every, the newest "
                           "2 + ceil(window / checkpoint_every) kept)"),
        "attempted": Out(np.int64(len(ref["losses"])), "exact", ("steps",), budget),
        "final_step": Out(np.int64(ref["final_step"]), "exact", ("verdict_step (kit's)", "rollback_to (kit's)", "steps"),
                          budget),
        "losses": Out(np.array(ref["losses"][verdict:]), "run_losses", run + ("rollback_to (kit's)",),
                      "the loss of every step after the rollback, counters rollback_to + 1 .. final_step, at the rate "
                      "times restart_lr_factor and on stream 65536 (fresh batches and noise)"),
        "heldout": Out(np.float64(ref["heldout"]), "run_heldout", ("losses",),
                       "the overall held-out nats/byte of the final theta (at counter final_step) by the evaluation "
                       "protocol"),
    }
    tol = {"run_losses": (LOSS_ATOL, 0.0, _spread(stored, "restart") + " (after the rollback); the `run` stage's "
                                                                        "tolerance"),
           "run_heldout": (HELDOUT_ATOL, 0.0, "the `run` stage's: the engines' largest held-out gap over a full run")}
    reading = ("the counter run on to `steps` after the rollback (the steps a restart re-runs not counted against "
               "--steps: PORTING.md before 2026-12-04)")
    misreadings = {"final_step": [(reading, np.int64(old["final_step"]))],
                   "attempted": [(reading, np.int64(len(old["losses"])))],
                   "heldout": [(reading, np.float64(old["heldout"]))]}
    estimator = "today's default estimator" if TODAY else "one-sided SPSA"
    return Stage("run_restart", f"a short run of {estimator} that restarts once (lr {cfg.lr:g}, then x "
                                f"{cfg.restart_lr_factor:g}): the verdict, the rollback, the steps attempted, the step "
                                "counter at the end, the steps' losses after the rollback and the held-out nats/byte",
                 inputs, outputs, settings=_settings(model, cfg), misreadings=misreadings, tol=tol)


def measure(which=("onesided", "restart"), out=sys.stdout) -> dict:
    """Train the runs named (both by default) on both engines, the restart run also as the old
    reading trains it, and write their figures into default_run_reference.json (the others kept):
    the native engine's figures and each run's spread between the engines."""
    ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in which:
            runs = {e: train_reference(Path(tmp) / f"{name}-{e}", name, e) for e in ENGINES}
            a, b = runs["native"], runs["onnxruntime"]
            cut = a["restarts"][0][0] if a["restarts"] else 0  # the steps after the first rollback
            same = a["restarts"] == b["restarts"] and len(a["losses"]) == len(b["losses"])
            ref[name] = dict(a, spread={
                "losses": float(np.abs(np.subtract(a["losses"][cut:], b["losses"][cut:])).max()) if same else None,
                "heldout": abs(a["heldout"] - b["heldout"]), "onnxruntime_restarts": b["restarts"]})
            print(f"{name}: held-out {a['heldout']:.4f} (ONNX Runtime {b['heldout']:.4f}), restarts {a['restarts']} "
                  f"(ONNX Runtime {b['restarts']}), final step {a['final_step']}", file=out)
        if "restart" in which:
            ref["restart"]["old_reading"] = old = train_reference(Path(tmp) / "old", "restart", budget=False)
            print(f"restart as the old reading trains it: restarts {old['restarts']}, final step {old['final_step']}, "
                  f"held-out {old['heldout']:.4f}", file=out)
    REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    return ref


if __name__ == "__main__":
    measure(sys.argv[1:] or ["onesided", "restart"])
