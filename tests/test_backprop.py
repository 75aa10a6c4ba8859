"""The backprop baseline of `zosoma compare` (zosoma.experiments.backprop) and the price of
zero-order (zosoma.experiments.price): autograd's gradient against central finite differences of
zosoma's own reference loss, the trained weights scored by zosoma's evaluator as PyTorch scores
them, the same batches as `zosoma train`, and the table's reading of the curves."""

import subprocess
import sys

import numpy as np
import pytest

from helpers import assert_close, one_line_error, run_cli
from zosoma.engines.ops import Ops
from zosoma.config import ModelConfig, VOCAB
from zosoma.errors import ConfigError
from zosoma.experiments import backprop
from zosoma.experiments.compare import Job, run_comparison
from zosoma.experiments.compare_config import load_comparison
from zosoma.experiments.price import ladder, price, time_to
from zosoma.mixture.routing import cut_segments
from zosoma.model import reference
from zosoma.model.params import Layout, init_params
from zosoma.training.folder import RunFolder

torch = pytest.importorskip("torch", reason="PyTorch is the backprop extra (and in the test extra)")

pytestmark = pytest.mark.usefixtures("scratch_cwd")

TOML = """
title = "price mini"
seeds = [0, 1]
curve_points = 3
curve_spacing = "log"
curve_bytes = 1024
price_levels = [5.4]
train = {batch = 2, seq_len = 8}

[[method]]
name = "SPSA P=2"
seeds = [0]
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 0.05}
steps = 4

[[method]]
name = "backprop"
model = {embed = 4, hidden = 8, layers = 1}
train = {optimizer = "backprop", lr = 0.01}
steps = 12
"""


def tiny(seed=0):
    """A float64 theta (d,) of a tiny model with every bias non-zero, its layout, and a (B, T+1) batch."""
    config = ModelConfig(embed=3, hidden=4, layers=2)
    layout = Layout(config)
    rng = np.random.default_rng([seed, 5])
    theta = init_params(config, seed).astype(np.float64)
    theta += rng.normal(0.0, 0.1, theta.shape)
    batch = rng.integers(0, 16, (2, 6), dtype=np.uint8)  # few byte values: their embedding rows get gradient
    return theta, layout, batch


def test_the_gradient_equals_central_finite_differences_of_zosomas_reference_loss():
    """Autograd's gradient, in zosoma's layout (flat_grad), against (L(theta + h e) - L(theta - h e)) / 2h
    of zosoma's NumPy reference loss (float64), for coordinates of every tensor and random directions."""
    theta, layout, batch = tiny()
    model = backprop.torch_model(theta, layout, torch.float64)
    backprop.mean_loss(model, batch).backward()
    grad = backprop.flat_grad(model, layout)
    h = 1e-6

    def central(direction):
        return (reference.loss(theta + h * direction, layout, batch)
                - reference.loss(theta - h * direction, layout, batch)) / (2 * h)

    rng = np.random.default_rng(1)
    coords = [e.offset + int(i) for e in layout.entries for i in rng.choice(e.size, min(e.size, 12), replace=False)]
    coords += [layout["embed"].offset + int(batch[0, 0]) * layout.config.embed]  # a row the batch uses
    numeric = np.array([central(np.eye(1, layout.size, c)[0]) for c in coords])
    assert_close(grad[coords], numeric, atol=1e-8, rtol=1e-6, name="dL/dtheta_i")
    assert np.abs(numeric).max() > 1e-3  # the check is not of zeros alone
    for _ in range(4):
        d = rng.standard_normal(layout.size)
        assert_close(grad @ d, central(d), atol=1e-8, rtol=1e-6, name="directional derivative")


