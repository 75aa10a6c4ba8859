"""SPSA and its update rules: ZO-SGD, ZO-momentum, ZO-Adam.

SPSA (Spall 1992; MeZO, Malladi et al. 2023, for seed-regenerated noise): on one shared minibatch,

    g_k  = (L(theta + eps*delta_k) - L(theta - eps*delta_k)) / (2*eps)      k = 0..P-1
    ghat = (1/P) * sum_k g_k * delta_k

where delta_k = noise(seed, expert, step, member=k). Only the P scalars g_k are needed to rebuild
ghat anywhere: the directions are regenerated from their counters, never stored.

The update rules are small pieces with explicit state (a dict of arrays, so it checkpoints as is):
ZO-SGD (the engine's fused regenerate-and-apply update), ZO-momentum (heavy ball, as
torch.optim.SGD) and ZO-Adam (Kingma & Ba 2015), all with decoupled weight decay (AdamW,
Loshchilov & Hutter 2019). Momentum and Adam are the update transforms of
zosoma.strategies.transforms built in; `--transforms` chains them onto ZO-SGD (or ES) too.
"""

from __future__ import annotations

import numpy as np

from zosoma.model.population import Population
from zosoma.strategies.base import Strategy


def central_differences(plus: np.ndarray, minus: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
    """SPSA coefficients g_k = (L+ - L-) / (2 eps) and the minibatch loss estimate at theta."""
    return (plus - minus) / (2 * eps), float(np.mean((plus + minus) / 2))


class SPSA(Strategy):
    """Dense antithetic perturbations eps * delta_k (Rademacher or Gaussian), central differences,
    and an update rule applied to ghat. The plain rule is ZO-SGD (Strategy.update)."""

    name = "sgd"
    not_summable = None  # central differences add up
    options = frozenset({"noise", "weight_decay", "shaping", "clip_at", "normalize_window", "probes", "queries",
                         "transforms"})

    def ask(self, expert: int, step: int) -> Population:
        cfg = self.cfg
        return Population(self.pairs(step), cfg.eps, cfg.seed, expert, step, cfg.noise)

    def coefficients(self, plus, minus):
        return central_differences(plus, minus, self.cfg.eps)


class Momentum(SPSA):
    """ZO-momentum: m <- beta1 m + ghat, theta <- theta - lr m (zosoma.strategies.transforms)."""

    name = "momentum"
    builtin = ("momentum",)


class Adam(SPSA):
    """ZO-Adam: bias-corrected first and second moments of ghat (zosoma.strategies.transforms)."""

    name = "adam"
    builtin = ("adam",)
