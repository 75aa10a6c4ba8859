"""The CPU engine's noise kernels: SPSA's members and update straight from the counters.

The same numbers as zosoma.model.noise.add_noise (the specification and its reference
generator), float32 op for op: `antithetic_pair` builds both members of one direction from one
generation (an antithetic pair of a population's member table), or a single member;
`weighted_sum` / `apply_weighted_sum` regenerate the update's D directions block by block in one
pass over the parameters, split over threads (zosoma.engines.cpu.threads).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from zosoma.engines.cpu import threads
from zosoma.model.noise import RADEMACHER, kind_code, philox4x32_10, stream_key

_jit = numba.njit(cache=True, error_model="numpy", nogil=True)  # nogil: run on zosoma.engines.cpu.threads

_BLOCK = 128  # parameters per block of the fast paths: one Rademacher Philox block, 32 Gaussian ones
_SPAN = 32  # blocks the update adds at once (16 KiB of float32: L1)
_THREADED_MIN = 1 << 20  # parameters x directions from which the update is split over threads
# For byte c of a Rademacher word, the float32 sign bits of its 8 parameters, two per uint64 (the
# lower-numbered parameter in the low half: little-endian, as x86 and ARM are). Flipping w's sign
# bit gives w * delta exactly, so the update adds the same numbers without a multiply.
_SIGN_BITS = np.array([[((c >> (2 * p)) & 1) << 31 | ((c >> (2 * p + 1)) & 1) << 63 for p in range(4)]
                       for c in range(256)], np.uint64)


@_jit
def _block_values(values, kind, block, k0, k1, member, step, expert):
    """values (128,) float32 = delta[128*block : 128*block + 128] of (member, step, expert),
    computed exactly as _axpy_rademacher / _axpy_gaussian compute them."""
    if kind == RADEMACHER:
        x = philox4x32_10(block, member, step, expert, k0, k1)
        for w in range(4):
            word = x[w]
            for bit in range(32):  # vectorises: one variable shift per lane
                values[(w << 5) + bit] = (np.float32(1.0) - np.float32(2.0)
                                          * np.float32((word >> np.uint32(bit)) & np.uint32(1)))
    else:
        for q in range(_BLOCK >> 2):
            x = philox4x32_10((block << 5) + q, member, step, expert, k0, k1)
            for p in range(2):
                u1 = (np.float64(x[2 * p]) + 0.5) * 2.3283064365386963e-10
                u2 = (np.float64(x[2 * p + 1]) + 0.5) * 2.3283064365386963e-10
                r = math.sqrt(-2.0 * math.log(u1))
                values[4 * q + 2 * p] = np.float32(r * math.cos(2.0 * math.pi * u2))
                values[4 * q + 2 * p + 1] = np.float32(r * math.sin(2.0 * math.pi * u2))


@_jit
def _signed_block(pairs, w2, block, k0, k1, member, step, expert):
    """pairs (64,) uint64, read as (128,) float32, = w * delta[128*block : 128*block + 128] of
    (member, step, expert), Rademacher: w2 is w's float32 bits in both halves of a uint64."""
    x = philox4x32_10(block, member, step, expert, k0, k1)
    for w in range(4):
        word = x[w]
        for q in range(4):  # a byte of the word: 8 parameters, 4 pairs
            c = (word >> np.uint32(8 * q)) & np.uint32(255)
            o = (w << 4) + (q << 2)
            for p in range(4):
                pairs[o + p] = w2 ^ _SIGN_BITS[c, p]


