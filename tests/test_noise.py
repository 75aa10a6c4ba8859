"""zosoma.model.noise against Random123's known answers and an independent pure-Python reading of its spec.

The pure-Python implementation below follows only the specification in zosoma/model/noise.py's docstring
(plain Python ints, no NumPy, no Numba), so it is a second, independent implementation; the
hard-coded vectors are its output, for porters (CUDA, other languages) to copy.
"""

import math
import subprocess
import sys

import numpy as np
import pytest

from helpers import assert_close
from world import PHILOX_KAT
from zosoma.model.noise import add_noise, noise, philox4x32_10

M32 = 0xFFFFFFFF

# zosoma's own test vectors: noise(n, seed=1234, expert=2, step=7, member=3, kind)[:n]
VECTOR_KEY = dict(seed=1234, expert=2, step=7, member=3)
RADEMACHER_FIRST16 = [1, 1, 1, -1, 1, 1, -1, 1, -1, 1, -1, 1, -1, 1, 1, 1]
GAUSSIAN_FIRST4 = [0.390466986, -0.026698803, -0.510494896, -0.276701408]


# --- the independent reference: the docstring's spec in plain Python ints ---------------------

def philox_py(counter, key):
    """Philox4x32-10 (Salmon et al. 2011) in Python ints: ten rounds, key bumped after each."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def block_py(block, seed, expert, step, member):
    return philox_py((block, member, step, expert), (seed & M32, seed >> 32))


def rademacher_py(n, seed, expert, step, member, start=0):
    out = []
    for i in range(start, start + n):
        x = block_py(i >> 7, seed, expert, step, member)
        j = i & 127
        out.append(1 - 2 * ((x[j >> 5] >> (j & 31)) & 1))
    return out


def gaussian_py(n, seed, expert, step, member, start=0):
    out = []
    for i in range(start, start + n):
        x = block_py(i >> 2, seed, expert, step, member)
        p = (i >> 1) & 1
        u1 = (x[2 * p] + 0.5) * 2.0**-32
        u2 = (x[2 * p + 1] + 0.5) * 2.0**-32
        r = math.sqrt(-2.0 * math.log(u1))
        out.append(r * math.cos(2 * math.pi * u2) if i % 2 == 0 else r * math.sin(2 * math.pi * u2))
    return out


# --- Philox ------------------------------------------------------------------------------------

@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(*counter, *key)) == expected
    assert philox_py(counter, key) == expected


# --- noise() against the pure-Python spec -------------------------------------------------------

KEYS = [  # (seed, expert, step, member); 2**40 + 12345 exercises the high key word
    (0, 0, 0, 0),
    (1234, 2, 7, 3),
    (2**40 + 12345, 1, 123456, 1023),
    (2**64 - 1, 7, 1, 2**32 - 1),
]


@pytest.mark.parametrize("seed, expert, step, member", KEYS)
@pytest.mark.parametrize("n, start", [(300, 0), (300, 256), (77, 640), (1, 128)])
def test_rademacher_matches_spec(seed, expert, step, member, n, start):
    got = noise(n, seed, expert, step, member, "rademacher", start)
    assert got.dtype == np.float32 and got.shape == (n,)
    want = np.array(rademacher_py(n, seed, expert, step, member, start), np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed, expert, step, member", KEYS)
@pytest.mark.parametrize("n, start", [(301, 0), (37, 12), (5, 4000), (2, 4)])
def test_gaussian_matches_spec(seed, expert, step, member, n, start):
    got = noise(n, seed, expert, step, member, "gaussian", start)
    assert got.dtype == np.float32 and got.shape == (n,)
    want = gaussian_py(n, seed, expert, step, member, start)
    # the spec computes in float64 and rounds to float32: within one float32 rounding
    assert_close(got, want, atol=1e-12, rtol=2.0**-23, name="gaussian noise")


def test_hard_coded_vectors():
    np.testing.assert_array_equal(noise(16, kind="rademacher", **VECTOR_KEY), RADEMACHER_FIRST16)
    assert_close(noise(4, kind="gaussian", **VECTOR_KEY), GAUSSIAN_FIRST4, atol=1e-6, rtol=0,
                 name="gaussian vector")
    # and the hard-coded numbers are what the pure-Python spec gives
    assert rademacher_py(16, **VECTOR_KEY) == RADEMACHER_FIRST16
    assert_close(gaussian_py(4, **VECTOR_KEY), GAUSSIAN_FIRST4, atol=1e-8, rtol=0)


@pytest.mark.parametrize("kind, start", [("rademacher", 384), ("gaussian", 20)])
def test_start_is_a_slice_of_the_whole_vector(kind, start):
    whole = noise(start + 1000, 5, 1, 2, 3, kind)
    np.testing.assert_array_equal(noise(1000, 5, 1, 2, 3, kind, start), whole[start:])
    np.testing.assert_array_equal(noise(start + 10, 5, 1, 2, 3, kind), whole[:start + 10])


# --- properties --------------------------------------------------------------------------------

@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_deterministic(kind):
    """A key gives the same bits in a fresh process as here after other keys' noise: none is carried."""
    code = (f"import sys; from zosoma.model.noise import noise; "
            f"sys.stdout.buffer.write(noise(5000, 9, 1, 2, 3, {kind!r}).tobytes())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=300).stdout
    noise(777, 1, 0, 0, 0, kind)
    assert noise(5000, 9, 1, 2, 3, kind).tobytes() == fresh


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("change", ["seed", "expert", "step", "member"])
def test_every_counter_field_changes_the_noise(kind, change):
    base = dict(seed=11, expert=1, step=5, member=2)
    other = dict(base, **{change: base[change] + 1})
    a, b = noise(4096, kind=kind, **base), noise(4096, kind=kind, **other)
    same = np.mean(a == b)
    if kind == "rademacher":
        assert 0.45 < same < 0.55, f"{change}: {same:.3f} of signs agree (independent: 0.5)"
    else:
        assert same == 0.0
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.06  # 4 sigma of 1/sqrt(4096)


def test_rademacher_statistics():
    x = noise(10**6, 3, 0, 0, 0, "rademacher")
    assert set(np.unique(x)) == {-1.0, 1.0}
    assert abs(x.mean(dtype=np.float64)) < 5e-3  # std of the mean: 1e-3
    # neighbouring signs are uncorrelated (bits of one word are not reused)
    assert abs(np.mean(x[1:].astype(np.float64) * x[:-1])) < 5e-3


def test_gaussian_statistics():
    x = noise(10**6, 3, 0, 0, 0, "gaussian").astype(np.float64)
    assert abs(x.mean()) < 5e-3  # std of the mean: 1e-3
    assert abs(x.std() - 1.0) < 5e-3  # std of the std: 1/sqrt(2n) = 7e-4
    assert abs(np.mean(np.abs(x) < 1.0) - 0.682689) < 3e-3  # one-sigma mass
    assert abs(np.mean(x**4) - 3.0) < 0.05  # kurtosis; std about 0.01
    assert abs(np.mean(x[1:] * x[:-1])) < 5e-3  # the cos and sin of a pair are uncorrelated


@pytest.mark.parametrize("kind, start", [("rademacher", 128), ("gaussian", 8)])
def test_add_noise_in_place_equals_out_of_place(kind, start):
    base = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = add_noise(np.empty_like(base), base, 0.01, 42, 1, 2, 3, kind, start)
    inplace = base.copy()
    returned = add_noise(inplace, inplace, 0.01, 42, 1, 2, 3, kind, start)
    assert returned is inplace
    np.testing.assert_array_equal(inplace, out)
    # out = base + scale * delta, with delta from noise()
    delta = noise(1000, 42, 1, 2, 3, kind, start)
    np.testing.assert_array_equal(out, base + np.float32(0.01) * delta)


@pytest.mark.parametrize("kind, start", [("rademacher", 64), ("rademacher", 1), ("gaussian", 2),
                                         ("gaussian", 6)])
def test_misaligned_start_raises(kind, start):
    with pytest.raises(ValueError):
        noise(10, 0, 0, 0, 0, kind, start)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range_raises(seed):
    with pytest.raises(ValueError):
        noise(10, seed, 0, 0, 0)
