"""The porting kit's whole-run stage: zosoma's own port (its trainer and evaluation, reading the kit's
batches) passes the `run` stage, which checks the stored reference figures against a fresh run;
a port that trains without the default shaping fails it, and the checker names the reading."""

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


def _check(kit, folder, outputs) -> tuple[int, str]:
    folder.mkdir()
    np.savez(folder / "run.npz", **outputs)
    out = io.StringIO()
    return check_port.check(kit, folder, out=out, stages=["run"], strict=True), out.getvalue()


@pytest.mark.slow
def test_zosomas_own_run_passes_the_run_stage(kit, tmp_path):
    status, text = _check(kit, tmp_path / "port", porting_port.port_run(kit, tmp_path / "train"))
    assert status == 0 and "[PASS] run: all 2 outputs" in text, text


@pytest.mark.slow
def test_a_run_without_the_default_shaping_fails_the_run_stage(kit, tmp_path):
    status, text = _check(kit, tmp_path / "port", porting_port.port_run(kit, tmp_path / "train", shaping=()))
    assert status == 1 and "[FAIL] heldout:" in text and "[FAIL] losses:" in text, text
    assert "looks like: trained without shaping" in text.split("[FAIL] heldout:")[1], text
