"""Model, training and clustering settings: frozen dataclasses stored as JSON in every checkpoint
(and clustering file)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass

from zosoma.errors import ConfigError

VOCAB = 256  # V: one class per byte value
ENGINES = ("native", "onnxruntime")  # where forwards run: the device's own kernels, or ONNX Runtime
PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # the forward's number format (zosoma.model.number_formats)
ON_DIVERGENCE = ("stop", "continue", "restart")  # what a run does when its loss runs away
LOSSES = ("independent", "summed")  # a SOMA run's experts: their own losses, or the summed ablation
MAX_STEPS = 2**32 - 1  # a step is one uint32 word of the noise and batch counters (zosoma.model.noise)
FLOAT32_MAX = 3.4028234663852886e38  # theta and its update are float32: a rate or decay above this is inf there


def _typed(config) -> None:
    """Every field of a config dataclass of its declared kind, or a ConfigError in one line (a
    TOML value or a Python argument of another kind would fail later, or train on a fraction):
    an int field takes an integer (not a bool, not 3.5), a float field any real number (kept as a
    float), a str field a string."""
    kinds = {"int": (numbers.Integral, int, "an integer"), "float": (numbers.Real, float, "a number"),
             "str": (str, str, "a string")}
    for f in dataclasses.fields(config):
        if f.type not in kinds:
            continue
        accepted, cast, what = kinds[f.type]
        value = getattr(config, f.name)
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"{f.name} must be {what}, got {value!r}")
        object.__setattr__(config, f.name, cast(value))


@dataclass(frozen=True)
class ModelConfig:
    embed: int = 64  # E: byte embedding width
    hidden: int = 128  # H: LSTM hidden width (gates are 4H wide, order i, f, g, o)
    layers: int = 1  # L: stacked LSTM layers

    def __post_init__(self):
        _typed(self)
        for name in ("embed", "hidden", "layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name} must be at least 1, got {getattr(self, name)}")

    def n_params(self) -> int:
        E, H, L, V = self.embed, self.hidden, self.layers, VOCAB
        lstm = sum(4 * H * ((E if layer == 0 else H) + H + 1) for layer in range(L))
        return V * E + lstm + H * V + V

    def flops_per_token(self) -> int:
        """Nominal forward FLOPs per predicted byte (multiply-add = 2), as any implementation counts
        them: every layer's input and recurrent matmul plus the output projection. Gate math,
        softmax and embedding lookup are left out (they are O(H), not O(H^2))."""
        E, H, L, V = self.embed, self.hidden, self.layers, VOCAB
        lstm = sum(2 * 4 * H * ((E if layer == 0 else H) + H) for layer in range(L))
        return lstm + 2 * H * V


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000  # optimizer steps
    batch: int = 8  # B: sequences per minibatch (shared by every perturbation of a step)
    seq_len: int = 32  # T: predicted bytes per sequence
    perturbations: int = 32  # P: SPSA directions per step (2P forward passes)
    eps: float = 1e-3  # perturbation scale: SPSA's eps (MeZO's default), EGGROLL's sigma
    noise: str = "rademacher"  # "rademacher" or "gaussian"
    # The strategy (zosoma.strategies): "sgd", "momentum", "adam" (SPSA with ZO-SGD, ZO-momentum,
    # ZO-Adam), "eggroll" (low-rank ES), "es" (OpenAI-ES), "onesided" (SPSA's forward differences,
    # 2P directions a step), "activity-onesided" (activity perturbation) and the others of
    # zosoma.strategies. No default here: a run that names no optimizer trains activity-onesided
    # at its own rate and steps, which zosoma.strategies.settings.resolve (DEFAULT_OPTIMIZER)
    # decides, so a configuration is built there, or names its strategy. The other fields'
    # defaults are the paper's estimator's, ZO-SGD as in MeZO (ZO-Adam's per-coordinate
    # normalisation amplifies the estimate's noise in the many coordinates whose true gradient is
    # small, and learned far slower here).
    optimizer: str = dataclasses.field(kw_only=True)
    rank: int = 1  # EGGROLL's r
    # The estimate's norm grows like sqrt(d / P), so the largest stable rate falls roughly like 1/d:
    # 0.15 suits the tiny preset's 50k parameters (0.3 diverged there).
    lr: float = 0.15  # peak learning rate
    schedule: str = "cosine"  # "constant" or "cosine"
    warmup: int = 20  # linear warm-up steps
    momentum: float = 0.9  # beta1 for momentum and Adam
    beta2: float = 0.999  # Adam second-moment decay
    weight_decay: float = 0.0  # decoupled (AdamW-style) weight decay
    seed: int = 0  # one seed fixes init, batches and noise
    checkpoint_every: int = 500  # steps between checkpoints
    # How the forwards run (zosoma.engines.get_ops). Both change a run's numbers, so they are part
    # of its configuration and a resume keeps them. Updates and master weights stay fp32.
    engine: str = "native"  # ENGINES: the device's kernels, or ONNX Runtime (an inference-only runtime)
    forward_precision: str = "fp32"  # PRECISIONS: bf16, fp16 and int8 are emulated on the CPU
    # Coefficient shaping (zosoma.strategies.shaping; SPSA's update rules): pieces applied in
    # order to the step's scalars before the update, e.g. ("clip", "normalize"). The default
    # normalises every step to the first steps' spread: over seeds 0-9 of the default run it ended
    # at 2.859 +- 0.013 held-out nats/byte against plain SPSA's 2.918 +- 0.033 (clip 2.886, both
    # 2.863; results/defaults-single, measured when the reference was the window's mean), and it
    # bounds a cliff-step. () is plain SPSA (the paper's).
    shaping: tuple = ("normalize",)
    # Cutting the price (docs/cut-price.md): pieces that compose with the shaping and each other.
    # The paper's estimator is every default: i.i.d. directions from the counters, a constant P,
    # the strategy's own update rule.
    probes: str = "iid"  # zosoma.strategies.probes: iid, orthogonal, guided (last update), blocks
    queries: str = "constant"  # zosoma.strategies.queries: constant P, or doubling (P/2, P, 2P)
    transforms: tuple = ()  # zosoma.strategies.transforms chained onto the estimate: momentum, adam
    clip_at: float = 5.0  # clip: each scalar bounded at this many running medians of |g|
    normalize_window: int = 50  # normalize: the first steps, whose mean (bounded) spread is the reference
    readout_lr: float = 1.0  # readout: the output layer's rate along its exact gradient (zosoma.strategies.readout)
    # A run whose loss runs away (zosoma.training.guard) stops with a message and a checkpoint; goes
    # on with the verdict recorded; or restarts: rolled back to a checkpoint from before the
    # guard's window, its rate times restart_lr_factor, on fresh batches and noise, and after
    # max_restarts restarts dropped (SOMA leaves a dropped expert out of routing). The verdicts
    # are in the results either way.
    # The default restarts: a SOMA run survives an expert that runs away (the summed ablation,
    # whose experts move together, stops instead; zosoma.strategies.settings).
    on_divergence: str = "restart"  # ON_DIVERGENCE
    restart_lr_factor: float = 0.5
    max_restarts: int = 3

    def __post_init__(self):
        _typed(self)
        positive = ("steps", "batch", "seq_len", "perturbations", "checkpoint_every", "rank", "normalize_window")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("eps", "lr", "momentum", "beta2", "weight_decay", "readout_lr"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"eps must be positive, got {self.eps}")
        if self.eps < 2.0**-150:  # below half the smallest float32: theta +- eps is theta, nothing trains
            raise ConfigError(f"eps must be at least 1e-45, got {self.eps:g} (0 in float32, the parameters' "
                              "precision: every member would equal theta)")
        for name in ("lr", "readout_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("eps", "lr", "weight_decay"):
            if getattr(self, name) > FLOAT32_MAX:
                raise ConfigError(f"{name} must be at most 3.4e38 (float32's largest, the parameters' precision), "
                                  f"got {getattr(self, name):g}")
        if self.steps > MAX_STEPS:
            raise ConfigError(f"steps must be at most {MAX_STEPS:,} (a step is a 32-bit word of the noise "
                              f"counters), got {self.steps:,}")
        if self.noise not in ("rademacher", "gaussian"):
            raise ConfigError(f"noise must be rademacher or gaussian, got {self.noise!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.forward_precision not in PRECISIONS:
            raise ConfigError(f"forward_precision must be one of {', '.join(PRECISIONS)}, got "
                              f"{self.forward_precision!r}")
        if self.on_divergence not in ON_DIVERGENCE:
            raise ConfigError(f"on_divergence must be one of {', '.join(ON_DIVERGENCE)}, got {self.on_divergence!r}")
        shaping = (self.shaping,) if isinstance(self.shaping, str) else self.shaping
        if not isinstance(shaping, (list, tuple)) or not all(isinstance(p, str) for p in shaping):
            raise ConfigError(f"shaping must be a piece's name or a list of them, got {self.shaping!r}")
        shaping = tuple(shaping)
        if "none" in shaping:  # plain SPSA, by name (--shaping none, shaping = "none")
            if shaping != ("none",):
                raise ConfigError("shaping none is plain SPSA: it takes no other piece")
            shaping = ()
        object.__setattr__(self, "shaping", shaping)  # a list read from JSON or TOML
        transforms = (self.transforms,) if isinstance(self.transforms, str) else self.transforms
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(p, str) for p in transforms):
            raise ConfigError(f"transforms must be a transform's name or a list of them, got {self.transforms!r}")
        object.__setattr__(self, "transforms", tuple(transforms))
        if not 0 < self.restart_lr_factor <= 1:
            raise ConfigError(f"restart_lr_factor must lie in (0, 1], got {self.restart_lr_factor}")
        if not math.isfinite(self.clip_at) or self.clip_at <= 0:
            raise ConfigError(f"clip_at must be a positive number, got {self.clip_at}")
        for name in ("warmup", "max_restarts", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"schedule must be constant or cosine, got {self.schedule!r}")
        for name in ("momentum", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must lie in [0, 2**63), got {self.seed}")


def step_bytes(model: ModelConfig, cfg: TrainConfig) -> dict:
    """Bytes one training step of one model holds at least, by what sets them (a lower bound of
    the CPU engine's buffers, zosoma.engines.cpu.forward, on one thread; a GPU holds as much on
    the device): "parameters", theta, its updated copy and a pair of members (d float32 each);
    "activations", one member's forward over the B rows (gates, input projections, outputs, and
    h and c per layer: (9 + 2L) H float32 a row) and the batch (T + 1 bytes and three int64 a
    row); "population", the P pairs' losses and scalars (four float64 each)."""
    B, H, L = cfg.batch, model.hidden, model.layers
    return {"parameters": 4 * 4 * model.n_params(),
            "activations": B * (4 * (9 + 2 * L) * H + cfg.seq_len + 1 + 24),
            "population": 4 * 8 * cfg.perturbations}