def test_trained_weights_score_in_zosoma_as_pytorch_scores_them():
    """A few Adam steps, then the weights back in theta (float32): zosoma's segment evaluator
    gives the nats/byte that PyTorch computes on the same segments with the same model."""
    layout = Layout(ModelConfig(embed=8, hidden=16))
    model = backprop.torch_model(init_params(layout.config, 0), layout)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rng = np.random.default_rng(2)
    text = np.frombuffer(b"the cat sat on the mat; " * 80, np.uint8)
    for _ in range(20):
        start = rng.integers(0, text.size - 17, 4)
        opt.zero_grad()
        backprop.mean_loss(model, np.stack([text[s:s + 17] for s in start])).backward()
        opt.step()
    theta = backprop.theta_of(model, layout)
    assert theta.dtype == np.float32 and theta.shape == (layout.size,)

    from zosoma.engines import get_ops
    from zosoma.mixture.routing import Ensemble, Whole, evaluate_routed

    zosoma_nats = evaluate_routed(Ensemble(((theta, layout),), Whole()), text, segment=64, context=32,
                                  ops=get_ops("cpu"))["routed"].nats_per_byte
    segs = cut_segments(text, 64, 32)
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(segs.tokens.astype(np.int64)))
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(
            segs.targets.astype(np.int64)).reshape(-1), reduction="none").reshape(segs.tokens.shape).double().numpy()
    torch_nats = float(np.where(segs.mask(), nll, 0.0).sum()) / segs.n_bytes
    assert zosoma_nats < 4.0  # it learned something: the check is not of a uniform model
    assert zosoma_nats == pytest.approx(torch_nats, rel=1e-5)


def test_backprop_trains_on_the_batches_zosoma_train_draws(tmp_path, monkeypatch):
    """Its minibatches are BatchSampler's at (seed, expert 0's stream, step), as a single ZO run's."""
    path = tmp_path / "p.toml"
    path.write_text(TOML)
    cmp = load_comparison(path)
    job = Job("bp", cmp.methods[1], 1, cmp)
    drawn = []
    real = backprop.BatchSampler.batch
    monkeypatch.setattr(backprop.BatchSampler, "batch", lambda self, *a: drawn.append(a) or real(self, *a))
    run = backprop.BackpropRun(RunFolder(tmp_path / "run"), job.spec)
    assert run.advance(3, lambda: False)
    assert drawn == [(1, 0, step, 2) for step in range(3)]
    assert run.totals() == {"step": 3, "tokens": 3 * 2 * 8, "wall_s": run.wall_s,
                            "flops": 3.0 * 3 * 2 * 8 * layer_flops(cmp.methods[1].model)}


def layer_flops(model):
    return model.flops_per_token()


@pytest.mark.slow
def test_a_comparison_with_backprop_writes_the_price_of_zero_order(tmp_path):
    """A ZO method and backprop: each run's curve has CPU-seconds, backprop's FLOPs count the backward at
    2x, a method's seeds are its own, and the report has the price table and price.png."""
    path = tmp_path / "p.toml"
    path.write_text(TOML)
    cmp = load_comparison(path)
    assert [j.name for j in __import__("zosoma.experiments.compare", fromlist=["jobs"]).jobs(cmp)] == [
        "spsa-p-2-seed0", "backprop-seed0", "backprop-seed1"]
    paths = run_comparison(cmp, tmp_path / "out")
    import json
    bp = json.loads((tmp_path / "out/runs/backprop-seed0/result.json").read_text())
    assert bp["kind"] == "backprop" and bp["steps"] == 12 and bp["tokens"] == 12 * 16
    assert bp["flops"] == 3 * bp["tokens"] * cmp.methods[1].model.flops_per_token()
    assert [p["step"] for p in bp["curve"]] == [0, 3, 6, 12]
    cpu = [p["cpu_s"] for p in bp["curve"]]
    assert cpu == sorted(cpu) and cpu[-1] > 0 and bp["cpu_s"] == cpu[-1]
    assert bp["heldout"]["overall"] < 5.545  # it trained
    report = paths["results.md"].read_text()
    assert "The price of zero-order" in report and "| 5.400 |" in report
    assert paths["price.png"].stat().st_size > 0


