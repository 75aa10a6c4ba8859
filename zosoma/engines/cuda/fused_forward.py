"""The small-expert population forward in one launch (kernels/fused.cu): each member's weights
built from the Philox counters in shared memory, the whole T-step recurrence, logits and NLL
inside one block, one loss out per member (docs/gpu.md, "Small experts: launches, not FLOPs").

It replaces the ~2T + 5 launches of cuda_forward's population forward (perturb, the weight
copies, a GEMM and a cell kernel per timestep, the logits, the log-softmax, the loss sum) with
one, for models whose member fits one block's shared memory: `shared_bytes(layout, B)` against
the device's opt-in limit (227 KB on an H100/H200). At B = 8 that is E=16 H=20 at 62 KB up to
E=32 H=64 at 217 KB; cuda_forward falls back to its kernels above it.

The launch takes a member table (direction, sign, expert, batch per member), so one launch can
hold the members of several populations: `experts_losses` evaluates N experts' steps, each its
own theta, batch and counters, in ONE launch. Shapes: M members, N experts, P pairs, B batch,
T time, d parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.config import VOCAB
from zosoma.engines.cuda import custom_kernels
from zosoma.engines.cuda.custom_kernels import runtime, to_device
from zosoma.model.noise import kind_code, stream_key
from zosoma.model.params import Layout
from zosoma.model.population import Population

LANES = 32  # fused.cu's partial maxima and sums per row of logits
THREADS = 512  # threads per block: B x 4H = 640 gate pre-activations at E=16 H=20, B=8
_U32 = 0xFFFFFFFF


def shared_bytes(layout: Layout, B: int) -> int:
    """Dynamic shared memory of one block of fused.cu for B rows (its layout, in the same order):
    the weights, h and c of every layer, the gates, the logits, the row reductions, B doubles."""
    cfg = layout.config
    H, L = cfg.hidden, cfg.layers
    floats = layout.size + 2 * L * B * H + B * 4 * H + B * VOCAB + 2 * B * LANES + B
    return 4 * (floats + (layout.size + B) % 2) + 8 * B


def fits(layout: Layout, B: int) -> bool:
    """Whether a member of this model on B rows fits one block's shared memory on the device."""
    return shared_bytes(layout, B) <= runtime().max_shared


@dataclass(frozen=True)
class Members:
    """The member table of one launch, (M,) each: member m is theta[expert[m]] + sign[m] * eps *
    delta_{direction[m]} (sign 0: theta itself), on batch batch[m]."""
    direction: np.ndarray  # int32
    sign: np.ndarray  # float32: +1, -1 or 0
    expert: np.ndarray  # int32: row of the per-expert thetas, counters and eps
    batch: np.ndarray  # int32: which (B, T+1) batch


def population_members(pop: Population, pairs: range, expert: int = 0, batch: int = 0) -> Members:
    """The members of `pairs` of a dense Population (its member table), all of one expert and batch."""
    direction, sign = pop.direction[pop.rows(pairs)], pop.sign[pop.rows(pairs)]
    return Members(direction, sign, np.full(sign.size, expert, np.int32), np.full(sign.size, batch, np.int32))


def member_losses(thetas, layout: Layout, batches, members: Members, counters, eps, kind: str) -> np.ndarray:
    """Mean nats/byte of every member of the table, in one launch. thetas (N, d) float32; batches
    (nb, B, T+1) uint8; counters (N, 4) uint32: (k0, k1, expert id, step) of each expert's noise
    (`expert_counters`); eps (N,) float32. Returns (M,) float64 NumPy."""
    thetas, batches = to_device(thetas), to_device(batches, np.uint8)
    if thetas.ndim != 2 or thetas.shape[1] != layout.size or batches.ndim != 3 or batches.shape[2] < 2:
        raise ValueError(f"thetas must be (N, {layout.size}) and batches (nb, B, T+1 >= 2), got {thetas.shape}, "
                         f"{batches.shape}")
    N, d = thetas.shape
    nb, B, T1 = batches.shape
    M = members.direction.shape[0]
    cfg = layout.config
    if M and (members.expert.min() < 0 or members.expert.max() >= N or members.batch.min() < 0
              or members.batch.max() >= nb):
        raise ValueError(f"the member table names experts outside 0..{N - 1} or batches outside 0..{nb - 1}")
    loss = runtime().xp.empty(M, np.float64)
    if M:
        # two copies up: the member table, then each expert's counters and eps (as their bits)
        sign_bits = members.sign.astype(np.float32).view(np.int32)
        table = to_device(np.concatenate([members.direction.astype(np.int32), sign_bits,
                                          members.expert.astype(np.int32), members.batch.astype(np.int32)]), np.int32)
        per_expert = to_device(np.concatenate([np.asarray(counters, np.uint32).ravel(),
                                               np.asarray(eps, np.float32).view(np.uint32)]), np.uint32)
        direction, sign, expert, batch = (table[i * M:(i + 1) * M] for i in range(4))
        custom_kernels.launch_blocks("fused_population_loss", M, THREADS, shared_bytes(layout, B), loss, thetas, d,
                                     batches, B, T1 - 1, direction, sign.view(np.float32), expert, batch,
                                     per_expert[:4 * N], per_expert[4 * N:].view(np.float32), M, cfg.embed,
                                     cfg.hidden, cfg.layers, kind_code(kind))
    return to_numpy(loss)


def counters(seed: int, expert: int, step: int) -> tuple:
    """One expert's row of the per-expert counters: its Philox key and (expert, step) counters."""
    return (*stream_key(seed), expert & _U32, step & _U32)


