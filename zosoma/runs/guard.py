"""The divergence guard: a run whose loss has run away is caught, not trained on to 1e2 nats/byte.

It watches the minibatch loss estimate of every step (the strategies' `loss`, the mean of the 2P
members' losses) and the steps skipped for non-finite losses:

    smoothed = EMA of the finite losses (decay 0.98: about the last 50 steps)
    best     = the lowest smoothed loss so far, once the first WARMUP steps are past
    verdict  "non-finite: N steps in a row skipped"    after SKIPS consecutive skipped steps
             "rising: smoothed loss X, RATIO x its best Y for N steps"
                                                     after WINDOW consecutive steps with
                                                     smoothed > RATIO * best

A healthy SPSA run's smoothed loss wanders by a few percent and never sits 25% above its best for
200 steps; the diverged runs seen so far (a SOMA expert at lr 0.3, the summed ablation at 0.15)
left their best for good within tens of steps. The guard is a pure function of the loss sequence,
so a resumed run reaches the same verdict at the same step (it replays the logged losses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.98
WARMUP = 50
RATIO = 1.25
WINDOW = 200
SKIPS = 20


@dataclass
class DivergenceGuard:
    smoothed: float | None = None
    best: float = math.inf
    steps: int = 0
    above: int = 0  # consecutive steps with smoothed > RATIO * best
    skipped_run: int = 0  # consecutive skipped steps
    skipped: int = 0  # skipped steps in all

    def observe(self, loss: float, skipped: bool) -> str | None:
        """Take one step's loss; the verdict when this step shows divergence, else None."""
        self.steps += 1
        if skipped or not math.isfinite(loss):
            self.skipped += bool(skipped)
            self.skipped_run += 1
            if self.skipped_run >= SKIPS:
                return f"non-finite: {self.skipped_run} steps in a row skipped"
            return None
        self.skipped_run = 0
        self.smoothed = loss if self.smoothed is None else DECAY * self.smoothed + (1 - DECAY) * loss
        if self.steps <= WARMUP:
            return None
        self.best = min(self.best, self.smoothed)
        self.above = self.above + 1 if self.smoothed > RATIO * self.best else 0
        if self.above >= WINDOW:
            return (f"rising: smoothed loss {self.smoothed:.3f}, over {RATIO} x its best {self.best:.3f} "
                    f"for {self.above} steps")
        return None

    @classmethod
    def replay(cls, metrics: list[dict]) -> "DivergenceGuard":
        """The guard as it stood after the logged steps (a resumed run)."""
        guard = cls()
        for record in metrics:
            guard.observe(record["loss"], record.get("skipped", False))
        return guard
