"""Guided probes (Maheswaranathan et al., "Guided evolutionary strategies", ICML 2019), with the
last update as the guiding subspace (k = 1, as Meier et al. 2019's "past descent directions"):
the directions are drawn from the covariance alpha I + (1 - alpha) d u u^T instead of I,

    delta_k = sqrt(alpha) z_k + sqrt((1 - alpha) d) c_k u       z_k the counters' direction,
                                                                c_k ~ N(0, 1), u = last / |last|

so a share 1 - alpha of each probe's energy lies along the previous step (E|delta_k|^2 = d, as
for an i.i.d. probe), and the estimate sum_k g_k delta_k / P follows that covariance times the
gradient. Before the first update (and whenever it was zero) the probes are the i.i.d. ones. The
last update direction is optimizer state ("guide"), checkpointed, so a resume is bit-exact. c_k
comes from NumPy's generator seeded with (seed, expert, step): a pure function of the counters.
"""

from __future__ import annotations

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.strategies.probes.design import Design, counter_directions

ALPHA = 0.5  # Maheswaranathan et al.'s default: half the probe's energy along the guide
TAG = 0x67756964  # "guid": c_k's own stream, apart from the directions'


class Guided(Design):
    keys = ("guide",)

    def init(self, ops, d: int) -> dict:
        return {"guide": ops.xp.zeros(d, np.float32)}

    def directions(self, pop, layout, d: int, state: dict) -> np.ndarray:
        Z = counter_directions(pop, d)  # (P, d)
        guide = to_numpy(state["guide"]).astype(np.float64)
        norm = np.linalg.norm(guide)
        if not norm > 0:
            return Z
        u = guide / norm
        c = np.random.default_rng([pop.seed, TAG, pop.expert, pop.step]).standard_normal(pop.P)  # (P,)
        U = np.sqrt(ALPHA) * Z + np.sqrt((1 - ALPHA) * d) * c[:, None] * u[None, :]
        return U.astype(np.float32)

    def after(self, direction, state: dict) -> dict:
        return {**state, "guide": direction.astype(np.float32)}
