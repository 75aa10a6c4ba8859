"""--optimizer rowwise: a direction per (member, row), each row's own loss difference
(zosoma.strategies.rowwise), against the NumPy reference; and why a shared direction gains nothing."""

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL, synthetic_corpus
from zosoma.config import TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.engines.cpu import forward
from zosoma.engines.ops import Ops, perturbed
from zosoma.model import reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.strategies import make_strategy


def _setup(B=3, T=12):
    layout, theta = Layout(TINY_MODEL), init_params(TINY_MODEL, 2)
    return layout, theta, BatchSampler(synthetic_corpus(), T + 1).batch(0, 0, 0, B)


def test_rowwise_step_against_numpy():
    layout, theta, batch = _setup()
    B, P, eps, lr = batch.shape[0], 2, 0.01, 0.05
    cfg = TrainConfig(optimizer="rowwise", perturbations=P, eps=eps, batch=B, seq_len=12, shaping=(), lr=lr,
                      warmup=0, schedule="constant")
    strategy = make_strategy(cfg)
    pop = strategy.ask(1, 3)
    assert pop.P == P  # the trainer counts 2 P B T bytes, as one-sided SPSA's
    deltas = [noise(theta.size, 0, 1, 3, i) for i in range(2 * P * B)]
    plus, minus = strategy.losses(Ops(), theta, layout, batch, pop, {})
    L = np.stack([plus, minus], axis=1).ravel()
    want = [reference.loss(theta + np.float32(eps) * d, layout, batch[i % B][None]) for i, d in enumerate(deltas)]
    assert_close(L, want, rtol=1e-5, name="single-row member losses")
    g, loss = strategy.coefficients(plus, minus)
    rows = np.asarray(want).reshape(2 * P, B)
    assert_close(g, ((rows - rows.mean(axis=0)) / eps).ravel(), rtol=1e-4, atol=1e-3, name="per-row scalars")
    assert loss == pytest.approx(np.mean(want), rel=1e-6)
    told = strategy.tell(Ops(), layout, theta, {}, {}, g, pop)
    ghat = sum(g[i] * deltas[i].astype(np.float64) for i in range(2 * P * B)) / (2 * P * B)
    assert_close(told.theta, theta - lr * ghat, atol=1e-6, rtol=1e-5, name="theta after the step")


def test_per_row_scalars_along_a_shared_direction_are_the_batch_scalar():
    """One-sided members' per-row differences, each against its row's mean, averaged over the rows
    with equal weights: the batch-mean scalar (the scalar is linear in the losses)."""
    layout, theta, batch = _setup()
    B, eps = batch.shape[0], 1e-3
    strategy = make_strategy(TrainConfig(optimizer="onesided", perturbations=4, eps=eps, shaping=()))
    pop = strategy.ask(0, 5)
    members = perturbed(theta, pop, range(pop.P))
    per_row = np.stack([forward.population_loss(members, layout, batch[b][None]) for b in range(B)], axis=1)
    g, _ = strategy.coefficients(*strategy.losses(Ops(), theta, layout, batch, pop, {}))
    row_scalars = (per_row - per_row.mean(axis=0)) / eps  # (2P, B)
    assert_close(row_scalars.mean(axis=1), g, atol=2e-3, rtol=1e-4, name="mean of per-row scalars")
