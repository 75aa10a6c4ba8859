"""The porting kit's stage `activity_onesided_step` (zosoma.porting.kit_activity) against the strategy
it specifies, --optimizer activity-onesided: its float64 model (zosoma.model.node_perturbation) gives
the kit's reference to rounding, its float32 step (the CPU engine) passes the stage with a margin,
and a port off by one bug (a sign, a counter, the members' mean, the credit, the readout's scale)
fails it. The kit's reference calls none of these: kit_activity writes its own."""

import io
import json

import numpy as np
import pytest

import porting_port
from porting_port import activity_onesided, load
from zosoma.config import ModelConfig
from zosoma.engines.cpu import noisy_forward
from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation
from zosoma.model.params import Layout
from zosoma.porting import check_port

pytest.importorskip("onnx", reason="the kit writes its model as ONNX (the onnx extra)")
STAGE = "activity_onesided_step"


@pytest.fixture(scope="module")
def layout(kit):
    m = json.loads((kit / "manifest.json").read_text())["model"]
    return Layout(ModelConfig(m["embed"], m["hidden"], m["layers"]))


@pytest.fixture(scope="module")
def good(kit, layout):
    """The stage's outputs from zosoma's own float32 code, written as a port would."""
    return porting_port.port_activity_onesided(kit, layout)


def _check(kit, tmp_path, outputs) -> tuple[int, str]:
    folder = tmp_path / "port"
    folder.mkdir(exist_ok=True)
    np.savez(folder / f"{STAGE}.npz", **outputs)
    out = io.StringIO()
    return check_port.check(kit, folder, out=out, stages=[STAGE]), out.getvalue()


def _tolerances(kit) -> dict:
    stage = {s["name"]: s for s in json.loads((kit / "manifest.json").read_text())["stages"]}[STAGE]
    return stage["outputs"]


def test_the_kits_reference_is_node_perturbations_float64_model(kit, layout):
    """node_perturbation in float64 from the kit's inputs (each piece from the kit's values of the
    one before) gives the kit's values: the noise and the credit bit for bit, the strategy's scalars
    bit for bit, the nats and the estimate to float64 rounding (other orders of summation), the
    combined noise within one float32 value (node_perturbation rounds it to float32)."""
    f, strategy, pop = activity_onesided(kit)
    B, T, J = f["batch"].shape[0], f["batch"].shape[1] - 1, pop.directions
    assert J == 2 * int(f["P"]) and strategy.readout == "local" and strategy.causal and strategy.onesided
    Z = np.stack([node_perturbation.member_noise(layout, B, T, pop.seed, pop.expert, pop.step, j, "rademacher",
                                                 "local") for j in range(J)])
    assert np.array_equal(Z, f["gate_noise"])
    nats = node_perturbation.member_losses(f["theta"].astype(np.float64), layout, f["batch"], float(f["eps"]),
                                           Z.astype(np.float64), pop.direction, pop.sign)
    np.testing.assert_allclose(nats, f["nats"], rtol=1e-13, atol=0)
    scalars, loss = strategy.coefficients(f["nats"][0::2], f["nats"][1::2])
    assert np.array_equal(scalars.reshape(J, B, T), f["scalars"]) and loss == pytest.approx(float(f["loss"]), 1e-15)
    assert np.array_equal(node_perturbation.credit(f["scalars"], causal=True)[0], f["credit"])
    zeta = node_perturbation.combined(f["scalars"], Z, causal=True, gates=Z.shape[-1])
    kit_zeta = f["zeta"].astype(np.float32)
    assert np.all(np.abs(zeta - kit_zeta) <= np.spacing(np.abs(kit_zeta)))
    ghat = node_perturbation.estimate(f["theta"].astype(np.float64), layout, f["batch"], f["zeta"])
    np.testing.assert_allclose(ghat, f["ghat"], rtol=1e-12, atol=1e-16)


def test_the_strategys_float32_step_passes_with_a_margin(kit, layout, good, tmp_path):
    """activity-onesided's own float32 step (the CPU engine's noisy forward, its estimate) passes the
    stage, every output under 1/5 of its tolerance; the scalars and the credit from the kit's values
    bit for bit; and the strategy's update run whole from the kit's scalars (credit, combined noise,
    estimate, step down) lands within theta_new's tolerance."""
    rc, text = _check(kit, tmp_path, good)
    assert rc == 0 and f"[PASS] {STAGE}: all 8 outputs" in text, text
    f = load(kit, STAGE)
    for output, tol in _tolerances(kit).items():
        w, g = f[output].astype(np.float64), good[output].astype(np.float64)
        assert np.all(np.abs(g - w) <= 0.2 * (tol["atol"] + tol["rtol"] * np.abs(w))), output
    assert np.array_equal(good["scalars"], f["scalars"]) and np.array_equal(good["credit"], f["credit"])
    _, strategy, pop = activity_onesided(kit)
    ops = Ops()
    strategy.losses(ops, f["theta"], layout, f["batch"], pop, {})  # the step whose batch it updates from
    theta, _ = strategy.update(ops, layout, f["theta"], {}, f["scalars"].ravel(), pop, float(f["lr"]))
    tol = _tolerances(kit)["theta_new"]
    assert check_port.compare("theta_new", theta, f["theta_new"], tol["atol"], tol["rtol"])[0]


