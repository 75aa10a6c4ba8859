"""The pieces that cut zero-order's price (docs/cut-price.md), each against a reference: a probe
design's directions (orthogonality, norms, antithetic members, determinism by seed), the block
structure's losses and estimate against a direct NumPy computation on a tiny model, the query
schedule's FLOP accounting, update transforms against the built-in rules and a hand-written
Adam; and the refusals. Resume bit for bit of the stateful pieces is in test_resume.py."""

import dataclasses

import numpy as np
import pytest

from helpers import assert_close, one_line_error, run_cli
from zosoma.api import Optimizer
from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines.cpu import forward
from zosoma.engines.ops import Ops, perturbed
from zosoma.errors import ConfigError
from zosoma.model import reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population
from zosoma.workers.population_workers import check_shardable
from zosoma.training.records import Step
from zosoma.training.trainer import Trainer, new_state, train
from zosoma.strategies import make_strategy
from zosoma.strategies.onesided import one_sided
from zosoma.strategies.probes.blocks import blocks
from zosoma.strategies.settings import resolve

MODEL = ModelConfig(embed=8, hidden=16, layers=1)


def corpus():
    text = np.frombuffer(b"zero-order training needs nothing but forward passes. " * 80, np.uint8)
    return Corpus(("t",), (text,))


def directions(probes, P=6, d=500, seed=0, step=3, state=None, **options):
    strategy = make_strategy(TrainConfig(probes=probes, perturbations=P, seed=seed, **{"optimizer": "sgd", **options}))
    state = strategy.init(Ops(), d) if state is None else state
    return strategy.probes.directions(strategy.ask(1, step), None, d, state)


def test_orthogonal_probes_are_orthogonal_of_norm_sqrt_d_and_fixed_by_the_seed():
    d, P = 500, 6
    U = directions("orthogonal", P, d).astype(np.float64)
    assert U.shape == (P, d)
    assert_close(U @ U.T, d * np.eye(P), atol=1e-3 * d, rtol=0, name="U U^T")
    assert np.array_equal(U, directions("orthogonal", P, d))  # the counters fix them
    assert not np.allclose(U, directions("orthogonal", P, d, seed=1))
    assert not np.allclose(U, directions("orthogonal", P, d, step=4))
    # they span what the counters' i.i.d. directions span: Gram-Schmidt of them, in order
    G = np.stack([noise(d, 0, 1, 3, k) for k in range(P)]).astype(np.float64)
    assert_close(U[0], G[0] / np.linalg.norm(G[0]) * np.sqrt(d), atol=1e-5, name="first direction")
    residual = G - (G @ U.T) @ U / d
    assert np.abs(residual).max() < 1e-3
    # more pairs than parameters: orthogonal blocks of d
    V = directions("orthogonal", P=12, d=8).astype(np.float64)
    for block in (V[:8], V[8:]):
        assert_close(block @ block.T, 8 * np.eye(len(block)), atol=1e-4, rtol=0, name="block")


def test_a_probe_designs_members_are_antithetic_pairs_along_its_directions():
    opt = Optimizer(40, optimizer="sgd", probes="orthogonal", perturbations=4, eps=0.01)
    theta = np.linspace(-1, 1, 40).astype(np.float32)
    members = opt.ask(theta, step=2)
    U = opt.strategy.probes.directions(opt.strategy.ask(0, 2), None, 40, opt.state)
    assert members.shape == (8, 40)
    assert np.array_equal(members[0::2], theta + np.float32(0.01) * U)
    assert np.array_equal(members[1::2], theta - np.float32(0.01) * U)


