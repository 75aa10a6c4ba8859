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
rounded down. EGGROLL is charged the same dense FLOPs per member: its shared GEMM does that work,
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
                                  is never repeated)
    OUT/runs/ablation-<loss>-seed<s>/
    OUT/results.md, results.csv, nats_vs_flops.png, nats_vs_wall.png     (zosoma.experiments.report)
    OUT/settings.json             what the results depend on besides each run's configuration:
                                  the evaluation protocol, chunking, routing, tuning (settings())

Runs are independent units of work for an executor (zosoma.runs.executor: inline, or `--jobs`
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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from zosoma.config import RETIRED, ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, load_corpus, load_text
from zosoma.download import find_wikitext103
from zosoma.engines import get_ops
from zosoma.errors import ConfigError, DataError
from zosoma.runs.executor import Inline
from zosoma.runs.folder import CheckpointFallback, RunFolder, changes
from zosoma.runs.records import Failed, Note, Result
from zosoma.runs.single import data_record, load_data
from zosoma.runs.soma import create_soma, lockstep_trainers, open_soma, train_lockstep
from zosoma.runs.trainer import Trainer, from_checkpoint, new_state, train
from zosoma.mixture.cluster import load_clustering
from zosoma.mixture.routing import Ensemble, Router, Whole, evaluate_routed, evaluate_routed_corpus
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
_TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - set(_SET_BY_COMPARISON)
_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}


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
    model = ModelConfig(**_known(raw.get("model", {}), _MODEL_KEYS, f"{where} model"))
    own = _train_table(raw.get("train", {}), where)
    fields = {**shared, **own}
    method = Method(str(raw["name"]), model, TrainConfig(**fields), _int(raw.get("experts", 1), f"{where}: experts"),
                    str(raw.get("loss", "independent")), _names(raw.get("series", ())))
    strategy = make_strategy(method.train)  # a shared setting the strategy ignores must keep its default
    for key in own:  # the method's own settings must all be read
        if key not in COMMON | strategy.options:
            raise ConfigError(f"{where}: {unused_option(strategy, key)}")
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
        _check_run(self.job, self.cmp, {k: run.soma[k] for k in ("experts", "loss", "chunk_size")})
        if m.loss == "summed":
            self.trainers = lockstep_trainers(run, self.ops)
        else:
            self.trainers = [run.trainer(i, self.ops) for i in range(m.experts)]
        for t in self.trainers:
            self._same_config(t.model, t.cfg)
        self.router = Router(load_clustering(self.folder.router), self.cmp.top_k)

    def _same_config(self, model, cfg):
        _check_run(self.job, self.cmp, {"model": dataclasses.asdict(model), "train": dataclasses.asdict(cfg)})

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
        """Skipped steps summed over experts, the guards' verdicts (a run they stopped), every
        restart and dropped expert (--on-divergence restart), the mean final training loss."""
        s = [t.summary() for t in self.trainers]
        finals = [x["final_train_loss"] for x in s if x["final_train_loss"] is not None]
        verdicts = [dict(x["divergence"], expert=i) for i, x in enumerate(s) if x["divergence"]]
        return {"skipped_steps": sum(x["skipped_steps"] for x in s), "divergence": verdicts or None,
                "restarts": [dict(r, expert=i) for i, x in enumerate(s) for r in x["restarts"]],
                "dropped": [dict(x["dropped"], expert=i) for i, x in enumerate(s) if x["dropped"]],
                "final_train_loss": float(np.mean(finals)) if finals else None}

    def totals(self) -> dict:
        s = [t.state for t in self.trainers]
        return {"step": self.step, "flops": float(sum(x.tokens for x in s)) * self.job.method.model.flops_per_token(),
                "wall_s": sum(x.wall_s for x in s)}

    def ensemble(self, top_k: int | None = None) -> Ensemble:
        """The run's model; a SOMA run's router top-k (default the comparison's) over the experts
        it did not drop (fewer when fewer are left)."""
        router = self.router
        if isinstance(router, Router):
            dropped = [i for i, t in enumerate(self.trainers) if t.state.dropped]
            k = min(top_k or router.top_k, len(self.trainers) - len(dropped))
            router = Router(router.clustering, k, router.temperature, dropped)
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
    (result.json) of the same job is read back instead, and one of another configuration refused.
    Returns the result record of zosoma.experiments.report's schema, or None when stopping()
    turned true first (the run is checkpointed where it was)."""
    folder = RunFolder(job.run_dir)
    if folder.read_result() is None:
        with folder.lock(wait=True):  # one writer per run folder (a killed comparison's worker may linger)
            if folder.read_result() is None:
                return _train_and_score(job, cmp, wikitext, stopping, folder)
    result = folder.read_result()
    _check_run(job, cmp, _from_result(result))
    return result


# ------------------------------------------------------------------- a folder bound to its config

def settings(cmp: Comparison) -> dict:
    """What a comparison's results depend on besides each run's own configuration (which its
    checkpoints and result.json record): the evaluation protocol, SOMA's chunking and routing, the
    tuning sweep. OUT is bound to these (RunFolder.bind)."""
    return {"curve_points": cmp.curve_points, "curve_bytes": cmp.curve_bytes, "segment": cmp.segment,
            "context": cmp.context, "top_k": cmp.top_k, "chunk_size": cmp.chunk_size,
            "eval_top_k": list(cmp.eval_top_k), "tuning": dataclasses.asdict(cmp.tuning) if cmp.tuning else None}


def _expected(job: Job, cmp: Comparison) -> dict:
    """The configuration a job's folder must hold (the keys _check_run compares)."""
    m, cfg = job.method, dataclasses.replace(job.method.train, seed=job.seed)
    return {"method": m.name, "experts": m.experts, "loss": m.loss, "series": list(m.series),
            "model": dataclasses.asdict(m.model), "train": dataclasses.asdict(cfg), "chunk_size": cmp.chunk_size}


