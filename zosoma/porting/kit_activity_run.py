"""The porting kit's stage `run_activity`: activity perturbation's default run (`zosoma train
--optimizer activity-onesided`: the tiny preset, every other setting the strategy's default as
zosoma.strategies.settings.resolve gives it) shortened to 300 steps, with run_onesided's outputs and
checks: every step's loss and the held-out nats/byte. PORTING.md ("A whole run") is the
specification it serves, "Activity perturbation" the rule its steps follow.

Its reference figures come from training with zosoma's Numba engine and are stored under
"activity" in default_run_reference.json (`python -m zosoma.porting.kit_activity_run`
measures them again), with the settings they were measured at: if the strategy's defaults move
(its rate, say, when it becomes zosoma train's default), the stage refuses to be written until
they are measured again. tests/test_porting_activity_run.py trains the run afresh.

How its tolerances were set: ONNX Runtime, run_onesided's second engine, cannot train activity
perturbation, so the spread is measured against the same run with every step computed by
zosoma.model.node_perturbation, the plain NumPy reference (`ReferenceSteps`: the members' nats, the
credit, zeta and the outer products; theta and its update float32, as a port's), once in float64
(the gap is what the Numba engine's float32 rounding moves the run by) and once in float32 (another
float32 port, in NumPy's summation order: the larger gap, 1.6e-3 in a step's loss against 9.8e-4).
A step's scalars divide float32 nats by eps = 1e-3, so rounding moves this run's losses some 200
times more than run_onesided's. The tolerances are the larger of the `run` stage's and 4 x the
larger gap, for the seeds and summation orders not measured: 7e-3 for the losses, the `run`
stage's 0.006 held-out (the gap there is 3.4e-5).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.porting.kit_default_run import REFERENCE, STEPS, _settings, run_inputs, train_run
from zosoma.porting.kit_run import HELDOUT_ATOL, LOSS_ATOL
from zosoma.porting.stage import Out, Stage
from zosoma.strategies.settings import DEFAULT_OPTIMIZER, resolve

OPTIMIZER = "activity-onesided"
MARGIN = 4  # the tolerance over the larger measured gap: the seeds and orders not measured
REFERENCES = {"float64": np.float64, "float32": np.float32}  # ReferenceSteps' dtypes the spread is measured with
# what a port may plausibly train instead: (the reading, the settings it trains with besides STEPS);
# "lr": None stands for run_activity's own rate (resolve's for activity-onesided)
MISREAD_RUNS = {
    "pairs": ("antithetic pairs +/- eps z_k (activity-local-causal's members), not 2P noises of their own",
              {"optimizer": "activity-local-causal", "lr": None}),
    "spsa_rate": ("the estimator swapped in but the rate left at one-sided SPSA's (1.4142 x the preset's)",
                  {"optimizer": OPTIMIZER, "lr": "onesided"}),
}


def activity_config(**given) -> tuple[ModelConfig, TrainConfig]:
    """run_activity's run: `zosoma train --optimizer activity-onesided --steps 300` (every other
    setting the strategy's default); `given` settings replace its own (a misreading's run)."""
    return resolve("tiny", {"steps": STEPS, "optimizer": OPTIMIZER, **given})


def misread_config(which: str) -> tuple[ModelConfig, TrainConfig]:
    """The run of MISREAD_RUNS[which]: its rate run_activity's or the optimizer named's default."""
    given = dict(MISREAD_RUNS[which][1])
    lr = given.pop("lr")
    rate = resolve("tiny", {"steps": STEPS, "optimizer": lr or OPTIMIZER})[1].lr
    return activity_config(**given, lr=rate)


class ReferenceSteps(Ops):
    """The CPU engine with activity perturbation's steps by zosoma.model.node_perturbation, the plain
    NumPy reference, in `dtype`: the members' nats, the credit, zeta and the outer products from
    theta in that dtype (the noise is exact: Rademacher signs); the update and theta stay float32,
    the evaluation the CPU engine's. Only the spread measurement trains with it."""

    _kept = None  # (Population, directions, (J, B, T, S) dtype): the noise activity_losses drew

    def __init__(self, dtype=np.float64):
        self.dtype = np.dtype(dtype)

    def activity_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                        timings: dict | None = None, readout: str = "perturb", positions: bool = False):
        pairs = range(pop.P) if pairs is None else pairs
        batch = np.asarray(batch)
        table = pop.direction[pop.rows(pairs)]
        directions = sorted(set(table.tolist()))
        Z = self._noise(layout, batch, pop, directions, readout)
        nats = node_perturbation.member_losses(np.asarray(theta, self.dtype), layout, batch, pop.scale, Z,
                                               np.searchsorted(directions, table), pop.sign[pop.rows(pairs)])
        plus, minus = nats[0::2], nats[1::2]
        self._kept = (pop, directions, Z)
        return (plus, minus) if positions else (plus.mean(axis=-1), minus.mean(axis=-1))

    def activity_estimate(self, theta, layout: Layout, batch, coeffs, pop: Population, readout: str = "perturb",
                          causal: bool = False):
        batch = np.asarray(batch)
        B, T = batch.shape[0], batch.shape[1] - 1
        J, kept, S = pop.directions, self._kept, node_perturbation.width(layout, readout)
        ours = kept is not None and kept[0] == pop and kept[1] == list(range(J)) and kept[2].shape[3] == S
        Z = kept[2] if ours else self._noise(layout, batch, pop, range(J), readout)
        coeffs = np.asarray(coeffs, np.float64).reshape((J, B, T) if causal else (J, B))
        w_gates, w_logits = (np.broadcast_to(w, Z.shape[:3]) for w in node_perturbation.credit(coeffs, causal))
        gates = 4 * layout.config.hidden * layout.config.layers
        zeta = np.concatenate([np.einsum("kbt,kbts->bts", w_gates, Z[..., :gates]),
                               np.einsum("kbt,kbts->bts", w_logits, Z[..., gates:])], axis=-1)
        return node_perturbation.estimate(np.asarray(theta, self.dtype), layout, batch, zeta.astype(self.dtype))

    def _noise(self, layout: Layout, batch, pop: Population, directions, readout: str) -> np.ndarray:
        B, T = batch.shape[0], batch.shape[1] - 1
        return np.stack([node_perturbation.member_noise(layout, B, T, pop.seed, pop.expert, pop.step, j, pop.kind,
                                                        readout) for j in directions]).astype(self.dtype)


