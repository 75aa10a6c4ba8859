"""Activity (node) perturbation: the reference's estimate against PyTorch autograd, the CPU engine's
forward against the reference, and the strategy end to end."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import assert_close
from test_torch_reference import torch_flat_grad
from zosoma.config import ModelConfig, TrainConfig
from zosoma.engines.cpu import noisy_forward
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError
from zosoma.model import node_perturbation as npert
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population
from zosoma.model.reference import forward, nll
from zosoma.strategies import make_strategy
from zosoma.strategies.onesided import one_sided

TINY = ModelConfig(embed=3, hidden=2, layers=2)


def setup(config=TINY, B=2, T=3, seed=0):
    layout = Layout(config)
    theta = init_params(config, seed).astype(np.float64)
    batch = np.random.default_rng([seed, 7]).integers(0, 256, (B, T + 1), dtype=np.uint8)
    return layout, theta, batch


def linear_map(theta, layout, batch, readout):
    """(d, B T S): the estimate as a linear map of zeta (node_perturbation.estimate column by column)."""
    B, T = batch.shape[0], batch.shape[1] - 1
    n = B * T * npert.width(layout, readout)
    basis = np.eye(n).reshape(n, B, T, -1)
    return np.stack([npert.estimate(theta, layout, batch, z) for z in basis], axis=1)


def readout_gradient(theta, layout, batch):
    """The readout's part of the estimate with a local readout (zeta on the gates only at zero)."""
    B, T = batch.shape[0], batch.shape[1] - 1
    return npert.estimate(theta, layout, batch, np.zeros((B, T, npert.width(layout, "local"))))


@pytest.mark.parametrize("readout, causal", [("perturb", False), ("local", False), ("perturb", True)])
def test_a_complete_basis_of_activity_directions_gives_the_autograd_gradient(readout, causal):
    """Node perturbation along every pre-activation of every row and time step in turn (z = e_j):
    each pair's central difference is dL_b/da_j, and the outer products sum them into the full
    gradient through time of every tensor (embedding, both layers, readout): float64, to 1e-8.
    With causal credit each position's noise takes only the differences of the targets it can
    move, which loses nothing here."""
    layout, theta, batch = setup()
    B, T = batch.shape[0], batch.shape[1] - 1
    n = B * T * npert.width(layout, readout)
    Z = np.eye(n).reshape(n, B, T, -1)
    if causal:
        plus, minus = npert.position_losses(theta, layout, batch, 1e-5, Z)
        zeta = npert.combined(npert.coefficients(plus, minus, 1e-5), Z, True, 4 * 2 * 2) * n
    else:
        plus, minus = npert.row_losses(theta, layout, batch, 1e-5, Z)
        zeta = np.einsum("kb,kbts->bts", npert.coefficients(plus, minus, 1e-5), Z) / B
    ghat = npert.estimate(theta, layout, batch, zeta.astype(np.float64))
    want, _ = torch_flat_grad(theta, layout, batch)
    assert_close(ghat, want, atol=1e-8, rtol=1e-6, name=f"basis estimate, readout {readout}")


@pytest.mark.slow
@pytest.mark.parametrize("kind, causal", [("rademacher", False), ("gaussian", False), ("rademacher", True)])
def test_the_estimate_from_the_counters_is_unbiased(kind, causal):
    """Over 6,000 pairs of the counters' noise (float64, eps 1e-4: the O(eps^2) bias is far below
    the noise), every coordinate's mean estimate lies within its standard error of autograd's
    gradient: the z-scores have mean square 1 +- 0.15 and none beyond 5.5 (the 834 of d = 1,584 coordinates
    that the batch touches). A wrong sign or scale on any block (here: the readout's noise with its
    sign flipped) fails it."""
    layout, theta, batch = setup(ModelConfig(embed=3, hidden=2, layers=1))
    B, T = batch.shape[0], batch.shape[1] - 1
    want, _ = torch_flat_grad(theta, layout, batch)
    M = linear_map(theta, layout, batch, "perturb")
    K, eps = 6000, 1e-4
    draws = []
    for k0 in range(0, K, 1000):
        Z = np.stack([npert.member_noise(layout, B, T, 5, 1, 2, k, kind) for k in range(k0, k0 + 1000)]).astype(
            np.float64)
        if causal:  # one pair's zeta each: combined() of that pair alone
            c = npert.coefficients(*npert.position_losses(theta, layout, batch, eps, Z), eps)
            zetas = np.stack([npert.combined(c[j:j + 1], Z[j:j + 1], True, 8).astype(np.float64)
                              for j in range(len(Z))])
        else:
            c = npert.coefficients(*npert.row_losses(theta, layout, batch, eps, Z), eps)
            zetas = np.einsum("kb,kbts->kbts", c, Z) / B
        draws.append(zetas.reshape(len(Z), -1) @ M.T)  # one pair's estimate each
    G = np.concatenate(draws)
    se = G.std(axis=0, ddof=1) / np.sqrt(K)
    live = se > 0  # embedding rows of bytes not in the batch: no signal, no noise
    z = (G.mean(axis=0) - want)[live] / se[live]
    assert live.sum() > 800 and abs(np.mean(z ** 2) - 1) < 0.15 and np.abs(z).max() < 5.5, \
        f"z-scores: mean square {np.mean(z ** 2):.3f}, max {np.abs(z).max():.2f} over {live.sum()} coordinates"
    flipped = G.copy()
    ro = layout["out.w"].offset
    flipped[:, ro:] *= -1
    z_bad = (flipped.mean(axis=0) - want)[live] / se[live]
    assert np.mean(z_bad ** 2) > 2


