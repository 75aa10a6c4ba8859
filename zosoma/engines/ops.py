"""Ops: the array work of training and inference, and the CPU engine that implements it.

Everything that touches a model's weights goes through one Ops object (the thinc pattern: this
class is the CPU engine, NumPy arrays and the Numba kernels of zosoma.engines.cpu; CudaOps in
zosoma.engines.cuda overrides it for a GPU). A new engine subclasses Ops and overrides what it
runs itself; what it does not override runs here, on the host. The rest of zosoma asks an engine
what it is only through the attributes below, never by its name. The interface:

    what it is name                     the engine's label in records and reports ("cpu", "cuda",
                                        "onnxruntime", "cpu-bf16", ...)
               device                   the device its forwards run on, as get_ops names it ("cpu",
                                        "cuda")
               engine                   the engine's kind, as get_ops names it ("native", "onnxruntime");
                                        with device and precision, the record an engine is sent to
                                        another process as (zosoma.engines.SendsEngine)
               on_device                True when its arrays live in an accelerator's memory
               precision                the forwards' number format (zosoma.model.number_formats)
    arrays     xp                       the array module of the engine's arrays (numpy, cupy)
               asarray(x)               x as an engine float32 array (theta, optimizer state)
               to_numpy(x)              an engine array as a NumPy array (checkpoints, evaluation)
    forwards   population_loss(thetas, layout, batch)           (M,) mean nats/byte of M models
               perturbed_losses(theta, layout, batch, pop, pairs)
                                        (plus, minus): losses of a Population's members 2k and
                                        2k+1, made from their counters as its member table says
                                        (dense, any table; or EGGROLL low-rank)
               nll_stream(theta, layout, tokens, targets, state)  per-byte nats, state carried
               log_probs(theta, layout, tokens, state)             next-byte log-probabilities
               models_nll(models, rows)  per-byte nats of several models, each on its own rows
    updates    noise_sum(coeffs, d, pop)  (1/D) sum_j coeffs[j] delta_j over the population's D
                                        directions, every delta regenerated
               sgd_update(theta, coeffs, pop, lr, weight_decay)   theta - lr (noise_sum + wd theta)
               experts_sgd_update(thetas, coeffs, pops, lrs, wds)  N experts' sgd_update (a GPU: one launch)
               lowrank_update(theta, layout, coeffs, pop, lr)     EGGROLL's theta + lr N^-1/2 sum c E
    activity   activity_losses(theta, layout, batch, pop, pairs)  (plus, minus) (K, B): each row's
                                        loss with noisy pre-activations (node perturbation), the
                                        noise as the member table says
               activity_estimate(theta, layout, batch, coeffs, pop)  its estimate from (D, B) scalars
               noisy_nats(theta, layout, batch, scale, Z, index, sign)  the engine's hooks under
               outer_products(theta, layout, batch, zeta)              them: the members' (M, B, T)
                                        nats, the clean forward's outer products (ghat)

Losses come back as NumPy float64 (a few scalars per step); theta and optimizer state stay engine
arrays between steps, so an engine on a device never sends weights to the host while training.
Shapes: M members, P pairs, D directions, B batch, T time, d parameters.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from zosoma.engines.cpu import forward, lowrank, noise_kernels
from zosoma.engines.cpu import noisy_forward
from zosoma.errors import ConfigError
from zosoma.model import noise
from zosoma.model import node_perturbation
from zosoma.model.population import Population, member_chunks
from zosoma.model.params import Layout


# Gaussian directions cost as much to generate as a forward at small sizes (libm log, sqrt, cos,
# sin per pair of values): the CPU engine keeps a population's directions, up to this size, from
# its forward for its update instead of generating them twice.
_KEEP_BYTES = 64 << 20


class Ops:
    """The CPU engine: NumPy arrays, the Numba kernels of zosoma.engines.cpu."""

    name = "cpu"
    device = "cpu"
    engine = "native"
    on_device = False
    precision = "fp32"
    gemm = "fp32"  # the GEMMs' number format: tensor cores on CUDA only (CudaOps)
    xp = np

    # --- arrays -----------------------------------------------------------------------------

    def asarray(self, x) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    # --- forwards ---------------------------------------------------------------------------

    def population_loss(self, thetas, layout: Layout, batch) -> np.ndarray:
        """(M,) float64 mean nats/byte of M models thetas (M, d) on one (B, T+1) batch (or one
        batch per model, (M, B, T+1)), from zero state."""
        return forward.population_loss(thetas, layout, batch)

    def perturbed_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                         timings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Losses of pair k's members 2k ("plus") and 2k+1 ("minus"), theta + sign_m *
        perturbation_{direction_m} as pop's member table says (antithetic pairs: theta +/-
        perturbation_k), for k in `pairs` (default all P) on the step's shared (B, T+1) batch; each
        (len(pairs),) float64. `timings`, if given, accumulates seconds of "noise" (building
        perturbed weights outside the forward) and "forward" (here the CPU forward builds each
        pair's members from the counters itself, so its noise is forward time)."""
        pairs = range(pop.P) if pairs is None else pairs
        timings = {} if timings is None else timings
        if pop.rank:  # EGGROLL: the shared-GEMM population forward regenerates its own factors
            t0 = time.perf_counter()
            losses = lowrank.eggroll_population_loss(theta, layout, batch, pop.scale, pop.rank, pop.seed,
                                                     pop.expert, pop.step, len(pairs), pairs.start)
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t0
            return losses[0::2], losses[1::2]
        if type(self).population_loss is Ops.population_loss:  # the CPU forward builds its own members
            t0 = time.perf_counter()
            deltas = None
            if (pop.kind == "gaussian" and len(pairs) == pop.P and pop.complete
                    and pop.directions * theta.size * 4 <= _KEEP_BYTES):
                deltas = np.empty((pop.directions, theta.size), np.float32)
            rows = pop.rows(pairs)
            plus, minus = forward.perturbed_sums(theta, layout, batch, pop.scale, pop.seed, pop.expert, pop.step,
                                                 pop.kind, pairs, deltas, (pop.direction[rows], pop.sign[rows]))
            self._kept = (pop, theta.size, deltas) if deltas is not None else None
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t0
            return plus, minus
        # an engine that overrides population_loss gets the members materialised, chunk by chunk
        host = self.to_numpy(theta)
        return self.materialised_losses(theta, layout, batch, pairs, timings,
                                        lambda chunk, out: perturbed(host, pop, chunk, out))

    def members(self, theta: np.ndarray, pop: Population, pairs: range) -> np.ndarray:
        """The dense population of `pairs` on the host, (2 |pairs|, d) float32 (perturbed): for a
        strategy that evaluates its members its own way (rowwise: each on one batch row)."""
        return perturbed(theta, pop, pairs)

    def materialised_losses(self, theta, layout: Layout, batch, pairs: range, timings: dict, build):
        """plus, minus losses of `pairs` run through population_loss on members built on the host:
        build(chunk, out) fills out (2 * len(chunk), d) with the chunk's pairs (rows 2j, 2j+1 the
        plus and minus members of chunk[j]); chunks keep the copies within member_chunks' budget."""
        plus, minus = np.empty(len(pairs)), np.empty(len(pairs))
        buf = None
        for chunk in member_chunks(pairs, theta.size):
            if buf is None or buf.shape[0] != 2 * len(chunk):
                buf = np.empty((2 * len(chunk), theta.size), np.float32)
            t0 = time.perf_counter()
            population = build(chunk, buf)
            t1 = time.perf_counter()
            losses = self.population_loss(population, layout, batch)
            timings["noise"] = timings.get("noise", 0.0) + t1 - t0
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
            at = slice(chunk.start - pairs.start, chunk.stop - pairs.start)
            plus[at], minus[at] = losses[0::2], losses[1::2]
        return plus, minus

    def experts_perturbed_losses(self, thetas, layout: Layout, batches, pops: list[Population]) -> list:
        """The steps of N experts of one Layout: (plus, minus) of all pairs of pops[n] around
        thetas[n] (d,) on batches[n] (B, T+1), one per expert, as N calls of perturbed_losses (an
        engine may run them together: CudaOps, one launch for all N)."""
        return [self.perturbed_losses(t, layout, b, p) for t, b, p in zip(thetas, batches, pops)]

    def nll_stream(self, theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):
        """Nats (B, T) float32 of each target byte under one model, and the state after the last
        step (one (h, c) pair of (B, H) per layer), carried in from `state` (None: zeros).
        Columns before scored_from are context whose nats no one reads: an engine may skip their
        output layer (here it does: they read 0) or compute them."""
        return forward.nll_stream(theta, layout, tokens, targets, state, scored_from)

    def log_probs(self, theta, layout: Layout, tokens, state=None):
        """Next-byte log-probabilities (B, T, V) float32 of one model, and the final state."""
        return forward.log_probs(theta, layout, tokens, state)

    def route(self, router, contexts) -> tuple[np.ndarray, np.ndarray]:
        """The router's experts (S, K) int64 and weights (S, K) float32 for S contexts
        (zosoma.mixture.routing.Router.select), computed on this engine's device."""
        return router.select(contexts)

    def models_nll(self, models: Sequence[tuple], rows: Sequence[tuple],
                   scored_from: Sequence[int] = ()) -> list[np.ndarray]:
        """Nats (B_i, T_i) float32 of model i = (theta, layout) on its rows (tokens, targets)
        (B_i, T_i) uint8, each from zero state: routed inference runs every selected expert on
        its own segments. scored_from[i], if given: columns before it are context, whose nats
        the caller ignores (nll_stream's). Here one model after another."""
        froms = list(scored_from) or [0] * len(models)
        return [self.nll_stream(theta, layout, tok, tgt, None, first)[0]
                for (theta, layout), (tok, tgt), first in zip(models, rows, froms)]

    # --- updates ----------------------------------------------------------------------------

    def noise_sum(self, coeffs, d: int, pop: Population) -> np.ndarray:
        """(d,) float32 (1/D) * sum_j coeffs[j] * delta_j, regenerating each direction j =
        0..D-1 of the dense Population in turn (D = pop.directions = len(coeffs)): SPSA's estimate
        from its scalars. Here in one pass over the parameters, split over threads; Gaussian
        directions that perturbed_losses kept for this population are read instead (the same
        numbers)."""
        return noise_kernels.weighted_sum(d, _weights(coeffs, pop), pop.seed, pop.expert, pop.step, pop.kind,
                                          self._kept_directions(pop, d))

    def sgd_update(self, theta, coeffs, pop: Population, lr: float, weight_decay: float = 0.0):
        """theta - lr * noise_sum(coeffs) - lr * weight_decay * theta, a new array (the inputs are
        left untouched, so an interruption never leaves a half-applied step). Here in one pass
        over theta, the same float32 numbers as the formula (unless noise_sum is overridden)."""
        if type(self).noise_sum is Ops.noise_sum:
            return noise_kernels.apply_weighted_sum(theta, _weights(coeffs, pop), lr,
                                                    lr * weight_decay if weight_decay else None,
                                                    pop.seed, pop.expert, pop.step, pop.kind,
                                                    self._kept_directions(pop, theta.size))
        new = theta - np.float32(lr) * self.noise_sum(coeffs, theta.size, pop)
        if weight_decay:
            new -= np.float32(lr * weight_decay) * theta
        return new.astype(np.float32)

    def experts_sgd_update(self, thetas, coeffs, pops: list[Population], lrs, weight_decays) -> list:
        """The fused steps of N experts: sgd_update(thetas[n], coeffs[n], pops[n], lrs[n],
        weight_decays[n]) for each n, as N calls of it (an engine may apply them together:
        CudaOps, one launch for all N)."""
        return [self.sgd_update(*args) for args in zip(thetas, coeffs, pops, lrs, weight_decays)]

    _kept = None  # (Population, d, (D, d) float32): the dense Gaussian directions last evaluated

    def _kept_directions(self, pop: Population, d: int):
        """The directions perturbed_losses kept for this population, or None (regenerate)."""
        kept = self._kept
        return kept[2] if kept is not None and kept[0] == pop and kept[1] == d else None

    def lowrank_update(self, theta, layout: Layout, coeffs, pop: Population, lr: float):
        """EGGROLL's theta + lr * (2P)^(-1/2) * sum_k coeffs[k] E_k (zosoma.engines.cpu.lowrank)."""
        return lowrank.eggroll_step(theta, layout, coeffs, lr, pop.scale, pop.rank, pop.seed, pop.expert,
                                    pop.step)

    # --- activity (node) perturbation: zosoma.model.node_perturbation --------------------------
    # The noise, the member table, the credit, zeta and the update stay on the host here; an engine
    # gives two hooks: noisy_nats (the members' forward) and outer_products (the clean forward's
    # accumulate, or its inputs: zosoma.engines.forward_only).

    def activity_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                        timings: dict | None = None, readout: str = "perturb", positions: bool = False
                        ) -> tuple[np.ndarray, np.ndarray]:
        """(plus, minus), each (len(pairs), B) float64: every batch row's mean nats/byte under pair
        k's members 2k and 2k + 1, member m's pre-activations plus pop.sign[m] * pop.scale *
        z_(pop.direction[m]), z_j the noise of direction j's counters (readout "local": on the gates
        only, node_perturbation.width); `positions`: each (len(pairs), B, T), the nats of every
        target. The noise is drawn here on the host and kept for activity_estimate of the same
        population; the members run in the engine's noisy_nats."""
        if type(self).population_loss is not Ops.population_loss and type(self).noisy_nats is Ops.noisy_nats:
            raise ConfigError(f"activity perturbation needs a noisy forward, which the {self.name} engine "
                              "does not have")
        pairs = range(pop.P) if pairs is None else pairs
        timings = {} if timings is None else timings
        batch = np.asarray(batch)
        B, T = batch.shape[0], batch.shape[1] - 1
        t0 = time.perf_counter()
        table = pop.direction[pop.rows(pairs)]
        directions = sorted(set(table.tolist()))  # each noise drawn once: a pair's two members may share it
        Z = noisy_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, directions, pop.kind, readout)
        t1 = time.perf_counter()
        index = np.searchsorted(directions, table)
        nats = self.noisy_nats(theta, layout, batch, pop.scale, Z, index, pop.sign[pop.rows(pairs)])
        plus, minus = np.ascontiguousarray(nats[0::2]), np.ascontiguousarray(nats[1::2])
        if not positions:
            plus, minus = plus.mean(axis=-1), minus.mean(axis=-1)
        self._activity_kept = (pop, directions, Z)
        timings["noise"] = timings.get("noise", 0.0) + t1 - t0
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        return plus, minus

    _activity_kept = None  # (Population, directions, (J, B, T, S) float32): the noise activity_losses drew

    def noisy_nats(self, theta, layout: Layout, batch, scale: float, Z, index, sign) -> np.ndarray:
        """(M, B, T) float64: the nats of every row's every target under member m, one forward at
        theta with its pre-activations plus sign[m] * scale * Z[index[m]] (Z (J, B, T, S) float32
        on the host; index, sign (M,) the member table) on the (B, T + 1) batch. Here one forward
        over the M B rows (zosoma.engines.cpu.noisy_forward)."""
        return noisy_forward.member_losses(self.to_numpy(theta), layout, batch, scale, Z, index, sign)

    def activity_estimate(self, theta, layout: Layout, batch, coeffs, pop: Population, readout: str = "perturb",
                          causal: bool = False):
        """(d,) float32 engine array: the outer products of zeta = 1/(D B) sum_j coeffs[j, b] z_j
        over the population's D directions (coeffs (D, B)) with a clean forward's inputs at theta
        (outer_products), the noise kept from activity_losses or regenerated from the counters;
        readout "local": the readout's exact gradient from the same clean forward; causal: coeffs
        (D, B, T) are every target's differences, each position's noise weighted by those it can
        move (node_perturbation.credit)."""
        batch = np.asarray(batch)
        B, T = batch.shape[0], batch.shape[1] - 1
        kept = self._activity_kept
        S, J = node_perturbation.width(layout, readout), pop.directions
        if kept is not None and kept[0] == pop and kept[1] == list(range(J)) and kept[2].shape[3] == S:
            Z = kept[2]
        else:
            Z = noisy_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, range(J), pop.kind, readout)
        coeffs = np.asarray(coeffs, np.float64).reshape((J, B, T) if causal else (J, B))
        gates = 4 * layout.config.hidden * layout.config.layers
        zeta = noisy_forward.weighted_noise(*node_perturbation.credit(coeffs, causal), Z, gates)
        return self.asarray(self.outer_products(theta, layout, batch, zeta))

    def outer_products(self, theta, layout: Layout, batch, zeta) -> np.ndarray:
        """ghat (d,): the outer products of zeta (B, T, S) float32 with the inputs of a clean
        forward at theta on the (B, T + 1) batch (node_perturbation.estimate, here itself)."""
        return node_perturbation.estimate(self.to_numpy(theta), layout, batch, zeta)


