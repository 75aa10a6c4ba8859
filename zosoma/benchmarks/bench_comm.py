"""Bytes exchanged per training step: SOMA's experts, one model's population sharded over W
workers, and data-parallel backpropagation, side by side for each preset (`zosoma bench comm`).

    SOMA experts             0 while training: each expert's batches, noise, losses and update are
                             its own (an executor carries only its progress records)
    sharded population       per step the driver gathers the 2P V float64 losses and sends the D V
                             float64 update scalars to each of the W workers, V the strategy's values
                             per member (the default run's, activity perturbation: D = 2P, V = B T, a
                             loss and a scalar per target; one-sided SPSA's V = 1;
                             docs/architecture.md#the-steps-scalars):
                             zosoma.workers.population_workers.exchange_bytes = 8 V (2P + W D) in all,
                             what every sharded run records as comm_bytes; 8 V (2P / W + D) per worker
    data-parallel all-reduce a ring all-reduce of the fp32 gradient sends 2 (W - 1) / W x 4d
                             bytes per worker and step (about 2 x 4d), independent of P

Beside the payload, "pickled" is what the local-process transport actually writes per worker and
step (the pickled messages: the scalars, the losses and their timings), measured here.
"""

from __future__ import annotations

import pickle

import numpy as np

from zosoma.config import PRESETS
from zosoma.strategies import make_strategy
from zosoma.strategies.settings import resolve
from zosoma.workers.population_workers import exchange_bytes, shard_pairs


def allreduce_bytes(d: int, W: int) -> float:
    """Bytes each of W workers sends per step in a ring all-reduce of d fp32 gradients."""
    return 2 * (W - 1) / W * 4 * d


def pickled_bytes(P: int, W: int, D: int, V: int = 1) -> int:
    """Bytes the local transport writes for the busiest worker and step: its losses reply and the
    driver's message of D V scalars, pickled as zosoma.workers.population_workers sends them."""
    pairs = max(shard_pairs(P, W), key=len)
    timings = {"data": 0.0, "update": 0.0, "forward": 0.0}
    reply = (True, (np.zeros((len(pairs), V)), np.zeros((len(pairs), V)), timings))
    return len(pickle.dumps(reply)) + len(pickle.dumps(("apply", (np.zeros(D * V),)))) + len(pickle.dumps(("losses", (0,))))


def bench_comm(workers: int = 8) -> list[dict]:
    """One row per preset: parameters d, perturbations P, the default run's scalars D and the
    bytes per step of each scheme."""
    rows = []
    for name in PRESETS:
        model, cfg = resolve(name)
        strategy = make_strategy(cfg)
        P, D, V = cfg.perturbations, strategy.ask(0, 0).directions, strategy.values_per_member()
        d, W = model.n_params(), min(workers, P)
        rows.append({"preset": name, "d": d, "P": P, "D": D, "V": V, "W": W, "soma": 0,
                     "population": exchange_bytes(P, W, D, V), "population_per_worker": exchange_bytes(P, W, D, V) / W,
                     "pickled_per_worker": pickled_bytes(P, W, D, V), "allreduce_per_worker": allreduce_bytes(d, W)})
    return rows


def format_comm(rows: list[dict]) -> str:
    W = rows[0]["W"] if rows else 0
    lines = [f"bytes per training step; W = {W} workers (P: the preset's perturbation pairs, D: the default run's "
             "directions, V: its values per member, d: parameters per model)",
             f"{'preset':<8}{'d':>12}{'P':>5}{'D':>5}{'V':>6}{'SOMA expert':>13}{'population':>12}{'per worker':>12}"
             f"{'pickled':>9}{'all-reduce':>13}{'ratio':>9}",
             f"{'':<8}{'':>12}{'':>5}{'':>5}{'':>6}{'':>13}{'(all W)':>12}{'':>12}{'':>9}{'per worker':>13}{'':>9}"]
    for r in rows:
        ratio = r["allreduce_per_worker"] / r["population_per_worker"]
        lines.append(f"{r['preset']:<8}{r['d']:>12,}{r['P']:>5}{r['D']:>5}{r['V']:>6}{r['soma']:>13,}{r['population']:>12,}"
                     f"{r['population_per_worker']:>12,.0f}{r['pickled_per_worker']:>9,}"
                     f"{r['allreduce_per_worker']:>13,.0f}{ratio:>8,.0f}x")
    lines += ["SOMA expert: nothing while training. population: 8 V (2P + W D) payload bytes, the 2P V losses gathered",
              "and the step's D V scalars sent to each worker (the default run's, activity perturbation: D = 2P members,",
              "V = B T targets each; every sharded run records it as comm_bytes); per worker 8 V (2P / W + D);",
              "pickled: what the local transport writes per",
              "worker. all-reduce: a ring all-reduce of the fp32 gradient, 2 (W - 1) / W x 4d per worker. ratio:",
              "all-reduce / population per worker."]
    return "\n".join(lines)
