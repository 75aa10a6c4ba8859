"""Benchmarks: tokens/s of each forward path, measured in one run beside their references.

Every benchmark returns a list of records (plain dicts) that `format_records` renders as a table:
    name             what ran
    tokens_per_s     predicted bytes per second (median over `repeats` timed runs, after a warm-up)
    gflops           nominal model GFLOP/s: ModelConfig.flops_per_token() * tokens_per_s / 1e9
                     (the same count for every path, whatever shortcuts a path takes)
    fraction_of_peak gflops / the fp32 matmul GFLOP/s measured in the same run (peak_gflops: the
                     larger of NumPy's 2-thread GEMM and one 1-thread GEMM per thread at once)
    ratio_vs_torch   tokens_per_s / torch's tokens_per_s in the same run
    repeats, seconds (median seconds per timed run), threads, note

Timed paths run in interleaved rounds (one run of each path per round), so a load that comes and
goes on a shared machine hits every path alike, with a short pause between paths: each BLAS
(NumPy's OpenBLAS, SciPy's OpenBLAS behind Numba, torch's OpenMP pool) has threads that spin for a
while after a call, and would steal the cores from the next path.

On the CUDA engine the paths are its population forward (CuPy) and torch's cuDNN nn.LSTM on
the same GPU, in fp32 (TF32 off for torch; CuPy uses TF32 only when CUPY_TF32 is set), beside the
GPU's fp32 GEMM peak. Every timed call ends by reading a result back to the host, so it includes
the device's work.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
from numba import njit

from zosoma.config import VOCAB, ModelConfig
from zosoma.engines.cpu import threads
from zosoma.model.params import Layout, init_params

_PAUSE_S = 0.3  # lets the previous path's BLAS threads stop spinning (OpenBLAS: about 0.1 s)
_PEAK_N = 2048  # matmul size for the fp32 peak
_PEAK_N_CUDA = 8192  # on a GPU: large enough that the launch is negligible (~1.1 TFLOP)


def blas_threads() -> int:
    """Threads OpenBLAS uses: its environment variables, else one per core."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return os.cpu_count() or 1


def _time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved(paths: dict[str, Callable[[], object]], repeats: dict[str, int],
                     pause_s: float = _PAUSE_S) -> dict[str, list[float]]:
    """Seconds per call of each path: one warm-up call each, then rounds that run every path
    still short of its repeats once, pausing between paths."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()
        time.sleep(pause_s)
    for _ in range(max(repeats.values())):
        for name, fn in paths.items():
            if len(times[name]) < repeats[name]:
                times[name].append(_time_once(fn))
                time.sleep(pause_s)
    return times


def matmul_peak_gflops(n: int = _PEAK_N, repeats: int = 5, xp=np) -> float:
    """Median fp32 GFLOP/s of an n x n x n matmul of array module xp (NumPy, or CuPy for the GPU):
    the machine's practical peak."""
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2))
    out = xp.empty((n, n), np.float32)

    def run():
        xp.matmul(a, b, out=out)
        float(out[0, 0])  # reading an element back waits for the device

    run()
    seconds = [_time_once(run) for _ in range(repeats)]
    return 2 * n ** 3 / float(np.median(seconds)) / 1e9


@njit(nogil=True, cache=True)
def _dot(a, b, out):
    np.dot(a, b, out)


def peak_gflops(n: int = 2048, repeats: int = 3) -> tuple[float, str]:
    """The fp32 matmul peak, the larger of two measurements: NumPy's n^3 matmul on BLAS's own
    threads (matmul_peak_gflops), and one n^3 one-thread GEMM per thread at once,
    the way zosoma's forward uses the cores (on a shared machine a split GEMM waits for its
    slowest thread). Returns GFLOP/s and which it was."""
    numpy_peak = matmul_peak_gflops(n, repeats)
    k = threads.n_threads()
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    outs = [np.empty((n, n), np.float32) for _ in range(k)]
    run = lambda: threads.run_items(lambda i, _: _dot(a, b, outs[i]), k)  # noqa: E731
    run()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    per_thread_peak = k * 2 * n ** 3 / float(np.median(seconds)) / 1e9
    if per_thread_peak > numpy_peak:
        return per_thread_peak, f"{k} one-thread {n}^3 GEMMs at once"
    return numpy_peak, f"numpy {n}^3 matmul"


