"""Activity (node) perturbation on the CUDA engine (zosoma.engines.cuda.activity_forward, kernels/activity.cu)
against the CPU engine's (zosoma.engines.cpu.noisy_forward, zosoma.model.node_perturbation), on the
runtime of test_kernels' `rt` fixture: the emulated one here, CuPy where there is a GPU."""

import numpy as np
import pytest

from test_kernels import GAUSSIAN_ATOL, emulated_libs, rt  # noqa: F401 (fixtures)
from helpers import assert_close
from zosoma.arrays import to_numpy
from zosoma.config import ModelConfig, TrainConfig
from zosoma.engines.cpu import noisy_forward
from zosoma.engines.cuda import activity_forward, cuda_ops
from zosoma.engines.cuda.launches import Launches
from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation as npert
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population
from zosoma.strategies import make_strategy
from zosoma.strategies.onesided import one_sided

VARIANTS = ["activity", "activity-local", "activity-causal", "activity-local-causal", "activity-onesided"]
NATS_ATOL = 2e-5  # per-target nats, float32 forwards whose GEMMs sum in other orders
DIFF_ATOL = 2e-5  # a member's nats minus another's


def _setup(config, B=3, T=7, seed=2):
    layout = Layout(config)
    theta = (init_params(config, seed) * 2).astype(np.float32)  # scaled up: gates away from their middle
    batch = np.random.default_rng(seed + 5).integers(0, 256, (B, T + 1), dtype=np.uint8)
    return layout, theta, batch


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("readout", ["perturb", "local"])
def test_the_device_draws_the_cpus_noise(rt, kind, readout):
    """The same Philox counters: Rademacher bit for bit, Gaussian within float32 rounding."""
    layout = Layout(ModelConfig(embed=5, hidden=4, layers=2))
    want = noisy_forward.draw(layout, 3, 5, 11, 2, 7, [0, 3, 4, 9], kind, readout)
    got = to_numpy(activity_forward.draw(layout, 3, 5, 11, 2, 7, [0, 3, 4, 9], kind, readout))
    if kind == "rademacher":
        assert np.array_equal(got, want)
    else:
        assert_close(got, want, atol=GAUSSIAN_ATOL, rtol=0, name="gaussian noise")


@pytest.mark.parametrize("config", [ModelConfig(embed=16, hidden=20, layers=1), ModelConfig(embed=5, hidden=4,
                                                                                             layers=2)])
@pytest.mark.parametrize("readout", ["perturb", "local"])
def test_the_device_noisy_forward_is_the_cpus(rt, config, readout):
    """Every member's every target's nats for three member tables (antithetic, one-sided, any),
    and the members' differences, within NATS_ATOL / DIFF_ATOL of the Numba forward."""
    layout, theta, batch = _setup(config)
    Z = noisy_forward.draw(layout, 3, 7, 1, 0, 4, range(6), "rademacher", readout)
    Zd = activity_forward.draw(layout, 3, 7, 1, 0, 4, range(6), "rademacher", readout)
    pairs = Population(3, 0.05, 1, 0, 4)
    for pop in (pairs, one_sided(pairs), pairs.with_members((4, 0, 0, 2, 5, 5), (-1, 1, -1, 1, 1, -1), 6)):
        want = noisy_forward.member_losses(theta, layout, batch, 0.05, Z, pop.direction, pop.sign)
        got = to_numpy(activity_forward.member_nats(theta, layout, batch, 0.05, Zd, pop.direction, pop.sign))
        assert got.shape == want.shape == (6, 3, 7)
        assert_close(got, want, atol=NATS_ATOL, rtol=0, name=f"nats {pop.member_directions}")
        assert_close(got[0::2] - got[1::2], want[0::2] - want[1::2], atol=DIFF_ATOL, rtol=0, name="differences")