def perturbed(theta: np.ndarray, pop: Population, pairs: range, out: np.ndarray | None = None) -> np.ndarray:
    """The dense population for `pairs`, as its member table says: rows 2j and 2j+1 are members
    2k and 2k+1 for k = pairs[j], member m = theta + sign_m * scale * delta_{direction_m}
    (antithetic pairs: theta + scale*delta_k and theta - scale*delta_k). Returns
    (2*len(pairs), d) float32."""
    out = np.empty((2 * len(pairs), theta.size), np.float32) if out is None else out
    k0, k1 = noise.stream_key(pop.seed)
    theta = np.ascontiguousarray(theta, np.float32)
    scale, code, none = np.float32(pop.scale), noise.kind_code(pop.kind), np.empty(0, np.float32)
    dirs, signs = pop.member_directions, pop.member_signs
    for j, k in enumerate(pairs):
        a, b = dirs[2 * k], dirs[2 * k + 1]
        if a == b and signs[2 * k] == -signs[2 * k + 1]:  # antithetic: one generation for both
            noise_kernels.antithetic_pair(out[2 * j], out[2 * j + 1], theta, signs[2 * k] * scale, code, k0, k1, a,
                                          pop.step, pop.expert, none)
        else:
            for i, m in ((0, a), (1, b)):
                noise_kernels.antithetic_pair(out[2 * j + i], none, theta, signs[2 * k + i] * scale, code, k0, k1, m,
                                              pop.step, pop.expert, none)
    return out


def _weights(coeffs, pop: Population) -> np.ndarray:
    """The float32 weights coeffs[j] / D of the population's D directions in SPSA's estimate."""
    pop.check_scalars(coeffs)
    coeffs = np.asarray(coeffs, np.float64)
    return (coeffs / len(coeffs)).astype(np.float32)


