"""Heavy-ball momentum (as torch.optim.SGD): m <- beta1 m + g; the step is along m."""

from __future__ import annotations

import numpy as np


class Momentum:
    keys = ("m",)  # its state arrays
    reads = ("momentum",)  # the TrainConfig fields it reads

    def __init__(self, cfg):
        self.beta1 = cfg.momentum

    def init(self, ops, d: int) -> dict:
        return {"m": ops.xp.zeros(d, np.float32)}

    def __call__(self, g, state: dict, step: int):
        m = self.beta1 * state["m"] + g
        return m, {"m": m.astype(np.float32)}
