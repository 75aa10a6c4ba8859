"""The summed-loss ablation of the SOMA paper (arXiv:2609.37899): N experts updated with the
scalars of their summed loss.

The same experts, starting weights, batches, perturbations and compute as independent SOMA, but
every expert's update uses the shared SPSA scalars of L = sum_j L_j,

    g_k = sum_j (L_j(theta_j + eps delta_{j,k}) - L_j(theta_j - eps delta_{j,k})) / (2 eps),

so the other experts' perturbations become noise in each expert's estimate. It wraps the experts'
own strategies, which must be SPSA's central differences (they add up; rank or z-score shaping and
one-sided differences against each expert's own mean do not).
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.strategies.base import Strategy
from zosoma.strategies.spsa import central_differences


class Summed:
    def __init__(self, strategies: list[Strategy]):
        for s in strategies:
            if s.not_summable:
                raise ConfigError(f"the summed-loss ablation shares SPSA central differences; --optimizer "
                                  f"{s.name} {s.not_summable}: use sgd, momentum or adam")
        self.strategies = strategies
        self.eps = strategies[0].cfg.eps

    def coefficients(self, losses: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[float]]:
        """The shared (P,) scalars and each expert's own minibatch loss estimate, from each expert's
        (plus, minus)."""
        shared = sum(plus - minus for plus, minus in losses) / (2 * self.eps)
        return shared, [central_differences(plus, minus, self.eps)[1] for plus, minus in losses]