@_jit
def antithetic_pair(plus, minus, base, scale, kind, k0, k1, member, step, expert, delta):
    """plus = base + scale * delta and minus = base - scale * delta, delta = the noise of
    (member, step, expert) under key (k0, k1) and kind code `kind`, from one generation; all
    float32 (d,), scale float32. The same numbers as add_noise with +scale and -scale. minus
    empty: plus alone (a member without an antithetic twin). delta: (d,) to keep the direction
    in, or empty."""
    n = base.shape[0]
    s = np.float32(scale)
    ns = -s
    both = minus.shape[0] > 0
    keep = delta.shape[0] > 0
    values = np.empty(_BLOCK, np.float32)
    for b in range((n + _BLOCK - 1) // _BLOCK):
        _block_values(values, kind, b, k0, k1, member, step, expert)
        j0 = b * _BLOCK
        for i in range(min(_BLOCK, n - j0)):
            plus[j0 + i] = base[j0 + i] + s * values[i]
            if both:
                minus[j0 + i] = base[j0 + i] + ns * values[i]
            if keep:
                delta[j0 + i] = values[i]


@_jit
def _weighted_blocks(out, theta, weights, lr, decay, decay_on, kind, k0, k1, step, expert, kept, b0, b1):
    """For parameter blocks [b0, b1): acc = sum_k weights[k] * delta_k, accumulated in float32 in
    k order from zero (as add_noise into a zeroed vector, k by k), then out = acc, or, when theta
    is not empty, out = theta - lr * acc, then minus decay * theta when decay_on. delta_k is
    regenerated, or read from kept (P, d) when that is not empty. Blocks go _SPAN at a time, so
    each direction's values are added over a span that stays in L1, in one vectorised loop."""
    n = out.shape[0]
    acc = np.empty(_SPAN * _BLOCK, np.float32)
    values = np.empty(_SPAN * _BLOCK, np.float32)
    pairs = np.empty(_SPAN * _BLOCK // 2, np.uint64)
    signed = pairs.view(np.float32)  # weights[k] * delta_k, built from sign bits
    bits = weights.view(np.uint32)
    fast = kind == RADEMACHER and kept.shape[0] == 0
    for s0 in range(b0, b1, _SPAN):
        s1 = min(b1, s0 + _SPAN)
        j0 = s0 * _BLOCK
        m = min(s1 * _BLOCK, n) - j0
        acc[:m] = 0.0
        for k in range(weights.shape[0]):
            if fast:
                w2 = np.uint64(bits[k]) | (np.uint64(bits[k]) << np.uint64(32))
                for b in range(s0, s1):
                    _signed_block(pairs[(b - s0) * (_BLOCK // 2):], w2, b, k0, k1, k, step, expert)
                for i in range(m):
                    acc[i] = acc[i] + signed[i]
            else:
                if kept.shape[0]:
                    values[:m] = kept[k, j0:j0 + m]
                else:
                    for b in range(s0, s1):
                        _block_values(values[(b - s0) * _BLOCK:(b - s0 + 1) * _BLOCK], kind, b, k0, k1, k, step,
                                      expert)
                w = weights[k]
                for i in range(m):
                    acc[i] = acc[i] + w * values[i]
        if theta.shape[0] == 0:
            for i in range(m):
                out[j0 + i] = acc[i]
        else:
            for i in range(m):
                t = theta[j0 + i]
                v = t - lr * acc[i]
                if decay_on:
                    v = v - decay * t
                out[j0 + i] = v


def _weighted(n, theta, weights, lr, decay, decay_on, seed, expert, step, kind, kept) -> np.ndarray:
    k0, k1 = stream_key(seed)
    code = kind_code(kind)
    weights = np.ascontiguousarray(weights, np.float32)
    kept = np.empty((0, 0), np.float32) if kept is None else kept
    if kept.size and kept.shape != (weights.size, n):
        raise ValueError(f"kept directions must be ({weights.size}, {n}), got {kept.shape}")
    out = np.empty(n, np.float32)
    # threads from about a million parameter-directions: at d x P = 0.8M one thread and two take
    # the same time (0.45-0.6 ms); the tiny preset's update (1.6M) takes 0.83 ms on one thread and
    # 0.63 ms on two (medians, AVX2 EPYC, sign-bit path); below that a busy core costs more than it saves
    many = n * weights.size >= _THREADED_MIN
    parts = threads.split((n + _BLOCK - 1) // _BLOCK, 4 * threads.n_threads() if many else 1)

    def work(i, _):
        _weighted_blocks(out, theta, weights, np.float32(lr), np.float32(decay), decay_on, code, k0, k1,
                         step, expert, kept, parts[i].start, parts[i].stop)

    threads.run_items(work, len(parts))
    return out


def weighted_sum(n, weights, seed, expert, step, kind="rademacher", kept=None) -> np.ndarray:
    """(n,) float32 sum_k weights[k] * delta_k, delta_k = noise(n, seed, expert, step, k, kind),
    the float32 weights (P,) applied in k order: the numbers of add_noise applied k by k to a
    zeroed vector. kept: the directions (P, n) float32 already generated (antithetic_pair's
    delta), else they are regenerated."""
    return _weighted(n, np.empty(0, np.float32), weights, 0.0, 0.0, False, seed, expert, step, kind, kept)


def apply_weighted_sum(theta, weights, lr, decay, seed, expert, step, kind="rademacher", kept=None) -> np.ndarray:
    """A new float32 theta - lr * weighted_sum(...), then - decay * theta unless decay is None
    (lr and decay rounded to float32), op for op as NumPy computes it from weighted_sum's result."""
    theta = np.ascontiguousarray(theta, np.float32)
    return _weighted(theta.size, theta, weights, lr, decay or 0.0, decay is not None, seed, expert, step, kind,
                     kept)