# name -> (model, training overrides). tiny: the default, a few minutes on 2 cores; paper: one
# 4.22M-parameter expert of the paper's N=2, 8.44M-parameter SOMA ensemble (E=508, H=496, L=2).
# The small and paper learning rates follow the 1/d rule above from tiny's; they are not tuned.
PRESETS = {
    "tiny": (ModelConfig(embed=32, hidden=64, layers=1), {}),
    "small": (ModelConfig(embed=128, hidden=256, layers=2), {"seq_len": 128, "lr": 0.008}),
    "paper": (ModelConfig(embed=508, hidden=496, layers=2), {"perturbations": 64, "seq_len": 128,
                                                             "lr": 0.003}),
}


def to_json(*configs) -> str:
    return json.dumps({type(c).__name__: dataclasses.asdict(c) for c in configs}, sort_keys=True)


def from_json(text: str) -> dict:
    """Inverse of to_json: {"ModelConfig": ModelConfig(...), "TrainConfig": TrainConfig(...)}."""
    classes = {"ModelConfig": ModelConfig, "TrainConfig": TrainConfig}
    raw = json.loads(text)
    return {name: classes[name](**{**ABSENT.get(name, {}),
                                   **{k: v for k, v in fields.items() if k not in RETIRED.get(name, ())}})
            for name, fields in raw.items() if name in classes}


