"""Query schedules: how many perturbation pairs P_t step t evaluates.

`constant` (the default, the paper's) is P every step. A schedule keeps its accounting in one
place: `pairs(t)` is P_t of step t of the run's `steps`, `mean_pairs()` the mean P_t over the
run, by which a forward-FLOP budget becomes a step count (zosoma.experiments.compare_config),
`total_pairs(steps)` the sum of P_t over the first `steps` steps (in closed form), and the trainer
counts each step's tokens as 2 P_t B T.
"""

from __future__ import annotations

from zosoma.errors import ConfigError
from zosoma.strategies.queries.doubling import Doubling


class Constant:
    def __init__(self, cfg):
        self.P = cfg.perturbations

    def pairs(self, step: int) -> int:
        return self.P

    def mean_pairs(self) -> float:
        return float(self.P)

    def total_pairs(self, steps: int) -> int:
        return self.P * steps


# --queries name -> schedule. A new schedule is one file and one line here.
QUERIES = {"constant": Constant, "doubling": Doubling}


def make_queries(cfg):
    if cfg.queries not in QUERIES:
        raise ConfigError(f"queries must be one of {', '.join(QUERIES)}, got {cfg.queries!r}")
    return QUERIES[cfg.queries](cfg)
