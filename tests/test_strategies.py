"""The strategy seam: the registry, declared options, OpenAI-ES, the summed-loss wrapper."""

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL as MODEL
from zosoma.config import TrainConfig
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError
from zosoma.model import reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.training.records import Step
from zosoma.training.trainer import Trainer, new_state, train
from zosoma.strategies import STRATEGIES, make_strategy
from zosoma.strategies.es import OpenES, centered_ranks
from zosoma.strategies.summed import Summed


def corpus():
    text = np.frombuffer(b"zero-order training needs nothing but forward passes. " * 80, np.uint8)
    return Corpus(("t",), (text,))


def test_the_registry_names_every_strategy():
    assert set(STRATEGIES) == {"sgd", "momentum", "adam", "eggroll", "es", "onesided", "readout", "rowwise", "activity",
                               "activity-local", "activity-causal", "activity-local-causal", "activity-onesided"}
    for name, cls in STRATEGIES.items():
        strategy = make_strategy(TrainConfig(optimizer=name))
        assert isinstance(strategy, cls) and strategy.name == name
    with pytest.raises(ConfigError, match="optimizer must be one of sgd, momentum, adam, eggroll, es, onesided, readout, rowwise, "
                                         "activity, activity-local, activity-causal, activity-local-causal, activity-onesided"):
        make_strategy(TrainConfig(optimizer="lbfgs"))


@pytest.mark.parametrize("optimizer, field, value", [
    ("eggroll", "noise", "gaussian"), ("eggroll", "momentum", 0.5), ("eggroll", "weight_decay", 0.1),
    ("sgd", "rank", 4), ("sgd", "momentum", 0.5), ("momentum", "beta2", 0.9), ("es", "noise", "gaussian"),
    ("es", "rank", 2)])
def test_an_option_the_strategy_ignores_is_an_error(optimizer, field, value):
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} is not used by --optimizer {optimizer}"):
        make_strategy(TrainConfig(optimizer=optimizer, **{field: value}))


def test_options_a_strategy_reads_are_accepted():
    make_strategy(TrainConfig(optimizer="adam", momentum=0.5, beta2=0.9, weight_decay=0.1, noise="gaussian"))
    make_strategy(TrainConfig(optimizer="eggroll", rank=4, eps=0.01))
    make_strategy(TrainConfig(optimizer="es", weight_decay=0.01))


def test_resolve_takes_the_preset_then_the_strategys_defaults_then_what_was_given():
    from zosoma.strategies.settings import resolve

    model, cfg = resolve("small", {"optimizer": "es", "hidden": 32})
    assert (model.embed, model.hidden, model.layers) == (128, 32, 2) and cfg.seq_len == 128  # the preset's
    assert (cfg.eps, cfg.lr) == (0.02, 0.005)  # ES's own, over the preset's lr
    assert resolve(None, {"optimizer": "es", "lr": 0.01})[1].lr == 0.01  # given wins
    assert resolve(None, {"optimizer": "es"}, shared={"eps": 0.03})[1].eps == 0.03  # so does a shared table
    assert resolve(None, {"optimizer": "es"}, shared={"momentum": 0.9})[1].optimizer == "es"  # at its default
    with pytest.raises(ConfigError, match="--momentum is not used by --optimizer es"):
        resolve(None, {"optimizer": "es"}, shared={"momentum": 0.5})
    with pytest.raises(ConfigError, match="--noise is not used by --optimizer es"):
        resolve(None, {"optimizer": "es", "noise": "rademacher"})  # given, though the default: still unread
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        resolve(None, {"optimizer": "lbfgs"})
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve(None, {"hiddn": 3})


