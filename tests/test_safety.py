"""A run folder is sacred: one writer, never overwritten, never silently replaced; faults end in one
line and a resumable run. Real subprocesses and signals where the fault is a process's."""

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import zosoma_cmd
from world import TINY_MODEL, tiny_args
from zosoma import atomic
from zosoma.cli.main import cli
from zosoma.errors import ConfigError, WriteError
from zosoma.training.folder import CHECKPOINT, LOCK, METRICS, NEXT, PREVIOUS, RunFolder
from zosoma.training.folder_lock import RunInUse

TINY = tiny_args(4, 2, lr=0.05)


pytestmark = pytest.mark.usefixtures("scratch_cwd")

def invoke(args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def last_line(result, code=1):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output.strip().splitlines()[-1]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train_args(text, run_dir, steps, *extra):
    return ["train", "--data", text, "--heldout", text, "--run-dir", run_dir, "--steps", steps, *TINY, *extra]


def steps_logged(folder: Path) -> list[int]:
    """The steps a live run has logged: its last line may be half written, so only whole lines count."""
    lines = (folder / METRICS).read_text().split("\n")[:-1]
    return [json.loads(line)["step"] for line in lines]


def wait_for(predicate, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(params=[False, True], ids=["single", "soma"])
def soma(request) -> bool:
    """Each test taking it runs as a single model and as a SOMA run."""
    return request.param


def soma_or_single(run: Path, soma: bool, *options) -> tuple[list, list[Path]]:
    """The training options that make `run` SOMA with two experts (and `options`), or none; and
    the folders that then train."""
    if soma:
        return ["--experts", "2", "--chunk-size", "256", *options], [run / f"expert{i}" for i in range(2)]
    return [], [run]


def sigterm_once_logged(args, folders):
    """Run zosoma `args` in a session of its own until each of `folders` has logged more than 20
    steps, then SIGTERM the session, as SLURM and systemd do: every process of the job. Its exit
    code, stdout and stderr."""
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert wait_for(lambda: all((f / METRICS).exists() and len(steps_logged(f)) > 20 for f in folders))
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


# --- 1. workers never outlive their parent ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_a_soma_run_kills_its_workers_and_the_resume_has_one_writer(text, tmp_path, sig):
    run = tmp_path / "soma"
    args = train_args(text, run, 100000, "--experts", "2", "--workers", "2", "--chunk-size", "256",
                      "--checkpoint-every", "50")
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    logged = lambda i, n: (run / f"expert{i}" / METRICS).exists() and len(steps_logged(run / f"expert{i}")) > n
    assert wait_for(lambda: logged(0, 20) and logged(1, 20))
    workers = [p for p in children(proc.pid) if "resource_tracker import main" not in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) >= 2
    proc.send_signal(sig)  # the parent only
    proc.wait(timeout=30)
    # resumed at once, while the old workers may still be alive: each expert folder waits for its lock
    resume = subprocess.Popen(zosoma_cmd() + ["train", "--resume", str(run)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: not any(alive(p) for p in workers), timeout=10), "workers outlived their parent"
    marks = [len(steps_logged(run / f"expert{i}")) for i in range(2)]
    assert wait_for(lambda: logged(0, marks[0] + 20) and logged(1, marks[1] + 20))
    resume.send_signal(signal.SIGINT)
    assert resume.wait(timeout=60) == 130, resume.stderr.read()
    for i in range(2):  # one writer per folder: every step once, in order
        steps = steps_logged(run / f"expert{i}")
        assert steps == list(range(1, len(steps) + 1))


# --- 2. a folder that holds anything is never written into by a new run -----------------------------

@pytest.mark.slow
def test_run_dir_that_holds_anything_is_refused_and_left_untouched(text, tmp_path):
    soma = tmp_path / "soma"
    assert invoke(train_args(text, soma, 2, "--experts", "2", "--chunk-size", "256")).exit_code == 0
    only_backups = tmp_path / "backups"
    assert invoke(train_args(text, only_backups, 6, "--checkpoint-every", "3")).exit_code == 0
    (only_backups / CHECKPOINT).rename(only_backups / NEXT)
    (only_backups / METRICS).unlink()
    (only_backups / "results.json").unlink()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for folder, words in ((soma, "already holds a run"), (only_backups, "already holds a run"),
                          (other, "is not empty (notes.txt)")):
        before = snapshot(folder)
        line = last_line(invoke(train_args(text, folder, 2)))
        assert words in line and "nothing in it was changed" in line
        assert snapshot(folder) == before


# --- 3. a damaged checkpoint is said, set aside, never silently used -------------------------------

def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 3]))
    elif how == "bit flip":  # inside a tensor's values: only the checksum notices
        import h5py
        with h5py.File(path, "r") as f:
            at = f["params/out.w"].id.get_offset() + 10
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "bit flip", "garbage", "empty"])
def test_a_damaged_latest_checkpoint_is_said_and_set_aside(text, tmp_path, how):
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert invoke(train_args(text, whole, 12, "--checkpoint-every", "4")).exit_code == 0
    assert invoke(train_args(text, run, 12, "--checkpoint-every", "4")).exit_code == 0
    damage(run / CHECKPOINT, how)
    damaged = (run / CHECKPOINT).read_bytes()
    for args in (["eval", run, "--data", text], ["info", run], ["export", run, "--out", tmp_path / "x.pt"]):
        line = last_line(invoke(args))
        assert "checkpoint.h5 is damaged" in line and "checkpoint.prev.h5 (step 8) is intact: pass --previous" in line
    result = invoke(["eval", run, "--data", text, "--previous"])
    assert result.exit_code == 0 and "warning: " in result.output and "using" in result.output
    result = invoke(["train", "--resume", run])
    assert result.exit_code == 0, result.output
    assert "warning: " in result.output and "checkpoint.h5 is damaged" in result.output
    aside = list(run.glob("checkpoint.damaged-*.h5"))
    assert len(aside) == 1 and aside[0].read_bytes() == damaged  # kept, never rotated over the good one
    a, b = RunFolder(whole).read_checkpoint(), RunFolder(run).read_checkpoint()
    assert a.step == b.step == 12 and np.array_equal(a.theta, b.theta)  # steps 9-12 redone exactly
    assert steps_logged(run) == list(range(1, 13))


