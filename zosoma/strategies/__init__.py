"""How a step is estimated: zero-order strategies with explicit, checkpointable state.

Owns each strategy (SPSA with its update rules, EGGROLL, OpenAI-ES, the summed-loss ablation
wrapper), the registry that maps `--optimizer` names to them, the pieces they compose with (each
a package with its own registry: shaping/, probes/ for the step's directions, queries/ for P over
the run, transforms/ for update rules chained onto the estimate), and the one path from options to a
run's configuration (settings.resolve: preset, then the strategy's defaults, then what was
given). A strategy says which population to evaluate (ask) and turns the population's losses into
an update (tell); the array work goes through the Ops it is handed. May import the foundation and zosoma.model.
"""

from __future__ import annotations

from zosoma.config import TrainConfig
from zosoma.errors import ConfigError
from zosoma.strategies.activity import Activity, ActivityCausal, ActivityLocal, ActivityLocalCausal, ActivityOneSided
from zosoma.strategies.base import Strategy, check_options
from zosoma.strategies.eggroll import Eggroll
from zosoma.strategies.es import OpenES
from zosoma.strategies.onesided import OneSided
from zosoma.strategies.readout import Readout
from zosoma.strategies.rowwise import Rowwise
from zosoma.strategies.spsa import SPSA, Adam, Momentum

# --optimizer name -> strategy class. A new strategy is one file and one line here.
STRATEGIES: dict[str, type[Strategy]] = {
    "sgd": SPSA,
    "momentum": Momentum,
    "adam": Adam,
    "eggroll": Eggroll,
    "es": OpenES,
    "onesided": OneSided,
    "readout": Readout,
    "rowwise": Rowwise,
    "activity": Activity,
    "activity-local": ActivityLocal,
    "activity-causal": ActivityCausal,
    "activity-local-causal": ActivityLocalCausal,
    "activity-onesided": ActivityOneSided,
}


def make_strategy(cfg: TrainConfig) -> Strategy:
    """The strategy cfg.optimizer names, after checking that cfg sets no option it ignores."""
    cls = STRATEGIES.get(cfg.optimizer)
    if cls is None:
        raise ConfigError(f"optimizer must be one of {', '.join(STRATEGIES)}, got {cfg.optimizer!r}")
    strategy = cls(cfg)
    check_options(strategy, cfg)
    return strategy
