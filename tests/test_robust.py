"""Robust training: coefficient shaping bounds a cliff-step and is checkpointed; a diverging model
is restarted (or dropped) on its own, the others untouched; every decision survives a kill."""

import dataclasses
import json
import subprocess

import numpy as np
import pytest

from helpers import zosoma_cmd
from world import TINY_MODEL as MODEL, tiny_args
from zosoma.engines.ops import Ops
from zosoma.config import TrainConfig, from_json, to_json
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.errors import ConfigError
from zosoma.workers.executor import Inline, LocalProcesses
from zosoma.training.folder import RunFolder
from zosoma.training.records import Diverged, Dropped, Evaluated, Finished, Restarted, Step
from zosoma.runs.soma import create_soma, load_ensemble, resume_soma
from zosoma.training.stepper import RESTART_STREAM
from zosoma.training.trainer import Trainer, from_checkpoint, new_state, train
from zosoma.strategies import make_strategy
from zosoma.strategies.base import check_options
from zosoma.strategies.es import OpenES
from zosoma.strategies.shaping import Chain, spread
from zosoma.strategies.shaping.clip import WARMUP
from zosoma.strategies.shaping.normalize import WARMUP as NORMALIZE_WARMUP

CFG = TrainConfig(optimizer="sgd", steps=120, batch=4, seq_len=16, perturbations=4, lr=0.2, checkpoint_every=20)


# --- shaping ---------------------------------------------------------------------------------------

def scalars(rng, steps, P=32, scale=1.0):
    return [rng.normal(0, scale, P) for _ in range(steps)]


def shaped(cfg, steps):
    chain, state, out = Chain(cfg), Chain(cfg).init(), []
    for g in steps:
        g, state, info = chain(g, state)
        out.append((g, info))
    return out, state


def test_normalize_holds_every_step_to_the_mean_spread_so_far():
    rng = np.random.default_rng(0)
    cfg = TrainConfig(optimizer="sgd", shaping=("normalize",), normalize_window=20)
    growing = [g * (1 + t / 10) for t, g in enumerate(scalars(rng, 100))]  # a run whose scalars grow
    out, state = shaped(cfg, growing)
    raw = [spread(g) for g in growing]  # never twice the mean before: every one enters as it is
    assert all(np.array_equal(g, r) for (g, _), r in zip(out[:NORMALIZE_WARMUP], growing))  # they measure
    held = [np.mean(raw[:t]) for t in range(NORMALIZE_WARMUP, 20)]  # then the mean of the steps before
    assert np.allclose([spread(g) for g, _ in out[NORMALIZE_WARMUP:20]], held, rtol=1e-12)
    assert np.allclose([spread(g) for g, _ in out[20:]], np.mean(raw[:20]), rtol=1e-12)  # then frozen
    assert state["normalize"] == {"steps": 20, "sum": pytest.approx(sum(raw[:20]))}


def test_a_climb_inside_the_window_is_held_to_the_steps_before():
    """cpu-robust's SPSA P=1024 at seed 2 began to climb at step 37 of its 50-step window: the
    window's steps went through as they were, and then their mean, the climb's steps in it, was
    the reference. Now they are held to the reference of the steps before, and enter it bounded."""
    rng = np.random.default_rng(4)
    steps = scalars(rng, 100)
    for t in range(41, 50):  # steps 42-50: the scalars' spread doubles every step
        steps[t] = steps[t] * 2.0 ** (t - 40)
    out, state = shaped(TrainConfig(optimizer="sgd", shaping=("normalize",), normalize_window=50), steps)
    typical = np.mean([spread(g) for g in steps[:41]])
    assert spread(steps[49]) > 100 * typical
    assert max(spread(g) for g, _ in out[41:50]) < 1.3 * typical  # the blow-up is scaled down
    assert max(spread(g) for g, _ in out[50:]) < 1.3 * typical  # and moves the reference little
    assert state["normalize"]["sum"] < 50 * 1.3 * typical