def test_resolve_holds_the_one_default_optimizer():
    """TrainConfig names no optimizer of its own: resolve's default is the default run's (activity
    perturbation with one-sided members at its rate and steps); a stored configuration written before the field existed reads as
    the paper's sgd, what it trained."""
    import json

    from zosoma.config import from_json, to_json
    from zosoma.strategies.settings import DEFAULT_OPTIMIZER, resolve

    with pytest.raises(TypeError, match="optimizer"):
        TrainConfig()
    cfg = resolve("tiny")[1]
    assert (cfg.optimizer, cfg.steps, cfg.lr) == (DEFAULT_OPTIMIZER, 3100, 0.15 * 20 / 3) and cfg.optimizer == "activity-onesided"
    assert (resolve("tiny", {"optimizer": "onesided"})[1].steps, resolve("tiny", {"optimizer": "onesided"})[1].lr) == (3540, 0.15 * 1.4142)
    assert resolve(None, {"optimizer": "sgd"})[1] == TrainConfig(optimizer="sgd")  # the paper's: the other defaults
    stored = json.loads(to_json(TrainConfig(optimizer="sgd")))
    del stored["TrainConfig"]["optimizer"]
    assert from_json(json.dumps(stored))["TrainConfig"] == TrainConfig(optimizer="sgd")


def test_centered_ranks():
    r = centered_ranks([3.0, -1.0, 10.0, 0.5])
    assert r.tolist() == pytest.approx([1 / 6, -0.5, 0.5, -1 / 6], abs=1e-15)
    assert centered_ranks([2.0, 2.0]).tolist() == [-0.5, 0.5]  # ties in index order
    assert centered_ranks([7.0]).tolist() == [-0.5]


def test_es_step_is_the_rank_shaped_gaussian_update():
    """One OpenES step: theta + lr / (2 P sigma) * sum_k (r_k+ - r_k-) eps_k with centred ranks of
    the fitness -loss over all 2P members, on members built from the Gaussian counters."""
    P, sigma, lr = 5, 0.05, 0.01
    cfg = TrainConfig(optimizer="es", perturbations=P, eps=sigma, lr=lr, batch=3, seq_len=12)
    layout = Layout(MODEL)
    theta = init_params(MODEL, 2)
    batch = BatchSampler(corpus(), cfg.seq_len + 1).batch(0, 0, 0, cfg.batch)
    es = OpenES(cfg)
    pop = es.ask(expert=1, step=3)
    assert (pop.kind, pop.rank, pop.scale, pop.P) == ("gaussian", 0, sigma, P)
    plus, minus = Ops().perturbed_losses(theta, layout, batch, pop)
    eps_k = [noise(theta.size, 0, 1, 3, k, "gaussian") for k in range(P)]
    for k in range(P):  # the members really are theta +/- sigma eps_k
        want = reference.loss(theta + np.float32(sigma) * eps_k[k], layout, batch)
        assert plus[k] == pytest.approx(want, rel=1e-5)
    coeffs, loss = es.coefficients(plus, minus)
    assert loss == pytest.approx(np.mean((plus + minus) / 2))
    ranks = centered_ranks(-np.stack([plus, minus], axis=1).ravel())
    new, state = es.update(Ops(), layout, theta, {}, coeffs, pop, lr)
    want = theta + lr / (2 * P * sigma) * sum((ranks[2 * k] - ranks[2 * k + 1]) * eps_k[k] for k in range(P))
    assert_close(new, want, atol=1e-6, rtol=1e-5, name="es step")
    assert state == {}
    nan_coeffs, _ = es.coefficients(np.array([np.nan, 1.0]), np.array([1.0, 1.0]))
    assert np.isnan(nan_coeffs).all()  # a diverged member: the trainer skips the step


