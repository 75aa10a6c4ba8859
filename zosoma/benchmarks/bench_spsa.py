"""SPSA step throughput beside PyTorch peers and the machine's fp32 matmul peak, in one run.

Runs the trainer's own step (zosoma.training.trainer.Trainer) on the shipped corpus, so what is timed is
what training does, split into drawing the batch ("data"), the 2P forward passes ("forward": on
the CPU engine each pair's two members are built from the counters inside it, so their noise is
forward time; `noise_in_forward` times that building alone), building perturbed weights outside
the forward ("noise": engines that take materialised members) and the update (regenerating the P
directions into the estimate and applying it, "update").

Beside it, in the same interleaved rounds (a load that comes and goes on a shared machine hits
every path alike): the PyTorch peers of zosoma.benchmarks.torch_peers for the same model, P, B, T
and noise (CPU engine, torch installed), each warmed up at 1 thread and at the BLAS thread count
and timed at the faster of the two (on a loaded machine torch's spinning threads can make 2
threads 10x slower than 1); then the fp32 matmul peak (`peak_gflops`). FLOP rates:

    nominal   ModelConfig.flops_per_token() x forward tokens (2P x B x T) per second: the count
              any implementation is charged
    executed  what zosoma's forward executes: layer 0's input projection is the table
              embed @ w_ih over the batch's U distinct bytes (2 x U x E x 4H per member) instead
              of a GEMM over the B x T bytes

Last, on the CPU engine in fp32, the step's roofline (zosoma.benchmarks.roofline): its work per
token against one core's GEMM peak and exp cost measured in the same run, and what bounds it.
The model is the preset's, or any shape (embed, hidden, layers).
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import numpy as np

from zosoma.config import ModelConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.benchmarks import roofline
from zosoma.benchmarks.bench_forward import peak_gflops
from zosoma.engines.cpu import forward, noise_kernels, threads
from zosoma.engines.ops import Ops
from zosoma.model import noise as noise_mod
from zosoma.training.trainer import Trainer, new_state
from zosoma.strategies.settings import resolve

PARTS = ("forward", "noise", "data", "update")
PEAK_N = 2048  # n of the n^3 GEMMs that measure the peaks
_PAUSE_S = 0.3  # between paths: the previous path's BLAS/OpenMP threads stop spinning
# After the pause every path runs one untimed step before its timed one: training runs its steps
# back to back, and a step straight after a sleep ran 30% slower (cores and caches still cold).


def step_defaults(preset: str) -> dict:
    """P, B and T a preset trains with (zosoma.config.PRESETS over TrainConfig's defaults)."""
    _, cfg = resolve(preset)
    return {"perturbations": cfg.perturbations, "batch": cfg.batch, "seq_len": cfg.seq_len}


def executed_flops_per_member(model: ModelConfig, batch: np.ndarray) -> int:
    """FLOPs zosoma's forward executes for one member on a (B, T+1) batch (module docstring)."""
    E, H = model.embed, model.hidden
    inputs = batch[:, :-1]
    return inputs.size * (model.flops_per_token() - 8 * E * H) + 8 * len(np.unique(inputs)) * E * H


def _noise_in_forward(theta: np.ndarray, pop) -> callable:
    """Building every pair's two members from the counters, as the CPU forward does, alone."""
    k0, k1 = noise_mod.stream_key(pop.seed)
    code = noise_mod.kind_code(pop.kind)
    scale = np.float32(pop.scale)

    none = np.empty(0, np.float32)

    def run():
        def work(k, bufs):
            noise_kernels.antithetic_pair(bufs[0], bufs[1], theta, scale, code, k0, k1, k, pop.step, pop.expert, none)
        threads.run_items(work, pop.P, lambda: np.empty((2, theta.size), np.float32))
    return run


def bench_spsa(preset: str = "paper", perturbations: int | None = None, batch: int | None = None,
               seq_len: int | None = None, steps: int = 2, noise: str = "rademacher", seed: int = 0,
               ops=None, peers: bool = True, peak_n: int | None = None, embed: int | None = None,
               hidden: int | None = None, layers: int | None = None) -> dict:
    """Median per-step seconds of each part of zosoma's step over `steps` timed steps (after one
    warm-up step), the same for each PyTorch peer, the fp32 peak and the step's roofline; P, B,
    T and the model's E, H, L default to the preset's."""
    defaults = step_defaults(preset)
    peak_n = peak_n or PEAK_N
    P = perturbations or defaults["perturbations"]
    B = batch or defaults["batch"]
    T = seq_len or defaults["seq_len"]
    shape = {k: v for k, v in (("embed", embed), ("hidden", hidden), ("layers", layers)) if v is not None}
    model, cfg = resolve(preset, {"perturbations": P, "batch": B, "seq_len": T, "steps": 2 * steps + 1, "noise": noise,
                                  "seed": seed, "checkpoint_every": 10**9, "optimizer": "sgd", **shape})  # as the peers
    sampler = BatchSampler(load_corpus(None, "train"), T + 1)
    n_threads = threads.n_threads()
    per_step, in_forward = [], []
    peer_steps, peer_times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(tmp, model, cfg, sampler, new_state(model, cfg), ops=Ops() if ops is None else ops)
        fp32_on_host = not trainer.ops.on_device and trainer.ops.precision == "fp32"  # the PyTorch peers' terms
        gemm_paths = _gemm_paths(trainer.ops)
        chosen = "loops" if gemm_paths and forward.uses_loops(model, B) else "blas"
        path_steps = {path: [] for path in gemm_paths}
        if peers and fp32_on_host:
            from zosoma.benchmarks import torch_peers
            peer_batch = sampler.batch(seed, 0, 0, B)
            for name, make in torch_peers.available().items():
                for n in sorted({1, n_threads}):
                    peer_steps[name, n] = make(model, P, peer_batch, eps=cfg.eps, kind=noise, threads=n, seed=seed)
                    peer_times[name, n] = []
        for s in range(steps + 1):  # round 0 warms up every path (JIT, caches)
            for path in gemm_paths or [None]:
                with forward.forced_gemm(path) if path else contextlib.nullcontext():
                    for _ in range(2 if s else 1):
                        trainer.update(*trainer.coefficients(*trainer.losses()))
                if s and path:
                    path_steps[path].append(sum(trainer.timings.get(k, 0.0) for k in PARTS))
                if s and path in (None, chosen):
                    per_step.append(dict(trainer.timings))
            if fp32_on_host and "noise" not in trainer.timings:  # the forward built the members itself
                pop = trainer.strategy.ask(0, s)
                build = _noise_in_forward(trainer.state.theta, pop)
                t0 = time.perf_counter()
                build()
                if s:
                    in_forward.append(time.perf_counter() - t0)
            for key, step in list(peer_steps.items()):
                time.sleep(_PAUSE_S)
                if s:
                    step(s)
                t0 = time.perf_counter()
                step(s)
                peer_times[key].append(time.perf_counter() - t0)
            if s == 0:  # each peer's timed steps run at the thread count of its faster warm-up
                for name in {name for name, _ in peer_steps}:
                    keys = sorted((k for k in peer_steps if k[0] == name), key=lambda k: peer_times[k][0])
                    for key in keys[1:]:
                        del peer_steps[key], peer_times[key]
                for times in peer_times.values():
                    times.clear()
            time.sleep(_PAUSE_S)
    peak, peak_how = peak_gflops(peak_n)
    parts = {k: float(np.median([t.get(k, 0.0) for t in per_step])) for k in PARTS}
    total = sum(parts.values())
    tokens = 2 * P * B * T
    measured = roofline.measure(model, peak_n) if fp32_on_host else None
    roof = roofline.roofline(model, measured, tokens, total, n_threads) if fp32_on_host else None
    paths = {}
    for path, times in path_steps.items():
        s = float(np.median(times))
        paths[path] = {"step_s": s, "tokens_per_s": tokens / s, "chosen": path == chosen,
                       "roofline": roofline.roofline(model, measured, tokens, s, n_threads)}
    nominal = model.flops_per_token() * tokens
    executed = 2 * P * np.mean([executed_flops_per_member(model, sampler.batch(seed, 0, s, B))
                                for s in range(1, steps + 1)])  # the timed steps' batches
    best = {}
    for (name, n), times in peer_times.items():
        s = float(np.median(times))
        if name not in best or s < best[name]["step_s"]:
            best[name] = {"name": name, "threads": n, "step_s": s, "tokens_per_s": tokens / s,
                          "gflops": nominal / s / 1e9}
    return {"preset": preset, "n_params": model.n_params(), "perturbations": P, "batch": B,
            "seq_len": T, "noise": noise, "steps": steps, "parts": parts, "step_s": total,
            "tokens_per_s": tokens / total, "outside_forward": 1 - parts["forward"] / total,
            "noise_in_forward_s": float(np.median(in_forward)) if in_forward else None,
            "gflops_nominal": nominal / total / 1e9, "gflops_executed": executed / total / 1e9,
            "peak_gflops": peak, "peak_how": peak_how, "threads": n_threads, "peers": list(best.values()),
            "peers_skipped": _peers_skipped(peers, fp32_on_host, trainer.ops.name),
            "model": model, "device": trainer.ops.name, "roofline": roof, "gemm_paths": paths}


def _gemm_paths(ops) -> list[str]:
    """The CPU forward's two GEMM paths (zosoma.engines.cpu.forward.GEMM_ENV), timed side by side
    when `ops` runs that forward in fp32; none for other engines."""
    runs_cpu_forward = (isinstance(ops, Ops) and ops.precision == "fp32" and not ops.on_device
                        and type(ops).population_loss is Ops.population_loss
                        and type(ops).perturbed_losses is Ops.perturbed_losses)
    return ["blas", "loops"] if runs_cpu_forward else []


def _peers_skipped(wanted: bool, fp32_on_host: bool, engine: str) -> str | None:
    """Why no PyTorch peer was timed, or None."""
    from zosoma.benchmarks import torch_peers

    if not wanted:
        return "not run (--no-peers)"
    if not fp32_on_host:
        return f"CPU yardsticks, not run on the {engine} engine"
    return None if torch_peers.available() else "torch is not installed"


def format_spsa(r: dict) -> str:
    m = r["model"]
    lines = [f"SPSA step, preset {r['preset']} (E={m.embed} H={m.hidden} L={m.layers}, {r['n_params']:,} parameters), "
             f"P={r['perturbations']} ({2 * r['perturbations']} forward passes), B={r['batch']} T={r['seq_len']}, "
             f"{r['noise']} noise, device {r['device']}, {r['threads']} threads; median of {r['steps']} steps, each after "
             f"an untimed one (after a warm-up round)",
             f"  {'part':<10} {'s/step':>9} {'share':>7}"]
    lines += [f"  {k:<10} {v:>9.4f} {v / r['step_s']:>7.1%}" for k, v in r["parts"].items()]
    lines.append(f"  {'total':<10} {r['step_s']:>9.4f}")
    if r["noise_in_forward_s"] is not None:
        lines.append(f"  the forward builds each pair's members from the counters: "
                     f"{r['noise_in_forward_s']:.4f} s of it ({r['noise_in_forward_s'] / r['step_s']:.1%} of the step)")
    lines.append(f"  outside the forward passes: {r['outside_forward']:.1%} of step time")
    peak = r["peak_gflops"]
    head = f"  {'path':<62} {'s/step':>8} {'tokens/s':>11} {'GFLOP/s':>8} {'executed':>9} {'of peak':>8} {'zosoma is':>10}"
    lines += ["", head,
              f"  {'fp32 matmul peak (' + r['peak_how'] + ')':<62} {'-':>8} {'-':>11} {peak:>8.1f} {'-':>9} {'100%':>8} {'-':>10}",
              f"  {'zosoma SPSA step':<62} {r['step_s']:>8.4f} {r['tokens_per_s']:>11,.0f} {r['gflops_nominal']:>8.1f} "
              f"{r['gflops_executed']:>9.1f} {r['gflops_nominal'] / peak:>8.0%} {'-':>10}"]
    for p in r["peers"]:
        name = f"{p['name']}, {p['threads']} thread{'s' if p['threads'] > 1 else ''}"
        lines.append(f"  {name:<62} {p['step_s']:>8.4f} {p['tokens_per_s']:>11,.0f} {p['gflops']:>8.1f} "
                     f"{p['gflops']:>9.1f} {p['gflops'] / peak:>8.0%} {r['tokens_per_s'] / p['tokens_per_s']:>9.2f}x")
    if r["peers_skipped"]:
        lines.append(f"  (PyTorch peers: {r['peers_skipped']})")
    lines.append("  tokens/s: forward tokens (2P x B x T per step); GFLOP/s nominal (ModelConfig.flops_per_token), "
                 "'executed': zosoma's layer-0 table instead of its input GEMM")
    if r["roofline"] is not None:
        lines += ["", roofline.format_roofline(r["roofline"])]
    if r["gemm_paths"]:
        lines += ["", format_gemm_paths(r["gemm_paths"])]
    return "\n".join(lines)


PATH_NAMES = {"blas": "GEMMs as BLAS calls (today's path)", "loops": "GEMMs as compiled loops"}


def format_gemm_paths(paths: dict) -> str:
    """The CPU forward's two GEMM paths timed in the same rounds: the step, its roofline fraction
    (the compute-bound time over the measured step) and GEMM share of the peak, what bounds it."""
    head = (f"  {'path (' + forward.GEMM_ENV + ')':<44} {'s/step':>8} {'tokens/s':>11} {'x blas':>7} "
            f"{'of roofline':>11} {'of peak':>8}  bound")
    lines = ["GEMM paths, same rounds ([chosen]: the one training takes here, ZOSOMA_CPU_GEMM)", head]
    for path, p in paths.items():
        f = p["roofline"]
        label = f"{path}: {PATH_NAMES[path]}" + (" [chosen]" if p["chosen"] else "")
        lines.append(f"  {label:<44} {p['step_s']:>8.4f} {p['tokens_per_s']:>11,.0f} "
                     f"{paths['blas']['step_s'] / p['step_s']:>6.2f}x {f['compute_bound_s'] / p['step_s']:>11.0%} "
                     f"{f['fraction_of_peak']:>8.0%}  {f['bound']}")
    lines.append("  of roofline: (GEMMs at the core peak + exps at the kernels' cost) / the measured step")
    return "\n".join(lines)
