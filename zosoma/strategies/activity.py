"""Activity (node) perturbation: noise on the pre-activations, each row's own loss difference.

Every strategy before this one perturbs the weights and turns a whole batch into one scalar per
member, so its error grows with the d perturbed weights. Node perturbation (Fiete and Seung 2006;
Ren, Kornblith, Liao and Hinton 2023, "Scaling forward gradient with local losses", activity
perturbation) perturbs what the layers compute: pair k adds +/- eps * z_k to every row's gate
pre-activations (4H per layer) and logits (V) at every time step, z_k from the counters (seed,
expert, step, member=k). Each of the B rows gives its own scalar per pair,

    c_(k,b) = (L_b(+k) - L_b(-k)) / (2 eps)                         P x B scalars, L_b a row's mean nats
    ghat    = outer products of zeta = 1/(P B) sum_k c_(k,b) z_(k,b)  with a clean forward's inputs

(zosoma.model.node_perturbation: at first order an unbiased estimate of the batch loss's gradient
through time, for every tensor; the readout's from the logits' noise, the embedding's through
layer 0's w_ih^T). The update regenerates or reuses the noise and runs one more forward at theta
that accumulates the outer products (Ops.activity_estimate); then the update transforms, then a
step down. No autograd and no backward pass: the forward computes every input the products need.

Its members share theta, so an engine runs a population as one forward over 2P B rows. A step
costs the 2P B T tokens of its members plus, per predicted byte, node_perturbation.update_flops
(the clean forward, the outer products, combining P pairs' noise): `extra_flops`.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.errors import ConfigError
from zosoma.model import node_perturbation
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.strategies.base import Strategy
from zosoma.strategies.onesided import one_sided


class Activity(Strategy):
    name = "activity"
    not_summable = "scales each expert's own rows' noise"  # per-row scalars: no shared loss to add
    options = frozenset({"noise", "weight_decay", "shaping", "clip_at", "normalize_window", "transforms"})

    readout = "perturb"  # the output layer: noise on its logits ("local": its exact delta rule)
    causal = False  # True: each target's own difference, credited to the noise that can move it
    onesided = False  # True: 2P members, each its own noise, against the members' mean (its ask's table)
    _step = None  # (pop, batch): the step whose losses ran, for its update

    @classmethod
    def extra_flops(cls, model: ModelConfig, cfg: TrainConfig) -> float:
        """FLOPs a step spends beyond its members' 2P B T forward bytes: the update's clean forward,
        outer products and noise combination (node_perturbation.update_flops per predicted byte)."""
        members = cfg.perturbations * (2 if cls.onesided else 1)  # the noises the update combines
        return float(cfg.batch * cfg.seq_len * node_perturbation.update_flops(Layout(model), members, cls.readout))

    def check(self, layout: Layout) -> None:
        if layout is None:  # zosoma.Optimizer: a flat vector has no pre-activations to perturb
            raise ConfigError(f"--optimizer {self.name} perturbs an LSTM's pre-activations: it needs a model "
                              "(zosoma train), not a flat vector")
        super().check(layout)

    def values_per_member(self) -> int:
        return self.cfg.batch * (self.cfg.seq_len if self.causal else 1)

    def ask(self, expert: int, step: int) -> Population:
        cfg = self.cfg
        return Population(self.pairs(step), cfg.eps, cfg.seed, expert, step, cfg.noise)

    def losses(self, ops, theta, layout: Layout, batch, pop: Population, state: dict, pairs: range | None = None,
               timings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(plus, minus), each (|pairs|, B): every row's loss under pair k's two members (causal and
        one-sided: (|pairs|, B, T), every target's nats)."""
        self._step = (pop, np.asarray(batch))
        return ops.activity_losses(theta, layout, batch, pop, pairs, timings, self.readout, self.causal)

    def coefficients(self, plus, minus):
        """The P B scalars c_(k,b), pair-major (causal: P B T, one per target), and the minibatch
        loss estimate at theta."""
        plus, minus = np.asarray(plus), np.asarray(minus)
        return node_perturbation.coefficients(plus, minus, self.cfg.eps).ravel(), float(np.mean((plus + minus) / 2))

    def update(self, ops, layout: Layout, theta, state: dict, coeffs: np.ndarray, pop: Population, lr: float):
        kept = self._step
        if kept is None or kept[0] != pop:
            raise RuntimeError(f"--optimizer activity updates step {pop.step} from the batch of its losses, "
                               "which this strategy did not evaluate")
        ghat = ops.activity_estimate(theta, layout, kept[1], coeffs, pop, self.readout, self.causal)
        direction, state = self.transforms(ghat, state, pop.step)
        return self.descend(ops, theta, direction, lr), state



class ActivityLocal(Activity):
    """Activity perturbation on the LSTM's gates only; the readout by its local rule, the exact
    delta rule (softmax - onehot) h_t^T of the update's clean forward. A row's scalar then carries
    the noise of its T 4H L gates only, not of its T V logits as well. The readout's gradient is
    exact and the gates' estimate unbiased, so the sum is an unbiased estimate whose blocks' scales
    a shaping of the scalars would set apart: it takes none."""

    name = "activity-local"
    readout = "local"
    options = Activity.options - {"shaping", "clip_at", "normalize_window"}
    defaults = {"shaping": ()}  # what its configuration records


class ActivityCausal(Activity):
    """Activity perturbation with each target's own difference (P B T scalars): the noise on a
    position's gates is weighted by the differences of that position's and later targets, the
    noise on its logits by its own target's only (node_perturbation.credit): the same expectation,
    less variance. The scalars sum to a row's, so the shaping scales them as it scales Activity's."""

    name = "activity-causal"
    causal = True


class ActivityLocalCausal(ActivityLocal):
    """activity-local's readout (its exact delta rule) with activity-causal's credit on the gates."""

    name = "activity-local-causal"
    causal = True


class ActivityOneSided(ActivityLocalCausal):
    """activity-local-causal with one-sided members, as --optimizer onesided is to SPSA: pair k's
    members are a + eps z_2k and a + eps z_2k+1, 2P noises of their own, and each target's scalar is
    its nats' difference from the 2P members' mean at that target, d_(j,b,t) = (nll_j - mean_i
    nll_i) / eps: twice the directions for the same forwards. The price: each scalar carries eps/2
    times the curvature along z_j, which a pair cancels, and the mean includes the member itself
    (a factor (2P - 1)/2P)."""

    name = "activity-onesided"
    onesided = True
    # 1.0 at the tiny preset's 0.15: `zosoma train`'s model (E=32 H=64, 3,540 steps) scored 2.475 /
    # 2.523 / 2.650 on validation at 1, 2 and 4 (results/price-activity, seed 0; 1 is the grid's edge)
    rate_factor = 20 / 3
    # 3,100 steps: one-sided SPSA's 3,540 at equal wall, a step costing 1.13x-1.14x its
    # (results/piece-cost.txt, the tiny preset's shape)
    defaults = {**ActivityLocalCausal.defaults, "steps": 3100}

    def ask(self, expert: int, step: int) -> Population:
        return one_sided(super().ask(expert, step))

    def coefficients(self, plus, minus):
        """The 2P B T scalars d_(j,b,t), member-major (member 2k + s), and the loss estimate."""
        plus, minus = np.asarray(plus), np.asarray(minus)
        nats = np.stack([plus, minus], axis=1).reshape((-1,) + plus.shape[1:])  # (2P, B, T), member j at j
        return ((nats - nats.mean(axis=0)) / self.cfg.eps).ravel(), float(nats.mean())
