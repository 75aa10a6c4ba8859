"""Normalisation: the step's scalars of every step rescaled to one reference spread (after FZOO, which
divides each step by the spread of the batch's losses).

    s_t  = rms(g_t)                                   this step's spread
    ref  = S / n                                      the mean of the n spreads recorded so far
    g_t <- g_t                                        while n < WARMUP (or n < W, if W is less)
    g_t <- g_t * ref / s_t                            from then on
    while n < W (`normalize_window`): S += min(s_t, CAP * ref) (s_t itself while n < WARMUP), n += 1

The spread of plain SPSA's scalars follows the loss: when a step throws the weights onto a cliff,
the next scalars are larger, so is the next step, and the run can run away (a feedback between the
loss and the step size). A reference breaks that loop: every step has the norm of a typical early
step, times the learning rate. The direction is still the estimate's.

The reference holds from step WARMUP + 1 on, not only after the window, and a spread enters it at
most at CAP times the reference before it: a run whose loss starts to climb inside the window
(cpu-robust's SPSA P=1024 at seed 2: from step 37 of 165, the scalars' spread twice the steps'
before) takes steps of the reference's size, where steps 1 to W once went through as they were
and then made the reference their mean. After W steps the reference is frozen.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError

WARMUP = 10  # steps taken as they are, measuring (a mean of fewer is too noisy to hold a step to)
CAP = 2.0  # a spread enters the reference at most at this many times the reference


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
        scale = 1.0
        if steps >= min(WARMUP, self.window):  # held to the reference
            scale = (total / steps) / s if s > 0 else 0.0
        if steps < self.window:  # still measuring: the spread joins the reference, bounded
            entry = min(s, CAP * total / steps) if steps >= WARMUP else s
            state = {"steps": steps + 1, "sum": total + entry}
        return g * scale, state, {"scale": scale}
