"""Reports for an equal-compute comparison: a Markdown table, a CSV with one row per run, and plots of
held-out nats/byte against forward FLOPs and against wall-clock time.

Each result is one finished run:
    {"method": "SOMA N=2 P=64", "kind": "soma", "seed": 0, "n_params": 99328, "steps": 2000,
     "flops": 1.2e13, "wall_s": 812.3, "heldout": {"code": 2.1, ..., "overall": 2.4},
     "wikitext103": 2.6 or None,
     "curve": [{"step": 0, "flops": 0.0, "wall_s": 0.0, "heldout": 5.5}, ...]}
Methods keep the order in which they first appear.
"""

import csv
from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.errors import ConfigError

NOTE = "Nats/byte are computed by the same segment protocol for every method."
MISSING = "n/a"


def _mean_std(values):
    """Mean and sample standard deviation (0 for a single value); (None, None) for no values."""
    if not values:
        return None, None
    x = np.asarray(values, dtype=float)
    return float(x.mean()), (float(x.std(ddof=1)) if len(x) >= 2 else 0.0)


def _by_method(results):
    """Runs grouped by method, methods in order of first appearance (dicts keep insertion order)."""
    groups = {}
    for run in results:
        groups.setdefault(run["method"], []).append(run)
    return groups


def _domains(runs):
    return sorted({d for run in runs for d in run["heldout"] if d != "overall"})


def summarise(results):
    """One row per method: settings, seed count, mean cost, and held-out / WikiText-103 mean and std."""
    rows = []
    for method, runs in _by_method(results).items():
        heldout_mean, heldout_std = _mean_std([r["heldout"]["overall"] for r in runs])
        # A run may lack WikiText-103 (not downloaded): average over the seeds that have it.
        wiki = [r["wikitext103"] for r in runs if r.get("wikitext103") is not None]
        wiki_mean, wiki_std = _mean_std(wiki)
        rows.append({
            "method": method, "kind": runs[0]["kind"], "n_params": runs[0]["n_params"],
            "seeds": len(runs), "steps": runs[0]["steps"],
            "flops": float(np.mean([r["flops"] for r in runs])),
            "wall_s": float(np.mean([r["wall_s"] for r in runs])),
            "heldout_mean": heldout_mean, "heldout_std": heldout_std,
            "wikitext_mean": wiki_mean, "wikitext_std": wiki_std, "wikitext_seeds": len(wiki),
            "domains": {d: _mean_std([r["heldout"][d] for r in runs if d in r["heldout"]])[0]
                        for d in _domains(runs)},
        })
    return rows


def _flops(x):
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"  # 1.20e13 rather than 1.20e+13


def _nats(x):
    return MISSING if x is None else f"{x:.3f}"


def _pm(mean, std):
    return MISSING if mean is None else f"{mean:.3f} ± {std:.3f}"


def _table(header, rows):
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in lines)


def markdown_table(rows):
    """The method table of summarise(): cost, held-out and WikiText-103 mean ± std, per-domain means."""
    domains = sorted({d for row in rows for d in row["domains"]})
    header = ["method", "params", "seeds", "steps", "forward FLOPs", "wall s",
              "held-out nats/byte (mean ± std)", "WikiText-103 nats/byte (mean ± std)", *domains]
    body = [[row["method"], row["n_params"], row["seeds"], row["steps"], _flops(row["flops"]),
             f"{row['wall_s']:.0f}", _pm(row["heldout_mean"], row["heldout_std"]), _wikitext(row),
             *(_nats(row["domains"].get(d)) for d in domains)] for row in rows]
    return _table(header, body)


def _wikitext(row):
    """WikiText-103 mean ± std, saying so when it covers fewer seeds than the held-out column."""
    cell = _pm(row["wikitext_mean"], row["wikitext_std"])
    if 0 < row["wikitext_seeds"] < row["seeds"]:
        cell += f" ({row['wikitext_seeds']} of {row['seeds']} seeds)"
    return cell


def write_csv(results, path):
    """One row per run; an empty cell where a run has no WikiText-103 or lacks a domain."""
    domains = _domains(results)
    fields = ["method", "kind", "seed", "n_params", "steps", "flops", "wall_s", "heldout_overall", "wikitext103",
              *(f"heldout_{d}" for d in domains)]

    with atomic_path(path, "report") as tmp:
        with open(tmp, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=fields)
            out.writeheader()
            for run in results:
                row = {k: run[k] for k in fields[:7]}
                row["heldout_overall"] = run["heldout"]["overall"]
                row["wikitext103"] = run.get("wikitext103")
                row.update({f"heldout_{d}": run["heldout"].get(d) for d in domains})
                out.writerow(row)


