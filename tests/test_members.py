"""A population's member table (zosoma.model.population): the strategy describes its members, the
CPU engine evaluates any description (its fused pair loop and its host builder) and regenerates
the table's D directions for the update. The CUDA engine's twin: tests/test_kernels.py."""

import numpy as np
import pytest

from helpers import assert_close, mixed_members, random_bytes, scaled_model
from zosoma.config import TrainConfig
from zosoma.engines.cpu import forward
from zosoma.engines.ops import Ops, perturbed
from zosoma.model import noise, reference
from zosoma.model.population import Population
from zosoma.strategies import make_strategy
from zosoma.strategies.onesided import one_sided

LOSS_RTOL = 1e-5  # float32 forward vs the float64 reference (tests/test_forward.py)


def _members(theta, pop, pairs):
    """The table's members by the specification: theta + sign_m * scale * delta_{direction_m}."""
    return np.stack([noise.add_noise(np.empty_like(theta), theta, pop.sign[m] * pop.scale, pop.seed, pop.expert,
                                     pop.step, int(pop.direction[m]), pop.kind)
                     for k in pairs for m in (2 * k, 2 * k + 1)])


def test_the_strategies_build_their_tables():
    spsa = make_strategy(TrainConfig(optimizer="sgd", perturbations=3)).ask(1, 2)
    assert spsa.member_directions == (0, 0, 1, 1, 2, 2) and spsa.member_signs == (1, -1) * 3
    assert spsa.directions == 3 and spsa == Population(3, spsa.scale, spsa.seed, 1, 2)  # the default table
    ones = make_strategy(TrainConfig(optimizer="onesided", perturbations=3)).ask(1, 2)
    assert ones.member_directions == tuple(range(6)) and ones.member_signs == (1,) * 6 and ones.directions == 6
    assert ones == one_sided(Population(3, ones.scale, ones.seed, 1, 2)) != spsa
    # what a kernel reads: two arrays per member, read-only
    assert ones.direction.dtype == np.int32 and ones.sign.dtype == np.float32
    assert list(ones.direction[Population.rows(range(1, 3))]) == [2, 3, 4, 5]
    with pytest.raises(ValueError):
        ones.direction[0] = 1


@pytest.mark.parametrize("table, message", [
    (((0, 0), (1, -1), 1), "2P = 4"),
    (((0, 0, 1, 1), (1, -1, 1, 2), 2), "signs must be"),
    (((0, 0, 1, 2), (1, -1, 1, 1), 2), "0..D-1"),
    (((0, 0, 1, -1), (1, -1, 1, 1), 2), "0..D-1"),
])
def test_a_bad_table_is_refused(table, message):
    with pytest.raises(ValueError, match=message):
        Population(2, 0.1, 0, 0, 0).with_members(*table)
    with pytest.raises(ValueError, match="low-rank"):
        Population(2, 0.1, 0, 0, 0, "gaussian", 2).with_members(range(4), (1,) * 4, 4)


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_any_table_is_built_and_evaluated_as_specified(kind):
    """Antithetic pairs (either sign first), a direction twice with one sign, two directions in a
    pair: the host builder gives the specification's members bit for bit, the fused pair loop
    their losses (bit for bit against the same members run through population_loss with
    Rademacher noise), for the whole population and a range of its pairs."""
    theta, layout = scaled_model(8, 16, 1, scale=2.0)
    batch = random_bytes(1, (3, 12))
    pop = mixed_members(Population(8, 0.05, 2**33 + 3, 2, 7, kind))
    for pairs in (range(8), range(2, 7)):
        members = perturbed(theta, pop, pairs)
        np.testing.assert_array_equal(members, _members(theta, pop, pairs))
        plus, minus = Ops().perturbed_losses(theta, layout, batch, pop, pairs)
        host = forward.population_loss(members, layout, batch)
        exact = np.array_equal if kind == "rademacher" else lambda a, b: np.allclose(a, b, rtol=1e-6, atol=0)
        assert exact(plus, host[0::2]) and exact(minus, host[1::2]), pairs
        want = [reference.loss(m.astype(np.float64), layout, batch) for m in members]
        assert_close(plus, want[0::2], rtol=LOSS_RTOL, name="first members")
        assert_close(minus, want[1::2], rtol=LOSS_RTOL, name="second members")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_the_update_regenerates_the_tables_directions(kind):
    """noise_sum and the fused sgd_update take one scalar per direction 0..D-1 (D = 9, and D =
    10 with direction 9 measured by no member), whatever the members were; Gaussian directions
    kept by the forward are used only when the table measured every one of them."""
    theta, layout = scaled_model(8, 16, 1, scale=2.0)
    batch = random_bytes(1, (3, 12))
    coeffs = np.linspace(-1.0, 2.0, 10)
    for pop in (mixed_members(Population(8, 0.05, 11, 1, 3, kind), extra=1),
                mixed_members(Population(8, 0.05, 11, 1, 3, kind))):
        D = pop.directions
        ops = Ops()
        ops.perturbed_losses(theta, layout, batch, pop)
        kept = ops._kept_directions(pop, theta.size)
        assert (kept is not None) == (kind == "gaussian" and pop.complete), (kind, D)
        want = sum(c / D * noise.noise(theta.size, 11, 1, 3, j, kind).astype(np.float64)
                   for j, c in enumerate(coeffs[:D]))
        assert_close(ops.noise_sum(coeffs[:D], theta.size, pop), want, atol=1e-6, name=f"estimate D={D}")
        new = ops.sgd_update(theta, coeffs[:D], pop, 0.1)
        assert_close(new, theta - 0.1 * want, atol=1e-6, name=f"update D={D}")
        with pytest.raises(ValueError, match=f"one scalar per direction, \\({D},\\)"):
            ops.sgd_update(theta, coeffs[:D - 1], pop, 0.1)
