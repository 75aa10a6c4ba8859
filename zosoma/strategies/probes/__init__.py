"""Probe designs: which P directions a dense strategy's antithetic pairs perturb along.

The paper's estimator (`iid`, the default) draws each direction delta_k independently from the
counters (seed, expert, step, k) and never stores it: the engine's fused forwards and update
regenerate them. A probe design instead builds the step's directions U (P, d) on the host, and
the strategy evaluates the members theta +/- eps U_k (antithetic pairs kept) through the engine's
population forward and takes its estimate as

    ghat = sum_k w_k g_k U_k          g_k the pair's scalar; w_k = 1/P unless the design says

Each design is a pure function of the counters and of its state (arrays in the optimizer's dict,
checkpointed), so a resumed run takes the same steps bit for bit:

    orthogonal   the P directions orthogonalised, each of norm sqrt(d) (Choromanski et al. 2018)
    guided       mixed with the last update (Guided ES, Maheswaranathan et al. 2019)
    blocks       each pair perturbs one block of the model (block-coordinate SPSA)
"""

from __future__ import annotations

from zosoma.errors import ConfigError
from zosoma.strategies.probes.blocks import Blocks
from zosoma.strategies.probes.guided import Guided
from zosoma.strategies.probes.orthogonal import Orthogonal

# --probes name -> design (None: the counters' own i.i.d. directions). One file and one line here.
PROBES = {"iid": None, "orthogonal": Orthogonal, "guided": Guided, "blocks": Blocks}


def make_probes(cfg):
    """The design cfg.probes names, or None for the paper's i.i.d. directions."""
    if cfg.probes not in PROBES:
        raise ConfigError(f"probes must be one of {', '.join(PROBES)}, got {cfg.probes!r}")
    design = PROBES[cfg.probes]
    return design(cfg) if design is not None else None
