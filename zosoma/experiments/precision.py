"""What a forward-only device's number format costs: the precision study.

The default single model (the tiny preset) and SOMA with N experts are trained with every forward
in fp32, bf16, fp16 or int8 (zosoma.engines.emulated: master weights and updates fp32 on the
host), each at eps = m * step(F) for the multiples m, and at TrainConfig's default eps. step(F)
is the format's step at the preset's initial parameters (zosoma.model.number_formats.format_step: the
median over parameters of the distance to the neighbouring value in F; for int8 the tensor's
scale): an eps well below it moves few weights to another representable value, so the two
members of a pair often compute the same loss.

Each finished run is scored on the held-out slices twice: in its format (what the device would
measure; SOMA routed top-2) and with the same weights in fp32 (what the format cost training
itself).

Output folder (laid out, checked and run by zosoma.experiments.study):

    OUT/runs/<name>/          a run folder (single model or SOMA) plus result.json, its record;
                              a finished run is never repeated, an unfinished one resumes;
                              a run of other settings (another study's) is refused
    OUT/settings.json         that OUT is a precision study's (a comparison's folder is refused)
    OUT/results.md            the tables; results.csv one row per run; precision.png
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.config import PRECISIONS, TrainConfig
from zosoma.errors import ConfigError
from zosoma.experiments.study import JobRun, Spec, StudyFolder
from zosoma.model.params import Layout, init_params
from zosoma.model.number_formats import format_step
from zosoma.training.json_shape import NUMBER
from zosoma.strategies.settings import resolve

PRESET = "tiny"
TOP_K = 2


@dataclass(frozen=True)
class Study:
    steps: int = 4000  # the default run length
    formats: tuple = PRECISIONS
    multiples: tuple = (0.25, 1.0, 4.0, 16.0)  # eps = m * step(F), single model
    experts: int = 4  # SOMA's N
    soma_multiples: tuple = (0.25, 1.0, 4.0, 16.0)  # SOMA's multiples (besides the default eps)
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.experts < 2:
            raise ConfigError("the study needs steps >= 1 and experts >= 2")
        for fmt in self.formats:
            if fmt not in PRECISIONS:
                raise ConfigError(f"format must be one of {', '.join(PRECISIONS)}, got {fmt!r}")
        if not all(m > 0 and math.isfinite(m) for m in self.multiples + self.soma_multiples):
            raise ConfigError("eps multiples must be positive numbers")


@dataclass(frozen=True)
class Job:
    """One run of the study (a zosoma.experiments.study Job): a model kind, a format and an eps."""
    name: str  # its folder, OUT/runs/<name>
    fmt: str
    experts: int  # 1: the single model
    eps: float
    multiple: float | None  # eps / step(F) as asked; None: the default eps
    step_size: float  # step(F)
    steps: int
    seed: int
    kind = "precision study"
    device = "cpu"  # the formats are emulated on the CPU
    # what its result.json must hold (zosoma.training.json_shape): what the report reads
    record_shape = {"name": str, "fmt": str, "experts": int, "eps": NUMBER, "multiple": (*NUMBER, type(None)),
                    "step_size": NUMBER, "eps_over_step": NUMBER, "steps": int, "seed": int,
                    "heldout": {"overall": NUMBER}, "heldout_fp32_eval": NUMBER,
                    "train_loss_last100": (*NUMBER, type(None)), "skipped_steps": int,
                    "divergence": ({"step": int, "verdict": str}, type(None)), "wall_s": NUMBER}

    @property
    def label(self) -> str:
        who = f"SOMA N={self.experts}" if self.experts > 1 else "single model"
        return f"{who}, {self.fmt} forwards, eps {self.eps:.3g}"

    def train_config(self) -> TrainConfig:
        return self.spec.train

    @property
    def spec(self) -> Spec:
        model, cfg = resolve(PRESET, {"steps": self.steps, "eps": self.eps, "seed": self.seed,
                                      "forward_precision": self.fmt, "checkpoint_every": min(500, self.steps),
                                      # a run the format makes diverge is a result: train it to the end
                                      # and record the guard's verdict; the paper's plain SPSA, as
                                      # the study ran
                                      "on_divergence": "continue", "optimizer": "sgd", "shaping": ()})
        return Spec(model, cfg, self.experts, top_k=TOP_K)

    def expected(self) -> dict:
        return {**{k: getattr(self, k) for k in ("fmt", "experts", "eps", "steps", "seed")}, **self.spec.record()}

    def score(self, run: JobRun, stopping: Callable[[], bool]) -> dict | None:
        """Train the run to the end and score it on the held-out slices in its format (what the
        device would measure) and with the same weights in fp32 (what the format cost training)."""
        if not run.advance(self.steps, stopping):
            return None
        in_format = run.score(run.heldout, ops=run.trainers[0].ops)
        fp32 = in_format["overall"] if self.fmt == "fp32" else run.score(run.heldout)["overall"]  # on run.ops
        logs = [t.folder.read_metrics() for t in run.trainers]
        metrics = [m for log in logs for m in log]
        last = [m["loss"] for log in logs for m in log[-100:] if np.isfinite(m["loss"])]
        summaries = [t.summary() for t in run.trainers]
        return {"name": self.name, **dataclasses.asdict(self), "eps_over_step": self.eps / self.step_size,
                "heldout": in_format, "heldout_fp32_eval": fp32,
                "train_loss_last100": float(np.mean(last)) if last else None,
                "skipped_steps": int(sum(bool(m.get("skipped")) for m in metrics)),
                "divergence": guard_verdict({"training": summaries} if self.experts > 1 else summaries[0]),
                "wall_s": float(sum(t.state.wall_s for t in run.trainers))}


def jobs(study: Study) -> list[Job]:
    """Every run of the study, SOMA first (the longest)."""
    model, default = resolve(PRESET)
    theta0 = init_params(model, study.seed)
    out = []
    for experts, multiples in ((study.experts, study.soma_multiples), (1, study.multiples)):
        for fmt in study.formats:
            step = format_step(theta0, Layout(model), fmt)
            who = f"soma{experts}" if experts > 1 else "single"
            for m in (None,) + tuple(multiples):
                eps = default.eps if m is None else m * step
                tag = "default-eps" if m is None else f"eps{m:g}step"
                out.append(Job(f"{who}-{fmt}-{tag}", fmt, experts, float(eps), m, step, study.steps, study.seed))
    return out


def guard_verdict(evaluated: dict) -> dict | None:
    """The divergence guard's verdict on a run, from its training summary: a single model's own;
    for a SOMA run ({"training": each expert's}), which experts' guards fired and the first
    verdict (each expert has its own guard)."""
    if "training" not in evaluated:
        return evaluated.get("divergence")
    fired = [(t["divergence"]["step"], i, t["divergence"]["verdict"])
             for i, t in enumerate(evaluated["training"]) if t.get("divergence")]
    if not fired:
        return None
    step, first, verdict = min(fired)
    who = ", ".join(str(i) for _, i, _ in sorted(fired, key=lambda f: f[1]))
    return {"step": step, "verdict": f"experts {who} of {len(evaluated['training'])}; expert {first}: {verdict}"}


def folder(out) -> StudyFolder:
    """The study's output folder: bound to being a precision study's, and each run folder to its
    job's configuration (a run of another study, say a shorter one, is refused)."""
    return StudyFolder(out, Job.kind, {})


def run_study(study: Study, out: Path, executor=None, should_stop: Callable[[], bool] = lambda: False,
              on_result: Callable[[Job, dict | None, str | None], None] = lambda j, r, e: None) -> dict:
    """Run every job not finished yet through `executor` (default inline), then write the report.
    Returns the report's paths ({} when no run has finished)."""
    todo, runs = jobs(study), folder(out)
    with runs.open(todo):  # one study at a time in an output folder
        _, errors = runs.run(todo, executor, should_stop, on_result)
        paths = write_study_report(study, out)
    if errors:
        raise ConfigError(f"{len(errors)} run(s) failed; the first: {errors[0]}")
    return paths


def write_study_report(study: Study, out: Path) -> dict:
    """The report of every run of `study` finished so far in `out`, naming those not finished;
    its paths, or {} when none has finished. Trains nothing."""
    found = folder(out).finished(jobs(study))
    finished = [r for r in found.values() if r is not None]
    return write_report(finished, out, [name for name, r in found.items() if r is None]) if finished else {}


# --------------------------------------------------------------------------------------- report

def _cell(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.3f}"


def format_tables(results: list[dict]) -> str:
    """Markdown: per model kind, held-out nats/byte by format and eps (in the format's steps),
    then every run's details."""
    lines = []
    for experts in sorted({r["experts"] for r in results}):
        runs = [r for r in results if r["experts"] == experts]
        cols = sorted({r["multiple"] for r in runs if r["multiple"] is not None})
        has_default = any(r["multiple"] is None for r in runs)
        who = "single model" if experts == 1 else f"SOMA N={experts} (routed top-{TOP_K})"
        lines += [f"**{who}**: held-out nats/byte, evaluated in the format (same weights in fp32)", ""]
        head = ["format", "step"] + [f"eps = {m:g} step" for m in cols] + (["eps = 1e-3 (default)"] if has_default else [])
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for fmt in dict.fromkeys(r["fmt"] for r in runs):
            by = {r["multiple"]: r for r in runs if r["fmt"] == fmt}
            row = [fmt, f"{next(iter(by.values()))['step_size']:.2g}"]
            for m in cols + ([None] if has_default else []):
                r = by.get(m)
                row.append("" if r is None else f"{_cell(r['heldout']['overall'])} ({_cell(r['heldout_fp32_eval'])})"
                           + (f" [eps/step {r['eps_over_step']:.2g}]" if m is None else ""))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += ["**Every run**", "",
              "| run | format | N | eps | eps / step | held-out (format) | held-out (fp32 eval) | "
              "train loss, last 100 steps | skipped steps | divergence guard | training s |",
              "|" + " --- |" * 11]
    for r in results:
        verdict = r.get("divergence")
        guard = f"step {verdict['step']}: {verdict['verdict']}" if verdict else ""
        lines.append(f"| {r['name']} | {r['fmt']} | {r['experts']} | {r['eps']:.3g} | {r['eps_over_step']:.3g} | "
                     f"{_cell(r['heldout']['overall'])} | {_cell(r['heldout_fp32_eval'])} | "
                     f"{_cell(r['train_loss_last100'])} | {r['skipped_steps']} | {guard} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def write_report(results: list[dict], out: Path, unfinished: list[str] = ()) -> dict:
    """results.md, results.csv and precision.png (when matplotlib is installed) in `out`;
    `unfinished`: the names of the study's runs not finished yet, listed in results.md."""
    out = Path(out)
    steps = sorted({r["steps"] for r in results})
    md = (f"# What the forward's number format costs\n\nTiny preset (49,664 parameters per model), seed "
          f"{results[0]['seed']}, {'/'.join(map(str, steps))} steps; master weights and updates fp32, every forward "
          "emulated in the format (zosoma.model.number_formats). step = the format's step at the initial "
          "parameters (median distance to the neighbouring representable value; int8: the tensor scale).\n\n"
          + format_tables(results)
          + (f"\n**Not finished yet** ({len(unfinished)} runs; the same `zosoma precision-study` command trains "
             f"them and rewrites this report): {', '.join(unfinished)}\n" if unfinished else ""))
    paths = {"md": out / "results.md", "csv": out / "results.csv"}
    atomic_write(paths["md"], md, "report")
    buf = io.StringIO()
    fields = ["name", "fmt", "experts", "eps", "multiple", "step_size", "eps_over_step", "steps", "seed",
              "heldout_overall", "heldout_fp32_eval", "train_loss_last100", "skipped_steps", "wall_s"]
    writer = csv.DictWriter(buf, fields, extrasaction="ignore")
    writer.writeheader()
    for r in results:
        writer.writerow({**r, "heldout_overall": r["heldout"]["overall"]})
    atomic_write(paths["csv"], buf.getvalue(), "report")
    try:
        paths["png"] = _plot(results, out / "precision.png")
    except ImportError:
        pass
    return paths


_CEILING = 5.545  # the uniform model's nats/byte: a run above it is drawn on this line as diverged


def _shown(r: dict) -> float:
    x = r["heldout"]["overall"]
    return _CEILING if not np.isfinite(x) or x > _CEILING else x


def _plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["experts"] for r in results})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), sharey=True, squeeze=False)
    for ax, experts in zip(axes[0], kinds):
        runs = [r for r in results if r["experts"] == experts]
        for fmt in dict.fromkeys(r["fmt"] for r in runs):
            color = f"C{PRECISIONS.index(fmt)}"  # one colour per format in every panel
            grid = sorted((r for r in runs if r["fmt"] == fmt and r["multiple"] is not None),
                          key=lambda r: r["eps_over_step"])
            ax.plot([r["eps_over_step"] for r in grid], [_shown(r) for r in grid], "o-", color=color, label=fmt)
            for r in runs:
                if r["fmt"] == fmt and r["multiple"] is None:
                    ax.plot([r["eps_over_step"]], [_shown(r)], "*", color=color, markersize=12)
        ax.axhline(_CEILING, color="grey", lw=0.8, ls=":")
        ax.text(0.02, _CEILING, "diverged (above the uniform model's 5.545)", va="bottom", fontsize=8,
                color="grey", transform=ax.get_yaxis_transform())
        ax.set_xscale("log")
        ax.set_xlabel("eps / the format's step (star: default eps 1e-3)")
        ax.set_title("single model" if experts == 1 else f"SOMA N={experts}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylim(min(_shown(r) for r in results) - 0.15, _CEILING + 0.3)
    axes[0][0].set_ylabel("held-out nats/byte (in the format)")
    axes[0][0].legend()
    fig.suptitle("What your hardware's precision costs (tiny preset)")
    fig.tight_layout()
    with atomic_path(path, "plot") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
