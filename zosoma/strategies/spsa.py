"""SPSA and its update rules: ZO-SGD, ZO-momentum, ZO-Adam.

SPSA (Spall 1992; MeZO, Malladi et al. 2023, for seed-regenerated noise): on one shared minibatch,

    g_k  = (L(theta + eps*delta_k) - L(theta - eps*delta_k)) / (2*eps)      k = 0..P-1
    ghat = (1/P) * sum_k g_k * delta_k

where delta_k = noise(seed, expert, step, member=k). Only the P scalars g_k are needed to rebuild
ghat anywhere: the directions are regenerated from their counters, never stored.

The update rules are small pieces with explicit state (a dict of arrays, so it checkpoints as is):
ZO-SGD (the engine's fused regenerate-and-apply update), ZO-momentum (heavy ball, as
torch.optim.SGD) and ZO-Adam (Kingma & Ba 2015), all with decoupled weight decay (AdamW,
Loshchilov & Hutter 2019).
"""

from __future__ import annotations

import numpy as np

from zosoma.model.population import Population
from zosoma.model.params import Layout
from zosoma.strategies.base import Strategy


def central_differences(plus: np.ndarray, minus: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
    """SPSA coefficients g_k = (L+ - L-) / (2 eps) and the minibatch loss estimate at theta."""
    return (plus - minus) / (2 * eps), float(np.mean((plus + minus) / 2))


class SPSA(Strategy):
    """Dense antithetic perturbations eps * delta_k (Rademacher or Gaussian), central differences,
    and an update rule applied to ghat. The plain rule is ZO-SGD."""

    name = "sgd"
    options = frozenset({"noise", "weight_decay", "shaping", "clip_at", "normalize_window"})

    def ask(self, expert: int, step: int) -> Population:
        cfg = self.cfg
        return Population(cfg.perturbations, cfg.eps, cfg.seed, expert, step, cfg.noise)

    def coefficients(self, plus, minus):
        return central_differences(plus, minus, self.cfg.eps)

    def update(self, ops, layout: Layout, theta, state, coeffs, pop, lr):
        return ops.sgd_update(theta, coeffs, pop, lr, self.cfg.weight_decay), {}

    def descend(self, ops, theta, direction, lr: float):
        """theta - lr * direction - lr * weight_decay * theta, a new float32 array."""
        new = theta - np.float32(lr) * direction.astype(np.float32)
        if self.cfg.weight_decay:
            new -= np.float32(lr * self.cfg.weight_decay) * theta
        return new.astype(np.float32)


class Momentum(SPSA):
    """ZO-momentum: m <- beta1 m + ghat, theta <- theta - lr m."""

    name = "momentum"
    options = SPSA.options | {"momentum"}

    def init(self, ops, d):
        return {"m": ops.xp.zeros(d, np.float32)}

    def update(self, ops, layout, theta, state, coeffs, pop, lr):
        ghat = ops.noise_sum(coeffs, theta.size, pop)
        m = self.cfg.momentum * state["m"] + ghat
        return self.descend(ops, theta, m, lr), {"m": m.astype(np.float32)}


class Adam(SPSA):
    """ZO-Adam: bias-corrected first and second moments of ghat."""

    name = "adam"
    options = SPSA.options | {"momentum", "beta2"}
    eps_adam = 1e-8

    def init(self, ops, d):
        return {"m": ops.xp.zeros(d, np.float32), "v": ops.xp.zeros(d, np.float32)}

    def update(self, ops, layout, theta, state, coeffs, pop, lr):
        cfg, xp = self.cfg, ops.xp
        ghat = ops.noise_sum(coeffs, theta.size, pop)
        m = cfg.momentum * state["m"] + (1 - cfg.momentum) * ghat
        v = cfg.beta2 * state["v"] + (1 - cfg.beta2) * ghat * ghat
        t = pop.step + 1
        m_hat = m / (1 - cfg.momentum ** t)
        v_hat = v / (1 - cfg.beta2 ** t)
        direction = m_hat / (xp.sqrt(v_hat) + self.eps_adam)
        return self.descend(ops, theta, direction, lr), {"m": m.astype(np.float32), "v": v.astype(np.float32)}