def test_time_to_a_level_is_interpolated_between_curve_points():
    curve = [{"cpu_s": 0.0, "heldout": 5.5}, {"cpu_s": 10.0, "heldout": 3.5}, {"cpu_s": 30.0, "heldout": 2.5}]
    assert time_to(curve, 4.5) == pytest.approx(5.0)
    assert time_to(curve, 3.0) == pytest.approx(20.0)
    assert time_to(curve, 5.5) == 0.0
    assert time_to(curve, 2.4) is None


def test_the_price_is_the_mean_over_seeds_and_the_ratio_to_the_fastest_backprop():
    def run(method, kind, seconds):
        return {"method": method, "kind": kind, "seed": 0,
                "curve": [{"step": 0, "cpu_s": 0.0, "heldout": 5.0}, {"step": 1, "cpu_s": seconds, "heldout": 2.0}]}
    results = [run("zo", "spsa", 300.0), run("zo", "spsa", 500.0), run("bp", "backprop", 4.0), run("bp2", "backprop", 8.0)]
    (row,) = price(results, ladder([3.5], None))
    assert row["cpu_s"] == {"zo": 200.0, "bp": 2.0, "bp2": 4.0}  # each halfway
    assert row["ratio"] == {"zo": 100.0, "bp": 1.0, "bp2": 2.0}
    (row,) = price(results[:1] + [run("zo", "spsa", 1.0) | {"curve": [{"step": 0, "cpu_s": 0, "heldout": 5.0}]}],
                   ladder([3.5], None))
    assert row["cpu_s"] == {"zo": None}  # one seed did not reach it: not reached


@pytest.mark.parametrize("text, message", [
    ('train = {optimizer = "backprop", perturbations = 4}', "a backprop method reads only .*; not perturbations"),
    ('train = {optimizer = "backprop"}\nexperts = 2', r"a backprop method trains one model \(experts = 1\)"),
    ('train = {optimizer = "backprop"}\nseeds = [5]', r"seeds \[5\] must be some of the comparison's \[0, 1\]"),
    ('train = {optimizer = "backprop", schedule = "linear"}', "schedule must be constant or cosine"),
])
def test_bad_backprop_methods_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "p.toml"
    path.write_text(TOML.replace('train = {optimizer = "backprop", lr = 0.01}', text))
    with pytest.raises(ConfigError, match=message):
        load_comparison(path)


