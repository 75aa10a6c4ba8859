"""From options to a run's configuration, in one place: the preset, then the strategy's
defaults, then what was given; every given key checked to be one the strategy reads.

The command line, the comparison's TOML methods, the precision study and the benchmarks all
call `resolve`, so none of them can train with another strategy's defaults (a TOML ES method
without eps and lr once trained with SPSA's).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Mapping

from zosoma.config import LOSSES, PRESETS, ModelConfig, TrainConfig, step_bytes
from zosoma.errors import ConfigError
from zosoma.strategies import STRATEGIES
from zosoma.strategies.base import check_options

MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig))

# What a run trains with when no optimizer is named: activity perturbation with one-sided members
# (zosoma.strategies.activity, ActivityOneSided), at its own defaults (20/3 times the preset's rate,
# 1.0 at tiny; 3,100 steps: one-sided SPSA's 3,540 at equal wall). Over seeds 0-2 `zosoma train
# --experts 4` ended at 2.297 +- 0.008 routed held-out nats/byte with it against 2.565 +- 0.003 with
# one-sided SPSA (the default until 2026-12-05) and 2.637 with the paper's estimator; `zosoma train`
# at 2.512 +- 0.008 against one-sided's 2.782 +- 0.017 (results/default-run-activity-soma4,
# results/default-run-activity, results/default-run-soma4). The only default optimizer: TrainConfig
# has none (its other fields' defaults are the paper's estimator's, SPSA with ZO-SGD at rate 0.15
# for 4,000 steps, --optimizer sgd); the summed-loss ablation, whose scalars must add up across
# experts, defaults to sgd.
DEFAULT_OPTIMIZER = "activity-onesided"
# What zosoma.Optimizer trains a flat vector with when no optimizer is named: a vector has no
# pre-activations to perturb, so the default run's weight-perturbation estimator, one-sided SPSA.
VECTOR_OPTIMIZER = "onesided"


def resolve(preset: str | None = None, given: Mapping = {}, shared: Mapping = {},
            loss: str = "independent") -> tuple[ModelConfig, TrainConfig]:
    """The model and training configuration of a run: `preset`'s (zosoma.config.PRESETS; None:
    the dataclasses' defaults), then the strategy's own defaults (Strategy.defaults; its rate is
    the preset's times Strategy.rate_factor unless it names one), then `shared`, then `given`;
    each a mapping of ModelConfig and TrainConfig fields together. The strategy (the optimizer
    given, else shared, else DEFAULT_OPTIMIZER; SPSA for the summed-loss ablation) must read
    every training key of `given`; a key of `shared` (a table several methods share) that it
    does not read must leave its field at the default. Anything else is a ConfigError in one line, as is a step
    that needs more memory than this machine has (check_memory). The summed-loss ablation (loss
    "summed") couples its experts, so its own default on divergence is to stop."""
    unknown = sorted(set(given) - MODEL_KEYS - TRAIN_KEYS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    if loss not in LOSSES:
        raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    base_model, base_train = PRESETS[preset] if preset is not None else (ModelConfig(), {})
    merged = {**shared, **given}
    name = merged.get("optimizer", "sgd" if loss == "summed" else DEFAULT_OPTIMIZER)
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise ConfigError(f"optimizer must be one of {', '.join(STRATEGIES)}, got {name!r}")
    model = dataclasses.replace(base_model, **{k: v for k, v in merged.items() if k in MODEL_KEYS})
    coupled = {"on_divergence": "stop"} if loss == "summed" else {}
    rate = {"lr": base_train.get("lr", TrainConfig.lr) * strategy.rate_factor}  # the preset's, scaled
    cfg = dataclasses.replace(TrainConfig(optimizer=name), **{**base_train, **rate, **strategy.defaults, **coupled,
                                                              **{k: v for k, v in merged.items() if k in TRAIN_KEYS}})
    # its own checks (the pieces named) now rather than when training starts; then what it reads
    check_options(strategy(cfg), cfg, given=[k for k in given if k in TRAIN_KEYS],
                  shared=[k for k in shared if k in TRAIN_KEYS and k not in given])
    check_memory(model, cfg)
    warn_slow_step(model, cfg)
    warn_narrow_eps(cfg)
    return model, cfg


SLOW_STEP_FLOPS = 3e12  # about half a minute of one core at the 100 GFLOP/s of a recent fp32 peak


class SlowStep(UserWarning):
    """One training step of this configuration takes minutes (one line: why, and how to stop it)."""


def warn_slow_step(model: ModelConfig, cfg: TrainConfig) -> None:
    """Warn (SlowStep) when one step's forward passes, 2P x B x T tokens at the model's FLOPs per
    token, take more than about half a minute of a core: a -P of 1e8 is legal but would look hung."""
    flops = 2 * cfg.perturbations * cfg.batch * cfg.seq_len * model.flops_per_token()
    if flops > SLOW_STEP_FLOPS:
        warnings.warn(f"one training step is {flops:.2g} forward FLOPs (2P x B x T = "
                      f"{2 * cfg.perturbations * cfg.batch * cfg.seq_len:,} tokens): about "
                      f"{max(1, round(flops / 1e11 / 60)):,} min of one core at 100 GFLOP/s; a second Ctrl-C or SIGTERM "
                      "stops it at once", SlowStep, stacklevel=3)


class NarrowEps(UserWarning):
    """Activity perturbation's noise is below the forward format's step at the pre-activations."""


def warn_narrow_eps(cfg: TrainConfig) -> None:
    """Warn (NarrowEps) when activity perturbation trains in a narrow format (--forward-precision)
    at an eps under 1e-2: its noise then sits at or below the format's step near 1, and the loss
    differences are mostly rounding (200 steps of the tiny preset at 1e-3: bf16 3.336, fp16 3.132,
    int8 3.155 against fp32's 3.069; at 3e-2 within 0.015 of it: docs/precision.md)."""
    if cfg.optimizer.startswith("activity") and cfg.forward_precision != "fp32" and cfg.eps < 1e-2:
        warnings.warn(f"--forward-precision {cfg.forward_precision} with --optimizer {cfg.optimizer}: eps {cfg.eps:g} "
                      "is at or below the format's step at the pre-activations, so the loss differences are mostly "
                      "rounding: use --eps 0.03 or more (docs/precision.md)", NarrowEps, stacklevel=3)


def check_memory(model: ModelConfig, cfg: TrainConfig, available: int | None = None) -> None:
    """A ConfigError in one line when one training step of this configuration needs more memory
    (zosoma.config.step_bytes, a lower bound) than `available` (default: what this machine has
    free now, available_memory), naming what takes it and the option that sets it: a batch of
    1e8 would otherwise allocate for minutes and end in a MemoryError."""
    available = available_memory() if available is None else available
    need = step_bytes(model, cfg)
    if available is None or sum(need.values()) <= available:
        return
    what, most = max(need.items(), key=lambda kv: kv[1])
    cause = {"parameters": (f"{model.n_params():,} parameters", "--hidden, --embed or --layers"),
             "activations": (f"the activations of a batch of {cfg.batch:,} at H={model.hidden}", "--batch or --hidden"),
             "population": (f"the losses of {cfg.perturbations:,} perturbation pairs", "--perturbations")}[what]
    raise ConfigError(f"one training step needs at least {_gb(sum(need.values()))} of memory ({_gb(most)} for "
                      f"{cause[0]}), more than the {_gb(available)} available here: lower {cause[1]}")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def available_memory() -> int | None:
    """Bytes of memory free for this process: the kernel's MemAvailable, or less where a cgroup
    (a container, a SLURM job) leaves less below its limit; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next(line.strip()[3:] for line in f if line.startswith("0::"))
        root = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None
