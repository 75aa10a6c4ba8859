"""The equal-compute comparison: SOMA against monolithic SPSA and EGGROLL at the same total
parameter count and the same forward-FLOP budget, over several seeds; and the ablation of
independent against summed expert losses.

A comparison is a TOML file, read and checked by zosoma.experiments.compare_config (the shipped
ones are in zosoma/experiments/configs/: `zosoma compare cpu`).

Compute accounting. Forward FLOPs are the nominal ModelConfig.flops_per_token (every matmul of
the LSTM and the output layer, multiply-add = 2) times the bytes pushed through forward passes,
2P * B * T per step per expert; a method's steps are the budget divided by its FLOPs per step,
rounded down. The steps a restart re-runs are spent too: a model that restarted stops when its
share is spent, at a lower step (zosoma.training.trainer, Trainer.spent), so no run spends more than
the budget; the report puts each method's spend beside it and marks a run over it. EGGROLL is charged the same dense FLOPs per member: its shared GEMM does that work,
and its rank-r corrections are left out like the gate math. Wall time is training seconds (no
evaluation) summed over a run's experts, i.e. aggregate compute time as the paper's GPU-hours;
CPU-seconds (cpu_s, in every curve point and record) are the process CPU time spent training
(_CpuClock), which a shared machine's other jobs do not inflate. A backprop method
(zosoma.experiments.backprop) counts its backward pass at 2x the forward's FLOPs.

Evaluation. Every method is scored by one protocol, the routed one of zosoma.mixture.routing: segments of
`segment` predicted bytes, each after `context` bytes of warm-up (and, for SOMA, routing) context.
A monolithic model is an ensemble of one expert with weight 1, which scores exactly as the model.

Output folder:

    OUT/runs/<method>-seed<s>/    one run folder per method and seed: a SOMA folder, or a single
                                  model's (`zosoma eval`, `zosoma info` and `zosoma train
                                  --resume` read both); plus curve.jsonl (the held-out curve)
                                  and result.json (the final evaluation: the run is finished and
                                  is never repeated, unless it trained on since: then its
                                  record is stale, and it is scored again)
    OUT/runs/ablation-<loss>-seed<s>/
    OUT/results.md, results.csv, nats_vs_flops.png, nats_vs_wall.png     (zosoma.experiments.report)
    OUT/settings.json             what the results depend on besides each run's configuration:
                                  the evaluation protocol, chunking, routing, tuning (settings())

The runs are the jobs of a study (zosoma.experiments.study, which lays out, checks and runs
them): independent units of work for an executor (zosoma.workers.executor: inline, or `--jobs`
worker processes with one BLAS thread each on a machine with as many cores); a killed comparison
resumes every unfinished run from its checkpoints. OUT is bound to the config that made it:
before anything trains, every run folder's record (result.json, else its checkpoints) is checked
against the job the config makes now, and OUT/settings.json against settings(); a difference is
refused in one line naming it (check_folder), never answered with the old runs. With device
"cuda" every run trains and is evaluated on the GPU; checkpoints stay device-independent, so a run
may resume on the other device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zosoma.corpus import Corpus, load_corpus, load_text
from zosoma.download import find_wikitext103
from zosoma.errors import ConfigError
from zosoma.experiments.backprop import import_torch
from zosoma.experiments.compare_config import Comparison, Method, Tuning, slug
from zosoma.experiments.report import lost
from zosoma.experiments.study import JobRun, Spec, StudyFolder
from zosoma.training.events import EventLog
from zosoma.training.json_shape import NUMBER, ListOf, MayLack, ValuesOf

@dataclass(frozen=True)
class Job:
    """One run of the comparison: a method at a seed (a zosoma.experiments.study Job)."""
    name: str  # its folder, OUT/runs/<name>
    method: Method
    seed: int
    cmp: Comparison  # the evaluation protocol it is scored by
    curve: bool = True  # the ablation and the tuning sweep need final figures only
    tuning: bool = False  # a sweep run: scored on the validation split only
    device: str = "cpu"  # where forward passes run (training and evaluation); results do not move
    wikitext: str | None = None  # WikiText-103's wiki.test.raw (None: found where downloaded)
    kind = "comparison"

    @property
    def label(self) -> str:
        return f"{self.method.name}, seed {self.seed}"

    @property
    def record_shape(self) -> dict:
        """What its result.json must hold (zosoma.training.json_shape): all that the report, the
        tuning and the ablation read of it (what they read where present may be absent: records
        of an older zosoma)."""
        point = {"step": int, "flops": NUMBER, "wall_s": NUMBER, "heldout": NUMBER,
                 "cpu_s": NUMBER if self.cmp.price_levels else MayLack(NUMBER)}
        if self.tuning:
            scores = {"validation": NUMBER}
        else:
            ks = {str(k): NUMBER for k in self.cmp.eval_top_k if k <= self.method.experts}
            scores = {"heldout": ValuesOf(NUMBER, ("overall",)), "wikitext103": (*NUMBER, type(None)),
                      "heldout_by_k": ks if self.curve else MayLack(ks)}
        return {"method": str, "kind": str, "seed": int, "experts": int, "n_params": int, "steps": int,
                "flops": NUMBER, "wall_s": NUMBER, "curve": ListOf(point), "model": dict, "train": dict, **scores,
                "loss": MayLack(str) if self.curve or self.tuning else str, "series": MayLack(ListOf(str)),
                "skipped_steps": MayLack(int), "final_train_loss": MayLack((*NUMBER, type(None))),
                "divergence": MayLack((ListOf({"expert": int, "step": int, "verdict": str}), type(None))),
                "restarts": MayLack(ListOf({"expert": int, "step": int, "to": int, "lr_scale": NUMBER})),
                "dropped": MayLack(ListOf({"expert": int, "step": int}))}

    @property
    def spec(self) -> Spec:
        m = self.method
        return Spec(m.model, dataclasses.replace(m.train, seed=self.seed), m.experts, m.loss, self.cmp.chunk_size,
                    self.cmp.top_k)

    def expected(self) -> dict:
        return {"method": self.method.name, "series": list(self.method.series), **self.spec.record()}

    def score(self, run: JobRun, stopping: Callable[[], bool]) -> dict | None:
        """Train the run to its budget, recording the held-out curve, and evaluate it: the result
        record of zosoma.experiments.report's schema, or None when stopping() turned true first."""
        cmp, folder = self.cmp, run.folder
        protocol = dict(segment=cmp.segment, context=cmp.context)
        curve = folder.read_curve()
        events = EventLog(folder.path)  # the run's curve and final figures for TensorBoard
        cpu = _DeviceClock(curve) if run.ops.on_device else _CpuClock(curve)
        if self.curve:
            subset = curve_texts(run.heldout, cmp)
            for target in curve_steps(run.cfg.steps, cmp.curve_points, cmp.curve_spacing):
                if run.step > target:
                    continue  # passed before a restart; its point was recorded then
                if not cpu.advance(run, target, stopping):
                    return None
                if run.diverged:
                    break  # scored below where the guard stopped it
                if run.step not in {p["step"] for p in curve}:  # one point where a run stopped short
                    point = {**run.totals(), "cpu_s": cpu.seconds, "heldout": run.score(subset, **protocol)["overall"]}
                    curve.append(point)
                    folder.append_curve(point)
                    events.evaluation(point["step"], point["heldout"], tag="eval/heldout_curve")
        elif not cpu.advance(run, run.cfg.steps, stopping):
            return None
        m = self.method
        result = {"method": m.name, "kind": m.kind, "seed": self.seed, "loss": m.loss, "experts": m.experts,
                  "series": list(m.series), "n_params": m.experts * m.model.n_params(), "steps": run.cfg.steps,
                  **run.totals(), "cpu_s": cpu.seconds, **run.training(), "curve": sorted(curve, key=lambda p: p["step"]),
                  "model": dataclasses.asdict(m.model), "train": dataclasses.asdict(run.cfg)}
        if run.ops.on_device:
            result["clock"] = "gpu"  # its cpu_s are the device's seconds (_DeviceClock)
        if self.tuning:  # tuning reads the validation split only
            result["validation"] = run.score(load_corpus(None, "validation"), **protocol)["overall"]
        else:
            wiki = find_wikitext103(self.wikitext)
            result["heldout"] = run.score(run.heldout, **protocol)
            result["wikitext103"] = run.score_bytes(load_text(wiki), **protocol) if wiki else None
            result["heldout_by_k"] = {str(k): run.score(run.heldout, top_k=k, **protocol)["overall"]
                                      for k in cmp.eval_top_k if k <= m.experts}
        settings = {k: result["train"][k] for k in ("perturbations", "lr", "eps", "optimizer", "shaping", "on_divergence")}
        events.hparams({"method": m.name, "experts": m.experts, "seed": self.seed, "params": result["n_params"], **settings},
                       {"hparams/validation": result.get("validation"), "hparams/wikitext103": result.get("wikitext103"),
                        "hparams/heldout": (result.get("heldout") or {}).get("overall")})  # TensorBoard's HParams view
        events.close()
        return result


