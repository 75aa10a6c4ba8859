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
import textwrap
from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.errors import ConfigError
from zosoma.experiments.price import YARDSTICK_LEVELS, machine, price_section

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


def lost(run: dict) -> bool:
    """A run that did not train: its guard stopped it, or every one of its models was dropped
    after its restarts (a single model's drop ends its run on the weights that ran away)."""
    return bool(run.get("divergence")) or len(run.get("dropped") or ()) >= run.get("experts", 1)


def over_budget(run: dict, budget) -> bool:
    """The run spent more forward FLOPs than the comparison's budget (the steps a restart re-ran
    count: runs of zosoma before they did could)."""
    return budget is not None and run["flops"] > budget


def _domains(runs):
    return sorted({d for run in runs for d in run["heldout"] if d != "overall"})


def summarise(results, budget=None):
    """One row per method: settings, seed count, mean cost (and with the comparison's forward-FLOP
    `budget`, how many runs spent more), and held-out / WikiText-103 mean and std."""
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
            "over_budget": sum(over_budget(r, budget) for r in runs),
            "wall_s": float(np.mean([r["wall_s"] for r in runs])),
            "heldout_mean": heldout_mean, "heldout_std": heldout_std,
            "wikitext_mean": wiki_mean, "wikitext_std": wiki_std, "wikitext_seeds": len(wiki),
            "domains": {d: _mean_std([r["heldout"][d] for r in runs if d in r["heldout"]])[0]
                        for d in _domains(runs)},
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in runs),
            "diverged": sum(lost(r) for r in runs),
            "restarts": sum(len(r.get("restarts") or ()) for r in runs),
            "dropped": sum(len(r.get("dropped") or ()) for r in runs),
            "final_train_loss": _mean_std([r["final_train_loss"] for r in runs
                                           if r.get("final_train_loss") is not None])[0],
        })
    at, by_method = equal_wall_clock(results)
    for row in rows:
        row["equal_wall_s"], row["heldout_at_equal_wall"] = at, by_method.get(row["method"])
    return rows


def equal_wall_clock(results):
    """The second view of equal compute: each method's held-out nats/byte (mean over seeds) at the
    same training seconds, the shortest of the methods' mean final wall times, read off each run's
    curve by linear interpolation in wall time. Returns (seconds, {method: nats/byte}); (None, {})
    when no run has a curve."""
    groups = {m: [r for r in runs if len(r.get("curve", [])) > 1] for m, runs in _by_method(results).items()}
    groups = {m: runs for m, runs in groups.items() if runs}
    if not groups:
        return None, {}
    at = min(np.mean([r["curve"][-1]["wall_s"] for r in runs]) for runs in groups.values())
    value = {}
    for m, runs in groups.items():
        value[m] = float(np.mean([np.interp(at, [p["wall_s"] for p in r["curve"]], [p["heldout"] for p in r["curve"]])
                                  for r in runs]))
    return float(at), value


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
    at = rows[0].get("equal_wall_s") if rows else None
    header = ["method", "params", "seeds", "steps", "forward FLOPs spent", "wall s",
              "held-out nats/byte (mean ± std)", "WikiText-103 nats/byte (mean ± std)",
              f"held-out at {at:.0f} s" if at else "held-out at equal seconds", "final train loss",
              "skipped steps", "diverged seeds", "restarts (experts dropped)", *domains]
    body = [[row["method"], f"{row['n_params']:,}", row["seeds"], f"{row['steps']:,}", _spent(row),
             f"{row['wall_s']:.0f}", _pm(row["heldout_mean"], row["heldout_std"]), _wikitext(row),
             _nats(row.get("heldout_at_equal_wall")), _nats(row.get("final_train_loss")),
             row.get("skipped_steps", 0), row.get("diverged", 0),
             f"{row.get('restarts', 0)} ({row.get('dropped', 0)})",
             *(_nats(row["domains"].get(d)) for d in domains)] for row in rows]
    return _table(header, body)


def _spent(row):
    """Mean forward FLOPs spent, marked where a run spent more than the budget."""
    cell = _flops(row["flops"])
    if row.get("over_budget"):
        cell += f" (**over budget**: {row['over_budget']} of {row['seeds']} seeds)"
    return cell


def _wikitext(row):
    """WikiText-103 mean ± std, saying so when it covers fewer seeds than the held-out column."""
    cell = _pm(row["wikitext_mean"], row["wikitext_std"])
    if 0 < row["wikitext_seeds"] < row["seeds"]:
        cell += f" ({row['wikitext_seeds']} of {row['seeds']} seeds)"
    return cell


