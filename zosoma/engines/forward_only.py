"""ForwardOnlyOps: the base of engines that run whole models and nothing else.

An inference runtime or an emulated low-precision device takes a model's parameters and a batch
and returns losses; it knows nothing of perturbations. Such an engine overrides
`population_loss` (and `nll_stream` for evaluation); this class builds every member of a step's
population on the host, as a perturbed COPY of theta in float32 (theta itself is never changed,
so nothing has to be undone: MeZO's in-place perturb-and-restore loses the parameters' low bits
in fp16), and hands the copies to it:

    dense (SPSA, ES)   theta +/- scale * delta_k          (Ops.perturbed_losses' own path)
    low rank (EGGROLL) theta +/- E_k, E_k materialised    (zosoma.model.noise.materialise)

The updates stay on the host (Ops' NumPy and Numba updates).
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.ops import Ops
from zosoma.model.noise import materialise
from zosoma.model.params import Layout
from zosoma.model.population import Population


class ForwardOnlyOps(Ops):
    """Ops whose forwards run elsewhere on whole parameter vectors; see the module docstring."""

    def perturbed_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                         timings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        if not pop.rank:
            return super().perturbed_losses(theta, layout, batch, pop, pairs, timings)
        pairs = range(pop.P) if pairs is None else pairs

        def build(chunk, members):
            for j, k in enumerate(chunk):
                e = materialise(layout, pop.scale, pop.rank, pop.seed, pop.expert, pop.step, k)
                members[2 * j] = theta + e
                members[2 * j + 1] = theta - e
            return members

        return self.materialised_losses(theta, layout, batch, pairs, {} if timings is None else timings, build)
