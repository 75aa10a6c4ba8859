"""What every strategy is: ask for a population, tell it the population's losses.

A strategy (after evosax's ask/tell, `algorithms/base.py`) estimates one step from forward passes
only. Per step and expert:

    pop            = strategy.ask(expert, step)                 which 2P_t members to evaluate (counters;
                                                                 P_t the query schedule's, zosoma.strategies.queries)
    plus, minus    = strategy.losses(ops, theta, layout, batch, pop, state)   the engine's forwards along
                                                                 the counters' directions, or a probe
                                                                 design's (zosoma.strategies.probes)
    coeffs, loss   = strategy.coefficients(plus, minus)          the step's scalars (NaN: skip it)
    told           = strategy.tell(ops, layout, theta, state, shaping, coeffs, pop, restarts)
        shape:  spread = rms(coeffs), recorded raw; coeffs, shaping = the shaping chain (the
                default run: normalize, zosoma.strategies.shaping)
        apply:  lr = learning_rate(step) * restart_lr_factor ** restarts   (lr_at)
                not all coeffs finite: theta and state unchanged, the step skipped
                else theta, state = strategy.update(ops, layout, theta, state, coeffs, pop, lr):
                  the default run: the engine's fused step; else ghat = estimate(coeffs), then the
                  update transforms (zosoma.strategies.transforms), then descend

The bookkeeping (shaping, the rate, the skip) is this base's, written once (evosax's `tell`
shapes fitness, then calls the strategy's `_tell`); a subclass writes only the maths (ask,
coefficients, update). Every place that steps calls it: the training loop (shape, then apply,
through its zosoma.training.stepper.Stepper), a population worker (apply, through a Stepper of its own,
on scalars the driver shaped) and zosoma.Optimizer (tell), so their bit-exact
agreement holds by construction. The step's scalars (docs/architecture.md: P, or 2P one-sided)
are all that a step needs to agree on an update:
any engine or machine regenerates the directions from the counters. Optimizer state is a dict of
arrays (checkpointed as is, kept on the engine between steps). Each strategy declares the
TrainConfig fields it reads beyond the common ones; `check_options` makes any other field that is
given or not at its default a one-line error instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from zosoma.config import TrainConfig
from zosoma.errors import ConfigError
from zosoma.model.population import Population
from zosoma.model.params import Layout
from zosoma.strategies.probes import make_probes
from zosoma.strategies.probes.design import members
from zosoma.strategies.queries import make_queries
from zosoma.strategies.shaping import Chain, spread
from zosoma.strategies.transforms import Chain as Transforms

# Fields every strategy reads (the schedule, the population size and scale, the run's bookkeeping,
# and where its forwards run).
COMMON = frozenset({"steps", "batch", "seq_len", "perturbations", "eps", "lr", "schedule", "warmup", "seed",
                    "checkpoint_every", "optimizer", "engine", "forward_precision", "on_divergence",
                    "restart_lr_factor", "max_restarts"})


class Strategy:
    """Base class. Subclasses set `name` and `options` and implement ask, coefficients, update;
    tell, shape and apply are the bookkeeping every strategy shares."""

    name = ""
    options: frozenset = frozenset()  # TrainConfig fields read beyond COMMON
    defaults: dict = {}  # TrainConfig values this strategy suggests when the user gives none
    rate_factor: float = 1.0  # its default rate over the preset's (which is tuned for SPSA)
    builtin: tuple = ()  # update transforms (zosoma.strategies.transforms) the strategy always applies
    # why its scalars do not add up across experts (the summed-loss ablation refuses it); None: they do
    not_summable: str | None = "shapes fitness instead"
    # why its population cannot be split over --population-workers (each worker computes only its
    # pairs' losses; the driver updates); None: it can
    unshardable: str | None = None

    @staticmethod
    def extra_flops(model, cfg: TrainConfig) -> float:
        """FLOPs a step spends beyond its 2 P_t B T forward bytes (a comparison's budget counts them)."""
        return 0.0

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # the pieces it reads (zosoma.strategies: shaping, probes, queries, transforms); the
        # paper's where it reads none
        self.shaping = Chain(dataclasses.replace(cfg, shaping=self._read("shaping", ())))
        self.probes = make_probes(dataclasses.replace(cfg, probes=self._read("probes", "iid")))  # None: the counters'
        self.queries = make_queries(dataclasses.replace(cfg, queries=self._read("queries", "constant")))
        self.transforms = Transforms(cfg, self.builtin + tuple(self._read("transforms", ())))
        self.options = self.options | self.transforms.reads  # momentum, beta2: read only by their transforms

    def _read(self, field: str, paper):
        """cfg's `field` if this strategy reads it, else `paper` (the paper's setting)."""
        return getattr(self.cfg, field) if field in self.options else paper

    def check(self, layout: Layout) -> None:
        """A ConfigError when this strategy's settings cannot train the model of `layout`."""
        if self.probes is not None:
            self.probes.check(layout, min(self.pairs(0), self.pairs(self.cfg.steps - 1)))

    def init(self, ops, d: int) -> dict:
        """Optimizer state for d parameters, as engine arrays: the update transforms' and the
        probe design's (none by default)."""
        return {**self.transforms.init(ops, d), **(self.probes.init(ops, d) if self.probes else {})}

    def values_per_member(self) -> int:
        """The losses a member returns and the scalars a direction gets: 1, the batch's mean loss
        (activity perturbation: one per row or per target); what a sharded step exchanges scales with it."""
        return 1

    def pairs(self, step: int) -> int:
        """P_t, the pairs step `step` evaluates (the query schedule's)."""
        return self.queries.pairs(step)

    def total_pairs(self) -> int:
        """The pairs of the whole run, sum_t P_t over cfg.steps steps (2 B T tokens each)."""
        return self.queries.total_pairs(self.cfg.steps)  # in closed form: a run may be 2**32 steps

    def ask(self, expert: int, step: int) -> Population:
        raise NotImplementedError

    def losses(self, ops, theta, layout: Layout, batch, pop: Population, state: dict, pairs: range | None = None,
               timings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(plus, minus) losses of the members of `pop` (its `pairs`, default all) on the step's
        batch: the engine's own from the counters, or members built on the host (builder)."""
        if not self.host_members:
            return ops.perturbed_losses(theta, layout, batch, pop, pairs, timings)
        pairs, timings = range(pop.P) if pairs is None else pairs, {} if timings is None else timings
        build = self.builder(ops.to_numpy(theta), layout, pop, state, timings)
        return ops.materialised_losses(theta, layout, batch, pairs, timings, build)

    def builder(self, theta: np.ndarray, layout: Layout, pop: Population, state: dict, timings: dict | None = None):
        """build(chunk, out): fills out's rows 2j, 2j+1 with the host-built members of pair chunk[j]
        (a probe design's theta +/- eps U_k; `timings` gets the directions' "noise" seconds)."""
        t0 = time.perf_counter()
        U = self.directions(pop, layout, theta.size, state)
        if timings is not None:
            timings["noise"] = timings.get("noise", 0.0) + time.perf_counter() - t0
        return lambda chunk, out: members(theta, U, pop.scale, chunk, out)

    @property
    def host_members(self) -> bool:
        """Whether this strategy's members are built on the host (members()), not regenerated from
        the counters by the engine (a probe design's)."""
        return self.probes is not None

    @property
    def engine_losses(self) -> bool:
        """Whether its losses are the engine's perturbed_losses of its population (all pairs), so an
        engine may evaluate several models' steps together (Ops.experts_perturbed_losses)."""
        return type(self).losses is Strategy.losses and not self.host_members

    @property
    def fused_update(self) -> bool:
        """Whether its update is the engine's fused regenerate-and-apply step (Ops.sgd_update)
        alone, so an engine may apply several models' steps together (Ops.experts_sgd_update)."""
        return type(self).update is Strategy.update and self.probes is None and not self.transforms

    _kept = None  # (pop, state, U): the directions of the step in progress, for its update

    def directions(self, pop: Population, layout: Layout, d: int, state: dict) -> np.ndarray:
        """(P, d) float32: the probe design's directions of `pop` from `state`, built once per step
        (the losses and the update of a step ask with the same population and state objects)."""
        kept = self._kept
        if kept is None or kept[0] != pop or kept[1] is not state:
            kept = self._kept = (pop, state, self.probes.directions(pop, layout, d, state))
        return kept[2]

    def members(self, theta: np.ndarray, layout: Layout, pop: Population, state: dict) -> np.ndarray:
        """(2P, d) float32: the host-built members of `pop`, rows 2k, 2k+1 those of pair k (the
        counters' own antithetic pairs: zosoma.engines.ops.perturbed)."""
        out = np.empty((2 * pop.P, theta.size), np.float32)
        return self.builder(theta, layout, pop, state)(range(pop.P), out)

    def coefficients(self, plus: np.ndarray, minus: np.ndarray) -> tuple[np.ndarray, float]:
        """The P per-pair scalars of the update from the members' losses (each (P,)), and the
        minibatch loss estimate at theta. Non-finite scalars mean: skip the step."""
        raise NotImplementedError

    def update(self, ops, layout: Layout, theta, state: dict, coeffs: np.ndarray, pop: Population, lr: float):
        """(new theta, new state) from the step's scalars; the inputs are left untouched. A dense
        strategy's: the estimate, its update transforms, a step down the result; with neither a
        probe design nor a transform, the engine's fused regenerate-and-apply step (the paper's)."""
        if self.fused_update:
            return ops.sgd_update(theta, coeffs, pop, lr, self.cfg.weight_decay), state
        direction, state = self.transforms(self.estimate(ops, layout, theta, state, coeffs, pop), state, pop.step)
        if self.probes is not None:
            state = self.probes.after(direction, state)
        return self.descend(ops, theta, direction, lr), state

    def estimate(self, ops, layout: Layout, theta, state: dict, coeffs: np.ndarray, pop: Population):
        """(d,) float32 engine array: ghat = sum_k w_k coeffs[k] U_k, the directions regenerated
        (the counters': w_k = 1/P, ops.noise_sum)."""
        if self.probes is None:
            return ops.noise_sum(coeffs, theta.size, pop)
        U = self.directions(pop, layout, theta.size, state)
        w = self.probes.weights(pop.P, layout) * np.asarray(coeffs, np.float64)
        return ops.asarray(w @ U.astype(np.float64))

    def descend(self, ops, theta, direction, lr: float):
        """theta - lr * direction - lr * weight_decay * theta, a new float32 array."""
        new = theta - np.float32(lr) * direction.astype(np.float32)
        if self.cfg.weight_decay:
            new -= np.float32(lr * self.cfg.weight_decay) * theta
        return new.astype(np.float32)

    def tell(self, ops, layout: Layout, theta, state: dict, shaping: dict, coeffs: np.ndarray, pop: Population,
             restarts: int = 0) -> "Told":
        """One step from the P raw scalars of the population `pop`: shape them, then apply them."""
        coeffs, shaping, record = self.shape(coeffs, shaping)
        theta, state, lr, skipped = self.apply(ops, layout, theta, state, coeffs, pop, restarts)
        return Told(theta, state, shaping, lr, skipped, record)

    def shape(self, coeffs: np.ndarray, shaping: dict) -> tuple[np.ndarray, dict, dict]:
        """(shaped scalars, new shaping state, the step's record of them: the raw scalars' spread,
        None when one is not finite, and what each shaping piece did)."""
        raw_spread = spread(coeffs) if finite(coeffs) else None
        coeffs, shaping, info = self.shaping(coeffs, shaping)
        return coeffs, shaping, {"spread": raw_spread, **info}

    def apply(self, ops, layout: Layout, theta, state: dict, coeffs: np.ndarray, pop: Population,
              restarts: int = 0):
        """(theta, state, lr, skipped) after the update from shaped scalars at the rate of step
        pop.step after `restarts` restarts, or, when one scalar is not finite, no update at all (a
        NaN would poison theta and the optimizer state)."""
        lr = lr_at(self.cfg, pop.step, restarts)
        if not finite(coeffs):
            return theta, state, lr, True
        theta, state = self.update(ops, layout, theta, state, coeffs, pop, lr)
        return theta, state, lr, False


@dataclass(frozen=True)
class Told:
    """One step's outcome (Strategy.tell): the new theta and optimizer and shaping states, the
    rate it took, whether it was skipped, and its record (spread, the shaping's fields)."""
    theta: object  # (d,) float32, an engine array
    optimizer: dict
    shaping: dict
    lr: float
    skipped: bool
    record: dict


class Pending(NamedTuple):
    """One model's step whose shaped scalars await Strategy.apply (apply_together)."""
    ops: object  # the model's engine
    strategy: Strategy
    layout: Layout
    theta: object  # (d,) float32 engine array
    state: dict  # the strategy's state
    coeffs: np.ndarray  # the step's shaped scalars
    pop: Population
    restarts: int


def apply_together(steps: list[Pending]) -> list[tuple]:
    """Strategy.apply of several models' steps, its results in order: those whose update is the
    engine's fused step (finite scalars, Strategy.fused_update) in one ops.experts_sgd_update call
    per engine (one launch on a GPU), each at the rate and with the state Strategy.apply gives it;
    the others one by one."""
    out: list = [None] * len(steps)
    fused: dict = {}
    for i, s in enumerate(steps):
        if s.strategy.fused_update and finite(s.coeffs):
            fused.setdefault(id(s.ops), []).append(i)
        else:
            out[i] = s.strategy.apply(s.ops, s.layout, s.theta, s.state, s.coeffs, s.pop, s.restarts)
    for ids in fused.values():
        group = [steps[i] for i in ids]
        lrs = [lr_at(s.strategy.cfg, s.pop.step, s.restarts) for s in group]
        thetas = group[0].ops.experts_sgd_update([s.theta for s in group], [s.coeffs for s in group],
                                                 [s.pop for s in group], lrs,
                                                 [s.strategy.cfg.weight_decay for s in group])
        for i, s, lr, theta in zip(ids, group, lrs, thetas):
            out[i] = (theta, s.state, lr, False)
    return out


def finite(coeffs: np.ndarray) -> bool:
    """Whether a step's scalars can be applied (every one finite)."""
    return bool(np.all(np.isfinite(coeffs)))


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
    plain = TrainConfig(optimizer=cfg.optimizer)
    own = dataclasses.replace(plain, **strategy.defaults)
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


def lr_scale(cfg: TrainConfig, restarts: int) -> float:
    """The rate's factor after `restarts` restarts (zosoma.training.trainer.Trainer.restart)."""
    return cfg.restart_lr_factor ** restarts


def lr_at(cfg: TrainConfig, step: int, restarts: int = 0) -> float:
    """The rate of `step` (0-based) after `restarts` restarts: the schedule times the restart factor."""
    return learning_rate(step, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule) * lr_scale(cfg, restarts)
