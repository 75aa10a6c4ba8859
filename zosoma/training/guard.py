"""The divergence guard: a run whose loss has run away is caught, not trained on to 1e2 nats/byte.

It watches the minibatch loss estimate of every step (the strategies' `loss`, the mean of the 2P
members' losses) and the steps skipped for non-finite losses:

    smoothed = EMA of the finite losses (decay 0.98: about the last 50 steps)
    best     = the lowest smoothed loss so far, from the first step
    window   = WINDOW steps, or an eighth of a shorter run (at least MIN_WINDOW)
    verdict  "non-finite: N steps in a row skipped"    after SKIPS consecutive skipped steps
             "rising: smoothed loss X, RATIO x its best Y for N steps"
                                                     after `window` consecutive steps past the
                                                     first WARMUP with smoothed > RATIO * best

A run whose steps run out inside such a stretch, before the window has judged it, gets the verdict
"rising when its budget ran out" (at_budget): the model it ends with is not a trained one.

A healthy SPSA run's smoothed loss wanders by a few percent and never sits 25% above its best for
200 steps; the diverged runs seen so far (a SOMA expert at lr 0.3, the summed ablation at 0.15)
left their best for good within tens of steps. The window shrinks with the run so a short one
(SPSA P=1024's 165 steps at CPU scale) is judged too, and the best counts from the first step so a
run that blows up within its first WARMUP steps is caught. The guard is a pure function of the
loss sequence, so a resumed run reaches the same verdict at the same step (its checkpoint keeps
the guard's state, which replaying the logged losses gives too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DECAY = 0.98
WARMUP = 50
RATIO = 1.25
WINDOW = 200
MIN_WINDOW = 20
SKIPS = 20


def window_for(steps: int) -> int:
    """How many steps a run's loss must sit above RATIO x its best to be called diverged."""
    return max(MIN_WINDOW, min(WINDOW, steps // 8))


@dataclass
class DivergenceGuard:
    window: int = WINDOW
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
        self.best = min(self.best, self.smoothed)
        if self.steps <= WARMUP:
            return None
        self.above = self.above + 1 if self.smoothed > RATIO * self.best else 0
        if self.above >= self.window:
            return (f"rising: smoothed loss {self.smoothed:.3f}, over {RATIO} x its best {self.best:.3f} "
                    f"for {self.above} steps")
        return None

    def at_budget(self) -> str | None:
        """The verdict on a run whose step budget ran out while its loss was running away: its
        smoothed loss over RATIO x its best at the last step (a stretch shorter than the window,
        which the guard had not judged yet), else None. Such a model is no trained model: the
        trainer treats this as the guard speaking (zosoma.training.trainer, Trainer.ran_out)."""
        if self.healthy:
            return None
        stretch = f" for the last {self.above} steps" if self.above else ""
        return (f"rising when its budget ran out: smoothed loss {self.smoothed:.3f}, over {RATIO} x its best "
                f"{self.best:.3f}{stretch}")

    @property
    def healthy(self) -> bool:
        """The smoothed loss is within RATIO of its best (or nothing has been judged yet)."""
        return self.smoothed is None or self.smoothed <= RATIO * self.best

    @property
    def rollback_point(self) -> bool:
        """A rollback may land here: healthy, and no skipped steps pending."""
        return self.healthy and self.skipped_run == 0

    def window_start(self) -> int:
        """The first step of the bad stretch the latest verdict judged (1-based, as records'
        "step"): a rollback goes to a checkpoint from before it."""
        return self.steps - max(self.above, self.skipped_run) + 1

    def state(self) -> dict:
        """What a checkpoint keeps of the guard: all but its window, which follows the run's length."""
        return {k: v for k, v in asdict(self).items() if k != "window"}

    @classmethod
    def replay(cls, metrics: list[dict], window: int = WINDOW) -> "DivergenceGuard":
        """The guard as it stood after the logged steps (a resumed run)."""
        guard = cls(window)
        for record in metrics:
            guard.observe(record["loss"], record.get("skipped", False))
        return guard


def healthy_steps(metrics: list[dict]) -> set[int]:
    """The steps (0 and the records' "step") after which the smoothed loss was within RATIO of
    its best so far: where a rollback may land."""
    guard, out = DivergenceGuard(), {0}
    for record in metrics:
        guard.observe(record["loss"], record.get("skipped", False))
        if guard.rollback_point:
            out.add(record["step"])
    return out


def rollback_index(course: list[int], before: int, healthy) -> int:
    """Where a restart rolls back to: the index, in `course` (the steps of the current course's
    checkpoints, sorted), of the newest from before step `before` (the first step of the guard's
    window) at which healthy(step), or with none, of the oldest (where the course's last restart
    put it)."""
    earlier = [k for k, step in enumerate(course) if step < before and healthy(step)]
    return earlier[-1] if earlier else 0
