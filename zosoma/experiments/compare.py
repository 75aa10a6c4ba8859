"""The equal-compute comparison: SOMA against monolithic SPSA and EGGROLL at the same total
parameter count and the same forward-FLOP budget, over several seeds; and the ablation of
independent against summed expert losses.

A comparison is a TOML file (the shipped ones are in zosoma/experiments/configs/: `zosoma compare cpu`):

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
rounded down. The steps a restart re-runs are spent too: a model that restarted stops when its
share is spent, at a lower step (zosoma.runs.trainer, Trainer.spent), so no run spends more than
the budget; the report puts each method's spend beside it and marks a run over it. EGGROLL is charged the same dense FLOPs per member: its shared GEMM does that work,
and its rank-r corrections are left out like the gate math. Wall time is training seconds (no
evaluation) summed over a run's experts, i.e. aggregate compute time as the paper's GPU-hours.

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
them): independent units of work for an executor (zosoma.runs.executor: inline, or `--jobs`
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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import Corpus, load_corpus, load_text
from zosoma.download import find_wikitext103
from zosoma.errors import ConfigError
from zosoma.experiments.report import lost
from zosoma.experiments.study import Run, Spec, StudyFolder
from zosoma.runs.events import EventLog
from zosoma.runs.folder import NUMBER
from zosoma.strategies.settings import MODEL_KEYS, TRAIN_KEYS, resolve

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
    """A path, or the name of a shipped config (`cpu` -> zosoma/experiments/configs/cpu.toml)."""
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
        shared = dict(_train_table(raw.get("train", {}), str(path)))
        budget = _positive_number(raw["flops"], f"{path}: flops")
        methods = tuple(_method(m, shared, f"{path} [[method]] {m.get('name', '?') if isinstance(m, dict) else '?'}",
                                budget=budget) for m in _list(raw.get("method", []), f"{path}: [[method]]"))
        ablation, ablation_seeds = (), ()
        if "ablation" in raw:
            a = dict(_known(raw["ablation"], {"seeds", "experts", "steps", "model", "train"}, f"{path} [ablation]"))
            ablation_seeds = _seeds(a.pop("seeds"), f"{path} [ablation]: seeds")
            steps = _int(a["steps"], f"{path} [ablation]: steps")
            ablation = tuple(_method({"name": f"ablation {loss}", "loss": loss, **a}, shared, f"{path} [ablation]",
                                     steps=steps) for loss in ("independent", "summed"))
        tuning = None
        if "tuning" in raw:
            where = f"{path} [tuning]"
            t = _known(raw["tuning"], {"seed", "lr_factors", "sigma_factors", "methods"}, where)
            factors = {k: tuple(_positive_number(x, f"{where}: {k}") for x in _list(t[k], f"{where}: {k}"))
                       for k in ("lr_factors", "sigma_factors") if k in t}
            tuning = Tuning(seed=_seed(t.get("seed", Tuning.seed), f"{where}: seed"), **factors,
                            methods=_names(t["methods"]) if "methods" in t else None)
        lowest = {"curve_points": 1, "curve_bytes": 2, "segment": 1, "context": 1, "top_k": 1, "chunk_size": 1}
        top_k = tuple(_int(k, f"{path}: eval_top_k") for k in _list(raw.get("eval_top_k", []), f"{path}: eval_top_k"))
        cmp = Comparison(title=str(raw.get("title", Path(path).stem)), seeds=_seeds(raw["seeds"], f"{path}: seeds"),
                         flops=budget, methods=methods, ablation=ablation, ablation_seeds=ablation_seeds,
                         tuning=tuning, eval_top_k=top_k,
                         **{k: _int(raw[k], f"{path}: {k}", low) for k, low in lowest.items() if k in raw})
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
    return cmp


def _known(table, keys: set, where: str) -> dict:
    """The TOML table, refused in one line when it holds a key not in `keys` (naming those that are)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table, got {table!r}")
    unknown = sorted(set(table) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(keys))})")
    return table


_SET_BY_COMPARISON = ("steps", "seed", "checkpoint_every")  # the budget, the run and resumability set these
_TRAIN_KEYS = TRAIN_KEYS - set(_SET_BY_COMPARISON)


def _train_table(table, where: str) -> dict:
    """A train table: TrainConfig's fields, less those the comparison sets."""
    for key in _SET_BY_COMPARISON:
        if isinstance(table, dict) and key in table:
            raise ConfigError(f"{where}: train.{key} is set by the comparison, not the config")
    return _known(table, _TRAIN_KEYS, f"{where} train")


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"{what} must be a list, got {value!r}")
    return value


def _int(value, what: str, low: int = 1) -> int:
    """A TOML integer >= low (true and false are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _seed(value, what: str, one: str = "an integer") -> int:
    """A seed as every run takes it (TrainConfig: [0, 2**63)), checked before any run starts."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ConfigError(f"{what} must be {one} in [0, 2**63), got {value!r}")
    return value


def _seeds(value, what: str) -> tuple[int, ...]:
    seeds = tuple(_seed(s, what, "integers") for s in _list(value, what))
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{what} must be distinct, got {list(seeds)}")
    return seeds