def test_a_window_within_the_warmup_is_the_mean_of_its_steps_as_before():
    """W <= WARMUP: the first W steps as they are, then their plain mean (the rule before the hold)."""
    rng = np.random.default_rng(5)
    steps = [g * (5.0 if t == 3 else 1.0) for t, g in enumerate(scalars(rng, 30))]
    out, _ = shaped(TrainConfig(optimizer="sgd", shaping=("normalize",), normalize_window=NORMALIZE_WARMUP), steps)
    raw = [spread(g) for g in steps]
    assert all(np.array_equal(g, r) for (g, _), r in zip(out[:NORMALIZE_WARMUP], steps))
    scale = [info["normalize_scale"] for _, info in out[NORMALIZE_WARMUP:]]
    assert scale == [(sum(raw[:NORMALIZE_WARMUP]) / NORMALIZE_WARMUP) / r for r in raw[NORMALIZE_WARMUP:]]


def test_clip_bounds_a_cliff_step():
    rng = np.random.default_rng(1)
    steps = scalars(rng, 60)
    cliff = steps[40].copy()
    cliff[7] = 500.0  # one sequence on a loss cliff: one scalar hundreds of times the others
    steps[40] = cliff
    out, _ = shaped(TrainConfig(optimizer="sgd", shaping=("clip",), clip_at=5.0), steps)
    g, info = out[40]
    median = np.median(np.abs(np.concatenate(steps[:40])))
    assert info["clip_count"] >= 1 and abs(g[7]) < 5 * 1.5 * median  # bounded near 5 running medians
    assert all(info["clip_count"] == 0 for _, info in out[:WARMUP])


@pytest.mark.parametrize("pieces", [("clip",), ("normalize",), ("clip", "normalize")])
def test_shaping_bounds_the_step_on_a_constructed_cliff(pieces):
    """The update's norm is sqrt(d/P) x the scalars' spread: on the cliff-step plain SPSA's is
    ~100x a typical step's; shaped, it stays within a few times."""
    rng = np.random.default_rng(2)
    steps = scalars(rng, 80)
    steps[70] = steps[70].copy()
    steps[70][3] = 1000.0
    out, _ = shaped(TrainConfig(optimizer="sgd", shaping=pieces, normalize_window=20), steps)
    typical = np.median([spread(g) for g, _ in out[20:70]])
    assert spread(steps[70]) > 30 * typical
    assert spread(out[70][0]) < 3 * typical


def test_shaping_passes_a_skipped_step_through():
    cfg = TrainConfig(optimizer="sgd", shaping=("clip", "normalize"))
    chain = Chain(cfg)
    state = chain.init()
    bad = np.array([1.0, np.nan, 2.0])
    g, new, info = chain(bad, state)
    assert g is bad and new is state and info == {}


def test_shaping_is_an_spsa_option_and_its_names_are_checked():
    with pytest.raises(ConfigError, match="--shaping is not used by --optimizer es"):
        make_strategy(TrainConfig(optimizer="es", eps=0.02, lr=0.005, shaping=("clip",)))
    with pytest.raises(ConfigError, match="--shaping is not used by --optimizer es"):  # named by the user
        check_options(OpenES(TrainConfig(optimizer="es")), TrainConfig(optimizer="es"), given={"shaping"})
    es = make_strategy(TrainConfig(optimizer="es", eps=0.02, lr=0.005))  # the SPSA default: not its option
    assert "shaping" not in es.options and not es.shaping.pieces
    with pytest.raises(ConfigError, match="unknown shaping 'rank'"):
        make_strategy(TrainConfig(optimizer="sgd", shaping=("rank",)))
    cfg = TrainConfig(optimizer="sgd", shaping=["clip", "normalize"])  # as JSON or TOML give it
    assert cfg.shaping == ("clip", "normalize") and from_json(to_json(cfg))["TrainConfig"] == cfg
    assert TrainConfig(optimizer="sgd", shaping="none").shaping == () and TrainConfig(optimizer="sgd").shaping == ("normalize",)
    with pytest.raises(ConfigError, match="shaping none is plain SPSA: it takes no other piece"):
        TrainConfig(optimizer="sgd", shaping=("none", "clip"))


