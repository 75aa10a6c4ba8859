"""The CPU forward's two GEMM paths (zosoma.engines.cpu.forward, ZOSOMA_CPU_GEMM): BLAS calls, and
compiled loops for small models. Each against the float64 NumPy reference and against the other:
a population's losses, a full SPSA step's update, a resumed run on the loops path bit for bit, and
that training takes BLAS unless told."""

import numpy as np
import pytest

from helpers import assert_close, one_line_error, random_bytes, run_cli, scaled_model
from zosoma.engines.ops import Ops
from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.engines.cpu import forward
from zosoma.errors import ConfigError
from zosoma.model import reference
from zosoma.model.params import Layout, init_params
from zosoma.training.folder import RunFolder
from zosoma.training.trainer import Trainer, from_checkpoint, new_state, train

LOSS_RTOL = 1e-5  # tests/test_forward.py's accuracy requirement against the float64 reference
PATHS = ["blas", "loops"]


@pytest.fixture(params=PATHS)
def gemm_path(request, monkeypatch):
    monkeypatch.setenv(forward.GEMM_ENV, request.param)
    return request.param


@pytest.mark.parametrize("embed, hidden, layers, B, T", [
    (16, 20, 1, 8, 32),  # SOMA's best expert, at its training B and T
    (5, 7, 2, 3, 9),  # odd rows (the loops pair rows), K and N off the loops' unroll, a second layer
])
def test_a_populations_losses_match_the_reference_on_both_paths(gemm_path, embed, hidden, layers, B, T):
    _, layout = scaled_model(embed, hidden, layers)
    thetas = np.stack([scaled_model(embed, hidden, layers, seed=m)[0] for m in range(3)])
    batch = random_bytes(1, (B, T + 1))
    losses = forward.population_loss(thetas, layout, batch)
    assert_close(losses, [reference.loss(t.astype(np.float64), layout, batch) for t in thetas],
                 rtol=LOSS_RTOL, name=f"{gemm_path} losses")


def test_the_paths_agree_on_a_steps_members_to_float_tolerance(monkeypatch):
    """The members theta +/- eps delta_k of one SPSA step, built from the same counters: only the
    GEMMs' summation order differs between the paths."""
    model = ModelConfig(embed=16, hidden=20, layers=1)
    theta, layout = init_params(model, 0), Layout(model)
    batch = random_bytes(2, (8, 33))
    sums = {}
    for path in PATHS:
        monkeypatch.setenv(forward.GEMM_ENV, path)
        sums[path] = forward.perturbed_sums(theta, layout, batch, 1e-3, 0, 0, 0, "rademacher", range(8))
    for blas, loops in zip(sums["blas"], sums["loops"]):
        assert_close(loops, blas, rtol=1e-6, name="plus/minus losses")


def _trainer(tmp_path, name, model, cfg):
    sampler = BatchSampler(load_corpus(None, "train"), cfg.seq_len + 1)
    return Trainer(tmp_path / name, model, cfg, sampler, new_state(model, cfg), ops=Ops())


def test_a_full_step_gives_the_same_update_on_both_paths(tmp_path, monkeypatch):
    """One SPSA step of SOMA's expert shape: the same losses to float tolerance, hence the same
    coefficients and update to float tolerance (central differences divide the losses' last
    bits by 2 eps); and from the same coefficients, the same update bit for bit (the update
    regenerates the directions from the counters, whichever path ran the forwards)."""
    model = ModelConfig(embed=16, hidden=20, layers=1)
    cfg = TrainConfig(optimizer="sgd", steps=2, batch=8, seq_len=32, perturbations=16, lr=0.15, checkpoint_every=100)
    steps = {}
    for path in PATHS:
        monkeypatch.setenv(forward.GEMM_ENV, path)
        trainer = _trainer(tmp_path, path, model, cfg)
        plus, minus = trainer.losses()
        coeffs, _ = trainer.coefficients(plus, minus)
        steps[path] = plus, minus, coeffs, trainer
    (pb, mb, cb, tb), (pl, ml, cl, tl) = steps["blas"], steps["loops"]
    assert_close(pl, pb, rtol=1e-6, name="plus")
    assert_close(ml, mb, rtol=1e-6, name="minus")
    assert_close(cl, cb, atol=1e-3 * np.abs(cb).max(), rtol=0.0, name="coefficients")
    tb.update(cb, float(np.mean((pb + mb) / 2)))
    tl.update(cb, float(np.mean((pb + mb) / 2)))  # the blas path's coefficients
    assert np.array_equal(tb.state.theta, tl.state.theta)


