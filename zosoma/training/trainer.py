"""The training loop of one model: a strategy, an engine, a run folder.

One step (zosoma.strategies.base), its pieces a Stepper's (zosoma.training.stepper):

    pop          = stepper.ask(step)                                  which 2P_t members
    plus, minus  = stepper.losses(theta, state, pop)                  batch(seed, stream, step), a pure
                                                                      function of the counters; forward
                                                                      passes only
    coeffs, loss = strategy.coefficients(plus, minus)                 the step's scalars (docs/architecture.md)
    coeffs       = strategy.shape(coeffs, shaping)                    raw spread recorded; the default
                                                                      run normalizes them
    theta, state = stepper.apply(theta, state, coeffs, pop)           Strategy.apply:
                   lr = schedule(step) * restart_lr_factor ** restarts; a non-finite scalar skips
    the step's record -> metrics.jsonl; every K steps -> checkpoint.h5 (which counts the records
                                                                   and checksums them)

Shape then apply is Strategy.tell; a sharded model (zosoma.workers.population_workers) shapes here
and applies on its workers, each with a Stepper of its own opened from the checkpoint.

theta and the optimizer state live on the engine (a GPU keeps them there); the host gets them
only for checkpoints. Batches and noise are regenerated from counters, so a run resumed from a
checkpoint takes exactly the steps an uninterrupted run would have taken. Training never reads the
step records back: what it needs of them (the divergence guard's state) is in the checkpoint,
whose size does not grow with the run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.engines.ops import Ops
from zosoma.formats.checkpoint import Checkpoint
from zosoma.model.params import init_params
from zosoma.training.events import EventLog
from zosoma.training.folder import MetricsMark, RunFolder
from zosoma.training.guard import DivergenceGuard, window_for
from zosoma.training.records import Continued, Diverged, Dropped, Finished, Restarted, Step, Stopped
from zosoma.training.stepper import Stepper
from zosoma.strategies import make_strategy
from zosoma.strategies.base import lr_scale
from zosoma.strategies.settings import check_memory


@dataclass
class RunState:
    """Everything that changes during training; saved whole in every checkpoint (the step records
    counted and checksummed: they live in metrics.jsonl)."""
    theta: np.ndarray  # (d,) float32, an engine array while training
    optimizer: dict  # the strategy's state arrays
    step: int = 0
    tokens: int = 0  # bytes pushed through forward passes (2P * B * T per step), restarts' too
    wall_s: float = 0.0  # training wall time summed over all sessions of this run
    divergence: dict | None = None  # the guard's verdict and its step, once it has spoken
    shaping: dict = field(default_factory=dict)  # the coefficient shaping's state (zosoma.strategies.shaping)
    restarts: list = field(default_factory=list)  # one record per restart: step, verdict, rolled back to, lr scale
    dropped: dict | None = None  # the verdict after which training gave up on this model
    guard: DivergenceGuard = field(default_factory=DivergenceGuard)  # after `step` (the Trainer sets its window)
    log: MetricsMark = field(default_factory=MetricsMark)  # how far metrics.jsonl went at `step`


def new_state(model: ModelConfig, cfg: TrainConfig, expert: int = 0) -> RunState:
    theta = init_params(model, cfg.seed, expert)
    strategy = make_strategy(cfg)
    return RunState(theta, strategy.init(Ops(), theta.size), shaping=strategy.shaping.init())


def from_checkpoint(ckpt: Checkpoint) -> RunState:
    e = ckpt.extra
    return RunState(ckpt.theta, ckpt.optimizer, ckpt.step, int(e.get("tokens", 0)), float(e.get("wall_s", 0.0)),
                    e.get("divergence"), e.get("shaping") or make_strategy(ckpt.train).shaping.init(),
                    list(e.get("restarts") or ()), e.get("dropped"), guard_of(ckpt), MetricsMark.of(ckpt))


def guard_of(ckpt: Checkpoint) -> DivergenceGuard:
    """The divergence guard as it stood at the checkpoint (replayed over the step records that a
    checkpoint of format version 1-2 holds)."""
    state = ckpt.extra.get("guard")
    return DivergenceGuard(**state) if state is not None else DivergenceGuard.replay(ckpt.stored_metrics or [])


class Trainer:
    """One model's training: `losses` evaluates the step's population, `update` applies
    coefficients. Independent training feeds each expert its own coefficients; the summed-loss
    ablation feeds every expert the shared ones (zosoma.runs.soma)."""

    def __init__(self, folder, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler, state: RunState,
                 ops: Ops, expert: int = 0, extra: dict | None = None):
        check_memory(model, cfg)  # a run resumed on a smaller machine, or started before this check
        self.stepper = Stepper(model, cfg, sampler, ops, expert, len(state.restarts))
        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        self.model, self.cfg, self.sampler, self.expert = model, cfg, sampler, expert
        self.strategy, self.ops, self.layout = self.stepper.strategy, self.stepper.ops, self.stepper.layout
        self.extra = dict(extra or {}, expert=expert, seed=cfg.seed)
        self.tokens_per_pair = 2 * cfg.batch * cfg.seq_len  # a pair's two members' predicted bytes
        self.total_tokens = self.tokens_per_pair * self.strategy.total_pairs()  # P_t summed (the query schedule)
        self.comm_bytes = 0  # exchanged per step with other processes: none, the model is here
        self.folder.make()
        self._go_on(state)
        self.log.cut()  # drop records past the checkpoint
        self.timings: dict = {}  # seconds of the step in progress: data, noise, forward, update
        self._pop = None  # the population `losses` evaluated, for `update`
        self.events = EventLog(self.folder.path, since=state.step)  # TensorBoard's view of metrics.jsonl
        self.verdict = None  # the guard's verdict on the latest step
        # a run resumed after its guard stopped it goes on: resuming says "continue"
        self.on_divergence = cfg.on_divergence  # "stop" for experts that move in lockstep (couple)
        self.stop_on_divergence = cfg.on_divergence == "stop" and state.divergence is None
        self.keep, self.stride = retention(cfg, self.guard.window)

    @property
    def run_dir(self):
        return self.folder.path

    @property
    def guard(self) -> DivergenceGuard:
        return self.state.guard

    @property
    def done(self) -> bool:
        return self.state.step >= self.cfg.steps or self.spent or self.state.dropped is not None

    @property
    def spent(self) -> bool:
        """The run's compute is spent: cfg.steps steps' forward passes, counting the steps a
        restart re-ran, so a model that restarted ends at a lower step (one that did not, at
        cfg.steps as before)."""
        return self.state.tokens >= self.total_tokens

    def losses(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's members' losses on its minibatch: plus (P,) and minus (P,)."""
        return self.stepper.losses(self.state.theta, self.state.optimizer, self.ask(), timings=self.timings)

    def ask(self):
        """The population of the step now beginning (its timings start afresh)."""
        self.timings, self._pop = {}, self.stepper.ask(self.state.step)
        return self._pop

    @property
    def asked(self):
        """The population of the step in progress (asked, its update not yet taken), else None."""
        return self._pop

    def coefficients(self, plus: np.ndarray, minus: np.ndarray) -> tuple[np.ndarray, float]:
        """The step's scalars and the minibatch loss estimate at theta."""
        return self.strategy.coefficients(plus, minus)

    def update(self, coeffs: np.ndarray, loss: float) -> Step:
        """Shape the step's scalars (zosoma.strategies.shaping) and apply the strategy's update from
        them (Strategy.shape, then self.apply); a non-finite scalar skips the step (a NaN would
        poison theta and the optimizer state). Returns the step's record."""
        t0 = time.perf_counter()
        pop, coeffs, shaping, shaped = self.shaped(coeffs)
        applied = self.apply(coeffs, pop)
        self.timings["update"] = self.timings.get("update", 0.0) + time.perf_counter() - t0
        return self.commit(loss, pop, applied, shaping, shaped)

    def shaped(self, coeffs: np.ndarray) -> tuple:
        """The first half of `update`: (the step's population, its scalars shaped, the new shaping
        state, the shaping's record); commit takes the step once they are applied."""
        pop = self._pop if self._pop is not None else self.stepper.ask(self.state.step)
        return (pop, *self.strategy.shape(coeffs, self.state.shaping))

    def commit(self, loss: float, pop, applied: tuple, shaping: dict, shaped: dict) -> Step:
        """The second half of `update`: take the step whose shaped scalars were applied (`applied`,
        as `apply` returns it: theta, optimizer state, lr, skipped); record, judge, checkpoint."""
        cfg, state, step = self.cfg, self.state, self.state.step
        theta, opt, lr, skipped = applied
        dt = sum(self.timings.values())
        tokens = self.tokens_per_pair * pop.P
        record = {"step": step + 1, "expert": self.expert, "loss": loss, "lr": lr,
                  "tokens": state.tokens + tokens, "wall_s": state.wall_s + dt,
                  "tokens_per_s": tokens / dt, "skipped": bool(skipped),
                  "comm_bytes": self.comm_bytes, **shaped,
                  **{f"{k}_s": v for k, v in self.timings.items()}}
        record["flops"] = record["tokens"] * self.model.flops_per_token()
        # The state changes only here, once the step is complete (stop requests are polled).
        state.theta, state.optimizer, state.step, state.shaping = theta, opt, step + 1, shaping
        state.tokens, state.wall_s = record["tokens"], record["wall_s"]
        self._pop = None
        self.verdict = self.guard.observe(loss, skipped)
        if self.verdict and state.divergence is None and self.on_divergence != "restart":
            state.divergence = {"step": state.step, "verdict": self.verdict}
        self.log.append(record)
        state.log = self.log.mark
        self.events.step(record, self.guard)
        if state.step % cfg.checkpoint_every == 0 or self.done:
            self.checkpoint()
        return Step(self.expert, record)

    def apply(self, coeffs: np.ndarray, pop):
        """(theta, optimizer state, lr, skipped) after the step's update from the shaped scalars
        (zosoma.workers.population_workers applies it on the workers instead)."""
        return self.stepper.apply(self.state.theta, self.state.optimizer, coeffs, pop)

    def to_checkpoint(self) -> Checkpoint:
        state, to_numpy = self.state, self.ops.to_numpy
        extra = dict(self.extra, tokens=state.tokens, flops=state.tokens * self.model.flops_per_token(),
                     divergence=state.divergence, wall_s=state.wall_s, data_cursor=state.step,
                     guard=state.guard.state())
        extra.update({k: v for k, v in (("shaping", state.shaping), ("restarts", state.restarts),
                                        ("dropped", state.dropped)) if v})  # absent when unused
        return Checkpoint(model=self.model, train=self.cfg, theta=to_numpy(state.theta), step=state.step,
                          optimizer={k: to_numpy(v) for k, v in state.optimizer.items()}, extra=extra,
                          metrics_records=state.log.records, metrics_sha256=state.log.sha256)

    def checkpoint(self) -> None:
        self.folder.write_checkpoint(self.to_checkpoint(), self.keep, self.stride)
        self.events.flush()  # what the checkpoint covers is on disk

    @property
    def halted(self) -> bool:
        """The guard found divergence and the run's action is to stop."""
        return self.stop_on_divergence and self.state.divergence is not None

    def halt(self) -> Diverged:
        """Checkpoint a diverged run where it is and say so (a resume goes on from here)."""
        self.checkpoint()
        self.stop_on_divergence = False
        return Diverged(self.expert, self.state.step, self.state.divergence["verdict"])

    def went_on(self) -> Continued | None:
        """The guard found divergence at this step and the run's action is to go on: the record
        that says so (once, at the step of the verdict), else None."""
        d = self.state.divergence
        if self.on_divergence == "continue" and d is not None and d["step"] == self.state.step:
            return Continued(self.expert, d["step"], d["verdict"])
        return None

    @property
    def restarting(self) -> bool:
        """The guard found divergence and the run's action is to restart (or drop) the model."""
        return self.on_divergence == "restart" and self.verdict is not None and self.state.dropped is None

    def couple(self) -> None:
        """This model moves in lockstep with others (the summed ablation): one of them cannot
        be rolled back alone, so a restart on divergence is a stop, for all of them."""
        if self.on_divergence == "restart":
            self.on_divergence = "stop"
            self.stop_on_divergence = self.state.divergence is None

    def restart(self) -> Restarted | Dropped:
        """Roll back to the newest checkpoint from before the guard's window began, with the rate
        times restart_lr_factor and batches and noise from a stream of its own (the seed still
        fixes them), and go on; after max_restarts restarts, drop the model instead: it trains no
        further, and a SOMA run's router leaves it out. The decision is checkpointed before this
        returns, so a run killed at any point resumes into the same decisions."""
        state, cfg, step, verdict = self.state, self.cfg, self.state.step, self.verdict
        self.verdict = None
        if len(state.restarts) >= cfg.max_restarts:
            state.dropped = {"step": step, "verdict": verdict}
            self.checkpoint()
            return Dropped(self.expert, step, verdict, len(state.restarts))
        # to where the smoothed loss was within the guard's ratio of its best
        back = from_checkpoint(self.folder.rollback_checkpoint(self.guard.window_start(),
                                                               lambda c: guard_of(c).rollback_point))
        restarts = state.restarts + [{"step": step, "verdict": verdict, "to": back.step,
                                      "lr_scale": lr_scale(cfg, len(state.restarts) + 1)}]
        # compute already spent stays counted: tokens and wall time go on from here
        self.adopt(dataclasses.replace(back, tokens=state.tokens, wall_s=state.wall_s, divergence=None,
                                       restarts=restarts, dropped=None))
        self.checkpoint()
        self.log.cut()  # after the checkpoint: a run killed in between resumes from the rollback
        self.events.rolled_back(back.step)
        return Restarted(self.expert, step, verdict, back.step, restarts[-1]["lr_scale"])

    def ran_out(self) -> Dropped | Diverged | Continued | None:
        """The run is done and its guard finds the loss still rising (DivergenceGuard.at_budget):
        judged as a verdict is, by the run's action, except that a restart has no compute left, so
        the model is dropped; the record that says so (checkpointed first), else None (a healthy
        end, or a model already dropped or judged)."""
        state = self.state
        verdict = self.guard.at_budget() if state.dropped is None and state.divergence is None else None
        if verdict is None:
            return None
        if self.on_divergence == "restart":
            state.dropped = {"step": state.step, "verdict": verdict}
            self.checkpoint()
            return Dropped(self.expert, state.step, verdict, len(state.restarts))
        state.divergence = {"step": state.step, "verdict": verdict}
        if self.halted:
            return self.halt()
        self.checkpoint()
        return Continued(self.expert, state.step, verdict)

    def adopt(self, state: RunState) -> None:
        """Go on from `state` (a restart's rollback)."""
        self._go_on(state)

    def _go_on(self, state: RunState) -> None:
        """Take `state` on: on the engine, with its restarts' stream (the counters of its batches and noise),
        its guard judging over this run's window, and its metrics log opened at its mark (checked;
        the file is cut back by self.log.cut())."""
        state.theta = self.ops.asarray(state.theta)
        state.optimizer = {k: self.ops.asarray(v) for k, v in state.optimizer.items()}
        state.guard = dataclasses.replace(state.guard, window=window_for(self.cfg.steps))
        self.log = self.folder.metrics_log(state.log)
        state.log = self.log.mark  # a version 1-2 checkpoint's records or a damaged file: the log's own
        self.state, self.stepper.restarts = state, len(state.restarts)

    def summary(self) -> dict:
        """What results record of the training itself (training_summary)."""
        return training_summary(self.guard, self.state.divergence, self.state.restarts, self.state.dropped)

    @property
    def theta(self) -> np.ndarray:
        """theta on the host (for evaluation and export)."""
        return self.ops.to_numpy(self.state.theta)


