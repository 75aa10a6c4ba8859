"""EGGROLL (zosoma.eggroll): the low-rank shared-GEMM population forward and the update against
explicitly materialised dense perturbations run through the NumPy reference (float64)."""

import math

import numpy as np
import pytest

from helpers import assert_close
from zosoma import eggroll, reference
from zosoma.config import VOCAB, ModelConfig
from zosoma.params import Layout, init_params


def _model(embed=8, hidden=16, layers=2, seed=0, scale=2.0, dtype=np.float64):
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, seed) * scale).astype(dtype), layout


def _bytes(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.uint8)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("r", [1, 3])
def test_population_losses_match_dense_reference(r, fused, monkeypatch):
    # fused: x @ [W | A_0..A_P-1] as one GEMM; unfused: x @ W plus a batched x_j @ A_i per pair
    monkeypatch.setattr(eggroll, "_FUSE_MAX_FRACTION", 1.0 if fused else 0.0)
    theta, layout = _model()
    batch = _bytes(1, (3, 13))
    sigma, seed, expert, step, pairs = 0.3, 7, 2, 5, 3
    losses = eggroll.eggroll_population_loss(theta, layout, batch, sigma, r, seed, expert, step,
                                             pairs)
    assert losses.shape == (2 * pairs,) and losses.dtype == np.float64
    want = []
    for i in range(pairs):
        e = eggroll.materialise(layout, sigma, r, seed, expert, step, i)
        want += [reference.loss(theta + e, layout, batch), reference.loss(theta - e, layout, batch)]
    want = np.array(want)
    assert_close(losses, want, rtol=1e-5, name="eggroll population loss")
    assert np.ptp(want) > 1e-3  # the perturbations actually change the losses
    # float32 agrees within float32 rounding, with the compiled cell/softmax and without
    for numba_cell in (True, False):
        monkeypatch.setattr(eggroll, "_USE_NUMBA_CELL", numba_cell)
        l32 = eggroll.eggroll_population_loss(theta.astype(np.float32), layout, batch, sigma, r,
                                              seed, expert, step, pairs)
        assert_close(l32, want, rtol=1e-4, name=f"float32 eggroll loss (numba={numba_cell})")


def test_materialised_perturbation_is_low_rank_and_scaled():
    _, layout = _model()
    r, sigma = 2, 0.5
    e = eggroll.materialise(layout, sigma, r, 3, 0, 1, 4)
    for name in ("embed", "lstm1.w_hh", "out.w"):
        assert np.linalg.matrix_rank(layout.view(e, name)) == r
    f = eggroll.pair_factors(layout, r, 3, 0, 1, 4, np.float64)
    assert_close(layout.view(e, "lstm0.bias"), sigma * f["lstm0.bias"], name="bias noise")
    a, b = f["out.w"]
    assert_close(layout.view(e, "out.w"), sigma / math.sqrt(r) * a @ b.T, name="out.w noise")


def test_noise_regenerates_and_members_differ():
    _, layout = _model()
    r = 2
    n = eggroll.noise_length(layout, r)
    assert n == sum((e.shape[0] + e.shape[1]) * r if len(e.shape) == 2 else e.size
                    for e in layout.entries)
    f1 = eggroll.pair_factors(layout, r, 11, 1, 4, 2)
    f2 = eggroll.pair_factors(layout, r, 11, 1, 4, 2)
    for name in f1:
        xs = f1[name] if isinstance(f1[name], tuple) else (f1[name],)
        ys = f2[name] if isinstance(f2[name], tuple) else (f2[name],)
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_array_equal(x, y)
    e = [eggroll.materialise(layout, 1.0, r, 11, 1, 4, m) for m in range(3)]
    np.testing.assert_array_equal(e[0], eggroll.materialise(layout, 1.0, r, 11, 1, 4, 0))
    assert not np.allclose(e[0], e[1]) and not np.allclose(e[1], e[2])
    # every other counter changes the noise too
    for args in ((12, 1, 4), (11, 2, 4), (11, 1, 5)):
        assert not np.allclose(e[0], eggroll.materialise(layout, 1.0, r, *args, 0))
    # the documented slicing: embed's A is the stream's first V*r values
    from zosoma.noise import noise
    z = noise(n, 11, 1, 4, 2, kind="gaussian")
    np.testing.assert_array_equal(f1["embed"][0].ravel(), z[:VOCAB * r])
    np.testing.assert_array_equal(f1["out.b"], z[-VOCAB:])