def test_plain_spsa_is_named_on_the_command_line(tmp_path):
    from click.testing import CliRunner
    from zosoma.cli.main import cli
    text = text_corpus(tmp_path)
    for name, extra in (("default", ["--optimizer", "onesided"]), ("plain", ["--optimizer", "onesided", "--shaping", "none"]),
                        ("activity", [])):
        args = ["train", "--data", str(text), "--heldout", str(text), "--steps", "3", "--embed", "8", "--hidden", "16",
                "-P", "2", "--run-dir", str(tmp_path / name), "--quiet", *extra]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
    assert RunFolder(tmp_path / "default").read_checkpoint().train.shaping == ("normalize",)
    assert RunFolder(tmp_path / "plain").read_checkpoint().train.shaping == ()
    assert RunFolder(tmp_path / "activity").read_checkpoint().train.shaping == ()  # the default takes none


def test_a_checkpoint_from_before_shaping_existed_trains_without_it():
    old = json.loads(to_json(MODEL, CFG))
    for field in ("shaping", "on_divergence", "clip_at", "normalize_window", "restart_lr_factor", "max_restarts"):
        del old["TrainConfig"][field]
    assert from_json(json.dumps(old))["TrainConfig"] == dataclasses.replace(CFG, shaping=(), on_divergence="stop")


def text_corpus(tmp_path):
    rng = np.random.default_rng(3)
    words = [b"river", b"stone", b"light", b"green", b"0123", b"4567", b"\n"]
    path = tmp_path / "a.txt"
    path.write_bytes(b" ".join(words[i] for i in rng.integers(0, 7, 4000)))
    return path


def single_trainer(folder, cfg, corpus, ckpt=None):
    sampler = BatchSampler(corpus, cfg.seq_len + 1)
    state = from_checkpoint(ckpt) if ckpt is not None else new_state(MODEL, cfg)
    return Trainer(folder, MODEL, cfg, sampler, state, ops=Ops())


@pytest.mark.parametrize("pieces", [("clip",), ("normalize",), ("clip", "normalize")])
def test_each_shaping_is_bit_reproducible_and_checkpointed(tmp_path, pieces):
    corpus = load_corpus([str(text_corpus(tmp_path))])
    cfg = dataclasses.replace(CFG, steps=80, shaping=pieces, normalize_window=10, clip_at=1.5)
    whole = single_trainer(tmp_path / "whole", cfg, corpus)
    records = [r for r in train(whole) if isinstance(r, Step)]
    assert any(r.metrics.get("normalize_scale", 1.0) != 1.0 or r.metrics.get("clip_count") for r in records)
    part = single_trainer(tmp_path / "part", cfg, corpus)
    list(train(part, should_stop=lambda: part.state.step == 50))
    ckpt = RunFolder(tmp_path / "part").read_checkpoint()
    assert ckpt.step == 50 and set(ckpt.extra["shaping"]) == set(pieces)  # the pieces' state is saved
    resumed = single_trainer(tmp_path / "part", cfg, corpus, ckpt)
    list(train(resumed))
    assert np.array_equal(resumed.theta, whole.theta)
    assert resumed.state.shaping == whole.state.shaping


# --- restart and drop ------------------------------------------------------------------------------

def faulty_soma(run_dir, text, cfg, bad_lr=None):
    """A SOMA run of 2 experts, nothing trained yet; with bad_lr, expert 1 alone at that rate."""
    create_soma(run_dir, MODEL, cfg, 2, chunk_size=256, train_paths=[str(text)], heldout_paths=[str(text)])
    if bad_lr is not None:
        folder = RunFolder(run_dir).expert(1)
        ckpt = folder.read_checkpoint()
        ckpt.train = dataclasses.replace(ckpt.train, lr=bad_lr)
        folder.write_checkpoint(ckpt)


RESTART = dataclasses.replace(CFG, on_divergence="restart", max_restarts=2)


