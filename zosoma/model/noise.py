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

EGGROLL's low-rank factors (Sarkar et al., "Evolution Strategies at the Hyperscale") are sliced
from one Gaussian stream per pair, member = the pair's index i:

    z = noise(noise_length(layout, r), seed, expert, step, member=i, kind="gaussian")

walking the Layout entries in order (embed, lstm0.w_ih, lstm0.w_hh, lstm0.bias, ..., out.w, out.b):

    matrix W (m, n) ("x @ W" orientation, m = fan-in rows, n = columns):
        A_i = next m*r values reshaped (m, r) row-major, then B_i = next n*r values reshaped (n, r)
        perturbation E_i = (sigma / sqrt(r)) A_i B_i^T
    vector v (k,):
        e_i = sigma * next k values                       (full-rank Gaussian)

The embedding (V, E) is a matrix like any other. Antithetic pairs: population member 2i uses
theta + E_i, member 2i+1 uses theta - E_i. `materialise` builds E_i densely, the reference that
the engines' population forwards (which never build it) are checked against.

This module is the reference generator, a Philox block at a time, written to be read; the CPU
engine's fast paths (zosoma.engines.cpu.noise_kernels) produce the same numbers, the CUDA kernels
too (Gaussian ones within float32 rounding).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from zosoma.arrays import get_array_module
from zosoma.model.params import Layout

RADEMACHER, GAUSSIAN = 0, 1
KINDS = {"rademacher": RADEMACHER, "gaussian": GAUSSIAN}

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # Philox multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)  # Weyl key increments
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_jit = numba.njit(cache=True, error_model="numpy", nogil=True)  # nogil: called on the CPU engine's threads


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
    code = kind_code(kind)
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


# --- EGGROLL's low-rank factors (module docstring) ------------------------------------------------

def noise_length(layout: Layout, r: int) -> int:
    """Length of one pair's Gaussian stream: sum over matrices of (m + n) * r, plus vector sizes."""
    return sum((e.shape[0] + e.shape[1]) * r if len(e.shape) == 2 else e.size
               for e in layout.entries)


def check_rank(r: int) -> int:
    r = int(r)
    if r < 1:
        raise ValueError(f"EGGROLL rank r must be at least 1, got {r}")
    return r


def split_factors(z, layout: Layout, r: int) -> dict:
    """Slice noise streams z (..., noise_length), NumPy or CuPy, into contiguous
    name -> (A (..., m, r), B (..., n, r)) for matrices and name -> (..., k) for vectors: the
    order of the module docstring, shared by the CPU and GPU populations and the update."""
    xp = get_array_module(z)
    lead = z.shape[:-1]
    out, pos = {}, 0
    for e in layout.entries:
        shapes = [(e.shape[0], r), (e.shape[1], r)] if len(e.shape) == 2 else [e.shape]
        parts = []
        for shape in shapes:
            size = math.prod(shape)
            parts.append(xp.ascontiguousarray(z[..., pos:pos + size]).reshape(lead + shape))
            pos += size
        out[e.name] = tuple(parts) if len(e.shape) == 2 else parts[0]
    return out


def pair_factors(layout: Layout, r: int, seed: int, expert: int, step: int, member: int,
                 dtype=np.float32) -> dict:
    """The unscaled noise of pair `member`: name -> (A (m, r), B (n, r)) for matrices, name -> (k,)
    standard Gaussian for vectors (callers apply the sigma and sigma/sqrt(r) scales)."""
    r = check_rank(r)
    z = noise(noise_length(layout, r), seed, expert, step, member, kind="gaussian")
    return split_factors(z.astype(dtype), layout, r)


def population_factors(layout: Layout, r: int, seed: int, expert: int, step: int, n_pairs: int,
                       dtype=np.float32, first: int = 0) -> dict:
    """The factors of pairs first .. first+n_pairs-1 stacked: name -> (A (P, m, r), B (P, n, r))
    or (P, k), P = n_pairs."""
    r = check_rank(r)
    n = noise_length(layout, r)
    z = np.empty((n_pairs, n), dtype)
    for i in range(n_pairs):
        z[i] = noise(n, seed, expert, step, first + i, kind="gaussian")
    return split_factors(z, layout, r)


def materialise(layout: Layout, sigma: float, r: int, seed: int, expert: int, step: int,
                member: int, dtype=np.float64) -> np.ndarray:
    """The dense perturbation E_i of pair `member` as a flat (d,) vector (tests and small uses only;
    the forward and the update never build it)."""
    f = pair_factors(layout, r, seed, expert, step, member, dtype)
    out = np.empty(layout.size, dtype)
    c = sigma / math.sqrt(r)
    for e in layout.entries:
        v = f[e.name]
        block = c * (v[0] @ v[1].T) if len(e.shape) == 2 else sigma * v
        out[e.offset:e.offset + e.size] = block.ravel()
    return out