def test_update_matches_dense_formula():
    theta, layout = _model()
    r, sigma, lr, seed, expert, step, pairs = 2, 0.1, 0.05, 5, 1, 9, 4
    losses = np.random.default_rng(0).normal(3.0, 0.2, 2 * pairs)
    new = eggroll.eggroll_update(theta, layout, losses, lr, sigma, r, seed, expert, step)
    fz = (-losses - (-losses).mean()) / (-losses).std()
    want = theta.copy()
    for j in range(2 * pairs):
        e = eggroll.materialise(layout, sigma, r, seed, expert, step, j // 2)
        want += lr / math.sqrt(2 * pairs) * fz[j] * (e if j % 2 == 0 else -e)
    assert new.dtype == theta.dtype
    assert_close(new - theta, want - theta, atol=1e-12, rtol=1e-9, name="update")
    # a custom shaping function is injected
    ones = eggroll.eggroll_update(theta, layout, losses, lr, sigma, r, seed, expert, step,
                                  shaping=lambda f: np.where(np.arange(f.size) % 2 == 0, 1.0, 0.0))
    e0 = sum(eggroll.materialise(layout, sigma, r, seed, expert, step, i) for i in range(pairs))
    assert_close(ones - theta, lr / math.sqrt(2 * pairs) * e0, atol=1e-12, rtol=1e-9,
                 name="custom shaping")


def test_equal_losses_give_zero_update():
    theta, layout = _model(dtype=np.float32)
    assert np.all(eggroll.zscore(np.full(6, 0.1 * 3)) == 0)
    new = eggroll.eggroll_update(theta, layout, np.full(8, 2.7), 0.1, 0.1, 1, 0, 0, 0)
    assert np.all(np.isfinite(new))
    np.testing.assert_array_equal(new, theta)
    with pytest.raises(ValueError):
        eggroll.zscore([1.0, np.nan])


def test_short_optimisation_lowers_loss():
    theta, layout = _model(embed=8, hidden=16, layers=1, scale=1.0, dtype=np.float32)
    pattern = np.frombuffer(b"abcabdabcabe", np.uint8)
    batch = np.tile(pattern, (4, 3))[:, :25].copy()
    before = reference.loss(theta.astype(np.float64), layout, batch)
    sigma, lr, r, pairs = 0.1, 0.1, 2, 16
    for step in range(40):
        losses = eggroll.eggroll_population_loss(theta, layout, batch, sigma, r, 3, 0, step, pairs)
        theta = eggroll.eggroll_update(theta, layout, losses, lr, sigma, r, 3, 0, step)
    after = reference.loss(theta.astype(np.float64), layout, batch)
    assert after < before - 0.3, (before, after)


def test_bench_returns_per_member_seconds():
    res = eggroll.bench_eggroll_vs_spsa(ModelConfig(embed=8, hidden=16, layers=1), B=2, T=8,
                                        members=4, repeats=1)
    assert res["eggroll_s_per_member"] > 0 and res["dense_s_per_member"] > 0
    assert res["members"] == 4


def test_bad_arguments():
    theta, layout = _model()
    with pytest.raises(ValueError):
        eggroll.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)).astype(np.int64), 0.1, 1,
                                        0, 0, 0, 2)
    with pytest.raises(ValueError):
        eggroll.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)), 0.1, 0, 0, 0, 0, 2)
    with pytest.raises(ValueError):
        eggroll.eggroll_update(theta, layout, np.ones(3), 0.1, 0.1, 1, 0, 0, 0)