@pytest.mark.slow
def test_a_diverging_expert_restarts_while_the_other_trains_untouched(tmp_path):
    text = text_corpus(tmp_path)
    faulty_soma(tmp_path / "clean", text, RESTART)
    faulty_soma(tmp_path / "fault", text, RESTART, bad_lr=40.0)
    list(resume_soma(tmp_path / "clean", Inline(), ops=Ops()))
    records = list(resume_soma(tmp_path / "fault", Inline(), ops=Ops()))
    restarts = [r for r in records if isinstance(r, Restarted)]
    assert restarts and {r.expert for r in restarts} == {1}
    assert [r.lr_scale for r in restarts] == [0.5, 0.25][:len(restarts)]
    a = RunFolder(tmp_path / "clean").expert(0).read_checkpoint()
    b = RunFolder(tmp_path / "fault").expert(0).read_checkpoint()
    assert np.array_equal(a.theta, b.theta) and a.step == b.step == CFG.steps  # bit for bit
    bad = RunFolder(tmp_path / "fault").expert(1).read_checkpoint()
    assert [r["step"] for r in bad.extra["restarts"]] == [r.step for r in restarts]
    assert all(r["to"] < r["step"] for r in bad.extra["restarts"])
    # after the rollback each restart draws other batches and noise: the counters' stream moves on
    steps = [json.loads(x) for x in (tmp_path / "fault" / "expert1" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))


@pytest.mark.slow
def test_a_dropped_expert_is_left_out_of_routing_and_said(tmp_path):
    text = text_corpus(tmp_path)
    cfg = dataclasses.replace(RESTART, max_restarts=1)
    faulty_soma(tmp_path / "run", text, cfg, bad_lr=400.0)
    records = list(resume_soma(tmp_path / "run", Inline(), ops=Ops()))
    assert [type(r) for r in records if isinstance(r, (Restarted, Dropped))] == [Restarted, Dropped]
    results = next(r for r in records if isinstance(r, Evaluated)).results
    assert results["dropped"] == [1] and results["training"][1]["dropped"]["verdict"].startswith("rising")
    assert len(results["training"][1]["restarts"]) == 1 and results["training"][0]["dropped"] is None
    held = results["heldout"]["overall"]
    assert held["routed"] == held["expert0"] == held["oracle"]  # everything goes to expert 0
    soma = json.loads((tmp_path / "run" / "soma.json").read_text())
    assert soma["experts_status"][1]["dropped"] and soma["experts_status"][0] == {"restarts": 0, "dropped": None}
    with pytest.warns(UserWarning, match="experts \\[1\\] were dropped; routing top-1 instead of top-2"):
        ensemble = load_ensemble(tmp_path / "run", top_k=2)
    experts, _ = ensemble.router.select([b"river stone", b"0123 4567"])
    assert set(experts.ravel()) == {0}
    # a resume finds nothing to train and says the same
    again = list(resume_soma(tmp_path / "run", Inline(), ops=Ops()))
    assert {r.expert for r in again if isinstance(r, Finished)} == {0, 1}
    assert not any(isinstance(r, Step) for r in again)


