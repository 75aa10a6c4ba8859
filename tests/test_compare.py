"""The equal-compute harness: configs, budgets, resumable runs, one evaluation protocol."""

import csv
import dataclasses
import json
import re
import signal
import subprocess

import numpy as np
import pytest

from helpers import one_line_error, run_cli, zosoma_cmd
from zosoma.engines.ops import Ops
from zosoma.experiments.compare import Job, check_folder, curve_steps, jobs, run_comparison
from zosoma.experiments.compare_config import find_config, load_comparison
from zosoma.experiments.study import JobRun, run_job
from zosoma.errors import ConfigError
from zosoma.training.folder import SETTINGS, RunFolder
from zosoma.model.evaluate import EvalResult
from zosoma.engines.cpu.forward import nll_stream
from zosoma.mixture.routing import cut_segments


def header(title, seeds, flops, curve_bytes):
    """The top of a comparison's TOML as the tests here write it: its budget, its curve, its batches."""
    return (f'\ntitle = "{title}"\nseeds = {seeds}\nflops = {flops}\ncurve_points = 2\ncurve_bytes = {curve_bytes}\n'
            'train = {batch = 2, seq_len = 8}\n')


MINI = header("mini", [0, 1], "4e9", 1024) + """
[[method]]
name = "SOMA N=2"
experts = 2
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 0.05}  # 0.1 diverged on an AVX2 machine: keep clear of the edge

[[method]]
name = "SPSA P=2"
model = {embed = 6, hidden = 11, layers = 1}
train = {perturbations = 2, lr = 0.05}

[ablation]
seeds = [0]
experts = 2
steps = 3
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2}
"""


pytestmark = pytest.mark.usefixtures("scratch_cwd")


