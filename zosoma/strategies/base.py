"""What every strategy is: ask for a population, tell it the population's losses.

A strategy (after evosax's ask/tell, `algorithms/base.py`) estimates one step from forward passes
only. Per step and expert:

    pop            = strategy.ask(expert, step)                 which 2P members to evaluate (counters)
    plus, minus    = ops.perturbed_losses(theta, layout, batch, pop)     the engine's forwards
    coeffs, loss   = strategy.coefficients(plus, minus)          P scalars (NaN: skip this step)
    theta, state   = strategy.update(ops, layout, theta, state, coeffs, pop, lr)

The P scalars are all that a step needs to agree on an update: any engine or machine regenerates
the directions from the counters. Optimizer state is a dict of arrays (checkpointed as is, kept on
the engine between steps). Each strategy declares the TrainConfig fields it reads beyond the common
ones; `check_options` makes any other field that is given or not at its default a one-line error
instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from zosoma.config import TrainConfig
from zosoma.errors import ConfigError
from zosoma.model.population import Population
from zosoma.model.params import Layout
from zosoma.strategies.shaping import Chain

# Fields every strategy reads (the schedule, the population size and scale, the run's bookkeeping,
# and where its forwards run).
COMMON = frozenset({"steps", "batch", "seq_len", "perturbations", "eps", "lr", "schedule", "warmup", "seed",
                    "checkpoint_every", "optimizer", "engine", "forward_precision", "on_divergence",
                    "restart_lr_factor", "max_restarts"})


class Strategy:
    """Base class. Subclasses set `name` and `options` and implement ask, coefficients, update."""

    name = ""
    options: frozenset = frozenset()  # TrainConfig fields read beyond COMMON
    defaults: dict = {}  # TrainConfig values this strategy suggests when the user gives none

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # the scalars' shaping pieces: none unless the strategy reads cfg.shaping
        self.shaping = Chain(cfg if "shaping" in self.options else dataclasses.replace(cfg, shaping=()))

    def check(self, layout: Layout) -> None:
        """A ConfigError when this strategy's settings cannot train the model of `layout`."""

    def init(self, ops, d: int) -> dict:
        """Optimizer state for d parameters, as engine arrays (none by default)."""
        return {}

    def ask(self, expert: int, step: int) -> Population:
        raise NotImplementedError

    def coefficients(self, plus: np.ndarray, minus: np.ndarray) -> tuple[np.ndarray, float]:
        """The P per-pair scalars of the update from the members' losses (each (P,)), and the
        minibatch loss estimate at theta. Non-finite scalars mean: skip the step."""
        raise NotImplementedError

    def update(self, ops, layout: Layout, theta, state: dict, coeffs: np.ndarray, pop: Population, lr: float):
        """(new theta, new state) from the P scalars; the inputs are left untouched."""
        raise NotImplementedError


# Fields read only under another setting: field -> (whether cfg reads it, the setting it needs).
READ_ONLY_WITH = {
    "clip_at": (lambda cfg: "clip" in cfg.shaping, "--shaping clip"),
    "normalize_window": (lambda cfg: "normalize" in cfg.shaping, "--shaping normalize"),
    "restart_lr_factor": (lambda cfg: cfg.on_divergence == "restart", "--on-divergence restart"),
    "max_restarts": (lambda cfg: cfg.on_divergence == "restart", "--on-divergence restart"),
}


def check_options(strategy: Strategy, cfg: TrainConfig, given=(), shared=()) -> None:
    """A ConfigError naming the first TrainConfig field that `strategy` does not read although it
    was given (`given`: the names someone set, zosoma.strategies.settings.resolve) or differs from
    its defaults (TrainConfig's, or the strategy's own: an unread field at either changes
    nothing); and the first field given, or set away from its default by `shared` (the names of
    a table several methods share), that only another setting makes read (READ_ONLY_WITH:
    --clip-at without clip shaping). The latter never for a stored configuration (neither given
    nor shared), so that a checkpoint written before that rule still resumes."""
    plain, own = TrainConfig(), dataclasses.replace(TrainConfig(), **strategy.defaults)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name not in COMMON | strategy.options and (
                f.name in given or value not in (getattr(plain, f.name), getattr(own, f.name))):
            raise UnusedOption(unused_option(strategy, f.name))
    for name in [*given, *(n for n in shared if getattr(cfg, n) != getattr(plain, n))]:
        if name in READ_ONLY_WITH and not READ_ONLY_WITH[name][0](cfg):
            raise UnusedOption(f"--{name.replace('_', '-')} is read only with {READ_ONLY_WITH[name][1]}, which "
                               "this run does not use")


class UnusedOption(ConfigError):
    """A setting given that the strategy does not read (the command line: a usage error)."""


def unused_option(strategy: Strategy, field: str) -> str:
    used = ", ".join("--" + o.replace("_", "-") for o in sorted(strategy.options)) or "none"
    return (f"--{field.replace('_', '-')} is not used by --optimizer {strategy.name} "
            f"(its own options: {used})")


def learning_rate(step: int, peak: float, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over `warmup` steps, then constant or cosine decay to zero at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