def write_csv(results, path, budget=None):
    """One row per run; an empty cell where a run has no WikiText-103 or lacks a domain, or there
    is no budget to hold its spend to."""
    domains = _domains(results)
    fields = ["method", "kind", "seed", "n_params", "steps", "flops", "wall_s", "heldout_overall", "wikitext103",
              "final_train_loss", "skipped_steps", "divergence", "restarts", "dropped", "flops_budget", "over_budget",
              *(f"heldout_{d}" for d in domains)]

    with atomic_path(path, "report") as tmp:
        with open(tmp, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=fields)
            out.writeheader()
            for run in results:
                row = {k: run[k] for k in fields[:7]}
                row["heldout_overall"] = run["heldout"]["overall"]
                row["wikitext103"] = run.get("wikitext103")
                row["final_train_loss"] = run.get("final_train_loss")
                row["skipped_steps"] = run.get("skipped_steps", 0)
                row["divergence"] = "; ".join(f"expert {v['expert']} step {v['step']}: {v['verdict']}"
                                              for v in run.get("divergence") or [])
                row["restarts"] = "; ".join(f"expert {v['expert']} step {v['step']} to {v['to']}, lr x{v['lr_scale']:g}"
                                            for v in run.get("restarts") or [])
                row["dropped"] = "; ".join(f"expert {v['expert']} step {v['step']}" for v in run.get("dropped") or [])
                row["flops_budget"] = budget
                row["over_budget"] = over_budget(run, budget) if budget is not None else None
                row.update({f"heldout_{d}": run["heldout"].get(d) for d in domains})
                out.writerow(row)


def _mean_curve(runs, *xs):
    """Per method: x (mean of each key of xs over seeds; default FLOPs and wall s) and y (mean,
    min, max held-out) over seeds at each step.

    Seeds normally log the same steps; if not, only the steps every seed has are used (None if there are none)."""
    by_step = [{p["step"]: p for p in run["curve"]} for run in runs]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    if not steps:
        return None

    def column(key):  # shape (steps, seeds)
        return np.array([[s[step][key] for s in by_step] for step in steps], dtype=float)

    y = column("heldout")
    return (*(column(x).mean(1) for x in xs or ("flops", "wall_s")), y.mean(1), y.min(1), y.max(1))


PLOTS_NEED = "plots need matplotlib: pip install 'zosoma[plots]'"


class NoPlots(ConfigError):
    """matplotlib is not installed (it is the plots extra)."""


