"""The porting kit's stage `run_activity` (zosoma.porting.kit_activity_run): activity perturbation's
default run, shortened. zosoma's own trainer passes it (training it afresh checks the stored
reference figures); a port that trains one-sided SPSA's run instead fails it with the reading
named; the reference steps that set its tolerances compute the engine's step; and run_onesided and
run_restart keep their figures when `zosoma train`'s default changes."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import porting_port
from zosoma.model.params import Layout, init_params
from zosoma.config import ModelConfig
from zosoma.engines.ops import Ops
from zosoma.model.population import Population
from zosoma.porting import check_port, kit_activity_run, kit_default_run
from zosoma.strategies import STRATEGIES, settings
from zosoma.strategies.onesided import one_sided

pytest.importorskip("onnx", reason="the kit writes its model as ONNX (the onnx extra)")
STAGE = "run_activity"


def _check(kit, folder, outputs, stage=STAGE) -> tuple[int, str]:
    folder.mkdir()
    np.savez(folder / f"{stage}.npz", **outputs)
    out = io.StringIO()
    return check_port.check(kit, folder, out=out, stages=[stage], strict=True), out.getvalue()


def _entry(kit, name=STAGE) -> dict:
    return {s["name"]: s for s in json.loads((kit / "manifest.json").read_text())["stages"]}[name]


def test_the_stage_is_activity_onesideds_default_run_shortened(kit):
    """Its settings are resolve's for `zosoma train --steps 300` (the default: activity-onesided);
    required, as activity_onesided_step is; its tolerances the `run` stage's or wider; every misreading it names lies outside
    them, so the checker can tell each from the kit's run."""
    entry, f = _entry(kit), np.load(kit / f"{STAGE}.npz")
    _, cfg = settings.resolve("tiny", {"steps": 300})
    assert str(f["optimizer"]) == "activity-onesided" and float(f["lr"]) == cfg.lr and int(f["steps"]) == 300
    assert str(f["shaping"]) == "" and int(f["perturbations"]) == cfg.perturbations
    assert "optional" not in entry and "optional" not in _entry(kit, "activity_onesided_step")
    run = _entry(kit, "run")["outputs"]
    for output in ("losses", "heldout"):
        tol = entry["outputs"][output]
        assert tol["atol"] >= run[output]["atol"] and "float64" in _entry(kit)["outputs"]["losses"]["why"]
        readings = entry["misreadings"][output]
        assert len(readings) == (4 if output == "losses" else 3) and "one-sided SPSA's run" in readings[0]["reading"]
        misread = np.load(kit / "misreadings.npz")
        for found in readings:
            gap = np.abs(misread[found["array"]] - f[output]).max()
            assert gap > 3 * tol["atol"], (found["reading"], gap)
    assert np.array_equal(f["batch_doc"], np.load(kit / "run_onesided.npz")["batch_doc"])  # the same batches


def _checker(kit, port) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(kit / "check_port.py"), str(kit), str(port), "--stage", STAGE],
                          capture_output=True, text=True)


@pytest.mark.subprocess
def test_the_kits_checker_names_one_sided_spsas_figures(kit, tmp_path):
    """The standalone checker in the kit folder passes the kit's own figures, and fails
    run_onesided's stored ones (what a port of one-sided SPSA writes: the slow test below trains
    it) on both outputs, each with the reading named."""
    assert _checker(kit, kit).returncode == 0
    stored = json.loads(kit_default_run.REFERENCE.read_text())["onesided"]
    (tmp_path / "port").mkdir()
    np.savez(tmp_path / "port" / f"{STAGE}.npz", losses=np.array(stored["losses"]),
             heldout=np.float64(stored["heldout"]))
    result = _checker(kit, tmp_path / "port")
    assert result.returncode == 1 and f"[FAIL] {STAGE}: 2 of 2 outputs failed" in result.stdout, result.stdout
    assert result.stdout.count("looks like: one-sided SPSA's run") == 2, result.stdout


def test_the_one_sided_runs_keep_their_optimizer_when_the_default_changes(monkeypatch):
    before = kit_default_run.onesided_config(), kit_default_run.restart_config()
    monkeypatch.setattr(settings, "DEFAULT_OPTIMIZER", "activity-onesided")
    assert settings.resolve("tiny", {})[1].optimizer == "activity-onesided"
    assert (kit_default_run.onesided_config(), kit_default_run.restart_config()) == before
    assert before[0][1].optimizer == before[1][1].optimizer == "onesided"


def test_a_moved_default_of_the_strategy_is_refused_not_shipped(monkeypatch):
    """The stored figures are the run at the settings they were measured with: if the strategy's
    defaults move (its rate, when it becomes zosoma train's default), writing the kit says so."""
    assert kit_activity_run.activity_stage().name == STAGE
    monkeypatch.setattr(STRATEGIES["activity-onesided"], "rate_factor", 10.0)
    with pytest.raises(RuntimeError, match=r"measured with other settings \(lr\): measure it again"):
        kit_activity_run.activity_stage()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_steps_compute_the_engines_step(causal, dtype):
    """ReferenceSteps (the spread's references) give the CPU engine's nats and estimate to float32
    rounding, in their dtype: the gap they measure is rounding, not another rule."""
    config = ModelConfig(embed=5, hidden=4, layers=2)
    layout = Layout(config)
    theta = (init_params(config, 3) * 2).astype(np.float32)
    batch = np.random.default_rng(4).integers(0, 256, (3, 8), dtype=np.uint8)
    pop = one_sided(Population(3, 1e-2, 7, 0, 5))
    reference = kit_activity_run.ReferenceSteps(dtype)
    got, want = (o.activity_losses(theta, layout, batch, pop, None, None, "local", causal) for o in (reference, Ops()))
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < 2e-5
    coeffs = np.random.default_rng(5).standard_normal((6, 3, 7) if causal else (6, 3))
    g, w = (o.activity_estimate(theta, layout, batch, coeffs, pop, "local", causal) for o in (reference, Ops()))
    assert g.dtype == dtype and np.abs(g - w).max() <= 1e-5 * np.abs(w).max()


@pytest.mark.slow
def test_zosomas_own_activity_run_passes_run_activity(kit, tmp_path):
    """Trained afresh, the run gives the stored figures (the kit's) within the stage's tolerances."""
    outputs = porting_port.port_default_run(kit, tmp_path / "train", STAGE)
    status, text = _check(kit, tmp_path / "port", outputs)
    assert status == 0 and f"[PASS] {STAGE}: all 2 outputs" in text, text


@pytest.mark.slow
def test_one_sided_spsas_run_fails_run_activity_with_the_reading_named(kit, tmp_path):
    """The deliberately wrong port: today's default run (one-sided SPSA, weights perturbed) where
    activity perturbation's is asked for."""
    outputs = porting_port.port_default_run(kit, tmp_path / "train", "run_onesided")
    status, text = _check(kit, tmp_path / "port", outputs)
    assert status == 1 and "[FAIL] losses:" in text and "[FAIL] heldout:" in text, text
    for output in ("losses", "heldout"):
        assert "looks like: one-sided SPSA's run" in text.split(f"[FAIL] {output}:")[1], text