def _torch_forward(config: ModelConfig, batch: np.ndarray, threads: int, on_gpu: bool = False):
    """torch's path for the same model shape: nn.Embedding + nn.LSTM(batch_first) + nn.Linear
    + cross_entropy under no_grad (its own random weights: speed does not depend on them); on the
    GPU, cuDNN's LSTM in fp32."""
    import torch

    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        if not torch.cuda.is_available():
            raise ImportError("torch has no CUDA device")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, config.embed).to(device)
    lstm = torch.nn.LSTM(config.embed, config.hidden, config.layers, batch_first=True).to(device)
    out = torch.nn.Linear(config.hidden, VOCAB).to(device)
    data = torch.from_numpy(batch.astype(np.int64)).to(device)
    inputs, targets = data[:, :-1], data[:, 1:].reshape(-1)

    def run():
        with torch.no_grad():
            hidden, _ = lstm(embed(inputs))
            logits = out(hidden).reshape(-1, VOCAB)
            return float(torch.nn.functional.cross_entropy(logits, targets))

    return run


def _record(name: str, config: ModelConfig, tokens: int, seconds: list[float], peak: float,
            **extra) -> dict:
    median = float(np.median(seconds))
    tokens_per_s = tokens / median
    gflops = config.flops_per_token() * tokens_per_s / 1e9
    return {"name": name, "tokens_per_s": tokens_per_s, "gflops": gflops,
            "fraction_of_peak": gflops / peak, "ratio_vs_torch": None, "repeats": len(seconds),
            "seconds": median, **extra}


