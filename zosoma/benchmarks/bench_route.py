"""Benchmark: top-k routed inference, many small experts against a few large ones.

The SOMA paper's claim (arXiv:2609.37899, its published figures): at a similar total size and
top-4 routing, SOMA with N = 256 experts serves 2.36M tokens/s against 257k for N = 8, 9.19x,
routing included, on RTX 5090 GPUs. With top-k routing each token runs k experts, so its cost
shrinks with the expert size, total / N. `bench_route` measures that ratio here, on this machine's
CPU and, with devices=("cpu", "cuda"), on its GPU too (the same ensembles and windows, the experts'
weights kept on the GPU), with random (seeded init_params) weights, which cost exactly what trained
ones do.

What one timed run does, for S held-out windows of `context` + `segment` bytes (real text from the
shipped corpus's held-out split, the same windows for both N):

    routing   embed the S contexts (hashed n-gram tf-idf -> SVD projection), squared distances to
              the N centroids, softmax, top-k                            Ops.route (Router.select)
    experts   group the S*k (segment, expert) pairs by expert and run each selected expert once
              on its rows: warm-up on the context from zero state, then score the segment
              (on the GPU: every expert's rows in tiles, all experts of one size in one
              population forward, zosoma.engines.cuda.grouped)          routing.run_selected
    mixing    the mixture's nats, -log sum_k w_k exp(-nll_k)            routing.mix_nll

tokens = S * segment scored bytes (the context warm-up is work, not output). Timed runs alternate
between the two N and the devices (one warm-up run each first), pausing between runs so that one
run's BLAS threads stop spinning before the next starts; each part is the median over `repeats`
runs. Routing runs on each device (Ops.route: on a GPU, zosoma.engines.cuda.device_routing), mixing
on the CPU. On a device the warm-up run also
counts the experts' rows computed (padding included) against the rows needed (segments x top-k)
and their kernel launches per time step (zosoma.engines.cuda.launches.RowCounter); the CPU runs each
expert on its own rows.

The clusterings are fitted on the shipped training corpus cut into 2048-byte chunks with the full
c-BTM pipeline (balanced k-means), but with one k-means++ restart and at most 10 Lloyd iterations
instead of 3 and 30, to keep the benchmark short; fitting time is reported, not counted.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from zosoma.engines import get_ops
from zosoma.workers.executor import THREAD_VARS, child_threads
from zosoma.config import ClusterConfig
from zosoma.mixture.cluster import fit_clusters
from zosoma.config import ModelConfig
from zosoma.errors import ConfigError
from zosoma.corpus import BatchSampler, chunk, load_corpus
from zosoma.model.params import Layout, init_params
from zosoma.mixture.routing import Ensemble, Router, Segments, segment_sums, mix_nll, run_selected

PAPER = {"n_small": 256, "n_large": 8, "top_k": 4, "small_tokens_per_s": 2.36e6,
         "large_tokens_per_s": 257e3, "ratio": 9.19}

_PAUSE_S = 0.3  # lets the previous run's BLAS threads stop spinning (OpenBLAS: about 0.1 s)
_CHUNK = 2048  # bytes per clustering chunk, as SOMA training (zosoma.runs.soma) uses by default
_THREAD_VARS = THREAD_VARS[:3]


def matched_config(total_params: int, n_experts: int) -> ModelConfig:
    """One layer, E = H / 2 (at least 8), H a multiple of 8: the expert whose n_experts copies
    come closest to total_params."""
    best = None
    for H in range(8, 4097, 8):
        model = ModelConfig(embed=max(8, H // 2), hidden=H, layers=1)
        gap = abs(n_experts * model.n_params() - total_params)
        if best is None or gap < best[0]:
            best = (gap, model)
    return best[1]


def matched_configs(total_params: int, *n_experts: int) -> list[ModelConfig]:
    """matched_config of each N; ConfigError unless all totals lie within 10% of total_params
    and of each other."""
    models = [matched_config(total_params, N) for N in n_experts]
    totals = [N * m.n_params() for N, m in zip(n_experts, models)]
    if max(totals) > 1.1 * min(totals) or not all(abs(t / total_params - 1) <= 0.1 for t in totals):
        shown = ", ".join(f"N={N}: {t:,}" for N, t in zip(n_experts, totals))
        raise ConfigError(f"cannot match {total_params:,} parameters with {' and '.join(map(str, n_experts))} "
                          f"experts within 10% ({shown}): choose a larger total")
    return models


def _ensemble(clustering, model: ModelConfig, top_k: int, seed: int) -> Ensemble:
    layout = Layout(model)
    experts = tuple((init_params(model, seed, i), layout) for i in range(clustering.n_clusters))
    return Ensemble(experts, Router(clustering, top_k))


def _run(ensemble: Ensemble, segs: Segments, batch: int, ops, count: bool = False) -> dict:
    """One routed pass over segs: seconds per part and the mixture's total nats; with count (on a
    device engine), the experts' launches and the rows they computed (zosoma.engines.cuda.launches.RowCounter)."""
    counter = contextlib.nullcontext(None)
    if count:
        from zosoma.engines.cuda.launches import RowCounter
        counter = RowCounter()
    t0 = time.perf_counter()
    experts, weights = ops.route(ensemble.router, segs.contexts)  # (S, K): on the device with a GPU
    t1 = time.perf_counter()
    with counter as launches:
        nll = run_selected(ensemble, segs, experts, batch, ops)  # (S, K, T), back on the host
    t2 = time.perf_counter()
    nats = float(segment_sums(mix_nll(nll, weights), segs.mask()).sum())
    t3 = time.perf_counter()
    return {"routing_s": t1 - t0, "experts_s": t2 - t1, "mixing_s": t3 - t2, "seconds": t3 - t0,
            "nats": nats, "experts": experts, "launches": launches}


