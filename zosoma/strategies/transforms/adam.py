"""Adam (Kingma & Ba 2015): bias-corrected first and second moments of the estimate; the step is
along m_hat / (sqrt(v_hat) + 1e-8)."""

from __future__ import annotations

import numpy as np

from zosoma.arrays import get_array_module

EPS = 1e-8


class Adam:
    keys = ("m", "v")  # its state arrays
    reads = ("momentum", "beta2")  # the TrainConfig fields it reads (beta1 is --momentum)

    def __init__(self, cfg):
        self.beta1, self.beta2 = cfg.momentum, cfg.beta2

    def init(self, ops, d: int) -> dict:
        return {"m": ops.xp.zeros(d, np.float32), "v": ops.xp.zeros(d, np.float32)}

    def __call__(self, g, state: dict, step: int):
        xp = get_array_module(g)
        m = self.beta1 * state["m"] + (1 - self.beta1) * g
        v = self.beta2 * state["v"] + (1 - self.beta2) * g * g
        t = step + 1
        m_hat = m / (1 - self.beta1 ** t)
        v_hat = v / (1 - self.beta2 ** t)
        return m_hat / (xp.sqrt(v_hat) + EPS), {"m": m.astype(np.float32), "v": v.astype(np.float32)}
