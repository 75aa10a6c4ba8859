"""SPSA step throughput, split into forward passes, noise generation and the update.

Runs the trainer's own step (zosoma.runs.trainer.Trainer) on the shipped corpus, so what is timed is
what training does: building the 2P perturbed parameter vectors chunk by chunk ("noise"), the
population forward ("forward"), drawing the batch ("data"), and regenerating the P directions
into the estimate plus the optimizer update ("update").
"""

from __future__ import annotations

import tempfile

import numpy as np

from zosoma.config import PRESETS, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.runs.trainer import Trainer, new_state

PARTS = ("forward", "noise", "data", "update")


def bench_spsa(preset: str = "paper", perturbations: int = 64, batch: int = 8, seq_len: int = 128,
               steps: int = 2, noise: str = "rademacher", seed: int = 0, ops=None) -> dict:
    """Median per-step seconds of each part over `steps` timed steps (after one warm-up step)."""
    model, overrides = PRESETS[preset]
    cfg = TrainConfig(**{**TrainConfig().__dict__, **overrides, "perturbations": perturbations,
                         "batch": batch, "seq_len": seq_len, "steps": steps + 1, "noise": noise,
                         "seed": seed, "checkpoint_every": 10**9})
    sampler = BatchSampler(load_corpus(None, "train"), seq_len + 1)
    per_step = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(tmp, model, cfg, sampler, new_state(model, cfg), ops=ops)
        for _ in range(steps + 1):
            trainer.update(*trainer.coefficients(*trainer.losses()))
            per_step.append(dict(trainer.timings))
    timed = per_step[1:]
    parts = {k: float(np.median([t.get(k, 0.0) for t in timed])) for k in PARTS}
    total = sum(parts.values())
    tokens = 2 * perturbations * batch * seq_len
    return {"preset": preset, "n_params": model.n_params(), "perturbations": perturbations, "batch": batch,
            "seq_len": seq_len, "noise": noise, "steps": steps, "parts": parts, "step_s": total,
            "tokens_per_s": tokens / total, "outside_forward": 1 - parts["forward"] / total,
            "model": model, "device": trainer.ops.name}


def format_spsa(r: dict) -> str:
    m = r["model"]
    lines = [f"SPSA step, preset {r['preset']} (E={m.embed} H={m.hidden} L={m.layers}, {r['n_params']:,} parameters), "
             f"P={r['perturbations']} ({2 * r['perturbations']} forward passes), B={r['batch']} T={r['seq_len']}, "
             f"{r['noise']} noise, device {r['device']}; median of {r['steps']} steps after a warm-up",
             f"  {'part':<10} {'s/step':>9} {'share':>7}"]
    lines += [f"  {k:<10} {v:>9.3f} {v / r['step_s']:>7.1%}" for k, v in r["parts"].items()]
    lines.append(f"  {'total':<10} {r['step_s']:>9.3f}   {r['tokens_per_s']:,.0f} forward tokens/s")
    lines.append(f"  outside the forward passes: {r['outside_forward']:.1%} of step time")
    return "\n".join(lines)