def expert_counters(pops: list[Population]) -> np.ndarray:
    """(N, 4) uint32: each Population's counters (k0, k1, expert, step)."""
    return np.array([counters(p.seed, p.expert, p.step) for p in pops], np.uint32)


def table_losses(theta, layout: Layout, batch, eps: float, seed: int, expert: int, step: int, kind: str,
                 direction, sign):
    """L of members 2j ("plus") and 2j+1 ("minus") of a member table (direction, sign), member m =
    theta + sign[m] * eps * delta_{direction[m]}, on one shared (B, T+1) batch, in one launch (the
    CUDA engine's SPSA step, cuda_forward.spsa_losses). Returns (plus, minus) float64 NumPy."""
    M = len(direction)
    members = Members(np.asarray(direction, np.int32), np.asarray(sign, np.float32), np.zeros(M, np.int32),
                      np.zeros(M, np.int32))
    losses = member_losses(to_device(theta)[None], layout, to_device(batch, np.uint8)[None], members,
                           np.array([counters(seed, expert, step)], np.uint32), np.float32([eps]), kind)
    return losses[0::2], losses[1::2]


def spsa_losses(theta, layout: Layout, batch, pop: Population, pairs: range | None = None):
    """L(member 2j) and L(member 2j+1) of `pairs` (default all) of a dense Population on one
    shared (B, T+1) batch, in one launch. Returns (plus, minus), each (len(pairs),) float64."""
    pairs = range(pop.P) if pairs is None else pairs
    return table_losses(theta, layout, batch, pop.scale, pop.seed, pop.expert, pop.step, pop.kind,
                        pop.direction[pop.rows(pairs)], pop.sign[pop.rows(pairs)])


def experts_losses(thetas, layout: Layout, batches, pops: list[Population], pairs: list[range] | None = None):
    """The steps of N experts in ONE launch: expert n's pairs of pops[n] (default all) around
    thetas[n] on batches[n]. thetas (N, d); batches (N, B, T+1) uint8; one dense Population per
    expert, all of one noise kind. Returns one (plus, minus) per expert, as N calls of
    spsa_losses would."""
    if len({p.kind for p in pops}) > 1 or any(p.rank for p in pops):
        raise ValueError("experts_losses takes dense populations of one noise kind")
    pairs = [range(p.P) for p in pops] if pairs is None else pairs
    tables = [population_members(p, r, expert=n, batch=n) for n, (p, r) in enumerate(zip(pops, pairs))]
    members = Members(*(np.concatenate([getattr(t, f) for t in tables]) for f in Members.__dataclass_fields__))
    eps = np.array([p.scale for p in pops], np.float32)
    losses = member_losses(thetas, layout, batches, members, expert_counters(pops), eps, pops[0].kind)
    out, at = [], 0
    for r in pairs:
        out.append((losses[at:at + 2 * len(r):2], losses[at + 1:at + 2 * len(r):2]))
        at += 2 * len(r)
    return out


def experts_update(thetas, coeffs, pops: list[Population], lr, weight_decay=0.0, out=None):
    """One fused ZO-SGD step of N experts in ONE launch: row n is what cuda_noise.spsa_update
    makes of thetas[n] with coeffs[n] under pops[n]'s counters, bit for bit. thetas (N, d) device
    float32; coeffs (N, K): K estimate scalars per expert (K = each Population's directions); lr,
    weight_decay: one each or one per expert. Returns the (N, d) device array (out, when given:
    it may be thetas, in place)."""
    thetas = to_device(thetas)
    N, d = thetas.shape
    c = np.asarray(to_numpy(coeffs), np.float64)
    if c.ndim != 2 or c.shape[0] != N or len(pops) != N or len({p.kind for p in pops}) > 1:
        raise ValueError(f"experts_update takes thetas (N, d), coeffs (N, K) and N populations of one noise kind, "
                         f"got {thetas.shape}, {c.shape} and {len(pops)}")
    coef = to_device((c / c.shape[1]).astype(np.float32))  # coeffs[k] / K as spsa_update's coefficients
    lr = np.broadcast_to(np.asarray(lr, np.float64), N)
    wd = np.broadcast_to(np.asarray(weight_decay, np.float64), N)
    rates = np.stack([lr.astype(np.float32), np.where(wd != 0, (lr * wd).astype(np.float32), 0)], axis=1)
    out = runtime().xp.empty_like(thetas) if out is None else custom_kernels.check_out(out, (N, d))
    counters = to_device(expert_counters(pops), np.uint32)
    custom_kernels.launch("experts_update", -(-d // 4), out, thetas, coef, c.shape[1], d, counters,
                          to_device(rates, np.float32), N, kind_code(pops[0].kind), rows=N)
    return out


def population_loss(thetas, layout: Layout, batch) -> np.ndarray:
    """Mean nats/byte of M given models (no noise) in one launch, as cuda_forward.population_loss.
    thetas (M, d); batch (B, T+1) shared or (M, B, T+1) one per member. Returns (M,) float64."""
    thetas = to_device(thetas)
    batch = to_device(batch, np.uint8)
    batches = batch[None] if batch.ndim == 2 else batch
    M = thetas.shape[0]
    members = Members(np.zeros(M, np.int32), np.zeros(M, np.float32), np.arange(M, dtype=np.int32),
                      np.arange(M, dtype=np.int32) if batches.shape[0] > 1 else np.zeros(M, np.int32))
    return member_losses(thetas, layout, batches, members, np.zeros((M, 4), np.uint32), np.zeros(M, np.float32),
                         "rademacher")