def test_the_noisy_forward_without_noise_is_the_reference_forward():
    layout, theta, batch = setup()
    B, T = batch.shape[0], batch.shape[1] - 1
    logits, _ = forward(theta, layout, batch[:, :-1])
    got = npert.noisy_nll(theta, layout, batch, np.zeros((3, B, T, npert.width(layout))))
    assert_close(got, np.broadcast_to(nll(logits, batch[:, 1:]), got.shape), atol=1e-12, name="noise-free nll")


@pytest.mark.parametrize("config", [ModelConfig(embed=16, hidden=20, layers=1), ModelConfig(embed=5, hidden=4,
                                                                                             layers=2)])
@pytest.mark.parametrize("kind, readout", [("rademacher", "perturb"), ("gaussian", "local")])
def test_the_cpu_engines_noisy_forward_matches_the_reference(config, kind, readout):
    """The Numba forward over 2K B rows (float32) against the reference (float64): the same noise
    from the counters, each row's losses and their differences within float32 rounding."""
    layout = Layout(config)
    theta = init_params(config, 1)
    batch = np.random.default_rng(3).integers(0, 256, (4, 9), dtype=np.uint8)
    Z = noisy_forward.draw(layout, 4, 8, 11, 2, 7, range(3, 8), kind, readout)
    want = np.stack([npert.member_noise(layout, 4, 8, 11, 2, 7, k, kind, readout) for k in range(3, 8)])
    assert np.array_equal(Z, want)
    pop = Population(5, 0.01, 0, 0, 0)  # antithetic pairs: members 2k, 2k + 1 on noise k, signs + and -
    rows = noisy_forward.member_losses(theta, layout, batch, 0.01, Z, pop.direction, pop.sign).mean(axis=-1)
    plus, minus = rows[0::2], rows[1::2]
    ref_plus, ref_minus = npert.row_losses(theta.astype(np.float64), layout, batch, 0.01, Z.astype(np.float64))
    assert_close(plus, ref_plus, atol=2e-6, rtol=0, name="plus rows")
    assert_close(minus, ref_minus, atol=2e-6, rtol=0, name="minus rows")
    assert_close(plus - minus, ref_plus - ref_minus, atol=1e-6, rtol=1e-3, name="differences")
    pairs = Population(2, 0.01, 0, 0, 0)
    for pop in (pairs, one_sided(pairs), pairs.with_members((4, 0, 0, 2), (-1, 1, -1, 1), 5)):  # any table
        got = noisy_forward.member_losses(theta, layout, batch, 0.01, Z, pop.direction, pop.sign)
        want = npert.member_losses(theta.astype(np.float64), layout, batch, 0.01, Z.astype(np.float64),
                                   pop.direction, pop.sign)
        assert_close(got, want, atol=3e-6, rtol=0, name=f"members {pop.member_directions}")


@pytest.mark.parametrize("name", ["activity", "activity-local", "activity-causal", "activity-local-causal",
                                  "activity-onesided"])
