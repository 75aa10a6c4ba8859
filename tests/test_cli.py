"""The command line, through click's CliRunner and as a real subprocess: the main commands work,
and bad input gets one line, a non-zero exit, and destroys nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import cli_json, one_line_error, zosoma_cmd
from world import tiny_args
from zosoma.formats.checkpoint import load_checkpoint
from zosoma.training.folder import RunFolder
from zosoma.cli.main import cli

TINY = tiny_args(4, 2, checkpoint_every=3)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon", b"\n"]
    for name in ("a", "b"):
        (root / f"{name}.txt").write_bytes(b" ".join(words[i] for i in rng.integers(0, 6, 800)))
    held = root / "held"
    held.mkdir()
    (held / "h.txt").write_bytes(b" ".join(words[i] for i in rng.integers(0, 6, 300)))
    return root


def run(args, **kw):
    return CliRunner().invoke(cli, args, catch_exceptions=False, **kw)



def test_help_everywhere():
    for args in ([], ["train"], ["eval"], ["info"], ["export"], ["data"], ["data", "download"],
                 ["bench"], ["bench", "forward"], ["bench", "spsa"]):
        result = run(args + ["--help"])
        assert result.exit_code == 0 and "Usage" in result.output


def test_train_info_eval_export(tmp_path, text_files):
    run_dir = tmp_path / "run"
    result = run(["train", "--data", str(text_files / "a.txt"), "--data", str(text_files / "b.txt"),
                  "--heldout", str(text_files / "held"), "--steps", "5", "--run-dir", str(run_dir),
                  "--wikitext", str(text_files / "held" / "h.txt")] + TINY)
    assert result.exit_code == 0, result.output
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["heldout"]) == {"h", "overall"} and results["wikitext103"] > 0
    for name in ("checkpoint.h5", "metrics.jsonl", "results.json"):
        assert (run_dir / name).exists()
    assert load_checkpoint(run_dir / "checkpoint.h5").step == 5

    info = cli_json(["info", run_dir], "info")
    assert info["kind"] == "checkpoint" and info["step"] == 5 and info["model"]["hidden"] == 16
    scored = cli_json(["eval", run_dir / "checkpoint.h5", "--data", text_files / "held"], "eval")
    assert scored["step"] == 5 and set(scored["heldout"]) == {"h", "overall"}
    for flag, value in (("--top-k", "1"), ("--temperature", "0.5")):  # a single model has no router to set
        line = one_line_error(run(["eval", str(run_dir), flag, value]), code=2)
        assert line.endswith(f"{flag} is an option of SOMA runs; {run_dir} is a single model"), line
    out = tmp_path / "m.pt"
    result = run(["export", str(run_dir), "--format", "torch", "--out", str(out)])
    assert result.exit_code == 0 and out.exists()
    result = run(["export", str(run_dir), "--out", str(out)])
    assert "exists" in one_line_error(result)


def test_bad_input_is_one_line_and_destroys_nothing(tmp_path, text_files):
    missing = tmp_path / "nope.txt"
    assert "nope.txt" in one_line_error(run(["train", "--data", str(missing)] + TINY))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert "empty" in one_line_error(run(["train", "--data", str(empty)] + TINY))
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    assert "too small" in one_line_error(run(["train", "--data", str(short), "--run-dir", str(tmp_path / "s")] + TINY))
    assert one_line_error(run(["train", "--steps", "0"]), code=2) == "Error: steps must be at least 1, got 0"  # as zosoma.train
    assert one_line_error(run(["train", "--lr", "-1"]), code=2) == "Error: lr must be positive, got -1.0"
    assert one_line_error(run(["train", "--eps", "nan"]), code=2) == "Error: eps must be a finite number, got nan"
    assert one_line_error(run(["train", "--optimizer", "lbfgs"]), code=2)

    # A run folder that holds a run is never overwritten.
    run_dir = tmp_path / "run"
    assert run(["train", "--data", str(text_files / "a.txt"), "--steps", "2", "--run-dir", str(run_dir)] + TINY).exit_code == 0
    before = (run_dir / "checkpoint.h5").read_bytes()
    assert "already holds a run" in one_line_error(run(["train", "--data", str(text_files / "a.txt"), "--run-dir", str(run_dir)] + TINY))
    assert (run_dir / "checkpoint.h5").read_bytes() == before
    assert "--lr" in one_line_error(run(["train", "--resume", str(run_dir), "--lr", "0.1"]))  # --steps extends it

    # Damaged checkpoints are reported, not loaded, and left as they are.
    bad = tmp_path / "bad.h5"
    bad.write_bytes(before[: len(before) // 2])
    for args in (["info", str(bad)], ["eval", str(bad)], ["export", str(bad), "--out", str(tmp_path / "x.pt")]):
        assert "bad.h5" in one_line_error(run(args))
    assert bad.read_bytes() == before[: len(before) // 2] and not (tmp_path / "x.pt").exists()
    assert "no checkpoint.h5" in one_line_error(run(["train", "--resume", str(tmp_path / "nothing")]))


@pytest.mark.slow
@pytest.mark.subprocess
def test_subprocess_sigkill_then_resume_equals_uninterrupted(tmp_path, text_files):
    """A run killed with SIGKILL and resumed ends with the same parameters as an uninterrupted run."""
    args = ["train", "--data", str(text_files / "a.txt"), "--steps", "300", "--checkpoint-every", "5",
            *tiny_args(4, 2)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    full = subprocess.run(zosoma_cmd() + args + ["--run-dir", str(tmp_path / "full")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr

    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen(zosoma_cmd() + args + ["--run-dir", str(killed_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once a checkpoint past step 0 exists
        if (killed_dir / "metrics.jsonl").exists() and len((killed_dir / "metrics.jsonl").read_text().splitlines()) >= 12:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    assert 0 < RunFolder(killed_dir).read_checkpoint().step < 300
    resumed = subprocess.run(zosoma_cmd() + ["train", "--resume", str(killed_dir)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    a = load_checkpoint(tmp_path / "full" / "checkpoint.h5")
    b = load_checkpoint(killed_dir / "checkpoint.h5")
    assert a.step == b.step == 300
    assert np.array_equal(a.theta, b.theta)
    assert all(np.array_equal(a.optimizer[k], b.optimizer[k]) for k in a.optimizer)


@pytest.mark.subprocess
def test_subprocess_ctrl_c_saves_and_exits(tmp_path, text_files):
    run_dir = tmp_path / "run"
    args = ["train", "--data", str(text_files / "a.txt"), "--steps", "100000", "--run-dir", str(run_dir)] + TINY
    proc = subprocess.Popen(zosoma_cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size > 0):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "checkpoints saved" in out
    ckpt = load_checkpoint(run_dir / "checkpoint.h5")
    assert ckpt.step > 0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == ckpt.step
    assert "Traceback" not in err


@pytest.mark.subprocess
def test_console_script_installed():
    exe = Path(sys.executable).parent / "zosoma"
    result = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "zosoma" in result.stdout


@pytest.mark.slow
def test_soma_commands(tmp_path, text_files):
    """train --experts, eval with routing options, sample, cluster, variance, and their errors."""
    data = ["--data", str(text_files / "a.txt"), "--data", str(text_files / "b.txt")]
    run_dir = tmp_path / "soma"
    result = run(["train", "--experts", "2", "--workers", "1", "--chunk-size", "128", "--steps", "3",
                  "--heldout", str(text_files / "held"), "--run-dir", str(run_dir)] + data + TINY)
    assert result.exit_code == 0, result.output
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["heldout"]["overall"]) == {"routed", "expert0", "expert1", "oracle"}
    info = cli_json(["info", run_dir], "info")
    assert [(e["expert"], e["step"], e["steps"]) for e in info["experts_status"]] == [(0, 3, 3), (1, 3, 3)]
    scored = cli_json(["eval", run_dir, "--data", text_files / "held", "--top-k", "1"], "eval")
    assert scored["top_k"] == 1 and {"routed", "expert0", "expert1", "oracle"} <= set(scored["heldout"]["overall"])
    assert "exceeds the 2 experts" in one_line_error(run(["eval", str(run_dir), "--top-k", "3"]))
    line = one_line_error(run(["eval", str(run_dir), "--streams", "2"]), code=2)  # SOMA is scored by segments
    assert line.endswith(f"--streams is an option of single models; {run_dir} is a SOMA run"), line
    result = run(["sample", str(run_dir), "--prompt", "alpha", "--bytes", "20", "--seed", "3"])
    assert result.exit_code == 0 and result.output.startswith("alpha")
    assert result.output == run(["sample", str(run_dir), "--prompt", "alpha", "--bytes", "20", "--seed", "3"]).output
    result = run(["train", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output  # already finished: nothing to train, evaluates again

    clustered = cli_json(["cluster", "-N", "2", "--chunk-size", "128"] + data, "cluster")
    assert len(clustered["clusters"]) == 2 and 0 < clustered["purity"] <= 1
    assert "cannot make 5000 clusters" in one_line_error(run(["cluster", "-N", "5000", "--chunk-size", "128"] + data))
    assert "exceeds the 2 experts" in one_line_error(run(["train", "--experts", "2", "--top-k", "3"] + data), code=2)
    assert "--experts 2 or more" in one_line_error(run(["train", "--loss", "summed"] + data), code=2)

    result = run(["variance", "--no-lstm", "--trials", "2000"])
    assert result.exit_code == 0 and "ratio" in result.output


def test_data_show_and_download(tmp_path, request):
    shown = cli_json(["data", "show"], "data-show")
    assert shown["splits"]["heldout"]["documents"][0]["name"] == "drama" and shown["baselines"]["bigram"] > 0
    shared = request.getfixturevalue("wikitext_files")
    import zipfile
    archive = tmp_path / "wikitext-103-raw-v1.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in ("wiki.test.raw", "wiki.valid.raw"):
            z.write(shared / name, f"wikitext-103-raw/{name}")
    result = run(["data", "download", "wikitext-103", "--url", archive.as_uri(), "--dest", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "wiki.test.raw").read_bytes() == (shared / "wiki.test.raw").read_bytes()
    assert "no such file" in one_line_error(run(["data", "download", "wikitext-103", "--url", str(tmp_path / "x.zip"),
                                                 "--dest", str(tmp_path / "out2")]))


def test_sample_a_single_model_and_greedy(tmp_path, text_files):
    from zosoma.runs.single import load_model
    from zosoma.mixture.sample import sample
    from zosoma.engines.ops import Ops
    run_dir = tmp_path / "one"
    assert run(["train", "--data", str(text_files / "a.txt"), "--run-dir", str(run_dir), "--steps", "3", *TINY]).exit_code == 0
    outputs = [run(["sample", str(run_dir), "--bytes", "12", "--temperature", "0", "--seed", str(s)]).output
               for s in (1, 2)]
    assert outputs[0] == outputs[1]  # greedy draws nothing
    ensemble = load_model(run_dir)
    (theta, layout), = ensemble.experts
    logp, _ = Ops().log_probs(theta, layout, np.frombuffer(b"\n", np.uint8)[None])
    assert sample(ensemble, b"", 1, temperature=0) == bytes([int(np.argmax(logp[0, -1]))])
    checkpoint = next(run_dir.glob("checkpoint.h5"))
    assert run(["sample", str(checkpoint), "--bytes", "12", "--temperature", "0"]).output == outputs[0]
    result = CliRunner().invoke(cli, ["sample", str(run_dir), "--top-k", "2"])
    assert "--top-k is an option of SOMA runs" in one_line_error(result)
