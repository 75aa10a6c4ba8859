"""One model's population over W workers: only scalars travel, every worker applies the same update.

The step's P pairs are split into W contiguous shares. Each worker holds theta and the strategy
state (read from the run's checkpoint) and a Stepper opened from it (zosoma.training.stepper), draws
the step's batch itself (a pure function of the counters), evaluates its share and returns only its
members' losses. The driver gathers them in
pair order, turns them into the step's scalars (the strategy's coefficients), logs them in the
run folder (scalars.jsonl) and sends them to every worker; every worker applies the identical
update. No parameters travel while training: theta comes to the driver for checkpoints only.

    driver                                       worker w (pairs P_w)
    -- apply(scalars of step t-1) ------------>  theta, state <- the strategy's update
    -- losses(t) ----------------------------->  batch(seed, expert, t); plus, minus over P_w
    <- plus, minus: 2 |P_w| float64 ----------

A lost worker (a killed process, a dead node) is rebuilt from the run's last checkpoint plus a
replay of the scalars logged since: updates only, no forward passes, the same numbers. The run
ends bit for bit where the single-process run ends: a member's losses do not depend on which
worker, or how many threads, computed them (zosoma.engines.cpu.threads). EGGROLL is not sharded: its
population shares one GEMM over all members, so splitting them changes the rounding.

A SOMA expert spreads this way at the end of a run (Borrower): once no other expert waits for a
worker, its executor lends it the cores other experts left free, and at its next checkpoint it
becomes a ShardedTrainer over its own core plus those, its own process only gathering and sending
scalars; the same numbers again.

The summed-loss ablation runs through the same exchange: one worker per expert, each evaluating
all P pairs of its own expert; the driver sums the experts' differences (zosoma.strategies.summed)
and every expert applies the shared scalars.

Workers come from a transport: InProcess (one after another in this process: the exchange
without processes), Processes (spawned local processes) or zosoma.workers.ray_executor.RayWorkers
(Ray actors on any node). A transport's spawn(spec, step, replay) returns a handle with
call(method, *args) -> ticket (never blocks), result(ticket) (blocks; tickets are awaited in
order; WorkerLost when the worker died) and close().

Bytes exchanged per step, recorded as each step's comm_bytes: the 2P float64 losses gathered and
the step's D float64 scalars (docs/architecture.md#the-steps-scalars) sent to each of the model's
W workers, 8 (2P + W D), each times the strategy's values per member V (activity perturbation's
B or B T: a loss and a scalar per row or target) (exchange_bytes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines import SendsEngine
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError, ZosomaError, one_line
from zosoma.workers.executor import child_threads, exit_with_parent, spare_cores
from zosoma.training.folder import RunFolder
from zosoma.training.stepper import Stepper
from zosoma.training.trainer import RunState, Trainer
from zosoma.strategies import make_strategy
from zosoma.strategies.base import finite, lr_at

MAX_REBUILDS = 3  # per worker and request: a worker that keeps dying is an error, not a loop


class WorkerLost(Exception):
    """A population worker died (its process, actor or node); the driver rebuilds it."""


def exchange_bytes(P: int, W: int, scalars: int | None = None, values: int = 1) -> int:
    """Payload bytes per step of one model sharded over W workers: 2P float64 losses gathered, the
    step's float64 scalars sent to each worker (`scalars`, default P: the update's directions,
    docs/architecture.md#the-steps-scalars), each times `values` (Strategy.values_per_member)."""
    return 8 * values * (2 * P + W * (P if scalars is None else scalars))


