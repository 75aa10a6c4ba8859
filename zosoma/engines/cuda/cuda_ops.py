"""The CUDA engine: CudaOps, the population forward and SPSA on an NVIDIA GPU, through CuPy.

Split as thinc splits its CupyOps: custom_kernels (the kernels' signatures, the runtime, every
launch), cuda_noise (noise and SPSA, kernels/noise.cu), cuda_forward (the population forward,
kernels/lstm.cu + cuBLAS) and this module, the Ops over them.

Its parts mirror the CPU functions one for one, and is checked against them (tests/test_kernels.py,
studies/gpu_check.py):

    population_loss(thetas, layout, batch)            zosoma.engines.cpu.forward.population_loss
    nll_stream / log_probs                             zosoma.engines.cpu.forward.nll_stream / log_probs
    population_nll(thetas, layout, tokens, targets)    nll_stream of M models at once, from zero state
    eggroll_population_loss(theta, layout, batch, ...) zosoma.engines.cpu.lowrank.eggroll_population_loss
    add_noise(out, base, scale, seed, ...)             zosoma.model.noise.add_noise (bit-identical signs)
    perturbed(theta, eps, members, seed, ...)          zosoma.engines.ops.perturbed
    spsa_gradient(coeffs, d, seed, ...)                zosoma.engines.ops.Ops.noise_sum
    spsa_update(theta, coeffs, lr, seed, ...)          zosoma.engines.ops.Ops.sgd_update (fused)
    spsa_losses(theta, layout, batch, P, eps, ...)     Ops.perturbed_losses of a dense Population
    experts_losses(thetas, layout, batches, pops)      Ops.experts_perturbed_losses: N experts, one launch
    activity_forward.member_nats / .estimate            Ops.activity_losses / activity_estimate (node
                                                       perturbation: zosoma.engines.cpu.noisy_forward)
    experts_update(thetas, coeffs, pops, lr, wd)       Ops.experts_sgd_update: N experts, one launch


Inputs may be NumPy or CuPy arrays (NumPy ones are copied to the device on each call, so keep theta
on the device across steps: `to_device`); array results stay on the device, except the per-member
losses, nll_stream, log_probs and population_nll, which return NumPy like their CPU twins.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.engines.cpu.lowrank import eggroll_step
from zosoma.engines.cuda import activity_forward, device_routing
from zosoma.engines.cuda.cuda_forward import (eggroll_population_loss, log_probs, nll_stream, population_loss,
                                             spsa_losses, step_path)
from zosoma.engines.cuda.cuda_noise import perturb, plain_rows, spsa_gradient, spsa_update
from zosoma.engines.cuda.custom_kernels import runtime, to_device
from zosoma.engines.cuda.fused_forward import experts_losses, experts_update
from zosoma.engines.cuda.grouped import grouped_nll
from zosoma.engines.cuda.tensor_cores import check_gemm_format, gemm_format
from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation
from zosoma.model.noise import KINDS, noise_length, split_factors
from zosoma.model.params import Layout
from zosoma.model.population import Population


class CudaOps(Ops):
    """Ops on an NVIDIA GPU: CuPy arrays, the kernels and forwards above. theta and optimizer
    state live on the device between steps; only the losses and the step's scalars
    (docs/architecture.md) cross to and from the host. Forwards and updates agree with the CPU engine within
    float32 rounding (Rademacher noise and the dense updates bit for bit)."""

    name = "cuda"
    device = "cuda"
    on_device = True

    def __init__(self, gemm: str = "fp32"):
        self.xp = runtime().xp
        # every forward's GEMMs: fp32, or tensor cores (tf32, bf16; zosoma.engines.cuda.tensor_cores);
        # the fused kernel of small models has none
        self.gemm = check_gemm_format(gemm)

    def _gemms(self):
        """The GEMMs of the block in this engine's format (fp32: as the caller has them)."""
        return gemm_format(self.gemm) if self.gemm != "fp32" else contextlib.nullcontext()

    def asarray(self, x):
        return to_device(x)

    def to_numpy(self, x) -> np.ndarray:
        return to_numpy(x)

    def population_loss(self, thetas, layout: Layout, batch) -> np.ndarray:
        with self._gemms():
            return population_loss(thetas, layout, batch)

    def perturbed_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                         timings: dict | None = None):
        pairs = range(pop.P) if pairs is None else pairs
        t0 = time.perf_counter()
        with self._gemms():
            result = self._perturbed_losses(theta, layout, batch, pop, pairs)
        if timings is not None:  # noise is made inside the device population: all of it is forward
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t0
        return result

    def _perturbed_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range):
        if pop.rank:
            losses = eggroll_population_loss(theta, layout, batch, pop.scale, pop.rank, pop.seed, pop.expert,
                                             pop.step, len(pairs), first=pairs.start)
            result = losses[0::2], losses[1::2]
        else:
            rows = pop.rows(pairs)
            result = spsa_losses(theta, layout, batch, pop.P, pop.scale, pop.seed, pop.expert, pop.step,
                                 pop.kind, pairs=pairs, table=(pop.direction[rows], pop.sign[rows]))
        return result

    def experts_perturbed_losses(self, thetas, layout: Layout, batches, pops: list[Population]) -> list:
        """N experts' dense populations of one noise kind, where a member fits a block's shared
        memory, in ONE fused launch (fused_forward.experts_losses: bitwise N single-expert fused
        launches); otherwise one expert after another."""
        batches = self.xp.asarray(batches)
        dense = all(not p.rank for p in pops) and len({p.kind for p in pops}) == 1
        if dense and step_path(layout, batches.shape[1], batches.shape[2] - 1, 2 * pops[0].P) == "fused":
            return experts_losses(self.xp.stack([to_device(t) for t in thetas]), layout, batches, pops)
        return super().experts_perturbed_losses(thetas, layout, batches, pops)

    def nll_stream(self, theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):  # every column
        with self._gemms():
            return nll_stream(theta, layout, tokens, targets, state)

    def log_probs(self, theta, layout: Layout, tokens, state=None):
        with self._gemms():
            return log_probs(theta, layout, tokens, state)

    def route(self, router, contexts):
        """A c-BTM router's choice on the device (zosoma.engines.cuda.device_routing: the host's
        experts but at float32 ties, weights within ROUTE_RTOL); a router without a clustering
        (a single model's) chooses as it does on the host."""
        if getattr(router, "clustering", None) is None:
            return router.select(contexts)
        return device_routing.select(router, contexts)

    def models_nll(self, models, rows, scored_from=()) -> list[np.ndarray]:  # scored_from unused: every column
        """Models of one size run as ONE population forward of row tiles (zosoma.engines.cuda.grouped):
        each model's rows sorted into tiles, padded to the tile, not to the largest model, so a
        time step is one batched GEMM and one cell kernel however many models there are."""
        out = [None] * len(models)
        groups: dict = {}
        for i, (_, layout) in enumerate(models):
            groups.setdefault(layout.config, (layout, []))[1].append(i)
        for layout, ids in groups.values():
            with self._gemms():
                nlls = grouped_nll([models[i][0] for i in ids], layout, [rows[i] for i in ids])
            for i, nll in zip(ids, nlls):
                out[i] = nll
        return out

    def noise_sum(self, coeffs, d: int, pop: Population):
        pop.check_scalars(coeffs)
        return spsa_gradient(coeffs, d, pop.seed, pop.expert, pop.step, pop.kind)

    def sgd_update(self, theta, coeffs, pop: Population, lr: float, weight_decay: float = 0.0):
        pop.check_scalars(coeffs)
        return spsa_update(theta, coeffs, lr, pop.seed, pop.expert, pop.step, pop.kind, weight_decay)

    def experts_sgd_update(self, thetas, coeffs, pops: list[Population], lrs, weight_decays) -> list:
        """N experts' fused steps of one noise kind and as many scalars each in ONE launch
        (fused_forward.experts_update: each row bitwise spsa_update's); otherwise one by one."""
        for c, p in zip(coeffs, pops):
            p.check_scalars(c)
        if len({p.kind for p in pops}) > 1 or len({len(c) for c in coeffs}) > 1:
            return super().experts_sgd_update(thetas, coeffs, pops, lrs, weight_decays)
        new = experts_update(self.xp.stack([to_device(t) for t in thetas]), np.stack(coeffs), pops,
                             np.asarray(lrs, np.float64), np.asarray(weight_decays, np.float64))
        return list(new)

    def lowrank_update(self, theta, layout: Layout, coeffs, pop: Population, lr: float):
        """The factors are regenerated on the device (float32 Box-Muller, within float32 rounding
        of the CPU's) and the update accumulates there in float64."""
        r, P = pop.rank, len(coeffs)
        n = noise_length(layout, r)
        z = self.xp.empty((P, n), np.float32)
        perturb(z, self.xp.zeros(n, np.float32), 1.0, 0, pop.seed, pop.expert, pop.step, *plain_rows(range(P)),
                KINDS["gaussian"])
        factors = split_factors(z.astype(np.float64), layout, r)
        return eggroll_step(theta, layout, self.xp.asarray(np.asarray(coeffs, np.float64)), lr,
                                    pop.scale, r, pop.seed, pop.expert, pop.step, factors=factors)

    # --- activity (node) perturbation: zosoma.engines.cuda.activity_forward ------------------------

    # (Population, directions, (J, B, T, S) device float32, theta, batch, outputs): the noise last drawn and
    # the clean forward's every layer's outputs (T, B, H), which rode with the members at that theta and batch
    _activity_kept = None

    def activity_losses(self, theta, layout: Layout, batch, pop: Population, pairs: range | None = None,
                        timings: dict | None = None, readout: str = "perturb", positions: bool = False):
        """Ops.activity_losses on the device: the noise drawn there from the same counters, the
        2 len(pairs) members as one forward over their 2 len(pairs) B rows, with the update's clean
        forward as B rows more; only the nats (one per member, row and target) reach the host. The
        noise and the clean forward's outputs stay on the device for activity_estimate."""
        pairs = range(pop.P) if pairs is None else pairs
        t0 = time.perf_counter()
        B, T = np.shape(batch)[0], np.shape(batch)[1] - 1
        table = pop.direction[pop.rows(pairs)]
        directions = sorted(set(table.tolist()))  # each noise drawn once: a pair's two members may share it
        Z = activity_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, directions, pop.kind, readout)
        with gemm_format(self.gemm):
            nats, outputs = activity_forward.member_nats(theta, layout, batch, pop.scale, Z,
                                                         np.searchsorted(directions, table), pop.sign[pop.rows(pairs)],
                                                         clean=True)
        nats = self.to_numpy(nats).astype(np.float64)
        plus, minus = np.ascontiguousarray(nats[0::2]), np.ascontiguousarray(nats[1::2])
        if not positions:
            plus, minus = plus.mean(axis=-1), minus.mean(axis=-1)
        self._activity_kept = (pop, directions, Z, theta, np.array(self.to_numpy(batch)), outputs)
        if timings is not None:  # noise and forward both on the device: all of it is forward
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t0
        return plus, minus

    def activity_estimate(self, theta, layout: Layout, batch, coeffs, pop: Population, readout: str = "perturb",
                          causal: bool = False):
        """Ops.activity_estimate on the device: the scalars' weights (node_perturbation.credit, on the
        host) go up, zeta and the outer products are made there, ghat stays there. The clean
        forward's outputs are activity_losses' when it ran this population at this very theta (the
        same array: theta is never changed in place) and batch; else the clean forward runs here."""
        B, T = np.shape(batch)[0], np.shape(batch)[1] - 1
        kept = self._activity_kept
        S, J = node_perturbation.width(layout, readout), pop.directions
        ours = kept is not None and kept[0] == pop
        if ours and kept[1] == list(range(J)) and kept[2].shape[3] == S:
            Z = kept[2]
        else:
            Z = activity_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, range(J), pop.kind, readout)
        same = ours and kept[3] is theta and np.array_equal(kept[4], self.to_numpy(batch))
        coeffs = np.asarray(coeffs, np.float64).reshape((J, B, T) if causal else (J, B))
        gates = 4 * layout.config.hidden * layout.config.layers
        zeta = activity_forward.weighted_noise(*node_perturbation.credit(coeffs, causal), Z, gates)
        with gemm_format(self.gemm):
            return activity_forward.estimate(theta, layout, batch, zeta, kept[5] if same else None)
