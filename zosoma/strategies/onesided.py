"""One-sided SPSA: forward differences against the population's mean, 2P directions per 2P forwards.

The paper's SPSA spends its 2P forwards on P antithetic pairs, so a step measures P directions.
Here every member has a direction of its own (Nesterov and Spokoiny 2017's forward differences;
the multi-point estimate of Liu et al., "A Primer on Zeroth-Order Optimization", 2020, with the
members' mean as the baseline instead of one more forward at theta):

    L_j  = L(theta + eps*delta_j)                    j = 0..2P-1,  delta_j = noise(seed, expert, step, j)
    g_j  = (L_j - mean_i L_i) / eps
    ghat = (1/(2P)) * sum_j g_j * delta_j

In the regime zosoma's runs are in (the estimate's error set by the random directions, not by the
minibatch: docs/cut-price.md's constant-P sweep) the error of ghat is about d/(2P) times |g|^2
against d/P for the antithetic pairs at the same forwards. The price: each g_j carries eps/2 times
the curvature along delta_j, which a pair cancels; with eps = 1e-3 it is far below the signal.

Pair k of the population is the members of directions 2k and 2k+1, built on the host from the
counters, so the engines' pair-wise population forwards, workers' pair ranges and zosoma.Optimizer
carry it unchanged. The update is SPSA's with 2P scalars: the engine's fused
regenerate-and-apply step over directions 0..2P-1 (Ops.noise_sum takes P = len(coeffs)).
"""

from __future__ import annotations

import numpy as np

from zosoma.model.population import Population
from zosoma.strategies.spsa import SPSA


class OneSided(SPSA):
    name = "onesided"
    options = SPSA.options - {"probes"}  # its directions are its own
    host_members = True
    not_summable = "measures one-sided differences"  # against each expert's own mean

    def builder(self, theta, layout, pop, state, timings=None):
        """Pair k's rows: the members of directions 2k and 2k+1 (no stored directions to time)."""
        return lambda chunk, out: one_sided_members(theta, pop, chunk, out)

    def coefficients(self, plus, minus):
        L = np.stack([plus, minus], axis=1).ravel()  # direction j's loss at index j
        loss = float(np.mean(L))
        return (L - loss) / self.cfg.eps, loss


def one_sided_members(theta: np.ndarray, pop: Population, pairs: range, out: np.ndarray) -> np.ndarray:
    """Rows 2j, 2j+1 of out: theta + scale delta_{2k} and theta + scale delta_{2k+1} for k = pairs[j],
    the directions regenerated from the counters (float32, as the engines' members)."""
    from zosoma.model.noise import add_noise  # compiles the generators: imported only where used
    theta = np.ascontiguousarray(theta, np.float32)
    for j, k in enumerate(pairs):
        for i in (0, 1):
            add_noise(out[2 * j + i], theta, pop.scale, pop.seed, pop.expert, pop.step, 2 * k + i, pop.kind)
    return out
