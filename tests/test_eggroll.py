"""EGGROLL (zosoma.engines.cpu.lowrank, the factors of zosoma.model.noise): the low-rank shared-GEMM
population forward (float64 NumPy path and float32 compiled path) and the update, as training
takes it (Eggroll.coefficients, then Ops.lowrank_update), against explicitly materialised dense
perturbations run through the NumPy reference (float64); the EGGROLL-vs-SPSA bench's records."""

import math

import numpy as np
import pytest

from helpers import assert_close
from zosoma.config import VOCAB, ModelConfig, TrainConfig
from zosoma.engines.cpu import lowrank as eggroll
from zosoma.engines.ops import Ops
from zosoma.benchmarks.bench_eggroll import bench_eggroll, format_eggroll
from zosoma.model import reference
from zosoma.model.noise import materialise, noise, noise_length, pair_factors
from zosoma.model.params import Layout, init_params
from zosoma.strategies.eggroll import Eggroll, zscore


def _model(embed=8, hidden=16, layers=2, seed=0, scale=2.0, dtype=np.float64):
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, seed) * scale).astype(dtype), layout


def _bytes(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.uint8)


def training_update(theta, layout, losses, lr, sigma, r, seed, expert, step):
    """One EGGROLL update as training takes it from the members' losses (2P,), member 2i being
    theta + E_i and 2i+1 theta - E_i: Eggroll.coefficients (z-scored fitness), then Eggroll.update
    (Ops.lowrank_update)."""
    egg = Eggroll(TrainConfig(optimizer="eggroll", perturbations=len(losses) // 2, eps=sigma, rank=r, seed=seed))
    coeffs, _ = egg.coefficients(np.asarray(losses[0::2]), np.asarray(losses[1::2]))
    return egg.update(Ops(), layout, theta, {}, coeffs, egg.ask(expert, step), lr)[0]


def _dense_losses(theta, layout, batch, sigma, r, seed, expert, step, pairs):
    """reference.loss of each materialised member theta +/- E_i, in float64."""
    theta = theta.astype(np.float64)
    out = []
    for i in range(pairs):
        e = materialise(layout, sigma, r, seed, expert, step, i)
        out += [reference.loss(theta + e, layout, batch), reference.loss(theta - e, layout, batch)]
    return np.array(out)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("r", [1, 3])
def test_population_losses_match_dense_reference(r, layers):
    theta, layout = _model(layers=layers)
    batch = _bytes(1, (3, 13))
    args = (0.3, r, 7, 2, 5, 3)  # sigma, r, seed, expert, step, pairs
    want = _dense_losses(theta, layout, batch, *args)
    assert np.ptp(want) > 1e-3  # the perturbations actually change the losses
    # float64: the NumPy path, to float64 rounding
    losses = eggroll.eggroll_population_loss(theta, layout, batch, *args)
    assert losses.shape == (6,) and losses.dtype == np.float64
    assert_close(losses, want, rtol=1e-12, name="float64 (NumPy) eggroll loss")
    # float32: the compiled path (rational tanh, float32 arithmetic)
    l32 = eggroll.eggroll_population_loss(theta.astype(np.float32), layout, batch, *args)
    assert l32.dtype == np.float64
    assert_close(l32, want, rtol=1e-5, name="float32 (compiled) eggroll loss")


@pytest.mark.parametrize("rows", [3, 12])
def test_member_groups_give_the_same_losses(rows, monkeypatch):
    # B=3: groups of one member, and of four members with a partial last group (6 = 4 + 2)
    theta, layout = _model(dtype=np.float32)
    batch = _bytes(2, (3, 9))
    args = (0.3, 2, 1, 0, 4, 3)
    whole = eggroll.eggroll_population_loss(theta, layout, batch, *args)
    monkeypatch.setattr(eggroll, "_ROWS_PER_GROUP", rows)
    grouped = eggroll.eggroll_population_loss(theta, layout, batch, *args)
    assert_close(grouped, whole, rtol=1e-6, name=f"groups of {rows // 3} members")


def test_materialised_perturbation_is_low_rank_and_scaled():
    _, layout = _model()
    r, sigma = 2, 0.5
    e = materialise(layout, sigma, r, 3, 0, 1, 4)
    for name in ("embed", "lstm1.w_hh", "out.w"):
        assert np.linalg.matrix_rank(layout.view(e, name)) == r
    f = pair_factors(layout, r, 3, 0, 1, 4, np.float64)
    assert_close(layout.view(e, "lstm0.bias"), sigma * f["lstm0.bias"], name="bias noise")
    a, b = f["out.w"]
    assert_close(layout.view(e, "out.w"), sigma / math.sqrt(r) * a @ b.T, name="out.w noise")


def test_noise_regenerates_and_members_differ():
    _, layout = _model()
    r = 2
    n = noise_length(layout, r)
    assert n == sum((e.shape[0] + e.shape[1]) * r if len(e.shape) == 2 else e.size
                    for e in layout.entries)
    f1 = pair_factors(layout, r, 11, 1, 4, 2)
    f2 = pair_factors(layout, r, 11, 1, 4, 2)
    for name in f1:
        xs = f1[name] if isinstance(f1[name], tuple) else (f1[name],)
        ys = f2[name] if isinstance(f2[name], tuple) else (f2[name],)
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_array_equal(x, y)
    e = [materialise(layout, 1.0, r, 11, 1, 4, m) for m in range(3)]
    np.testing.assert_array_equal(e[0], materialise(layout, 1.0, r, 11, 1, 4, 0))
    assert not np.allclose(e[0], e[1]) and not np.allclose(e[1], e[2])
    # every other counter changes the noise too
    for args in ((12, 1, 4), (11, 2, 4), (11, 1, 5)):
        assert not np.allclose(e[0], materialise(layout, 1.0, r, *args, 0))
    # the documented slicing: embed's A is the stream's first V*r values
    z = noise(n, 11, 1, 4, 2, kind="gaussian")
    np.testing.assert_array_equal(f1["embed"][0].ravel(), z[:VOCAB * r])
    np.testing.assert_array_equal(f1["out.b"], z[-VOCAB:])


def test_update_matches_dense_formula():
    theta, layout = _model()
    r, sigma, lr, seed, expert, step, pairs = 2, 0.1, 0.05, 5, 1, 9, 4
    losses = np.random.default_rng(0).normal(3.0, 0.2, 2 * pairs)
    new = training_update(theta, layout, losses, lr, sigma, r, seed, expert, step)
    fz = (-losses - (-losses).mean()) / (-losses).std()
    want = theta.copy()
    for j in range(2 * pairs):
        e = materialise(layout, sigma, r, seed, expert, step, j // 2)
        want += lr / math.sqrt(2 * pairs) * fz[j] * (e if j % 2 == 0 else -e)
    assert new.dtype == theta.dtype
    assert_close(new - theta, want - theta, atol=1e-12, rtol=1e-9, name="update")


def test_step_applies_given_coefficients():
    # eggroll_step: theta + lr N^-1/2 sum_i coef_i E_i (N = 2P); the coefficients are zscore's pair differences
    theta, layout = _model()
    r, sigma, lr, seed, expert, step = 1, 0.2, 0.3, 4, 0, 2
    coef = np.array([0.5, -1.0, 2.0])
    new = eggroll.eggroll_step(theta, layout, coef, lr, sigma, r, seed, expert, step)
    want = sum(coef[i] * materialise(layout, sigma, r, seed, expert, step, i)
               for i in range(3))
    assert_close(new - theta, lr / math.sqrt(6) * want, atol=1e-12, rtol=1e-9, name="step")
    losses = np.random.default_rng(1).normal(3.0, 0.2, 6)
    fz = zscore(-losses)
    coeffs, _ = Eggroll(TrainConfig(optimizer="eggroll", perturbations=3)).coefficients(losses[0::2], losses[1::2])
    np.testing.assert_array_equal(coeffs, fz[0::2] - fz[1::2])
    new32 = eggroll.eggroll_step(theta.astype(np.float32), layout, coef, lr, sigma, r, seed,
                                 expert, step)
    assert new32.dtype == np.float32


def test_equal_losses_give_zero_update():
    theta, layout = _model(dtype=np.float32)
    assert np.all(zscore(np.full(6, 0.1 * 3)) == 0)
    new = training_update(theta, layout, np.full(8, 2.7), 0.1, 0.1, 1, 0, 0, 0)
    assert np.all(np.isfinite(new))
    np.testing.assert_array_equal(new, theta)
    with pytest.raises(ValueError):
        zscore([1.0, np.nan])


def test_short_optimisation_lowers_loss():
    theta, layout = _model(embed=8, hidden=16, layers=1, scale=1.0, dtype=np.float32)
    pattern = np.frombuffer(b"abcabdabcabe", np.uint8)
    batch = np.tile(pattern, (4, 3))[:, :25].copy()
    before = reference.loss(theta.astype(np.float64), layout, batch)
    sigma, lr, r, pairs = 0.1, 0.1, 2, 16
    for step in range(40):
        losses = eggroll.eggroll_population_loss(theta, layout, batch, sigma, r, 3, 0, step, pairs)
        theta = training_update(theta, layout, losses, lr, sigma, r, 3, 0, step)
    after = reference.loss(theta.astype(np.float64), layout, batch)
    assert after < before - 0.3, (before, after)


def test_bench_records_and_table():
    from zosoma.engines.ops import Ops

    timed = []

    class Recording(Ops):  # what the benchmark times is the engine's own population forward
        def perturbed_losses(self, theta, layout, batch, pop, pairs=None, timings=None):
            timed.append((pop.P, pop.rank, pop.kind, batch.shape, theta.dtype))
            return super().perturbed_losses(theta, layout, batch, pop, pairs, timings)

    rec = bench_eggroll(8, 16, 1, batch=2, seq_len=8, pairs=2, rank=1, repeats=1, ops=Recording())
    assert rec["members"] == 4 and rec["params"] == Layout(ModelConfig(8, 16, 1)).size
    assert set(timed) == {(2, 1, "gaussian", (2, 9), np.dtype(np.float32)), (2, 0, "rademacher", (2, 9), np.dtype(np.float32))}
    assert len(timed) == 2 * (1 + 1)  # warm-up + one timed round, EGGROLL and dense each
    assert rec["dense_with_noise_s_per_member"] >= rec["dense_s_per_member"]
    assert rec["speedup"] == pytest.approx(rec["dense_s_per_member"] / rec["eggroll_s_per_member"])
    table = format_eggroll([rec, rec])
    lines = table.splitlines()
    assert "EGGROLL ms/member" in lines[0] and "dense+noise ms/member" in lines[0]
    assert len(lines) == 4 and lines[1] == lines[2]  # header, two rows, the settings line


def test_bad_arguments():
    theta, layout = _model()
    with pytest.raises(ValueError):
        eggroll.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)).astype(np.int64), 0.1, 1,
                                        0, 0, 0, 2)
    with pytest.raises(ValueError):
        eggroll.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)), 0.1, 0, 0, 0, 0, 2)
    with pytest.raises(ValueError):
        eggroll.eggroll_step(theta, layout, np.ones((2, 2)), 0.1, 0.1, 1, 0, 0, 0)
    with pytest.raises(ValueError):
        eggroll.eggroll_step(theta[:-1], layout, np.ones(2), 0.1, 0.1, 1, 0, 0, 0)
