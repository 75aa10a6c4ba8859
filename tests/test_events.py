"""TensorBoard event files: every run folder has them, and TensorBoard's own reader finds in them
what metrics.jsonl says (per step), the evaluation, and a resumed or restarted run's one course."""

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("tensorboard", reason="the test extra installs TensorBoard, whose reader checks the files")
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer  # noqa: E402

from helpers import run_cli, zosoma_cmd  # noqa: E402
from world import tiny_args  # noqa: E402
from zosoma.training.folder import CHECKPOINT, METRICS, RunFolder  # noqa: E402

TINY = tiny_args(4, 4)


def scalars(logdir) -> dict:
    """{run: {tag: [(step, value)]}} as TensorBoard shows them (purged events dropped)."""
    mux = EventMultiplexer().AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out = {}
    for run, tags in mux.Runs().items():
        out[run] = {t: [(e.step, e.value) for e in mux.Scalars(run, t)] for t in tags["scalars"]}
    return out


def logged_steps(folder, tag: str) -> list[int]:
    """The steps of `tag` in the folder's event files as written, oldest file first: what a reader
    that does not purge (W&B's import, a plain loop over the records) finds."""
    return [event.step for path in sorted(folder.glob("events.out.tfevents.*"))
            for event in EventFileLoader(str(path)).Load() if any(v.tag == tag for v in event.summary.value)]


def metrics(folder):
    return [json.loads(line) for line in (folder / METRICS).read_text().splitlines()]


def test_a_run_folder_shows_its_metrics_in_tensorboard(text, tmp_path):
    run = tmp_path / "runs" / "one"
    base = ["train", "--data", text, "--heldout", text, *TINY, "--checkpoint-every", "10", "--optimizer", "onesided"]
    assert run_cli(base + ["--run-dir", run, "--steps", "25", "--shaping", "normalize"]).exit_code == 0
    shown = scalars(tmp_path / "runs")["one"]
    logged = metrics(run)
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("spread", "train/spread"),
                     ("normalize_scale", "train/normalize_scale"), ("forward_s", "time/forward_s")):
        assert shown[tag] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged], tag
    assert [s for s, _ in shown["guard/smoothed"]] == list(range(1, 26))
    results = json.loads((run / "results.json").read_text())
    assert shown["eval/heldout"] == [(25, pytest.approx(results["heldout"]["overall"], rel=1e-6))]


def test_a_resumed_run_shows_one_course(text, tmp_path):
    """Steps past the checkpoint a run resumed from were logged twice: TensorBoard shows the
    second course only, equal to metrics.jsonl."""
    run = tmp_path / "runs" / "one"
    base = ["train", "--data", text, "--heldout", text, *TINY, "--checkpoint-every", "10"]
    assert run_cli(base + ["--run-dir", run, "--steps", "15"]).exit_code == 0
    # back to the step-10 checkpoint, as a kill between steps 10 and 15 would have left it
    (run / CHECKPOINT).unlink()
    (run / "results.json").unlink()
    assert run_cli(["train", "--resume", run, "--steps", "20"]).exit_code == 0
    shown = scalars(tmp_path / "runs")["one"]["train/loss"]
    assert shown == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in metrics(run)]
    assert [s for s, _ in shown] == list(range(1, 21)) == logged_steps(run, "train/loss")
    # a finished run resumed again is evaluated again: its one evaluation point is replaced
    assert run_cli(["train", "--resume", run]).exit_code == 0
    assert logged_steps(run, "eval/heldout") == [20] and logged_steps(run, "train/loss") == list(range(1, 21))


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_killed_past_its_checkpoint_logs_each_step_once(text, tmp_path):
    """SIGKILL after events past the newest checkpoint (step 0) reached the file, then resume:
    the event files hold each step once, in order, as metrics.jsonl does."""
    run = tmp_path / "one"
    args = ["train", "--data", text, "--heldout", text, *tiny_args(4, 2), "--steps", "3000",
            "--checkpoint-every", "3000", "--optimizer", "onesided", "--run-dir", run]
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    while time.time() < deadline and not any(f.stat().st_size for f in run.glob("events.*")):  # 64 KiB of events
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert RunFolder(run).read_checkpoint().step == 0 < len(logged_steps(run, "train/loss"))
    resumed = subprocess.run(zosoma_cmd() + ["train", "--resume", str(run)], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert logged_steps(run, "train/loss") == list(range(1, 3001)) == [r["step"] for r in metrics(run)]
    assert logged_steps(run, "eval/heldout") == [3000]


@pytest.mark.slow
def test_a_soma_run_shows_each_expert_and_the_ensemble(text, tmp_path):
    run = tmp_path / "runs" / "soma"
    assert run_cli(["train", "--data", text, "--heldout", text, *TINY, "--steps", "6", "--experts", "2",
                    "--chunk-size", "256", "--workers", "1", "--run-dir", run]).exit_code == 0
    shown = scalars(tmp_path / "runs")
    assert {"soma", "soma/expert0", "soma/expert1"} <= set(shown)
    results = json.loads((run / "results.json").read_text())
    assert shown["soma"]["eval/heldout"][0][1] == pytest.approx(results["heldout"]["overall"]["routed"], rel=1e-6)
    for i in range(2):
        assert len(shown[f"soma/expert{i}"]["train/loss"]) == 6
        assert shown[f"soma/expert{i}"]["eval/heldout"][0][1] == pytest.approx(
            results["heldout"]["overall"][f"expert{i}"], rel=1e-6)
    # resumed once finished, it is evaluated again: one point each, at the same steps
    assert run_cli(["train", "--resume", run]).exit_code == 0
    assert logged_steps(run, "eval/heldout") == [6]
    for i in range(2):
        assert logged_steps(run / f"expert{i}", "eval/heldout") == [6]
        assert logged_steps(run / f"expert{i}", "train/loss") == list(range(1, 7))


def test_a_restarted_run_shows_the_course_it_kept(text, tmp_path):
    run = tmp_path / "runs" / "one"
    result = run_cli(["train", "--data", text, "--heldout", text, *TINY, "--optimizer", "onesided", "--steps", "120", "--lr", "40",
                      "--checkpoint-every", "20", "--on-divergence", "restart", "--max-restarts", "1", "--run-dir", run])
    assert result.exit_code == 1 and "restarted at step" in result.output
    shown = scalars(tmp_path / "runs")["one"]["train/loss"]
    assert shown == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in metrics(run)]
    assert [s for s, _ in shown] == logged_steps(run, "train/loss")


def test_a_run_without_tensorboardx_trains_and_says_so_once(text, tmp_path, monkeypatch):
    """The events are a view: a checkout run where tensorboardX is missing (the first device run's
    gpu_check stopped there) trains, writes metrics.jsonl and says once that it writes no events."""
    from zosoma.training import events

    def missing():
        raise ModuleNotFoundError("No module named 'tensorboardX'", name="tensorboardX")

    monkeypatch.setattr(events, "_proto", missing)
    monkeypatch.setattr(events, "_told_missing", [])
    run = tmp_path / "run"
    result = run_cli(["train", "--data", text, "--heldout", text, *TINY, "--checkpoint-every", "2",
                      "--run-dir", run, "--steps", "4"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "TensorBoard events" in line]
    assert len(said) == 1 and "not written (No module named 'tensorboardX')" in said[0], result.output
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4] and not list(run.glob("events.out.*"))
