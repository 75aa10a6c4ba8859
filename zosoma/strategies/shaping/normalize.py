"""Normalisation: every step's P scalars rescaled to one reference spread (after FZOO, which
divides each step by the spread of the batch's losses).

    s_t  = rms(g_t)                                   this step's spread
    ref  = mean of s_1 .. s_W                          the first W steps, unscaled (`normalize_window`)
    g_t <- g_t * ref / s_t                             from step W + 1 on

The spread of plain SPSA's scalars follows the loss: when a step throws the weights onto a cliff,
the next scalars are larger, so is the next step, and the run can run away (a feedback between the
loss and the step size). A fixed reference breaks that loop: every step has the norm of a typical
early step, times the learning rate. The direction is still the estimate's.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError


def spread(g: np.ndarray) -> float:
    """The scalars' root mean square: the estimate's norm is this times sqrt(d / P)."""
    return float(np.sqrt(np.mean(np.square(g))))


class Normalize:
    def __init__(self, cfg):
        if cfg.normalize_window < 1:
            raise ConfigError(f"normalize_window must be at least 1, got {cfg.normalize_window}")
        self.window = cfg.normalize_window

    def init(self) -> dict:
        return {"steps": 0, "sum": 0.0}

    def __call__(self, g: np.ndarray, state: dict):
        s = spread(g)
        steps, total = state["steps"], state["sum"]
        if steps < self.window:  # still measuring the reference: the step as it is
            return g, {"steps": steps + 1, "sum": total + s}, {"scale": 1.0}
        scale = (total / steps) / s if s > 0 else 0.0
        return g * scale, state, {"scale": scale}
