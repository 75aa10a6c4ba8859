"""Per-member forward cost: EGGROLL's shared-GEMM population forward vs full-rank SPSA's.

EGGROLL evaluates all 2P members at once (`eggroll_population_loss`, regenerating its low-rank
factors inside the timing). SPSA evaluates 2P dense perturbed copies one member after another
(`zosoma.engines.cpu.forward.population_loss`), run exactly as the trainer runs it (`Ops.perturbed_losses`: the
copies are built chunk by chunk within a memory budget, then evaluated): "dense" is the forward
alone, "dense+noise" also counts building the Rademacher copies. The three are timed in turn in
each of `repeats` rounds after one warm-up (which also compiles), and each keeps its best round,
so a load spike on a shared machine hits all of them alike rather than one.
"""

from __future__ import annotations

import time

import numpy as np

from zosoma.config import VOCAB, ModelConfig
from zosoma.engines.ops import Ops
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population

SIGMA = 1e-3  # the perturbation scale (TrainConfig.eps); it does not change the work done


def bench_eggroll(embed: int, hidden: int, layers: int, batch: int = 8, seq_len: int = 32,
                  pairs: int = 64, rank: int = 1, repeats: int = 3, seed: int = 0,
                  ops=None) -> dict:
    """Best-of-`repeats` seconds per population member of EGGROLL (rank `rank`) and of SPSA, both
    with 2*pairs members on one shared (batch, seq_len+1) batch of random bytes. Returns a dict;
    speedup = dense seconds / EGGROLL seconds (above 1: EGGROLL is cheaper per member). Both run
    on the engine `ops` (default the CPU); on a GPU SPSA's copies are built inside its forward
    call, so "dense" includes the noise there."""
    if pairs < 1 or repeats < 1:
        raise ValueError(f"pairs and repeats must be at least 1, got {pairs} and {repeats}")
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    theta = init_params(layout.config, seed)
    data = np.random.default_rng(seed).integers(0, VOCAB, (batch, seq_len + 1), dtype=np.uint8)
    members = 2 * pairs
    ops = ops or Ops()

    theta = ops.asarray(theta)  # results come back as NumPy, so each call ends synchronised

    def eggroll():
        ops.perturbed_losses(theta, layout, data, Population(pairs, SIGMA, seed, 0, 0, "gaussian", rank))

    def spsa():  # -> (forward seconds, forward + noise seconds); an engine that perturbs inside
        timings = {}  # its forward reports it all as forward
        ops.perturbed_losses(theta, layout, data, Population(pairs, SIGMA, seed, 0, 0), timings=timings)
        return timings["forward"], timings["forward"] + timings.get("noise", 0.0)

    eggroll()
    spsa()
    t_egg, t_dense, t_dense_noise = np.inf, np.inf, np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        eggroll()
        t_egg = min(t_egg, time.perf_counter() - t0)
        fwd, both = spsa()
        t_dense, t_dense_noise = min(t_dense, fwd), min(t_dense_noise, both)
    return {"embed": embed, "hidden": hidden, "layers": layers, "params": layout.size,
            "batch": batch, "seq_len": seq_len, "pairs": pairs, "members": members, "rank": rank,
            "repeats": repeats, "device": ops.name, "eggroll_s_per_member": t_egg / members,
            "dense_s_per_member": t_dense / members,
            "dense_with_noise_s_per_member": t_dense_noise / members,
            "speedup": t_dense / t_egg}


def format_eggroll(records: list[dict]) -> str:
    """A plain-text table of bench_eggroll records, one row each."""
    cols = ("E", "H", "L", "params", "members", "EGGROLL ms/member", "dense ms/member",
            "dense+noise ms/member", "speedup")
    rows = [(str(r["embed"]), str(r["hidden"]), str(r["layers"]), f"{r['params']:,}",
             str(r["members"]), f"{1e3 * r['eggroll_s_per_member']:.3f}",
             f"{1e3 * r['dense_s_per_member']:.3f}",
             f"{1e3 * r['dense_with_noise_s_per_member']:.3f}", f"{r['speedup']:.2f}x")
            for r in records]
    widths = [max(len(c), *(len(row[k]) for row in rows)) for k, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    if records:
        r = records[0]
        lines.append(f"rank {r['rank']}, B={r['batch']} T={r['seq_len']}, {r['pairs']} pairs; "
                     f"best of {r['repeats']}; device {r['device']}; speedup = dense / EGGROLL per member")
    return "\n".join(lines)
