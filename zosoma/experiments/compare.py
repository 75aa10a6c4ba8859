"""The equal-compute comparison: SOMA against monolithic SPSA and EGGROLL at the same total
parameter count and the same forward-FLOP budget, over several seeds; and the ablation of
independent against summed expert losses.

A comparison is a TOML file (the shipped ones are in zosoma/configs/: `zosoma compare cpu`):

    title = "..."
    seeds = [0, 1, 2]
    flops = 1.5e13            # forward-FLOP budget of every run (all members of all experts)
    curve_points = 8          # held-out evaluations along training (step 0 is added)
    curve_bytes = 8192        # bytes of each held-out file scored at those points
    train = {batch = 8, seq_len = 32}          # TrainConfig fields shared by every method

    [[method]]
    name = "SOMA N=2, P=64"
    experts = 2                                # default 1: one monolithic model
    model = {embed = 32, hidden = 64, layers = 1}
    train = {perturbations = 64, lr = 0.15}    # the method's own TrainConfig fields

    [ablation]                                 # optional: independent vs summed losses
    seeds = [0, 1, 2]
    experts = 4
    steps = 1000
    model = {...}
    train = {...}

Compute accounting. Forward FLOPs are the nominal ModelConfig.flops_per_token (every matmul of
the LSTM and the output layer, multiply-add = 2) times the bytes pushed through forward passes,
2P * B * T per step per expert; a method's steps are the budget divided by its FLOPs per step,
rounded down. EGGROLL is charged the same dense FLOPs per member: its shared GEMM does that work,
and its rank-r corrections are left out like the gate math. Wall time is training seconds (no
evaluation) summed over a run's experts, i.e. aggregate compute time as the paper's GPU-hours.

Evaluation. Every method is scored by one protocol, the routed one of zosoma.soma.routing: segments of
`segment` predicted bytes, each after `context` bytes of warm-up (and, for SOMA, routing) context.
A monolithic model is an ensemble of one expert with weight 1, which scores exactly as the model.

Output folder:

    OUT/runs/<method>-seed<s>/    one run folder per method and seed: a SOMA folder, or a single
                                  model's (`zosoma eval`, `zosoma info` and `zosoma train
                                  --resume` read both); plus curve.jsonl (the held-out curve)
                                  and result.json (the final evaluation: the run is finished and
                                  is never repeated)
    OUT/runs/ablation-<loss>-seed<s>/
    OUT/results.md, results.csv, nats_vs_flops.png, nats_vs_wall.png     (zosoma.experiments.report)

Runs are independent units of work for an executor (zosoma.runs.executor: inline, or `--jobs`
worker processes with one BLAS thread each on a machine with as many cores); a killed comparison
resumes every unfinished run from its checkpoints, and a run folder started under a different
configuration is refused rather than mixed. With device "cuda" every run trains and is evaluated
on the GPU; checkpoints stay device-independent, so a run may resume on the other device.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, load_corpus, load_text
from zosoma.download import find_wikitext103
from zosoma.engines import get_ops
from zosoma.errors import ConfigError, DataError
from zosoma.runs.executor import Inline
from zosoma.runs.folder import CheckpointFallback, RunFolder
from zosoma.runs.records import Failed, Note, Result
from zosoma.runs.single import data_record, load_data
from zosoma.runs.soma import create_soma, lockstep_trainers, open_soma, train_lockstep
from zosoma.runs.trainer import Trainer, from_checkpoint, new_state, train
from zosoma.soma.cluster import load_clustering
from zosoma.soma.routing import Ensemble, Router, Whole, evaluate_routed, evaluate_routed_corpus
from zosoma.strategies import make_strategy
from zosoma.strategies.base import COMMON, unused_option

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


# --------------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class Method:
    name: str
    model: ModelConfig
    train: TrainConfig  # steps already set from the budget; seed set per run
    experts: int = 1
    loss: str = "independent"
    series: tuple[str, ...] = ()  # curves the method is a point of (the N-curve: "equal params", ...)

    @property
    def kind(self) -> str:
        if self.experts > 1:
            return "soma"
        return self.train.optimizer if self.train.optimizer in ("eggroll", "es") else "spsa"

    def flops_per_step(self) -> float:
        t = self.train
        return self.experts * 2 * t.perturbations * t.batch * t.seq_len * self.model.flops_per_token()


@dataclass(frozen=True)
class Comparison:
    title: str
    seeds: tuple[int, ...]
    flops: float
    methods: tuple[Method, ...]
    ablation: tuple[Method, ...]  # (independent, summed), or () when the file has none
    ablation_seeds: tuple[int, ...]
    curve_points: int = 8
    curve_bytes: int = 8192
    segment: int = 256
    context: int = 512
    top_k: int = 2
    chunk_size: int = 2048
    tuning: Tuning | None = None
    eval_top_k: tuple[int, ...] = ()  # also score every run routed top-k with each of these k


@dataclass(frozen=True)
class Tuning:
    """Equal tuning for every method (or the methods named): the learning rate (and sigma, for
    EGGROLL and ES) at each factor of its configured value, one seed, the full budget, scored on
    the validation split; a diverged run counts as a loss. The winner then runs every seed of the
    comparison; a method not named runs as configured."""
    seed: int = 0
    lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    sigma_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    methods: tuple[str, ...] | None = None  # None: every method

    def tunes(self, method: Method) -> bool:
        return self.methods is None or method.name in self.methods


_TOP_KEYS = {"title", "seeds", "flops", "curve_points", "curve_bytes", "segment", "context", "top_k",
             "chunk_size", "train", "method", "ablation", "tuning", "eval_top_k"}


def find_config(name: str) -> Path:
    """A path, or the name of a shipped config (`cpu` -> zosoma/configs/cpu.toml)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{name}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"{name}: no such file, and not a shipped comparison ({names})")