def _ops(device: str, gemm: str):
    """The engine of `device`, its GEMMs in `gemm` on a GPU (the CPU's in fp32)."""
    ops = get_ops(device)
    return get_ops(device, gemm=gemm) if ops.on_device else ops


def _blas_threads() -> int | None:
    """The BLAS thread count the environment sets, when all of _THREAD_VARS agree on one."""
    values = {os.environ.get(v) for v in _THREAD_VARS}
    value = values.pop() if len(values) == 1 else None
    return int(value) if value is not None and value.isdigit() else None


def bench_route(n_small: int = 256, n_large: int = 8, top_k: int = 4, total_params: int = 2_000_000,
                segment: int = 128, context: int = 128, n_segments: int = 1024, repeats: int = 3,
                seed: int = 0, batch: int = 256, threads: int | None = 1,
                devices: tuple = ("cpu",), gemm: str = "fp32") -> list[dict]:
    """Tokens/s of top-k routed inference for n_large and n_small experts of about the same total
    size (matched_config), routing included, on each of `devices` ("cpu", "cuda"). Returns, per
    device, one record per N, large first, then a "ratio" record (small / large, beside the
    paper's 9.19x).

    gemm: the GEMM format of the device's experts (zosoma.engines.get_ops; the CPU's stay fp32).

    threads: BLAS threads. Unless the environment already says so, the benchmark runs in a
    spawned process whose OPENBLAS_NUM_THREADS (and OMP_, MKL_) is `threads` (BLAS reads it once,
    when it loads). Default 1: the small experts' per-step products are far too small to split,
    and on a shared machine a second thread that waits for a busy core slows every product
    10x or more (measured here: the E=8 H=16 forward 16x, the E=88 H=176 one 3-10x). None: the
    current process, as it is.
    """
    matched_configs(total_params, n_small, n_large)  # fail before any work
    kwargs = dict(n_small=n_small, n_large=n_large, top_k=top_k, total_params=total_params,
                  segment=segment, context=context, n_segments=n_segments, repeats=repeats,
                  seed=seed, batch=batch, devices=tuple(devices), gemm=gemm)
    if threads is None or _blas_threads() == threads:
        return _bench(**kwargs)
    ctx = multiprocessing.get_context("spawn")
    with child_threads(threads), ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(bench_route, **kwargs, threads=threads).result()


def _bench(n_small, n_large, top_k, total_params, segment, context, n_segments, repeats, seed,
           batch, devices, gemm) -> list[dict]:
    train = chunk(load_corpus(None, "train"), _CHUNK)
    windows = BatchSampler(load_corpus(None, "heldout"), context + segment).batch(seed, 0, 0, n_segments)
    segs = Segments.from_windows(windows, context)
    setups = []
    for N, model in zip((n_large, n_small), matched_configs(total_params, n_large, n_small)):
        cfg = ClusterConfig(n_clusters=N, restarts=1, iterations=10, seed=seed)
        t = time.perf_counter()
        clustering, _ = fit_clusters(train, cfg)
        fit_s = time.perf_counter() - t
        ensemble = _ensemble(clustering, model, top_k, seed)
        for device in devices:  # the weights live on the device before timing, as in serving
            setups.append((N, device, model, fit_s, ensemble.on(_ops(device, gemm))))

    runs: dict[tuple, list[dict]] = {(N, device): [] for N, device, *_ in setups}
    counted = {}  # (N, device) -> the warm-up's RowCounter, on a device
    for rep in range(repeats + 1):  # round 0 is the warm-up (JIT, caches, kernel compiles), not kept
        for N, device, _, _, ensemble in setups:
            ops = _ops(device, gemm)
            result = _run(ensemble, segs, batch, ops, count=ops.on_device and not rep)
            if rep:
                runs[N, device].append(result)
            else:
                counted[N, device] = result["launches"]
            time.sleep(_PAUSE_S)

    records = []
    tokens = segs.n_bytes
    for device in devices:
        per_n = []
        for N, _, model, fit_s, ensemble in (s for s in setups if s[1] == device):
            rs = runs[N, device]
            med = {k: float(np.median([r[k] for r in rs])) for k in ("seconds", "routing_s", "experts_s", "mixing_s")}
            rows = np.bincount(rs[0]["experts"].ravel(), minlength=N)  # segments routed to each expert
            launches = counted[N, device]  # None on the CPU, which runs each expert on its rows alone
            per_n.append({
                "name": f"N={N}", "device": device, "n_experts": N, "top_k": top_k, "model": model,
                "params_per_expert": model.n_params(), "total_params": N * model.n_params(),
                "flops_per_token": top_k * model.flops_per_token(),
                "n_segments": len(segs), "segment": segment, "context": context, "tokens": tokens,
                "tokens_per_s": tokens / med["seconds"], **med, "repeats": repeats,
                "experts_used": int((rows > 0).sum()), "max_segments_per_expert": int(rows.max()),
                "rows_needed": int(rows.sum()),
                "rows_computed": int(rows.sum()) if launches is None else launches.rows,
                "launches_per_step": None if launches is None else launches.total / segs.tokens.shape[1],
                "nats_per_byte": rs[0]["nats"] / tokens, "cluster_fit_s": fit_s,
                "cluster_config": "balanced k-means, 1 restart, <= 10 iterations (fast settings)",
                "threads": _blas_threads(),
            })
        large, small = per_n
        records += per_n + [{"name": "ratio", "device": device,
                             "ratio": small["tokens_per_s"] / large["tokens_per_s"],
                             "flops_ratio": large["flops_per_token"] / small["flops_per_token"],
                             "params_ratio": small["total_params"] / large["total_params"],
                             "n_small": n_small, "n_large": n_large, "paper": PAPER}]
    return records


