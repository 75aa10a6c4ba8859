"""What a model needs to take steps: its strategy, engine, parameter layout, batches and stream.

One step of a model, from its counters (zosoma.strategies.base):

    pop          = stepper.ask(step)                                  which 2P_t members
    plus, minus  = stepper.losses(theta, state, pop, pairs, timings)  batch(seed, stream, step); forward
                                                                      passes only, over `pairs` (all)
    coeffs       = the step's scalars, shaped                         (the trainer's: Strategy.shape)
    theta, state, lr, skipped = stepper.apply(theta, state, coeffs, pop)   Strategy.apply, at the rate
                                                                      after `restarts` restarts

The trainer (zosoma.training.trainer) and a population worker (zosoma.workers.population_workers.Shard,
opened from a checkpoint) each hold one, so both take a step with the same pieces built the same
way. theta and the strategy state stay with their holder: a Stepper holds nothing that changes
from one step to the next, only the restarts, which move the model to a stream of its own.
"""

from __future__ import annotations

import time

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError
from zosoma.formats.checkpoint import Checkpoint
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.strategies import make_strategy

# A restart moves an expert's batches and noise to a stream of their own: counters use
# expert + RESTART_STREAM * restarts where they used the expert (no two experts' streams meet).
RESTART_STREAM = 1 << 16


def stream(expert: int, restarts: int) -> int:
    return expert + RESTART_STREAM * restarts


class Stepper:
    """One model's steps: `model` trained by `cfg` on `sampler`'s batches as expert `expert`, with
    `ops` (the run's engine, handed down: zosoma.runs.run.engine resolves it from the placement and
    from cfg's engine and forward precision) after `restarts` restarts."""

    def __init__(self, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler, ops: Ops, expert: int = 0,
                 restarts: int = 0):
        if sampler.T1 != cfg.seq_len + 1:
            raise ConfigError(f"sampler windows are {sampler.T1} bytes, training needs {cfg.seq_len + 1}")
        self.model, self.cfg, self.sampler, self.expert = model, cfg, sampler, expert
        self.restarts = restarts  # the restarts so far: they pick the stream and scale the rate
        self.strategy = make_strategy(cfg)
        self.ops = ops
        self.layout = Layout(model)
        self.strategy.check(self.layout)

    @classmethod
    def of(cls, ckpt: Checkpoint, corpus: Corpus, expert: int, ops: Ops) -> "Stepper":
        """The steps of the model a checkpoint holds, on `corpus` and the engine `ops`, with its restarts."""
        return cls(ckpt.model, ckpt.train, BatchSampler(corpus, ckpt.train.seq_len + 1), ops, expert,
                   len(ckpt.extra.get("restarts") or ()))

    @property
    def stream(self) -> int:
        """The counters' expert word of this model's batches and noise."""
        return stream(self.expert, self.restarts)

    def batch(self, step: int):
        """(B, T + 1) uint8: the minibatch of `step`, a pure function of the counters."""
        return self.sampler.batch(self.cfg.seed, self.stream, step, self.cfg.batch)

    def ask(self, step: int) -> Population:
        """The members of `step`."""
        return self.strategy.ask(self.stream, step)

    def losses(self, theta, state: dict, pop: Population, pairs: range | None = None, timings: dict | None = None):
        """(plus, minus) losses of the members of `pop` (its `pairs`, default all: (|pairs|,) each)
        on the batch of its step; `timings` gets the seconds of data, noise and forwards."""
        timings = {} if timings is None else timings
        t0 = time.perf_counter()
        batch = self.batch(pop.step)
        timings["data"] = time.perf_counter() - t0
        return self.strategy.losses(self.ops, theta, self.layout, batch, pop, state, pairs=pairs, timings=timings)

    def apply(self, theta, state: dict, coeffs, pop: Population):
        """(theta, state, lr, skipped) after the update of `pop`'s step from its shaped scalars
        (Strategy.apply)."""
        return self.strategy.apply(self.ops, self.layout, theta, state, coeffs, pop, self.restarts)
