"""The SPSA step, update rules and the training loop: estimates, skipping, resumption from an older
checkpoint (a resume's exactness: tests/test_resume.py)."""

import hashlib

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL as MODEL
from zosoma.model import reference
from zosoma.config import TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.errors import CheckpointError
from zosoma.engines.ops import Ops
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population, member_chunks
from zosoma.training.folder import CHECKPOINT, METRICS, PREVIOUS, CheckpointFallback, RunFolder
from zosoma.training.records import Finished, Step
from zosoma.training.trainer import Trainer, from_checkpoint, new_state, train
from zosoma.strategies.base import learning_rate
from zosoma.strategies.spsa import SPSA, Adam, Momentum


def small_corpus(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    text = ("the quick brown fox jumps over the lazy dog. " * 200).encode()
    noisy = np.frombuffer(text, np.uint8)[:n].copy()
    flip = rng.random(n) < 0.02
    noisy[flip] = rng.integers(97, 123, flip.sum())
    return Corpus(("toy",), (noisy,))


def test_spsa_losses_match_reference_population():
    layout = Layout(MODEL)
    theta = init_params(MODEL, 3)
    batch = BatchSampler(small_corpus(), 13).batch(0, 0, 0, 4)
    calls = []

    class ReferenceOps(Ops):  # the CPU engine with the NumPy reference as its forward
        def population_loss(self, thetas, layout, batch):
            calls.append(len(thetas))
            return np.array([reference.loss(t, layout, batch) for t in thetas])

    plus, minus = ReferenceOps().perturbed_losses(theta, layout, batch, Population(5, 1e-2, seed=7, expert=1, step=2))
    for k in range(5):
        d = noise(theta.size, 7, 1, 2, k)
        assert plus[k] == pytest.approx(reference.loss(theta + np.float32(1e-2) * d, layout, batch), rel=1e-6)
        assert minus[k] == pytest.approx(reference.loss(theta - np.float32(1e-2) * d, layout, batch), rel=1e-6)
    assert sum(calls) == 10


def test_member_chunks_cover_all_directions_within_budget():
    chunks = list(member_chunks(range(100), 1_000_000, budget_bytes=40_000_000))
    assert [k for c in chunks for k in c] == list(range(100))
    assert max(len(c) for c in chunks) == 5  # 5 pairs of 4 MB copies = 40 MB


def test_spsa_gradient_is_mean_of_scaled_directions():
    coeffs = np.array([0.5, -2.0, 1.25])
    d = 1000
    expected = sum(c * noise(d, 11, 0, 4, k) for k, c in enumerate(coeffs)) / len(coeffs)
    assert_close(Ops().noise_sum(coeffs, d, Population(3, 1.0, 11, 0, 4)), expected, atol=1e-6, name="ghat")
    expected = sum(c * noise(d, 11, 0, 4, k, "gaussian") for k, c in enumerate(coeffs)) / len(coeffs)
    assert_close(Ops().noise_sum(coeffs, d, Population(3, 1.0, 11, 0, 4, "gaussian")), expected, atol=1e-5,
                 name="ghat gaussian")


class GivenEstimate(Ops):
    """The CPU engine with a fixed SPSA estimate: the update rules see exactly g."""

    def __init__(self, g):
        self.g = g

    def noise_sum(self, coeffs, d, pop):
        return self.g


def test_update_rules():
    theta = np.ones(4, np.float32)
    g = np.array([1, -1, 2, 0], np.float32)
    ops, layout, coeffs = GivenEstimate(g), Layout(MODEL), np.zeros(1)

    def update(cls, theta, state, step, **cfg):
        strategy = cls(TrainConfig(optimizer=cls.name, **cfg))
        state = strategy.init(ops, theta.size) if state is None else state
        return strategy.update(ops, layout, theta, state, coeffs, Population(1, 1e-3, 0, 0, step), 0.1)

    new, _ = update(SPSA, theta, None, 0)
    assert_close(new, theta - 0.1 * g, atol=1e-7, name="sgd")
    new, state = update(Momentum, theta, None, 0, momentum=0.9)
    new, state = update(Momentum, new, state, 1, momentum=0.9)
    assert_close(new, theta - 0.1 * g - 0.1 * 1.9 * g, atol=1e-6, name="momentum")
    new, state = update(Adam, theta, None, 0, momentum=0.9, beta2=0.999, weight_decay=0.01)
    # The first Adam step moves every coordinate with a non-zero gradient by lr * sign(g).
    assert_close(new, theta - 0.1 * np.sign(g) - 0.1 * 0.01 * theta, atol=1e-6, name="adam")
    assert theta[0] == 1.0  # inputs untouched


def test_learning_rate_schedules():
    assert learning_rate(0, 1.0, 100, 10, "cosine") == pytest.approx(0.1)
    assert learning_rate(9, 1.0, 100, 10, "cosine") == pytest.approx(1.0)
    assert learning_rate(10, 1.0, 100, 10, "cosine") == pytest.approx(1.0)
    assert learning_rate(55, 1.0, 100, 10, "cosine") == pytest.approx(0.5)
    assert learning_rate(99, 1.0, 100, 10, "constant") == 1.0


def run_steps(tmp_path, cfg, state=None, ops=None):
    sampler = BatchSampler(small_corpus(), cfg.seq_len + 1)
    state = new_state(MODEL, cfg) if state is None else state
    trainer = Trainer(tmp_path, MODEL, cfg, sampler, state, ops=ops or Ops())
    return state, list(train(trainer))


def test_training_lowers_the_loss(tmp_path):
    cfg = TrainConfig(steps=60, batch=8, seq_len=16, perturbations=8, optimizer="sgd", lr=1.0, warmup=5,
                      checkpoint_every=30)
    state, records = run_steps(tmp_path, cfg)
    losses = [r.loss for r in records if isinstance(r, Step)]
    assert isinstance(records[-1], Finished) and state.step == 60
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0  # 5.3 -> 3.5 nats/byte here
    assert records[-2].metrics["tokens"] == 60 * 2 * 8 * 8 * 16
    assert len((tmp_path / METRICS).read_text().splitlines()) == 60


def test_resume_from_an_older_checkpoint_drops_later_metrics(tmp_path):
    """A run killed between checkpoints resumes from the last one and redoes the later steps."""
    cfg = TrainConfig(optimizer="sgd", steps=8, batch=4, seq_len=16, perturbations=2, checkpoint_every=5)
    full, _ = run_steps(tmp_path / "full", cfg)
    sampler = BatchSampler(small_corpus(), 17)
    state = new_state(MODEL, cfg)
    gen = train(Trainer(tmp_path / "killed", MODEL, cfg, sampler, state, ops=Ops()))
    for r in gen:  # abandon the generator after step 7: the checkpoint on disk holds step 5
        if isinstance(r, Step) and r.step == 7:
            break
    gen.close()
    ckpt = RunFolder(tmp_path / "killed").read_checkpoint()
    assert ckpt.step == 5
    resumed, _ = run_steps(tmp_path / "killed", cfg, state=from_checkpoint(ckpt))
    assert np.array_equal(resumed.theta, full.theta)
    assert len((tmp_path / "killed" / METRICS).read_text().splitlines()) == 8


def test_a_checkpoint_does_not_grow_with_the_run(tmp_path):
    """A checkpoint holds the parameters, the optimizer state and a constant rest: the step records
    stay in metrics.jsonl, which it counts and checksums (`head -n N metrics.jsonl | sha256sum`)."""
    sizes = {}
    for steps in (20, 200):
        cfg = TrainConfig(steps=steps, batch=2, seq_len=8, perturbations=2, optimizer="adam", lr=0.01,
                          checkpoint_every=steps)
        run_steps(tmp_path / str(steps), cfg)
        path = tmp_path / str(steps) / CHECKPOINT
        sizes[steps] = path.stat().st_size
        ckpt = RunFolder(path.parent).read_checkpoint()
        log = (path.parent / METRICS).read_bytes()
        assert ckpt.metrics_records == steps and ckpt.metrics_sha256 == hashlib.sha256(log).hexdigest()
    state = 3 * Layout(MODEL).size * 4  # theta, Adam's m and v in float32
    assert abs(sizes[200] - sizes[20]) < 200 and sizes[200] < state + 16_000, sizes


class Poisoned(Ops):
    """The CPU engine whose first member's loss is always NaN."""

    def population_loss(self, thetas, layout, batch):
        losses = super().population_loss(thetas, layout, batch)
        losses[0] = np.nan
        return losses


def test_non_finite_loss_skips_the_step(tmp_path):
    cfg = TrainConfig(optimizer="sgd", steps=3, batch=2, seq_len=8, perturbations=2)
    state = new_state(MODEL, cfg)
    theta0 = state.theta.copy()
    state, records = run_steps(tmp_path, cfg, state=state, ops=Poisoned())
    assert all(r.skipped for r in records if isinstance(r, Step))
    assert np.array_equal(state.theta, theta0) and state.step == 3
    assert (tmp_path / CHECKPOINT).exists()


def test_checkpoint_rotation_keeps_the_previous_and_survives_a_damaged_latest(tmp_path):
    cfg = TrainConfig(optimizer="sgd", steps=6, batch=2, seq_len=8, perturbations=2, checkpoint_every=3)
    run_steps(tmp_path, cfg)
    folder = RunFolder(tmp_path)
    assert folder.read_checkpoint().step == 6
    assert folder.read_checkpoint(step=3).step == 3
    data = (tmp_path / CHECKPOINT).read_bytes()
    (tmp_path / CHECKPOINT).write_bytes(data[: len(data) // 2])
    with pytest.warns(CheckpointFallback, match=r"checkpoint\.h5 is damaged .*; using .*checkpoint\.prev\.h5 \(step 3\)"):
        assert folder.read_checkpoint().step == 3  # the damaged latest is passed over, and said so
    (tmp_path / PREVIOUS).unlink()
    with pytest.raises(CheckpointError, match="checkpoint.h5"):
        folder.read_checkpoint()


# --- EGGROLL as the trainer's optimizer ----------------------------------------------------------

EGG = dict(optimizer="eggroll", rank=1, eps=0.01, batch=4, seq_len=16, perturbations=4, warmup=2)


def test_eggroll_step_is_the_zscored_low_rank_update(tmp_path):
    """One trainer step equals eggroll_step of the z-scored fitness of the same members' losses,
    which in turn moves theta by lr * N^-1/2 * sum_j f~_j E_j with the materialised perturbations."""
    from zosoma.engines.cpu.lowrank import eggroll_population_loss, eggroll_step
    from zosoma.model.noise import materialise
    from zosoma.strategies.eggroll import zscore

    cfg = TrainConfig(steps=1, lr=0.5, **EGG)
    layout = Layout(MODEL)
    sampler = BatchSampler(small_corpus(), cfg.seq_len + 1)
    theta0 = new_state(MODEL, cfg).theta
    state, _ = run_steps(tmp_path, cfg)
    batch = sampler.batch(cfg.seed, 0, 0, cfg.batch)
    losses = eggroll_population_loss(theta0, layout, batch, cfg.eps, 1, cfg.seed, 0, 0, cfg.perturbations)
    lr = learning_rate(0, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule)
    fz = zscore(-losses)
    expected = eggroll_step(theta0, layout, fz[0::2] - fz[1::2], lr, cfg.eps, 1, cfg.seed, 0, 0)
    assert_close(state.theta, expected, rtol=1e-5, atol=1e-7)
    dense = sum((fz[2 * i] - fz[2 * i + 1]) * materialise(layout, cfg.eps, 1, cfg.seed, 0, 0, i)
                for i in range(cfg.perturbations))
    assert_close(state.theta - theta0, lr / np.sqrt(2 * cfg.perturbations) * dense, rtol=1e-3, atol=1e-7)


def test_eggroll_training_lowers_the_loss(tmp_path):
    cfg = TrainConfig(steps=40, lr=3.0, checkpoint_every=15, **{**EGG, "perturbations": 8})
    _, records = run_steps(tmp_path, cfg)
    losses = [r.loss for r in records if isinstance(r, Step)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2


def test_summed_losses_need_spsa(tmp_path):
    from zosoma.errors import ConfigError
    from zosoma.runs.soma import create_soma

    with pytest.raises(ConfigError, match="SPSA"):
        create_soma(tmp_path, MODEL, TrainConfig(**EGG), 2, "summed")
