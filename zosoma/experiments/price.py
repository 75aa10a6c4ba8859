"""The price of zero-order: the CPU-seconds each method of a comparison needs to reach a ladder of
held-out levels, and their ratio to backprop's (the comparison's backprop methods:
zosoma.experiments.backprop), as a table (its plot, price.png: zosoma.experiments.report.plot_price).

A comparison whose config names `price_levels` gets them in its report (zosoma.experiments.report):
the levels given and the byte trigram's and 4-gram's levels (zosoma.yardsticks, measured on the
curve's texts: the first curve_bytes of each held-out file), each read off every run's
held-out curve against its training CPU-seconds (zosoma.experiments.compare records them: process CPU time while training, evaluation left out), linearly interpolated
between the two curve points around the first crossing. A method's figure is the mean over its
seeds when every seed reached the level, else "not reached"; its ratio is to the fastest backprop
method that reached it. On a GPU (`zosoma compare price --device cuda`) the same table is in
GPU-seconds: every run's training wall time on the device, backprop's on the same GPU through
PyTorch's cuDNN LSTM (zosoma.experiments.backprop).
"""

from __future__ import annotations

import os
import platform

import numpy as np

YARDSTICK_LEVELS = ("witten-bell-3", "kneser-ney-4")  # the n-gram levels the ladder starts from
CURVE_ORDERS = (4,)  # the Kneser-Ney order measured on the curve's texts
NOT_REACHED = "not reached"


def time_to(curve: list[dict], level: float) -> float | None:
    """The CPU-seconds at which a curve (points with cpu_s and heldout, in step order) first
    reaches `level`, interpolated between the points around the crossing; None if it never does."""
    for before, after in zip([None, *curve], curve):
        if after["heldout"] <= level:
            if before is None:
                return after["cpu_s"]
            frac = (before["heldout"] - level) / (before["heldout"] - after["heldout"])
            return before["cpu_s"] + frac * (after["cpu_s"] - before["cpu_s"])
    return None


def ladder(levels, yardsticks=None) -> list[tuple[float, str]]:
    """(level, label) pairs, highest (easiest) first: the levels given, and the n-gram levels of
    `yardsticks` (zosoma.yardsticks.Yardsticks on the curve's texts) where given."""
    from zosoma.yardsticks import label

    out = [(float(x), "") for x in levels]
    if yardsticks is not None:
        out += [(yardsticks.overall(k), label(k)) for k in YARDSTICK_LEVELS if k in yardsticks.nats]
    return sorted(out, key=lambda p: -p[0])


def price(results: list[dict], levels: list[tuple[float, str]]) -> list[dict]:
    """One row per level: {"level", "label", "cpu_s": {method: mean seconds or None},
    "ratio": {method: seconds / the fastest backprop's, or None}} (methods in order of appearance)."""
    by_method: dict[str, list[dict]] = {}
    for r in results:
        by_method.setdefault(r["method"], []).append(r)
    backprop = {m for m, runs in by_method.items() if runs[0]["kind"] == "backprop"}
    rows = []
    for level, name in levels:
        cpu = {}
        for m, runs in by_method.items():
            times = [time_to(sorted(r["curve"], key=lambda p: p["step"]), level) for r in runs]
            cpu[m] = None if any(t is None for t in times) else float(np.mean(times))
        base = min((cpu[m] for m in backprop if cpu[m] is not None), default=None)
        ratio = {m: (t / base if t is not None and base else None) for m, t in cpu.items()}
        rows.append({"level": level, "label": name, "cpu_s": cpu, "ratio": ratio})
    return rows


def machine() -> str:
    """The CPU model and the OpenBLAS kernels NumPy uses, as the results name their machine."""
    from threadpoolctl import threadpool_info

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = [f"{p.get('internal_api')} {p.get('architecture')}" for p in threadpool_info() if p.get("user_api") == "blas"]
    return f"{os.cpu_count()} x {model}; NumPy's BLAS: {', '.join(dict.fromkeys(blas)) or 'unknown'}"


def _seconds(t: float | None, ratio: float | None) -> str:
    if t is None:
        return NOT_REACHED
    cell = f"{t:.3g} s" if t < 1000 else f"{t:,.0f} s"
    return cell + (f" (x{ratio:,.3g})" if ratio is not None else "")


def price_markdown(rows: list[dict], results: list[dict]) -> str:
    """The table: a row per level, a column per method (its seeds in the header)."""
    seeds: dict[str, list] = {}
    for r in results:
        seeds.setdefault(r["method"], []).append(r["seed"])
    methods = list(seeds)
    header = ["held-out nats/byte", *(f"{m} ({len(s)} seed{'s' * (len(s) > 1)})" for m, s in seeds.items())]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        level = f"{row['level']:.3f}" + (f" ({row['label']})" if row["label"] else "")
        lines.append("| " + " | ".join([level, *(_seconds(row["cpu_s"][m], row["ratio"][m]) for m in methods)]) + " |")
    return "\n".join(lines)


def price_section(results: list[dict], levels, yardsticks=None) -> str:
    """The report's section: what is measured, where, and the table (`yardsticks`: on the curve's texts).
    Runs of `zosoma compare --device cuda` (a "clock" field: the device's seconds) are priced in GPU-seconds, the rest in CPU-seconds."""
    rows = price(results, ladder(levels, yardsticks))
    torch = any(r["kind"] == "backprop" for r in results)
    gpu = any("clock" in r for r in results)
    unit = "GPU" if gpu else "CPU"
    if gpu:
        clock = ("GPU-seconds: the run's wall time while training on the GPU, one run at a time (--jobs 1), "
                 "evaluation left out")
        where = "; backprop runs PyTorch on the same GPU (cuDNN)" if torch else ""
    else:
        clock = "CPU-seconds: the run's process CPU time while training (every thread's; evaluation left out)"
        where = "; backprop runs PyTorch on one thread (torch.set_num_threads(1))" if torch else ""
    return (f"## The price of zero-order: training {unit}-seconds to reach each held-out level (x: the ratio to the "
            "fastest backprop method)\n\n"
            f"{price_markdown(rows, results)}\n\n"
            "Held-out nats/byte here are the curve's: the first curve_bytes of each held-out file, where the n-gram "
            "levels are measured too (zosoma.yardsticks); the method table above scores the whole held-out split. "
            f"{clock}, read off its "
            "held-out curve (the first crossing, linearly interpolated between curve points), mean over the seeds when "
            "every seed reached the level. Backprop's FLOPs count its backward pass at 2x the forward"
            + where + ".\n")