@pytest.mark.slow
def test_restarts_are_the_same_inline_and_in_processes(tmp_path):
    text = text_corpus(tmp_path)
    for name, executor in (("inline", Inline()), ("processes", LocalProcesses(2))):
        faulty_soma(tmp_path / name, text, RESTART, bad_lr=40.0)
        list(resume_soma(tmp_path / name, executor, ops=Ops()))
    for i in range(2):
        a = RunFolder(tmp_path / "inline").expert(i).read_checkpoint()
        b = RunFolder(tmp_path / "processes").expert(i).read_checkpoint()
        assert np.array_equal(a.theta, b.theta) and a.extra.get("restarts") == b.extra.get("restarts")


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_restart_decision_survives_sigkill_and_resume(tmp_path):
    text = text_corpus(tmp_path)
    args = ["train", "--data", text, "--heldout", text, *tiny_args(4, 4, optimizer="onesided", lr=40, steps=3000, checkpoint_every=20),
            "--on-divergence", "restart", "--max-restarts", "2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = subprocess.run(zosoma_cmd() + [str(a) for a in args + ["--run-dir", whole]], capture_output=True, text=True)
    assert done.returncode == 1 and "training gave up on it" in done.stderr, done.stderr
    proc = subprocess.Popen(zosoma_cmd() + [str(a) for a in args + ["--run-dir", cut]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def restarted():
        try:
            return bool(RunFolder(cut).read_checkpoint().extra.get("restarts"))
        except Exception:
            return False

    import time
    deadline = time.time() + 120
    while not restarted() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    resumed = subprocess.run(zosoma_cmd() + ["train", "--resume", str(cut)], capture_output=True, text=True)
    assert resumed.returncode == 1 and "training gave up on it" in resumed.stderr
    a, b = RunFolder(whole).read_checkpoint(), RunFolder(cut).read_checkpoint()
    assert np.array_equal(a.theta, b.theta) and a.step == b.step
    assert a.extra["restarts"] == b.extra["restarts"] and a.extra["dropped"] == b.extra["dropped"]


def test_the_summed_ablations_experts_stop_together_where_one_would_restart(tmp_path):
    # a restart would roll one expert back alone, out of the lockstep: coupled experts stop
    text = text_corpus(tmp_path)
    cfg = dataclasses.replace(RESTART, lr=400.0)
    create_soma(tmp_path / "summed", MODEL, cfg, 2, loss="summed", chunk_size=256, train_paths=[str(text)],
                heldout_paths=[str(text)])
    records = list(resume_soma(tmp_path / "summed", Inline(), ops=Ops()))
    assert not any(isinstance(r, (Restarted, Dropped)) for r in records)
    stopped = [r for r in records if isinstance(r, Diverged)]
    assert stopped and all(r.step == stopped[0].step for r in stopped)
    ckpts = [RunFolder(tmp_path / "summed").expert(i).read_checkpoint() for i in range(2)]
    assert ckpts[0].step == ckpts[1].step < cfg.steps
    assert RESTART_STREAM == 1 << 16


def test_a_sharded_population_restarts_as_one_process_does(tmp_path):
    from zosoma.workers.population_workers import InProcess, Sharding
    from zosoma.runs.single import start_run
    text = text_corpus(tmp_path)
    cfg = dataclasses.replace(RESTART, lr=40.0, max_restarts=1)
    ends = []
    for name, sharding in (("one", None), ("sharded", Sharding(InProcess(), 2))):
        records = list(start_run(tmp_path / name, MODEL, cfg, [str(text)], [str(text)], sharding=sharding, ops=Ops()))
        assert any(isinstance(r, Restarted) for r in records) and isinstance(records[-1], Dropped)
        ends.append(RunFolder(tmp_path / name).read_checkpoint())
    assert np.array_equal(ends[0].theta, ends[1].theta)
    assert ends[0].extra["restarts"] == ends[1].extra["restarts"] and ends[0].step == ends[1].step


# --- what a dropped model and --on-divergence continue say ------------------------------------------

def cli_train(*args):
    from click.testing import CliRunner
    from zosoma.cli.main import cli
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
def test_a_dropped_single_model_is_said_on_resume_and_the_advice_is_a_new_run(tmp_path):
    from helpers import one_line_error, snapshot
    from zosoma.training.folder import LOCK
    text, run = text_corpus(tmp_path), tmp_path / "run"
    done = cli_train("train", "--data", text, "--heldout", text, *tiny_args(4, 4, optimizer="onesided", lr=40, steps=3000, checkpoint_every=20),
                     "--on-divergence", "restart", "--max-restarts", "1", "--run-dir", run, "--quiet")
    assert done.exit_code == 1 and "training gave up on it, so resuming cannot help; start a new run with a " \
                                   "lower --lr" in done.output, done.output
    assert "--resume" not in done.output  # the advice is a new run, not a resume that cannot train it
    dropped = RunFolder(run).read_checkpoint().extra["dropped"]
    before = {k: v for k, v in snapshot(run).items() if k != LOCK}
    for extra in ([], ["--steps", "6000"]):  # neither a plain resume nor an extension trains it
        line = one_line_error(cli_train("train", "--resume", run, *extra), 1)
        assert f"the model was dropped at step {dropped['step']} after 1 restart(s) ({dropped['verdict']})" in line
        assert "resuming cannot help; start a new run with a lower --lr" in line
    assert {k: v for k, v in snapshot(run).items() if k != LOCK} == before  # no results.json, nothing trained


@pytest.mark.slow
def test_on_divergence_continue_says_its_verdict_once_and_trains_on(tmp_path):
    text, run = text_corpus(tmp_path), tmp_path / "run"
    done = cli_train("train", "--data", text, "--heldout", text, *tiny_args(4, 4, lr=400, steps=300),
                     "--on-divergence", "continue",
                     "--run-dir", run, "--quiet")
    assert done.exit_code == 0, done.output
    verdict = json.loads((run / "results.json").read_text())["divergence"]
    said = f"the model diverged at step {verdict['step']} ({verdict['verdict']}); --on-divergence continue: it " \
           "trains on regardless"
    assert done.output.count(said) == 1 and verdict["step"] < 300
    assert RunFolder(run).read_checkpoint().step == 300
    # the summed ablation's experts step in lockstep: each says its own verdict too
    from zosoma.training.records import Continued
    cfg = dataclasses.replace(CFG, on_divergence="continue", lr=400.0)
    create_soma(tmp_path / "summed", MODEL, cfg, 2, loss="summed", chunk_size=256, train_paths=[str(text)],
                heldout_paths=[str(text)])
    records = list(resume_soma(tmp_path / "summed", Inline(), ops=Ops()))
    went_on = sorted((r for r in records if isinstance(r, Continued)), key=lambda r: r.expert)
    assert [r.expert for r in went_on] == [0, 1] and isinstance(records[-1], Evaluated)
    assert [t["divergence"]["step"] for t in records[-1].results["training"]] == [r.step for r in went_on]


# --- issue 45: a model still diverging when its budget runs out is dropped, and said ----------------

@pytest.mark.slow
def test_a_single_model_still_diverging_at_its_budget_is_dropped_with_exit_code_1(tmp_path):
    """Before issue 45: rc 0, results.json with divergence null and a held-out figure of hundreds."""
    text, run = text_corpus(tmp_path), tmp_path / "run"
    done = cli_train("train", "--data", text, "--heldout", text, *tiny_args(4, 4, lr=400, steps=40),
                     "--optimizer", "sgd", "--shaping", "none", "--run-dir", run, "--quiet")
    assert done.exit_code == 1, done.output
    said = "the model was dropped at step 40 after 0 restart(s) (rising when its budget ran out: smoothed loss "
    assert said in done.output and "training gave up on it" in done.output
    assert not (run / "results.json").exists()  # no figure is reported as the run's
    dropped = RunFolder(run).read_checkpoint().extra["dropped"]
    assert dropped["step"] == 40 and dropped["verdict"].startswith("rising when its budget ran out")
    info = cli_train("info", run)
    assert info.exit_code == 0 and f"dropped: {json.dumps(dropped, sort_keys=True)}"[:100] in info.output


def test_an_expert_still_diverging_at_its_budget_is_left_out_of_routing_and_said(tmp_path):
    from zosoma.runs.run import Run
    text = text_corpus(tmp_path)
    faulty_soma(tmp_path / "run", text, dataclasses.replace(RESTART, steps=40), bad_lr=400.0)
    records = list(resume_soma(tmp_path / "run", Inline(), ops=Ops()))
    dropped = [r for r in records if isinstance(r, Dropped)]
    assert [(r.expert, r.step, r.restarts) for r in dropped] == [(1, 40, 0)]
    assert dropped[0].verdict.startswith("rising when its budget ran out: smoothed loss ")
    results = next(r for r in records if isinstance(r, Evaluated)).results
    assert results["dropped"] == [1]
    assert results["training"][1]["dropped"] == {"step": 40, "verdict": dropped[0].verdict}
    held = results["heldout"]["overall"]
    assert held["routed"] == held["expert0"] < 5.6 < held["expert1"]  # the routed figure is expert 0's alone
    run = Run.open(tmp_path / "run")
    assert [e["dropped"] for e in run.describe()["experts_status"]] == [None, results["training"][1]["dropped"]]
    assert "expert1: step 40/40" in run.summary(run.describe()) and "DROPPED at step 40" in run.summary(run.describe())
    with pytest.warns(UserWarning, match="experts \\[1\\] were dropped"):
        scored = run.evaluate(load_corpus([str(text)]))  # zosoma eval
    from zosoma.cli.render import results as shown
    assert scored["dropped"] == [1]
    for r in (results, scored):  # what zosoma train and zosoma eval print
        assert "dropped in training, so left out of routing: expert1" in shown(r).splitlines()