MAX_KEPT = 10  # checkpoint files a run keeps for rollbacks, about: the newest two and those spread over the window


def retention(cfg: TrainConfig, window: int) -> tuple[int, int | None]:
    """(the checkpoints a run's rotation spans, the stride of steps at which it keeps those past the
    newest two, None: all). A rollback needs a checkpoint from before the guard's window, so a run that
    restarts spans the window; when that takes more than MAX_KEPT files (--checkpoint-every 1 kept
    202), it keeps one every stride steps instead (zosoma.training.folder.write_checkpoint)."""
    if cfg.on_divergence != "restart":
        return 2, None
    spanned = math.ceil(window / cfg.checkpoint_every)
    if 2 + spanned <= MAX_KEPT:
        return 2 + spanned, None
    return 2 + spanned, cfg.checkpoint_every * math.ceil(spanned / (MAX_KEPT - 2))


def training_summary(guard: DivergenceGuard, divergence: dict | None, restarts=(), dropped: dict | None = None) -> dict:
    """Of a run's divergence guard after its last step: skipped (non-finite) steps, the guard's
    verdict (None when it never spoke), the restarts and whether training gave up (dropped), and
    the final training loss (the guard's smoothed minibatch loss)."""
    return {"skipped_steps": guard.skipped, "divergence": divergence, "restarts": list(restarts),
            "dropped": dropped, "final_train_loss": guard.smoothed}


