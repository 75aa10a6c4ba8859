"""OpenAI-ES (Salimans et al., "Evolution Strategies as a Scalable Alternative to Reinforcement
Learning", 2017): antithetic Gaussian perturbations, centred-rank fitness shaping.

Members theta +/- sigma eps_k, eps_k ~ N(0, I) from the counters (the dense Gaussian population,
as SPSA's `--noise gaussian`); fitness f = -loss over all 2P members is replaced by its centred
rank in [-0.5, 0.5]; the ascent step on the rank-shaped objective is

    theta <- theta + lr / (2P sigma) * sum_k (r_{k+} - r_{k-}) eps_k   (- lr * weight_decay * theta)

Against SPSA: the same forwards, but the scalars are ranks, not finite differences (invariant to
the loss's scale, robust to outliers); against EGGROLL: full-rank noise and rank shaping instead
of low-rank noise and z-scores. The step is the engine's fused SPSA update with coefficients
-(r_{k+} - r_{k-}) / (2 sigma).
"""

from __future__ import annotations

import numpy as np

from zosoma.model.population import Population
from zosoma.strategies.base import Strategy


def centered_ranks(x) -> np.ndarray:
    """Ranks of x (ties in index order) mapped linearly onto [-0.5, 0.5], float64 (Salimans et al.'s
    compute_centered_ranks)."""
    x = np.asarray(x, np.float64).ravel()
    ranks = np.empty(x.size)
    ranks[np.argsort(x, kind="stable")] = np.arange(x.size)
    return ranks / max(1, x.size - 1) - 0.5


class OpenES(Strategy):
    name = "es"
    options = frozenset({"weight_decay", "probes", "queries", "transforms"})
    defaults = {"eps": 0.02, "lr": 0.005, "shaping": ()}  # a sweep on the tiny preset; ranks are its shaping

    def ask(self, expert: int, step: int) -> Population:
        cfg = self.cfg
        return Population(self.pairs(step), cfg.eps, cfg.seed, expert, step, "gaussian")

    def coefficients(self, plus, minus):
        loss = float(np.mean((plus + minus) / 2))
        if not (np.all(np.isfinite(plus)) and np.all(np.isfinite(minus))):
            return np.full(plus.shape, np.nan), loss
        r = centered_ranks(-np.stack([plus, minus], axis=1).ravel())  # fitness ranks, + then - of each pair
        return -(r[0::2] - r[1::2]) / (2 * self.cfg.eps), loss
