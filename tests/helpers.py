"""Shared test helpers: explicit tolerances that say where and by how much a check failed, and the
installed console script for subprocess tests."""

import sys
from pathlib import Path

import numpy as np


def assert_close(actual, reference, atol=0.0, rtol=1e-5, name="value"):
    """Assert |actual - reference| <= atol + rtol * |reference| elementwise; on failure report the
    max difference and the first mismatches (after llm.c's check_tensor)."""
    actual = np.asarray(actual, np.float64)
    reference = np.asarray(reference, np.float64)
    assert actual.shape == reference.shape, f"{name}: shape {actual.shape} != {reference.shape}"
    diff = np.abs(actual - reference)
    bad = diff > atol + rtol * np.abs(reference)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        firsts = ", ".join(f"{tuple(i)}: {actual[tuple(i)]:.7g} vs {reference[tuple(i)]:.7g}" for i in idx)
        raise AssertionError(f"{name}: {bad.sum()} of {bad.size} mismatches (atol={atol}, rtol={rtol}); "
                             f"max abs diff {diff.max():.3g}; first: {firsts}")


def zosoma_cmd() -> list[str]:
    """The installed console script, as a user runs it."""
    return [str(Path(sys.executable).parent / "zosoma")]


RAY_OPTIONS = dict(include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)


def start_ray():
    """Ray on this machine with 2 CPUs and a small object store, quiet (tests' session cluster)."""
    import logging

    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, logging_level=logging.ERROR, **RAY_OPTIONS)
    return ray


def one_line_error(result, code=None):
    """The last line of a failed CliRunner result, checked to be an error without a traceback
    (exit code `code` if given, else any non-zero)."""
    assert result.exit_code != 0 if code is None else result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return [x for x in result.output.strip().splitlines() if x.strip()][-1]


def run_cli(args):
    """zosoma's command line in this process; an unexpected exception propagates."""
    from click.testing import CliRunner
    from zosoma.cli.main import cli
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def cli_json(args, kind):
    """The object `zosoma ARGS --json` prints, checked to succeed and to carry schema zosoma.KIND/1."""
    import json
    result = run_cli([*args, "--json"])
    assert result.exit_code == 0, result.output
    obj = json.loads(result.output)
    assert obj["schema"] == f"zosoma.{kind}/1", obj["schema"]
    return obj


def scaled_model(embed, hidden, layers, seed=0, scale=3.0):
    """float32 parameters of a model, the default initialisation times `scale` (gates saturate,
    predictions far from uniform: a harder test than the initialisation), and its Layout."""
    from zosoma.config import ModelConfig
    from zosoma.model.params import Layout, init_params
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, seed) * scale).astype(np.float32), layout