def load_comparison(path: Path) -> Comparison:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    _known(raw, _TOP_KEYS, str(path))
    try:
        shared = dict(raw.get("train", {}))
        budget = float(raw["flops"])
        methods = tuple(_method(m, shared, budget=budget) for m in raw.get("method", []))
        ablation, ablation_seeds = (), ()
        if "ablation" in raw:
            a = dict(raw["ablation"])
            _known(a, {"seeds", "experts", "steps", "model", "train"}, f"{path} [ablation]")
            ablation_seeds = tuple(int(s) for s in a.pop("seeds"))
            ablation = tuple(_method({"name": f"ablation {loss}", "loss": loss, **a}, shared, steps=a["steps"])
                             for loss in ("independent", "summed"))
        tuning = None
        if "tuning" in raw:
            t = dict(raw["tuning"])
            _known(t, {"seed", "lr_factors", "sigma_factors", "methods"}, f"{path} [tuning]")
            names = _names(t.pop("methods")) if "methods" in t else None
            tuning = Tuning(**{k: (int(v) if k == "seed" else tuple(float(x) for x in v)) for k, v in t.items()},
                            methods=names)
        cmp = Comparison(title=str(raw.get("title", Path(path).stem)), seeds=tuple(int(s) for s in raw["seeds"]),
                         flops=budget, methods=methods, ablation=ablation, ablation_seeds=ablation_seeds,
                         tuning=tuning, eval_top_k=tuple(int(k) for k in raw.get("eval_top_k", ())),
                         **{k: int(raw[k]) for k in ("curve_points", "curve_bytes", "segment", "context",
                                                      "top_k", "chunk_size") if k in raw})
    except KeyError as e:
        raise ConfigError(f"{path}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not cmp.methods or not cmp.seeds:
        raise ConfigError(f"{path}: needs at least one [[method]] and one seed")
    names = [m.name for m in cmp.methods]
    if len(set(map(slug, names))) != len(names):
        raise ConfigError(f"{path}: method names must be distinct: {names}")
    unknown = sorted(set(cmp.tuning.methods or ()) - set(names)) if cmp.tuning else []
    if unknown:
        raise ConfigError(f"{path} [tuning]: no such method(s) {unknown}; the methods are {names}")
    if cmp.curve_points < 1 or cmp.curve_bytes < 2:
        raise ConfigError(f"{path}: curve_points must be >= 1 and curve_bytes >= 2")
    return cmp


def _known(table: dict, keys: set, where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(keys))})")