def _positive_number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _method(raw: dict, shared: dict, where: str, budget: float | None = None, steps: int | None = None) -> Method:
    """One method's table (`where` names it in errors) with the shared train fields under its own;
    its steps are the budget's, or `steps`."""
    _known(raw, {"name", "experts", "loss", "model", "train", "steps", "series"}, where)
    given = {**_known(raw.get("model", {}), MODEL_KEYS, f"{where} model"), **_train_table(raw.get("train", {}), where)}
    try:
        model, train_cfg = resolve(None, given, shared, loss=str(raw.get("loss", "independent")))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    method = Method(str(raw["name"]), model, train_cfg, _int(raw.get("experts", 1), f"{where}: experts"),
                    str(raw.get("loss", "independent")), _names(raw.get("series", ())))
    if steps is None:
        steps = int(budget // method.flops_per_step())
        if steps < 1:
            raise ConfigError(f"{where}: the budget of {budget:.3g} FLOPs is less than one step "
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
        """What its result.json must hold (zosoma.runs.folder.record_problem): what the report reads."""
        scores = ({"validation": NUMBER} if self.tuning else
                  {"heldout": {"overall": NUMBER}, "wikitext103": (*NUMBER, type(None))})
        return {"method": str, "kind": str, "seed": int, "experts": int, "n_params": int, "steps": int,
                "flops": NUMBER, "wall_s": NUMBER, "curve": list, "model": dict, "train": dict, **scores}

    @property
    def spec(self) -> Spec:
        m = self.method
        return Spec(m.model, dataclasses.replace(m.train, seed=self.seed), m.experts, m.loss, self.cmp.chunk_size,
                    self.cmp.top_k)

    def expected(self) -> dict:
        return {"method": self.method.name, "series": list(self.method.series), **self.spec.record()}

    def score(self, run: Run, stopping: Callable[[], bool]) -> dict | None:
        """Train the run to its budget, recording the held-out curve, and evaluate it: the result
        record of zosoma.experiments.report's schema, or None when stopping() turned true first."""
        cmp, folder = self.cmp, run.folder
        protocol = dict(segment=cmp.segment, context=cmp.context)
        curve = folder.read_curve()
        events = EventLog(folder.path)  # the run's curve and final figures for TensorBoard
        if self.curve:
            subset = Corpus(run.heldout.names, tuple(d[:cmp.curve_bytes] for d in run.heldout.docs))
            for target in curve_steps(run.cfg.steps, cmp.curve_points):
                if run.step > target:
                    continue  # passed before a restart; its point was recorded then
                if not run.advance(target, stopping):
                    return None
                if run.diverged:
                    break  # scored below where the guard stopped it
                if run.step not in {p["step"] for p in curve}:  # one point where a run stopped short
                    point = {**run.totals(), "heldout": run.score(subset, **protocol)["overall"]}
                    curve.append(point)
                    folder.append_curve(point)
                    events.evaluation(point["step"], point["heldout"], tag="eval/heldout_curve")
        elif not run.advance(run.cfg.steps, stopping):
            return None
        m = self.method
        result = {"method": m.name, "kind": m.kind, "seed": self.seed, "loss": m.loss, "experts": m.experts,
                  "series": list(m.series), "n_params": m.experts * m.model.n_params(), "steps": run.cfg.steps,
                  **run.totals(), **run.training(), "curve": sorted(curve, key=lambda p: p["step"]),
                  "model": dataclasses.asdict(m.model), "train": dataclasses.asdict(run.cfg)}
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


def jobs(cmp: Comparison, device: str = "cpu", wikitext: str | None = None) -> list[Job]:
    """The comparison's main runs (its methods as configured or tuned) and the ablation's."""
    out = [Job(f"{slug(m.name)}-seed{s}", m, s, cmp, True, device=device, wikitext=wikitext)
           for s in cmp.seeds for m in cmp.methods]
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


def curve_steps(steps: int, points: int) -> list[int]:
    """0 and `points` evenly spaced steps ending at `steps` (fewer when steps < points)."""
    return sorted({0} | {math.ceil(steps * k / points) for k in range(1, points + 1)})


# ------------------------------------------------------------------- a folder bound to its config

def settings(cmp: Comparison) -> dict:
    """What a comparison's results depend on besides each run's own configuration (which its
    checkpoints and result.json record): the evaluation protocol, SOMA's chunking and routing, the
    tuning sweep. OUT is bound to these (RunFolder.bind)."""
    return {"curve_points": cmp.curve_points, "curve_bytes": cmp.curve_bytes, "segment": cmp.segment,
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
    """Run every job not yet finished through `executor` (zosoma.runs.executor; default inline),
    then write the report. With [tuning], first the sweep (tuning_jobs), then the main runs at
    each method's winning setting. on_result(job, result, error) is called as each job ends.
    When should_stop() turns true every run checkpoints and stops, and Stopped is raised. Returns
    the report's paths; raises ZosomaError when a job failed (the others still run to the end,
    and the report is written from the finished ones)."""
    from zosoma.experiments.report import write_report
    from zosoma.yardsticks import lookup

    out_dir = Path(out_dir)
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
    yardsticks = lookup(load_corpus(None, "heldout"), wikitext, cmp.segment, cmp.context)
    paths = (write_report(main, pairs, out_dir, cmp.title, tuning=rows, budget=cmp.flops, yardsticks=yardsticks)
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