def summary_of(ckpt: Checkpoint) -> dict:
    """training_summary of a checkpoint's run."""
    e = ckpt.extra
    return training_summary(guard_of(ckpt), e.get("divergence"), e.get("restarts") or (), e.get("dropped"))


def after_step(t: Trainer, going: list) -> Iterator:
    """What `train` does after a model's step: goes on past a verdict, halts, restarts or drops it;
    `going` gets True when it trains on (zosoma.training.together steps many models so)."""
    if said := t.went_on():
        yield said
    if t.halted:
        yield t.halt()
        return
    if t.restarting:
        record = t.restart()
        yield record
        if isinstance(record, Dropped):
            return
    going.append(True)


def train(trainer: Trainer, should_stop: Callable[[], bool] = lambda: False,
          widen: Callable[[Trainer], Trainer] | None = None) -> Iterator:
    """Train one model with its own losses (SOMA's independent experts; a single model) to
    cfg.steps, or fewer when restarts re-ran steps (Trainer.spent), yielding a Step record per
    step and a final Finished (or, when the loss is still rising at the end, what the guard's
    verdict would have made of it: Trainer.ran_out), or Stopped when should_stop() turned true
    (the state is checkpointed first). `widen`, given, may hand the model to a trainer over more workers
    before a step (zosoma.workers.population_workers.Borrower)."""
    try:
        while not trainer.done:
            if should_stop():
                trainer.checkpoint()
                yield Stopped(trainer.expert, trainer.state.step)
                return
            if widen is not None:
                trainer = widen(trainer)
            yield trainer.update(*trainer.coefficients(*trainer.losses()))
            going = []
            yield from after_step(trainer, going)
            if not going:
                return
        if said := trainer.ran_out():  # the budget ran out mid-divergence: not a trained model
            yield said
            if not isinstance(said, Continued):
                return
        yield Finished(trainer.expert, trainer.state.step)
    finally:
        trainer.events.close()