def _method(raw: dict, shared: dict, budget: float | None = None, steps: int | None = None) -> Method:
    _known(raw, {"name", "experts", "loss", "model", "train", "steps", "series"}, f"method {raw.get('name', '?')}")
    model = ModelConfig(**raw.get("model", {}))
    fields = {**shared, **raw.get("train", {})}
    for key in ("steps", "seed", "checkpoint_every"):  # the budget, the run and resumability set these
        if key in fields:
            raise ConfigError(f"method {raw['name']}: train.{key} is set by the comparison, not the config")
    method = Method(str(raw["name"]), model, TrainConfig(**fields), int(raw.get("experts", 1)),
                    str(raw.get("loss", "independent")), _names(raw.get("series", ())))
    strategy = make_strategy(method.train)  # a shared setting the strategy ignores must keep its default
    for key in raw.get("train", {}):  # the method's own settings must all be read
        if key not in COMMON | strategy.options:
            raise ConfigError(f"method {method.name}: {unused_option(strategy, key)}")
    if steps is None:
        steps = int(budget // method.flops_per_step())
        if steps < 1:
            raise ConfigError(f"method {method.name}: the budget of {budget:.3g} FLOPs is less than one step "
                              f"({method.flops_per_step():.3g} FLOPs)")
    train_cfg = dataclasses.replace(method.train, steps=int(steps), checkpoint_every=min(500, int(steps)))
    return dataclasses.replace(method, train=train_cfg)


def _names(value) -> tuple[str, ...]:
    """A TOML string or list of strings as a tuple."""
    return (str(value),) if isinstance(value, str) else tuple(str(v) for v in value)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class Job:
    run_dir: str
    method: Method
    seed: int
    curve: bool  # the ablation and the tuning sweep need final figures only
    device: str = "cpu"  # where forward passes run (training and evaluation); results do not move
    tuning: bool = False  # a sweep run: scored on the validation split only


def jobs(cmp: Comparison, out_dir: Path, device: str = "cpu") -> list[Job]:
    """The comparison's main runs (its methods as configured or tuned) and the ablation's."""
    runs = Path(out_dir) / "runs"
    out = [Job(str(runs / f"{slug(m.name)}-seed{s}"), m, s, True, device) for s in cmp.seeds for m in cmp.methods]
    out += [Job(str(runs / f"{slug(m.name)}-seed{s}"), m, s, False, device) for s in cmp.ablation_seeds
            for m in cmp.ablation]
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


def tuning_jobs(cmp: Comparison, out_dir: Path, device: str = "cpu") -> list[Job]:
    """Every method at every tuned setting, the tuning seed, the full budget (runs/tune/...)."""
    if cmp.tuning is None:
        return []
    tune = Path(out_dir) / "runs" / "tune"
    return [Job(str(tune / f"{slug(m.name)}-{slug(label)}-seed{cmp.tuning.seed}"), v, cmp.tuning.seed, False,
                device, tuning=True)
            for m in cmp.methods if cmp.tuning.tunes(m) for label, v in variants(m, cmp.tuning)]


def tuned(cmp: Comparison, results: dict[str, dict], out_dir: Path) -> tuple[Comparison, list[dict]]:
    """The comparison with each tuned method at its best setting on validation (a diverged run
    loses), and one row per sweep run for the tuning table."""
    rows, methods = [], []
    sweep = tuning_jobs(cmp, out_dir)
    for m in cmp.methods:
        if cmp.tuning.tunes(m):
            m = _best(m, cmp.tuning, [results[j.run_dir] for j in sweep if j.method.name == m.name], rows)
        methods.append(m)
    return dataclasses.replace(cmp, methods=tuple(methods)), rows


def _best(method: Method, tuning: Tuning, results: list[dict], rows: list[dict]) -> Method:
    """The setting of `method` whose sweep run (results, in variants' order) scored best; appends
    one tuning-table row per setting, the winner's marked chosen."""
    best = None
    for (label, v), r in zip(variants(method, tuning), results):
        score = math.inf if r.get("divergence") else r["validation"]
        rows.append({"method": method.name, "setting": label, "lr": v.train.lr, "eps": v.train.eps,
                     "validation": r["validation"], "diverged": bool(r.get("divergence")),
                     "final_train_loss": r.get("final_train_loss"), "chosen": False})
        if best is None or score < best[0]:
            best = (score, v, len(rows) - 1)
    rows[best[2]]["chosen"] = True
    return best[1]


# ------------------------------------------------------------------------------------------ runs

class _Run:
    """The trainers of one job's run folder (one, or one per expert) and how to score them."""

    def __init__(self, job: Job, cmp: Comparison):
        self.job, self.cmp, self.folder = job, cmp, RunFolder(job.run_dir)
        self.ops = get_ops(job.device)
        m = job.method
        self.cfg = dataclasses.replace(m.train, seed=job.seed)
        if m.experts > 1:
            self._open_soma()
        else:
            self._open_single()

    def _open_single(self):
        m, cfg = self.job.method, self.cfg
        train_corpus, self.heldout = load_data(None, None)
        data = data_record(train_corpus)
        if self.folder.has_checkpoint:
            ckpt = self.folder.read_checkpoint(set_aside=True)
            self._same_config(ckpt.model, ckpt.train)
            if ckpt.extra.get("data", {}).get("fingerprint") != data["fingerprint"]:
                raise DataError(f"{self.folder}: the training data changed since the run started")
            state = from_checkpoint(ckpt)
        else:
            state = None
        sampler = BatchSampler(train_corpus, cfg.seq_len + 1)
        trainer = Trainer(self.folder, m.model, cfg, sampler, state or new_state(m.model, cfg),
                          extra={"data": data}, ops=self.ops)
        if state is None:
            trainer.checkpoint()  # step 0, as `zosoma train` leaves it
        self.trainers, self.router = [trainer], Whole()

    def _open_soma(self):
        m, cfg = self.job.method, self.cfg
        if not self.folder.is_soma:  # new, or a creation cut short: the job's own folder, redone
            create_soma(self.folder.path, m.model, cfg, m.experts, m.loss, self.cmp.chunk_size, top_k=self.cmp.top_k,
                        new_folder=False)
        run = open_soma(self.folder.path)
        self.heldout = run.heldout
        if (run.soma["experts"], run.soma["loss"], run.soma["chunk_size"]) != (m.experts, m.loss, self.cmp.chunk_size):
            self._refuse()
        if m.loss == "summed":
            self.trainers = lockstep_trainers(run, self.ops)
        else:
            self.trainers = [run.trainer(i, self.ops) for i in range(m.experts)]
        for t in self.trainers:
            self._same_config(t.model, t.cfg)
        self.router = Router(load_clustering(self.folder.router), self.cmp.top_k)

    def _same_config(self, model, cfg):
        if model != self.job.method.model or cfg != self.cfg:
            self._refuse()

    def _refuse(self):
        raise ConfigError(f"{self.folder} was started with another configuration; remove it or choose "
                          "another output folder")

    @property
    def step(self) -> int:
        return min(t.state.step for t in self.trainers)

    def advance(self, target: int, stopping: Callable[[], bool]) -> bool:
        """Train every expert to step `target` (checkpointed there); False when asked to stop
        (every expert is checkpointed where it was). A run the divergence guard stopped trains no
        further: it is scored where it stopped, and its result says so."""
        if self.diverged:
            return not stopping()
        if self.job.method.loss == "summed":
            _drain(train_lockstep(self.trainers, lambda: self.trainers[0].state.step >= target or stopping()))
        else:
            for t in self.trainers:
                _drain(train(t, lambda t=t: t.state.step >= target or stopping() or self.diverged))
        return not stopping()

    @property
    def diverged(self) -> bool:
        return any(t.state.divergence is not None and t.cfg.on_divergence == "stop" for t in self.trainers)

    def training(self) -> dict:
        """Skipped steps summed over experts, the guards' verdicts, the mean final training loss."""
        s = [t.summary() for t in self.trainers]
        finals = [x["final_train_loss"] for x in s if x["final_train_loss"] is not None]
        verdicts = [dict(x["divergence"], expert=i) for i, x in enumerate(s) if x["divergence"]]
        return {"skipped_steps": sum(x["skipped_steps"] for x in s), "divergence": verdicts or None,
                "final_train_loss": float(np.mean(finals)) if finals else None}

    def totals(self) -> dict:
        s = [t.state for t in self.trainers]
        return {"step": self.step, "flops": float(sum(x.tokens for x in s)) * self.job.method.model.flops_per_token(),
                "wall_s": sum(x.wall_s for x in s)}

    def ensemble(self, top_k: int | None = None) -> Ensemble:
        router = self.router
        if top_k is not None and isinstance(router, Router):
            router = Router(router.clustering, top_k, router.temperature)
        return Ensemble(tuple((t.state.theta, t.layout) for t in self.trainers), router)

    def score(self, corpus: Corpus, top_k: int | None = None) -> dict:
        """Nats/byte of the (routed) model on each name of corpus, and "overall"."""
        by = evaluate_routed_corpus(self.ensemble(top_k), corpus, self.ops, segment=self.cmp.segment,
                                    context=self.cmp.context)
        return {name: r["routed"].nats_per_byte for name, r in by.items()}

    def score_bytes(self, data: np.ndarray) -> float:
        return evaluate_routed(self.ensemble(), data, segment=self.cmp.segment, context=self.cmp.context,
                               ops=self.ops)["routed"].nats_per_byte


def _drain(records: Iterator) -> None:
    for _ in records:
        pass


def curve_steps(steps: int, points: int) -> list[int]:
    """0 and `points` evenly spaced steps ending at `steps` (fewer when steps < points)."""
    return sorted({0} | {math.ceil(steps * k / points) for k in range(1, points + 1)})


def run_job(job: Job, cmp: Comparison, wikitext: str | None = None,
            stopping: Callable[[], bool] = lambda: False) -> dict | None:
    """Train one run to its budget, recording the held-out curve, and evaluate it; a finished run
    (result.json) is read back instead. Returns the result record of zosoma.experiments.report's schema, or
    None when stopping() turned true first (the run is checkpointed where it was)."""
    folder = RunFolder(job.run_dir)
    if folder.read_result() is None:
        with folder.lock(wait=True):  # one writer per run folder (a killed comparison's worker may linger)
            return folder.read_result() or _train_and_score(job, cmp, wikitext, stopping, folder)
    return folder.read_result()


def _train_and_score(job: Job, cmp: Comparison, wikitext, stopping, folder: RunFolder) -> dict | None:
    run = _Run(job, cmp)
    curve = folder.read_curve()
    if job.curve:
        subset = Corpus(run.heldout.names, tuple(d[:cmp.curve_bytes] for d in run.heldout.docs))
        for target in curve_steps(run.cfg.steps, cmp.curve_points):
            if run.step > target:
                continue  # passed before a restart; its point was recorded then
            if not run.advance(target, stopping):
                return None
            if run.diverged:
                break  # scored below where the guard stopped it
            if target not in {p["step"] for p in curve}:
                point = {**run.totals(), "heldout": run.score(subset)["overall"]}
                curve.append(point)
                folder.append_curve(point)
    elif not run.advance(run.cfg.steps, stopping):
        return None
    m = job.method
    result = {"method": m.name, "kind": m.kind, "seed": job.seed, "loss": m.loss, "experts": m.experts,
              "series": list(m.series), "n_params": m.experts * m.model.n_params(), "steps": run.cfg.steps,
              **run.totals(), **run.training(), "curve": sorted(curve, key=lambda p: p["step"]),
              "model": dataclasses.asdict(m.model), "train": dataclasses.asdict(run.cfg)}
    if job.tuning:  # tuning reads the validation split only
        result["validation"] = run.score(load_corpus(None, "validation"))["overall"]
    else:
        wiki = find_wikitext103(wikitext)
        result["heldout"] = run.score(run.heldout)
        result["wikitext103"] = run.score_bytes(load_text(wiki)) if wiki else None
        result["heldout_by_k"] = {str(k): run.score(run.heldout, k)["overall"]
                                  for k in cmp.eval_top_k if k <= m.experts}
    folder.write_result(result)
    return result


@dataclass(frozen=True)
class JobUnit:
    """One comparison run as an idempotent unit of work (zosoma.runs.executor)."""
    job: Job
    cmp: Comparison
    wikitext: str | None = None

    @property
    def run_dir(self) -> str:
        return self.job.run_dir

    def __call__(self, stopping: Callable[[], bool]) -> Iterator:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointFallback)
            result = run_job(self.job, self.cmp, self.wikitext, stopping)
        yield from (Note(str(w.message)) for w in caught)
        if result is not None:
            yield Result(self.job.run_dir, result)


