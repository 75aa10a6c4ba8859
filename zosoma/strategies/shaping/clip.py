"""Clipping: each of the step's scalars bounded at `clip_at` times a running scale of the
scalars, so that one sequence sitting on a loss cliff cannot throw the weights (evotorch's ClipUp
bounds the update's norm; here the bound is per scalar, before the update rule).

    m     = running median of |g| (an EMA, decay 0.98, of each step's median |g_k|; the
            first step sets it)
    g_k  <- clip(g_k, -c m, c m)                       with the m of the steps before this one
    m    <- 0.98 m + 0.02 median_k |g_k|               after the step, from its clipped scalars

The first WARMUP steps only measure m. The median, not the mean, so that the cliff-step itself
hardly moves the bound.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError

DECAY = 0.98
WARMUP = 10


class Clip:
    def __init__(self, cfg):
        if not cfg.clip_at > 0:
            raise ConfigError(f"clip_at must be positive, got {cfg.clip_at}")
        self.at = float(cfg.clip_at)

    def init(self) -> dict:
        return {"steps": 0, "median": 0.0}

    def __call__(self, g: np.ndarray, state: dict):
        steps, m = state["steps"], state["median"]
        clipped = 0
        if steps >= WARMUP:
            bound = self.at * m
            clipped = int(np.count_nonzero(np.abs(g) > bound))
            g = np.clip(g, -bound, bound)
        median = float(np.median(np.abs(g)))
        m = median if steps == 0 else DECAY * m + (1 - DECAY) * median
        return g, {"steps": steps + 1, "median": m}, {"count": clipped}