@pytest.fixture
def restore_sigint():
    """The command's Ctrl-C handler stays for its process: put pytest's back after a CliRunner run."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def mini(tmp_path):
    path = tmp_path / "mini.toml"
    path.write_text(MINI)
    return load_comparison(path)


def test_budget_sets_each_methods_steps(mini):
    soma, spsa = mini.methods
    for m in (soma, spsa):
        assert m.train.steps == int(mini.flops // m.flops_per_step())
        assert m.flops_per_step() * m.train.steps <= mini.flops < m.flops_per_step() * (m.train.steps + 1)
    assert soma.flops_per_step() == 2 * 2 * 2 * 2 * 8 * soma.model.flops_per_token()  # N * 2P * B * T
    assert [m.loss for m in mini.ablation] == ["independent", "summed"]
    assert all(m.train.steps == 3 for m in mini.ablation)
    assert len(jobs(mini)) == 2 * 2 + 2


def test_shipped_configs_load():
    cpu = load_comparison(find_config("cpu"))
    assert {m.kind for m in cpu.methods} == {"soma", "spsa", "eggroll", "es"}
    assert cpu.tuning is not None and cpu.tuning.lr_factors == (0.5, 1.0, 2.0)
    assert len(cpu.seeds) >= 3 and len(cpu.ablation_seeds) >= 3
    sizes = [m.experts * m.model.n_params() for m in cpu.methods]
    assert max(sizes) / min(sizes) < 1.02  # the same total parameter count, within 2%
    spent = [m.flops_per_step() * m.train.steps for m in cpu.methods]
    assert max(spent) <= cpu.flops and min(spent) > 0.98 * cpu.flops
    curve = load_comparison(find_config("ncurve"))
    assert curve.eval_top_k == (1, 2, 4) and {s for m in curve.methods for s in m.series} == {"equal params",
                                                                                                 "expert size"}
    equal = [m.experts * m.model.n_params() for m in curve.methods if "equal params" in m.series]
    assert max(equal) / min(equal) < 1.05 and sorted(m.experts for m in curve.methods
                                                     if "equal params" in m.series) == [1, 2, 4, 8, 16]
    assert curve.tuning.methods == ("N=4 E=20 H=40", "N=8 E=16 H=20", "N=16 E=8 H=12")
    paper = load_comparison(find_config("paper"))
    assert abs(paper.methods[0].experts * paper.methods[0].model.n_params() / 8.44e6 - 1) < 0.001


@pytest.mark.parametrize("text, message", [
    (MINI.replace("curve_points", "curve_pionts"), "unknown key"),
    (MINI.replace('flops = 4e9', ''), r"give the comparison a budget \(flops\) or the method its steps"),
    (MINI.replace('curve_points = 2', 'curve_spacing = "square"'), "curve_spacing must be one of linear, log"),
    (MINI.replace('curve_points = 2', 'price_levels = [2.5, -1]'), "price_levels must be a positive finite number"),
    (MINI.replace('flops = 4e9', 'flops = 10'), "less than one step"),
    (MINI.replace('lr = 0.05}', 'lr = 0.05, rank = 2}'), "--rank is not used by --optimizer sgd"),
    (MINI.replace('train = {perturbations = 2, lr = 0.05}', 'train = {steps = 5}'), "set by the comparison"),
    (MINI.replace('"SPSA P=2"', '"SOMA N=2"'), "distinct"),
    (MINI.replace("layers = 1}", "layers = 0}", 1), "layers must be at least 1"),
    ("title = [", "bad.toml"),
    (MINI + '[tuning]\nmethods = ["SPSA P=3"]\n', "no such method"),
    (MINI.replace('experts = 2\nmodel', 'experts = 0\nmodel', 1), r"SOMA N=2: experts must be an integer >= 1, got 0"),
    (MINI.replace('curve_points = 2', 'curve_points = 2.5'),
     r"curve_points must be an integer >= 1, got 2.5"),
    (MINI.replace('curve_points = 2', 'eval_top_k = [0]'), r"eval_top_k must be an integer >= 1, got 0"),
])
def test_bad_configs_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_comparison(path)


TRAIN_KEYS = r"\(known: batch, beta2, (\w+, )*perturbations, "  # every TrainConfig field but those the comparison sets


@pytest.mark.parametrize("old, new, message", [
    # a typo inside a method's, the shared or the ablation's train and model tables
    ("train = {perturbations = 2, lr = 0.05}  #", "train = {perturbatons = 2, lr = 0.05}  #",
     r"bad.toml \[\[method\]\] SOMA N=2 train: unknown key\(s\) perturbatons " + TRAIN_KEYS),
    ("model = {embed = 4,", "model = {embd = 4,",
     r"bad.toml \[\[method\]\] SOMA N=2 model: unknown key\(s\) embd \(known: embed, hidden, layers\)$"),
    ("train = {batch = 2, seq_len = 8}", "train = {batch = 2, seq_len = 8, batchh = 3}",
     r"bad.toml train: unknown key\(s\) batchh " + TRAIN_KEYS),
    ("train = {perturbations = 2}\n", "train = {perturbations = 2, lrr = 1}\n",
     r"bad.toml \[ablation\] train: unknown key\(s\) lrr " + TRAIN_KEYS),
    ("steps = 3\nmodel = {embed = 4,", "steps = 3\nmodel = {embed = 4, hiden = 3,",
     r"bad.toml \[ablation\] model: unknown key\(s\) hiden \(known: embed, hidden, layers\)$"),
    # a budget that is no number of FLOPs
    ("flops = 4e9", "flops = inf", r"bad.toml: flops must be a positive finite number, got inf$"),
    ("flops = 4e9", "flops = nan", r"bad.toml: flops must be a positive finite number, got nan$"),
    ("flops = 4e9", "flops = 0", r"bad.toml: flops must be a positive finite number, got 0$"),
    ("flops = 4e9", "flops = -4e9", r"bad.toml: flops must be a positive finite number, got -4000000000.0$"),
    ("flops = 4e9", 'flops = "4e9"', r"bad.toml: flops must be a positive finite number, got '4e9'$"),
    ("flops = 4e9", "flops = true", r"bad.toml: flops must be a positive finite number, got True$"),
    # seeds no run can take, found before any run starts
    ("seeds = [0, 1]", "seeds = [-1]", r"bad.toml: seeds must be integers in \[0, 2\*\*63\), got -1$"),
    ("seeds = [0, 1]", "seeds = [9223372036854775807, 1.5]", r"bad.toml: seeds must be integers in .*, got 1.5$"),
    ("seeds = [0, 1]", "seeds = [9223372036854775808]", r"bad.toml: seeds must be integers in .*, got 9223372036854775808$"),
    ("seeds = [0, 1]", "seeds = [0, 0]", r"bad.toml: seeds must be distinct, got \[0, 0\]$"),
    ("seeds = [0, 1]", "seeds = 1", r"bad.toml: seeds must be a list, got 1$"),
    ("seeds = [0]\nexperts", "seeds = [-2]\nexperts",
     r"bad.toml \[ablation\]: seeds must be integers in \[0, 2\*\*63\), got -2$"),
    ("[ablation]", "[tuning]\nseed = -1\n\n[ablation]",
     r"bad.toml \[tuning\]: seed must be an integer in \[0, 2\*\*63\), got -1$"),
    # every method's settings as a run would take them, checked when the file is read
    ("train = {perturbations = 2, lr = 0.05}  #", "train = {perturbations = 3.5, lr = 0.05}  #",
     r"bad.toml \[\[method\]\] SOMA N=2: perturbations must be an integer, got 3.5$"),
    ("train = {perturbations = 2, lr = 0.05}  #", 'train = {perturbations = 2, lr = 0.05, shaping = "clipp"}  #',
     r"bad.toml \[\[method\]\] SOMA N=2: unknown shaping 'clipp' \(known: clip, normalize\)$"),
    ("experts = 2\nmodel", 'experts = 2\nloss = "bogus"\nmodel',
     r"bad.toml \[\[method\]\] SOMA N=2: loss must be one of independent, summed, got 'bogus'$"),
    ("train = {batch = 2, seq_len = 8}", "train = {batch = 2, seq_len = 8, clip_at = 3.0}",
     r"bad.toml \[\[method\]\] SOMA N=2: --clip-at is read only with --shaping clip, which this run does not use$"),
    ("model = {embed = 6, hidden = 11,", "model = {embed = 6, hidden = 1000000,",
     r"bad.toml \[\[method\]\] SPSA P=2: one training step needs at least .* GB of memory .* lower --hidden"),
])
def test_bad_configs_through_the_command_line(tmp_path, restore_sigint, old, new, message):
    """Exit code 1, one line saying what is wrong, no traceback, nothing written."""
    assert old in MINI
    (tmp_path / "bad.toml").write_text(MINI.replace(old, new, 1))
    for plan in ([], ["--plan"]):
        line = one_line_error(run_cli(["compare", "bad.toml", "--out", "out", "--jobs", "1", *plan]), 1)
        assert re.search("^Error: " + message, line), line
    assert not (tmp_path / "out").exists()


def test_a_plan_checks_the_device_as_a_run_does(tmp_path, restore_sigint):
    """compare --plan --device cuda printed a plan on a machine without a GPU."""
    from zosoma.engines.cuda.backend import cuda_unavailable_reason
    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is here: --device cuda is right")
    (tmp_path / "mini.toml").write_text(MINI)
    lines = [one_line_error(run_cli(["compare", "mini.toml", "--out", "out", "--device", "cuda", *plan]), 1)
             for plan in (["--plan"], [])]
    assert lines[0] == lines[1] and lines[0].startswith("Error: --device cuda: no CUDA device")
    assert not (tmp_path / "out").exists()


# a record of MINI's SOMA run (no eval_top_k) as the report reads it; the cases below damage it
GOOD = {"method": "SOMA N=2", "kind": "soma", "seed": 0, "experts": 2, "n_params": 9, "steps": 3, "flops": 1.0,
        "wall_s": 1, "model": {}, "train": {}, "heldout": {"overall": 2.5, "drama": 2.4}, "wikitext103": None,
        "heldout_by_k": {}, "loss": "independent", "series": [], "skipped_steps": 0, "final_train_loss": 2.6,
        "divergence": None, "restarts": [{"expert": 1, "step": 3, "to": 0, "lr_scale": 0.5}],
        "dropped": [{"expert": 1, "step": 3, "verdict": "rising"}],
        "curve": [{"step": 0, "flops": 0.0, "wall_s": 0.0, "heldout": 5.5, "cpu_s": 0.0}]}


@pytest.mark.parametrize("record, problem", [
    ("[1, 2]", r"it is \[1, 2\], not a JSON object"),
    ('{"method": "SOMA N=2"}', "no kind"),
    ('{"method": "SOMA N=2", "kind": "soma", "seed": 0, "experts": 2, "n_params": 9, "steps": 3, "flops": 1.0, '
     '"wall_s": 1, "curve": [], "model": {}, "train": 5, "heldout": {"overall": 2.5}, "wikitext103": null}',
     "train is 5"),
    ('{"method": "SOMA N=2", "kind": "soma", "seed": 0, "experts": 2, "n_params": 9, "steps": 3, "flops": 1.0, '
     '"wall_s": 1, "curve": [], "model": {}, "train": {}, "heldout": {"overall": "2.5"}, "wikitext103": null}',
     'heldout.overall is "2.5"'),
    # issue 45: the right outer shape, the wrong inner one (a KeyError and a TypeError in the report)
    (json.dumps({**GOOD, "curve": [{"a": 1}]}), r"no curve\[0\]\.step"),
    (json.dumps({**GOOD, "restarts": 5}), "restarts is 5, not a list"),
])
def test_a_result_record_of_the_wrong_shape_is_one_line_saying_how_to_write_it_again(tmp_path, restore_sigint,
                                                                                      record, problem):
    """JSON that the report cannot read: refused at --plan as at a run, as a record cut short is."""
    (tmp_path / "mini.toml").write_text(MINI)
    done = tmp_path / "out" / "runs" / "soma-n-2-seed0" / "result.json"
    done.parent.mkdir(parents=True)
    done.write_text(record)
    for plan in (["--plan"], []):
        line = one_line_error(run_cli(["compare", "mini.toml", "--out", "out", "--jobs", "1", *plan]), 1)
        assert re.search(f"^Error: {re.escape(str(done.relative_to(tmp_path)))} is damaged \\({problem}\\): delete "
                         "it; run the same command again: it scores the run again from its checkpoints$", line), line
    assert done.read_text() == record


@pytest.mark.parametrize("damage, problem", [
    ({"curve": [{"a": 1}]}, "no curve[0].step"),
    ({"curve": [GOOD["curve"][0], {**GOOD["curve"][0], "heldout": True}]}, "curve[1].heldout is true"),
    ({"curve": {"step": 0}}, 'curve is {"step": 0}, not a list'),
    ({"restarts": 5}, "restarts is 5, not a list"),
    ({"restarts": [{"expert": 1, "step": 3, "to": 0}]}, "no restarts[0].lr_scale"),
    ({"dropped": [{"expert": "1", "step": 3}]}, 'dropped[0].expert is "1"'),
    ({"divergence": {"step": 3, "verdict": "rising"}}, 'divergence is {"step": 3, "verdict": "rising"}, not a list'),
    ({"divergence": [{"expert": 0, "step": 3}]}, "no divergence[0].verdict"),
    ({"heldout": {"overall": 2.5, "drama": None}}, "heldout.drama is null"),
    ({"heldout": {"drama": 2.4}}, "no heldout.overall"),
    ({"series": "N"}, 'series is "N", not a list'),
    ({"final_train_loss": "2.6"}, 'final_train_loss is "2.6"'),
    ({"heldout_by_k": []}, "heldout_by_k is [], not a JSON object"),
])
def test_every_part_of_a_result_record_the_report_reads_is_checked(mini, damage, problem):
    from zosoma.training.json_shape import record_problem
    job = jobs(mini)[0]
    assert job.name == "soma-n-2-seed0" and record_problem(GOOD, job.record_shape) is None
    assert record_problem({**GOOD, **damage}, job.record_shape) == problem
    older = {k: v for k, v in GOOD.items() if k not in ("restarts", "dropped", "series", "skipped_steps", "loss")}
    assert record_problem(older, job.record_shape) is None  # what the report reads only where present


def test_a_comparison_with_a_price_table_needs_its_runs_cpu_seconds(tmp_path):
    cmp = load_comparison_text(tmp_path, MINI.replace('title = "mini"', 'title = "mini"\nprice_levels = [3.0]'))
    point = {k: v for k, v in GOOD["curve"][0].items() if k != "cpu_s"}
    from zosoma.training.json_shape import record_problem
    assert record_problem({**GOOD, "curve": [point]}, jobs(cmp)[0].record_shape) == "no curve[0].cpu_s"


def test_curve_steps():
    assert curve_steps(100, 4) == [0, 25, 50, 75, 100]
    assert curve_steps(10, 3) == [0, 4, 7, 10]
    assert curve_steps(2, 8) == [0, 1, 2]
    assert curve_steps(10000, 4, "log") == [0, 10, 100, 1000, 10000]


def test_a_methods_own_steps_and_seeds(tmp_path):
    """A method's steps replace the budget's, and its seeds are some of the comparison's."""
    path = tmp_path / "own.toml"
    path.write_text(MINI.replace('name = "SPSA P=2"', 'name = "SPSA P=2"\nsteps = 7\nseeds = [1]'))
    cmp = load_comparison(path)
    assert cmp.methods[1].train.steps == 7
    assert [j.name for j in jobs(cmp) if j.curve] == ["soma-n-2-seed0", "soma-n-2-seed1", "spsa-p-2-seed1"]