def _mean_curve(runs):
    """Per method: x (mean FLOPs, mean wall s) and y (mean, min, max held-out) over seeds at each step.

    Seeds normally log the same steps; if not, only the steps every seed has are used (None if there are none)."""
    by_step = [{p["step"]: p for p in run["curve"]} for run in runs]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    if not steps:
        return None

    def column(key):  # shape (steps, seeds)
        return np.array([[s[step][key] for s in by_step] for step in steps], dtype=float)

    y = column("heldout")
    return column("flops").mean(1), column("wall_s").mean(1), y.mean(1), y.min(1), y.max(1)


def plot_curves(results, path_flops, path_wall, title=None):
    """Two PNGs: held-out nats/byte against forward FLOPs (log x) and against wall-clock seconds.

    One line per method (mean over seeds) with a band from the best to the worst seed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ConfigError("plots need matplotlib: pip install 'zosoma[plots]'") from err

    curves = {method: _mean_curve(runs) for method, runs in _by_method(results).items()}
    curves = {method: curve for method, curve in curves.items() if curve is not None}
    axes = ((path_flops, "forward FLOPs", True),
            (path_wall, "training seconds (summed over a run's experts)", False))
    for path, xlabel, log_x in axes:
        # Figure + Agg canvas directly, not pyplot: no global state, no display backend needed.
        fig = Figure(figsize=(7, 4.5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for method, (flops, wall, mean, lo, hi) in curves.items():
            x = flops if log_x else wall
            keep = x > 0 if log_x else np.ones_like(x, bool)  # step 0 has 0 FLOPs: no place on a log axis
            (line,) = ax.plot(x[keep], mean[keep], label=method)
            ax.fill_between(x[keep], lo[keep], hi[keep], color=line.get_color(), alpha=0.2, linewidth=0)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out nats/byte")
        if title:
            ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if curves:
            ax.legend()
        fig.tight_layout()
        with atomic_path(path, "plot") as tmp:
            fig.savefig(tmp, format="png")


def ablation_summary(pairs):
    """Independent minus summed experts, per seed and over seeds (negative: independent is better).

    pairs: [{"seed": s, "independent": {"heldout": x, "wikitext103": y}, "summed": {...}}, ...].
    Returns {"heldout": ..., "wikitext103": ...}, each with per_seed rows and mean, std, min, max of the
    difference; a seed where either value is None is left out of that metric, a metric with no seeds is None."""
    summary = {}
    for metric in ("heldout", "wikitext103"):
        per_seed = [{"seed": p["seed"], "independent": p["independent"][metric], "summed": p["summed"][metric],
                     "diff": p["independent"][metric] - p["summed"][metric]}
                    for p in pairs
                    if p["independent"].get(metric) is not None and p["summed"].get(metric) is not None]
        diffs = [r["diff"] for r in per_seed]
        mean, std = _mean_std(diffs)
        summary[metric] = None if not per_seed else {
            "per_seed": per_seed, "mean": mean, "std": std, "min": min(diffs), "max": max(diffs)}
    return summary


def ablation_markdown(summary):
    """Seed rows (independent, summed, difference for each metric), then a mean ± std row."""
    metrics = [(m, label) for m, label in (("heldout", "held-out"), ("wikitext103", "WikiText-103"))
               if summary.get(m)]
    header = ["seed", *(f"{label} {col}" for _, label in metrics for col in ("independent", "summed", "diff"))]
    by_seed = {m: {r["seed"]: r for r in summary[m]["per_seed"]} for m, _ in metrics}
    seeds = list(dict.fromkeys(seed for m, _ in metrics for seed in by_seed[m]))
    body = [[seed, *(_nats(by_seed[m].get(seed, {}).get(col)) for m, _ in metrics
                     for col in ("independent", "summed", "diff"))] for seed in seeds]
    body.append(["mean ± std", *(_pm(*_mean_std([r[col] for r in summary[m]["per_seed"]]))
                                 for m, _ in metrics for col in ("independent", "summed", "diff"))])
    return _table(header, body)


def write_report(results, ablation_pairs, out_dir, title):
    """results.md, results.csv, nats_vs_flops.png and nats_vs_wall.png in out_dir; returns their paths."""
    if not results:
        raise ConfigError("no finished runs to report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("results.md", "results.csv", "nats_vs_flops.png", "nats_vs_wall.png")}
    text = f"# {title}\n\n{NOTE}\n\n{markdown_table(summarise(results))}\n"
    if ablation_pairs:
        text += ("\n## Ablation: independent minus summed experts (negative: independent is better)\n\n"
                 f"{ablation_markdown(ablation_summary(ablation_pairs))}\n")
    atomic_write(paths["results.md"], text, "report")
    write_csv(results, paths["results.csv"])
    plot_curves(results, paths["nats_vs_flops.png"], paths["nats_vs_wall.png"], title=title)
    return paths
