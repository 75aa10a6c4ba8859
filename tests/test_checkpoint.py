"""Checkpoint I/O: bit-exact round trips, named errors for damaged files, atomic writes, and the
torch export checked against the NumPy reference forward."""

import json
from pathlib import Path
import os

import h5py
import numpy as np
import pytest

from world import TINY_MODEL_L2 as MODEL
import zosoma
from zosoma.model import reference
from zosoma.formats.checkpoint import Checkpoint, description, load_checkpoint, save_checkpoint, summary
from zosoma.config import ModelConfig, TrainConfig
from zosoma import atomic
from zosoma.errors import CheckpointError, WriteError
from zosoma.model.params import Layout, init_params
from zosoma.training.folder import last_metrics

from helpers import assert_close

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures"


def make_checkpoint(step=7, seed=0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    theta = init_params(MODEL, seed=seed)
    d = theta.size
    theta[:3] = [np.nan, np.inf, -0.0]  # values need not be finite, and must survive bit for bit
    return Checkpoint(
        model=MODEL,
        train=TrainConfig(steps=50, lr=1e-3, optimizer="adam", seed=seed),
        theta=theta,
        step=step,
        optimizer={"m": rng.standard_normal(d).astype(np.float32),
                   "v": rng.random(d).astype(np.float32)},
        extra={"seed": seed, "cursor": [3, 1, 4], "flops": 1.5e12, "expert": 1, "note": "é ✓"},
        metrics_records=7, metrics_sha256="ab" * 32,
    )


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt.h5"
    ck = make_checkpoint()
    save_checkpoint(path, ck)
    return path, ck


def assert_raises_naming(path, func=load_checkpoint, match=None):
    with pytest.raises(CheckpointError) as info:
        func(path)
    message = str(info.value)
    assert str(path) in message, message
    assert "\n" not in message, message
    if match is not None:
        assert match in message, message
    return message


def test_round_trip_is_bit_exact(saved):
    path, ck = saved
    got = load_checkpoint(path)
    assert got.model == ck.model and got.train == ck.train
    assert got.step == ck.step and isinstance(got.step, int)
    assert got.theta.dtype == np.float32 and got.theta.shape == ck.theta.shape
    assert got.theta.tobytes() == ck.theta.tobytes()
    assert sorted(got.optimizer) == ["m", "v"]
    for name, values in ck.optimizer.items():
        assert got.optimizer[name].dtype == values.dtype
        assert got.optimizer[name].tobytes() == values.tobytes()
    assert got.extra == ck.extra
    assert (got.metrics_records, got.metrics_sha256, got.stored_metrics) == (7, "ab" * 32, None)


def test_file_says_what_it_is(saved):
    path, ck = saved
    layout = Layout(MODEL)
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == b"zosoma-checkpoint"  # fixed-length text: no global heap
        assert f.attrs["format_version"] == 3
        assert f.attrs["metrics_records"] == 7 and f.attrs["metrics_sha256"] == b"ab" * 32
        assert sorted(f.keys()) == ["extra", "optimizer", "params"]  # the step records are in metrics.jsonl
        assert f.attrs["zosoma_version"].decode() == zosoma.__version__
        assert f.attrs["step"] == 7
        assert json.loads(f.attrs["config"])["ModelConfig"] == {"embed": 8, "hidden": 16, "layers": 2}
        stored_layout = json.loads(f["params/layout"][()].tobytes())
        assert stored_layout == [[e.name, list(e.shape), e.offset] for e in layout.entries]
        for e in layout.entries:  # one dataset per tensor, in zosoma's orientation
            ds = f["params"][e.name]
            assert ds.shape == e.shape and ds.attrs["offset"] == e.offset
            np.testing.assert_array_equal(ds[()], layout.view(ck.theta, e.name))


def test_empty_optimizer_and_numpy_scalars(tmp_path):
    path = tmp_path / "plain.h5"
    ck = make_checkpoint(step=0)
    ck.optimizer, ck.metrics_records = {}, np.int64(3)
    ck.extra = {"seed": np.int64(9), "loss": np.float32(2.5)}
    save_checkpoint(path, ck)
    got = load_checkpoint(path)
    assert got.optimizer == {} and got.step == 0
    assert got.metrics_records == 3 and got.extra == {"seed": 9, "loss": 2.5}


def test_overwrite_replaces_previous(saved):
    path, _ = saved
    save_checkpoint(path, make_checkpoint(step=8, seed=1))
    assert load_checkpoint(path).step == 8
    assert sorted(os.listdir(path.parent)) == ["ckpt.h5"]


def test_missing_file(tmp_path):
    assert_raises_naming(tmp_path / "absent.h5", match="does not exist")


def test_truncated_file(saved):
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert_raises_naming(path, match="damaged")


@pytest.mark.parametrize("where", [0.5, 0.3, 0.9])
def test_corrupted_bytes(saved, where):
    path, _ = saved
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    data[at:at + 16] = bytes(b ^ 0x5A for b in data[at:at + 16])
    path.write_bytes(bytes(data))
    assert_raises_naming(path, match="damaged")


def test_non_hdf5_file(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("this is not a checkpoint\n" * 100)
    assert_raises_naming(path, match="damaged")


def test_hdf5_without_format_attribute(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(4))
    assert_raises_naming(path, match="format")


def test_other_format(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:
        f.attrs["format"] = "keras"
    assert_raises_naming(path, match="keras")


def test_newer_format_version(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = np.int64(4)
    assert_raises_naming(path, match="written by a newer zosoma")


def test_format_version_1_files_are_still_read():
    """data/fixtures/checkpoint-v1.h5 was written by the previous zosoma (variable-length strings,
    layout and extra as attributes)."""
    got = load_checkpoint(FIXTURES / "checkpoint-v1.h5")
    assert got.step == 3 and got.model == ModelConfig(embed=4, hidden=6, layers=1)
    np.testing.assert_array_equal(got.theta, init_params(got.model, 5))
    assert got.optimizer["m"].tolist() == [0.5] * got.theta.size and got.extra == {"seed": 5}


def test_format_version_2_files_are_still_read():
    """data/fixtures/checkpoint-v2.h5 was written by zosoma before the step records left the
    checkpoint for metrics.jsonl (its /metrics dataset): they come back as stored_metrics."""
    got = load_checkpoint(FIXTURES / "checkpoint-v2.h5")
    assert got.step == 3 and got.model == ModelConfig(embed=4, hidden=6, layers=1)
    np.testing.assert_array_equal(got.theta, init_params(got.model, 5))
    assert got.optimizer["m"].tolist() == [0.5] * got.theta.size and got.extra == {"seed": 5}
    assert got.metrics_records == 3 and [r["loss"] for r in got.stored_metrics][:2] == [5.5, 5.25]
    assert description(FIXTURES / "checkpoint-v2.h5")["format_version"] == 2
    assert last_metrics(FIXTURES / "checkpoint-v2.h5")["step"] == 3  # what `zosoma info` shows of it


def test_changed_metrics_record_count_fails_checksum(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:
        f.attrs["metrics_records"] = np.int64(6)
    assert_raises_naming(path, match="checksum")


def test_shape_mismatch_between_config_and_tensors(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:  # tensors of hidden=16 under a config that says hidden=32
        config = json.loads(f.attrs["config"])
        config["ModelConfig"]["hidden"] = 32
        f.attrs["config"] = json.dumps(config)
    assert_raises_naming(path, match="shape mismatch")


def test_shape_mismatch_of_one_tensor(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:
        del f["params/out.b"]
        f["params"].create_dataset("out.b", data=np.zeros(255, np.float32)).attrs["offset"] = 0
    assert_raises_naming(path, match="'out.b' has shape (255,)")


def test_changed_value_fails_checksum(saved):
    path, _ = saved
    with h5py.File(path, "r+") as f:
        f["optimizer/v"][0] += 1
    assert_raises_naming(path, match="checksum")


@pytest.mark.parametrize("target", ["write", "fsync"])
def test_failed_write_keeps_previous_checkpoint(saved, monkeypatch, target):
    path, ck = saved
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if target == "write":  # the disk fills up midway through the file
        real, calls = os.write, []

        def flaky(fd, data):
            calls.append(1)
            return disk_full() if len(calls) == 2 else real(fd, data[:4096])

        monkeypatch.setattr(atomic.os, "write", flaky)
    else:  # fails after the temporary is complete, before the rename
        monkeypatch.setattr(atomic.os, "fsync", disk_full)
    with pytest.raises(WriteError, match="cannot write checkpoint .*ckpt.h5: No space left on device$"):
        save_checkpoint(path, make_checkpoint(step=99, seed=1))
    monkeypatch.undo()
    assert sorted(os.listdir(path.parent)) == ["ckpt.h5"]  # no temporary left behind
    assert path.read_bytes() == before
    assert load_checkpoint(path).step == ck.step


def test_interrupted_write_keeps_previous_checkpoint(saved, monkeypatch):
    path, _ = saved
    monkeypatch.setattr(atomic.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, make_checkpoint(step=99))
    monkeypatch.undo()
    assert sorted(os.listdir(path.parent)) == ["ckpt.h5"]
    assert load_checkpoint(path).step == 7


def test_bad_checkpoint_is_refused_before_touching_the_file(saved):
    path, _ = saved
    before = path.read_bytes()
    bad_theta = make_checkpoint()
    bad_theta.theta = bad_theta.theta[:-1]
    with pytest.raises(ValueError, match="theta"):
        save_checkpoint(path, bad_theta)
    for field, value in (("metrics_records", -1), ("metrics_sha256", "")):
        bad = make_checkpoint()
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=field):
            save_checkpoint(path, bad)
    not_json = make_checkpoint()
    not_json.extra = {"oops": object()}
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(path, not_json)
    assert path.read_bytes() == before
    assert sorted(os.listdir(path.parent)) == ["ckpt.h5"]


def test_unwritable_directory(tmp_path):
    target = tmp_path / "missing_dir" / "ckpt.h5"
    with pytest.raises(WriteError, match="missing_dir"):
        save_checkpoint(target, make_checkpoint())


def test_summary(saved):
    path, ck = saved
    text = summary(path, {"step": 7, "loss": float("nan")})
    n = Layout(MODEL).size
    assert n == MODEL.n_params() == 10112
    assert "step         7" in text
    assert f"{n} parameters" in text
    assert "lstm1.w_hh" in text and "(16, 64)" in text
    assert "zosoma-checkpoint v3" in text and zosoma.__version__ in text
    assert "m (10112,) float32" in text
    assert "7 records" in text and "NaN" in text  # the last record
    assert "cursor: [3, 1, 4]" in text


def test_summary_of_damaged_file(saved):
    path, _ = saved
    path.write_bytes(path.read_bytes()[:1000])
    assert_raises_naming(path, func=summary)


def test_exported_torch_model_matches_reference(saved, tmp_path):
    torch = pytest.importorskip("torch")
    from torch_reference import TorchByteLSTM
    from zosoma.formats.torch_state import export_torch

    path, _ = saved
    ck = make_checkpoint()
    ck.theta[:3] = 0.1  # finite values for the forward
    layout = Layout(MODEL)
    rng = np.random.default_rng(1)
    layout.view(ck.theta, "out.b")[:] = rng.normal(0, 0.5, 256)  # init leaves it zero; test the mapping
    save_checkpoint(path, ck)
    theta = load_checkpoint(path).theta

    export_torch(theta, layout, tmp_path / "m.pt")
    model = TorchByteLSTM(MODEL).to(torch.float32)
    model.load_state_dict(torch.load(tmp_path / "m.pt"), strict=True)
    tokens = rng.integers(0, 256, size=(3, 17), dtype=np.uint8)
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(tokens.astype(np.int64)))
    expected, _ = reference.forward(theta.astype(np.float64), layout, tokens)
    assert_close(logits.numpy(), expected, rtol=1e-4, atol=1e-5, name="torch logits")