def test_guided_probes_mix_the_last_update_in_and_keep_it_as_state():
    d, P = 300, 5
    Z = np.stack([noise(d, 0, 1, 3, k) for k in range(P)])
    assert np.array_equal(directions("guided", P, d), Z)  # no update yet: the i.i.d. directions
    guide = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    U = directions("guided", P, d, state={"guide": guide}).astype(np.float64)
    u = guide / np.linalg.norm(guide.astype(np.float64))
    along = U - np.sqrt(0.5) * Z  # what is not the counters' share lies along the guide
    c = along @ u / np.sqrt(0.5 * d)
    assert_close(along, np.sqrt(0.5 * d) * c[:, None] * u[None, :], atol=1e-4, name="guide share")
    assert np.array_equal(U, directions("guided", P, d, state={"guide": guide}))  # fixed by the counters
    assert not np.allclose(c, directions("guided", P, d, step=4, state={"guide": guide}).astype(np.float64) @ u)
    # the state after a step is the direction it stepped along
    opt = Optimizer(d, optimizer="sgd", probes="guided", perturbations=P, eps=0.01, lr=0.1, warmup=0, schedule="constant",
                    shaping="none")
    theta = np.zeros(d, np.float32)
    losses = np.random.default_rng(1).standard_normal(2 * P)
    new = opt.tell(theta, 0, losses)
    assert_close(opt.state["guide"], (theta - new) / 0.1, atol=1e-6, name="guide")


def test_block_probes_measure_each_block_alone_against_numpy():
    """Each pair's members differ from theta in its own block only, their losses are the
    reference forward's, and the estimate is the mean over each block's own pairs."""
    P, eps = 7, 0.01
    cfg = TrainConfig(optimizer="sgd", probes="blocks", perturbations=P, eps=eps, batch=3, seq_len=12, shaping=())
    layout, theta = Layout(MODEL), init_params(MODEL, 2)
    batch = BatchSampler(corpus(), cfg.seq_len + 1).batch(0, 0, 0, cfg.batch)
    strategy = make_strategy(cfg)
    strategy.check(layout)
    pop = strategy.ask(1, 3)
    spans = blocks(layout)
    assert [name for name, _, _ in spans] == ["embed", "lstm0", "out"]
    assert spans[0][1] == 0 and spans[-1][2] == theta.size
    plus, minus = strategy.losses(Ops(), theta, layout, batch, pop, {})
    g, _ = strategy.coefficients(plus, minus)
    ghat = np.zeros(theta.size)
    for k in range(P):
        _, start, stop = spans[k % 3]
        delta = np.zeros(theta.size, np.float32)
        delta[start:stop] = noise(theta.size, 0, 1, 3, k)[start:stop]
        want_plus = reference.loss(theta + np.float32(eps) * delta, layout, batch)
        want_minus = reference.loss(theta - np.float32(eps) * delta, layout, batch)
        assert plus[k] == pytest.approx(want_plus, rel=1e-5) and minus[k] == pytest.approx(want_minus, rel=1e-5)
        assert g[k] == pytest.approx((want_plus - want_minus) / (2 * eps), rel=1e-3, abs=1e-4)
        ghat += g[k] * delta / len(range(k % 3, P, 3))  # block b's pairs: k = b, b + 3, ...
    est = strategy.estimate(Ops(), layout, theta, {}, g, pop)
    assert_close(est, ghat, atol=1e-6, rtol=1e-5, name="block estimate")


def test_block_probes_need_a_pair_per_block_and_a_models_layout():
    with pytest.raises(ConfigError, match="at least one pair per block"):
        make_strategy(TrainConfig(optimizer="sgd", probes="blocks", perturbations=2)).check(Layout(MODEL))
    with pytest.raises(ConfigError, match="needs an LSTM's layout"):
        Optimizer(10, optimizer="sgd", probes="blocks")


def test_the_doubling_schedule_keeps_the_forward_budget():
    cfg = TrainConfig(optimizer="sgd", queries="doubling", perturbations=16, steps=70)
    strategy = make_strategy(cfg)
    P = [strategy.pairs(t) for t in range(cfg.steps)]
    assert P == [8] * 40 + [16] * 20 + [32] * 10  # 4/7, 2/7, 1/7 of the steps
    assert [8 * 40, 16 * 20, 32 * 10] == [320] * 3  # each stage a third of the forward budget
    assert strategy.total_pairs() == sum(P) == 70 * 16 * 6 / 7
    assert [strategy.ask(0, t).P for t in (0, 39, 40, 59, 60, 69)] == [8, 8, 16, 16, 32, 32]
    assert make_strategy(dataclasses.replace(cfg, queries="constant")).total_pairs() == 70 * 16