def test_a_damaged_metrics_log_is_said_in_one_line_and_set_aside(text, tmp_path):
    run = tmp_path / "run"
    assert invoke(train_args(text, run, 12, "--checkpoint-every", "4")).exit_code == 0
    last = json.loads(invoke(["info", run, "--json"]).stdout)["last_metrics"]
    assert last == json.loads((run / METRICS).read_text().splitlines()[-1])  # read from the log
    lines = (run / METRICS).read_text().splitlines(keepends=True)
    (run / METRICS).write_text("".join(lines[:5]))  # cut short: the checkpoint counts 12 records
    info = invoke(["info", run, "--json"])
    assert info.exit_code == 0 and json.loads(info.stdout)["last_metrics"] is None
    assert "warning: " in info.stderr and "does not hold the 12 records" in info.stderr
    result = invoke(["train", "--resume", run, "--steps", "14"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if METRICS in line]
    assert len(said) == 1 and said[0].startswith("warning: ") and "does not hold the 12 records" in said[0], said
    assert [p.read_text() for p in run.glob("metrics.damaged-*.jsonl")] == ["".join(lines[:5])]
    assert steps_logged(run) == [13, 14]  # the log begins anew at the checkpoint


def test_a_soma_run_with_a_damaged_expert_checkpoint(text, tmp_path):
    run = tmp_path / "soma"
    assert invoke(train_args(text, run, 6, "--experts", "2", "--chunk-size", "256", "--checkpoint-every", "3",
                             "--workers", "1")).exit_code == 0
    damage(run / "expert1" / CHECKPOINT, "truncated")
    for args in (["info", run], ["eval", run, "--data", text], ["sample", run, "--bytes", "5"]):
        line = last_line(invoke(args))
        assert "expert1" in line and "pass --previous" in line
    assert invoke(["sample", run, "--bytes", "5", "--previous"]).exit_code == 0


# --- 4. a full disk ends in one line and a resumable run --------------------------------------------

def on_a_small_disk(tmp_path, argv, size="160k"):
    """Run argv with tmp_path/disk a tmpfs of `size` (mounted as root, or in a user namespace with
    `unshare -rm`), copying what it holds to tmp_path/copy afterwards. None where neither works."""
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    script = (f'mount -t tmpfs -o size={size} tmpfs {disk} 2>/dev/null || exit 99; "$@"; rc=$?; '
              f'cp -r {disk} {copy}; umount {disk}; exit $rc')
    for prefix in (["sh", "-c", script, "sh"], ["unshare", "-rm", "sh", "-c", script, "sh"]):
        try:
            proc = subprocess.run(prefix + argv, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:  # no unshare
            continue
        if proc.returncode != 99:
            return proc
    return None


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("checkpoint_every", ["10", "100000"])  # the checkpoint / the metrics append fills it
def test_a_full_disk_is_one_line_and_the_run_resumes(text, tmp_path, checkpoint_every):
    args = [str(a) for a in train_args(text, tmp_path / "disk" / "run", 3000, "--checkpoint-every", checkpoint_every)]
    proc = on_a_small_disk(tmp_path, zosoma_cmd() + args)
    folder = tmp_path / "copy" / "run"
    if proc is None:  # no tmpfs to be had: the same failure through RLIMIT_FSIZE (EFBIG)
        limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))  # noqa: E731
        proc = subprocess.run(zosoma_cmd() + args, capture_output=True, text=True, preexec_fn=limit, timeout=300)
        folder = tmp_path / "disk" / "run"
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: cannot write ") and line.endswith(("No space left on device", "File too large"))
    assert (folder / METRICS).read_bytes().endswith(b"\n")  # whole lines or nothing
    assert all(json.loads(x) for x in (folder / METRICS).read_text().splitlines())
    roomy = tmp_path / "roomy"
    shutil.copytree(folder, roomy)
    resumed = invoke(["train", "--resume", roomy])
    assert resumed.exit_code == 0, resumed.output
    assert steps_logged(roomy) == list(range(1, 3001))