def test_without_a_budget_every_method_gives_its_steps(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(TOML.replace("steps = 4\n", ""))
    with pytest.raises(ConfigError, match=r"give the comparison a budget \(flops\) or the method its steps"):
        load_comparison(path)


def test_without_pytorch_the_baseline_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "p.toml").write_text(TOML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if not installed
    result = run_cli(["compare", "p.toml", "--out", "out", "--jobs", "1"])
    assert one_line_error(result) == f"Error: {backprop.MISSING}"


@pytest.mark.slow
@pytest.mark.subprocess
def test_zosomas_own_training_needs_no_torch(tmp_path):
    """Training runs with torch not importable, and never loads the backprop baseline (torch may
    still be imported where installed: tensorboardX imports it for its own conversions)."""
    code = ("import sys; sys.modules['torch'] = None; from zosoma.api import train; "
            f"train(run_dir={str(tmp_path / 'run')!r}, embed=4, hidden=4, steps=2, perturbations=2); "
            "assert 'zosoma.experiments.backprop' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- issue 45: a backprop run under signals keeps a checkpoint and resumes from it bit for bit ------

LONG = """
title = "backprop under signals"
seeds = [0]
curve_points = 4
curve_bytes = 1024
train = {batch = 2, seq_len = 8}

[[method]]
name = "backprop"
model = {embed = 16, hidden = 64, layers = 1}
train = {optimizer = "backprop", lr = 0.01}
steps = 1200
"""


class StopAfter:
    """A stop request, true from its n-th poll on (one poll per step)."""

    def __init__(self, n):
        self.polls, self.n = 0, n

    def __call__(self):
        self.polls += 1
        return self.polls > self.n


def curve_events(folder) -> list[int]:
    """The steps of every eval/heldout_curve event in the folder's event files, as written."""
    import struct

    from tensorboardX.proto import event_pb2
    steps = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            steps += [event.step for v in event.summary.value if v.tag == "eval/heldout_curve"]
            at += 16 + n
    return steps


def test_a_stopped_backprop_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """It started again at step 0 (and wrote its first curve points into its events twice)."""
    from zosoma.experiments.compare import Job
    from zosoma.experiments.study import run_job

    path = tmp_path / "p.toml"
    path.write_text(TOML)
    cmp = load_comparison(path)
    method = cmp.methods[1]
    whole = run_job(Job("whole", method, 0, cmp), tmp_path / "whole")
    part = Job("part", method, 0, cmp)
    assert run_job(part, tmp_path / "part", stopping=StopAfter(8)) is None  # stopped part way
    stopped = RunFolder(tmp_path / "part").read_checkpoint().step
    assert 3 <= stopped < 12 and [p["step"] for p in RunFolder(tmp_path / "part").read_curve()][-1] <= stopped
    from zosoma.errors import ConfigError
    from zosoma.runs.single import resume_run
    with pytest.raises(ConfigError, match="is a backprop run of a comparison: run the same zosoma compare command"):
        list(resume_run(tmp_path / "part", ops=Ops()))  # zosoma train --resume: it is not zosoma's to train
    resumed = run_job(part, tmp_path / "part")
    for key in ("heldout", "steps", "step", "tokens", "flops", "final_train_loss", "checkpoint_steps"):
        assert resumed[key] == whole[key], key
    assert [(p["step"], p["heldout"]) for p in resumed["curve"]] == [(p["step"], p["heldout"]) for p in whole["curve"]]
    a, b = (RunFolder(tmp_path / name).read_checkpoint() for name in ("whole", "part"))
    assert np.array_equal(a.theta, b.theta) and a.step == b.step == 12
    assert a.optimizer.keys() == b.optimizer.keys()  # the torch weights and AdamW's state, bit for bit
    assert all(np.array_equal(a.optimizer[k], b.optimizer[k]) for k in a.optimizer)
    assert curve_events(tmp_path / "part") == curve_events(tmp_path / "whole") == [0, 3, 6, 12]  # each point once
    assert run_job(part, tmp_path / "part") == resumed  # finished: read back, not trained again


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_stops_a_backprop_run_with_its_checkpoint_and_the_rerun_goes_on(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import time

    from helpers import zosoma_cmd

    (tmp_path / "p.toml").write_text(LONG)
    cmd = zosoma_cmd() + ["compare", str(tmp_path / "p.toml"), "--jobs", "1", "--out"]
    run = tmp_path / "cut" / "runs" / "backprop-seed0"
    proc = subprocess.Popen(cmd + [str(tmp_path / "cut")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while len(RunFolder(run).read_curve() if run.exists() else []) < 2 and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopping after this step (a second signal stops at once, keeping the newest checkpoint)" in err
    stopped = RunFolder(run).read_checkpoint().step
    points = [p["step"] for p in RunFolder(run).read_curve()]
    assert 0 < points[-1] <= stopped < 1200 and not (run / "result.json").exists()
    for out_dir in ("cut", "whole"):  # the rerun goes on from the checkpoint; a run never stopped, to compare
        done = subprocess.run(cmd + [str(tmp_path / out_dir)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    cut, whole = (json.loads((tmp_path / d / "runs" / "backprop-seed0" / "result.json").read_text())
                  for d in ("cut", "whole"))
    assert cut["heldout"] == whole["heldout"] and cut["step"] == whole["step"] == 1200
    assert [(p["step"], p["heldout"]) for p in cut["curve"]] == [(p["step"], p["heldout"]) for p in whole["curve"]]
    assert curve_events(run) == [p["step"] for p in whole["curve"]]  # each point once, in order