@pytest.mark.parametrize("causal", [False, True])
def test_the_device_noise_combination_is_the_cpus(rt, causal):
    """zeta: the same float64 sums in the same order, so the CPU's bits in emulation."""
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((5, 3, 4, 30)).astype(np.float32)
    coeffs = rng.standard_normal((5, 3, 4) if causal else (5, 3))
    want = noisy_forward.weighted_noise(*npert.credit(coeffs, causal), Z, 12)
    got = to_numpy(activity_forward.weighted_noise(*npert.credit(coeffs, causal), rt.xp.asarray(Z), 12))
    if rt.xp is np:
        assert np.array_equal(got, want)
    else:
        assert_close(got, want, atol=1e-7, rtol=1e-6, name="zeta")


@pytest.mark.parametrize("readout", ["perturb", "local"])
def test_the_device_estimate_is_the_references(rt, readout):
    """The outer products of a zeta with the clean forward's inputs (and the local readout's delta
    rule) against node_perturbation.estimate in float64: every tensor of a two-layer model."""
    layout, theta, batch = _setup(ModelConfig(embed=5, hidden=4, layers=2), B=3, T=6)
    zeta = np.random.default_rng(1).standard_normal((3, 6, npert.width(layout, readout))).astype(np.float32)
    want = npert.estimate(theta.astype(np.float64), layout, batch, zeta.astype(np.float64))
    got = to_numpy(activity_forward.estimate(theta, layout, batch, rt.xp.asarray(zeta)))
    for e in layout.entries:
        assert_close(layout.view(got, e.name), layout.view(want, e.name), atol=1e-5, rtol=1e-5, name=e.name)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variants_step_on_the_device_is_the_cpus(rt, name):
    """Every activity strategy's step on CudaOps against Ops: the losses (rows or targets) within
    NATS_ATOL, and theta after one update from the SAME scalars within 1e-5 (the device's estimate
    of the CPU's scalars, so only the estimate's arithmetic differs); the estimate reached the host
    as a device array, the noise drawn once."""
    config = ModelConfig(embed=6, hidden=5, layers=1)
    layout, theta, batch = _setup(config, B=3, T=7)
    cfg = TrainConfig(optimizer=name, perturbations=4, batch=3, seq_len=7, eps=1e-2, shaping=(), warmup=0)
    cpu, dev = make_strategy(cfg), make_strategy(cfg)
    pop = cpu.ask(1, 9)
    plus, minus = cpu.losses(Ops(), theta, layout, batch, pop, {})
    ops = cuda_ops.CudaOps()
    dplus, dminus = dev.losses(ops, ops.asarray(theta), layout, batch, pop, {})
    assert dplus.shape == plus.shape and dplus.dtype == np.float64
    assert_close(dplus, plus, atol=NATS_ATOL, rtol=0, name="plus")
    assert_close(dminus, minus, atol=NATS_ATOL, rtol=0, name="minus")
    coeffs, _ = cpu.coefficients(plus, minus)
    want, _ = cpu.update(Ops(), layout, theta, {}, coeffs, pop, 1.0)
    got, _ = dev.update(ops, layout, ops.asarray(theta), {}, coeffs, pop, 1.0)
    assert isinstance(got, rt.xp.ndarray)
    assert_close(to_numpy(got), want, atol=1e-5, rtol=1e-5, name="step")