def test_zeta_summed_in_float32_in_any_order_is_free(kit):
    """PORTING.md leaves zeta's precision free: float32 sums of the 2P members, forwards or
    backwards, pass well inside the tolerance (zosoma sums in float64 and rounds)."""
    f = load(kit, STAGE)
    w, z = f["credit"].astype(np.float32), f["gate_noise"].astype(np.float32)
    tol = _tolerances(kit)["zeta"]
    for order in (range(len(w)), reversed(range(len(w)))):
        zeta = np.zeros(z.shape[1:], np.float32)
        for j in order:
            zeta += w[j][..., None] * z[j]
        allowed = tol["atol"] + tol["rtol"] * np.abs(f["zeta"])
        assert np.all(np.abs(zeta - f["zeta"]) <= 0.2 * allowed)


def _nats(f, layout, Z, index, sign):
    """(M, B, T) every target's nats under members sign[m] eps Z[index[m]] (the CPU engine's forward)."""
    return noisy_forward.member_losses(f["theta"], layout, f["batch"], float(f["eps"]), Z, index, sign)


def wrong_counter(kit, good, layout):
    """Members counted from 1: member j's noise from the counter of member j + 1."""
    f, strategy, pop = activity_onesided(kit)
    B, T, J = f["batch"].shape[0], f["batch"].shape[1] - 1, pop.directions
    Z = noisy_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, range(1, J + 1), "rademacher", "local")
    return dict(good, gate_noise=Z.astype(np.int8), nats=_nats(f, layout, Z, np.arange(J), np.ones(J)))


def wrong_pairs(kit, good, layout):
    """activity-local-causal's antithetic members +/- eps z_k, not 2P noises of their own."""
    f, strategy, pop = activity_onesided(kit)
    B, T, P = f["batch"].shape[0], f["batch"].shape[1] - 1, int(f["P"])
    Z = noisy_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, range(P), "rademacher", "local")
    return dict(good, nats=_nats(f, layout, Z, np.repeat(np.arange(P), 2), np.tile([1.0, -1.0], P)))


def wrong_sign(kit, good, layout):
    f = load(kit, STAGE)
    return dict(good, scalars=(f["nats"].mean(axis=0) - f["nats"]) / float(f["eps"]))


def wrong_mean_of_the_others(kit, good, layout):
    f = load(kit, STAGE)
    J = f["nats"].shape[0]
    others = (f["nats"].sum(axis=0) - f["nats"]) / (J - 1)
    return dict(good, scalars=(f["nats"] - others) / float(f["eps"]))


def wrong_credit_not_causal(kit, good, layout):
    """Each target's difference weights only its own position's noise."""
    f = load(kit, STAGE)
    return dict(good, credit=f["scalars"] / f["scalars"].size)


def wrong_readout_scale(kit, good, layout):
    """The readout's delta rule summed, not averaged over the B T targets."""
    f = load(kit, STAGE)
    ghat = good["ghat"].copy()
    g = layout.views(ghat)
    for name in ("out.w", "out.b"):
        g[name] *= f["scalars"][0].size
    return dict(good, ghat=ghat)


def wrong_ascent(kit, good, layout):
    f = load(kit, STAGE)
    return dict(good, theta_new=f["theta"] + np.float32(f["lr"]) * f["ghat"].astype(np.float32))


WRONG = [  # (the output that fails, the wrong port, what the checker says it looks like; None: no look-alike)
    ("gate_noise", wrong_counter, None),
    ("nats", wrong_pairs, "antithetic pairs"),
    ("scalars", wrong_sign, "the sign turned"),
    ("scalars", wrong_mean_of_the_others, "the OTHER members"),
    ("credit", wrong_credit_not_causal, "own difference only"),
    ("ghat", wrong_readout_scale, "without 1/(B T)"),
    ("theta_new", wrong_ascent, "ascent"),
]


@pytest.mark.parametrize("output, port, looks_like", WRONG, ids=[w[1].__name__[6:] for w in WRONG])
def test_a_port_off_by_one_bug_fails_the_stage(kit, layout, good, tmp_path, output, port, looks_like):
    rc, text = _check(kit, tmp_path, port(kit, good, layout))
    assert rc == 1 and f"[FAIL] {output}:" in text and f"[FAIL] {STAGE}:" in text, text
    if output == "gate_noise":  # a wrong counter fails the nats too
        assert "[FAIL] nats:" in text, text
    if looks_like:
        line = text.split(f"[FAIL] {output}:")[1].split("\n  [")[0]
        assert "looks like:" in line and looks_like in line, text