def random_bytes(seed, shape):
    """uint8 bytes uniform over the vocabulary, seeded."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def streamed_in_halves(nll_stream, theta, layout, tokens, targets, cut=10):
    """An engine's `nll_stream` over tokens and targets (B, T) in one pass, then in two: the first
    `cut` steps, and the rest carrying on from the state they leave. Returns the whole pass's nll
    (B, T) and final state, the first half's nll and state, the second half's nll and final state."""
    whole, state_whole = nll_stream(theta, layout, tokens, targets)
    first, state = nll_stream(theta, layout, tokens[:, :cut], targets[:, :cut])
    second, state_halves = nll_stream(theta, layout, tokens[:, cut:], targets[:, cut:], state)
    return whole, state_whole, first, state, second, state_halves


def on_a_tmpfs(tmp_path, argv, options, seed=None):
    """Run argv with tmp_path/disk a tmpfs mounted with `options` ("size=160k"; "ro" remounts it
    read-only once `seed`'s contents are copied onto it), in a user namespace (`unshare -rm`) or as
    root; what the disk holds afterwards is copied to tmp_path/copy. None where no tmpfs can be had."""
    import subprocess
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir(parents=True, exist_ok=True)
    opts = options.split(",")
    fill = f"cp -a {seed}/. {disk}/ && " if seed else ""
    remount = f"mount -o remount,ro {disk} && " if "ro" in opts else ""
    script = (f'mount -t tmpfs -o {",".join(o for o in opts if o != "ro") or "size=1m"} tmpfs {disk} 2>/dev/null '
              f'|| exit 99; {fill}{remount}"$@"; rc=$?; cp -a {disk} {copy}; umount {disk}; exit $rc')
    for prefix in (["unshare", "-rm", "sh", "-c", script, "sh"], ["sh", "-c", script, "sh"]):
        try:
            proc = subprocess.run(prefix + [str(a) for a in argv], capture_output=True, text=True, timeout=300)
        except FileNotFoundError:  # no unshare
            continue
        if proc.returncode != 99:
            return proc
    return None


def on_a_full_disk(tmp_path, argv, size: int, file_limit: int, seed=None):
    """(process, folder holding what the disk held): argv run with tmp_path/disk a tmpfs of `size`
    bytes holding a copy of `seed`'s contents; where no tmpfs can be had, the same failure through
    RLIMIT_FSIZE (EFBIG once a file grows past `file_limit`) in tmp_path/disk itself."""
    import resource
    import shutil
    import subprocess
    proc = on_a_tmpfs(tmp_path, argv, f"size={size}", seed)
    if proc is not None:
        return proc, tmp_path / "copy"
    if seed:
        shutil.copytree(seed, tmp_path / "disk", dirs_exist_ok=True)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))  # noqa: E731
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, preexec_fn=limit,
                          timeout=300), tmp_path / "disk"


def error_line(proc):
    """The one line a failed subprocess printed on stderr, checked to have no traceback."""
    assert proc.returncode not in (0, None), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def on_a_read_only_disk(tmp_path, argv, seed=None):
    """(process, folder holding what the disk held): argv run with tmp_path/disk read-only, holding
    a copy of `seed`'s contents: a tmpfs remounted read-only, or where none can be had its folders
    made 0o555 (skipped as root, who writes there anyway)."""
    import os
    import shutil
    import subprocess

    import pytest
    proc = on_a_tmpfs(tmp_path, argv, "size=4m,ro", seed)
    if proc is not None:
        return proc, tmp_path / "copy"
    if os.geteuid() == 0:
        pytest.skip("no tmpfs to mount read-only, and root writes into a 0o555 folder")
    disk = tmp_path / "disk"
    if seed:
        shutil.copytree(seed, disk, dirs_exist_ok=True)
    folders = [disk, *(p for p in disk.rglob("*") if p.is_dir())]
    for p in folders:
        p.chmod(0o555)
    try:
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300), disk
    finally:
        for p in folders:
            p.chmod(0o755)


def snapshot(folder) -> dict:
    """Every entry under `folder`: a file's sha256, or "folder"."""
    import hashlib
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(Path(folder).rglob("*"))}


def users_files(folder) -> dict:
    """A file and a folder of the user's in `folder` (made if missing); returns their snapshot."""
    folder = Path(folder)
    (folder / "mine" / "deeper").mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("the user's notes")
    (folder / "mine" / "data.bin").write_bytes(np.random.default_rng(0).bytes(1000))
    (folder / "mine" / "deeper" / "forward.npz").write_bytes(b"the user's, not the kit's")
    return snapshot(folder)


def mixed_members(pop, extra: int = 0):
    """pop (a Population) with a member table mixing what a strategy may build: antithetic pairs
    with either sign first, one direction twice with one sign, and pairs of two directions with a
    minus-signed member; D = P + 1 + extra directions (direction P is every fourth pair's second;
    `extra` directions no member measures)."""
    dirs, signs = [], []
    for k in range(pop.P):
        dirs += [k, k] if k % 4 < 3 else [k, pop.P]
        signs += [(1, -1), (-1, 1), (1, 1), (-1, 1)][k % 4]
    return pop.with_members(dirs, signs, pop.P + 1 + extra)
