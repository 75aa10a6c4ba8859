"""The variance experiment: independent vs summed losses, against the exact theory and 1/N.

Monte-Carlo sizes shrink when the suite runs with NUMBA_DISABLE_JIT=1 (noise and forward in pure
Python); tolerances follow the standard errors, so both settings check the same claims.
"""

import math

import numba
import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL as TINY
from zosoma.corpus import BatchSampler, Corpus
from zosoma.model.noise import noise
from zosoma.engines.ops import Ops
from zosoma.model.population import Population
from zosoma.experiments.variance import format_table, lstm_variance, quadratic_blocks, quadratic_variance, theory

NS = (1, 2, 4, 8, 16)
D = 64
JIT = not numba.config.DISABLE_JIT
TRIALS = 20_000 if JIT else 2_000
# The ratio's standard error is about sqrt(2/R + 2/(N R)) <= sqrt(3/R) for R directions in all
# (the summed loss's squared scalar is a chi-square(1) per direction); allow five of them.
TOL = 5 * math.sqrt(3 / TRIALS)


@pytest.fixture(scope="module")
def quadratic():
    return quadratic_variance(Ns=NS, d=D, P=1, trials=TRIALS, seed=0)


def test_theory_closed_forms():
    for N in NS:
        ind, sh = theory(np.full(N, 3.0), D, P=1, kind="rademacher")
        assert_close(ind / sh, np.full(N, (D - 1) / (N * D - 1)), rtol=1e-12, name=f"rademacher N={N}")
        ind, sh = theory(np.full(N, 3.0), D, P=4, kind="gaussian")
        assert_close(ind / sh, np.full(N, (D + 1) / (N * D + 1)), rtol=1e-12, name=f"gaussian N={N}")
        assert_close(ind, np.full(N, (D + 1) / 4), rtol=1e-12, name="gaussian independent")
    # unequal norms: a block with a small gradient suffers most from the others' noise
    ind, sh = theory(np.array([1.0, 4.0]), D)
    assert_close(sh, [(D - 1) + D * 4.0, (D - 1) + D * 0.25], rtol=1e-12, name="shared")
    assert (ind / sh)[0] < 0.5 < (ind / sh)[1]


def test_quadratic_blocks_are_equal():
    a, b, x, g = quadratic_blocks(5, D, seed=3)
    assert (a > 0).all()
    assert_close((g * g).sum(axis=1), np.full(5, float(D)), rtol=1e-12, name="||g_i||^2")
    assert_close(g, a * x + b, rtol=1e-12, name="gradient")
    assert_close(quadratic_blocks(2, D, seed=3)[3], g[:2], rtol=0, name="block i independent of N")


def test_quadratic_ratio_is_one_over_n(quadratic):
    for rec in quadratic:
        N = rec["N"]
        assert rec["theory"] == pytest.approx((D - 1) / (N * D - 1), rel=1e-12)
        # about 1/N (the paper's claim), then the exact theory (6% with the JIT: sd about 1%)
        assert abs(rec["ratio"] * N - 1) < 0.10, rec
        assert abs(rec["ratio"] / rec["theory"] - 1) < TOL, rec
        assert abs(rec["rel_var_independent"] / (D - 1) - 1) < TOL, rec
        assert abs(rec["rel_var_shared"] / (N * D - 1) - 1) < TOL, rec