def test_the_strategys_step_is_the_references_estimate(name):
    """One step of the strategy on the CPU engine: its losses are each row's (P, B), its scalars
    c = (L+ - L-) / 2eps pair-major, and with no shaping, no decay and rate 1 it moves theta by
    exactly the reference estimate from those scalars (the noise regenerated from the counters)."""
    config = ModelConfig(embed=6, hidden=5, layers=1)
    layout = Layout(config)
    theta = init_params(config, 2)
    cfg = TrainConfig(optimizer=name, perturbations=4, batch=3, seq_len=7, eps=1e-2, shaping=(), warmup=0)
    batch = np.random.default_rng(4).integers(0, 256, (3, 8), dtype=np.uint8)
    strategy, ops = make_strategy(cfg), Ops()
    readout = strategy.readout
    pop = strategy.ask(1, 9)
    pairs = Population(4, 1e-2, 0, 1, 9, "rademacher")
    assert pop == (one_sided(pairs) if strategy.onesided else pairs)  # the estimator's member table
    plus, minus = strategy.losses(ops, theta, layout, batch, pop, {})
    assert plus.shape == minus.shape == ((4, 3, 7) if strategy.causal else (4, 3))
    coeffs, loss = strategy.coefficients(plus, minus)
    J = pop.directions  # the noises: 8, one per member, or 4, one per pair
    assert J == (8 if strategy.onesided else 4)
    if strategy.onesided:  # member 2k + s: plus (s = 0) or minus (s = 1) of pair k, against the members' mean
        nats = np.stack([plus, minus], axis=1).reshape(8, 3, 7)
        assert_close(coeffs, ((nats - nats.mean(axis=0)) / 1e-2).ravel(), rtol=1e-12, name="scalars")
    else:
        assert_close(coeffs, ((plus - minus) / 2e-2).ravel(), rtol=1e-12, name="scalars")
    new, _ = strategy.update(ops, layout, theta, {}, coeffs, pop, 1.0)
    Z = np.stack([npert.member_noise(layout, 3, 7, 0, 1, 9, k, readout=readout) for k in range(J)])
    zeta = npert.combined(coeffs.reshape((J, 3, 7) if strategy.causal else (J, 3)), Z, strategy.causal, 20)
    want = theta - npert.estimate(theta, layout, batch, zeta)
    assert_close(new, want, atol=1e-6, rtol=1e-5, name="step")


def test_activity_trains_from_the_command_line(tmp_path, monkeypatch):
    """`zosoma train --optimizer activity` and `activity-local` run to the end and learn; the
    local readout refuses a shaping (it takes none); the Python optimizer refuses both."""
    from zosoma import Optimizer
    from zosoma.cli.main import cli

    text = tmp_path / "t.txt"
    text.write_bytes(b"zero-order training needs nothing but forward passes. " * 400)
    for name, lr in (("activity", "0.3"), ("activity-local", "1.0")):
        run = tmp_path / name
        result = CliRunner().invoke(cli, ["train", "--optimizer", name, "--data", str(text), "--heldout", str(text),
                                          "--embed", "8", "--hidden", "8", "--steps", "30", "--lr", lr, "-P", "4",
                                          "--batch", "4", "--seq-len", "16", "--run-dir", str(run)])
        assert result.exit_code == 0, result.output

        losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, (name, losses[:5], losses[-5:])
    result = CliRunner().invoke(cli, ["train", "--optimizer", "activity-local", "--shaping", "normalize",
                                      "--data", str(text), "--steps", "2"])
    assert result.exit_code == 2 and "--shaping is not used by --optimizer activity-local" in result.output
    for name in ("activity", "activity-local", "activity-causal", "activity-local-causal", "activity-onesided"):
        with pytest.raises(ConfigError, match=f"--optimizer {name} perturbs an LSTM's pre-activations: it needs a model"):
            Optimizer(10, optimizer=name)


def test_extra_flops_count_the_update():
    """The update's clean forward, outer products and noise combination, per step: 5.5% of the
    members' forwards at E=16 H=20, P=32, B=8, T=32 (perturbed logits), 3.9% with a local readout."""
    from zosoma.strategies.activity import Activity, ActivityLocal

    model, cfg = ModelConfig(embed=16, hidden=20, layers=1), TrainConfig(optimizer="activity", perturbations=32)
    forwards = 2 * 32 * 8 * 32 * model.flops_per_token()
    assert Activity.extra_flops(model, cfg) / forwards == pytest.approx(0.0554, abs=1e-3)
    assert ActivityLocal.extra_flops(model, cfg) / forwards == pytest.approx(0.0390, abs=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_the_engines_noise_combination_is_the_references(causal):
    """zeta on the engine (a Numba loop, float64 sums) equals node_perturbation.combined (einsum),
    rows' weights broadcast over time or every target's causal ones."""
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((5, 3, 4, 30)).astype(np.float32)
    coeffs = rng.standard_normal((5, 3, 4) if causal else (5, 3))
    want = npert.combined(coeffs, Z, causal, 12)
    assert_close(noisy_forward.weighted_noise(*npert.credit(coeffs, causal), Z, 12), want, atol=1e-7, rtol=1e-6,
                 name="zeta")


def test_an_engine_without_a_noisy_forward_refuses_it():
    """An engine that runs whole models (it overrides population_loss) but gives no noisy_nats
    (the emulated formats and ONNX Runtime do: tests/test_activity_engines.py) says so in one line
    instead of training on the host's fp32 forward."""

    class LossesOnly(Ops):
        name = "losses-only"

        def population_loss(self, thetas, layout, batch):
            return super().population_loss(thetas, layout, batch)

    layout, theta, batch = setup(ModelConfig(embed=4, hidden=3, layers=1))
    with pytest.raises(ConfigError, match="activity perturbation needs a noisy forward, which the losses-only engine "
                                          "does not have"):
        LossesOnly().activity_losses(theta.astype(np.float32), layout, batch, Population(2, 1e-2, 0, 0, 0))