def test_an_activity_step_launches(rt):
    """The activity step's launches at E=16 H=20, one layer, P=4 one-sided pairs, B=2, T=5: the
    members' forward (the update's clean rows riding along) is the noise (1 kernel), the table GEMM,
    per step a recurrent GEMM and one kernel (the noise and the cell), then one readout GEMM and one
    softmax kernel (local readout: no logits' noise): 2 + T kernels + T + 2 GEMMs. The update: zeta
    (1 kernel), the readout's delta rule (1 GEMM, 1 softmax kernel) and the outer products (w_ih,
    w_hh, the embedding's two, the readout: 5 GEMMs). At another theta (a copy) the clean forward
    runs in the update instead (T kernels, T + 1 GEMMs more), to the same estimate within float32."""
    layout, theta, batch = _setup(ModelConfig(embed=16, hidden=20, layers=1), B=2, T=5)
    cfg = TrainConfig(optimizer="activity-onesided", perturbations=4, batch=2, seq_len=5, shaping=(), warmup=0)
    strategy, ops = make_strategy(cfg), cuda_ops.CudaOps()
    theta = ops.asarray(theta)
    pop = strategy.ask(0, 0)
    T = 5
    with Launches() as forward:
        plus, minus = strategy.losses(ops, theta, layout, batch, pop, {})
    assert (forward.kernels, forward.gemms) == (2 + T, T + 2)
    coeffs, _ = strategy.coefficients(plus, minus)
    with Launches() as update:
        kept = ops.activity_estimate(theta, layout, batch, coeffs, pop, strategy.readout, strategy.causal)
    assert (update.kernels, update.gemms) == (2, 6)
    with Launches() as fresh:
        ghat = ops.activity_estimate(theta.copy(), layout, batch, coeffs, pop, strategy.readout, strategy.causal)
    assert (fresh.kernels, fresh.gemms) == (2 + T, 6 + T + 1)
    assert_close(to_numpy(kept), to_numpy(ghat), atol=1e-7, rtol=1e-5, name="kept vs fresh clean forward")


@pytest.fixture
def cuda_cli(rt, monkeypatch):
    """`--device cuda` names the runtime of `rt` (get_ops' cache emptied before and after)."""
    from zosoma.engines import get_ops
    from zosoma.engines.cuda import backend

    monkeypatch.setattr(backend, "cuda_unavailable_reason", lambda: None)
    get_ops.cache_clear()
    yield
    get_ops.cache_clear()


@pytest.mark.slow
def test_activity_onesided_trains_on_the_device_as_on_the_cpu(cuda_cli, tmp_path):
    """`zosoma train --optimizer activity-onesided --device cuda`, 20 steps of one E=16 H=20 expert
    (P=8, B=4, T=16), ends within 1e-4 of the CPU run's every step loss and held-out figure (4.4e-6
    and 1e-6 measured in emulation) and theta within 3e-4 (7.8e-5 measured: each target's nats
    agree within float32 rounding, ~1e-6, which one-sided scalars divide by eps = 1e-3)."""
    import json

    from click.testing import CliRunner

    from zosoma.cli.main import cli
    from zosoma.training.folder import RunFolder

    text = tmp_path / "t.txt"
    text.write_bytes(b"zero-order training needs nothing but forward passes, on any device. " * 300)
    runs = {}
    for device in ("cpu", "cuda"):
        run = tmp_path / device
        result = CliRunner().invoke(cli, ["train", "--optimizer", "activity-onesided", "--device", device,
                                          "--data", str(text), "--heldout", str(text), "--embed", "16",
                                          "--hidden", "20", "--steps", "20", "-P", "8", "--batch", "4",
                                          "--seq-len", "16", "--seed", "0", "--lr", "0.15",  # the rate measured above
                                          "--run-dir", str(run)])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        heldout = json.loads((run / "results.json").read_text())["heldout"]["overall"]
        runs[device] = ([r["loss"] for r in records if "loss" in r], RunFolder(run).read_checkpoint().theta, heldout)
    (cpu_losses, cpu_theta, cpu_heldout), (dev_losses, dev_theta, dev_heldout) = runs["cpu"], runs["cuda"]
    assert len(dev_losses) == len(cpu_losses) >= 20
    assert_close(np.array(dev_losses), np.array(cpu_losses), atol=1e-4, rtol=0, name="step losses")
    assert abs(dev_heldout - cpu_heldout) < 1e-4, (dev_heldout, cpu_heldout)
    assert_close(dev_theta, cpu_theta, atol=3e-4, rtol=0, name="theta")
    assert cpu_losses[-1] < cpu_losses[0]
