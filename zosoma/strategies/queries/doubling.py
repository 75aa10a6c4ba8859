"""A growing query budget (after AdaZeta, Yang et al. 2024: few queries while the loss falls fast,
more as the estimate's noise starts to dominate): P doubles twice over the run, P/2, P, 2P, each
stage spending one third of the run's forward budget. A stage of twice the pairs takes half the
steps, so the stages are 4/7, 2/7 and 1/7 of the steps, and the mean P_t over the run is 6/7 P:
at a fixed budget the run takes 7/6 the steps of a constant P.
"""

from __future__ import annotations

from zosoma.errors import ConfigError

STAGES = (0.5, 1.0, 2.0)  # P_t / P in each stage, each one third of the forward budget
SHARE = tuple((1 / f) / sum(1 / g for g in STAGES) for f in STAGES)  # the stages' shares of the steps


class Doubling:
    def __init__(self, cfg):
        if cfg.perturbations < 2:
            raise ConfigError("--queries doubling starts at P/2 pairs: it needs --perturbations 2 or more")
        self.P, self.steps = cfg.perturbations, cfg.steps
        ends, total = [], 0.0
        for share in SHARE:
            total += share
            ends.append(round(total * self.steps))  # the first step of the next stage
        self.ends = ends

    def pairs(self, step: int) -> int:
        stage = next((i for i, end in enumerate(self.ends) if step < end), len(STAGES) - 1)
        return max(1, round(self.P * STAGES[stage]))

    def total_pairs(self, steps: int) -> int:
        """sum of pairs(t) for t < steps, stage by stage."""
        total, start = 0, 0
        for i, end in enumerate(self.ends[:-1] + [max(steps, self.ends[-1])]):
            total += max(0, min(end, steps) - start) * max(1, round(self.P * STAGES[i]))
            start = max(start, end)
        return total

    def mean_pairs(self) -> float:
        """The mean P_t of a run (the budget's: 3 / sum(1 / f) = 6/7 P; a run's own steps round
        the stages' ends, which pairs() follows)."""
        return self.P * len(STAGES) / sum(1 / f for f in STAGES)
