"""--optimizer readout: the output layer's exact gradient from a forward, one-sided SPSA for the
rest (zosoma.strategies.readout), against PyTorch autograd and the NumPy reference."""

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL, synthetic_corpus as corpus
from zosoma import Optimizer
from zosoma.config import TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError
from zosoma.experiments.compare_config import Method
from zosoma.model import reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.strategies import make_strategy
from zosoma.strategies.readout import readout_flops, readout_gradient
from zosoma.strategies.settings import resolve
from zosoma.workers.population_workers import check_shardable

torch = pytest.importorskip("torch", reason="PyTorch, the referee, is in the test extra")
from torch_reference import torch_model  # noqa: E402


def _setup(B=3, T=12, seed=2):
    layout = Layout(TINY_MODEL)
    theta = init_params(TINY_MODEL, seed)
    layout.view(theta, "out.b")[:] = np.random.default_rng(seed).normal(0, 0.5, 256)
    batch = BatchSampler(corpus(), T + 1).batch(0, 0, seed, B)
    return layout, theta, batch


def test_readout_gradient_is_autograds():
    layout, theta, batch = _setup()
    w, b, loss = readout_gradient(theta, layout, batch)
    model = torch_model(theta, layout)
    tokens = torch.from_numpy(batch[:, :-1].astype(np.int64))
    logits, _ = model(tokens)
    L = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                          torch.from_numpy(batch[:, 1:].astype(np.int64)).reshape(-1))
    L.backward()
    assert loss == pytest.approx(L.item(), rel=1e-12)
    assert_close(w, model.linear.weight.grad.numpy().T, atol=1e-14, rtol=1e-10, name="dL/d out.w")
    assert_close(b, model.linear.bias.grad.numpy(), atol=1e-14, rtol=1e-10, name="dL/d out.b")


def test_readout_step_against_numpy():
    """Members perturb the embedding and LSTM only (one-sided directions from the counters, their
    prefix); the update is one-sided SPSA's estimate on that prefix and the exact gradient on the
    readout, at readout_lr times the schedule's factor."""
    layout, theta, batch = _setup()
    P, eps, lr, rlr = 3, 0.01, 0.05, 0.7
    cfg = TrainConfig(optimizer="readout", perturbations=P, eps=eps, shaping=(), lr=lr, readout_lr=rlr, warmup=4,
                      steps=10)
    strategy = make_strategy(cfg)
    n0 = layout["out.w"].offset
    pop = strategy.ask(1, 2)
    deltas = [noise(theta.size, 0, 1, 2, j) for j in range(2 * P)]
    for d in deltas:
        d[n0:] = 0
    plus, minus = strategy.losses(Ops(), theta, layout, batch, pop, {})
    want = [reference.loss(theta + np.float32(eps) * d, layout, batch) for d in deltas]
    assert_close(np.stack([plus, minus], axis=1).ravel(), want, rtol=1e-5, name="member losses")
    g, _ = strategy.coefficients(plus, minus)
    told = strategy.tell(Ops(), layout, theta, {}, {}, g, pop)
    factor = (2 + 1) / 4  # warm-up step 2 of 4
    ghat = sum(g[j] * deltas[j].astype(np.float64) for j in range(2 * P)) / (2 * P)
    w, b, _ = readout_gradient(theta, layout, batch)
    want = theta - lr * factor * ghat
    want[n0:] = theta[n0:] - rlr * factor * np.concatenate([w.ravel(), b])
    assert told.lr == pytest.approx(lr * factor)
    assert_close(told.theta, want, atol=1e-6, rtol=1e-5, name="theta after the step")


def test_a_run_that_names_readout_gets_its_tuned_readout_rate():
    assert resolve(None, {"optimizer": "readout"})[1].readout_lr == 10.0
    assert resolve(None, {"optimizer": "readout", "readout_lr": 3.0})[1].readout_lr == 3.0


def test_readout_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match="--readout-lr is not used by --optimizer onesided"):
        resolve(None, {"optimizer": "onesided", "readout_lr": 2.0})
    for name in ("readout", "rowwise"):
        with pytest.raises(ConfigError, match=f"--optimizer {name} .* needs a model"):
            Optimizer(100, optimizer=name)
    with pytest.raises(ConfigError, match="readout_lr must be a finite number"):
        TrainConfig(optimizer="readout", readout_lr=float("nan"))
    for name in ("readout", "rowwise"):
        with pytest.raises(ConfigError, match=f"--optimizer {name} .* not sharded over --population-workers"):
            check_shardable(TrainConfig(optimizer=name), 2)
    check_shardable(TrainConfig(optimizer="readout"), 1)


def test_readout_flops_are_counted_in_the_budget():
    model, cfg = resolve(None, {"optimizer": "readout", "embed": 16, "hidden": 20, "perturbations": 64})
    base = Method("one-sided", model, resolve(None, {"optimizer": "onesided", "embed": 16, "hidden": 20,
                                                      "perturbations": 64})[1])
    extra = Method("readout", model, cfg, experts=8).flops_per_step() / 8 - base.flops_per_step()
    assert extra == readout_flops(model, cfg) == cfg.batch * cfg.seq_len * (16_000 + 2 * 20 * 256 + 5 * 256)
