"""Kernel launches per SPSA step of N experts, on each of the CUDA engine's paths (issue 47):

    kernels   today's path: each expert's population through cuda_forward's perturb kernel,
              weight copies, a GEMM and a cell kernel per timestep, the logits and the
              log-softmax, then the expert's fused update: ~2T + 5 launches per expert
    graph     the same forward captured once per shape as a CUDA graph (graph_forward): per
              expert the perturb kernel, the graph, the update: 3 launches per expert
    fused     every expert's members in ONE fused.cu launch (fused_forward.experts_losses), then
              every expert's update in ONE launch (fused_forward.experts_update): 2 launches a
              step, whatever N
    together  SOMA's training stepping its N experts together (zosoma.training.together, `--executor
              together`): each expert's Trainer (batch, coefficients, shaping, guard, records) around
              the engine's calls for all of them (zosoma.benchmarks.bench_together)

Counted with zosoma.engines.cuda.launches.Launches on the device when there is one (and timed
there), else on the recording runtime (NumPy arrays, every launch recorded and none run: a
step's launches do not depend on the values it computes, so any N counts in seconds). The step
is SOMA's: N experts of E=16 H=20 L=1 at P=64, B=8, T=32, antithetic Rademacher SPSA.
"""

from __future__ import annotations

import time

import numpy as np

from zosoma.config import VOCAB, ModelConfig
from zosoma.engines.cuda import cuda_forward, cuda_noise, custom_kernels, fused_forward
from zosoma.engines.cuda.launches import Launches
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population

SOMA_EXPERT = ModelConfig(embed=16, hidden=20, layers=1)
SOMA_STEP = dict(P=64, B=8, T=32)
EXPERTS = (1, 16, 64)
PATHS = ("kernels", "graph", "fused", "together")


def experts_step(path: str, thetas, layout: Layout, batches, pops: list[Population], lr: float):
    """One SPSA step of N experts on `path`: every expert's losses, plain SPSA coefficients
    (L+ - L-) / 2 eps, every expert's fused update. thetas (N, d) device, updated in place;
    batches (N, B, T+1) uint8."""
    if path == "fused":
        losses = fused_forward.experts_losses(thetas, layout, batches, pops)
        coeffs = np.stack([(plus - minus) / (2 * p.scale) for (plus, minus), p in zip(losses, pops)])
        fused_forward.experts_update(thetas, coeffs, pops, lr, out=thetas)
        return
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    with cuda_forward.forced_path(path):
        for n, p in enumerate(pops):
            plus, minus = cuda_forward.spsa_losses(thetas[n], layout, batches[n], p.P, p.scale, p.seed, p.expert,
                                                   p.step, p.kind)
            cuda_noise.spsa_update(thetas[n], (plus - minus) / (2 * p.scale), lr, p.seed, p.expert, p.step, p.kind,
                                   out=thetas[n])


def count_launches(model: ModelConfig = SOMA_EXPERT, P: int = SOMA_STEP["P"], B: int = SOMA_STEP["B"],
                   T: int = SOMA_STEP["T"], experts=EXPERTS, paths=PATHS, rt=None, timed_steps: int = 0) -> list[dict]:
    """One row per (path, N): launches of one step (after a first, untimed one), split into raw
    kernels and GEMMs, on runtime `rt` (default: a RecordingRuntime; the device's:
    custom_kernels.runtime()), and the median seconds of timed_steps further steps."""
    layout = Layout(model)
    rows = []
    from zosoma.benchmarks.bench_together import ZeroedRecording, together_launches
    rt = ZeroedRecording() if rt is None else rt
    with custom_kernels.using(rt), np.errstate(all="ignore"):
        xp = rt.xp
        sync = xp.cuda.runtime.deviceSynchronize if hasattr(xp, "cuda") else (lambda: None)
        for N in experts:
            thetas = custom_kernels.to_device(np.stack([init_params(model, 0, n) for n in range(N)]))
            batches = custom_kernels.to_device(np.random.default_rng(N).integers(0, VOCAB, (N, B, T + 1), np.uint8),
                                               np.uint8)
            for path in paths:
                if path == "fused" and not fused_forward.fits(layout, B):
                    continue
                if path == "together":
                    rows += together_launches(model, P, B, T, (N,), rt, timed_steps)
                    continue
                pops = lambda step: [Population(P, 1e-3, 0, n, step) for n in range(N)]  # noqa: E731
                experts_step(path, thetas, layout, batches, pops(0), 1e-4)
                with Launches(xp) as n:
                    experts_step(path, thetas, layout, batches, pops(1), 1e-4)
                seconds = []
                for s in range(timed_steps):
                    sync()
                    t0 = time.perf_counter()
                    experts_step(path, thetas, layout, batches, pops(2 + s), 1e-4)
                    sync()
                    seconds.append(time.perf_counter() - t0)
                rows.append({"path": path, "experts": N, "kernels": n.kernels, "gemms": n.gemms, "graphs": n.graphs,
                             "launches": n.total, "per_expert": n.total / N,
                             "step_s": float(np.median(seconds)) if seconds else None,
                             "tokens": 2 * P * B * T * N})
    return rows


def format_launches(rows: list[dict], where: str) -> str:
    """The table of count_launches; `where` says which runtime counted."""
    lines = [f"launches per SPSA step of N experts ({where}): raw kernels + GEMMs + graph replays",
             f"  {'path':<8} {'N':>4} {'kernels':>8} {'GEMMs':>6} {'graphs':>6} {'launches':>9} {'per expert':>11}"
             f" {'s/step':>9} {'tokens/s':>12}"]
    for r in rows:
        timed = (f" {r['step_s']:>9.5f} {r['tokens'] / r['step_s']:>12,.0f}" if r["step_s"] else
                 f" {'-':>9} {'-':>12}")
        lines.append(f"  {r['path']:<8} {r['experts']:>4} {r['kernels']:>8} {r['gemms']:>6} {r['graphs']:>6} "
                     f"{r['launches']:>9} {r['per_expert']:>11.2f}" + timed)
    lines.append("  kernels: each expert through the per-timestep kernels (today's path); graph: those captured once "
                 "as a CUDA graph (per expert: perturb, the graph, the update); fused: every expert's members in one "
                 "fused.cu launch, every update in one; together: SOMA's training stepping every expert together "
                 "(--executor together)")
    return "\n".join(lines)