def curve_texts(heldout: Corpus, cmp: Comparison) -> Corpus:
    """What the held-out curve scores: the first curve_bytes of each held-out file."""
    return Corpus(heldout.names, tuple(d[:cmp.curve_bytes] for d in heldout.docs))


class _CpuClock:
    """A run's training CPU-seconds: this process's CPU time (every thread's, so a BLAS or torch
    thread pool's too) while the run advances, evaluation left out, added to what its curve
    recorded before a restart (the steps after its last point that a kill cut short are not
    counted). Wall time, on a shared machine, counts other processes' turns; CPU time does not."""

    def __init__(self, curve: list[dict]):
        self.seconds = max((p.get("cpu_s", 0.0) for p in curve), default=0.0)

    def advance(self, run, target: int, stopping: Callable[[], bool]) -> bool:
        t0 = time.process_time()
        try:
            return run.advance(target, stopping)
        finally:
            self.seconds += time.process_time() - t0


class _DeviceClock(_CpuClock):
    """On a GPU (--device cuda): the run's training wall seconds, the device's time when it runs one
    job at a time (--jobs 1). Every step waits for its losses on the host (the ZO members', backprop's
    loss.item()), so no queued device work is left out."""

    def advance(self, run, target: int, stopping: Callable[[], bool]) -> bool:
        t0 = time.perf_counter()
        try:
            return run.advance(target, stopping)
        finally:
            self.seconds += time.perf_counter() - t0