def _from_result(result: dict) -> dict:
    """What a finished run's record says it was (a field an older zosoma did not write takes its
    default, as a checkpoint's config does)."""
    def config(cls, fields):
        retired = RETIRED.get(cls.__name__, ())
        return {**dataclasses.asdict(cls()), **{k: v for k, v in fields.items() if k not in retired}}
    return {"method": result.get("method"), "experts": result.get("experts"), "loss": result.get("loss"),
            "series": result.get("series", []), "model": config(ModelConfig, result.get("model", {})),
            "train": config(TrainConfig, result.get("train", {}))}


def _check_run(job: Job, cmp: Comparison, found: dict) -> None:
    """Refuse a run folder whose recorded configuration (the fields in `found`) is not the job's."""
    expected = _expected(job, cmp)
    diffs = changes(found, {k: expected[k] for k in found})
    if diffs:
        raise ConfigError(f"{job.run_dir} ({job.method.name}, seed {job.seed}) was made with another configuration "
                          f"({'; '.join(diffs)}): give this comparison another --out")


def _check_folder_of(job: Job, cmp: Comparison) -> dict | None:
    """Refuse a job's folder that holds another configuration, reading only: its finished record,
    else its SOMA description and every expert's checkpoint, else its checkpoint. Returns the
    finished record, or None (nothing yet, an unfinished run, or a SOMA run whose creation was cut
    short: it is redone)."""
    folder = RunFolder(job.run_dir)
    result = folder.read_result()
    if result is not None:
        _check_run(job, cmp, _from_result(result))
        return result
    if folder.is_soma:
        soma = folder.read_soma()
        _check_run(job, cmp, {k: soma[k] for k in ("experts", "loss", "chunk_size")})
        held = [folder.expert(i) for i in range(soma["experts"])]
    elif folder.has_checkpoint:
        _check_run(job, cmp, {"experts": 1})
        held = [folder]
    else:
        held = []
    for f in held:
        ckpt = f.read_checkpoint()
        _check_run(job, cmp, {"model": dataclasses.asdict(ckpt.model), "train": dataclasses.asdict(ckpt.train)})
    return None


def check_folder(cmp: Comparison, out_dir: Path) -> int:
    """Refuse (ConfigError, one line naming what changed) an output folder that other settings,
    or another configuration of any of its runs, left; writes nothing. Returns how many of the
    comparison's runs are finished. With [tuning], the main runs of the tuned methods are known
    only once the sweep has finished; run_comparison checks them then."""
    RunFolder(out_dir).bind("comparison", settings(cmp), write=False)
    sweep = tuning_jobs(cmp, out_dir)
    done = _check_jobs(cmp, sweep)
    main = cmp
    if cmp.tuning is not None:
        if len(done) == len(sweep):
            main, _ = tuned(cmp, done, out_dir)
        else:
            main = dataclasses.replace(cmp, methods=tuple(m for m in cmp.methods if not cmp.tuning.tunes(m)))
    return len(done) + len(_check_jobs(main, jobs(main, out_dir)))


def _check_jobs(cmp: Comparison, todo: list[Job]) -> dict[str, dict]:
    """Check every job's folder against the job; the finished ones' records by run folder."""
    done = {job.run_dir: _check_folder_of(job, cmp) for job in todo}
    return {run_dir: result for run_dir, result in done.items() if result is not None}


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
    return folder.read_result()  # as a rerun reads it back (JSON: tuples are lists)


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
        check_folder(cmp, out_dir)  # nothing trains in a folder another configuration left
        RunFolder(out_dir).bind("comparison", settings(cmp))
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
        if cmp.tuning is not None:
            _check_jobs(cmp, todo)  # the tuned methods' main runs, known only now
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
