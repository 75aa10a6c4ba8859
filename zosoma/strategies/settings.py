"""From options to a run's configuration, in one place: the preset, then the strategy's
defaults, then what was given; every given key checked to be one the strategy reads.

The command line, the comparison's TOML methods, the precision study and the benchmarks all
call `resolve`, so none of them can train with another strategy's defaults (a TOML ES method
without eps and lr once trained with SPSA's).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from zosoma.config import PRESETS, ModelConfig, TrainConfig
from zosoma.errors import ConfigError
from zosoma.strategies import STRATEGIES
from zosoma.strategies.base import check_options

MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def resolve(preset: str | None = None, given: Mapping = {}, shared: Mapping = {},
            loss: str = "independent") -> tuple[ModelConfig, TrainConfig]:
    """The model and training configuration of a run: `preset`'s (zosoma.config.PRESETS; None:
    the dataclasses' defaults), then the strategy's own defaults (Strategy.defaults), then
    `shared`, then `given`; each a mapping of ModelConfig and TrainConfig fields together. The
    strategy (the optimizer given, else shared, else the default) must read every training key
    of `given`; a key of `shared` (a table several methods share) that it does not read must
    leave its field at the default. Anything else is a ConfigError in one line. The summed-loss
    ablation (loss "summed") couples its experts, so its own default on divergence is to stop."""
    unknown = sorted(set(given) - MODEL_KEYS - TRAIN_KEYS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    base_model, base_train = PRESETS[preset] if preset is not None else (ModelConfig(), {})
    merged = {**shared, **given}
    name = merged.get("optimizer", TrainConfig.optimizer)
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise ConfigError(f"optimizer must be one of {', '.join(STRATEGIES)}, got {name!r}")
    model = dataclasses.replace(base_model, **{k: v for k, v in merged.items() if k in MODEL_KEYS})
    coupled = {"on_divergence": "stop"} if loss == "summed" else {}
    cfg = dataclasses.replace(TrainConfig(), **{**base_train, **strategy.defaults, **coupled,
                                                **{k: v for k, v in merged.items() if k in TRAIN_KEYS}})
    check_options(strategy, cfg, given=[k for k in given if k in TRAIN_KEYS])
    return model, cfg