def test_a_failed_append_leaves_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    atomic.append_line(path, '{"step": 1}')
    write = os.write
    monkeypatch.setattr(atomic.os, "write", lambda fd, data: write(fd, data[:5]))  # a disk that fills up
    with pytest.raises(WriteError, match="cannot write log .*: No space left on device$"):
        atomic.append_line(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}\n'


# --- 5. one writer per folder -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.subprocess
def test_two_trainers_on_one_folder(text, tmp_path):
    run = tmp_path / "run"
    args = [str(a) for a in train_args(text, run, 100000)]
    procs = [subprocess.Popen(zosoma_cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    assert wait_for(lambda: any(p.poll() is not None for p in procs), timeout=120)
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    err = loser.stderr.read()
    assert loser.returncode == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("Error: ")
    assert "in use by pid" in err or "already holds a run" in err
    assert wait_for(lambda: (run / CHECKPOINT).exists())
    line = last_line(invoke(["train", "--resume", run]))  # a live owner: refused in one line
    assert f"in use by pid {winner.pid} on " in line
    winner.send_signal(signal.SIGINT)
    assert winner.wait(timeout=60) == 130
    with RunFolder(run).lock():  # the owner is gone: the lock is free (a dead owner's too)
        with pytest.raises(RunInUse, match="in use by pid"):
            with RunFolder(run).lock():
                pass


@pytest.mark.subprocess
def test_a_dead_owners_lock_is_taken_over(tmp_path):
    folder = RunFolder(tmp_path / "run")
    code = f"from zosoma.training.folder import RunFolder; import os; RunFolder({str(folder.path)!r}).lock().__enter__(); os._exit(0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert "pid" in (folder.path / LOCK).read_text()  # left behind by the dead process
    with folder.lock():
        assert f"pid {os.getpid()}" in (folder.path / LOCK).read_text()


# --- 6-8. every input checked before any work; odd inputs one line ------------------------------------

def test_inputs_are_checked_before_training(text, tmp_path):
    for extra, words in ((["--wikitext", tmp_path / "nowhere"], "no wiki.test.raw"),
                         (["--heldout", tmp_path / "missing.txt"], "no such file")):
        run = tmp_path / f"run{len(words)}"
        assert words in last_line(invoke(train_args(text, run, 100000, *extra)))
        assert not (run / CHECKPOINT).exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo):
        assert "not a regular file" in last_line(invoke(["train", "--data", path, "--run-dir", tmp_path / "x"]))
    # settings the library refuses are usage errors (exit code 2), in its words
    line = last_line(invoke(["train", "--weight-decay", "inf"]), code=2)
    assert line == "Error: weight_decay must be a finite number, got inf"
    assert "finite" in last_line(invoke(["train", "--momentum", "nan", "--optimizer", "momentum"]), code=2)


def test_an_unwritable_run_dir_is_one_line(text, tmp_path):
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing: use a folder under a file
        (tmp_path / "file").write_text("x")
        run_dir = tmp_path / "file" / "run"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        run_dir = locked / "run"
    line = last_line(invoke(train_args(text, run_dir, 5)))
    assert line.startswith("Error: cannot create run folder") or line.startswith("Error: cannot lock")


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_prompt_is_bytes(text, tmp_path):
    run = tmp_path / "soma"
    assert invoke(train_args(text, run, 2, "--experts", "2", "--chunk-size", "256")).exit_code == 0
    prompt = b"caf\xe9 \xff"  # not UTF-8
    proc = subprocess.run(zosoma_cmd() + [b"sample", str(run).encode(), b"--prompt", prompt, b"--bytes", b"20"],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(prompt) and len(proc.stdout) == len(prompt) + 20 + 1  # + newline


# --- 7 and 9. a second Ctrl-C, and the small things ---------------------------------------------------

def test_a_signal_cannot_fall_between_the_renames(tmp_path, monkeypatch):
    """Ctrl-C during a checkpoint rotation is held until both renames are done."""
    from zosoma.formats.checkpoint import Checkpoint
    from zosoma.config import ModelConfig, TrainConfig
    from zosoma.model.params import init_params

    model = ModelConfig(embed=4, hidden=4, layers=1)
    folder = RunFolder(tmp_path)
    folder.make()
    folder.write_checkpoint(Checkpoint(model, TrainConfig(optimizer="sgd"), init_params(model, 0), 1))
    replace = os.replace

    def replace_then_interrupt(a, b):
        replace(a, b)
        if Path(a).name == CHECKPOINT:  # between the two renames of the rotation
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not a handler a CliRunner test left behind
    with pytest.raises(KeyboardInterrupt):
        folder.write_checkpoint(Checkpoint(model, TrainConfig(optimizer="sgd"), init_params(model, 0), 2))
    monkeypatch.undo()
    assert (tmp_path / CHECKPOINT).exists() and (tmp_path / PREVIOUS).exists() and not (tmp_path / NEXT).exists()
    assert folder.read_checkpoint().step == 2


@pytest.mark.slow
def test_small_things(text, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["eval", empty], ["info", empty]):
        line = last_line(invoke(args))
        assert "not a run folder" in line and "resume" not in line
    run = tmp_path / "soma"
    assert invoke(train_args(text, run, 2, "--experts", "2", "--chunk-size", "256")).exit_code == 0
    line = last_line(invoke(["export", run, "--out", tmp_path / "m.pt"]))
    assert "is a SOMA run: export one expert" in line and "expert1" in line
    out = tmp_path / "m.pt"
    assert invoke(["export", run / "expert0", "--out", out]).exit_code == 0
    before = out.read_bytes()
    torch = pytest.importorskip("torch", reason="exporting a state_dict needs PyTorch")
    monkeypatch.setattr(torch, "save", lambda obj, path: (Path(path).write_bytes(b"half"), 1 / 0))
    assert invoke(["export", run / "expert1", "--out", out, "--force"]).exit_code != 0
    assert out.read_bytes() == before  # --force replaces the file whole or not at all
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m.pt")) == []


# --- 10. SIGTERM saves as Ctrl-C does; a second signal stops at once ----------------------------------------

@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_saves_and_exits_like_ctrl_c(text, tmp_path, soma):
    run = tmp_path / "run"
    extra, folders = soma_or_single(run, soma, "--workers", "2")
    args = train_args(text, run, 100000, "--checkpoint-every", "100000", *extra)
    code, out, err = sigterm_once_logged(args, folders)
    assert code == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopping after this step" in err and f"Continue with: zosoma train --resume {run}" in out
    for f in folders:  # only the step-0 checkpoint existed: every step logged was saved on the way out
        assert RunFolder(f).read_checkpoint().step == len(steps_logged(f)) > 20


def test_an_interrupt_from_the_library_aborts_with_its_code(text, tmp_path, monkeypatch):
    """(A second stop signal ends the command at once: tests/test_inputs.py, in a real subprocess.)"""
    from zosoma.cli.stop import Interrupted

    def interrupted(*args, **kwargs):  # SIGTERM outside training (ZosomaGroup's handler)
        raise Interrupted(signal.SIGINT)
        yield

    monkeypatch.setattr("zosoma.runs.run.start_run", interrupted)  # where the run handle calls it
    result = invoke(train_args(text, tmp_path / "run", 2))
    assert result.exit_code == 130 and result.output.strip().splitlines()[-1] == "aborted"


@pytest.mark.subprocess
def test_a_killed_soma_parent_leaves_no_warnings(text, tmp_path):
    run = tmp_path / "soma"
    args = train_args(text, run, 100000, "--experts", "2", "--workers", "2", "--chunk-size", "256")
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    # both workers training (a kill while a worker is still being spawned is Python's own traceback)
    assert wait_for(lambda: all((run / f"expert{i}" / METRICS).exists() and
                                "\n" in (run / f"expert{i}" / METRICS).read_text() for i in range(2)))
    proc.kill()
    _, err = proc.communicate(timeout=60)  # once the workers and the resource tracker are gone too
    assert "leaked semaphore" not in err and "Traceback" not in err, err


# --- 11. a SOMA expert belongs to its run; a resume keeps where the run ran ---------------------------

def test_an_expert_is_resumed_only_with_its_run(text, tmp_path):
    run = tmp_path / "soma"
    assert invoke(train_args(text, run, 4, "--experts", "2", "--chunk-size", "256", "--workers", "1")).exit_code == 0
    before = snapshot(run)
    line = last_line(invoke(["train", "--resume", run / "expert0"]))
    assert "is an expert of the SOMA run" in line and f"--resume {run}" in line
    line = last_line(invoke(train_args(text, run / "expert0", 2)))
    assert f"continue it with --resume {run}," in line
    assert snapshot(run) == before


def test_a_resume_keeps_the_placement_and_can_extend_the_run(text, tmp_path):
    from zosoma.workers.population_workers import exchange_bytes
    run = tmp_path / "run"
    args = train_args(text, run, 4, "--population-workers", "2", "--executor", "inline")
    args[args.index("-P") + 1] = "4"
    assert invoke(args).exit_code == 0
    result = invoke(["train", "--resume", run, "--steps", "8"])
    assert result.exit_code == 0, result.output
    assert "placement: --executor inline --population-workers 2" in result.output
    assert "extending" in result.output and "from 4 to 8 steps" in result.output
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    # sharded before and after: the default's 2P members' losses and scalars, one per target (B T = 4 x 16)
    assert {r["comm_bytes"] for r in records} == {exchange_bytes(4, 2, 8, 4 * 16)}
    assert RunFolder(run).read_checkpoint().train.steps == 8
    assert "extend a run, not shorten it" in last_line(invoke(["train", "--resume", run, "--steps", "6"]))


def test_a_soma_run_is_extended_whole(text, tmp_path):
    run = tmp_path / "soma"
    assert invoke(train_args(text, run, 3, "--experts", "2", "--chunk-size", "256", "--workers", "1")).exit_code == 0
    assert invoke(["train", "--resume", run, "--steps", "5"]).exit_code == 0
    for i in range(2):
        assert steps_logged(run / f"expert{i}") == [1, 2, 3, 4, 5]
        assert RunFolder(run / f"expert{i}").read_checkpoint().train.steps == 5


# --- 12. WikiText-103 given by path: checked first, kept absolute, replaceable on resume --------------

def test_wikitext_by_path_is_checked_before_training(text, tmp_path, monkeypatch):
    empty = tmp_path / "empty" / "wiki.test.raw"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    binary = tmp_path / "binary.raw"
    binary.write_bytes(bytes(range(256)) * 10)
    for path, words in ((empty, "is empty"), (binary, "is not text")):
        line = last_line(invoke(train_args(text, tmp_path / "new", 2, "--wikitext", path)))
        assert words in line and "wiki.test.raw" in line
        assert not (tmp_path / "new").exists()
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text("step 1 loss 5.5\n" * 400)
    monkeypatch.chdir(tmp_path)
    result = invoke(train_args(text, "run", 2, "--wikitext", "logs/train.log"))
    assert result.exit_code == 0, result.output
    assert "is not the official wiki.test.raw" in result.output
    assert RunFolder(tmp_path / "run").read_checkpoint().extra["data"]["wikitext"] == str(log.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    moved = tmp_path / "moved.log"
    log.rename(moved)
    assert "no wiki.test.raw" in last_line(invoke(["train", "--resume", tmp_path / "run"]))
    result = invoke(["train", "--resume", tmp_path / "run", "--wikitext", moved])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "results.json").read_text())["wikitext103_path"] == str(moved)


# --- 13. a start that fails leaves nothing; default names never collide ------------------------------

def test_a_start_that_fails_leaves_no_folder(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = tmp_path / "small.txt"
    small.write_bytes(b"some words " * 180)
    base = ["train", "--data", small, "--experts", "8", *TINY]
    line = last_line(invoke(base + ["--run-dir", tmp_path / "new"]), code=2)  # a usage error
    assert "cannot make 8 clusters" in line and not (tmp_path / "new").exists()
    assert "cannot make 8 clusters" in last_line(invoke(base), code=2)  # in the default runs/<name>
    assert list((tmp_path / "runs").iterdir()) == []
    line = last_line(invoke(["train", "--data", small, "--optimizer", "eggroll", "--rank", "9", *TINY[:-2]]))
    assert "--rank 9 exceeds 8, the smallest side of this model's matrices" in line
    assert list((tmp_path / "runs").iterdir()) == []


def test_default_run_folders_are_unique(tmp_path, monkeypatch):
    from zosoma.training.folder import new_run_dir
    monkeypatch.chdir(tmp_path)
    made = [new_run_dir("tiny-") for _ in range(3)]  # within one second
    assert len(set(made)) == 3 and all(p.is_dir() for p in made)


# --- 14. a damaged results record is one line saying how to write it again ---------------------------

def test_a_damaged_results_record_is_one_line_and_a_resume_writes_it_again(text, tmp_path):
    import zosoma
    run = tmp_path / "run"
    assert CliRunner().invoke(cli, [str(a) for a in train_args(text, run, 3, "--quiet")]).exit_code == 0
    good = (run / "results.json").read_text()
    (run / "results.json").write_text(good[: len(good) // 2])  # cut short, as a full disk or an editor leaves it
    (tmp_path / "result.json").write_text("{")
    with pytest.raises(ConfigError, match=r"results.json is damaged \(.*\): delete it; zosoma train --resume"):
        zosoma.open_run(run).results
    with pytest.raises(ConfigError, match=r"result.json is damaged .*: delete it; run the same command again"):
        RunFolder(tmp_path).read_result()
    (run / "results.json").unlink()
    assert CliRunner().invoke(cli, ["train", "--resume", str(run), "--quiet"]).exit_code == 0
    assert json.loads((run / "results.json").read_text()) == json.loads(good)


# --- 15. results say which checkpoint they are of: a stopped extension leaves them stale, said -------

@pytest.mark.slow
@pytest.mark.subprocess
def test_results_of_a_run_extended_then_stopped_are_stale_everywhere_they_are_read(text, tmp_path, soma):
    import zosoma
    from zosoma.training.folder import StaleResults
    run = tmp_path / "run"
    extra, folders = soma_or_single(run, soma, "--executor", "inline")
    assert invoke(train_args(text, run, 3, "--quiet", *extra)).exit_code == 0
    results = zosoma.open_run(run).results
    assert results["checkpoint_steps"] == [3] * len(folders)
    # --steps extends the run; SIGTERM stops it part way, checkpointed
    code = sigterm_once_logged(["train", "--resume", run, "--steps", "3000", "--quiet"], folders)[0]
    assert code == 128 + signal.SIGTERM
    now = [RunFolder(f).read_checkpoint().step for f in folders]
    assert all(3 < s for s in now) and min(now) < 3000  # inline, expert 0 may have finished first
    stale = f"results.json is of step {', '.join(['3'] * len(folders))}, but the newest checkpoint is at step " \
            f"{', '.join(map(str, now))}: it is stale"
    with pytest.raises(StaleResults, match=re.escape(stale)):
        zosoma.open_run(run).results
    info = subprocess.run(zosoma_cmd() + ["info", str(run), "--json"], capture_output=True, text=True)
    described = json.loads(info.stdout)
    assert stale in described["results_stale"] and f"warning: {run}/{stale}" in info.stderr
    assert [e["step"] for e in described["experts_status"]] == now if soma else described["step"] == now[0]
    scored = subprocess.run(zosoma_cmd() + ["eval", str(run), "--data", text, "--json"], capture_output=True,
                            text=True)
    assert scored.returncode == 0 and f"warning: {run}/{stale}" in scored.stderr
    # a results.json an older zosoma wrote, without checkpoint_steps, is read, and judged all the same
    older = {k: v for k, v in results.items() if k != "checkpoint_steps"}
    (run / "results.json").write_text(json.dumps(older))
    with pytest.raises(StaleResults, match="but the newest checkpoint is "):
        zosoma.open_run(run).results
    # the resume finishes the run and evaluates it: current again
    assert invoke(["train", "--resume", run, "--quiet"]).exit_code == 0
    assert zosoma.open_run(run).results["checkpoint_steps"] == [3000] * len(folders)


def test_results_past_a_damaged_newest_checkpoint_say_it_is_damaged(text, tmp_path):
    """They said "the run trained on after it was evaluated", which it did not."""
    run = tmp_path / "run"
    assert invoke(train_args(text, run, 4, "--checkpoint-every", "2", "--quiet")).exit_code == 0
    damage(run / "checkpoint.h5", "truncated")
    result = invoke(["eval", run, "--data", text, "--previous"])
    assert result.exit_code == 0, result.output
    assert (f"warning: {run}/results.json is of step 4, but the newest intact checkpoint is at step 2: it is stale "
            "(the newest checkpoint is damaged, so the model it scored cannot be read)") in result.output
    assert "trained on after" not in result.output


def test_results_an_older_zosoma_wrote_without_checkpoint_steps_are_read(text, tmp_path):
    import zosoma
    run = tmp_path / "run"
    assert invoke(train_args(text, run, 3, "--quiet")).exit_code == 0
    older = {k: v for k, v in json.loads((run / "results.json").read_text()).items() if k != "checkpoint_steps"}
    (run / "results.json").write_text(json.dumps(older))
    assert zosoma.open_run(run).results == older
    assert json.loads(invoke(["info", run, "--json"]).output)["results_stale"] is None


# --- 16. eval, info and sample on a run still training say so, and which checkpoint they read --------

def hold_lock(folder: Path):
    """A process that owns `folder` (RunFolder.lock) until it is killed, started and holding it."""
    code = ("import sys, time; from zosoma.training.folder import RunFolder\n"
            "with RunFolder(sys.argv[1]).lock():\n    print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
@pytest.mark.subprocess
def test_commands_on_a_run_still_training_say_so_and_name_the_step_they_read(text, tmp_path):
    import zosoma
    from zosoma.training.folder import StillTraining
    run = tmp_path / "run"
    # its only checkpoint is step 0's until it stops: what a command reads now is the untrained model
    args = train_args(text, run, 100000, "--checkpoint-every", "100000", "--quiet")
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: (run / METRICS).exists() and len(steps_logged(run)) > 20)
        live = f"is still training (pid {proc.pid} on "
        info = subprocess.run(zosoma_cmd() + ["info", str(run), "--json"], capture_output=True, text=True)
        described = json.loads(info.stdout)
        assert described["trained_by"].startswith(f"pid {proc.pid} on ") and described["step"] == 0
        assert live in info.stderr and "this uses its checkpoint at step 0, not the finished model" in info.stderr
        for args in (["eval", run, "--data", text, "--json"], ["sample", run, "--bytes", "5"]):
            done = subprocess.run(zosoma_cmd() + [str(a) for a in args], capture_output=True, text=True,
                                  errors="replace")  # sampled bytes
            assert done.returncode == 0 and live in done.stderr, done.stderr
            assert "this uses its checkpoint at step 0, not the finished model" in done.stderr
        opened = zosoma.open_run(run)
        assert opened.trained_by.startswith(f"pid {proc.pid} on ")
        with pytest.warns(StillTraining, match=re.escape(live)):
            opened.model()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    assert zosoma.open_run(run).trained_by is None
    done = subprocess.run(zosoma_cmd() + ["info", str(run), "--json"], capture_output=True, text=True)
    assert json.loads(done.stdout)["trained_by"] is None and "still training" not in done.stderr


@pytest.mark.subprocess
def test_an_export_of_a_run_still_training_says_so(text, tmp_path):
    """eval, info and sample said so; export wrote the step-0 weights without a word."""
    run = tmp_path / "run"
    assert invoke(train_args(text, run, 2, "--quiet")).exit_code == 0
    holder = hold_lock(run)
    try:
        live = f"{run} is still training (pid {holder.pid} on "
        for args in (["--out", tmp_path / "model.pt"], ["--format", "onnx", "--out", tmp_path / "model.onnx"]):
            with warnings.catch_warnings():
                warnings.simplefilter("always")  # said again in this process, as in a new one
                result = invoke(["export", run, *args])
            assert result.exit_code == 0 and live in result.output, result.output
            assert "this uses its checkpoint at step 2, not the finished model" in result.output
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_soma_run_whose_owner_lives_is_said_to_be_training_for_each_expert(text, tmp_path):
    import zosoma
    from zosoma.config import TrainConfig
    from zosoma.training.folder import StillTraining
    from zosoma.runs.soma import create_soma
    run = tmp_path / "run"
    create_soma(run, TINY_MODEL, TrainConfig(optimizer="sgd", steps=5, batch=4, seq_len=16,
                perturbations=2), 2, chunk_size=256, train_paths=[str(text)], heldout_paths=[str(text)])
    holder = hold_lock(run)
    try:
        live = f"{run} is still training (pid {holder.pid} on "
        with pytest.warns(StillTraining, match=re.escape(live) + ".*its experts' checkpoints at step 0, 0"):
            zosoma.open_run(run).model()
        done = subprocess.run(zosoma_cmd() + ["sample", str(run), "--bytes", "5"], capture_output=True, text=True,
                              errors="replace")
        assert done.returncode == 0 and live in done.stderr, done.stderr
        done = subprocess.run(zosoma_cmd() + ["info", str(run / "expert1"), "--json"], capture_output=True, text=True)
        assert json.loads(done.stdout)["trained_by"].startswith(f"pid {holder.pid} on ") and live in done.stderr
        done = invoke(["export", run, "--format", "onnx", "--out", tmp_path / "onnx"])
        assert done.exit_code == 0 and live in done.output and "experts' checkpoints at step 0, 0" in done.output
    finally:
        holder.kill()
        holder.wait()
    assert zosoma.open_run(run).trained_by is None


def test_eval_of_a_damaged_soma_json_or_a_dropped_model_says_so(text, tmp_path):
    """A garbage soma.json was warned of, then evaluated as SOMA anyway; a single model training gave
    up on was scored without a word of the drop."""
    import zosoma
    from zosoma.runs.soma import DroppedExperts
    soma = tmp_path / "soma"
    assert invoke(train_args(text, soma, 2, "--experts", "2", "--chunk-size", "256", "--executor", "inline",
                             "--quiet")).exit_code == 0
    (soma / "soma.json").write_text("garbage{")
    damaged = f"Error: {soma}: soma.json is damaged (Expecting value: line 1 column 1 (char 0)), so this SOMA run " \
              "cannot be read"
    for command in ("eval", "sample"):
        assert last_line(invoke([command, soma])) == damaged
    with pytest.raises(ConfigError, match="soma.json is damaged"):
        zosoma.open_run(soma).evaluate()
    run = tmp_path / "run"
    result = invoke(train_args(text, run, 120, "--optimizer", "onesided", "--lr", "40", "--checkpoint-every", "20", "--on-divergence", "restart",
                               "--max-restarts", "0", "--quiet"))
    assert result.exit_code == 1 and "the model was dropped at step" in result.output
    scored = invoke(["eval", run])
    assert scored.exit_code == 0 and f"warning: {run} was dropped at step " in scored.output
    assert "after 0 restart(s)" in scored.output and "it is scored as it was left" in scored.output
    with pytest.warns(DroppedExperts, match="was dropped at step"):
        zosoma.open_run(run).evaluate(data=text)


def test_a_run_that_checkpoints_every_step_keeps_a_bounded_chain_to_roll_back_to(text, tmp_path):
    """--checkpoint-every 1 with restarts kept 2 + the guard's window files (52 here, 202 at most);
    now the newest two and one every stride steps over the window, and the restarts roll back to
    the steps they did before (step 49: a multiple of the stride)."""
    from zosoma.config import TrainConfig
    from zosoma.formats.checkpoint import load_checkpoint
    from zosoma.training.trainer import MAX_KEPT, retention
    restart = TrainConfig(optimizer="sgd", checkpoint_every=1, on_divergence="restart")
    assert retention(restart, 200) == (202, 25) and retention(restart, 50) == (52, 7)
    assert retention(TrainConfig(optimizer="sgd", checkpoint_every=500, on_divergence="restart"), 200) == (3, None)  # as it was
    assert retention(TrainConfig(optimizer="sgd", checkpoint_every=1, on_divergence="stop"), 200) == (2, None)
    run = tmp_path / "run"
    result = invoke(train_args(text, run, 400, "--optimizer", "onesided", "--lr", "40", "--checkpoint-every", "1", "--max-restarts", "1",
                               "--quiet"))
    assert result.exit_code == 1 and "rolled back to step 49" in result.output
    assert len(list(run.glob("checkpoint*.h5"))) <= MAX_KEPT
    older = list(run.glob("checkpoint.prev[0-9]*.h5"))
    assert older and all(load_checkpoint(p).step % 7 == 0 for p in older)