def test_a_scheduled_runs_records_count_its_own_pairs(tmp_path):
    cfg = TrainConfig(optimizer="sgd", queries="doubling", perturbations=4, steps=7, batch=2, seq_len=8, warmup=1, lr=0.05,
                      checkpoint_every=7)
    trainer = Trainer(tmp_path, MODEL, cfg, BatchSampler(corpus(), cfg.seq_len + 1), new_state(MODEL, cfg), ops=Ops())
    records = [r.metrics for r in train(trainer) if isinstance(r, Step)]
    tokens = np.diff([0] + [r["tokens"] for r in records])
    assert list(tokens) == [2 * P * 2 * 8 for P in (2, 2, 2, 2, 4, 4, 8)]
    assert records[-1]["flops"] == 2 * 2 * 8 * 24 * MODEL.flops_per_token()  # 2 B T sum_t P_t
    assert trainer.done and trainer.state.step == 7


def test_the_comparison_turns_a_budget_into_the_schedules_steps(tmp_path):
    from zosoma.experiments.compare_config import load_comparison
    path = tmp_path / "c.toml"
    path.write_text('seeds = [0]\nflops = 1e11\ntrain = {batch = 4, seq_len = 16, perturbations = 8}\n'
                    '[[method]]\nname = "constant"\nmodel = {embed = 8, hidden = 16}\n'
                    '[[method]]\nname = "doubling"\nmodel = {embed = 8, hidden = 16}\ntrain = {queries = "doubling"}\n')
    constant, doubling = load_comparison(path).methods
    assert doubling.train.steps == pytest.approx(constant.train.steps * 7 / 6, abs=2)
    spent = make_strategy(doubling.train).total_pairs() * 2 * 4 * 16 * MODEL.flops_per_token()
    assert abs(spent - 1e11) <= doubling.flops_per_step() * 2  # within rounding of a stage end


def test_one_sided_spsa_gives_every_member_a_direction_against_numpy():
    """--optimizer onesided: member j is theta + eps delta_j (2P directions from the counters),
    its scalar (L_j - mean L) / eps, its estimate their mean along the directions."""
    P, eps = 3, 0.01
    cfg = TrainConfig(optimizer="onesided", perturbations=P, eps=eps, batch=3, seq_len=12, shaping=())
    layout, theta = Layout(MODEL), init_params(MODEL, 2)
    batch = BatchSampler(corpus(), cfg.seq_len + 1).batch(0, 0, 0, cfg.batch)
    strategy = make_strategy(cfg)
    pop = strategy.ask(1, 3)
    deltas = [noise(theta.size, 0, 1, 3, j) for j in range(2 * P)]
    assert len({d.tobytes() for d in deltas}) == 2 * P  # no member mirrors another
    plus, minus = strategy.losses(Ops(), theta, layout, batch, pop, {})
    want = [reference.loss(theta + np.float32(eps) * delta, layout, batch) for delta in deltas]
    assert_close(np.stack([plus, minus], axis=1).ravel(), want, rtol=1e-5, name="member losses")
    g, loss = strategy.coefficients(plus, minus)
    L = np.stack([plus, minus], axis=1).ravel()
    assert loss == pytest.approx(L.mean()) and np.array_equal(g, (L - L.mean()) / eps)
    ghat = sum(g[j] * deltas[j].astype(np.float64) for j in range(2 * P)) / (2 * P)
    assert_close(strategy.estimate(Ops(), layout, theta, {}, g, pop), ghat, atol=1e-6, rtol=1e-5, name="estimate")
    members = Optimizer(theta.size, optimizer="onesided", perturbations=P, eps=eps, seed=0).ask(theta, step=3)
    assert members.shape == (2 * P, theta.size)  # zosoma.Optimizer's members: expert 0's counters, in order j
    for j in range(2 * P):
        assert np.array_equal(members[j], theta + np.float32(eps) * noise(theta.size, 0, 0, 3, j))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_one_sided_members_are_built_inside_the_fused_forward(kind):
    """The CPU forward builds a one-sided pair's members from the counters in its pair loop: the
    same losses as the members built on the host and run through population_loss (what an engine
    without the fused loop gets), bit for bit with Rademacher noise, and every direction kept for
    the update when Gaussian."""
    layout, theta = Layout(MODEL), init_params(MODEL, 2)
    batch = BatchSampler(corpus(), 13).batch(0, 0, 0, 3)
    pop = one_sided(Population(4, 1e-3, 5, 1, 7, kind))
    fused = Ops()
    plus, minus = fused.perturbed_losses(theta, layout, batch, pop, range(1, 4))
    members = perturbed(theta, pop, range(1, 4))
    host = forward.population_loss(members, layout, batch)
    exact = np.array_equal if kind == "rademacher" else lambda a, b: np.allclose(a, b, rtol=1e-6, atol=0)
    assert exact(plus, host[0::2]) and exact(minus, host[1::2])
    fused.perturbed_losses(theta, layout, batch, pop)  # all pairs: Gaussian directions are kept
    kept = fused._kept_directions(pop, theta.size)
    assert (kept is None) == (kind == "rademacher")
    if kept is not None:
        assert all(np.array_equal(kept[j], noise(theta.size, 5, 1, 7, j, kind)) for j in range(8))