def test_single_model_scored_by_the_segment_protocol(mini, tmp_path):
    """A monolithic model is a one-expert ensemble: its score is the model's own segment nats."""
    run = JobRun(RunFolder(tmp_path / "run"), Job("run", mini.methods[1], 0, mini).spec)
    data = run.heldout.docs[0][:3000]
    segs = cut_segments(data, mini.segment, mini.context)
    t = run.trainers[0]
    nll, _ = nll_stream(t.state.theta, t.layout, segs.tokens, segs.targets)
    expected = EvalResult(float(np.where(segs.mask(), nll.astype(np.float64), 0).sum()), segs.n_bytes)
    assert run.score_bytes(data) == pytest.approx(expected.nats_per_byte, rel=1e-12)


class _StopAfter:
    """Stands in for the executor's stop request: true from its n-th poll on (one poll per step)."""

    def __init__(self, n):
        self.polls, self.n = 0, n

    def __call__(self):
        self.polls += 1
        return self.polls > self.n


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_a_run_resumed_midway_equals_an_uninterrupted_one(mini, tmp_path, which):
    method = mini.methods[which]
    whole = run_job(Job("whole", method, 1, mini), tmp_path / "whole")
    part = Job("part", method, 1, mini)
    # the executor asks every run to stop, a third of the way in
    assert run_job(part, tmp_path / "part", stopping=_StopAfter(method.train.steps // 3)) is None
    assert 0 < len(RunFolder(tmp_path / "part").read_curve()) < mini.curve_points + 1
    resumed = run_job(part, tmp_path / "part")
    for key in ("heldout", "wikitext103", "steps", "flops", "n_params"):
        assert resumed[key] == whole[key]
    assert [p["heldout"] for p in resumed["curve"]] == [p["heldout"] for p in whole["curve"]]
    assert [p["step"] for p in whole["curve"]] == curve_steps(method.train.steps, mini.curve_points)
    assert whole["curve"][0]["heldout"] > whole["curve"][-1]["heldout"]  # it learned
    assert whole["kind"] == ("soma" if which == 0 else "spsa")
    assert set(whole["heldout"]) == {"drama", "scripture", "legal", "code_python", "code_c", "tech_docs",
                                     "dictionary", "multilingual", "overall"}


@pytest.mark.slow
def test_a_finished_run_is_not_repeated(mini, tmp_path):
    job = Job("run", mini.methods[1], 0, mini)
    first = run_job(job, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint.h5"
    stamp = ckpt.stat().st_mtime_ns
    assert run_job(job, tmp_path / "run") == json.loads((tmp_path / "run" / "result.json").read_text()) == first
    assert ckpt.stat().st_mtime_ns == stamp


WILD = header("wild", [0], "4e8", 256) + """
[[method]]
name = "SPSA wild"
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 1000.0, on_divergence = "stop"}
"""


@pytest.mark.slow
def test_a_record_the_run_has_trained_past_is_scored_again_never_reused(tmp_path):
    from zosoma.runs.single import resume_run
    cmp = load_comparison_text(tmp_path, WILD)
    job, run = Job("run", cmp.methods[0], 0, cmp), tmp_path / "run"
    first = run_job(job, run)
    assert first["divergence"] and first["checkpoint_steps"] == [first["step"]] < [cmp.methods[0].train.steps]
    # `zosoma train --resume` goes on past the guard's stop; stopped part way, the record is stale
    list(resume_run(run, should_stop=_StopAfter(30), ops=Ops()))
    now = RunFolder(run).read_checkpoint().step
    assert now == first["step"] + 30
    again = run_job(job, run)
    assert again["step"] == now and again["checkpoint_steps"] == [now] and again["heldout"] != first["heldout"]
    assert run_job(job, run) == again  # current: read back
    # an extension changes the run's configuration: refused, not answered with the old record
    list(resume_run(run, steps=cmp.methods[0].train.steps + 100, should_stop=_StopAfter(5), ops=Ops()))
    with pytest.raises(ConfigError, match="another configuration .*train.steps was"):
        run_job(job, run)


def test_a_changed_config_is_refused(mini, tmp_path):
    JobRun(RunFolder(tmp_path / "run"), Job("run", mini.methods[1], 0, mini).spec).advance(1, lambda: False)
    other = load_comparison_text(tmp_path, MINI.replace("lr = 0.05", "lr = 0.07"))
    with pytest.raises(ConfigError, match="another configuration"):
        run_job(Job("run", other.methods[1], 0, other), tmp_path / "run")


@pytest.mark.slow
def test_a_soma_run_with_another_expert_count_is_refused(mini, tmp_path):
    JobRun(RunFolder(tmp_path / "run"), Job("run", mini.methods[0], 0, mini).spec)
    other = load_comparison_text(tmp_path, MINI.replace("experts = 2\nmodel", "experts = 3\nmodel", 1))
    with pytest.raises(ConfigError, match="another configuration"):
        run_job(Job("run", other.methods[0], 0, other), tmp_path / "run")


# flops: a few steps per run
TINY = header("tiny", [0], "4e6", 256) + """
[[method]]
name = "SPSA small"
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 0.05}

[[method]]
name = "SPSA wide"
model = {embed = 6, hidden = 11, layers = 1}
train = {perturbations = 2, lr = 0.05}
"""


def compare_cli(*args):
    return run_cli(["compare", "my.toml", "--out", "out", "--jobs", "1", *args])


@pytest.mark.slow
def test_a_comparison_folder_is_bound_to_its_config(tmp_path, restore_sigint):
    """A rerun with a changed lr, budget or evaluation setting is refused in one line naming what
    changed (and --plan says so), never answered with the old runs, which stay as they were."""
    (tmp_path / "my.toml").write_text(TINY)
    plan = compare_cli("--plan")
    assert plan.exit_code == 0 and "2 runs, 0 already finished" in plan.output
    assert not (tmp_path / "out").exists()  # a plan writes nothing
    first = compare_cli()
    assert first.exit_code == 0, first.output
    runs = tmp_path / "out" / "runs"
    kept = {p: p.read_bytes() for p in [*runs.glob("*/result.json"), tmp_path / "out" / SETTINGS]}
    assert len(kept) == 3

    def refused(text):
        (tmp_path / "my.toml").write_text(text)
        lines = [one_line_error(compare_cli(*plan), 1) for plan in (["--plan"], [])]
        assert lines[0] == lines[1] and "another --out" in lines[0]
        assert {p: p.read_bytes() for p in kept} == kept
        return lines[0]

    line = refused(TINY.replace("lr = 0.05}", "lr = 0.03}", 1))
    assert line == ("Error: out/runs/spsa-small-seed0 (SPSA small, seed 0) was made with another configuration "
                    "(train.lr was 0.05, now 0.03): give this comparison another --out")
    line = refused(TINY.replace("flops = 4e6", "flops = 8e6"))
    was, now = (load_comparison_text(tmp_path, TINY.replace("4e6", f)).methods[0].train.steps for f in ("4e6", "8e6"))
    assert f"(SPSA small, seed 0) was made with another configuration (train.steps was {was}, now {now}; " in line
    line = refused(TINY.replace("curve_bytes = 256", "curve_bytes = 512").replace("[[method]]", "segment = 128\n\n"
                                                                                     "[[method]]", 1))
    assert line == ("Error: out was made with another configuration (curve_bytes was 256, now 512; "
                    "segment was 256, now 128): give this comparison another --out")
    (tmp_path / "my.toml").write_text(TINY)
    again = compare_cli()
    assert again.exit_code == 0 and "2 runs, 2 already finished" in again.output
    assert {p: p.read_bytes() for p in kept} == kept


def test_an_unfinished_run_of_another_config_is_refused_before_any_run_trains(tmp_path, restore_sigint):
    """Only a checkpoint (no result.json) of the old lr: the plan does not count the folder as
    usable, and no other run starts training in it."""
    (tmp_path / "my.toml").write_text(TINY)
    cmp = load_comparison(tmp_path / "my.toml")
    small, wide = jobs(cmp)
    assert run_job(small, tmp_path / "out" / "runs" / small.name, stopping=_StopAfter(2)) is None  # stopped at step 2, checkpointed
    (tmp_path / "my.toml").write_text(TINY.replace("lr = 0.05}", "lr = 0.03}", 1))
    for plan in (["--plan"], []):
        line = one_line_error(compare_cli(*plan), 1)
        assert "spsa-small-seed0 (SPSA small, seed 0) was made with another configuration (train.lr was 0.05" in line
    assert not (tmp_path / "out" / "runs" / wide.name).exists()


@pytest.mark.slow
def test_an_unfinished_soma_run_of_another_config_is_refused(mini, tmp_path):
    """A SOMA run's description and every expert's checkpoint are checked before anything trains."""
    soma = jobs(mini)[0]
    JobRun(RunFolder(tmp_path / "out" / "runs" / soma.name), soma.spec)  # created: every expert at step 0
    assert check_folder(mini, tmp_path / "out") == 0
    for old, new, what in [("lr = 0.05}", "lr = 0.07}", "train.lr was 0.05, now 0.07"),
                           ("experts = 2\nmodel", "experts = 3\nmodel", "experts was 2, now 3"),
                           ("[[method]]", "chunk_size = 1024\n\n[[method]]", "chunk_size was 2048, now 1024")]:
        other = load_comparison_text(tmp_path, MINI.replace(old, new, 1))
        with pytest.raises(ConfigError, match=re.escape(f"(SOMA N=2, seed 0) was made with another configuration "
                                                        f"({what}")):
            check_folder(other, tmp_path / "out")


def load_comparison_text(tmp_path, text):
    path = tmp_path / "other.toml"
    path.write_text(text)
    return load_comparison(path)


@pytest.mark.slow
def test_ablation_modes_share_start_data_and_noise(mini, tmp_path):
    runs = [JobRun(RunFolder(tmp_path / m.loss), Job(m.loss, m, 0, mini, False).spec) for m in mini.ablation]
    for a, b in zip(runs[0].trainers, runs[1].trainers):
        np.testing.assert_array_equal(a.state.theta, b.state.theta)
        np.testing.assert_array_equal(a.sampler.batch(0, a.expert, 2, 2), b.sampler.batch(0, b.expert, 2, 2))
        np.testing.assert_array_equal(a.losses()[0], b.losses()[0])


# flops: 150 steps
HOT = header("hot", [0], "4.7e7", 256) + """
[[method]]
name = "SPSA hot"         # runs away; its guard restarts it at step 70, from step 0 at lr 0.4
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 40, restart_lr_factor = 0.01}

[[method]]
name = "SPSA cool"
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 0.05}
"""


@pytest.mark.slow
def test_the_steps_a_restart_re_runs_count_against_the_budget(tmp_path):
    """Issue 33: a restarted run trained to its last step after re-running steps, so it spent
    more than the budget every run was said to have (cpu-robust's P=1024: 1.94e13 against
    1.5e13). It stops where its budget is spent, at a lower step, and the report says so."""
    cmp = load_comparison_text(tmp_path, HOT)
    run_comparison(cmp, tmp_path / "out")
    hot, cool = (json.loads((tmp_path / "out" / "runs" / j.name / "result.json").read_text()) for j in jobs(cmp))
    steps, per_step = cmp.methods[0].train.steps, cmp.methods[0].flops_per_step()
    rerun = sum(r["step"] - r["to"] for r in hot["restarts"])
    assert rerun > 0 and hot["step"] == steps - rerun  # it stopped short by the steps it re-ran
    assert hot["flops"] == cool["flops"] == steps * per_step <= cmp.flops  # the budget spent, and no more
    assert not cool["restarts"] and cool["step"] == steps  # a run with no restart: all its steps, as before
    assert [p["step"] for p in hot["curve"]][-1] == hot["step"] < steps  # its curve ends where it stopped
    assert len({p["step"] for p in hot["curve"]}) == len(hot["curve"])
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "out" / "results.csv").open())}
    assert [float(rows[m]["flops"]) for m in ("SPSA hot", "SPSA cool")] == [steps * per_step] * 2
    assert {rows[m]["over_budget"] for m in rows} == {"False"} and float(rows["SPSA hot"]["flops_budget"]) == cmp.flops
    table = (tmp_path / "out" / "results.md").read_text()
    assert "forward FLOPs spent" in table and "over budget" not in table and "budget, 4.70e7" in table