# Fields older versions wrote that no longer mean anything; their checkpoints still load.
RETIRED = {"TrainConfig": ("eval_every",)}
# What a field means in a checkpoint written before it existed: the behaviour of that version,
# whatever today's default, so a resumed old run trains on exactly as it would have.
ABSENT = {"TrainConfig": {"shaping": (), "on_divergence": "stop", "optimizer": "sgd"}}


@dataclass(frozen=True)
class ClusterConfig:
    """How the corpus is clustered and a text embedded for the router (zosoma.mixture.cluster);
    stored as JSON in the clustering file (zosoma.formats.clustering)."""

    n_clusters: int = 8  # N: clusters, one expert each
    ngram_min: int = 1  # shortest hashed byte n-gram
    ngram_max: int = 4  # longest hashed byte n-gram
    # F: hash buckets, a power of two. The projection is F x svd_dim float32: 26 MB at 2**16, which
    # clusters and routes the shipped corpus as well as 2**18 (105 MB) does.
    n_features: int = 2**16
    sublinear_tf: bool = True  # tf = 1 + ln(count) rather than count
    svd_dim: int = 100  # D: embedding width (c-BTM: 100)
    svd_oversample: int = 10  # extra random directions in the randomized SVD
    svd_power_iterations: int = 1  # randomized SVD power iterations (2 clusters no better)
    balanced: bool = True  # equal cluster sizes while fitting (c-BTM)
    iterations: int = 30  # at most this many k-means (Lloyd) iterations per restart
    restarts: int = 3  # k-means++ initialisations; the lowest objective wins
    seed: int = 0  # fixes the SVD's random directions and the k-means++ draws

    def __post_init__(self):
        if self.n_clusters < 1:
            raise ConfigError(f"n_clusters must be at least 1, got {self.n_clusters}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"n-gram range {self.ngram_min}..{self.ngram_max}: need "
                              "1 <= ngram_min <= ngram_max")
        f = self.n_features
        if not (isinstance(f, int) and 2**4 <= f <= 2**24 and f & (f - 1) == 0):
            raise ConfigError(f"n_features must be a power of two from 2**4 to 2**24, got {f}")
        for name in ("svd_dim", "iterations", "restarts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.svd_oversample < 0 or self.svd_power_iterations < 0:
            raise ConfigError("svd_oversample and svd_power_iterations must not be negative")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must lie in [0, 2**63), got {self.seed}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ClusterConfig":
        return cls(**json.loads(text))