# ----------------------------------------------------------------------------------------- driver

class Stopped(Exception):
    """The comparison was asked to stop: every unfinished run is checkpointed where it was."""


def run_comparison(cmp: Comparison, out_dir: Path, executor=None, wikitext: str | None = None,
                   device: str = "cpu", should_stop: Callable[[], bool] = lambda: False,
                   on_result: Callable[[Job, dict | None, str | None], None] = lambda j, r, e: None) -> dict:
    """Run every job not yet finished through `executor` (zosoma.runs.executor; default inline),
    then write the report. With [tuning], first the sweep (tuning_jobs), then the main runs at
    each method's winning setting. on_result(job, result, error) is called as each job ends.
    When should_stop() turns true every run checkpoints and stops, and Stopped is raised. Returns
    the report's paths; raises ZosomaError when a job failed (the others still run to the end,
    and the report is written from the finished ones)."""
    from zosoma.experiments.report import write_report

    out_dir = Path(out_dir)
    results: dict[str, dict] = {}
    errors: list[str] = []
    rows = None
    with RunFolder(out_dir).lock():  # one comparison at a time in an output folder
        if cmp.tuning is not None:
            sweep = tuning_jobs(cmp, out_dir, device)
            _run_jobs(executor, cmp, sweep, wikitext, should_stop, on_result, results, errors)
            if should_stop():
                raise Stopped(f"stopped during tuning: {len(results)} of {len(sweep)} sweep runs finished; the "
                              "same command resumes the rest")
            if errors:
                raise ConfigError(f"{len(errors)} tuning run(s) failed; the first: {errors[0]}")
            cmp, rows = tuned(cmp, results, out_dir)
        todo = jobs(cmp, out_dir, device)
        _run_jobs(executor, cmp, todo, wikitext, should_stop, on_result, results, errors)
    if should_stop():
        raise Stopped(f"stopped: {sum(j.run_dir in results for j in todo)} of {len(todo)} runs finished; the "
                      "same command resumes the rest")
    main = [results[j.run_dir] for j in todo if j.curve and j.run_dir in results]
    pairs = ablation_pairs([results[j.run_dir] for j in todo if not j.curve and j.run_dir in results])
    paths = write_report(main, pairs, out_dir, cmp.title, tuning=rows) if main else {}
    if errors:
        raise ConfigError(f"{len(errors)} run(s) failed; the first: {errors[0]}")
    return paths


def _run_jobs(executor, cmp, todo, wikitext, should_stop, on_result, results, errors) -> None:
    for record in (executor or Inline()).run([JobUnit(job, cmp, wikitext) for job in todo], should_stop):
        if isinstance(record, Note):
            warnings.warn(record.message, CheckpointFallback, stacklevel=2)
        elif isinstance(record, Result):
            results[record.unit] = record.value
            on_result(next(j for j in todo if j.run_dir == record.unit), record.value, None)
        elif isinstance(record, Failed):
            job = todo[record.unit]
            errors.append(f"{job.run_dir}: {record.error}")
            on_result(job, None, errors[-1])


def ablation_pairs(results: list[dict]) -> list[dict]:
    """zosoma.experiments.report's ablation input: per seed, each loss mode's overall held-out and WikiText."""
    by_seed: dict[int, dict] = {}
    for r in results:
        by_seed.setdefault(r["seed"], {"seed": r["seed"]})[r["loss"]] = {
            "heldout": r["heldout"]["overall"], "wikitext103": r["wikitext103"]}
    return [p for _, p in sorted(by_seed.items()) if "independent" in p and "summed" in p]