def format_route(records: list[dict]) -> str:
    """The records of bench_route as a table and a ratio line per device (and, with several
    devices, each device's speed-up over the first)."""
    per_n = [r for r in records if r["name"] != "ratio"]
    first = per_n[0]

    def device(r):
        return r.get("device", "cpu")

    lines = [f"top-{first['top_k']} routed inference, random weights: {first['n_segments']} held-out "
             f"segments of {first['segment']} bytes, each after {first['context']} bytes of context "
             f"(median of {first['repeats']} runs; routing included; BLAS threads: "
             f"{first['threads'] or 'default'})",
             f"  {'N':>5}  {'device':<6} {'expert':<16} {'params/expert':>13} {'total':>11} {'FLOP/token':>11} "
             f"{'tokens/s':>10} {'routing':>8} {'experts':>8} {'mixing':>8} {'used':>5} {'max seg':>8} "
             f"{'rows':>14} {'launch/t':>8}"]
    for r in per_n:
        m = r["model"]
        lines.append(f"  {r['n_experts']:>5}  {device(r):<6} {f'E={m.embed} H={m.hidden} L={m.layers}':<16} "
                     f"{r['params_per_expert']:>13,} {r['total_params']:>11,} {r['flops_per_token']:>11,} "
                     f"{r['tokens_per_s']:>10,.0f} {r['routing_s']:>7.3f}s {r['experts_s']:>7.3f}s "
                     f"{r['mixing_s']:>7.3f}s {r['experts_used']:>5} {r['max_segments_per_expert']:>8} "
                     f"{_rows(r):>14} {_per_step(r):>8}")
    for ratio in (r for r in records if r["name"] == "ratio"):
        p = ratio["paper"]
        lines.append(f"  {device(ratio)}: N={ratio['n_small']} / N={ratio['n_large']}: {ratio['ratio']:.2f}x "
                     f"tokens/s (nominal FLOPs per token {ratio['flops_ratio']:.1f}x fewer; total params "
                     f"{ratio['params_ratio']:.3f}x)   paper: {p['small_tokens_per_s'] / 1e6:.2f}M vs "
                     f"{p['large_tokens_per_s'] / 1e3:.0f}k tokens/s, {p['ratio']:.2f}x (RTX 5090)")
    base = {r["n_experts"]: r for r in per_n if device(r) == device(first)}
    for r in per_n:
        if device(r) != device(first):
            lines.append(f"  {device(r)} / {device(first)}, N={r['n_experts']}: "
                         f"{r['tokens_per_s'] / base[r['n_experts']]['tokens_per_s']:.2f}x tokens/s")
    fits = ", ".join(f"N={r['n_experts']} {r['cluster_fit_s']:.1f} s" for r in base.values())
    lines.append(f"  clusters: {first['cluster_config']}; fitted in {fits} (not timed); "
                 f"'used' = experts with at least one segment, 'max seg' = most segments on one; "
                 f"'rows' = expert rows computed (padding included) / needed (segments x top-k); "
                 f"'launch/t' = the experts' kernels and GEMMs per time step (on a device)")
    return "\n".join(lines)


def _rows(r: dict) -> str:
    if "rows_needed" not in r:
        return "-"
    return f"{r['rows_computed'] / r['rows_needed']:.2f}x of {r['rows_needed']:,}"


def _per_step(r: dict) -> str:
    return "-" if r.get("launches_per_step") is None else f"{r['launches_per_step']:.2f}"
