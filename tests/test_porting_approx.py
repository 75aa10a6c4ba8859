"""Approximate activations (zosoma.porting.approx_activations): the forward is stage 1's but for its
sigmoid and tanh, the two modes are what their sources say, and the engine built on them
evaluates streams and members as zosoma's own engine does."""

import numpy as np
import pytest

from zosoma.config import ModelConfig
from zosoma.engines.ops import Ops
from zosoma.model import reference
from zosoma.model.params import Layout, init_params
from zosoma.porting import approx_activations as approx

LAYOUT = Layout(ModelConfig(embed=8, hidden=16, layers=2))
THETA = init_params(LAYOUT.config, 0, 0) * np.float32(2)


def test_with_the_exact_functions_it_is_stage_1s_forward(monkeypatch):
    tokens = np.random.default_rng(0).integers(0, 256, (3, 12), dtype=np.uint8)
    monkeypatch.setattr(approx, "sigmoid", lambda x, mode: 1.0 / (1.0 + np.exp(-x)))
    monkeypatch.setattr(approx, "tanh", lambda x, mode: np.tanh(x))
    got = approx.forward(THETA.astype(np.float64), LAYOUT, tokens, "plan")["logits"][0]
    want = reference.forward(THETA.astype(np.float64), LAYOUT, tokens)[0]
    assert np.abs(got - want).max() < 1e-12


def test_the_modes_are_plan_and_onnx_hardsigmoid():
    x = np.linspace(-8, 8, 160001)
    exact = 1 / (1 + np.exp(-x))
    assert abs(np.abs(approx.sigmoid(x, "plan") - exact).max() - 0.0189) < 1e-4  # PLAN's published error
    assert np.array_equal(approx.sigmoid(x, "hard"), np.clip(0.2 * x + 0.5, 0, 1))  # ONNX HardSigmoid's defaults
    assert approx.sigmoid(np.array([2.375]), "plan")[0] == 0.03125 * 2.375 + 0.84375  # a segment applies from its start
    assert approx.sigmoid(np.array([-2.375]), "plan")[0] == 1 - (0.03125 * 2.375 + 0.84375)
    for mode in approx.MODES:
        assert np.allclose(approx.tanh(x, mode), 2 * approx.sigmoid(2 * x, mode) - 1)
        assert list(approx.sigmoid(np.array([-np.inf, np.inf], np.float32), mode)) == [0, 1]


def test_the_engine_streams_and_scores_members_as_its_forward_does():
    ops = approx.ApproxOps("plan")
    rng = np.random.default_rng(1)
    text = rng.integers(0, 256, (2, 41), dtype=np.uint8)
    whole, _ = ops.nll_stream(THETA, LAYOUT, text[:, :-1], text[:, 1:])
    first, state = ops.nll_stream(THETA, LAYOUT, text[:, :20], text[:, 1:21])
    second, _ = ops.nll_stream(THETA, LAYOUT, text[:, 20:-1], text[:, 21:], state)
    assert np.abs(np.concatenate([first, second], axis=1) - whole).max() < 1e-5
    members = THETA + rng.normal(0, 1e-2, (3, THETA.size)).astype(np.float32)
    losses = ops.population_loss(members, LAYOUT, text)
    assert np.allclose(losses, [ops.nll_stream(m, LAYOUT, text[:, :-1], text[:, 1:])[0].mean() for m in members])
    exact = Ops().population_loss(members, LAYOUT, text)
    assert 1e-4 < np.abs(losses - exact).max() < 0.1  # approximate, not another loss
    with pytest.raises(ValueError, match="mode must be one of plan, hard"):
        approx.ApproxOps("cubic")
