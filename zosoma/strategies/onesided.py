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

All of it is this file's: the population's member table (`one_sided`: member j along direction
j with sign +1, 2P directions) is what the engines evaluate, as they evaluate any table (the CPU
forward inside its fused pair loop, the CUDA perturb kernel), so pair-wise forwards, workers' pair
ranges and zosoma.Optimizer carry it unchanged. The update is SPSA's with 2P scalars: the
engine's fused regenerate-and-apply step over the table's directions 0..2P-1.
"""

from __future__ import annotations

import numpy as np

from zosoma.model.population import Population
from zosoma.strategies.spsa import SPSA


class OneSided(SPSA):
    name = "onesided"
    options = SPSA.options - {"probes"}  # its directions are its own
    not_summable = "measures one-sided differences"  # against each expert's own mean
    # sqrt(2) times SPSA's rate (four places, the grid it was tuned on): under normalize shaping
    # the same step length as SPSA's at its rate, and the validation optimum of the default run
    # and of `--experts 4` (results/default-run, results/default-run-soma4; twice was best on one
    # smaller expert trained 4x longer, results/cut-price-step). 3,540 steps: 4,000 at equal
    # wall, a step costing up to 1.13x SPSA's (results/piece-cost.txt, the tiny preset's shape).
    rate_factor = 1.4142
    defaults = {"steps": 3540}

    def ask(self, expert: int, step: int) -> Population:
        return one_sided(super().ask(expert, step))

    def coefficients(self, plus, minus):
        L = np.stack([plus, minus], axis=1).ravel()  # direction j's loss at index j
        loss = float(np.mean(L))
        return (L - loss) / self.cfg.eps, loss


def one_sided(pop: Population) -> Population:
    """pop with one-sided members: member j is theta + scale * delta_j, j = 0..2P-1, each along a
    direction of its own (pair k: directions 2k and 2k+1)."""
    n = 2 * pop.P
    return pop.with_members(range(n), (1,) * n, n)
