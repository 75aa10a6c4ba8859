"""A step's population, named by counters: what an engine evaluates and a strategy updates from.

Kept apart from zosoma.model.noise (which compiles its generators with Numba on import) so that
the strategies and the command line stay light to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Population:
    """The 2P antithetic members of one step, named by their counters: member pair k (k < P) is
    theta + perturbation_k and theta - perturbation_k, where perturbation_k is

        rank 0 (dense, SPSA and ES):   scale * delta_k,  delta_k = noise(seed, expert, step, k, kind)
        rank r >= 1 (EGGROLL):         E_k = (scale / sqrt(r)) A_k B_k^T (+ scale * e_k on vectors),
                                       factors sliced from pair k's Gaussian stream (zosoma.model.noise)

    One-sided (dense only: zosoma.strategies.onesided) pair k is instead theta + scale * delta_2k
    and theta + scale * delta_2k+1: 2P directions of their own, no antithetic twin.

    Engines evaluate a Population (or a range of its pairs) without storing any perturbation."""

    P: int  # pairs of members
    scale: float  # eps (SPSA), sigma (ES, EGGROLL)
    seed: int
    expert: int
    step: int
    kind: str = "rademacher"  # dense noise: "rademacher" or "gaussian" (rank >= 1: always Gaussian)
    rank: int = 0  # 0: dense; r >= 1: EGGROLL's low-rank perturbations
    onesided: bool = False  # pair k's members along directions 2k and 2k+1

    @property
    def directions(self) -> int:
        """The directions the population measures, as many as the update's scalars."""
        return 2 * self.P if self.onesided else self.P


def member_chunks(pairs: range, d: int, budget_bytes: int = 64 << 20) -> Iterator[range]:
    """Split `pairs` into chunks whose 2*chunk float32 parameter copies fit the budget: perturbed
    copies exist only for the chunk being evaluated."""
    size = max(1, min(len(pairs), budget_bytes // (2 * 4 * d)))
    for start in range(pairs.start, pairs.stop, size):
        yield range(start, min(pairs.stop, start + size))
