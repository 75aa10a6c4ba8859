"""Update transforms: small rules chained between a dense strategy's estimate and its step.

After optax's `chain`: each piece maps the estimate (or the previous piece's output) g (d,) and
its own state arrays to a new direction and new state; the step then descends along the last one:

    ghat            = estimate(scalars)              the strategy's (SPSA, ES; any probe design)
    g, state        = momentum(ghat, state)          heavy ball
    g, state        = adam(g, state)                 bias-corrected moments
    theta           = theta - lr g - lr wd theta     Strategy.descend

`--optimizer momentum` and `--optimizer adam` are SPSA with one of these built in; `--transforms`
chains them onto any dense strategy (`--optimizer es --transforms adam` is ES with Adam). With no
transform and the counters' directions, the step is the engine's fused update (the paper's ZO-SGD).
"""

from __future__ import annotations

from zosoma.errors import ConfigError
from zosoma.strategies.transforms.adam import Adam
from zosoma.strategies.transforms.momentum import Momentum

# --transforms name -> piece. A new update rule is one file and one line here.
TRANSFORMS = {"momentum": Momentum, "adam": Adam}


class Chain:
    """The pieces named, in order; their state arrays share the optimizer's dict (each piece's
    keys its own)."""

    def __init__(self, cfg, names):
        unknown = [n for n in names if n not in TRANSFORMS]
        if unknown:
            raise ConfigError(f"transforms must be among {', '.join(TRANSFORMS)}, got {unknown[0]!r}")
        self.pieces = [TRANSFORMS[n](cfg) for n in names]
        self.reads = frozenset(f for p in self.pieces for f in p.reads)  # the TrainConfig fields they read
        keys = [k for p in self.pieces for k in p.keys]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"transforms {' + '.join(names)} would share a moment; chain one of them")

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def init(self, ops, d: int) -> dict:
        return {k: v for p in self.pieces for k, v in p.init(ops, d).items()}

    def __call__(self, g, state: dict, step: int):
        """(direction (d,), new state) from the estimate g at `step` (0-based)."""
        new = dict(state)
        for piece in self.pieces:
            g, mine = piece(g, {k: state[k] for k in piece.keys}, step)
            new.update(mine)
        return g, new
