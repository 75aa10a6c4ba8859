"""The porting kit's whole-run stages: zosoma's own port (its trainer and evaluation, reading the kit's
batches) passes `run`, `run_onesided` and `run_restart`, which checks the stored reference figures
against fresh runs; a port that trains without the default shaping fails `run`, and one that follows
PORTING.md's old sentence on run length after a restart fails `run_restart`, each with the reading
named."""

import io

import numpy as np
import pytest

import porting_port
from zosoma.porting import check_port
from zosoma.porting.kit import write_kit


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit") / "kit"
    write_kit(out)
    return out


def _check(kit, folder, outputs, stage="run") -> tuple[int, str]:
    folder.mkdir()
    np.savez(folder / f"{stage}.npz", **outputs)
    out = io.StringIO()
    return check_port.check(kit, folder, out=out, stages=[stage], strict=True), out.getvalue()


@pytest.mark.slow
def test_zosomas_own_run_passes_the_run_stage(kit, tmp_path):
    status, text = _check(kit, tmp_path / "port", porting_port.port_run(kit, tmp_path / "train"))
    assert status == 0 and "[PASS] run: all 2 outputs" in text, text


@pytest.mark.slow
def test_a_run_without_the_default_shaping_fails_the_run_stage(kit, tmp_path):
    status, text = _check(kit, tmp_path / "port", porting_port.port_run(kit, tmp_path / "train", shaping=()))
    assert status == 1 and "[FAIL] heldout:" in text and "[FAIL] losses:" in text, text
    assert "looks like: trained without shaping" in text.split("[FAIL] heldout:")[1], text


@pytest.mark.slow
def test_zosomas_own_default_run_passes_the_run_onesided_stage(kit, tmp_path):
    status, text = _check(kit, tmp_path / "port", porting_port.port_default_run(kit, tmp_path / "train", "run_onesided"),
                          "run_onesided")
    assert status == 0 and "[PASS] run_onesided: all 2 outputs" in text, text


@pytest.mark.slow
def test_zosomas_own_restarting_run_passes_the_run_restart_stage(kit, tmp_path):
    """The run restarts once and ends with its counter short of `steps` by the steps it re-ran."""
    outputs = porting_port.port_default_run(kit, tmp_path / "train", "run_restart")
    steps = int(np.load(kit / "run_restart.npz")["steps"])
    assert outputs["attempted"] == steps  # every step attempted, the re-run ones included
    assert outputs["final_step"] == steps - (outputs["verdict_step"] - outputs["rollback_to"]) < steps
    assert outputs["losses"].size == outputs["final_step"] - outputs["rollback_to"]
    status, text = _check(kit, tmp_path / "port", outputs, "run_restart")
    assert status == 0 and "[PASS] run_restart: all 6 outputs" in text, text


@pytest.mark.slow
def test_a_port_that_runs_on_to_steps_after_a_restart_fails_run_restart(kit, tmp_path):
    """The deliberately wrong port of PORTING.md's old sentence ("the counter rolls back with the
    checkpoint, and runs on to steps"): its counter ends at `steps`, it attempts more steps than
    the budget, its held-out figure moves; the checker names the reading."""
    outputs = porting_port.port_default_run(kit, tmp_path / "train", "run_restart", budget=False)
    steps = int(np.load(kit / "run_restart.npz")["steps"])
    assert outputs["final_step"] == steps and outputs["attempted"] > steps
    status, text = _check(kit, tmp_path / "port", outputs, "run_restart")
    assert status == 1 and "[FAIL] final_step:" in text and "[FAIL] attempted:" in text, text
    assert "[FAIL] losses: shape" in text, text
    assert "looks like: the counter run on to `steps` after the rollback" in text.split("[FAIL] final_step:")[1], text
