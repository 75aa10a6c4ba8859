"""The SPSA training loop, written as a generator of progress records.

Each step: draw the step's minibatch (a pure function of seed, expert and step), evaluate the 2P
antithetic perturbations on it, turn the losses into per-direction coefficients (SPSA: central
differences; EGGROLL: z-scored fitness differences), update. Batches
and noise are regenerated from counters, so a run resumed from a checkpoint takes exactly the steps
an uninterrupted run would have taken.

A run (or expert) folder holds `checkpoint.h5` (written atomically every K steps, at the end, and
when asked to stop; the one before it is kept as `checkpoint.prev.h5`) and `metrics.jsonl` (one
record per step, cut back to the checkpoint's step on resume).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .config import ModelConfig, TrainConfig
from .corpus import BatchSampler
from .eggroll import eggroll_population_loss, eggroll_step, zscore
from .errors import CheckpointError, ConfigError
from .forward import population_loss
from .optim import apply_update, init_state, learning_rate, spsa_gradient, spsa_losses
from .params import Layout, init_params

CHECKPOINT = "checkpoint.h5"
PREVIOUS = "checkpoint.prev.h5"
NEXT = "checkpoint.next.h5"
METRICS = "metrics.jsonl"


@dataclass
class RunState:
    """Everything that changes during training; saved whole in every checkpoint."""
    theta: np.ndarray
    optimizer: dict
    step: int = 0
    metrics: list = field(default_factory=list)
    tokens: int = 0  # bytes pushed through forward passes (2P * B * T per step)
    wall_s: float = 0.0  # training wall time summed over all sessions of this run


def new_state(model: ModelConfig, cfg: TrainConfig, expert: int = 0) -> RunState:
    theta = init_params(model, cfg.seed, expert)
    return RunState(theta, init_state(cfg.optimizer, theta.size))


def to_checkpoint(model, cfg, state: RunState, extra: dict) -> Checkpoint:
    extra = dict(extra, tokens=state.tokens, flops=state.tokens * model.flops_per_token(),
                 wall_s=state.wall_s, data_cursor=state.step)
    return Checkpoint(model=model, train=cfg, theta=state.theta, step=state.step,
                      optimizer=state.optimizer, metrics=state.metrics, extra=extra)


def from_checkpoint(ckpt: Checkpoint) -> RunState:
    return RunState(ckpt.theta, ckpt.optimizer, ckpt.step, list(ckpt.metrics),
                    int(ckpt.extra.get("tokens", 0)), float(ckpt.extra.get("wall_s", 0.0)))


def write_checkpoint(run_dir: Path, ckpt: Checkpoint) -> None:
    """Atomically replace run_dir/checkpoint.h5, keeping the one it replaces as checkpoint.prev.h5.
    At every instant at least one of the three files holds a complete checkpoint."""
    run_dir = Path(run_dir)
    save_checkpoint(run_dir / NEXT, ckpt)
    if (run_dir / CHECKPOINT).exists():
        os.replace(run_dir / CHECKPOINT, run_dir / PREVIOUS)
    os.replace(run_dir / NEXT, run_dir / CHECKPOINT)


def read_checkpoint(run_dir: Path, step: int | None = None) -> Checkpoint:
    """The newest complete checkpoint of run_dir, or the one at `step`. A damaged file is passed
    over only when another one can take its place; otherwise its error is raised."""
    run_dir = Path(run_dir)
    found, errors = [], []
    for name in (CHECKPOINT, NEXT, PREVIOUS):
        if (run_dir / name).exists():
            try:
                found.append(load_checkpoint(run_dir / name))
            except CheckpointError as e:
                errors.append(e)
    if step is not None:
        found = [c for c in found if c.step == step]
    if not found:
        if errors:
            raise errors[0]
        where = f"at step {step} " if step is not None else ""
        raise CheckpointError(f"{run_dir}: no {CHECKPOINT} {where}to resume from")
    return max(found, key=lambda c: c.step)


class Trainer:
    """One model's SPSA training: `losses` evaluates the step's perturbations, `update` applies an
    estimate built from per-direction coefficients. Independent training feeds each expert its own
    central differences; the summed-loss ablation feeds every expert the shared ones."""

    def __init__(self, run_dir: Path, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler,
                 state: RunState, expert: int = 0, extra: dict | None = None, device: str = "cpu"):
        if sampler.T1 != cfg.seq_len + 1:
            raise ConfigError(f"sampler windows are {sampler.T1} bytes, training needs {cfg.seq_len + 1}")
        self.run_dir, self.model, self.cfg, self.sampler = Path(run_dir), model, cfg, sampler
        self.state, self.expert = state, expert
        self.device = device  # "cpu" or "cuda" (resolved); only the forward passes move to the GPU
        self.layout = Layout(model)
        self.extra = dict(extra or {}, expert=expert, seed=cfg.seed)
        self.tokens_per_step = 2 * cfg.perturbations * cfg.batch * cfg.seq_len
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _rewrite_metrics(self.run_dir / METRICS, state.metrics)  # drop records past the checkpoint
        self.timings: dict = {}  # seconds of the step in progress: noise, forward, update

    @property
    def done(self) -> bool:
        return self.state.step >= self.cfg.steps

    @property
    def eggroll(self) -> bool:
        return self.cfg.optimizer == "eggroll"

    def losses(self) -> tuple[np.ndarray, np.ndarray]:
        """L(theta + eps delta_k) and L(theta - eps delta_k), k < P, on this step's minibatch
        (EGGROLL: L(theta + E_k) and L(theta - E_k) of its low-rank perturbations)."""
        t0 = time.perf_counter()
        cfg, step = self.cfg, self.state.step
        batch = self.sampler.batch(cfg.seed, self.expert, step, cfg.batch)
        self.timings = {"data": time.perf_counter() - t0}
        if self.eggroll:
            return self._eggroll_losses(batch)
        args = (cfg.perturbations, cfg.eps, cfg.seed, self.expert, step, cfg.noise)
        if self.device == "cuda":  # the population is perturbed and evaluated on the device
            from . import gpu
            t0 = time.perf_counter()
            result = gpu.spsa_losses(self.state.theta, self.layout, batch, *args)
            self.timings["forward"] = time.perf_counter() - t0
            return result
        return spsa_losses(self.state.theta, lambda thetas: population_loss(thetas, self.layout, batch),
                           *args, self.timings)

    def _eggroll_losses(self, batch) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        args = (self.layout, batch, cfg.eps, cfg.rank, cfg.seed, self.expert, self.state.step,
                cfg.perturbations)
        t0 = time.perf_counter()
        if self.device == "cuda":
            from .gpu import eggroll_population_loss as population
        else:
            population = eggroll_population_loss
        losses = population(self.state.theta, *args)
        self.timings["forward"] = time.perf_counter() - t0  # noise factors included
        return losses[0::2], losses[1::2]

    def coefficients(self, plus: np.ndarray, minus: np.ndarray) -> tuple[np.ndarray, float]:
        """Per-direction coefficients for `update` and the minibatch loss estimate at theta."""
        if not self.eggroll:
            return central_differences(plus, minus, self.cfg.eps)
        loss = float(np.mean((plus + minus) / 2))
        if not (np.all(np.isfinite(plus)) and np.all(np.isfinite(minus))):
            return np.full(plus.shape, np.nan), loss  # a diverged member: the step is skipped
        fz = zscore(-np.stack([plus, minus], axis=1).ravel())  # fitness of members 2k (+), 2k+1 (-)
        return fz[0::2] - fz[1::2], loss

    def update(self, coeffs: np.ndarray, loss: float) -> dict:
        """Apply ghat = (1/P) sum_k coeffs[k] delta_k (EGGROLL: theta += lr (2P)^-1/2 sum_k
        coeffs[k] E_k); a non-finite coefficient skips the step (a NaN would poison theta and the
        optimizer state). Returns the step's record."""
        t0 = time.perf_counter()
        cfg, state, step = self.cfg, self.state, self.state.step
        lr = learning_rate(step, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule)
        skipped = not np.all(np.isfinite(coeffs))
        theta, opt = state.theta, state.optimizer
        if not skipped and self.eggroll:
            theta = eggroll_step(theta, self.layout, coeffs, lr, cfg.eps, cfg.rank, cfg.seed,
                                 self.expert, step)
        elif not skipped:
            ghat = spsa_gradient(coeffs, theta.size, cfg.seed, self.expert, step, cfg.noise)
            theta, opt = apply_update(cfg.optimizer, theta, ghat, opt, step, lr,
                                      cfg.momentum, cfg.beta2, cfg.weight_decay)
        self.timings["update"] = time.perf_counter() - t0
        dt = sum(self.timings.values())
        record = {"step": step + 1, "expert": self.expert, "loss": loss, "lr": lr,
                  "tokens": state.tokens + self.tokens_per_step, "wall_s": state.wall_s + dt,
                  "tokens_per_s": self.tokens_per_step / dt, "skipped": bool(skipped),
                  **{f"{k}_s": v for k, v in self.timings.items()}}
        record["flops"] = record["tokens"] * self.model.flops_per_token()
        # The state changes only here, once the step is complete (stop requests are polled).
        state.theta, state.optimizer, state.step = theta, opt, step + 1
        state.tokens, state.wall_s = record["tokens"], record["wall_s"]
        state.metrics.append(record)
        with open(self.run_dir / METRICS, "a") as log:
            log.write(json.dumps(record) + "\n")
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
            self.checkpoint()
        return record

    def checkpoint(self) -> None:
        write_checkpoint(self.run_dir, to_checkpoint(self.model, self.cfg, self.state, self.extra))


def central_differences(plus: np.ndarray, minus: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
    """SPSA coefficients g_k = (L+ - L-) / (2 eps) and the minibatch loss estimate at theta."""
    return (plus - minus) / (2 * eps), float(np.mean((plus + minus) / 2))


def train(trainer: Trainer, should_stop: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """Train one model with its own losses (SOMA's independent experts; a single model) to
    cfg.steps, yielding one record per step and a final record with "event": "done", or
    "stopped" when should_stop() turned true (the state is checkpointed first)."""
    while not trainer.done:
        if should_stop():
            trainer.checkpoint()
            yield {"event": "stopped", "step": trainer.state.step, "expert": trainer.expert}
            return
        yield trainer.update(*trainer.coefficients(*trainer.losses()))
    yield {"event": "done", "step": trainer.state.step, "expert": trainer.expert}


def _rewrite_metrics(path: Path, records: list) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)