@pytest.mark.usefixtures("scratch_cwd")
def test_a_resumed_run_on_the_loops_path_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setenv(forward.GEMM_ENV, "loops")
    model = ModelConfig(embed=16, hidden=20, layers=1)
    cfg = TrainConfig(optimizer="sgd", steps=8, batch=4, seq_len=16, perturbations=4, lr=0.15, checkpoint_every=3)
    full = _trainer(tmp_path, "full", model, cfg)
    list(train(full, lambda: False))
    part = _trainer(tmp_path, "part", model, cfg)
    list(train(part, lambda: part.state.step >= 4))
    assert RunFolder(tmp_path / "part").read_checkpoint().step == 4
    sampler = BatchSampler(load_corpus(None, "train"), cfg.seq_len + 1)
    resumed = Trainer(tmp_path / "part", model, cfg, sampler,
                      from_checkpoint(RunFolder(tmp_path / "part").read_checkpoint()), ops=Ops())
    list(train(resumed, lambda: False))
    a, b = RunFolder(tmp_path / "full").read_checkpoint(), RunFolder(tmp_path / "part").read_checkpoint()
    assert a.step == b.step == cfg.steps and np.array_equal(a.theta, b.theta)


def test_training_takes_blas_unless_told(monkeypatch):
    """The loops lose against OpenBLAS's SkylakeX kernels (results/bench-spsa-shapes-after.txt):
    the default run keeps BLAS's bits; ZOSOMA_CPU_GEMM=loops chooses them for any model."""
    monkeypatch.delenv(forward.GEMM_ENV, raising=False)
    assert not forward.uses_loops(ModelConfig(embed=16, hidden=20), 8)  # SOMA's experts
    assert not forward.uses_loops(ModelConfig(embed=32, hidden=64), 8)  # the tiny preset
    for path, loops in (("blas", False), ("loops", True)):
        monkeypatch.setenv(forward.GEMM_ENV, path)
        assert forward.uses_loops(ModelConfig(embed=128, hidden=256), 8) is loops
        assert forward.uses_loops(ModelConfig(embed=16, hidden=20), 8) is loops


@pytest.mark.usefixtures("scratch_cwd")
def test_a_bad_gemm_setting_is_refused_before_a_run_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(forward.GEMM_ENV, "fast")
    result = run_cli(["train", "--preset", "tiny", "--steps", "2", "--run-dir", tmp_path / "run"])
    assert one_line_error(result) == "Error: ZOSOMA_CPU_GEMM must be one of blas, loops, got 'fast'"
    assert not (tmp_path / "run").exists()
    from zosoma.runs.run import Run, Spec  # the library's door refuses it as the command line does

    with pytest.raises(ConfigError, match="^ZOSOMA_CPU_GEMM must be one of blas, loops, got 'fast'$"):
        Run.start(Spec(ModelConfig(embed=4, hidden=6), TrainConfig(optimizer="sgd", steps=1)), run_dir=tmp_path / "api")
    assert not (tmp_path / "api").exists()


def test_a_steps_losses_do_not_depend_on_how_its_pairs_are_grouped(monkeypatch):
    """perturbed_sums hands the threads a few pairs per call: every pair's losses are the ones it
    gets alone, bit for bit."""
    model = ModelConfig(embed=16, hidden=20, layers=1)
    theta, layout = init_params(model, 0), Layout(model)
    batch = random_bytes(3, (8, 33))
    whole = forward.perturbed_sums(theta, layout, batch, 1e-3, 0, 0, 0, "gaussian", range(40))
    alone = [forward.perturbed_sums(theta, layout, batch, 1e-3, 0, 0, 0, "gaussian", range(k, k + 1))
             for k in range(40)]
    assert np.array_equal(whole[0], [p[0] for p, _ in alone]) and np.array_equal(whole[1], [m[0] for _, m in alone])