def jobs(cmp: Comparison, device: str = "cpu", wikitext: str | None = None) -> list[Job]:
    """The comparison's main runs (its methods as configured or tuned) and the ablation's."""
    out = [Job(f"{slug(m.name)}-seed{s}", m, s, cmp, True, device=device, wikitext=wikitext)
           for s in cmp.seeds for m in cmp.methods if s in (m.seeds or cmp.seeds)]
    out += [Job(f"{slug(m.name)}-seed{s}", m, s, cmp, False, device=device, wikitext=wikitext)
            for s in cmp.ablation_seeds for m in cmp.ablation]
    return out


def variants(method: Method, tuning: Tuning) -> list[tuple[str, Method]]:
    """(label, method) at each tuned setting: lr times each factor, and for EGGROLL and ES (whose
    eps is their sigma) sigma times each factor too."""
    sigmas = tuning.sigma_factors if method.train.optimizer in ("eggroll", "es") else (1.0,)
    out = []
    for f in tuning.lr_factors:
        for s in sigmas:
            cfg = dataclasses.replace(method.train, lr=method.train.lr * f, eps=method.train.eps * s)
            label = f"lr x{f:g}" + (f", sigma x{s:g}" if len(sigmas) > 1 else "")
            out.append((label, dataclasses.replace(method, train=cfg)))
    return out


