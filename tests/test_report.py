"""zosoma.experiments.report on synthetic results: summary statistics, the Markdown table, the CSV, the plots, the ablation."""

import csv
import sys

import numpy as np
import pytest

from zosoma.errors import ConfigError
from zosoma.experiments.report import (ablation_markdown, ablation_summary, equal_wall_clock, lost, markdown_table,
                                       n_curve, n_curve_markdown, plot_curves, plot_n_curve, summarise,
                                       tuning_markdown, write_csv, write_report)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOMAINS = ("code", "legal", "prose")


def make_run(method, kind, seed, rng, wikitext=True, steps=(0, 250, 500)):
    heldout = {d: float(rng.uniform(2, 3)) for d in DOMAINS}
    heldout["overall"] = float(np.mean(list(heldout.values())))
    return {
        "method": method, "kind": kind, "seed": seed, "n_params": 99328, "steps": steps[-1],
        "flops": 1.2e13 + seed * 1e11, "wall_s": 800.0 + 10 * seed, "heldout": heldout,
        "wikitext103": float(rng.uniform(2, 3)) if wikitext else None,
        "curve": [{"step": s, "flops": s * 2.4e10, "wall_s": s * 1.6 + seed, "heldout": 5.5 - s / 250 + seed * 0.1}
                  for s in steps],
    }


@pytest.fixture
def results():
    rng = np.random.default_rng(0)
    # Interleaved seeds check the order of first appearance; SPSA seed 2 has no WikiText-103.
    return [make_run(method, kind, seed, rng, wikitext=not (kind == "spsa" and seed == 2))
            for seed in range(3) for method, kind in (("SOMA N=2 P=64", "soma"), ("SPSA P=128", "spsa"))]


def test_summary_matches_numpy(results):
    rows = summarise(results)
    assert [r["method"] for r in rows] == ["SOMA N=2 P=64", "SPSA P=128"]
    for row in rows:
        runs = [r for r in results if r["method"] == row["method"]]
        overall = [r["heldout"]["overall"] for r in runs]
        wiki = [r["wikitext103"] for r in runs if r["wikitext103"] is not None]
        assert row["seeds"] == 3
        assert row["heldout_mean"] == pytest.approx(np.mean(overall))
        assert row["heldout_std"] == pytest.approx(np.std(overall, ddof=1))
        assert row["wikitext_mean"] == pytest.approx(np.mean(wiki))
        assert row["wikitext_std"] == pytest.approx(np.std(wiki, ddof=1))
        assert row["flops"] == pytest.approx(np.mean([r["flops"] for r in runs]))
        assert list(row["domains"]) == sorted(DOMAINS)
        assert row["domains"]["code"] == pytest.approx(np.mean([r["heldout"]["code"] for r in runs]))


def test_a_run_whose_models_were_all_dropped_counts_as_diverged():
    # cpu-robust's SPSA P=1024 seed 2: three restarts, then its one model dropped; the table said
    # "diverged seeds 0" beside a held-out mean of 8.4.
    rng = np.random.default_rng(2)
    single, soma_one_dropped, soma_all_dropped, stopped = (make_run(m, k, 0, rng) for m, k in
        (("SPSA", "spsa"), ("SOMA", "soma"), ("SOMA all", "soma"), ("SPSA stopped", "spsa")))
    single.update(experts=1, dropped=[{"expert": 0, "step": 70, "verdict": "rising"}])
    soma_one_dropped.update(experts=2, dropped=[{"expert": 1, "step": 9, "verdict": "rising"}])
    soma_all_dropped.update(experts=2, dropped=[{"expert": e, "step": 9, "verdict": "rising"} for e in (0, 1)])
    stopped.update(experts=1, divergence=[{"expert": 0, "step": 5, "verdict": "non-finite"}])
    assert [lost(r) for r in (single, soma_one_dropped, soma_all_dropped, stopped)] == [True, False, True, True]
    assert [row["diverged"] for row in summarise([single, soma_one_dropped, soma_all_dropped, stopped])] == [1, 0, 1, 1]


def test_single_seed_and_no_wikitext():
    rng = np.random.default_rng(1)
    row, = summarise([make_run("EGGROLL", "eggroll", 0, rng, wikitext=False)])
    assert row["heldout_std"] == 0.0
    assert row["wikitext_mean"] is None and row["wikitext_std"] is None
    assert "n/a" in markdown_table([row])