@pytest.mark.slow
@pytest.mark.subprocess
def test_compare_command_end_to_end(tmp_path):
    """Writes the table, CSV and plots; a second invocation repeats nothing."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    (tmp_path / "mini.toml").write_text(MINI.replace("seeds = [0, 1]", "seeds = [0]"))
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_bytes(b" = Valkyria Chronicles III = \n Senj\xc5\x8d no Valkyria 3 is a tactical role playing game .\n" * 60)
    cmd = zosoma_cmd() + ["compare", "mini.toml", "--out", "out", "--jobs", "2", "--wikitext", str(wiki)]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "finished spsa-p-2-seed0" in first.stdout
    out = tmp_path / "out"
    table = (out / "results.md").read_text()
    assert "| SOMA N=2 |" in table and "| SPSA P=2 |" in table and "Ablation" in table
    assert (out / "nats_vs_flops.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 2
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "4 already finished" in again.stdout
    bad = subprocess.run(zosoma_cmd() + ["compare", "missing.toml"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "missing.toml" in bad.stderr


@pytest.mark.slow
def test_es_is_a_comparison_method(tmp_path):
    """A strategy added through the registry is available to `zosoma compare` as it is."""
    path = tmp_path / "es.toml"
    path.write_text(MINI.split("[[method]]")[0] + """