def test_quadratic_gaussian_and_several_directions():
    P, trials = 4, (TRIALS // 5 if JIT else 150)
    tol = 5 * math.sqrt(3 / (P * trials))
    for rec in quadratic_variance(Ns=(1, 4, 16), d=D, P=P, trials=trials, kind="gaussian", seed=1):
        N = rec["N"]
        assert rec["theory"] == pytest.approx((D + 1) / (N * D + 1), rel=1e-12)
        assert abs(rec["ratio"] / rec["theory"] - 1) < tol, rec
        assert abs(rec["rel_var_independent"] / ((D + 1) / P) - 1) < tol, rec


def test_quadratic_is_deterministic():
    run = lambda seed: quadratic_variance(Ns=(2, 4), d=16, P=2, trials=300, seed=seed)
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_quadratic_matches_the_spsa_estimator():
    """Squared errors rebuilt one trial at a time with Ops.noise_sum (the SPSA estimate)."""
    N, d, P, trials, eps, seed = 3, 40, 2, 4, 1e-3, 11
    a, b, x, g = quadratic_blocks(N, d, seed)
    f = lambda i, t: 0.5 * (a[i] * t * t).sum() + (b[i] * t).sum()
    diff = lambda i, delta: (f(i, x[i] + eps * delta) - f(i, x[i] - eps * delta)) / (2 * eps)
    sq = np.zeros((2, N))
    for step in range(trials):
        c = np.array([[diff(i, noise(d, seed, i, step, k)) for k in range(P)] for i in range(N)])  # (N, P)
        for i in range(N):
            for m, coeffs in enumerate((c[i], c.sum(axis=0))):
                ghat = Ops().noise_sum(coeffs, d, Population(len(coeffs), 1.0, seed, i, step)).astype(np.float64)
                sq[m, i] += ((ghat - g[i]) ** 2).sum()
    rec, = quadratic_variance(Ns=(N,), d=d, P=P, trials=trials, eps=eps, seed=seed)
    rel = sq.mean(axis=1) / trials / d
    assert_close([rec["rel_var_independent"], rec["rel_var_shared"]], rel, rtol=1e-5, name="rel var")


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        quadratic_variance(Ns=(0, 2), trials=10)
    with pytest.raises(ValueError):
        quadratic_variance(Ns=(2,), P=0, trials=10)
    with pytest.raises(ValueError):
        quadratic_variance(Ns=(2,), trials=10, kind="uniform")


# --- real LSTM experts ---------------------------------------------------------------------------

REPS, P_LSTM = (64, 8) if JIT else (4, 4)


def toy_sampler(T1):
    rng = np.random.default_rng(0)
    text = np.frombuffer(("the quick brown fox jumps over the lazy dog. " * 100).encode(), np.uint8).copy()
    flip = rng.random(text.size) < 0.05
    text[flip] = rng.integers(97, 123, flip.sum())
    return BatchSampler(Corpus(("toy",), (text,)), T1)


@pytest.fixture(scope="module")
def lstm():
    return lstm_variance(Ns=(1, 2), model=TINY, sampler=toy_sampler(17), B=4, T=16, reps=REPS, P=P_LSTM,
                         seed=0)


def true_grad_norms_sq(thetas, batches):
    """||grad L_i||^2 of each expert on its batch by PyTorch's autograd (float64): a theory that
    owes nothing to the SPSA samples it is checked against."""
    torch = pytest.importorskip("torch", reason="PyTorch's autograd is the referee here (the test extra)")
    from torch_reference import torch_model

    from zosoma.model.params import Layout

    norms = []
    for theta, batch in zip(thetas, batches):
        model = torch_model(theta, Layout(TINY))
        data = torch.from_numpy(batch.astype(np.int64))
        logits, _ = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), data[:, 1:].reshape(-1))
        grads = torch.autograd.grad(loss, list(model.parameters()))
        norms.append(float(sum((g ** 2).sum() for g in grads)))
    return np.array(norms)


def test_lstm_variance_matches_an_independent_theory_for_n_2_4_8():
    """Real LSTM experts at fixed weights: the measured variances of the independent and shared
    estimators, and their ratio, within 10% of theory evaluated at the autograd gradients."""
    from zosoma.model.params import init_params

    reps, P = (128, 16) if JIT else (6, 4)
    sampler = toy_sampler(17)
    batches = [sampler.batch(0, i, 0, 4) for i in range(8)]
    thetas = [init_params(TINY, 0, i) for i in range(8)]
    records = lstm_variance(Ns=(2, 4, 8), model=TINY, batches=batches, thetas=thetas, reps=reps, P=P, seed=0)
    g2 = true_grad_norms_sq(thetas, batches)
    tol = 0.10 if JIT else 0.8
    for rec in records:
        N, d, per = rec["N"], rec["d"], rec["per_expert"]
        sample = np.array(per["grad_norm_sq"])
        measured_ind = np.array(per["rel_var_independent"]) * sample  # absolute spreads
        measured_sh = np.array(per["rel_var_shared"]) * sample
        want_ind = (d - 1) / P * g2[:N]
        want_sh = ((d - 1) * g2[:N] + d * (g2[:N].sum() - g2[:N])) / P
        assert abs(measured_ind.mean() / want_ind.mean() - 1) < tol, (N, measured_ind, want_ind)
        assert abs(measured_sh.mean() / want_sh.mean() - 1) < tol, (N, measured_sh, want_sh)
        ratio, want = measured_ind.mean() / measured_sh.mean(), want_ind.mean() / want_sh.mean()
        assert abs(ratio / want - 1) < tol, (N, ratio, want)
        assert ratio < 1.5 / N  # about 1/N or below: unequal gradients make the others' noise larger


def test_lstm_accepts_batches_and_checks_them(lstm):
    sampler = toy_sampler(17)
    batches = [sampler.batch(0, i, 0, 4) for i in range(2)]
    again = lstm_variance(Ns=(1, 2), model=TINY, batches=batches, B=4, T=16, reps=REPS, P=P_LSTM, seed=0)
    assert again == lstm  # the sampler path draws exactly these batches
    with pytest.raises(ValueError):
        lstm_variance(Ns=(4,), model=TINY, batches=batches, reps=4, P=2)
    with pytest.raises(ValueError):
        lstm_variance(Ns=(2,), model=TINY, batches=batches, reps=1, P=2)


def test_format_table(quadratic, lstm):
    text = format_table(quadratic + lstm)
    assert "quadratic: N blocks of d=64" in text and "LSTM experts: E=8 H=16" in text
    assert text.count("rel.var indep") == 2
    lines = text.splitlines()
    row = next(line for line in lines if line.split()[:1] == ["16"])
    assert f"{quadratic[-1]['ratio']:.4f}" in row and "0.0625" in row