def tolerances(spread: dict) -> tuple[float, float]:
    """(the losses' atol, the held-out's): the `run` stage's, or MARGIN x the measured gap rounded
    up to one significant figure where that is larger."""
    def up(x: float) -> float:
        digits = math.floor(math.log10(x))
        return math.ceil(x / 10 ** digits) * 10 ** digits
    return (max(LOSS_ATOL, up(MARGIN * spread["losses"])), max(HELDOUT_ATOL, up(MARGIN * spread["heldout"])))


def settings_of(model: ModelConfig, cfg: TrainConfig) -> dict:
    """The run's model and training settings as the reference file stores them."""
    return json.loads(json.dumps({**dataclasses.asdict(model), **dataclasses.asdict(cfg)}))


def activity_stage() -> Stage:
    model, cfg = activity_config()
    stored = json.loads(REFERENCE.read_text())
    ref, spread = stored["activity"], stored["activity"]["spread"]
    changed = sorted(k for k, v in settings_of(model, cfg).items() if ref["settings"].get(k) != v)
    if changed:  # the strategy's defaults moved (its rate, say): the stored figures are another run's
        raise RuntimeError(f"run_activity's reference was measured with other settings ({', '.join(changed)}): "
                           "measure it again, python -m zosoma.porting.kit_activity_run")
    inputs = run_inputs(cfg)
    outputs = {
        "losses": Out(np.array(ref["losses"]), "activity_run_losses", tuple(inputs) + ("the shipped corpus",),
                      "each step's loss (the mean over the 2P members, rows and targets of the nats, member j's gate "
                      "pre-activations plus eps z_j: one-sided activity perturbation), training from init(seed, 0) "
                      f"at lr {cfg.lr:.5g} (the preset's x 20/3), no shaping, the readout by its delta rule"),
        "heldout": Out(np.float64(ref["heldout"]), "activity_run_heldout", ("losses",),
                       "the overall held-out nats/byte of the final theta by the evaluation protocol"),
    }
    loss_atol, heldout_atol = tolerances(spread)
    gap = (f"zosoma's Numba engine against the same run with its steps by the plain NumPy reference in float64 "
           f"and in float32, seed 0: step losses {spread['losses']:.1e} apart at most, held-out "
           f"{spread['heldout']:.1e}")
    tol = {"activity_run_losses": (loss_atol, 0.0, f"{gap}; the larger of the `run` stage's tolerance and "
                                                   f"{MARGIN} x the gap (the seeds and orders not measured)"),
           "activity_run_heldout": (heldout_atol, 0.0, "the larger of the `run` stage's (the engines' largest "
                                                       f"held-out gap over a full run) and {MARGIN} x the gap")}
    paper = json.loads(Path(__file__).with_name("run_reference.json").read_text())
    found = [("one-sided SPSA's run (weights perturbed, not activities: run_onesided's)", stored["onesided"]),
             ("the paper's estimator at its rate (antithetic pairs, lr 0.15: the `run` stage's)", paper),
             *((MISREAD_RUNS[k][0], ref["misread"][k]) for k in MISREAD_RUNS)]
    # pairs end 0.008 from the kit's held-out, too near to name by it: their losses name them
    misreadings = {"losses": [(what, np.array(run["losses"])) for what, run in found],
                   "heldout": [(what, np.float64(run["heldout"])) for what, run in found
                               if what != MISREAD_RUNS["pairs"][0]]}
    default = ", zosoma train's default" if DEFAULT_OPTIMIZER == OPTIMIZER else ""
    settings = _settings(model, cfg, {
        "perturbations": "P: 2P members, each its own gate noise z_j",
        "eps": "the gate noise's scale", "noise": "the gate noise's kind",
        "optimizer": f"one-sided activity perturbation{default}", "lr": "the peak rate (the preset's x 20/3)",
        "normalize_window": "W (read by the normalize shaping only: none here)",
        "shaping": "none: the strategy takes no shaping"})
    return Stage("run_activity", f"activity perturbation's default run (zosoma train --optimizer {OPTIMIZER}) "
                                 f"shortened to {cfg.steps} steps on the shipped corpus: every step's loss and the "
                                 "held-out nats/byte", inputs, outputs, settings=settings, misreadings=misreadings,
                 tol=tol)


