"""Coefficient shaping: small transforms chained onto the step's scalars of an SPSA-family
estimator.

After optax's `chain` and evosax's `fitness_shaping`: each piece maps one step's scalars g (P,)
and its own state (a dict of floats, checkpointed with the run) to new scalars and a new state,
and says what it did (`info`, logged with the step). Pieces compose in the order given:

    g, state = central_differences(L+, L-)            the estimator (zosoma.strategies.spsa)
    g, state["clip"]      = clip(g, state["clip"])     bound one cliff-step's scalar
    g, state["normalize"] = normalize(g, ...)          every step to one reference spread
    theta, opt = update rule(g)                        ZO-SGD, ZO-momentum, ZO-Adam

A step whose scalars are not all finite is passed through untouched (it is skipped anyway) and
leaves every state as it was. The pieces are pure functions of (scalars, state), so a resumed run
takes the same steps bit for bit.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.strategies.shaping.clip import Clip
from zosoma.strategies.shaping.normalize import Normalize, spread

# --shaping name -> piece. A new piece is one file and one line here.
SHAPINGS = {"clip": Clip, "normalize": Normalize}


class Chain:
    """The pieces of `cfg.shaping`, in order."""

    def __init__(self, cfg):
        unknown = [name for name in cfg.shaping if name not in SHAPINGS]
        if unknown:
            raise ConfigError(f"unknown shaping {unknown[0]!r} (known: {', '.join(SHAPINGS)})")
        self.pieces = [(name, SHAPINGS[name](cfg)) for name in cfg.shaping]

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def init(self) -> dict:
        return {name: piece.init() for name, piece in self.pieces}

    def __call__(self, coeffs: np.ndarray, state: dict) -> tuple[np.ndarray, dict, dict]:
        """(shaped coeffs, new state, what each piece did) for one step's (P,) scalars."""
        if not self.pieces or not np.all(np.isfinite(coeffs)):
            return coeffs, state, {}
        g = np.asarray(coeffs, np.float64)
        new, info = {}, {}
        for name, piece in self.pieces:
            g, new[name], did = piece(g, state[name])
            info.update({f"{name}_{k}": v for k, v in did.items()})
        return g, new, info
