"""zosoma.experiments.estimators: a strategy's estimate read off its own step, against the true
gradient from autograd."""

import numpy as np
import pytest

from world import TINY_MODEL, synthetic_corpus
from zosoma.corpus import BatchSampler
from zosoma.engines.ops import Ops
from zosoma.experiments import estimators
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.model import reference

pytest.importorskip("torch", reason="the true gradient is autograd's")


def test_estimates_are_the_strategies_own_and_the_gradient_is_autograds():
    layout, theta = Layout(TINY_MODEL), init_params(TINY_MODEL, 1)
    batch = BatchSampler(synthetic_corpus(), 9).batch(0, 0, 0, 2)
    g = estimators.true_gradient(theta, layout, batch)
    i = layout["lstm0.w_hh"].offset + 3  # a recurrent weight: its gradient runs through time
    e = np.zeros(theta.size)
    e[i] = 1e-4
    fd = (reference.loss(theta.astype(np.float64) + e, layout, batch)
          - reference.loss(theta.astype(np.float64) - e, layout, batch)) / 2e-4
    assert g[i] == pytest.approx(fd, rel=1e-6) and g[i] != 0
    P, eps = 2, 1e-2
    ghat = estimators.estimates("sgd", theta, layout, batch, 3, Ops(), perturbations=P, eps=eps)
    for r in range(3):  # SPSA: (1/P) sum_k (L+ - L-) / 2 eps delta_k at step r's counters
        deltas = [noise(theta.size, 0, 0, r, k).astype(np.float64) for k in range(P)]
        want = sum((reference.loss(theta + np.float32(eps) * d.astype(np.float32), layout, batch)
                    - reference.loss(theta - np.float32(eps) * d.astype(np.float32), layout, batch)) / (2 * eps) * d
                   for d in deltas) / P
        np.testing.assert_allclose(ghat[r], want, atol=2e-4, rtol=1e-3)
    readout = estimators.estimates("readout", theta, layout, batch, 2, Ops(), perturbations=P, eps=eps)
    assert estimators.block_cosines(readout, g, layout)["readout"] == pytest.approx(1.0, abs=1e-5)
    exact = estimators.measure(np.stack([g, g]), g)
    assert exact["cosine"] == pytest.approx(1) and exact["rel_error"] == pytest.approx(0, abs=1e-12)
    rows = estimators.row_gradients(theta, layout, batch)
    np.testing.assert_allclose(rows.mean(axis=0), g, atol=1e-12)
    assert 1 <= estimators.row_gain(rows) <= 2