def measure(out=sys.stdout) -> dict:
    """Train run_activity's run on the Numba engine, again with ReferenceSteps in each of REFERENCES'
    dtypes, and the misreadings' runs; write their figures under "activity" in
    default_run_reference.json (the others kept): the spread the largest gap of the references."""
    ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = activity_config()
        a = train_run(Path(tmp) / "native", model, cfg)
        by = {}
        for name, dtype in REFERENCES.items():
            b = train_run(Path(tmp) / name, model, cfg, ops=ReferenceSteps(dtype))
            if b["restarts"] != a["restarts"] or len(b["losses"]) != len(a["losses"]):
                raise RuntimeError(f"the {name} reference steps restarted as the engine did not: {b['restarts']}")
            by[name] = {"losses": float(np.abs(np.subtract(a["losses"], b["losses"])).max()),
                        "heldout": abs(a["heldout"] - b["heldout"])}
            print(f"activity: held-out {a['heldout']:.4f} ({name} reference steps {b['heldout']:.4f}), restarts "
                  f"{a['restarts']}, final step {a['final_step']}, step losses {by[name]['losses']:.1e} apart at most",
                  file=out)
        ref["activity"] = dict(a, spread={"against": "the steps by zosoma.model.node_perturbation in float64 and "
                                                     "float32 (kit_activity_run.ReferenceSteps)",
                                          **{k: max(g[k] for g in by.values()) for k in ("losses", "heldout")},
                                          "by": by}, misread={}, settings=settings_of(model, cfg))
        for which in MISREAD_RUNS:
            m, c = misread_config(which)
            ref["activity"]["misread"][which] = run = train_run(Path(tmp) / which, m, c)
            print(f"misread {which} ({c.optimizer}, lr {c.lr:.5g}): held-out {run['heldout']:.4f}, restarts "
                  f"{run['restarts']}", file=out)
    REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    return ref


if __name__ == "__main__":
    measure()