def test_one_sided_halves_the_estimates_error_at_the_same_forwards():
    """On a linear loss L = g . theta the error of P antithetic pairs is (d - 1)|g|^2 / P, and of
    2P one-sided members about (d - 1)|g|^2 / (2P): the same 2P forwards measure twice the
    directions (the mean baseline adds O(1/P) of that)."""
    d, P, steps = 400, 8, 300
    g = np.random.default_rng(0).standard_normal(d)
    errors = {}
    for name in ("sgd", "onesided"):
        strategy = make_strategy(TrainConfig(optimizer=name, perturbations=P, eps=1e-3, shaping=()))
        err = []
        for step in range(steps):
            pop = strategy.ask(0, step)
            if name == "sgd":
                deltas = [noise(d, 0, 0, step, k).astype(np.float64) for k in range(P)]
                plus, minus = np.array([x @ g for x in deltas]) * 1e-3, -np.array([x @ g for x in deltas]) * 1e-3
            else:
                deltas = [noise(d, 0, 0, step, j).astype(np.float64) for j in range(2 * P)]
                L = np.array([x @ g for x in deltas]) * 1e-3
                plus, minus = L[0::2], L[1::2]
            coeffs, _ = strategy.coefficients(plus, minus)
            err.append(np.sum((strategy.estimate(Ops(), None, np.zeros(d, np.float32), {}, coeffs, pop) - g) ** 2))
        errors[name] = np.mean(err) / ((d - 1) * g @ g)
    assert errors["sgd"] == pytest.approx(1 / P, rel=0.12)
    assert errors["onesided"] == pytest.approx(1 / (2 * P), rel=0.15)


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_a_chained_transform_is_the_built_in_rule_bit_for_bit(rule):
    theta = np.linspace(-1, 1, 64).astype(np.float32)
    built_in, chained = (Optimizer(64, optimizer=rule, perturbations=4, lr=0.01),
                         Optimizer(64, optimizer="sgd", transforms=[rule], perturbations=4, lr=0.01))
    a = b = theta
    for step in range(4):
        losses = np.cos(np.arange(8) + step)
        a, b = built_in.tell(a, step, losses), chained.tell(b, step, losses)
        assert np.array_equal(a, b)
    assert built_in.state.keys() == chained.state.keys()


