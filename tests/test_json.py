"""What the commands give a program or a log: --json objects with a stable schema, and progress
as plain lines when there is no terminal (a log file, nohup, SLURM)."""

import re
import subprocess

import pytest

from helpers import cli_json, run_cli, zosoma_cmd
from world import tiny_args

TINY = tiny_args(4, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text):
    root = tmp_path_factory.mktemp("json")
    base = ["train", "--data", text, "--heldout", text, *TINY, "--steps", "6", "--quiet"]
    assert run_cli(base + ["--run-dir", root / "one"]).exit_code == 0
    assert run_cli(base + ["--run-dir", root / "soma", "--experts", "2", "--chunk-size", "256",
                           "--workers", "1"]).exit_code == 0
    return root, text


def test_eval_and_info_as_json(runs):
    root, text = runs
    one = cli_json(["eval", root / "one", "--data", text], "eval")
    assert one["kind"] == "single" and one["step"] == 6 and set(one["heldout"]) == {"a", "overall"}
    soma = cli_json(["eval", root / "soma", "--data", text], "eval")
    assert soma["kind"] == "soma" and {"routed", "expert0", "expert1", "oracle"} <= set(soma["heldout"]["overall"])
    assert soma["dropped"] == [] and soma["top_k"] == 2
    info = cli_json(["info", root / "one"], "info")
    assert info["kind"] == "checkpoint" and info["step"] == 6 and info["train"]["optimizer"] == "activity-onesided"
    assert info["train"]["shaping"] == []  # the default estimator takes no shaping
    assert [t["name"] for t in info["tensors"]][0] == "embed" and info["last_metrics"]["step"] == 6
    info = cli_json(["info", root / "soma"], "info")
    assert info["kind"] == "soma" and [e["step"] for e in info["experts_status"]] == [6, 6]


@pytest.mark.slow
def test_data_show_cluster_and_bench_as_json(tmp_path):
    shown = cli_json(["data", "show"], "data-show")
    assert shown["baselines"]["trigram"] == pytest.approx(2.2206, abs=1e-4)
    assert [d["name"] for d in shown["splits"]["heldout"]["documents"]][0] == "drama"
    clusters = cli_json(["cluster", "-N", "2"], "cluster")
    assert len(clusters["clusters"]) == 2 and sum(c["size"] for c in clusters["clusters"]) == clusters["chunks"]
    comm = cli_json(["bench", "comm", "-W", "4"], "bench-comm")
    assert [r["preset"] for r in comm["results"]] == ["tiny", "small", "paper"]
    forward = cli_json(["bench", "forward", "--embed", "8", "--hidden", "16", "--layers", "1", "--batch", "2",
                      "--seq-len", "8", "--repeats", "1", "--no-numpy"], "bench-forward")
    assert [r["name"] for r in forward["results"] if (r["tokens_per_s"] or 0) > 0]  # the skipped ones: null
    spsa = cli_json(["bench", "spsa", "--preset", "tiny", "-P", "2", "--batch", "2", "--seq-len", "4", "--steps", "1",
                   "--no-peers"], "bench-spsa")  # its model config was once not serialisable
    assert spsa["results"]["model"] == {"embed": 32, "hidden": 64, "layers": 1} and spsa["results"]["step_s"] > 0


@pytest.mark.slow
@pytest.mark.subprocess
def test_progress_without_a_terminal_is_plain_lines(runs, tmp_path):
    _, text = runs
    args = ["train", "--data", str(text), "--heldout", str(text), *TINY, "--steps", "40", "--run-dir",
            str(tmp_path / "run"), "--log-every", "10"]
    done = subprocess.run(zosoma_cmd() + args, capture_output=True, text=True)  # stdout and stderr: pipes
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("[")]
    assert [re.search(r"step (\d+)/40", x).group(1) for x in lines] == ["10", "20", "30", "40"]
    assert all(re.search(r"loss \d\.\d{3} \(smoothed\), [\d,]+ tok/s, ETA", x) for x in lines)
    assert "it/s" not in done.stderr and "step/s" not in done.stderr  # no progress bar drawn into the log
    quiet = subprocess.run(zosoma_cmd() + args[:-4] + ["--run-dir", str(tmp_path / "q"), "--quiet"],
                           capture_output=True, text=True)
    assert quiet.returncode == 0 and not any(x.startswith("[") for x in quiet.stdout.splitlines())
    assert "held-out nats/byte" in quiet.stdout
    assert "give seconds as 30s" in run_cli(["train", "--log-every", "soon"]).output