def _matplotlib():
    """(Figure, FigureCanvasAgg): a figure drawn with no global state and no display backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise NoPlots(PLOTS_NEED) from err
    return Figure, FigureCanvasAgg


def plot_price(results: list[dict], path, yardsticks=None, title: str | None = None) -> dict:
    """price.png: held-out nats/byte (the curve's texts) against training CPU-seconds (GPU-seconds for a
    device comparison; log x), one line per method (the mean over seeds at each curve step) with a
    band from the best to the worst seed, and the n-gram levels of `yardsticks` (on the same texts)
    as horizontal lines. Returns {label: (x, y)} of what was drawn."""
    from zosoma.yardsticks import label

    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for method, runs in _by_method(results).items():
        curve = _mean_curve(runs, "cpu_s")
        if curve is None:
            continue
        cpu, mean, lo, hi = curve
        keep = np.arange(cpu.size) > 0  # step 0, untrained: no place on a log axis
        (line,) = ax.plot(cpu[keep], mean[keep], marker=".", label=method)
        ax.fill_between(cpu[keep], lo[keep], hi[keep], color=line.get_color(), alpha=0.2, linewidth=0)
    for k, style in zip(YARDSTICK_LEVELS, ("--", ":")):
        if yardsticks is not None and k in yardsticks.nats:
            ax.axhline(yardsticks.overall(k), color="gray", linestyle=style, linewidth=1.2,
                       label=f"{label(k)}, {yardsticks.overall(k):.3f} (yardstick)")
    ax.set_xscale("log")
    gpu = any("clock" in r for r in results)  # zosoma compare --device cuda: the device's seconds
    ax.set_xlabel("training GPU-seconds (wall time on the device, one run at a time)" if gpu else
                  "training CPU-seconds (process CPU time, summed over a run's experts)")
    ax.set_ylabel("held-out nats/byte (the curve's texts)")
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, "plot") as tmp:
        fig.savefig(tmp, format="png")
    return {line.get_label(): (np.asarray(line.get_xdata()), np.asarray(line.get_ydata())) for line in ax.get_lines()}


def plot_curves(results, path_flops, path_wall, title=None):
    """Two PNGs: held-out nats/byte against forward FLOPs (log x) and against wall-clock seconds.

    One line per method (mean over seeds) with a band from the best to the worst seed. Returns
    what was drawn: {path: {method: (x, y) of its line}}, read back from the figure."""
    Figure, FigureCanvasAgg = _matplotlib()
    curves = {method: _mean_curve(runs) for method, runs in _by_method(results).items()}
    curves = {method: curve for method, curve in curves.items() if curve is not None}
    axes = ((path_flops, "forward FLOPs", True),
            (path_wall, "training seconds (summed over a run's experts)", False))
    drawn = {}
    for path, xlabel, log_x in axes:
        # Figure + Agg canvas directly, not pyplot: no global state, no display backend needed.
        fig = Figure(figsize=(7, 4.5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        positive = False
        for method, (flops, wall, mean, lo, hi) in curves.items():
            x = flops if log_x else wall
            keep = x > 0 if log_x else np.ones_like(x, bool)  # step 0 has 0 FLOPs: no place on a log axis
            positive |= bool(keep.any())
            (line,) = ax.plot(x[keep], mean[keep], label=method)
            ax.fill_between(x[keep], lo[keep], hi[keep], color=line.get_color(), alpha=0.2, linewidth=0)
        if log_x and positive:  # every run stopped by its guard before its first point past step 0: no log axis
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
        drawn[str(path)] = {line.get_label(): (np.asarray(line.get_xdata()), np.asarray(line.get_ydata()))
                            for line in ax.get_lines()}
    return drawn


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


def tuning_markdown(rows):
    """The tuning sweep: every method at every setting, its validation nats/byte, the choice."""
    header = ["method", "setting", "lr", "sigma / eps", "validation nats/byte", "final train loss", "diverged", "chosen"]
    body = [[r["method"], r["setting"], f"{r['lr']:.4g}", f"{r['eps']:.4g}", _nats(r["validation"]),
             _nats(r.get("final_train_loss")), "yes" if r["diverged"] else "", "**yes**" if r["chosen"] else ""]
            for r in rows]
    return _table(header, body)


def n_curve(results):
    """SOMA's curve in N: per series and N, held-out nats/byte (mean ± std) at each evaluated
    top-k, over every seed (a diverged run counts, as the protocol says) and over the seeds that
    did not diverge. Rows: {"series", "N", "n_params", "seeds", "diverged", "k": {k: (mean, std)},
    "k_trained": {k: (mean, std) or (None, None)}}."""
    groups: dict = {}
    for r in results:
        for series in r.get("series") or ():
            groups.setdefault((series, r["experts"]), []).append(r)
    rows = []
    for (series, N), runs in sorted(groups.items()):
        ks = sorted({int(k) for r in runs for k in r.get("heldout_by_k", {})})
        trained = [r for r in runs if not lost(r)]
        rows.append({"series": series, "N": N, "n_params": runs[0]["n_params"], "seeds": len(runs),
                     "diverged": len(runs) - len(trained),
                     "restarts": sum(len(r.get("restarts") or ()) for r in runs),
                     "dropped": sum(len(r.get("dropped") or ()) for r in runs),
                     "wikitext": _mean_std([r["wikitext103"] for r in trained if r.get("wikitext103") is not None]),
                     "k": {k: _mean_std([r["heldout_by_k"][str(k)] for r in runs]) for k in ks},
                     "k_trained": {k: _mean_std([r["heldout_by_k"][str(k)] for r in trained]) for k in ks}})
    return rows


def n_curve_markdown(rows):
    ks = sorted({k for row in rows for k in row["k"]})
    header = ["series", "N", "params in all", "seeds", "diverged", "restarts (experts dropped)",
              *(f"top-{k} held-out" for k in ks), *(f"top-{k}, seeds that did not diverge" for k in ks),
              "WikiText-103 (routed), seeds that did not diverge"]
    body = [[r["series"], r["N"], f"{r['n_params']:,}", r["seeds"], r["diverged"],
             f"{r.get('restarts', 0)} ({r.get('dropped', 0)})",
             *(_pm(*r["k"][k]) if k in r["k"] else MISSING for k in ks),
             *(_pm(*r["k_trained"][k]) if k in r["k_trained"] else MISSING for k in ks),
             _pm(*r["wikitext"]) if r.get("wikitext") and r["wikitext"][0] is not None else MISSING] for r in rows]
    return _table(header, body)


def plot_n_curve(rows, path, title=None):
    """Held-out nats/byte against N (log2 x), one line per series and top-k, each point the mean
    over the seeds that did not diverge, annotated where some did. Returns what was drawn:
    {label: (x, y)}, read back from the figure."""
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for series in dict.fromkeys(r["series"] for r in rows):
        mine = [r for r in rows if r["series"] == series]
        for k in sorted({k for r in mine for k in r["k"]}):
            pts = [(r["N"], r["k_trained"][k][0]) for r in mine if k in r["k"] and r["k_trained"][k][0] is not None]
            ax.plot([n for n, _ in pts], [y for _, y in pts], marker="o", label=f"{series}, top-{k}")
        for r in mine:
            if 0 < r["diverged"] < r["seeds"]:  # above its highest point, ending there (the last N is at the edge)
                y = max(m for m, _ in r["k_trained"].values())
                ax.annotate(f"{r['diverged']}/{r['seeds']} seeds diverged", (r["N"], y), textcoords="offset points",
                            xytext=(-2, 8), ha="right", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("experts N")
    ax.set_ylabel("held-out nats/byte (seeds that did not diverge)")
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 60)), fontsize=10)  # long titles wrap, not clip
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, "plot") as tmp:
        fig.savefig(tmp, format="png")
    return {line.get_label(): (np.asarray(line.get_xdata()), np.asarray(line.get_ydata())) for line in ax.get_lines()}


def yardsticks_markdown(yardsticks):
    """The yardsticks beside the method table (zosoma.yardsticks.lookup's {"heldout": Yardsticks,
    "wikitext103": ...}): a row per yardstick, its held-out, WikiText-103 and per-domain nats/byte."""
    from zosoma.yardsticks import label

    held, wiki = yardsticks["heldout"], yardsticks.get("wikitext103")
    domains = sorted(d for d in held.nats["witten-bell-3"] if d != "overall")
    header = ["yardstick", "held-out nats/byte", "WikiText-103 nats/byte", *domains]
    body = [[label(k), _nats(held.overall(k)), _nats(wiki and wiki.overall(k)), *(_nats(v[d]) for d in domains)]
            for k, v in held.nats.items()]
    return _table(header, body)


def write_report(results, ablation_pairs, out_dir, title, tuning=None, budget=None, yardsticks=None,
                 price=None):
    """results.md, results.csv, nats_vs_flops.png and nats_vs_wall.png in out_dir (and
    n_curve.png when runs belong to series); returns their paths, a plot's None where matplotlib
    is missing (the tables come first: hours of runs are never lost to a missing plot library).
    `budget`: the forward FLOPs every run may spend, beside which the table puts each method's.
    With yardsticks (zosoma.yardsticks.lookup's, on the same held-out texts), their table follows
    the method table. With price, (levels, the yardsticks on the curve's texts), the price of
    zero-order (zosoma.experiments.price) at those levels and price.png."""
    if not results:
        raise ConfigError("no finished runs to report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("results.md", "results.csv", "nats_vs_flops.png", "nats_vs_wall.png")}
    rows = summarise(results, budget)
    text = f"# {title}\n\n{NOTE}\n\n{markdown_table(rows)}\n"
    if price:  # CPU-seconds are the machine's: name it
        text = f"# {title}\n\nMachine: {machine()}.\n\n{NOTE}\n\n{markdown_table(rows)}\n"
    at, _ = equal_wall_clock(results)
    views = []
    if budget is not None:
        views.append(f"every run has the same forward-FLOP budget, {_flops(budget)}, and the steps a restart re-runs "
                     "count against it (a model that restarted stops at a lower step; the forward FLOPs spent "
                     "column is the mean over seeds, marked where a run spent more)")
    if at:
        views.append(f"the held-out at {at:.0f} s column reads each run's curve at the same training seconds (the "
                     "shortest method's mean), summed over a run's experts")
    if views:
        text += f"\nEqual compute{', two views' if len(views) == 2 else ''}: {'; '.join(views)}.\n"
    if price:
        text += "\n" + price_section(results, *price)
        paths["price.png"] = out_dir / "price.png"
    if yardsticks and "heldout" in yardsticks:
        text += ("\n## Yardsticks: byte n-grams counted on the train split and compressors, on the same bytes and "
                 f"segments (zosoma data yardsticks)\n\n{yardsticks_markdown(yardsticks)}\n")
    if tuning:
        text += ("\n## Tuning: each swept method at every setting, seed 0, full budget, scored on validation "
                 f"(a diverged run loses)\n\n{tuning_markdown(tuning)}\n")
    curve = n_curve(results)
    if curve:
        text += f"\n## SOMA's curve in N (held-out nats/byte, routed top-k)\n\n{n_curve_markdown(curve)}\n"
        paths["n_curve.png"] = out_dir / "n_curve.png"
    if ablation_pairs:
        text += ("\n## Ablation: independent minus summed experts (negative: independent is better)\n\n"
                 f"{ablation_markdown(ablation_summary(ablation_pairs))}\n")
    atomic_write(paths["results.md"], text, "report")
    write_csv(results, paths["results.csv"], budget)
    try:
        if curve:
            plot_n_curve(curve, paths["n_curve.png"], title=title)
        plot_curves(results, paths["nats_vs_flops.png"], paths["nats_vs_wall.png"], title=title)
        if price:
            plot_price(results, paths["price.png"], price[1], title=title)
    except NoPlots:
        paths.update({name: None for name in paths if name.endswith(".png")})
    return paths