[[method]]
name = "OpenAI-ES P=2"
model = {embed = 6, hidden = 11, layers = 1}
train = {optimizer = "es", perturbations = 2, eps = 0.02, lr = 0.002}
""")
    cmp = load_comparison(path)
    result = run_job(Job("run", cmp.methods[0], 0, cmp, False), tmp_path / "run")
    assert result["kind"] == "es" and result["train"]["optimizer"] == "es"
    assert result["steps"] == cmp.methods[0].train.steps and 0 < result["heldout"]["overall"] < 6


@pytest.mark.slow
def test_a_toml_es_method_without_eps_and_lr_trains_with_es_defaults(tmp_path):
    """The comparison resolves its methods as the command line does: a strategy's own defaults
    (ES: eps 0.02, lr 0.005) under what the method and the shared table give."""
    path = tmp_path / "es.toml"
    path.write_text(MINI.split("[[method]]")[0] + """
[[method]]
name = "OpenAI-ES P=2"
model = {embed = 6, hidden = 11, layers = 1}
train = {optimizer = "es", perturbations = 2}
""")
    cmp = load_comparison(path)
    assert (cmp.methods[0].train.eps, cmp.methods[0].train.lr) == (0.02, 0.005)
    result = run_job(Job("run", cmp.methods[0], 0, cmp, False), tmp_path / "run")
    assert (result["train"]["eps"], result["train"]["lr"]) == (0.02, 0.005)
    assert RunFolder(tmp_path / "run").read_checkpoint().train.eps == 0.02


@pytest.mark.slow
def test_equal_tuning_picks_each_methods_best_setting_on_validation(mini, tmp_path):
    """[tuning]: every method at each lr factor (and sigma factor for ES/EGGROLL), seed 0, the full
    budget, scored on the validation split; the main runs then use the winner."""
    from zosoma.experiments.compare import run_comparison, tuning_jobs
    from zosoma.experiments.compare_config import Tuning

    cmp = dataclasses.replace(mini, methods=mini.methods[1:], seeds=(0,), ablation=(), ablation_seeds=(),
                              tuning=Tuning(seed=0, lr_factors=(0.5, 2.0), sigma_factors=(1.0,)))
    sweep = tuning_jobs(cmp)
    assert [j.method.train.lr for j in sweep] == [0.025, 0.1] and all(j.tuning for j in sweep)
    paths = run_comparison(cmp, tmp_path / "out")
    results = {j.name: RunFolder(tmp_path / "out" / "runs" / j.name).read_result() for j in sweep}
    scores = [results[j.name]["validation"] for j in sweep]
    assert all("heldout" not in r for r in results.values())  # tuning never reads the held-out slices
    best = sweep[int(np.argmin(scores))].method.train.lr
    final = RunFolder(tmp_path / "out" / "runs" / "spsa-p-2-seed0").read_result()
    assert final["train"]["lr"] == best and "heldout" in final
    text = paths["results.md"].read_text()
    assert "## Tuning" in text and text.count("**yes**") == 1


@pytest.mark.slow
def test_tuning_only_the_methods_named(mini, tmp_path):
    """[tuning] methods = [...]: only those are swept; the others run every seed as configured."""
    from zosoma.experiments.compare import run_comparison, tuning_jobs
    from zosoma.experiments.compare_config import Tuning

    cmp = dataclasses.replace(mini, seeds=(0,), ablation=(), ablation_seeds=(),
                              tuning=Tuning(seed=0, lr_factors=(0.5, 2.0), methods=("SPSA P=2",)))
    sweep = tuning_jobs(cmp)
    assert [(j.method.name, j.method.train.lr) for j in sweep] == [("SPSA P=2", 0.025), ("SPSA P=2", 0.1)]
    paths = run_comparison(cmp, tmp_path / "out")
    soma = RunFolder(tmp_path / "out" / "runs" / "soma-n-2-seed0").read_result()
    assert soma["train"]["lr"] == 0.05 and "heldout" in soma
    text = paths["results.md"].read_text()
    assert text.count("| SPSA P=2 |") >= 2 and "| SOMA N=2 | lr" not in text
    # the main runs are bound to the tuned setting: a rerun finds every run finished and its own
    assert check_folder(cmp, tmp_path / "out") == len(sweep) + 2
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "runs").rglob("result.json")}
    run_comparison(cmp, tmp_path / "out")
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


# 40 steps at lr 400: every model runs away within them, and the run ends before the guard's
# warm-up (50 steps) is over, so no verdict ever comes
RUNAWAY = header("runaway", [0], "4e8", 256) + """
[[method]]
name = "SOMA runaway"
experts = 2
steps = 40
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 400}

[[method]]
name = "SPSA runaway"
steps = 40
model = {embed = 4, hidden = 8, layers = 1}
train = {perturbations = 2, lr = 400}
"""


@pytest.mark.slow
def test_runs_still_diverging_when_their_budget_ends_are_diverged_seeds(tmp_path):
    """Issue 45: such runs were reported at thousands of nats/byte with "diverged seeds 0"."""
    cmp = load_comparison_text(tmp_path, RUNAWAY)
    run_comparison(cmp, tmp_path / "out")
    for job, experts in zip(jobs(cmp), (2, 1)):
        r = json.loads((tmp_path / "out" / "runs" / job.name / "result.json").read_text())
        assert [d["expert"] for d in r["dropped"]] == list(range(experts)) and r["step"] == 40
        assert all(d["verdict"].startswith("rising when its budget ran out") for d in r["dropped"])
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "out" / "results.csv").open())}
    assert all(rows[m]["dropped"].count("step 40") == n for m, n in (("SOMA runaway", 2), ("SPSA runaway", 1)))
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    header_row = next(line for line in table if line.startswith("| method |")).split(" | ")
    column = header_row.index("diverged seeds")
    assert [line.split(" | ")[column] for line in table if "runaway |" in line] == ["1", "1"]