def tuning_jobs(cmp: Comparison, device: str = "cpu") -> list[Job]:
    """Every method at every tuned setting, the tuning seed, the full budget (OUT/runs/tune/...)."""
    if cmp.tuning is None:
        return []
    seed = cmp.tuning.seed
    return [Job(f"tune/{slug(m.name)}-{slug(label)}-seed{seed}", v, seed, cmp, False, tuning=True, device=device)
            for m in cmp.methods if cmp.tuning.tunes(m) for label, v in variants(m, cmp.tuning)]


def tuned(cmp: Comparison, results: dict[str, dict]) -> tuple[Comparison, list[dict]]:
    """The comparison with each tuned method at its best setting on validation (a diverged run
    loses; `results`: the sweep's records by job name), and one row per sweep run for the tuning
    table."""
    rows, methods = [], []
    sweep = tuning_jobs(cmp)
    for m in cmp.methods:
        if cmp.tuning.tunes(m):
            m = _best(m, cmp.tuning, [results[j.name] for j in sweep if j.method.name == m.name], rows)
        methods.append(m)
    return dataclasses.replace(cmp, methods=tuple(methods)), rows


def _best(method: Method, tuning: Tuning, results: list[dict], rows: list[dict]) -> Method:
    """The setting of `method` whose sweep run (results, in variants' order) scored best; appends
    one tuning-table row per setting, the winner's marked chosen."""
    best = None
    for (label, v), r in zip(variants(method, tuning), results):
        score = math.inf if lost(r) else r["validation"]
        rows.append({"method": method.name, "setting": label, "lr": v.train.lr, "eps": v.train.eps,
                     "validation": r["validation"], "diverged": lost(r),
                     "final_train_loss": r.get("final_train_loss"), "chosen": False})
        if best is None or score < best[0]:
            best = (score, v, len(rows) - 1)
    rows[best[2]]["chosen"] = True
    return best[1]


def curve_steps(steps: int, points: int, spacing: str = "linear") -> list[int]:
    """0 and `points` steps ending at `steps`, evenly spaced in the step (linear) or in its
    logarithm (log: steps ** (k / points), where a level is reached early); fewer where
    they coincide."""
    if spacing == "log":
        return sorted({0} | {math.ceil(steps ** (k / points)) for k in range(1, points + 1)})
    return sorted({0} | {math.ceil(steps * k / points) for k in range(1, points + 1)})


# ------------------------------------------------------------------- a folder bound to its config

def settings(cmp: Comparison) -> dict:
    """What a comparison's results depend on besides each run's own configuration (which its
    checkpoints and result.json record): the evaluation protocol, SOMA's chunking and routing, the
    tuning sweep. OUT is bound to these (RunFolder.bind)."""
    spacing = {"curve_spacing": cmp.curve_spacing} if cmp.curve_spacing != "linear" else {}  # older folders: linear
    return {"curve_points": cmp.curve_points, **spacing, "curve_bytes": cmp.curve_bytes, "segment": cmp.segment,
            "context": cmp.context, "top_k": cmp.top_k, "chunk_size": cmp.chunk_size,
            "eval_top_k": list(cmp.eval_top_k), "tuning": dataclasses.asdict(cmp.tuning) if cmp.tuning else None}


def study_folder(cmp: Comparison, out_dir) -> StudyFolder:
    """OUT, bound to the comparison's settings."""
    return StudyFolder(out_dir, Job.kind, settings(cmp))


def known_jobs(cmp: Comparison, folder: StudyFolder, device: str = "cpu", wikitext: str | None = None) -> list[Job]:
    """The jobs known before anything trains: the tuning sweep's, and the main runs of the
    methods not tuned, or of every method (each at its winning setting) once the sweep has
    finished in `folder`."""
    sweep = tuning_jobs(cmp, device)
    if cmp.tuning is not None:
        done = {name: r for name, r in folder.finished(sweep).items() if r is not None}
        if len(done) == len(sweep):
            cmp, _ = tuned(cmp, done)
        else:
            cmp = dataclasses.replace(cmp, methods=tuple(m for m in cmp.methods if not cmp.tuning.tunes(m)))
    return sweep + jobs(cmp, device, wikitext)


