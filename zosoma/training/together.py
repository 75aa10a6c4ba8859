"""Several models trained together in one process: each step of all of them in one population.

SOMA's experts share nothing, yet a GPU is launch-bound at their sizes (docs/gpu.md): stepped one
expert at a time, N experts cost N times the launches. Here a step takes every live model's
population to the engine at once:

    pops, batches   = each trainer's own step: its counters (expert, restarts' stream, step), its
                      cluster's batch
    losses          = ops.experts_perturbed_losses(thetas, layout, batches, pops)   one call per
                      engine and model shape (a GPU: one fused launch of N x 2P members)
    each trainer    its coefficients and shaping (Trainer.shaped), as alone
    applied         = Strategy.apply of them all (apply_together: the fused ZO-SGD updates in one
                      ops.experts_sgd_update call, one launch on a GPU)
    each trainer    commits its step (Trainer.commit): record, guard, checkpoint; then goes on,
                      halts, restarts or is dropped exactly as `train` would have it

The engines' batched calls give the bits of their one-model calls, so every model ends with the
numbers of training it alone (`zosoma.training.trainer.train`); a model whose strategy evaluates or
updates its own way (Strategy.engine_losses, fused_update) takes its own calls within the step.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import numpy as np

from zosoma.training.records import Continued, Failed, Finished, Stopped
from zosoma.training.trainer import Trainer, after_step
from zosoma.strategies.base import Pending, apply_together
from zosoma.errors import one_line


def train_together(trainers: Sequence[Trainer], should_stop: Callable[[], bool] = lambda: False,
                   units: Sequence | None = None) -> Iterator:
    """Train every trainer to its end as `train` trains one, all stepping together; yields their
    records (a step's records model by model). `units[k]` names trainers[k] in a Failed record
    (default k): a step that raises fails every model still training (they share it)."""
    units = list(range(len(trainers))) if units is None else list(units)
    live = list(zip(units, trainers))
    try:
        while live:
            for unit, t in [(u, t) for u, t in live if t.done]:
                live.remove((unit, t))
                yield from _alone(unit, _finished(t))
            if not live:
                return
            if should_stop():
                for _, t in live:
                    t.checkpoint()
                    yield Stopped(t.expert, t.state.step)
                return
            try:
                steps = step_together([t for _, t in live])
            except Exception as e:  # one step for all of them: all of them failed
                for unit, _ in live:
                    yield Failed(unit, one_line(e))
                return
            for (unit, t), record in zip(list(live), steps):
                yield record
                going = []
                yield from _alone(unit, after_step(t, going))
                if not going:
                    live.remove((unit, t))
    finally:
        for t in trainers:
            t.events.close()


def _alone(unit, records: Iterator) -> Iterator:
    """One model's records; what it raises fails that model alone (Failed, as Inline says it)."""
    try:
        yield from records
    except Exception as e:
        yield Failed(unit, one_line(e))



def _finished(t: Trainer) -> Iterator:
    """The end of `train` for a model that is done."""
    if said := t.ran_out():  # the budget ran out mid-divergence: not a trained model
        yield said
        if not isinstance(said, Continued):
            return
    yield Finished(t.expert, t.state.step)


def step_together(trainers: Sequence[Trainer]) -> list:
    """One step of every trainer (none done), their populations evaluated together and their
    updates applied together; returns each one's Step record (Trainer.update's)."""
    losses = losses_together(trainers)
    pops = [t.asked for t in trainers]
    coefficients = [t.coefficients(*pair) for t, pair in zip(trainers, losses)]
    t0 = time.perf_counter()
    shaped = [t.shaped(c) for t, (c, _) in zip(trainers, coefficients)]
    applied = apply_together([Pending(t.ops, t.strategy, t.layout, t.state.theta, t.state.optimizer, coeffs, pop,
                                      t.stepper.restarts) for t, (pop, coeffs, _, _) in zip(trainers, shaped)])
    _share(trainers, pops, "update", time.perf_counter() - t0)
    return [t.commit(loss, pop, a, shaping, record)
            for t, (_, loss), (pop, _, shaping, record), a in zip(trainers, coefficients, shaped, applied)]


def losses_together(trainers: Sequence[Trainer]) -> list:
    """Trainer.losses of every trainer, for the step each now begins: (plus, minus) each. Those
    whose strategy takes the engine's losses (Strategy.engine_losses) go to their engine in one
    Ops.experts_perturbed_losses call per engine and model shape; the others (a strategy's own
    losses, a trainer whose model lives on workers) take their own."""
    losses, groups = [None] * len(trainers), {}
    for i, t in enumerate(trainers):
        if type(t).losses is not Trainer.losses or not t.strategy.engine_losses:
            losses[i] = t.losses()
            continue
        pop = t.ask()
        t0 = time.perf_counter()
        batch = t.stepper.batch(pop.step)
        t.timings["data"] = time.perf_counter() - t0
        groups.setdefault((id(t.ops), t.layout.config, batch.shape), []).append((i, batch))
    for members in groups.values():
        ts = [trainers[i] for i, _ in members]
        ps = [t.asked for t in ts]
        t0 = time.perf_counter()
        out = ts[0].ops.experts_perturbed_losses([t.state.theta for t in ts], ts[0].layout,
                                                 np.stack([b for _, b in members]), ps)
        _share(ts, ps, "forward", time.perf_counter() - t0)
        for (i, _), pair in zip(members, out):
            losses[i] = pair
    return losses


def _share(trainers: Sequence[Trainer], pops, key: str, seconds: float) -> None:
    """Split a together call's seconds over its trainers by their populations' pairs (into their
    steps' timings)."""
    members = [p.P for p in pops]
    for t, m in zip(trainers, members):
        t.timings[key] = t.timings.get(key, 0.0) + seconds * m / sum(members)
