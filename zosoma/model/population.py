"""A step's population, named by counters: what an engine evaluates and a strategy updates from.

Kept apart from zosoma.model.noise (which compiles its generators with Numba on import) so that
the strategies and the command line stay light to import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class Population:
    """The 2P members of one step, named by their counters and described by a member table (the
    strategy's, as evosax's ask describes its population; engines evaluate any table): member m
    is theta + sign_m * perturbation_{direction_m}, members 2k and 2k+1 form pair k (the unit
    engines and population workers split the work by), and an update regenerates directions
    0..D-1, one scalar each. A direction's perturbation is

        rank 0 (dense):         scale * delta_j,  delta_j = noise(seed, expert, step, j, kind)
        rank r >= 1 (EGGROLL):  E_j = (scale / sqrt(r)) A_j B_j^T (+ scale * e_j on vectors),
                                factors sliced from pair j's Gaussian stream (zosoma.model.noise)

    The table by default, the paper's antithetic pairs (SPSA, ES; EGGROLL's low-rank path keeps
    it): member 2k = (k, +1), 2k+1 = (k, -1), D = P. A strategy builds another with
    with_members (one-sided SPSA's forward differences: member j = (j, +1), D = 2P).
    Engines evaluate a Population (or a range of its pairs) without storing any perturbation, and
    hand the table to a kernel as the arrays `direction` (int32) and `sign` (float32)."""

    P: int  # pairs of members
    scale: float  # eps (SPSA), sigma (ES, EGGROLL)
    seed: int
    expert: int
    step: int
    kind: str = "rademacher"  # dense noise: "rademacher" or "gaussian" (rank >= 1: always Gaussian)
    rank: int = 0  # 0: dense; r >= 1: EGGROLL's low-rank perturbations
    member_directions: tuple = ()  # (2P,) member m's direction index; () the antithetic table's
    member_signs: tuple = ()  # (2P,) member m's sign, +1 or -1
    directions: int = 0  # D, the directions the update regenerates (0: P)

    def __post_init__(self):
        if not self.member_directions:  # the antithetic table
            object.__setattr__(self, "member_directions", tuple(k for k in range(self.P) for _ in (0, 1)))
            object.__setattr__(self, "member_signs", (1, -1) * self.P)
            object.__setattr__(self, "directions", self.directions or self.P)
        elif self.rank:
            raise ValueError("a low-rank population keeps its antithetic pairs (no member table)")
        dirs, signs = self.member_directions, self.member_signs
        if len(dirs) != 2 * self.P or len(signs) != 2 * self.P:
            raise ValueError(f"a member table of {self.P} pairs lists 2P = {2 * self.P} directions and signs, "
                             f"got {len(dirs)} and {len(signs)}")
        if any(s not in (1, -1) for s in signs):
            raise ValueError("member signs must be +1 or -1")
        if dirs and not (0 <= min(dirs) and max(dirs) < self.directions < 2 ** 31):
            raise ValueError(f"member directions must lie in 0..D-1, D = {self.directions} < 2**31")

    def with_members(self, directions, signs, count: int) -> Population:
        """This population with the member table (direction, sign) per member and `count` directions."""
        return replace(self, member_directions=tuple(int(j) for j in directions),
                       member_signs=tuple(int(s) for s in signs), directions=int(count))

    @cached_property
    def direction(self) -> np.ndarray:
        """(2P,) int32 read-only: member m's direction index (a kernel's member table)."""
        return _frozen(np.array(self.member_directions, np.int32))

    @cached_property
    def sign(self) -> np.ndarray:
        """(2P,) float32 read-only: member m's sign, +1 or -1 (a kernel's member table)."""
        return _frozen(np.array(self.member_signs, np.float32))

    @property
    def complete(self) -> bool:
        """Whether every direction 0..D-1 is some member's (then the members' directions are all
        the update's)."""
        return len(set(self.member_directions)) == self.directions

    def check_scalars(self, coeffs) -> None:
        """ValueError unless coeffs holds the update's one scalar per direction, (D,)."""
        if np.shape(coeffs) != (self.directions,):
            raise ValueError(f"the update takes one scalar per direction, ({self.directions},), got {np.shape(coeffs)}")

    @staticmethod
    def rows(pairs: range) -> slice:
        """The members of `pairs` in the table: 2*pairs.start .. 2*pairs.stop."""
        return slice(2 * pairs.start, 2 * pairs.stop)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def member_chunks(pairs: range, d: int, budget_bytes: int = 64 << 20) -> Iterator[range]:
    """Split `pairs` into chunks whose 2*chunk float32 parameter copies fit the budget: perturbed
    copies exist only for the chunk being evaluated."""
    size = max(1, min(len(pairs), budget_bytes // (2 * 4 * d)))
    for start in range(pairs.start, pairs.stop, size):
        yield range(start, min(pairs.stop, start + size))
