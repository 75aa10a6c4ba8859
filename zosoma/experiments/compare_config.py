"""The comparison's configuration: its TOML file, read and checked in full before anything runs
(a bad value is refused in one line naming it), into a Comparison of Methods; the runner is
zosoma.experiments.compare.

A comparison is a TOML file (the shipped ones are in zosoma/experiments/configs/: `zosoma compare cpu`):

    title = "..."
    seeds = [0, 1, 2]
    flops = 1.5e13            # forward-FLOP budget of every run (all members of all experts); may be
                              # left out when every method gives its own steps
    curve_points = 8          # held-out evaluations along training (step 0 is added)
    curve_spacing = "linear"  # or "log": the points evenly spaced in log(step), most of them early
    price_levels = [2.86, 2.5]  # optional: the report's price of zero-order (zosoma.experiments.price):
                              # the CPU-seconds each method needs to reach these held-out levels
    curve_bytes = 8192        # bytes of each held-out file scored at those points
    train = {batch = 8, seq_len = 32}          # TrainConfig fields shared by every method

    [[method]]
    name = "SOMA N=2, P=64"
    experts = 2                                # default 1: one monolithic model
    model = {embed = 32, hidden = 64, layers = 1}
    train = {perturbations = 64, lr = 0.15}    # the method's own TrainConfig fields (no optimizer:
                                               # the paper's SPSA, ESTIMATOR)
    steps = 4000                               # optional: its own steps, not the budget's
    seeds = [0]                                # optional: some of the seeds only

    [[method]]
    name = "backprop"                          # the backprop baseline (zosoma.experiments.backprop)
    model = {embed = 32, hidden = 64}
    train = {optimizer = "backprop", lr = 3e-3}  # Adam(W): lr, momentum (beta1), beta2, weight_decay

    [ablation]                                 # optional: independent vs summed losses
    seeds = [0, 1, 2]
    experts = 4
    steps = 1000
    model = {...}
    train = {...}
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from zosoma.config import ModelConfig, TrainConfig
from zosoma.errors import ConfigError
from zosoma.experiments.backprop import BACKPROP, flops_per_step as backprop_flops, resolve_backprop
from zosoma.model.protocol import PROTOCOL
from zosoma.strategies.settings import MODEL_KEYS, TRAIN_KEYS, resolve

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

@dataclass(frozen=True)
class Method:
    name: str
    model: ModelConfig
    train: TrainConfig  # steps already set from the budget; seed set per run
    experts: int = 1
    loss: str = "independent"
    series: tuple[str, ...] = ()  # curves the method is a point of (the N-curve: "equal params", ...)
    seeds: tuple[int, ...] | None = None  # some of the comparison's seeds only (None: every one)

    @property
    def kind(self) -> str:
        if self.experts > 1:
            return "soma"
        return self.train.optimizer if self.train.optimizer in ("eggroll", "es", BACKPROP) else "spsa"

    def flops_per_step(self) -> float:
        """Forward FLOPs of a mean step: N experts x 2 P x B x T tokens, P the query schedule's
        mean (zosoma.strategies.queries: the constant P, unless it grows), plus each expert's
        strategy's extra arithmetic (Strategy.extra_flops: the readout's local gradient)."""
        from zosoma.strategies import STRATEGIES
        from zosoma.strategies.queries import make_queries
        t = self.train
        if t.optimizer == BACKPROP:  # a forward and a backward pass (zosoma.experiments.backprop)
            return backprop_flops(self.model, t)
        forwards = 2 * make_queries(t).mean_pairs() * t.batch * t.seq_len * self.model.flops_per_token()
        return self.experts * (forwards + STRATEGIES[t.optimizer].extra_flops(self.model, t))


@dataclass(frozen=True)
class Comparison:
    title: str
    seeds: tuple[int, ...]
    flops: float | None  # the forward-FLOP budget of every run; None: each method gives its steps
    methods: tuple[Method, ...]
    ablation: tuple[Method, ...]  # (independent, summed), or () when the file has none
    ablation_seeds: tuple[int, ...]
    curve_points: int = 8
    curve_spacing: str = "linear"  # CURVE_SPACINGS
    price_levels: tuple[float, ...] = ()  # held-out levels of the price table (a report setting only)
    curve_bytes: int = 8192
    segment: int = PROTOCOL.segment
    context: int = PROTOCOL.context
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


CURVE_SPACINGS = ("linear", "log")

_TOP_KEYS = {"title", "seeds", "flops", "curve_points", "curve_spacing", "price_levels", "curve_bytes", "segment", "context", "top_k",
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
        budget = _positive_number(raw["flops"], f"{path}: flops") if "flops" in raw else None
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
        spacing = raw.get("curve_spacing", Comparison.curve_spacing)
        if spacing not in CURVE_SPACINGS:
            raise ConfigError(f"{path}: curve_spacing must be one of {', '.join(CURVE_SPACINGS)}, got {spacing!r}")
        cmp = Comparison(title=str(raw.get("title", Path(path).stem)), seeds=_seeds(raw["seeds"], f"{path}: seeds"),
                         flops=budget, methods=methods, ablation=ablation, ablation_seeds=ablation_seeds,
                         tuning=tuning, eval_top_k=top_k, curve_spacing=spacing,
                         price_levels=tuple(_positive_number(x, f"{path}: price_levels")
                                            for x in _list(raw.get("price_levels", []), f"{path}: price_levels")),
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
    for m in cmp.methods:
        if m.seeds is not None and not set(m.seeds) <= set(cmp.seeds):
            raise ConfigError(f"{path} [[method]] {m.name}: seeds {list(m.seeds)} must be some of the "
                              f"comparison's {list(cmp.seeds)}")
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


# A zero-order method that names no optimizer trains with the paper's estimator (SPSA, ZO-SGD, at
# TrainConfig's defaults), which every shipped comparison measures; `zosoma train`'s default,
# one-sided SPSA, is a method of its own here (optimizer = "onesided").
ESTIMATOR = "sgd"
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
    _known(raw, {"name", "experts", "loss", "model", "train", "steps", "series", "seeds"}, where)
    given = {**_known(raw.get("model", {}), MODEL_KEYS, f"{where} model"), **_train_table(raw.get("train", {}), where)}
    try:
        if given.get("optimizer") == BACKPROP:
            model = resolve(None, {k: v for k, v in given.items() if k in MODEL_KEYS})[0]
            train_cfg = resolve_backprop(model, {k: v for k, v in given.items() if k not in MODEL_KEYS}, shared)
        else:
            model, train_cfg = resolve(None, given, {"optimizer": ESTIMATOR, **shared},
                                       loss=str(raw.get("loss", "independent")))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    method = Method(str(raw["name"]), model, train_cfg, _int(raw.get("experts", 1), f"{where}: experts"),
                    str(raw.get("loss", "independent")), _names(raw.get("series", ())),
                    _seeds(raw["seeds"], f"{where}: seeds") if "seeds" in raw else None)
    if train_cfg.optimizer == BACKPROP and method.experts > 1:
        raise ConfigError(f"{where}: a backprop method trains one model (experts = 1)")
    if steps is None and "steps" in raw:
        steps = _int(raw["steps"], f"{where}: steps")
    if steps is None and budget is None:
        raise ConfigError(f"{where}: give the comparison a budget (flops) or the method its steps")
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