def test_es_with_adam_is_the_es_estimate_through_adam():
    d, P, lr = 50, 4, 0.01
    opt = Optimizer(d, optimizer="es", transforms=["adam"], perturbations=P, lr=lr, warmup=0, schedule="constant",
                    beta2=0.99)
    theta = np.linspace(-1, 1, d).astype(np.float32)
    losses = np.sin(np.arange(2 * P))
    coeffs, _ = opt.strategy.coefficients(losses[0::2], losses[1::2])
    ghat = sum(coeffs[k] * noise(d, 0, 0, 0, k, "gaussian").astype(np.float64) for k in range(P)) / P
    m, v = 0.1 * ghat, 0.01 * ghat ** 2  # one step from zero moments
    want = theta - lr * (m / 0.1) / (np.sqrt(v / 0.01) + 1e-8)
    assert_close(opt.tell(theta, 0, losses), want, atol=1e-5, rtol=1e-4, name="ES + Adam")


def test_pieces_are_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match="--probes is not used by --optimizer eggroll"):
        resolve(None, {"optimizer": "eggroll", "probes": "guided"})
    with pytest.raises(ConfigError, match="--beta2 is not used by --optimizer es"):
        resolve(None, {"optimizer": "es", "beta2": 0.9})  # ES reads it only through --transforms adam
    assert resolve(None, {"optimizer": "es", "transforms": "adam", "beta2": 0.9})[1].transforms == ("adam",)
    with pytest.raises(ConfigError, match="would share a moment"):
        resolve(None, {"optimizer": "sgd", "transforms": ["momentum", "adam"]})
    with pytest.raises(ConfigError, match="probes must be one of iid, orthogonal, guided, blocks"):
        resolve(None, {"optimizer": "sgd", "probes": "sobol"})
    with pytest.raises(ConfigError, match="not sharded over --population-workers"):
        check_shardable(TrainConfig(optimizer="sgd", queries="doubling"), 2)
    with pytest.raises(ConfigError, match="--probes is not used by --optimizer onesided"):
        resolve(None, {"optimizer": "onesided", "probes": "orthogonal"})
    error = one_line_error(run_cli(["train", "--optimizer", "eggroll", "--probes", "orthogonal", "--steps", "1"]), 2)
    assert "--probes is not used by --optimizer eggroll" in error


def test_the_papers_estimator_is_trainconfigs_default_and_available_by_name():
    cfg = TrainConfig(optimizer="sgd")
    assert (cfg.optimizer, cfg.lr, cfg.steps, cfg.probes, cfg.queries, cfg.transforms) == (
        "sgd", 0.15, 4000, "iid", "constant", ())
    named = resolve(None, {"optimizer": "sgd", "probes": "iid", "queries": "constant"})[1]
    assert named == resolve(None, {"optimizer": "sgd"})[1] == cfg
    strategy = make_strategy(named)
    assert strategy.probes is None and not strategy.transforms  # the engine's fused step


def test_a_run_that_names_no_optimizer_trains_with_activity_onesided_one_sided_at_sqrt2_the_presets_rate():
    for preset, rate in (("tiny", 0.15), ("small", 0.008), ("paper", 0.003)):
        model, cfg = resolve(preset)
        assert (cfg.optimizer, cfg.lr, cfg.steps) == ("activity-onesided", rate * 20 / 3, 3100)
        assert resolve(preset, {"optimizer": "activity-onesided"}) == (model, cfg)
        onesided = resolve(preset, {"optimizer": "onesided"})[1]
        assert (onesided.lr, onesided.steps) == (rate * 1.4142, 3540)
        assert resolve(preset, {"optimizer": "sgd"})[1].lr == rate  # the paper's, at the preset's own
    assert resolve("tiny")[1].lr == 1.0  # the rate results/default-run-activity tuned
    assert resolve("tiny", {"optimizer": "onesided"})[1].lr == 0.3 * 0.7071  # results/default-run's, bit for bit
    assert resolve("tiny", {"lr": 0.1, "steps": 7})[1].lr == 0.1  # given values win
    assert resolve("tiny", {"optimizer": "es"})[1].lr == 0.005  # a strategy's own rate stays its own
    assert resolve("tiny", loss="summed")[1].optimizer == "sgd"  # the ablation's scalars must add up
