"""The porting kit and its standalone checker (zosoma.porting): the kit folder, the checker's
verdicts (a perturbed output, NaN, damaged files) and the command. tests/test_porting_stages.py
checks the stages themselves: zosoma's own code passes each, a wrong reading of each convention
fails it."""

import ast
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import (error_line, on_a_full_disk, on_a_read_only_disk, one_line_error, snapshot, users_files,
                     zosoma_cmd)
from zosoma.cli.main import cli
from zosoma.config import ModelConfig
from zosoma.errors import OptionError
from zosoma.model.noise import philox4x32_10, stream_key
from zosoma.porting import check_port
from zosoma.porting.kit import STAGES, write_kit

pytest.importorskip("onnx", reason="the kit writes its model as ONNX (the onnx extra)")


def _load(kit, name):
    with np.load(kit / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def test_the_checker_imports_nothing_of_zosoma():
    source = Path(check_port.__file__).read_text()
    modules = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(ast.parse(source))
               if isinstance(n, (ast.Import, ast.ImportFrom)) for a in (n.names if isinstance(n, ast.Import) else [n])]
    assert not [m for m in modules if m and m.startswith("zosoma")], modules


@pytest.mark.subprocess
def test_the_kit_accepts_its_own_outputs(kit):
    result = subprocess.run([sys.executable, str(kit / "check_port.py"), str(kit), str(kit), "--strict"],
                            capture_output=True, text=True, cwd=kit.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed, 0 skipped: PASS" in result.stdout


def _box_muller32(a, b):
    """The Gaussian pair of Philox words (a, b) computed in float32 throughout."""
    u1 = (np.float32(a) + np.float32(0.5)) * np.float32(2.0 ** -32)
    u2 = (np.float32(b) + np.float32(0.5)) * np.float32(2.0 ** -32)
    r = np.sqrt(np.float32(-2) * np.log(u1))
    return r * np.cos(np.float32(2 * np.pi) * u2), r * np.sin(np.float32(2 * np.pi) * u2)


def test_a_float32_box_muller_needs_the_gaussian_tolerance(kit):
    """A float32 Box-Muller passes the kit; its worst case, a first word whose u1 rounds to 1 in
    float32, needs most of the Gaussian tolerance (5e-4)."""
    f = _load(kit, "noise")
    got = []
    for s, e, t, m in zip(f["seed"], f["expert"], f["step"], f["member"]):
        words = np.array([philox4x32_10(b, int(m), int(t), int(e), *stream_key(int(s))) for b in range(75)],
                         np.uint32)
        pairs = [_box_muller32(w[2 * p], w[2 * p + 1]) for w in words for p in range(2)]
        got.append(np.array(pairs, np.float32).reshape(-1)[:int(f["length"])])
    assert np.abs(np.stack(got) - f["gaussian"]).max() < 1e-5  # typical words: a few float32 ulps
    a = 2**32 - 128  # (a + 0.5) rounds to 2^32 in float32: u1 = 1, r = 0 instead of 2.4e-4
    r64 = np.sqrt(-2 * np.log((a + 0.5) * 2.0 ** -32))
    worst = abs(float(_box_muller32(a, 0)[0]) - r64)
    assert 2e-4 < worst < 5e-4


def _port_of_losses(kit, tmp_path, change):
    """A port folder holding the kit's losses with nll[1, 3] replaced by `change` of it; the folder,
    the kit's losses and the port's nll."""
    port = tmp_path / "port"
    port.mkdir()
    losses = _load(kit, "losses")
    nll = losses["nll"].copy()
    nll[1, 3] = change(nll[1, 3])
    np.savez(port / "losses.npz", nll=nll, loss=losses["loss"])
    return port, losses, nll


@pytest.mark.subprocess
def test_a_perturbed_output_is_rejected(kit, tmp_path):
    port = _port_of_losses(kit, tmp_path, lambda x: x + 1e-3)[0]
    noise_out = _load(kit, "noise")
    rad = noise_out["rademacher"].copy()
    rad[2, 200] *= -1
    np.savez(port / "noise.npz", philox=noise_out["philox"], rademacher=rad, gaussian=noise_out["gaussian"])
    result = subprocess.run([sys.executable, str(kit / "check_port.py"), str(kit), str(port)],
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stdout
    assert "[FAIL] nll: 1 of 96 mismatches" in result.stdout and "(1, 3)" in result.stdout
    assert "[FAIL] rademacher: 1 of 1200 differ" in result.stdout and "(2, 200)" in result.stdout
    assert "[ok] loss" in result.stdout and "[skip] forward" in result.stdout


def test_nothing_checked_and_a_foreign_folder(kit, tmp_path):
    assert check_port.check(kit, tmp_path) == 1  # the port wrote nothing: not a pass
    assert check_port.check(tmp_path, tmp_path) == 2


def test_porting_kit_command(tmp_path):
    out = tmp_path / "kit"
    result = CliRunner().invoke(cli, ["porting-kit", str(out), "--embed", "8", "--hidden", "8", "--layers", "1"])
    assert result.exit_code == 0 and "check_port.py" in result.output, result.output
    assert json.loads((out / "manifest.json").read_text())["model"]["parameters"] == 2048 + 544 + 2048 + 256
    again = CliRunner().invoke(cli, ["porting-kit", str(out)])
    assert again.exit_code == 1
    assert again.output.strip().endswith("exists; pass --force to replace the files zosoma wrote there")


def test_strict_does_not_ask_for_the_optional_approx_stage(kit, tmp_path):
    """approx is for devices with approximate activations: a port that does not write it passes
    --strict; one that writes it is checked."""
    port = tmp_path / "port"
    port.mkdir()
    for stage in STAGES:
        if stage != "approx":
            shutil.copy(kit / f"{stage}.npz", port)
    out = io.StringIO()
    assert check_port.check(kit, port, strict=True, out=out) == 0, out.getvalue()
    assert "[skip] approx:" in out.getvalue() and "(optional: for a device whose sigmoid" in out.getvalue()
    shutil.copy(kit / "approx.npz", port)
    assert check_port.check(kit, port, strict=True, out=io.StringIO(), stages=["approx"]) == 0


def test_the_training_graph_gives_the_losses_stages_figures(kit):
    """train_model.onnx (theta an input) fed the losses stage's theta and batch gives that stage's
    nll and loss within its tolerances, as the manifest says."""
    ort = pytest.importorskip("onnxruntime", reason="ONNX Runtime is in the onnx extra")
    manifest = json.loads((kit / "manifest.json").read_text())
    assert "train_model.onnx" in manifest["files"] and "losses.npz" in manifest["graphs"]["train_model.onnx"]["check"]
    f, m = _load(kit, "losses"), manifest["model"]
    batch = f["batch"].astype(np.int64)
    zeros = np.zeros((m["layers"], batch.shape[0], m["hidden"]), np.float32)
    session = ort.InferenceSession(str(kit / "train_model.onnx"), providers=["CPUExecutionProvider"])
    nll, loss, _, _ = session.run(None, {"theta": f["theta"], "tokens": batch[:, :-1], "targets": batch[:, 1:],
                                         "h0": zeros, "c0": zeros})
    tol = next(s for s in manifest["stages"] if s["name"] == "losses")["outputs"]
    assert np.abs(nll - f["nll"]).max() <= tol["nll"]["atol"] / 5
    assert abs(float(loss) - float(f["loss"])) <= tol["loss"]["atol"] / 5


def test_the_kit_has_a_readme_and_the_default_runs_batches(kit):
    """README.md names every stage and file; default_run_batches.npz holds the default run's
    3,100 x 8 windows on stream 0 and a first restart's, as zosoma's sampler draws them."""
    from zosoma.corpus import BatchSampler, load_corpus
    manifest = json.loads((kit / "manifest.json").read_text())
    readme = (kit / "README.md").read_text()
    assert all(f"`{s}.npz`" in readme for s in STAGES) and "check_port.py" in readme
    assert {"README.md", "default_run_batches.npz"} <= set(manifest["files"]) and "skipped" not in manifest
    f = _load(kit, "default_run_batches")
    assert f["batch_doc"].shape == f["batch_start"].shape == (2, 3100, 8) and list(f["streams"]) == [0, 65536]
    sampler = BatchSampler(load_corpus(None, split="train"), int(f["T"]) + 1)
    for row, s in enumerate(f["streams"]):
        for t in (0, 1234, 3099):
            doc, start = sampler.positions(0, int(s), t, 8)
            assert np.array_equal(doc, f["batch_doc"][row, t]) and np.array_equal(start, f["batch_start"][row, t])


def test_without_onnx_the_kit_is_written_but_the_graphs_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    out = tmp_path / "kit"
    result = kit_cli(out)
    assert result.exit_code == 0, result.output
    assert ("skipped model.onnx, train_model.onnx: the onnx package is not installed (pip install 'zosoma[onnx]')"
            in result.output), result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} and "model.onnx" not in manifest["files"]
    assert len(manifest["skipped"]) == 1 and "Not written here" in (out / "README.md").read_text()
    assert check_port.check(out, out, strict=True) == 0  # every stage is there


# --- the checker's verdicts: NaN never passes, damaged files are one line -----------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_from_the_port_fails_at_any_tolerance(bad):
    ok, line = check_port.compare("x", np.array([1.0, bad]), np.array([1.0, 2.0]), atol=np.inf, rtol=np.inf)
    assert not ok
    assert f"max |diff| inf (1 NaN or inf from the port where the kit's is finite); first: (1,): port {bad} vs kit 2" \
        in line
    assert check_port.compare("x", np.array([1.0, np.inf]), np.array([1.0, np.inf]), 0, 0)[0]  # the kit's own inf


@pytest.mark.subprocess
def test_a_nan_in_the_port_is_reported_with_its_sides(kit, tmp_path):
    port, losses, nll = _port_of_losses(kit, tmp_path, lambda x: np.nan)
    result = subprocess.run([sys.executable, str(kit / "check_port.py"), str(kit), str(port)],
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stdout
    want = f"[FAIL] nll: 1 of 96 mismatches (atol 0.0001, rtol 1e-05); max |diff| inf (1 NaN or inf from the port " \
           f"where the kit's is finite); first: (1, 3): port nan vs kit {losses['nll'][1, 3]:.9g}"
    assert want in result.stdout
    ok, line = check_port.compare("nll", nll[:, :3], losses["nll"], 1e-4, 1e-5)
    assert not ok and line == "nll: shape (4, 3) from the port, (4, 24) in the kit"


def _damage(path: Path, how: str, member: str) -> None:
    """Cut an .npz in half, or flip one bit inside the bytes of one of its arrays."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
        return
    with zipfile.ZipFile(path) as z:
        at = z.getinfo(f"{member}.npy").header_offset
    name, extra = (int.from_bytes(data[at + k:at + k + 2], "little") for k in (26, 28))  # the local header
    data[at + 30 + name + extra + 200] ^= 0x10  # past the .npy header: only the CRC-32 can tell
    path.write_bytes(bytes(data))


@pytest.mark.subprocess
@pytest.mark.parametrize("side", ["kit", "port"])
@pytest.mark.parametrize("how", ["truncated", "bit flip"])
def test_a_damaged_npz_is_one_line(kit, tmp_path, side, how):
    copy, port = tmp_path / "kit", tmp_path / "port"
    shutil.copytree(kit, copy)
    port.mkdir()
    for name in ("forward.npz", "losses.npz"):
        shutil.copy(kit / name, port / name)
    damaged = (copy if side == "kit" else port) / "forward.npz"
    _damage(damaged, how, "theta" if side == "kit" else "logits")  # the kit's inputs count too
    result = subprocess.run([sys.executable, str(copy / "check_port.py"), str(copy), str(port)],
                            capture_output=True, text=True)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    if side == "kit":
        assert result.returncode == 2
        (line,) = result.stdout.strip().splitlines()
        assert line.startswith(f"error: {damaged} is damaged (")
        assert line.endswith("the kit cannot be used (write it again with `zosoma porting-kit`)")
    else:
        assert result.returncode == 1
        assert f"[FAIL] forward: {damaged} is damaged (" in result.stdout
        assert "[ok] nll" in result.stdout and result.stdout.strip().endswith(f"1 failed, {len(STAGES) - 2} skipped: FAIL")


# --- --force replaces the kit and nothing else; failures leave the folder as it was -------------------

SMALL = ["--embed", "8", "--hidden", "8", "--layers", "1"]


def kit_cli(out, *extra):
    return CliRunner().invoke(cli, ["porting-kit", str(out), *SMALL, *extra])


def leftovers(*folders) -> list[str]:
    """Temporary entries (zosoma's are hidden: .NAME.tmp-PID, .NAME.old-PID) in `folders`."""
    return sorted(str(p) for f in folders if f.is_dir() for p in f.iterdir() if p.name.startswith("."))


def test_force_replaces_the_kit_and_nothing_else(tmp_path):
    out = tmp_path / "kit"
    users = users_files(out)
    assert one_line_error(kit_cli(out)).endswith("exists; pass --force to replace the files zosoma wrote there")
    result = kit_cli(out, "--force")
    assert result.exit_code == 0, result.output
    assert users.items() <= snapshot(out).items()  # every one of the user's files, byte for byte
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"notes.txt", "mine"}
    forward, kit_files = (out / "forward.npz").read_bytes(), list(manifest["files"])
    (out / "retired.npz").write_bytes(b"an earlier kit's file this one no longer writes")
    (tmp_path / "outside.txt").write_text("the user's")
    manifest["files"] += ["retired.npz", "mine", "../outside.txt", "/etc/hostname"]  # only plain files of its own
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = kit_cli(out, "--force", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["seed"] == 1
    assert (out / "forward.npz").read_bytes() != forward
    assert set(snapshot(out)) == set(users) | set(kit_files)  # retired.npz gone, nothing temporary left
    assert users.items() <= snapshot(out).items() and (tmp_path / "outside.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kit", "outside.txt"]


def test_a_run_folder_is_refused_force_or_not(tmp_path):
    """A kit is never written into a run folder (as export refuses them): --force replaces a kit's
    files, never a run's."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.h5").write_bytes(b"a run's checkpoint")
    before = snapshot(run)
    for extra in ((), ("--force",)):
        assert one_line_error(kit_cli(run, *extra), 1) == (f"Error: {run} is a run folder: write the porting kit "
                                                           "elsewhere; nothing was changed")
    assert snapshot(run) == before and leftovers(tmp_path, run) == []


@pytest.mark.parametrize("option, value", [("--hidden", "100000"), ("--embed", "100000"),
                                           ("--layers", "1000000000000"), ("--seed", str(2**63))])
def test_a_kit_too_large_or_a_seed_out_of_range_is_one_line(tmp_path, option, value):
    """Refused before anything is written, in one line with exit code 2 (a bad option), and the
    Python API refuses it in the same words (a 40-line MemoryError before)."""
    out = tmp_path / "kit"
    line = one_line_error(kit_cli(out, option, value), 2)
    assert ("a kit takes at most 1,000,000" in line and "lower --hidden, --embed or --layers" in line
            if option != "--seed" else line == f"Error: --seed must be an integer in [0, 2^63), got {2**63}")
    sizes = {"embed": 8, "hidden": 8, "layers": 1, **({option[2:]: int(value)} if option != "--seed" else {})}
    with pytest.raises(OptionError) as err:
        write_kit(out, ModelConfig(**sizes), int(value) if option == "--seed" else 0)
    assert line == f"Error: {err.value}"
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_users_file_with_a_kit_name_stops_it(tmp_path):
    out = tmp_path / "kit"
    users_files(out)
    (out / "forward.npz").write_bytes(b"the user's")
    before = snapshot(out)
    assert one_line_error(kit_cli(out, "--force")) == (f"Error: {out / 'forward.npz'} was not written by zosoma; "
                                                       "nothing was changed (move it away, or choose another folder)")
    assert snapshot(out) == before
    (out / "forward.npz").unlink()
    (out / "manifest.json").write_text(json.dumps({"format": "someone else's", "files": ["notes.txt"]}))
    before = snapshot(out)
    assert "manifest.json was not written by zosoma" in one_line_error(kit_cli(out, "--force"))
    assert snapshot(out) == before
    (tmp_path / "file").write_text("x")
    assert one_line_error(kit_cli(tmp_path / "file", "--force")).endswith("is a file.")
    assert leftovers(tmp_path, out) == []


@pytest.mark.parametrize("when", ["building", "moving in"])
def test_a_failure_half_way_leaves_the_old_kit(tmp_path, monkeypatch, when):
    out = tmp_path / "kit"
    users_files(out)
    assert kit_cli(out, "--force").exit_code == 0
    before = snapshot(out)
    if when == "building":
        from zosoma.porting import kit_files  # the graphs are written after every stage's vectors
        monkeypatch.setattr(kit_files, "save_model", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    else:  # the third file renamed into the folder fails (Ctrl-C); the renames putting things back work
        rename, calls = os.rename, []

        def flaky(src, dst):
            if Path(dst).parent == out or Path(dst) == out:
                calls.append(dst)
                if len(calls) == 3:
                    raise KeyboardInterrupt
            rename(src, dst)
        monkeypatch.setattr(os, "rename", flaky)
    result = kit_cli(out, "--force", "--seed", "1")
    assert result.exit_code == 130 and "aborted" in result.output  # 128 + SIGINT, as a Ctrl-C
    assert snapshot(out) == before  # the old kit and the user's files, as they were
    assert leftovers(tmp_path, out) == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_full_disk_is_one_line_and_leaves_the_old_kit_or_nothing(tmp_path):
    seed = tmp_path / "seed"
    users_files(seed / "kit")
    assert kit_cli(seed / "kit", "--force").exit_code == 0
    held = sum(p.stat().st_size for p in (seed / "kit").iterdir() if p.is_file())  # about 1.3 MB
    # room for the old kit and half a new one; a new kit into a disk of an eighth of one
    for case, size, extra in (("replace", held * 3 // 2, ["--force", "--seed", "1"]), ("new", held // 8, [])):
        root = tmp_path / case
        target = root / "disk" / "kit"
        proc, disk = on_a_full_disk(root, zosoma_cmd() + ["porting-kit", target, *SMALL, *extra], size, 60_000,
                                    seed if case == "replace" else None)
        line = error_line(proc)
        assert line.startswith(f"Error: cannot write porting kit {target}: ")
        assert line.endswith(("No space left on device", "File too large"))
        if case == "replace":
            assert snapshot(disk / "kit") == snapshot(seed / "kit") and leftovers(disk, disk / "kit") == []
        else:
            assert list(disk.iterdir()) == []  # no .kit.tmp, no half a kit


@pytest.mark.subprocess
def test_a_read_only_folder_is_one_line(tmp_path):
    seed = tmp_path / "seed"
    users_files(seed / "kit")
    assert kit_cli(seed / "kit", "--force").exit_code == 0
    for case, name, extra in (("new", "fresh", []), ("replace", "kit", ["--force"])):
        root = tmp_path / case
        target = root / "disk" / name
        proc, disk = on_a_read_only_disk(root, zosoma_cmd() + ["porting-kit", target, *SMALL, *extra], seed)
        line = error_line(proc)
        assert line.startswith(f"Error: cannot write porting kit {target}: ")
        assert line.endswith(("Read-only file system", "Permission denied"))
        assert snapshot(disk) == snapshot(seed)