def test_markdown_table(results):
    rows = summarise(results)
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| method | params | seeds | steps | forward FLOPs spent | wall s |")
    assert lines[0].rstrip(" |").endswith("| code | legal | prose")
    soma = lines[2]
    r = rows[0]
    assert soma.startswith("| SOMA N=2 P=64 | 99,328 | 3 | 500 | 1.21e13 | 810 |")
    assert f"{r['heldout_mean']:.3f} ± {r['heldout_std']:.3f}" in soma
    assert f"{r['wikitext_mean']:.3f} ± {r['wikitext_std']:.3f}" in soma
    assert lines[3].startswith("| SPSA P=128 |")
    assert "(2 of 3 seeds)" in lines[3] and "of 3 seeds" not in soma


def test_a_run_over_the_budget_is_marked(results, tmp_path):
    """Issue 33: cpu-robust's P=1024 spent 1.76e13 (seeds 0 and 1: 1.94e13, their restarts' steps)
    under a table that said every run had the 1.5e13 budget. The spend is beside the budget, and
    a method with a run over it is marked in the table and the CSV."""
    budget = 1.2149e13  # every synthetic run spends 1.2e13 + seed x 1e11: seed 2 is over
    rows = summarise(results, budget)
    assert [r["over_budget"] for r in rows] == [1, 1]
    table = markdown_table(rows)
    assert "| 1.21e13 (**over budget**: 1 of 3 seeds) |" in table
    assert "over budget" not in markdown_table(summarise(results, 1.3e13))
    assert "over budget" not in markdown_table(summarise(results))  # no budget: nothing to hold it to
    paths = write_report(results, [], tmp_path, "t", budget=budget)
    text = paths["results.md"].read_text()
    assert "the same forward-FLOP budget, 1.21e13, and the steps a restart re-runs count against it" in text
    rows = list(csv.DictReader(paths["results.csv"].open()))
    assert [(int(r["seed"]), r["over_budget"]) for r in rows] == [(s, str(s == 2)) for s in range(3) for _ in range(2)]
    assert {float(r["flops_budget"]) for r in rows} == {budget}


def test_equal_wall_clock_reads_each_curve_at_the_same_seconds(results):
    """The second view of equal compute: the shortest method's mean final seconds (here every
    curve ends at 500 * 1.6 + seed s: 801 s on average), each run's curve interpolated there."""
    at, by_method = equal_wall_clock(results)
    assert at == pytest.approx(np.mean([800 + s for s in range(3)]))
    for method, value in by_method.items():
        runs = [r for r in results if r["method"] == method]
        # the curve is linear in seconds here: heldout = 5.5 - (wall - seed) / 400 + 0.1 seed; a run
        # that finished before `at` keeps its final value
        want = [5.5 - (min(at, 800 + s) - s) / 400 + 0.1 * s for s in range(3)]
        assert value == pytest.approx(np.mean(want))
        assert method in [r["method"] for r in runs]
    row = summarise(results)[0]
    assert row["equal_wall_s"] == at and row["heldout_at_equal_wall"] == by_method[row["method"]]
    assert f"held-out at {at:.0f} s" in markdown_table(summarise(results))


