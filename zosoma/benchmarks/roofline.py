"""What bounds the SPSA step at a model shape: its nominal work per token against one core's fp32
GEMM peak and exp throughput, both measured in the same run (`zosoma bench spsa`).

Counted per predicted byte (token) of an L-layer LSTM (E embed, H hidden, V = 256):

    gemm_flops  every GEMM, multiply-add = 2 (ModelConfig.flops_per_token): per layer the input-
                and hidden-to-gate products 2*4H*(E_in + H) (E_in = E in layer 0, H above), and
                the output layer 2*H*V
    exps        transcendentals, counted apart from FLOPs: the log-softmax's V exponentials and,
                per layer, the 5H gate nonlinearities (sigmoid of i, f, o; tanh of g and of the
                cell), one exponential's worth each

Left out: the O(H) gate and cell arithmetic beside them (bias adds, f*c + i*g, o*tanh(c)), the
embedding lookup, and the log-softmax's max and sum passes. The exps are priced at what the CPU
forward pays for them: its own log-softmax and gate kernels (zosoma.engines.cpu.forward's
`output_rows` and `lstm_cell_rows`, a vectorised exp and a rational tanh) timed alone on one
thread; NumPy's float32 np.exp per element is reported beside them as a yardstick.

The compute-bound step is the step's tokens x (gemm_flops / core peak + the kernels' seconds per
token) / threads; the rest of the measured step is overhead (small-GEMM calls, the noise, the
batch, the update, Python). The peak is a 1-thread n^3 float32 GEMM through the BLAS the forward
calls (Numba's np.dot, SciPy's OpenBLAS), pinned to one thread with threadpoolctl, which also
names the BLAS libraries and their kernels (internal_api, architecture).
"""

from __future__ import annotations

import os
import time

import numpy as np

from zosoma.config import VOCAB, ModelConfig
from zosoma.engines.cpu.row_kernels import lstm_cell_rows, output_rows

GATE_EXPS = 5  # per hidden unit and layer: sigmoid i, f, o, tanh g, tanh(c)
_KERNEL_ROWS = 1024  # rows per timed kernel call (the forward's chunks are about this size)
_EXP_N = 1 << 16  # floats per np.exp call: 256 KB, cache-resident like a chunk's logits


def token_work(model: ModelConfig) -> dict:
    """The nominal work of one token (module docstring): GEMM FLOPs, split into the LSTM layers
    and the output layer, and exps, split into the log-softmax's and the gates'."""
    output = 2 * model.hidden * VOCAB
    gate_exps = GATE_EXPS * model.hidden * model.layers
    return {"gemm_flops": model.flops_per_token(), "lstm_flops": model.flops_per_token() - output,
            "output_flops": output, "exps": VOCAB + gate_exps, "softmax_exps": VOCAB, "gate_exps": gate_exps}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up (JIT, caches)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return float(np.median(seconds))


