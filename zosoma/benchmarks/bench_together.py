"""Launches per step of SOMA's training stepping N experts together (zosoma.training.together, the
`--executor together` placement), counted as bench_launches counts its paths: the training side's
own step (each expert's Trainer, its batch, shaping, guard and records) on the CUDA engine, so
the count is what a SOMA run launches, not a kernel benchmark's.

Counted on the recording runtime (nothing runs; its losses read as zeros, so every step's
scalars are finite and its update launches, as on a device) or on a given runtime (the emulated
one, or the device's: then timed too).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from zosoma.config import VOCAB, ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines.cuda import custom_kernels
from zosoma.engines.cuda.launches import Launches, RecordingRuntime, _ShapesOnly
from zosoma.training.together import step_together
from zosoma.training.trainer import Trainer, new_state


class _Zeroed(_ShapesOnly):
    """The recording runtime's arrays, uninitialised ones as zeros: the losses it never computes
    read as equal, so a step's scalars are finite (garbage could be NaN and skip the update)."""

    @staticmethod
    def empty(shape, dtype=float, **kwargs):
        return np.zeros(shape, dtype)


class ZeroedRecording(RecordingRuntime):
    def __init__(self):
        super().__init__()
        self.xp = _Zeroed()


def soma_config(P: int, B: int, T: int, steps: int = 100) -> TrainConfig:
    """The default SOMA run's strategy (one-sided SPSA, normalize shaping) at P pairs, B x T."""
    return TrainConfig(optimizer="onesided", shaping=("normalize",), perturbations=P, batch=B, seq_len=T,
                       steps=steps, checkpoint_every=steps)


def together_launches(model: ModelConfig, P: int, B: int, T: int, experts, rt=None, timed_steps: int = 0) -> list[dict]:
    """One row per N in `experts` (bench_launches.count_launches' fields, path "together"): the
    launches of one step_together of N experts' Trainers on the CUDA engine, after a first
    untimed step, and the median seconds of timed_steps further steps."""
    from zosoma.engines import cuda_engine_here

    rt = ZeroedRecording() if rt is None else rt
    cfg = soma_config(P, B, T, steps=1000)  # no checkpoint, and not done, within the steps timed
    rng = np.random.default_rng(0)
    rows = []
    with custom_kernels.using(rt), np.errstate(all="ignore"), tempfile.TemporaryDirectory() as tmp:
        ops, xp = cuda_engine_here(), rt.xp
        sync = xp.cuda.runtime.deviceSynchronize if hasattr(xp, "cuda") else (lambda: None)
        for N in experts:
            trainers = []
            for n in range(N):
                text = rng.integers(0, VOCAB, 4 * (T + 1) * B, np.uint8)
                sampler = BatchSampler(Corpus((f"expert{n}",), (text,)), T + 1)
                trainers.append(Trainer(f"{tmp}/{N}/expert{n}", model, cfg, sampler, new_state(model, cfg, n), ops,
                                        expert=n))
            step_together(trainers)
            with Launches(xp) as counted:
                step_together(trainers)
            seconds = []
            for _ in range(timed_steps):
                sync()
                t0 = time.perf_counter()
                step_together(trainers)
                sync()
                seconds.append(time.perf_counter() - t0)
            for t in trainers:
                t.events.close()
            rows.append({"path": "together", "experts": N, "kernels": counted.kernels, "gemms": counted.gemms,
                         "graphs": counted.graphs, "launches": counted.total, "per_expert": counted.total / N,
                         "step_s": float(np.median(seconds)) if seconds else None, "tokens": 2 * P * B * T * N})
    return rows