def test_es_trains(tmp_path):
    cfg = TrainConfig(optimizer="es", steps=40, batch=4, seq_len=16, perturbations=8, warmup=2,
                      checkpoint_every=15, eps=0.02, lr=0.05)
    trainer = Trainer(tmp_path, MODEL, cfg, BatchSampler(corpus(), cfg.seq_len + 1), new_state(MODEL, cfg), ops=Ops())
    losses = [r.loss for r in train(trainer) if isinstance(r, Step)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3  # it learns


def test_summed_wrapper_shares_spsa_scalars_and_refuses_shaped_fitness():
    cfgs = [TrainConfig(optimizer="sgd", eps=0.01), TrainConfig(optimizer="sgd", eps=0.01)]
    summed = Summed([make_strategy(c) for c in cfgs])
    losses = [(np.array([1.0, 2.0]), np.array([0.5, 2.5])), (np.array([3.0, 1.0]), np.array([1.0, 1.0]))]
    shared, per_expert = summed.coefficients(losses)
    assert_close(shared, np.array([(0.5 + 2.0) / 0.02, (-0.5 + 0.0) / 0.02]), rtol=1e-12)
    assert per_expert == [pytest.approx(1.5), pytest.approx(1.5)]
    for name in ("eggroll", "es"):
        with pytest.raises(ConfigError, match=f"--optimizer {name} shapes fitness"):
            Summed([make_strategy(TrainConfig(optimizer=name))])
    with pytest.raises(ConfigError, match="--optimizer onesided measures one-sided differences"):
        Summed([make_strategy(TrainConfig(optimizer="onesided"))])



@pytest.mark.parametrize("optimizer", ["sgd", "adam", "es"])
def test_tell_shapes_rates_and_skips_in_the_base_for_every_strategy(optimizer):
    """Strategy.tell is the one step of the loop, a population worker and zosoma.Optimizer: the
    raw spread recorded, the shaping chain, the schedule times restart_lr_factor ** restarts, then
    the rule's update; a non-finite scalar changes no state at all."""
    from zosoma.strategies.base import learning_rate
    from zosoma.strategies.shaping import spread
    cfg = TrainConfig(optimizer=optimizer, perturbations=4, steps=100, warmup=10, lr=0.1, restart_lr_factor=0.5,
                      **({"shaping": ()} if optimizer == "es" else {}))
    strategy, ops = make_strategy(cfg), Ops()
    theta, pop = np.random.default_rng(0).normal(size=50).astype(np.float32), strategy.ask(0, 30)
    state, shaping = strategy.init(ops, 50), strategy.shaping.init()
    coeffs = np.array([0.3, -1.2, 0.7, 0.1])
    told = strategy.tell(ops, None, theta, state, shaping, coeffs, pop, restarts=2)
    lr = learning_rate(30, 0.1, 100, 10, "cosine") * 0.25
    shaped, new_shaping, info = strategy.shaping(coeffs, shaping)
    expected, expected_state = strategy.update(ops, None, theta, state, shaped, pop, lr)
    assert told.lr == lr and not told.skipped and told.shaping == new_shaping
    assert np.array_equal(told.theta, expected) and told.optimizer.keys() == expected_state.keys()
    assert told.record == {"spread": spread(coeffs), **info}
    assert ("normalize_scale" in told.record) == (optimizer != "es")  # the default run's shaping

    skipped = strategy.tell(ops, None, theta, state, shaping, np.array([0.3, np.nan, 0.7, 0.1]), pop, restarts=2)
    assert skipped.skipped and skipped.lr == lr and skipped.record == {"spread": None}
    assert skipped.theta is theta and skipped.optimizer is state and skipped.shaping is shaping


def test_activity_perturbation_in_a_narrow_format_warns_of_an_eps_below_its_step():
    """The default estimator's noise at eps 1e-3 is under a bf16 pre-activation's step: resolve
    says so in one warning (docs/precision.md measured it), and not at eps 0.03 or for SPSA."""
    import warnings

    from zosoma.strategies.settings import NarrowEps, resolve

    with pytest.warns(NarrowEps, match="--forward-precision bf16 with --optimizer activity-onesided: eps 0.001"):
        resolve("tiny", {"forward_precision": "bf16"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", NarrowEps)
        resolve("tiny", {"forward_precision": "bf16", "eps": 0.03})
        resolve("tiny", {"forward_precision": "int8", "optimizer": "onesided"})
        resolve("tiny")
