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

Activity perturbation (Ops.activity_losses, activity_estimate: the noise, the credit, zeta and the
update on the host) needs two forwards of such an engine, which it gives as hooks:

    noisy_nats(theta, layout, batch, scale, Z, index, sign)   (M, B, T) float64: the members' nats,
        one forward at theta over M B rows with sign[m] * scale * Z[index[m]] added to every
        layer's gate pre-activations (and, with S > L 4H, the logits) before the nonlinearity,
        where the CPU engine adds it (zosoma.engines.cpu.noisy_forward)
    clean_inputs(theta, layout, batch, probs)   (x0, hs, probs): what the outer products read from
        a clean forward at theta (zosoma.model.node_perturbation.clean_forward's), from the
        engine's own forward: the inputs a device has

and the outer products themselves run here on the host in float32
(node_perturbation.outer_products): a device without an outer-product accumulate returns its
clean forward's inputs instead.
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation
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

    def outer_products(self, theta, layout: Layout, batch, zeta) -> np.ndarray:
        """ghat (d,) float32: zeta's outer products with the engine's clean forward's inputs
        (clean_inputs), in float32 on the host, theta's own w_ih for the embedding's rows."""
        local = zeta.shape[-1] == node_perturbation.width(layout, "local")
        x0, hs, probs = self.clean_inputs(theta, layout, batch, local)
        inputs = (np.asarray(x0, np.float32), [np.asarray(h, np.float32) for h in hs],
                  None if probs is None else np.asarray(probs, np.float32))
        return node_perturbation.outer_products(np.asarray(theta, np.float32), layout, batch, zeta, inputs)