def check_folder(cmp: Comparison, out_dir: Path) -> int:
    """Refuse (ConfigError, one line naming what changed) an output folder that other settings,
    or another configuration of any of its runs, left; writes nothing. Returns how many of the
    comparison's runs are finished. With [tuning], the main runs of the tuned methods are known
    only once the sweep has finished; run_comparison checks them then."""
    folder = study_folder(cmp, out_dir)
    return len(folder.check(known_jobs(cmp, folder)))


# ----------------------------------------------------------------------------------------- driver

class Stopped(Exception):
    """The comparison was asked to stop: every unfinished run is checkpointed where it was."""


def run_comparison(cmp: Comparison, out_dir: Path, executor=None, wikitext: str | None = None,
                   device: str = "cpu", should_stop: Callable[[], bool] = lambda: False,
                   on_result: Callable[[Job, dict | None, str | None], None] = lambda j, r, e: None) -> dict:
    """Run every job not yet finished through `executor` (zosoma.workers.executor; default inline),
    then write the report. With [tuning], first the sweep (tuning_jobs), then the main runs at
    each method's winning setting. on_result(job, result, error) is called as each job ends.
    When should_stop() turns true every run checkpoints and stops, and Stopped is raised. Returns
    the report's paths; raises ZosomaError when a job failed (the others still run to the end,
    and the report is written from the finished ones)."""
    from zosoma.experiments.report import write_report
    from zosoma.yardsticks import lookup

    out_dir = Path(out_dir)
    if any(m.kind == "backprop" for m in cmp.methods):
        import_torch()  # before anything trains: one line saying how to install it
    folder = study_folder(cmp, out_dir)
    rows = None
    with folder.open(known_jobs(cmp, folder, device, wikitext)):  # nothing trains in a folder another config left
        if cmp.tuning is not None:
            sweep = tuning_jobs(cmp, device)
            results, errors = folder.run(sweep, executor, should_stop, on_result)
            if should_stop():
                raise Stopped(f"stopped during tuning: {len(results)} of {len(sweep)} sweep runs finished; the "
                              "same command resumes the rest")
            if errors:
                raise ConfigError(f"{len(errors)} tuning run(s) failed; the first: {errors[0]}")
            cmp, rows = tuned(cmp, results)
            folder.check(jobs(cmp))  # the tuned methods' main runs, known only now
        todo = jobs(cmp, device, wikitext)
        results, errors = folder.run(todo, executor, should_stop, on_result)
    if should_stop():
        raise Stopped(f"stopped: {sum(j.name in results for j in todo)} of {len(todo)} runs finished; the "
                      "same command resumes the rest")
    main = [results[j.name] for j in todo if j.curve and j.name in results]
    pairs = ablation_pairs([results[j.name] for j in todo if not j.curve and j.name in results])
    heldout = load_corpus(None, "heldout")
    yardsticks = lookup(heldout, wikitext, cmp.segment, cmp.context)
    price = None
    if cmp.price_levels and main:  # the levels are read off the curves: the yardsticks on the curve's texts
        from zosoma.experiments.price import CURVE_ORDERS
        from zosoma.yardsticks import measure
        price = (cmp.price_levels, measure(load_corpus(None, "train"), curve_texts(heldout, cmp), CURVE_ORDERS,
                                           cmp.segment, cmp.context))
    paths = (write_report(main, pairs, out_dir, cmp.title, tuning=rows, budget=cmp.flops, yardsticks=yardsticks,
                          price=price)
             if main else {})
    if errors:
        raise ConfigError(f"{len(errors)} run(s) failed; the first: {errors[0]}")
    return paths


def ablation_pairs(results: list[dict]) -> list[dict]:
    """zosoma.experiments.report's ablation input: per seed, each loss mode's overall held-out and WikiText."""
    by_seed: dict[int, dict] = {}
    for r in results:
        by_seed.setdefault(r["seed"], {"seed": r["seed"]})[r["loss"]] = {
            "heldout": r["heldout"]["overall"], "wikitext103": r["wikitext103"]}
    return [p for _, p in sorted(by_seed.items()) if "independent" in p and "summed" in p]
