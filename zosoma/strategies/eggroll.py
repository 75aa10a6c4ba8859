"""EGGROLL (Sarkar et al., "Evolution Strategies at the Hyperscale"; reference code
ESHyperscale/HyperscaleES): low-rank antithetic ES, z-scored fitness.

Member pairs theta +/- E_k with E_k = (sigma/sqrt(r)) A_k B_k^T per matrix (full-rank Gaussian on
vectors), regenerated from counters (zosoma.model.noise); fitness f = -loss, shaped by `zscore`
across the 2P members; update (the reference code's convention, without 1/sigma)

    theta <- theta + lr * (2P)^(-1/2) * sum_k (f~_{k+} - f~_{k-}) E_k
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.strategies.base import Strategy


def zscore(fitness) -> np.ndarray:
    """Fitness shaping: (f - mean) / std across the population (float64); all zeros when every
    fitness is equal (zero variance), never NaN. Non-finite fitness raises ValueError."""
    f = np.asarray(fitness, np.float64)
    if not np.all(np.isfinite(f)):
        raise ValueError("fitness values must be finite (a member diverged)")
    if f.size == 0 or f.max() == f.min():
        return np.zeros_like(f)
    std = f.std()
    if not std > 1e-12 * max(1.0, float(np.abs(f).max())):
        return np.zeros_like(f)
    return (f - f.mean()) / std


class Eggroll(Strategy):
    name = "eggroll"
    options = frozenset({"rank", "queries"})
    defaults = {"shaping": ()}  # z-scored fitness is its shaping

    def check(self, layout: Layout) -> None:
        """A rank-r product A B^T of an m x n matrix has rank at most min(m, n): a larger r only
        costs time (and the FLOPs count would not show it)."""
        side = min(min(e.shape) for e in layout.entries if len(e.shape) == 2)
        if self.cfg.rank > side:
            m = layout.config
            raise ConfigError(f"--rank {self.cfg.rank} exceeds {side}, the smallest side of this model's matrices "
                              f"(E={m.embed}, H={m.hidden}): a rank-r perturbation of an m x n matrix has rank "
                              f"at most min(m, n)")

    def ask(self, expert: int, step: int) -> Population:
        cfg = self.cfg
        return Population(self.pairs(step), cfg.eps, cfg.seed, expert, step, "gaussian", cfg.rank)

    def coefficients(self, plus, minus):
        loss = float(np.mean((plus + minus) / 2))
        if not (np.all(np.isfinite(plus)) and np.all(np.isfinite(minus))):
            return np.full(plus.shape, np.nan), loss  # a diverged member: the step is skipped
        fz = zscore(-np.stack([plus, minus], axis=1).ravel())  # fitness of members 2k (+), 2k+1 (-)
        return fz[0::2] - fz[1::2], loss

    def update(self, ops, layout, theta, state, coeffs, pop, lr):
        return ops.lowrank_update(theta, layout, coeffs, pop, lr), state
