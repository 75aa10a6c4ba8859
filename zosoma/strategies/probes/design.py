"""What every probe design is (zosoma.strategies.probes): the step's P directions on the host,
their weights in the estimate, and state it keeps across steps. The defaults are those of a
stateless design that weighs every pair 1/P."""

from __future__ import annotations

import numpy as np


class Design:
    keys: tuple = ()  # its state arrays in the optimizer's dict

    def __init__(self, cfg):
        self.cfg = cfg

    def init(self, ops, d: int) -> dict:
        return {}

    def check(self, layout, P: int) -> None:
        """A ConfigError when this design cannot probe a model of `layout` with P pairs."""

    def directions(self, pop, layout, d: int, state: dict) -> np.ndarray:
        """(P, d) float32: the step's directions U_k (members theta +/- eps U_k)."""
        raise NotImplementedError

    def weights(self, P: int, layout) -> np.ndarray:
        """(P,) the weights w_k of the estimate sum_k w_k g_k U_k."""
        return np.full(P, 1.0 / P)

    def after(self, direction, state: dict) -> dict:
        """The state after a step along `direction` (d,)."""
        return state


def counter_directions(pop, d: int) -> np.ndarray:
    """(P, d) float32: the population's i.i.d. directions delta_k, as the engines regenerate them."""
    from zosoma.model.noise import noise  # compiles the generators: imported only where used
    return np.stack([noise(d, pop.seed, pop.expert, pop.step, k, pop.kind) for k in range(pop.P)])


def members(theta: np.ndarray, U: np.ndarray, scale: float, pairs: range, out: np.ndarray) -> np.ndarray:
    """Rows 2j, 2j+1 of out: theta + scale U_k and theta - scale U_k for k = pairs[j] (float32)."""
    for j, k in enumerate(pairs):
        step = np.float32(scale) * U[k]
        np.add(theta, step, out=out[2 * j])
        np.subtract(theta, step, out=out[2 * j + 1])
    return out