def bench_forward(embed: int = 512, hidden: int = 512, layers: int = 2, batch: int = 64,
                  seq_len: int = 256, repeats: int = 5, seed: int = 0,
                  include_numpy: bool = True, ops=None, others: tuple = ()) -> list[dict]:
    """Forward + mean loss (no gradient) of one model on a (batch, seq_len + 1) byte batch:
    the NumPy reference, the engine's `population_loss` with M = 1 (default the CPU's Numba
    path), and torch's nn.LSTM, timed in interleaved rounds, plus the fp32 matmul peak measured
    in the same run. On a GPU engine: its population_loss and torch's cuDNN nn.LSTM on the GPU,
    beside the GPU's peak (no NumPy reference). `others`: more CPU engines (e.g. ONNX Runtime)
    whose population_loss is timed in the same rounds."""
    from zosoma.engines.ops import Ops
    from zosoma.model import reference

    ops = ops or Ops()
    config = ModelConfig(embed=embed, hidden=hidden, layers=layers)
    layout = Layout(config)
    theta = init_params(config, seed)
    data = np.random.default_rng([seed, 0xBE7C]).integers(0, VOCAB, (batch, seq_len + 1),
                                                          dtype=np.uint8)
    tokens = batch * seq_len
    threads = blas_threads()
    shape = f"E={embed} H={hidden} L={layers} B={batch} T={seq_len}"
    xp = ops.xp
    on_gpu = ops.on_device  # its peak, no NumPy reference
    thetas, data_e = ops.asarray(theta[None]), xp.asarray(data)
    main = (f"{ops.name} population_loss M=1",
            "cuBLAS + raw kernels" if on_gpu else f"blas={threads}, kernels serial")
    paths = {"main": lambda: ops.population_loss(thetas, layout, data_e)}
    counts = {"main": repeats}
    for other in others:
        paths[other.name] = lambda other=other: other.population_loss(theta[None], layout, data)
        counts[other.name] = repeats
    torch_name = "torch cuDNN nn.LSTM no_grad" if on_gpu else "torch nn.LSTM no_grad"
    try:
        paths["torch"] = _torch_forward(config, data, threads, on_gpu)
        counts["torch"] = repeats
        import torch
        torch_threads = "cuda" if on_gpu else f"torch={torch.get_num_threads()}"
    except ImportError as e:  # torch missing, or (on "cuda") built without CUDA
        torch_missing = "torch not installed" if isinstance(e, ModuleNotFoundError) else str(e)
    numpy_repeats = min(repeats, 2)  # minutes per run at the full-size model
    include_numpy = include_numpy and not on_gpu
    if include_numpy:
        paths["numpy"] = lambda: reference.loss(theta, layout, data)
        counts["numpy"] = numpy_repeats

    times = time_interleaved(paths, counts)
    time.sleep(_PAUSE_S)
    peak_n = _PEAK_N_CUDA if on_gpu else _PEAK_N
    if on_gpu:
        peak, peak_how = matmul_peak_gflops(peak_n, xp=xp), f"{xp.__name__} {peak_n}^3 matmul"
    else:
        peak, peak_how = peak_gflops(peak_n)

    records = [{"name": f"fp32 matmul peak ({peak_how})", "tokens_per_s": None,
                "gflops": peak, "fraction_of_peak": 1.0, "ratio_vs_torch": None, "repeats": 5,
                "threads": "cuda" if on_gpu else f"blas={threads}"}]
    if include_numpy:
        records.append(_record("numpy reference forward+loss", config, tokens, times["numpy"],
                               peak, threads=f"blas={threads}",
                               note=f"{shape}; {numpy_repeats} repeats (slow path)"))
    # The table lookup replaces layer 0's input GEMM (2*E*4H per token) by embed @ w_ih once.
    executed = (config.flops_per_token() - 8 * embed * hidden
                + 8 * VOCAB * embed * hidden / tokens) / config.flops_per_token()
    records.append(_record(main[0], config, tokens, times["main"], peak, threads=main[1],
                           note=f"{shape}; layer-0 input by table lookup: executes "
                                f"{executed:.0%} of the nominal FLOPs"))
    for other in others:
        threads_of = getattr(other, "threads", None)
        records.append(_record(f"{other.name} population_loss M=1", config, tokens, times[other.name], peak,
                               threads=f"intra-op={threads_of(layout)}" if threads_of else "-", note=shape))
    if "torch" in times:
        records.append(_record(torch_name, config, tokens, times["torch"], peak,
                               threads=torch_threads, note=shape))
        torch_rate = records[-1]["tokens_per_s"]
        for record in records:
            if record["tokens_per_s"] is not None:
                record["ratio_vs_torch"] = record["tokens_per_s"] / torch_rate
    else:
        records.append({"name": torch_name, "tokens_per_s": None, "gflops": None,
                        "fraction_of_peak": None, "ratio_vs_torch": None, "repeats": 0,
                        "note": torch_missing})
    return records


_COLUMNS = (  # (key, header, format); other keys follow in first-seen order
    ("name", "path", "{}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("gflops", "GFLOP/s", "{:.1f}"),
    ("fraction_of_peak", "of peak", "{:.0%}"),
    ("ratio_vs_torch", "vs torch", "{:.2f}x"),
    ("repeats", "repeats", "{}"),
    ("seconds", "s/run", "{:.3g}"),
    ("threads", "threads", "{}"),
)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return fmt.format(value)


def format_records(records: list[dict]) -> str:
    """An aligned plain-text table of benchmark records (numbers right-aligned, "-" for none);
    a "note" column, when any record has one, goes last."""
    known = [c for c in _COLUMNS if any(c[0] in r for r in records)]
    extra = []
    for record in records:
        for key, value in record.items():
            if (key not in {c[0] for c in _COLUMNS} and key != "note" and key not in extra
                    and not isinstance(value, (list, tuple, dict))):
                extra.append(key)
    columns = known + [(key, key, "{}") for key in extra]
    if any("note" in r for r in records):
        columns.append(("note", "note", "{}"))
    rows = [[header for _, header, _ in columns]]
    rows += [[_cell(r.get(key), fmt) for key, _, fmt in columns] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    left = {"name", "note", "threads"}

    def line(row):
        cells = [cell.ljust(w) if key in left else cell.rjust(w)
                 for cell, w, (key, _, _) in zip(row, widths, columns)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule] + [line(row) for row in rows[1:]])
