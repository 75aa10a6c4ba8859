"""Oversized and odd inputs end in one line before anything is written, from the command line and
the Python API alike (the comparison's TOML: tests/test_compare.py); a stop signal waits neither
for a step of minutes nor for the final evaluation. Real subprocesses where a signal is involved."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from world import TINY_MODEL_ARGS as MODEL, tiny_args
import zosoma
from helpers import one_line_error, run_cli, zosoma_cmd
from zosoma.config import ModelConfig, TrainConfig
from zosoma.download import NotOfficial
from zosoma.errors import ConfigError
from zosoma.training.folder import CHECKPOINT, RunFolder
from zosoma.strategies import make_strategy
from zosoma.strategies.settings import SlowStep, check_memory, resolve

TINY = tiny_args(4, 2, lr=0.05)

pytestmark = pytest.mark.usefixtures("scratch_cwd")


def nothing_made() -> bool:
    """No run folder in runs/ (the default) was left behind."""
    return not Path("runs").exists() or list(Path("runs").iterdir()) == []


# --- the memory one step needs, refused up front ------------------------------------------------------

@pytest.mark.parametrize("option, field, value, lower", [
    ("--batch", "batch", 10**9, "--batch"),  # the activations of a billion rows
    ("--hidden", "hidden", 10**6, "--hidden"),  # 4e12 parameters
    ("-P", "perturbations", 10**12, "--perturbations"),  # the losses of 1e12 pairs
])
def test_a_step_larger_than_this_machine_is_refused_before_any_folder(text, option, field, value, lower):
    line = one_line_error(run_cli(["train", "--data", text, option, value]), 2)
    assert "Error: one training step needs at least" in line and f"lower {lower}" in line, line
    assert nothing_made()
    with pytest.raises(ConfigError, match=r"one training step needs at least .* GB of memory"):
        zosoma.train(data=text, **{field: value})
    assert nothing_made()


def test_the_memory_rule_compares_a_steps_lower_bound_with_what_is_free(monkeypatch):
    model, cfg = ModelConfig(), TrainConfig(optimizer="sgd")
    check_memory(model, cfg, available=10**9)  # about 2 MB at the defaults
    with pytest.raises(ConfigError, match=r"more than the 0.0 GB available here: lower --hidden"):
        check_memory(model, cfg, available=1000)
    monkeypatch.setattr("zosoma.strategies.settings.available_memory", lambda: None)
    check_memory(model, dataclasses.replace(cfg, batch=10**9))  # where nothing says what is free: not refused


def test_a_step_of_minutes_is_said_up_front_and_a_usual_one_is_not():
    with pytest.warns(SlowStep, match="a second Ctrl-C or SIGTERM stops it at once"):
        resolve("tiny", {"perturbations": 10**8})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowStep)
        resolve("tiny", {})  # the default step: nothing to say
        resolve("paper", {})



def test_a_folder_whose_step_is_too_large_does_not_resume_into_a_crash(text, tmp_path):
    """A run folder an older version left with an impossible batch: one line, nothing changed."""
    run = tmp_path / "run"
    assert run_cli(["train", "--data", text, "--run-dir", run, "--steps", "1", *TINY, "--quiet"]).exit_code == 0
    folder = RunFolder(run)
    ckpt = folder.read_checkpoint()
    folder.write_checkpoint(dataclasses.replace(ckpt, train=dataclasses.replace(ckpt.train, batch=10**9)))
    before = (run / CHECKPOINT).read_bytes()
    line = one_line_error(run_cli(["train", "--resume", run, "--steps", "2"]), 1)
    assert "one training step needs at least" in line and "lower --batch" in line
    assert (run / CHECKPOINT).read_bytes() == before


# --- experts whose clusters would be too small to learn from -----------------------------------------

def test_too_many_experts_for_the_text_are_refused_before_clustering(text, tmp_path):
    # 15 kB of text, 8 experts of the tiny preset's 49,664 parameters: 0.039 bytes per parameter
    args = ["train", "--data", text, "--experts", "8", "--chunk-size", "256", "--steps", "1"]
    line = one_line_error(run_cli(args + ["--run-dir", tmp_path / "run"]), 2)  # a bad option, as any other
    assert "--experts 8: clusters of about 1,914 bytes of text for experts of 49,664 parameters" in line
    assert "under the 0.5 an expert needs: at most 0 experts" in line
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"--experts 8: clusters of about"):
        zosoma.train(data=text, experts=8, chunk_size=256, steps=1)
    assert nothing_made()
    assert run_cli(args + [*MODEL, "--experts", "2", "--quiet"]).exit_code == 0  # 0.96 bytes per parameter


def test_a_model_trained_into_nothing_ends_non_zero(text, tmp_path):
    """A weight decay near float32's largest makes theta inf at the first step: the run said so and
    ended with exit code 1 (it printed a held-out NaN with exit code 0), from the API alike. The
    default guard restarts it and drops it when its budget runs out; with the guard told to go on,
    the end of the run finds the parameters not finite."""
    args = ["train", "--data", text, "--heldout", text, *TINY, "--steps", "30", "--weight-decay", "3e38"]
    result = run_cli(args + ["--run-dir", tmp_path / "dropped", "--quiet"])
    assert result.exit_code == 1 and "the model was dropped at step" in result.output
    args += ["--on-divergence", "continue"]
    result = run_cli(args + ["--run-dir", tmp_path / "run", "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = next(x for x in result.output.splitlines() if x.startswith("Error:"))
    assert line.startswith(f"Error: {tmp_path / 'run'}: the model's parameters are not finite after step")
    assert "lower --lr or --weight-decay" in line and not (tmp_path / "run" / "results.json").exists()
    with pytest.raises(ConfigError, match="parameters are not finite"):
        zosoma.train(data=text, heldout=text, embed=8, hidden=16, batch=4, seq_len=16, perturbations=2, steps=30,
                     weight_decay=3e38, on_divergence="continue", run_dir=tmp_path / "api")


def test_a_run_whose_every_loss_was_non_finite_is_no_result():
    import numpy as np

    from zosoma.runs.single import check_trained
    theta = np.zeros(3, np.float32)
    check_trained(theta, skipped=4, step=5, where="run")  # one step updated it
    check_trained(theta, skipped=0, step=0, where="run")  # not trained yet: nothing to judge
    with pytest.raises(ConfigError, match="run: every one of its 5 steps had a non-finite loss"):
        check_trained(theta, skipped=5, step=5, where="run")
    with pytest.raises(ConfigError, match="not finite after step 5"):
        check_trained(np.array([0, np.nan], np.float32), skipped=0, step=5, where="run")


# --- names that are not UTF-8 ---------------------------------------------------------------------------

@pytest.mark.subprocess
def test_a_file_name_that_is_not_utf8_is_one_line_and_writes_nothing(text, tmp_path):
    bad = os.fsencode(tmp_path) + b"/odd\xff.txt"
    shutil.copy(text, bad)
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(text, os.fsencode(folder) + b"/also\xfe.txt")
    for data, shown in ((bad, "odd\\xff.txt"), (os.fsencode(folder), "also\\xfe.txt")):
        for soma in ([], ["--experts", "2", "--chunk-size", "256"]):
            cmd = zosoma_cmd() + ["train", "--data", data, "--run-dir", str(tmp_path / "run"), "--steps", "1", *TINY,
                                  *soma]
            result = subprocess.run(cmd, capture_output=True, timeout=120)
            err = result.stderr.decode("utf-8", "backslashreplace")
            assert result.returncode == 1 and len(err.strip().splitlines()) == 1, err
            assert err.startswith("Error: ") and shown in err and "is not UTF-8 text; rename it" in err
            assert not (tmp_path / "run").exists()


# --- options that another setting leaves unread ------------------------------------------------------

@pytest.mark.parametrize("args, needs", [  # the shaping's options under an estimator that takes a shaping
    (["--optimizer", "onesided", "--clip-at", "3"], "--shaping clip"),
    (["--optimizer", "onesided", "--shaping", "none", "--normalize-window", "9"], "--shaping normalize"),
    (["--optimizer", "onesided", "--shaping", "clip", "--normalize-window", "9"], "--shaping normalize"),
    (["--on-divergence", "stop", "--max-restarts", "2"], "--on-divergence restart"),
    (["--on-divergence", "continue", "--restart-lr-factor", "0.3"], "--on-divergence restart"),
])
def test_an_option_another_setting_leaves_unread_is_refused(text, args, needs):
    line = one_line_error(run_cli(["train", "--data", text, *args]), 2)
    assert line.endswith(f"is read only with {needs}, which this run does not use"), line
    given = {a[2:].replace("-", "_"): v for a, v in zip(args[::2], args[1::2])}
    given = {k: (float(v) if k in ("clip_at", "restart_lr_factor") else int(v) if v.isdigit() else v)
             for k, v in given.items()}
    with pytest.raises(ConfigError, match=f"read only with {needs}"):
        zosoma.train(data=text, **given)
    with pytest.raises(ConfigError, match=f"read only with {needs}"):
        zosoma.Optimizer(d=3, **given)
    assert nothing_made()


def test_options_read_under_their_setting_are_accepted_and_old_checkpoints_still_load():
    _, cfg = resolve("tiny", {"optimizer": "onesided", "shaping": ("clip",), "clip_at": 3.0, "max_restarts": 1})
    assert cfg.clip_at == 3.0 and cfg.max_restarts == 1 and cfg.on_divergence == "restart"
    # a configuration stored before the rule (clip_at set, clip not used) is not refused
    make_strategy(TrainConfig(optimizer="sgd", shaping=(), clip_at=3.0, on_divergence="stop", max_restarts=7))


@pytest.mark.parametrize("field, value, message", [
    ("perturbations", 3.5, "perturbations must be an integer, got 3.5"),
    ("steps", True, "steps must be an integer, got True"),
    ("lr", "0.1", "lr must be a number, got '0.1'"),
    ("shaping", "clipp", "unknown shaping 'clipp'"),
    ("shaping", 5, "shaping must be a piece's name or a list of them, got 5"),
    ("hidden", 64.0, "hidden must be an integer, got 64.0"),
])
def test_a_value_of_the_wrong_kind_is_refused_at_once(field, value, message):
    with pytest.raises(ConfigError, match=message):
        resolve("tiny", {"optimizer": "onesided", field: value})  # an estimator that reads every field here


def test_a_loss_that_does_not_exist_is_refused_at_once(text):
    """Where options are resolved (a comparison's --plan: tests/test_compare.py), not when a SOMA
    run is created."""
    with pytest.raises(ConfigError, match="loss must be one of independent, summed, got 'bogus'"):
        resolve("tiny", {}, loss="bogus")
    with pytest.raises(ConfigError, match="loss must be one of independent, summed, got 'bogus'"):
        zosoma.train(data=text, experts=2, loss="bogus")
    assert nothing_made()


# --- eval says what it scored ---------------------------------------------------------------------------

def test_eval_warns_of_a_wikitext_that_is_not_the_official_one_and_names_data_given(text, tmp_path, monkeypatch):
    monkeypatch.delenv("ZOSOMA_WIKITEXT103", raising=False)  # where none is found, eval says where it would be
    run = tmp_path / "run"
    assert run_cli(["train", "--data", text, "--run-dir", run, "--steps", "1", *TINY, "--quiet"]).exit_code == 0
    other = tmp_path / "notes.txt"
    other.write_text("some text that is not WikiText-103\n" * 100)
    result = run_cli(["eval", run, "--data", text, "--wikitext", other])
    assert result.exit_code == 0, result.output
    assert f"warning: {other} is not the official wiki.test.raw" in result.output
    assert "nats/byte on the --data files" in result.output and "held-out" not in result.output
    result = run_cli(["eval", run, "--data", text])  # no WikiText-103 here, and none was asked for
    assert result.exit_code == 0 and "WikiText-103" not in result.output
    scored = json.loads(run_cli(["eval", run, "--data", text, "--json"]).stdout)
    assert set(scored["heldout"]) == {"a", "overall"} and scored["wikitext103"] is None
    result = run_cli(["eval", run])  # the held-out slices, by default: the hint where WikiText-103 is
    assert "held-out nats/byte" in result.output and "WikiText-103: not found" in result.output
    with pytest.warns(NotOfficial, match="is not the official wiki.test.raw"):
        scores = zosoma.open_run(run).evaluate(data=text, wikitext=other)
    assert scores["wikitext103_path"] == str(other.resolve())


def test_yardsticks_warn_of_a_wikitext_that_is_not_the_official_one_as_eval_does(tmp_path, monkeypatch):
    """zosoma data yardsticks scored any file as "WikiText-103" without a word."""
    import zosoma.yardsticks as yardsticks
    def measured(*args):  # stands for the minute measuring takes
        raise ConfigError("measured")
    monkeypatch.setattr(yardsticks, "measure", measured)
    other = tmp_path / "notes.txt"
    other.write_text("some text that is not WikiText-103\n" * 100)
    result = run_cli(["data", "yardsticks", "--wikitext", other])
    assert f"warning: {other.resolve()} is not the official wiki.test.raw" in result.output
    assert one_line_error(result, 1) == "Error: measured"
    binary = tmp_path / "wiki.bin"
    binary.write_bytes(b"\0\1\2" * 100)
    assert one_line_error(run_cli(["data", "yardsticks", "--wikitext", binary]), 1) == \
        f"Error: {binary.resolve()} is not text, so not WikiText-103's wiki.test.raw"


# --- stop signals do not wait ------------------------------------------------------------------------------

def started(proc, check, timeout=180.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def stopped(cmd, ready, pauses, timeout):
    """Run `cmd` until `ready()`; then for each pause wait that long and send SIGTERM, the process
    still running each time. Its exit code, stdout, stderr and the seconds it took after the last."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started(proc, ready)
        for pause in pauses:
            time.sleep(pause)
            assert proc.poll() is None
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err, time.monotonic() - sent


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_signal_stops_a_step_of_minutes_at_once(text, tmp_path):
    """A batch of 200,000 rows and 64 pairs: minutes per step. The first SIGTERM waits for the
    step; the second ends the run within seconds, its step-0 checkpoint kept, in one line."""
    run = tmp_path / "run"
    cmd = zosoma_cmd() + ["train", "--data", str(text), "--run-dir", str(run), "--steps", "3", *MODEL,
                          "--batch", "200000", "--seq-len", "16", "-P", "64", "--log-every", "1",
                          "--optimizer", "onesided"]  # weight perturbation: activity's noise for 200,000 rows would not fit
    # the first signal, inside the first step, waits for its end: still running 2 s later
    code, out, err, took = stopped(cmd, lambda: (run / CHECKPOINT).exists(), pauses=(3, 2), timeout=60)
    assert took < 15, "the second signal did not stop the step"
    assert code == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopping after this step" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("stopped at once; the newest checkpoint is kept. Continue with: zosoma "
                                            f"train --resume {run}")
    assert RunFolder(run).read_checkpoint().step == 0 and RunFolder(run).owner() is None


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_stop_during_the_final_evaluation_ends_at_once(text, tmp_path):
    """Held-out text of 20 MB takes the tiny model a minute or more to score: a SIGTERM once the
    last step is saved ends the command within seconds, with its code and how to evaluate later."""
    run, heldout = tmp_path / "run", tmp_path / "heldout.txt"
    heldout.write_bytes(text.read_bytes() * 1200)
    cmd = zosoma_cmd() + ["train", "--data", str(text), "--heldout", str(heldout), "--run-dir", str(run),
                          "--steps", "2", *TINY]
    saved = lambda: (run / CHECKPOINT).exists() and RunFolder(run).read_checkpoint().step == 2  # noqa: E731
    code, out, err, took = stopped(cmd, saved, pauses=(1,), timeout=120)
    assert took < 15, "the stop waited for the evaluation"
    assert code == 128 + signal.SIGTERM, err
    assert f"zosoma train --resume {run}" in out + err and "Traceback" not in err
    assert not (run / "results.json").exists()
    assert RunFolder(run).read_checkpoint().step == 2 and RunFolder(run).owner() is None