def test_tuning_and_n_curve_tables(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    tuning = [{"method": "SPSA", "setting": f"lr x{f:g}", "lr": 0.1 * f, "eps": 1e-3, "validation": v,
               "diverged": d, "final_train_loss": 2.5, "chosen": c}
              for f, v, d, c in ((0.5, 2.9, False, False), (1, 2.8, False, True), (2, 9.9, True, False))]
    lines = tuning_markdown(tuning).splitlines()
    assert lines[3].endswith("| 2.800 | 2.500 |  | **yes** |") and "| yes |" in lines[4]
    runs = [{"series": ["equal params"], "experts": n, "n_params": 100_000, "heldout_by_k": {"1": 3.0 - n / 10 + s,
            **({"2": 2.9 - n / 10 + s} if n > 1 else {})}} for n in (1, 2, 4) for s in (0.0, 0.2)]
    runs[-1]["divergence"] = [{"expert": 3, "step": 50, "verdict": "rising"}]  # N=4, second seed
    runs[-1]["heldout_by_k"] = {"1": 9.0, "2": 8.0}
    runs[0]["restarts"] = [{"expert": 0, "step": 90, "to": 50, "lr_scale": 0.5, "verdict": "rising"}] * 2
    runs[0]["dropped"] = [{"expert": 0, "step": 99, "verdict": "rising"}]  # N=1, first seed: its one model, so lost
    rows = n_curve(runs)
    assert [(r["N"], sorted(r["k"]), r["diverged"]) for r in rows] == [(1, [1], 1), (2, [1, 2], 0), (4, [1, 2], 1)]
    assert rows[1]["k"][2][0] == pytest.approx(2.9 - 0.2 + 0.1) and rows[1]["seeds"] == 2
    assert rows[2]["k"][2][0] == pytest.approx((2.5 + 8.0) / 2)  # every seed, the diverged one too
    assert rows[2]["k_trained"][2] == (pytest.approx(2.5), 0.0)  # the seed that did not diverge
    text = n_curve_markdown(rows)
    assert "| equal params | 1 | 100,000 | 2 | 1 | 2 (1) | 3.000 ± 0.141 | n/a | 3.100 ± 0.000 | n/a | n/a |" in text
    assert ("| equal params | 4 | 100,000 | 2 | 1 | 0 (0) | 5.800 ± 4.525 | 5.250 ± 3.889 | 2.600 ± 0.000 | "
            "2.500 ± 0.000 | n/a |") in text
    drawn = plot_n_curve(rows, tmp_path / "n.png")
    x, y = drawn["equal params, top-2"]  # N = 2 and 4, means over the seeds that did not diverge
    np.testing.assert_allclose(x, [2, 4])
    np.testing.assert_allclose(y, [2.8, 2.5])
    np.testing.assert_allclose(drawn["equal params, top-1"][1], [3.1, 2.9, 2.6])


def test_csv_round_trip(results, tmp_path):
    path = tmp_path / "results.csv"
    write_csv(results, path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results)
    assert list(rows[0])[:9] == ["method", "kind", "seed", "n_params", "steps", "flops", "wall_s",
                                 "heldout_overall", "wikitext103"]
    for row, run in zip(rows, results):
        assert row["method"] == run["method"] and int(row["seed"]) == run["seed"]
        assert float(row["flops"]) == run["flops"]
        assert float(row["heldout_overall"]) == run["heldout"]["overall"]
        assert float(row["heldout_legal"]) == run["heldout"]["legal"]
        assert row["wikitext103"] == ("" if run["wikitext103"] is None else str(run["wikitext103"]))
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_plots_are_png(results, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    # A seed that logged an extra step: only the steps every seed has are plotted.
    results[0]["curve"].append({"step": 750, "flops": 1.8e13, "wall_s": 1200.0, "heldout": 2.0})
    flops, wall = tmp_path / "f.png", tmp_path / "w.png"
    drawn = plot_curves(results, flops, wall, title="synthetic")
    for path in (flops, wall):
        assert path.read_bytes()[:8] == PNG_MAGIC
    for method, runs in {r["method"]: [x for x in results if x["method"] == r["method"]] for r in results}.items():
        steps = sorted(set.intersection(*({p["step"] for p in run["curve"]} for run in runs)))
        point = lambda key, step: np.mean([next(p[key] for p in run["curve"] if p["step"] == step) for run in runs])  # noqa: E731
        want_y = [point("heldout", s) for s in steps]
        x, y = drawn[str(wall)][method]  # every common step, mean over seeds, in step order
        np.testing.assert_allclose(x, [point("wall_s", s) for s in steps])
        np.testing.assert_allclose(y, want_y)
        x, y = drawn[str(flops)][method]  # the log axis leaves out step 0's zero FLOPs
        keep = [point("flops", s) > 0 for s in steps]
        np.testing.assert_allclose(x, [point("flops", s) for s, k in zip(steps, keep) if k])
        np.testing.assert_allclose(y, [v for v, k in zip(want_y, keep) if k])
        assert 750 not in steps  # the step only one seed logged is not drawn


def test_plots_of_runs_stopped_before_their_first_point(tmp_path):
    """Every run's guard stopped it before the first point past step 0 (0 FLOPs): the FLOPs plot
    is drawn without a log axis instead of failing."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    rng = np.random.default_rng(2)
    runs = [make_run(m, "spsa", 0, rng, steps=(0,)) for m in ("SPSA P=2", "SPSA P=4")]
    flops, wall = tmp_path / "f.png", tmp_path / "w.png"
    drawn = plot_curves(runs, flops, wall)
    assert flops.read_bytes()[:8] == PNG_MAGIC and wall.read_bytes()[:8] == PNG_MAGIC
    assert [len(x) for x, _ in drawn[str(flops)].values()] == [0, 0]


def test_plots_without_matplotlib(results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"zosoma\[plots\]"):
        plot_curves(results, tmp_path / "f.png", tmp_path / "w.png")


def test_a_report_without_matplotlib_keeps_its_tables(results, tmp_path, monkeypatch):
    """An N-curve that trained for hours still gets results.md and results.csv when the plots
    extra is missing (the n-curve plot once raised ImportError before results.md was written)."""
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    for r in results:
        r.update(series=["equal params"], experts=2 if r["kind"] == "soma" else 1,
                 heldout_by_k={"1": r["heldout"]["overall"]})
    paths = write_report(results, [], tmp_path, "synthetic")
    assert {name for name, p in paths.items() if p is None} == {"n_curve.png", "nats_vs_flops.png", "nats_vs_wall.png"}
    assert "## SOMA's curve in N" in paths["results.md"].read_text()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["results.csv", "results.md"]


def test_ablation():
    ind, summed = [2.40, 2.35, 2.50], [2.45, 2.40, 2.48]
    pairs = [{"seed": s, "independent": {"heldout": i, "wikitext103": i + 0.2 if s else None},
              "summed": {"heldout": j, "wikitext103": j + 0.3}} for s, (i, j) in enumerate(zip(ind, summed))]
    summary = ablation_summary(pairs)
    diffs = np.subtract(ind, summed)
    held = summary["heldout"]
    assert held["mean"] == pytest.approx(diffs.mean())
    assert held["std"] == pytest.approx(diffs.std(ddof=1))
    assert (held["min"], held["max"]) == pytest.approx((diffs.min(), diffs.max()))
    wiki = summary["wikitext103"]  # seed 0 has no independent WikiText-103 value
    assert [r["seed"] for r in wiki["per_seed"]] == [1, 2]
    assert wiki["mean"] == pytest.approx(np.mean(diffs[1:] - 0.1))
    lines = ablation_markdown(summary).splitlines()
    assert len(lines) == 2 + 3 + 1
    assert lines[2].startswith("| 0 | 2.400 | 2.450 | -0.050 | n/a | n/a | n/a |")
    assert f"{held['mean']:.3f} ± {held['std']:.3f}" in lines[-1]


def test_write_report(results, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    pairs = [{"seed": 0, "independent": {"heldout": 2.4, "wikitext103": None},
              "summed": {"heldout": 2.5, "wikitext103": None}}]
    paths = write_report(results, pairs, tmp_path / "out", "Equal compute")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths.values())
    text = paths["results.md"].read_text(encoding="utf-8")
    assert text.startswith("# Equal compute\n")
    assert "same segment protocol" in text and "| SPSA P=128 |" in text
    assert "| 0 | 2.400 | 2.500 | -0.100 |" in text and "WikiText-103 independent" not in text
    assert paths["nats_vs_wall.png"].read_bytes()[:8] == PNG_MAGIC


def test_the_yardsticks_follow_the_method_table(results, tmp_path, monkeypatch):
    from zosoma.yardsticks import Yardsticks
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # tables only, quickly
    nats = {"witten-bell-3": {"code": 2.0, "legal": 2.1, "prose": 2.2, "overall": 2.15},
            "kneser-ney-8": {"code": 1.2, "legal": 1.3, "prose": 1.4, "overall": 1.35},
            "zlib-9": {"code": 2.4, "legal": 2.5, "prose": 2.6, "overall": 2.55}}
    held = Yardsticks(nats, 256, 512, (8,), "train")
    wiki = Yardsticks({k: {"WikiText-103": v["overall"] + 1, "overall": v["overall"] + 1} for k, v in nats.items()},
                      256, 512, (8,), "train")
    text = write_report(results, [], tmp_path, "t", yardsticks={"heldout": held, "wikitext103": wiki})[
        "results.md"].read_text(encoding="utf-8")
    table = text[text.index("## Yardsticks"):]
    assert "| yardstick | held-out nats/byte | WikiText-103 nats/byte | code | legal | prose |" in table
    assert "| Kneser-Ney 8-gram | 1.350 | 2.350 | 1.200 | 1.300 | 1.400 |" in table
    assert "| zlib -9 | 2.550 | 3.550 |" in table
    text = write_report(results, [], tmp_path, "t", yardsticks={"heldout": held})["results.md"].read_text()
    assert "| Witten-Bell 3-gram | 2.150 | n/a | 2.000 |" in text
    assert "## Yardsticks" not in write_report(results, [], tmp_path, "t")["results.md"].read_text()
