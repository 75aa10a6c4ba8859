"""Counter-based perturbation noise: a pure function of (seed, expert, step, member, index).

Nothing is stored: any backend on any machine regenerates the same perturbation from its counter.
The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; the generator of cuRAND, JAX and PyTorch's CUDA RNG), checked against Random123's
known-answer vectors in the tests.

Specification (enough to reimplement it on other hardware):

    key     = (seed mod 2**32, seed >> 32)                 # two uint32 words
    counter = (block, member, step, expert)                # four uint32 words
    x0..x3  = philox4x32_10(counter, key)                  # four uint32 words per block

Rademacher (default): 128 parameters per block, one bit each.
    block = i >> 7;  j = i & 127;  bit = (x[j >> 5] >> (j & 31)) & 1;  delta_i = 1 - 2 * bit

Gaussian: 4 parameters per block, Box-Muller on the pairs (x0, x1) and (x2, x3):
    block = i >> 2;  p = (i >> 1) & 1;  a, b = x[2p], x[2p + 1]
    u1 = (a + 0.5) * 2**-32;  u2 = (b + 0.5) * 2**-32;  r = sqrt(-2 ln u1)
    delta_i = r * cos(2 pi u2) if i is even else r * sin(2 pi u2)
The CPU computes Gaussian values in float64 and rounds them to float32; a float32 implementation
agrees within float32 rounding.

In SPSA a member is one perturbation direction k (its antithetic pair theta +/- eps*delta_k shares
it); in EGGROLL a member is one antithetic pair of low-rank factors.

Fast paths (same numbers as add_noise, float32 op for op): `antithetic_pair` builds both members
of a pair from one generation; `weighted_sum` / `apply_weighted_sum` regenerate SPSA's P directions
block by block in one pass over the parameters (the update), split over threads.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from zosoma.model import threads

RADEMACHER, GAUSSIAN = 0, 1
KINDS = {"rademacher": RADEMACHER, "gaussian": GAUSSIAN}

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # Philox multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)  # Weyl key increments
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_jit = numba.njit(cache=True, error_model="numpy", nogil=True)  # nogil: zosoma.model.threads


@_jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of one counter (c0..c3) under key (k0, k1); all uint32. Returns 4 uint32."""
    c0, c1, c2, c3 = np.uint32(c0), np.uint32(c1), np.uint32(c2), np.uint32(c3)
    k0, k1 = np.uint32(k0), np.uint32(k1)
    for _ in range(10):
        p0 = _M0 * np.uint64(c0)
        p1 = _M1 * np.uint64(c2)
        hi0, lo0 = np.uint32(p0 >> _S32), np.uint32(p0 & _LO32)
        hi1, lo1 = np.uint32(p1 >> _S32), np.uint32(p1 & _LO32)
        # numba widens integer arithmetic to 64 bits; truncate back to the uint32 words
        c0, c1, c2, c3 = np.uint32(hi1 ^ c1 ^ k0), lo1, np.uint32(hi0 ^ c3 ^ k1), lo0
        k0 = np.uint32(k0 + _W0)
        k1 = np.uint32(k1 + _W1)
    return c0, c1, c2, c3


def stream_key(seed: int) -> tuple[int, int]:
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    return seed & 0xFFFFFFFF, seed >> 32


@_jit
def _axpy_rademacher(out, base, scale, start, k0, k1, member, step, expert):
    # out[j] = base[j] + scale * delta[start + j]; start is a multiple of 128.
    n = out.shape[0]
    first = start >> 7
    for b in range((n + 127) >> 7):
        x = philox4x32_10(first + b, member, step, expert, k0, k1)
        for w in range(4):
            word = x[w]
            j0 = (b << 7) + (w << 5)
            for bit in range(32):
                j = j0 + bit
                if j < n:
                    sign = np.float32(1.0) - np.float32(2.0) * np.float32((word >> np.uint32(bit)) & np.uint32(1))
                    out[j] = base[j] + scale * sign


@_jit
def _axpy_gaussian(out, base, scale, start, k0, k1, member, step, expert):
    # out[j] = base[j] + scale * delta[start + j]; start is a multiple of 4.
    n = out.shape[0]
    first = start >> 2
    for b in range((n + 3) >> 2):
        x = philox4x32_10(first + b, member, step, expert, k0, k1)
        for p in range(2):
            u1 = (np.float64(x[2 * p]) + 0.5) * 2.3283064365386963e-10
            u2 = (np.float64(x[2 * p + 1]) + 0.5) * 2.3283064365386963e-10
            r = math.sqrt(-2.0 * math.log(u1))
            j = (b << 2) + 2 * p
            if j < n:
                out[j] = base[j] + scale * np.float32(r * math.cos(2.0 * math.pi * u2))
            if j + 1 < n:
                out[j + 1] = base[j + 1] + scale * np.float32(r * math.sin(2.0 * math.pi * u2))


def add_noise(out, base, scale, seed, expert, step, member, kind="rademacher", start=0):
    """out = base + scale * delta, where delta = noise(seed, expert, step, member)[start:start+n].

    out and base are float32 (n,) arrays and may be the same array (in-place update). `start` lets
    a caller work on a slice of the parameter vector; it must be a multiple of 128 (Rademacher) or
    4 (Gaussian)."""
    k0, k1 = stream_key(seed)
    if kind not in KINDS:
        raise ValueError(f"noise kind must be one of {', '.join(KINDS)}, got {kind!r}")
    code = KINDS[kind]
    align = 128 if code == RADEMACHER else 4
    if start % align:
        raise ValueError(f"start must be a multiple of {align} for {kind} noise")
    fn = _axpy_rademacher if code == RADEMACHER else _axpy_gaussian
    fn(out, base, np.float32(scale), start, k0, k1, member, step, expert)
    return out


def noise(n, seed, expert, step, member, kind="rademacher", start=0) -> np.ndarray:
    """The perturbation delta[start:start+n] itself, float32 (for tests and small uses)."""
    out = np.zeros(n, np.float32)
    return add_noise(out, out, 1.0, seed, expert, step, member, kind, start)


def kind_code(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"noise kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return KINDS[kind]


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
    float32 (d,), scale float32. The same numbers as add_noise with +scale and -scale. delta:
    (d,) to keep the direction in, or empty."""
    n = base.shape[0]
    s = np.float32(scale)
    ns = -s
    keep = delta.shape[0] > 0
    values = np.empty(_BLOCK, np.float32)
    for b in range((n + _BLOCK - 1) // _BLOCK):
        _block_values(values, kind, b, k0, k1, member, step, expert)
        j0 = b * _BLOCK
        for i in range(min(_BLOCK, n - j0)):
            plus[j0 + i] = base[j0 + i] + s * values[i]
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
