"""Per-row scalars for weight perturbation: one-sided SPSA with a direction of its own per row.

Each batch row's own loss difference, against one direction shared by the member's B rows, gives
nothing: the one-sided scalar is linear in the losses, so

    (1/B) sum_b (L_jb - mean_i L_ib) / eps  =  (L_j - mean_i L_i) / eps

(L_j the member's batch-mean loss), and the estimate is the batch-mean one, bit for bit up to
rounding. What per-row losses do allow, at the same forward FLOPs, is a different direction for
every (member, row): the 2P forwards of B rows become 2P B single-row forwards, each along its
own delta, so a step measures 2P B directions where one-sided SPSA measures 2P:

    L_i  = L_{b(i)}(theta + eps*delta_i)      i = 0..2PB-1, row b(i) = i mod B, delta_i from the counters
    g_i  = (L_i - mean_{i' : b(i') = b(i)} L_i') / eps       (each row's own baseline)
    ghat = (1/(2PB)) sum_i g_i delta_i

Each g_i measures row b(i)'s gradient g_b alone, so ghat is unbiased for the batch gradient
g = mean_b g_b (up to the baselines' O(1/2P) and eps's curvature, as one-sided SPSA), and its
error is about d mean_b |g_b|^2 / (2PB) against d |g|^2 / (2P): it gains the factor
B |g|^2 / mean_b |g_b|^2, between 1 (rows' gradients orthogonal) and B (all alike).
docs/cut-price.md measures that factor at a fixed theta.

The forwards are the engine's population forward on one member per (member, row), each with its
one-row batch (host-built members, ops.population_loss). On a CPU a one-row forward is a
matrix-vector product where a batch's is a matrix product: the same FLOPs at a lower rate.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.model.population import Population, member_chunks
from zosoma.strategies.onesided import OneSided, one_sided


class Rowwise(OneSided):
    name = "rowwise"
    options = frozenset({"noise", "weight_decay", "shaping", "clip_at", "normalize_window"})
    unshardable = "evaluates every (member, row) of the step in one population"

    def check(self, layout) -> None:
        if layout is None:  # zosoma.Optimizer: a flat vector's loss has no batch rows
            raise ConfigError("--optimizer rowwise scores each batch row of a model's batch: it needs a model "
                              "(zosoma train), not a flat vector")
        super().check(layout)

    def rows(self, pop: Population) -> Population:
        """The population of single-row members: directions 0..2PB-1, direction i on row i mod B."""
        return one_sided(Population(pop.P * self.cfg.batch, pop.scale, pop.seed, pop.expert, pop.step, pop.kind))

    def losses(self, ops, theta, layout, batch, pop, state, pairs=None, timings=None):
        """(plus, minus), (PB,) each: member i's loss on its row is at 2 (i // 2) + (i % 2)."""
        rows, host, batch = self.rows(pop), ops.to_numpy(theta), np.asarray(batch)
        L = np.empty(2 * rows.P)
        for chunk in member_chunks(range(rows.P), host.size):
            i = np.arange(2 * chunk.start, 2 * chunk.stop)
            L[i] = ops.population_loss(ops.asarray(ops.members(host, rows, chunk)), layout,
                                       batch[i % batch.shape[0], None])
        return L[0::2], L[1::2]

    def coefficients(self, plus, minus):
        L = np.stack([plus, minus], axis=1).reshape(-1, self.cfg.batch)  # (2P, B): direction j B + b
        return ((L - L.mean(axis=0)) / self.cfg.eps).ravel(), float(L.mean())

    def update(self, ops, layout, theta, state, coeffs, pop, lr):
        return super().update(ops, layout, theta, state, coeffs, self.rows(pop), lr)
