"""Block-coordinate probes: independent loss signals for the blocks of one model, from forward
passes only (block-coordinate SPSA; the within-model analogue of SOMA's independent experts).

The model's tensors are grouped into blocks (the embedding; each LSTM layer's w_ih, w_hh and
bias; the output layer), n_b blocks in all. Pair k perturbs only block b(k) = k mod n_b, along the
counters' direction delta_k restricted to that block, so its loss difference

    g_k = (L(theta + eps delta_k^(b)) - L(theta - eps delta_k^(b))) / (2 eps)

measures that block alone: the other blocks' perturbations add no noise to it (the variance of
an SPSA estimate grows with the perturbed dimension, here d_b instead of d). Each block's
estimate is the mean over its own n_b(k) pairs,

    ghat^(b) = (1 / n_b) sum_{k: b(k) = b} g_k delta_k^(b),        so w_k = 1 / n_{b(k)}

and the P pairs (P >= n_b) are split across the blocks round robin. A forward-only device runs
this with what it has for SPSA, plus a parameter range per member: its noise generator adds
eps delta_k only on [start, stop) of the block (or a mask), the forwards are unchanged, and the
update needs the same P scalars and counters (plus the block of each pair, a function of k).
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.strategies.probes.design import Design, counter_directions


def blocks(layout) -> list[tuple[str, int, int]]:
    """(name, start, stop) of each block of theta: its entries grouped by the name's first part
    (embed, lstm0, lstm1, ..., out), in layout order."""
    found: dict[str, list[int]] = {}
    for e in layout.entries:
        span = found.setdefault(e.name.split(".")[0], [e.offset, e.offset])
        span[1] = e.offset + e.size
    return [(name, start, stop) for name, (start, stop) in found.items()]


class Blocks(Design):
    def check(self, layout, P: int) -> None:
        if layout is None:
            raise ConfigError("--probes blocks splits a model into its layers: it needs an LSTM's layout")
        if P < len(blocks(layout)):
            raise ConfigError(f"--probes blocks needs at least one pair per block: P = {P} < "
                              f"{len(blocks(layout))} blocks")

    def directions(self, pop, layout, d: int, state: dict) -> np.ndarray:
        self.check(layout, pop.P)
        U = counter_directions(pop, d)  # (P, d)
        spans = blocks(layout)
        for k in range(pop.P):
            _, start, stop = spans[k % len(spans)]
            U[k, :start] = 0
            U[k, stop:] = 0
        return U

    def weights(self, P: int, layout) -> np.ndarray:
        block = np.arange(P) % len(blocks(layout))  # b(k)
        return 1.0 / np.bincount(block)[block]
