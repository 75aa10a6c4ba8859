"""The SPSA training loop, written as a generator of progress records.

Each step: draw the step's minibatch (a pure function of seed, expert and step), evaluate the 2P
antithetic perturbations on it, turn the loss differences into the SPSA estimate, update. Batches
and noise are regenerated from counters, so a run resumed from a checkpoint takes exactly the steps
an uninterrupted run would have taken.

A run folder holds `checkpoint.h5` (written atomically every K steps, at the end, and when asked
to stop), `metrics.jsonl` (one record per step) and nothing else that matters for resuming.
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
from .errors import ConfigError
from .forward import population_loss
from .optim import apply_update, init_state, learning_rate, spsa_gradient, spsa_losses
from .params import Layout, init_params

CHECKPOINT = "checkpoint.h5"
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


def spsa_step(theta, layout: Layout, batch: np.ndarray, cfg: TrainConfig, expert: int, step: int):
    """The P central differences g_k of one step and the mean minibatch loss at theta."""
    plus, minus = spsa_losses(theta, lambda thetas: population_loss(thetas, layout, batch),
                              cfg.perturbations, cfg.eps, cfg.seed, expert, step, cfg.noise)
    return (plus - minus) / (2 * cfg.eps), float(np.mean((plus + minus) / 2))


def train(run_dir: Path, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler,
          state: RunState, expert: int = 0, extra: dict | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """Train from `state` to cfg.steps, yielding one record per step and a final record with
    "event": "done" or "stopped" (should_stop() turned true; the state is checkpointed first)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if sampler.T1 != cfg.seq_len + 1:
        raise ConfigError(f"sampler windows are {sampler.T1} bytes, training needs {cfg.seq_len + 1}")
    layout = Layout(model)
    extra = dict(extra or {}, expert=expert, seed=cfg.seed)
    tokens_per_step = 2 * cfg.perturbations * cfg.batch * cfg.seq_len
    ckpt_path = run_dir / CHECKPOINT
    _rewrite_metrics(run_dir / METRICS, state.metrics)  # drop records past the checkpoint we resume
    with open(run_dir / METRICS, "a") as log:
        while state.step < cfg.steps:
            if should_stop():
                save_checkpoint(ckpt_path, to_checkpoint(model, cfg, state, extra))
                yield {"event": "stopped", "step": state.step, "expert": expert}
                return
            t0 = time.perf_counter()
            step = state.step
            batch = sampler.batch(cfg.seed, expert, step, cfg.batch)
            g, loss = spsa_step(state.theta, layout, batch, cfg, expert, step)
            lr = learning_rate(step, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule)
            skipped = not np.all(np.isfinite(g))
            if skipped:  # a NaN/inf loss would poison theta and the optimizer state: skip the step
                theta, opt = state.theta, state.optimizer
            else:
                ghat = spsa_gradient(g, state.theta.size, cfg.seed, expert, step, cfg.noise)
                theta, opt = apply_update(cfg.optimizer, state.theta, ghat, state.optimizer, step, lr,
                                          cfg.momentum, cfg.beta2, cfg.weight_decay)
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "expert": expert, "loss": loss, "lr": lr,
                      "tokens": state.tokens + tokens_per_step, "wall_s": state.wall_s + dt,
                      "tokens_per_s": tokens_per_step / dt, "skipped": bool(skipped)}
            record["flops"] = record["tokens"] * model.flops_per_token()
            # The state changes only here, once the step is complete (stop requests are polled).
            state.theta, state.optimizer, state.step = theta, opt, step + 1
            state.tokens, state.wall_s = record["tokens"], record["wall_s"]
            state.metrics.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            yield record
            if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
                save_checkpoint(ckpt_path, to_checkpoint(model, cfg, state, extra))
    yield {"event": "done", "step": state.step, "expert": expert}


def resume_state(run_dir: Path) -> tuple[Checkpoint, RunState]:
    ckpt = load_checkpoint(Path(run_dir) / CHECKPOINT)
    return ckpt, from_checkpoint(ckpt)


def _rewrite_metrics(path: Path, records: list) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)