def core_peak(n: int = 2048, repeats: int = 3) -> dict:
    """fp32 GFLOP/s of one n^3 GEMM on one thread through the forward's BLAS, and the BLAS
    libraries loaded (threadpoolctl: internal_api, version, architecture, file)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from zosoma.benchmarks.bench_forward import _dot

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)
    with threadpool_limits(limits=1, user_api="blas"):
        s = _median_s(lambda: _dot(a, b, out), repeats)
    blas = [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "filepath")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return {"gflops": 2 * n ** 3 / s / 1e9, "how": f"1-thread {n}^3 sgemm through Numba's np.dot", "blas": blas}


def np_exp_ns(repeats: int = 5, calls: int = 20) -> float:
    """Nanoseconds per element of NumPy's float32 exp (one thread, as NumPy's ufuncs run)."""
    x = np.random.default_rng(0).uniform(-10, 0, _EXP_N).astype(np.float32)
    out = np.empty_like(x)

    def run():
        for _ in range(calls):
            np.exp(x, out=out)
    return _median_s(run, repeats) / (calls * _EXP_N) * 1e9


def kernel_s_per_token(model: ModelConfig, repeats: int = 5) -> dict:
    """Seconds per token of the CPU forward's log-softmax + NLL row (`output_rows`, V exps) and of
    its gate and cell math (`lstm_cell_rows`, 5H exps, once per layer), each timed alone."""
    rng = np.random.default_rng(0)
    R, H, G = _KERNEL_ROWS, model.hidden, 4 * model.hidden
    logits = rng.standard_normal((R, VOCAB), dtype=np.float32)
    zeros_v = np.zeros(VOCAB, np.float32)  # a zero bias: repeated calls leave the logits as they are
    targets = rng.integers(0, VOCAB, R, dtype=np.uint8)
    nll, fold = np.empty(R, np.float32), np.empty(VOCAB // 2, np.float32)
    softmax = _median_s(lambda: output_rows(logits, zeros_v, targets, nll, False, fold), repeats)
    gates, xsrc = (rng.standard_normal((R, G), dtype=np.float32) for _ in range(2))
    rows, bias = np.arange(R), np.zeros(G, np.float32)
    c, h = np.zeros((R, H), np.float32), np.empty((R, H), np.float32)
    cell = _median_s(lambda: lstm_cell_rows(gates, xsrc, rows, bias, c, h), repeats)
    return {"softmax": softmax / R, "gates": model.layers * cell / R}


def measure(model: ModelConfig, peak_n: int = 2048) -> dict:
    """Everything the roofline needs from this machine, for one model shape."""
    return {"core": core_peak(peak_n), "np_exp_ns": np_exp_ns(), "kernels": kernel_s_per_token(model)}


def roofline(model: ModelConfig, measured: dict, tokens: int, step_s: float, threads: int) -> dict:
    """The step's measured seconds against its compute-bound time on `threads` cores: the GEMMs at
    the core peak, the exps at the forward's kernels' cost, and the rest (overhead); the GEMM
    FLOP rate reached as a fraction of threads x the core peak; the largest of the three parts
    bounds the step."""
    work = token_work(model)
    core, kernels = measured["core"], measured["kernels"]
    per_token_exp_s = kernels["softmax"] + kernels["gates"]
    parts = {"gemm": tokens * work["gemm_flops"] / (core["gflops"] * 1e9) / threads,
             "exps": tokens * per_token_exp_s / threads}
    parts["overhead"] = step_s - parts["gemm"] - parts["exps"]
    gflops = tokens * work["gemm_flops"] / step_s / 1e9
    return {"per_token": work, "core_peak_gflops": core["gflops"], "peak_how": core["how"], "blas": core["blas"],
            "np_exp_ns": measured["np_exp_ns"], "forward_exp_ns": per_token_exp_s / work["exps"] * 1e9,
            "threads": threads, "tokens": tokens, "step_s": step_s, "parts_s": parts,
            "compute_bound_s": parts["gemm"] + parts["exps"], "gflops": gflops,
            "fraction_of_peak": gflops / (threads * core["gflops"]), "bound": max(parts, key=parts.get)}


def _blas_names(blas: list) -> str:
    return ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernels "
                     f"({os.path.basename(os.path.dirname(b['filepath'] or '')) or '?'})" for b in blas) or "none found"


def format_roofline(r: dict) -> str:
    w, p = r["per_token"], r["parts_s"]
    step = f"step: {r['tokens']:,} tokens on {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
    lines = ["roofline",
             f"  per token: {w['gemm_flops']:,} GEMM FLOPs (LSTM 2*4H*(E+H) per layer: {w['lstm_flops']:,}; "
             f"output 2*H*256: {w['output_flops']:,})",
             f"             {w['exps']:,} exps (log-softmax: {w['softmax_exps']}; gates 5H per layer: {w['gate_exps']:,})",
             f"  core peak {r['core_peak_gflops']:.1f} GFLOP/s ({r['peak_how']})",
             f"  BLAS: {_blas_names(r['blas'])}",
             f"  exp: np.exp float32 {r['np_exp_ns']:.2f} ns/element; the forward's log-softmax and gate kernels "
             f"{r['forward_exp_ns']:.2f} ns per exp",
             f"  {step:<38} {'s/step':>8} {'share':>7}"]
    for label, key in (("GEMMs at the core peak", "gemm"), ("exps at the kernels' cost", "exps"),
                       ("the rest: overhead", "overhead")):
        lines.append(f"    {label:<36} {p[key]:>8.4f} {p[key] / r['step_s']:>7.1%}")
    lines += [f"    {'measured step':<36} {r['step_s']:>8.4f}",
              f"  {r['gflops']:.1f} GEMM GFLOP/s = {r['fraction_of_peak']:.0%} of {r['threads']} x the core peak; "
              f"bound by: {r['bound']}"]
    return "\n".join(lines)


def format_shapes(results: list[dict]) -> str:
    """One row per shape of `bench spsa --shapes`: the step and its roofline side by side."""
    head = (f"  {'shape':<16} {'params':>8} {'FLOPs/tok':>9} {'exps/tok':>8} {'s/step':>8} {'tokens/s':>11} "
            f"{'GFLOP/s':>8} {'of peak':>7} {'GEMM s':>8} {'exps s':>8} {'overhead':>8}  bound")
    lines = [f"shapes at P={results[0]['perturbations']} B={results[0]['batch']} T={results[0]['seq_len']}, "
             f"device {results[0]['device']}:", head]
    for r in results:
        m, f = r["model"], r["roofline"]
        shape = f"E={m.embed} H={m.hidden} L={m.layers}"
        if f is None:
            lines.append(f"  {shape:<16} {r['n_params']:>8,} {'':>9} {'':>8} {r['step_s']:>8.4f} {r['tokens_per_s']:>11,.0f}")
            continue
        w, p = f["per_token"], f["parts_s"]
        lines.append(f"  {shape:<16} {r['n_params']:>8,} {w['gemm_flops']:>9,} {w['exps']:>8,} {r['step_s']:>8.4f} "
                     f"{r['tokens_per_s']:>11,.0f} {f['gflops']:>8.1f} {f['fraction_of_peak']:>7.0%} {p['gemm']:>8.4f} "
                     f"{p['exps']:>8.4f} {p['overhead']:>8.4f}  {f['bound']}")
    if any(r.get("gemm_paths") for r in results):
        lines += ["", format_paths_table(results)]
    return "\n".join(lines)


def format_paths_table(results: list[dict]) -> str:
    """The CPU forward's two GEMM paths at each shape, timed in the same rounds: tokens/s, the
    ratio, and each one's fraction of the roofline (compute-bound time / measured step) and of
    the peak, and what bounds it."""
    lines = ["GEMM paths at each shape, same rounds (blas: BLAS calls, today's path; loops: compiled loops):",
             f"  {'shape':<16} {'blas tok/s':>11} {'loops tok/s':>11} {'loops/blas':>10} {'of roofline':>13} "
             f"{'of peak':>11}  {'taken':<5} {'bound (blas / loops)'}"]
    for r in results:
        paths = r.get("gemm_paths")
        if not paths:
            continue
        m = r["model"]
        blas, loops = paths["blas"], paths["loops"]
        fb, fl = blas["roofline"], loops["roofline"]
        frac = f"{fb['compute_bound_s'] / blas['step_s']:.0%} / {fl['compute_bound_s'] / loops['step_s']:.0%}"
        peak = f"{fb['fraction_of_peak']:.0%} / {fl['fraction_of_peak']:.0%}"
        taken = "loops" if loops["chosen"] else "blas"
        lines.append(f"  {f'E={m.embed} H={m.hidden} L={m.layers}':<16} {blas['tokens_per_s']:>11,.0f} "
                     f"{loops['tokens_per_s']:>11,.0f} {blas['step_s'] / loops['step_s']:>9.2f}x {frac:>13} {peak:>11}  "
                     f"{taken:<5} {fb['bound']} / {fl['bound']}")
    return "\n".join(lines)