def shard_pairs(P: int, W: int) -> list[range]:
    """The P pairs split into W contiguous shares, sizes differing by at most one."""
    if W > P:
        raise ConfigError(f"{W} population workers for {P} perturbation pairs (-P): each worker needs at "
                          f"least one pair; use at most {P} workers")
    bounds = [P * w // W for w in range(W + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_shardable(cfg: TrainConfig, W: int) -> None:
    """ConfigError when `cfg` cannot be sharded over W workers bit for bit."""
    reason = make_strategy(cfg).unshardable
    if W > 1 and reason:
        raise ConfigError(f"--optimizer {cfg.optimizer} {reason}: it is not sharded over --population-workers")
    if W > 1 and make_strategy(cfg).ask(0, 0).rank:
        raise ConfigError(f"--optimizer {cfg.optimizer} evaluates its population as one shared GEMM, whose "
                          "rounding depends on the split: it is not sharded over --population-workers")
    if W > 1 and cfg.queries != "constant":
        raise ConfigError(f"--queries {cfg.queries} changes P during the run; the workers' shares of the pairs are "
                          "fixed: it is not sharded over --population-workers")
    shard_pairs(cfg.perturbations, W)


# --- the worker side -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec(SendsEngine):
    """What one worker holds: a model's run folder, its training data, the pairs it evaluates."""
    run_dir: str
    corpus: Corpus
    expert: int
    ops: Ops  # the run's engine: this one in this process, rebuilt from its record in another
    pairs: range | None = None  # None: all of the step's P pairs


class Shard:
    """One worker's copy of a model: the checkpoint at `step` of spec.run_dir, then `replay` (the
    logged scalars of steps step, step + 1, ...) applied."""

    def __init__(self, spec: ShardSpec, step: int, replay: Sequence = ()):
        ckpt = RunFolder(spec.run_dir).read_checkpoint(step)
        self.stepper, self.pairs = Stepper.of(ckpt, spec.corpus, spec.expert, spec.ops), spec.pairs
        asarray = self.stepper.ops.asarray
        self.theta, self.optimizer = asarray(ckpt.theta), {k: asarray(v) for k, v in ckpt.optimizer.items()}
        self.step = ckpt.step
        for coeffs in replay:
            self.apply(coeffs)
        self.update_s = 0.0  # the last update's seconds, reported with the next losses

    def apply(self, coeffs) -> None:
        """The step's update from its scalars (shaped by the driver), as Trainer.update applies
        it (Stepper.apply)."""
        t0 = time.perf_counter()
        coeffs, pop = np.asarray(coeffs, np.float64), self.stepper.ask(self.step)
        self.theta, self.optimizer, _, _ = self.stepper.apply(self.theta, self.optimizer, coeffs, pop)
        self.step += 1
        self.update_s = time.perf_counter() - t0

    def losses(self, step: int):
        """(plus, minus, timings) of this worker's pairs at `step`: (|pairs|,) float64 each."""
        if step != self.step:
            raise RuntimeError(f"population worker at step {self.step} was asked for step {step}")
        timings = {"update": self.update_s}
        plus, minus = self.stepper.losses(self.theta, self.optimizer, self.stepper.ask(step), self.pairs, timings)
        return plus, minus, timings

    def state(self):
        """(step, theta, optimizer state) as NumPy arrays, for a checkpoint."""
        to_numpy = self.stepper.ops.to_numpy
        return self.step, to_numpy(self.theta), {k: to_numpy(v) for k, v in self.optimizer.items()}


def error_line(exc: BaseException) -> str:
    """A worker's error as the driver shows it: a ZosomaError's own line, else its type and line."""
    return str(exc) if isinstance(exc, ZosomaError) else one_line(exc)


# --- transports ------------------------------------------------------------------------------------

class InProcess:
    """Workers in this process, one after another: the exchange without processes."""

    def spawn(self, spec: ShardSpec, step: int, replay: Sequence = ()):
        return _InProcessHandle(spec, step, replay)


class _InProcessHandle:
    """Runs each call at once; result() is the last call's (the driver awaits every reply it
    needs before its next call), or the first error of any call."""

    def __init__(self, spec, step, replay):
        self.shard = Shard(spec, step, replay)
        self.calls, self.value, self.error = 0, None, None

    def call(self, method, *args) -> int:
        if self.error is None:
            try:
                self.value = getattr(self.shard, method)(*args)
            except Exception as e:
                self.error = error_line(e)
        self.calls += 1
        return self.calls - 1

    def result(self, ticket):
        if self.error is not None:
            raise ConfigError(self.error)
        return self.value

    def close(self):
        self.shard = None


class Processes:
    """Workers in spawned local processes, `threads` BLAS threads each. A worker exits when the
    driver's process dies."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))

    def spawn(self, spec: ShardSpec, step: int, replay: Sequence = ()):
        return _ProcessHandle(spec, step, replay, self.threads)


class _ProcessHandle:
    def __init__(self, spec, step, replay, threads):
        ctx = multiprocessing.get_context("spawn")  # BLAS threads do not survive a fork
        self.conn, child = ctx.Pipe()
        with child_threads(threads):
            self.process = ctx.Process(target=_serve, args=(child, spec, step, list(replay), os.getpid()),
                                       daemon=True)
            self.process.start()
        child.close()
        self.sent = self.received = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, method, *args) -> int:
        try:
            self.conn.send((method, args))
        except OSError:
            pass  # a dead worker: result() says so
        self.sent += 1
        return self.sent - 1

    def result(self, ticket):
        """The reply to `ticket`; replies to earlier calls (updates: None) are passed over, an
        error in any of them is raised."""
        while True:
            try:
                ok, value = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(1)
                raise WorkerLost(f"process {self.process.pid} exited (code {self.process.exitcode})") from None
            n, self.received = self.received, self.received + 1
            if not ok:
                raise ConfigError(value)
            if n == ticket:
                return value

    def close(self):
        self.conn.close()  # the worker sees EOF and exits
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _serve(conn, spec: ShardSpec, step: int, replay: list, parent: int) -> None:
    """A worker process: build the shard, then answer the driver's calls in order until EOF."""
    for s in (signal.SIGINT, signal.SIGTERM):  # stopping is the driver's: it checkpoints, then closes us
        signal.signal(s, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    try:
        shard, error = Shard(spec, step, replay), None
    except Exception as e:  # said in reply to every call
        shard, error = None, error_line(e)
    try:
        while True:
            method, args = conn.recv()
            if error is None:
                try:
                    reply = (True, getattr(shard, method)(*args))
                except Exception as e:
                    reply = (False, error_line(e))
            conn.send(reply if error is None else (False, error))
    except (EOFError, OSError):  # the driver closed the pipe, or died
        return


# --- the driver side -------------------------------------------------------------------------------

class Group:
    """The driver's workers: one ShardSpec each, spawned at the first step asked for, rebuilt when
    lost, closed when their model is done. Losses are asked of every worker at once, so the
    experts of the summed ablation evaluate in parallel."""

    def __init__(self, workers, specs: Sequence[ShardSpec]):
        self.workers, self.specs = workers, list(specs)
        self.handles: list = [None] * len(self.specs)
        self.at = [0] * len(self.specs)  # steps each worker has been sent (its step)
        self.since = [0] * len(self.specs)  # the checkpoint each worker would be rebuilt from
        self._losses: tuple[int, list] | None = None  # (step, every worker's losses)
        self.notes: list[str] = []  # rebuilt workers, one line each, for the next Step record
        weakref.finalize(self, _close_all, self.handles)

    def start(self, step: int) -> None:
        for i, spec in enumerate(self.specs):
            if self.handles[i] is None:
                self.handles[i] = self.workers.spawn(spec, step)
                self.at[i] = self.since[i] = step

    def losses(self, step: int) -> list:
        """Every worker's (plus, minus, timings) at `step` (asked once per step)."""
        if self._losses is None or self._losses[0] != step:
            self.start(step)
            tickets = [h.call("losses", step) for h in self.handles]
            self._losses = (step, [self._result(i, t, "losses", step) for i, t in enumerate(tickets)])
        return self._losses[1]

    def apply(self, i: int, coeffs: np.ndarray) -> None:
        self.handles[i].call("apply", coeffs)
        self.at[i] += 1

    def state(self, i: int):
        return self._result(i, self.handles[i].call("state"), "state")

    def checkpointed(self, i: int, step: int) -> None:
        self.since[i] = step

    def close(self, i: int) -> None:
        if self.handles[i] is not None:
            self.handles[i].close()
            self.handles[i] = None

    def _result(self, i: int, ticket, method: str, *args):
        """Worker i's reply to `ticket`; a lost worker is rebuilt and asked again."""
        for attempt in range(MAX_REBUILDS + 1):
            try:
                return self.handles[i].result(ticket)
            except WorkerLost as lost:
                if attempt == MAX_REBUILDS:
                    raise ConfigError(f"population worker {i} was lost {attempt + 1} times (last: {lost}); "
                                      "its run resumes from its last checkpoint") from None
                self._rebuild(i, lost)
                ticket = self.handles[i].call(method, *args)

    def _rebuild(self, i: int, lost: WorkerLost) -> None:
        spec, since, at = self.specs[i], self.since[i], self.at[i]
        logged = RunFolder(spec.run_dir).read_scalars(since)
        missing = [s for s in range(since, at) if s not in logged]
        if missing:
            raise ConfigError(f"population worker {i} was lost and {spec.run_dir} lacks the scalars of step "
                              f"{missing[0]} to rebuild it; its run resumes from its last checkpoint")
        self.handles[i].close()
        self.handles[i] = self.workers.spawn(spec, since, [logged[s] for s in range(since, at)])
        self.notes.append(f"population worker {i} was lost ({lost}); rebuilt from the checkpoint at step "
                          f"{since} and {at - since} logged steps of scalars")


def _close_all(handles: list) -> None:
    """Close what is still open (also at interpreter exit, when Ray may already be gone)."""
    for h in handles:
        if h is not None:
            with contextlib.suppress(Exception):
                h.close()


class ShardedTrainer(Trainer):
    """A Trainer whose model lives on workers (`members` of `group`): losses gathered in pair
    order, scalars logged and sent back; theta reaches the driver only for checkpoints."""

    def __init__(self, folder, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler, state: RunState,
                 group: Group, members: Sequence[int], ops: Ops, expert: int = 0, extra: dict | None = None):
        super().__init__(folder, model, cfg, sampler, state, ops, expert=expert, extra=extra)
        self.group, self.members = group, list(members)
        self.comm_bytes = self._exchanged(self.stepper.ask(state.step))
        self.synced = state.step  # the driver's theta is the workers' at this step
        self.folder.cut_scalars(state.step)  # scalars past the checkpoint belong to an abandoned session

    def _exchanged(self, pop) -> int:
        """The bytes a step of population `pop` exchanges: its losses, and its scalars to each worker."""
        return exchange_bytes(pop.P, len(self.members), pop.directions, self.stepper.strategy.values_per_member())

    def losses(self):
        t0 = time.perf_counter()
        step = self.state.step
        self._pop = self.stepper.ask(step)
        self.comm_bytes = self._exchanged(self._pop)
        every = self.group.losses(step)
        mine = [every[m] for m in self.members]
        wall = time.perf_counter() - t0
        keys = {k for _, _, t in mine for k in t}
        self.timings = {k: max(t.get(k, 0.0) for _, _, t in mine) for k in keys}  # the slowest worker's
        self.timings["exchange"] = max(0.0, wall - sum(self.timings.values()))
        return np.concatenate([p for p, _, _ in mine]), np.concatenate([m for _, m, _ in mine])

    def update(self, coeffs, loss):
        """Trainer.update, its record carrying any rebuilt worker's line."""
        record = super().update(coeffs, loss)
        notes, self.group.notes = tuple(self.group.notes), []
        return replace(record, notes=notes) if notes else record

    def apply(self, coeffs, pop):
        """Log the shaped scalars, send them to the workers (each applies them with Strategy.apply);
        the driver's theta waits for a checkpoint."""
        self.folder.append_scalars(self.state.step, coeffs)  # logged before any worker applies them
        for m in self.members:
            self.group.apply(m, coeffs)
        return (self.state.theta, self.state.optimizer, lr_at(self.cfg, pop.step, len(self.state.restarts)),
                not finite(coeffs))

    def adopt(self, state) -> None:
        """A restart rolled the model back: the workers are rebuilt from its new checkpoint (at
        their first step asked for), and the scalars logged past it belong to the abandoned course."""
        super().adopt(state)
        self.synced = state.step
        self.folder.cut_scalars(state.step)
        for m in self.members:
            self.group.close(m)

    def _sync(self) -> None:
        """The driver's theta and optimizer state from a worker, when they are behind."""
        if self.synced != self.state.step:
            step, theta, optimizer = self.group.state(self.members[0])
            if step != self.state.step:
                raise RuntimeError(f"population worker at step {step}, driver at {self.state.step}")
            self.state.theta = self.ops.asarray(theta)
            self.state.optimizer = {k: self.ops.asarray(v) for k, v in optimizer.items()}
            self.synced = step

    def to_checkpoint(self):
        self._sync()
        return super().to_checkpoint()

    def checkpoint(self) -> None:
        super().checkpoint()
        for m in self.members:
            self.group.checkpointed(m, self.state.step)
        if self.done:  # the model is finished: its workers go
            for m in self.members:
                self.group.close(m)

    @property
    def theta(self) -> np.ndarray:
        self._sync()
        return super().theta


@dataclass(frozen=True)
class Sharding:
    """One model's population over `size` workers spawned by `workers` (a transport)."""
    workers: object
    size: int


def make_trainer(folder, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler, state: RunState,
                 ops: Ops, extra: dict | None = None, sharding: Sharding | None = None) -> Trainer:
    """One model (expert 0) on the engine `ops`: a Trainer in this process, or with `sharding` a
    ShardedTrainer over sharding.size workers, each evaluating a contiguous share of the P pairs."""
    if sharding is None:
        return Trainer(folder, model, cfg, sampler, state, ops, extra=extra)
    check_shardable(cfg, sharding.size)
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    specs = [ShardSpec(str(folder.path), sampler.corpus, 0, ops, pairs)
             for pairs in shard_pairs(cfg.perturbations, sharding.size)]
    return ShardedTrainer(folder, model, cfg, sampler, state, Group(sharding.workers, specs), range(len(specs)),
                          ops, extra=extra)


def spread(trainer: Trainer, width: int, workers) -> ShardedTrainer:
    """`trainer`'s model, at a step it has a checkpoint for, with its P pairs over `width` workers
    spawned by `workers` (a transport); the trainer it was (on fewer workers) is given up."""
    if isinstance(trainer, ShardedTrainer):
        trainer._sync()
        for m in trainer.members:
            trainer.group.close(m)
    specs = [ShardSpec(str(trainer.folder.path), trainer.sampler.corpus, trainer.expert, trainer.ops, pairs)
             for pairs in shard_pairs(trainer.cfg.perturbations, width)]
    wider = ShardedTrainer(trainer.folder, trainer.model, trainer.cfg, trainer.sampler, trainer.state,
                           Group(workers, specs), range(width), trainer.ops, expert=trainer.expert,
                           extra=trainer.extra)
    wider.events = trainer.events  # one event file per session
    return wider


class Borrower:
    """An independent expert's trainer spread over the cores its executor lends it
    (zosoma.workers.executor.Cores: those no other unit holds, at the end of a run). Called between
    steps; the spread happens at a checkpointed step (every checkpoint_every steps), whose
    checkpoint the new workers read: no checkpoint is added, and the numbers are those of the
    trainer alone (its steps' records count the scalars exchanged, logged in scalars.jsonl)."""

    def __init__(self, cores):
        self.cores = cores

    def __call__(self, trainer: Trainer) -> Trainer:
        """`trainer`, or the same model over more workers when cores were lent."""
        cfg = trainer.cfg
        width = len(trainer.members) if isinstance(trainer, ShardedTrainer) else 1
        if trainer.state.step % cfg.checkpoint_every or width >= cfg.perturbations or trainer.strategy.ask(0, 0).rank:
            return trainer  # no checkpoint here to start workers from; or nothing to share (EGGROLL: not sharded)
        more = self.cores.borrow(cfg.perturbations - width)
        return spread(trainer, width + more, Processes(self.cores.threads)) if more else trainer


def borrower(trainer: Trainer) -> Borrower | None:
    """A Borrower for `trainer` where its executor lends cores (zosoma.workers.executor.spare_cores)
    and its forwards run on them (not on a GPU); else None."""
    cores = spare_cores()
    return Borrower(cores) if cores is not None and not trainer.ops.on_device else None


def summed_trainers(trainers: Sequence[Trainer], workers) -> list[ShardedTrainer]:
    """The summed ablation's experts (Trainers at one step, as zosoma.runs.soma.lockstep_trainers
    makes them) moved onto one worker each, on their engine's device; train them with
    zosoma.runs.soma.train_lockstep."""
    specs = [ShardSpec(str(t.folder.path), t.sampler.corpus, t.expert, t.ops) for t in trainers]
    group = Group(workers, specs)
    return [ShardedTrainer(t.folder, t.model, t.cfg, t.sampler, t.state, group, [i], t.ops, expert=t.expert,
                           extra=t.extra)
            for i, t in enumerate(trainers)]
