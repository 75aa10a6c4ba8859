"""SOMA's experts trained together (zosoma.training.together, `--executor together`): each step of all
of them in one population, the bits of training them one at a time, on the CPU engine and on the
emulated CUDA runtime (one fused launch for every expert's members, one for every update)."""

import dataclasses
import json

import numpy as np
import pytest

from test_kernels import emulated_libs, rt  # noqa: F401 (fixtures)
from test_robust import RESTART, faulty_soma, text_corpus
from world import TINY_MODEL as MODEL
from zosoma.config import TrainConfig
from zosoma.engines.ops import Ops
from zosoma.training.folder import RunFolder
from zosoma.training.records import Dropped, Finished, Restarted, Step, Stopped
from zosoma.training.trainer import train
from zosoma.runs.soma import ExpertUnit, create_soma, open_soma, resume_soma, start_soma
from zosoma.workers.executor import Inline, Together

pytestmark = pytest.mark.usefixtures("scratch_cwd")

CFG = TrainConfig(optimizer="onesided", shaping=("normalize",), steps=8, batch=2, seq_len=16, perturbations=2,
                  lr=0.5, checkpoint_every=3)
TIMES = ("wall_s", "tokens_per_s", "data_s", "noise_s", "forward_s", "update_s")  # seconds: not the numbers


def soma(run_dir, data, cfg, executor, n_experts=3, **kw):
    paths = [str(data / "prose.txt"), str(data / "digits.txt")]
    return list(start_soma(run_dir, MODEL, cfg, n_experts, executor=executor, chunk_size=256, train_paths=paths,
                           heldout_paths=paths[:1], ops=Ops(), **kw))


def same_experts(a, b, n):
    """Expert by expert: the same checkpoint arrays, training state and step records (their
    seconds aside)."""
    for i in range(n):
        x, y = (RunFolder(r).expert(i).read_checkpoint() for r in (a, b))
        assert x.step == y.step and np.array_equal(x.theta, y.theta), i
        assert x.optimizer.keys() == y.optimizer.keys()
        assert all(np.array_equal(x.optimizer[k], y.optimizer[k]) for k in x.optimizer)
        for key in ("shaping", "restarts", "dropped", "divergence", "guard", "tokens"):
            assert x.extra.get(key) == y.extra.get(key), (i, key)
        assert metrics(a, i) == metrics(b, i)


def metrics(run_dir, i):
    lines = (RunFolder(run_dir).expert(i).path / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMES} for x in lines]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["onesided", "momentum", "rowwise"])
def test_together_trains_the_bits_of_one_expert_at_a_time(tmp_path, two_domains, optimizer):
    """The default run's strategy (one-sided, normalize shaping: the fused update together), one
    with an update of its own (momentum) and one with losses of its own (rowwise)."""
    cfg = dataclasses.replace(CFG, optimizer=optimizer, shaping=() if optimizer == "rowwise" else CFG.shaping)
    alone = soma(tmp_path / "alone", two_domains, cfg, Inline())
    together = soma(tmp_path / "together", two_domains, cfg, Together())
    same_experts(tmp_path / "alone", tmp_path / "together", 3)
    steps = [(r.expert, r.step) for r in together if isinstance(r, Step)]
    assert steps[:3] == [(0, 1), (1, 1), (2, 1)]  # one step of every expert, then the next
    assert sorted(steps) == sorted((r.expert, r.step) for r in alone if isinstance(r, Step))
    results = [json.loads((tmp_path / d / "results.json").read_text())["heldout"] for d in ("alone", "together")]
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::zosoma.runs.soma.DroppedExperts")
def test_a_restart_and_a_drop_happen_as_one_at_a_time(tmp_path):
    """Expert 1 diverges at a rate far too high: it restarts (and, with max_restarts=1 at a worse
    rate, is dropped) exactly as alone, while the others step on together."""
    text = text_corpus(tmp_path)
    for name, cfg, bad_lr in (("restart", RESTART, 40.0), ("drop", dataclasses.replace(RESTART, max_restarts=1), 400.0)):
        fates = []
        for executor in (Inline(), Together()):
            run = tmp_path / f"{name}-{type(executor).__name__}"
            faulty_soma(run, text, cfg, bad_lr=bad_lr)
            records = list(resume_soma(run, executor, ops=Ops()))
            fates.append([(type(r).__name__, r.expert, r.step) for r in records
                          if isinstance(r, (Restarted, Dropped, Finished))])
        assert sorted(fates[0]) == sorted(fates[1])  # (records of different experts interleave)
        bad = [kind for kind, expert, _ in fates[0] if expert == 1]
        assert ("Finished", 0, cfg.steps) in fates[0] and bad[0] == "Restarted"
        if name == "drop":
            assert bad == ["Restarted", "Dropped"]
        same_experts(tmp_path / f"{name}-Inline", tmp_path / f"{name}-Together", 2)


@pytest.mark.slow
def test_a_run_stopped_together_resumes_to_the_same_bits(tmp_path, two_domains):
    """Stopped mid-run (every expert checkpointed at step 5, between its checkpoints at 3 and 6),
    then resumed together: the experts of an uninterrupted one-at-a-time run."""
    soma(tmp_path / "whole", two_domains, CFG, Inline())
    stepped = []
    for r in start_soma(tmp_path / "cut", MODEL, CFG, 3, executor=Together(), chunk_size=256,
                        train_paths=[str(two_domains / "prose.txt"), str(two_domains / "digits.txt")],
                        heldout_paths=[str(two_domains / "prose.txt")], should_stop=lambda: len(stepped) >= 13,
                        ops=Ops()):
        if isinstance(r, Step):
            stepped.append(r)
        elif isinstance(r, Stopped):
            assert r.step == 5
    assert len(stepped) == 15  # asked between two steps of all three
    resumed = list(resume_soma(tmp_path / "cut", Together(), ops=Ops()))
    assert [(r.expert, r.step) for r in resumed if isinstance(r, Step)][:3] == [(0, 6), (1, 6), (2, 6)]
    same_experts(tmp_path / "whole", tmp_path / "cut", 3)


@pytest.mark.slow
def test_together_on_the_emulated_gpu_is_one_expert_at_a_time_in_two_launches_a_step(tmp_path, rt):
    """On the CUDA engine (the emulated runtime, or the device where there is one), three experts
    stepped together end with the bits of each trained alone: their members run in one fused
    launch and their updates in one (bitwise the single-expert launches at any GEMM-free shape:
    the fused kernel has no GEMM), 2 launches a step against 2 per expert alone."""
    from zosoma.engines.cuda.cuda_ops import CudaOps
    from zosoma.engines.cuda.fused_forward import fits
    from zosoma.engines.cuda.launches import Launches
    from zosoma.model.params import Layout

    text = text_corpus(tmp_path)
    cfg = dataclasses.replace(CFG, steps=4, checkpoint_every=2)
    assert fits(Layout(MODEL), cfg.batch)  # the fused path, alone and together
    ops, launches = CudaOps(), {}
    for name in ("alone", "together"):
        create_soma(tmp_path / name, MODEL, cfg, 3, chunk_size=256, train_paths=[str(text)])
        run = open_soma(tmp_path / name)
        units = [ExpertUnit(str(run.folder), run.soma, run.corpora[i], i, ops) for i in range(3)]
        with Launches() as counted:
            if name == "together":
                records = list(Together().run(units))
            else:
                records = []
                for unit in units:
                    with unit.opened() as (trainer, _):
                        records += train(trainer)
        assert {r.expert for r in records if isinstance(r, Finished)} == {0, 1, 2}
        launches[name] = counted.total
    assert launches == {"alone": 3 * 2 * cfg.steps, "together": 2 * cfg.steps}
    same_experts(tmp_path / "alone", tmp_path / "together", 3)


@pytest.mark.slow
def test_train_executor_together_from_the_command_line(tmp_path, two_domains):
    """`zosoma train --experts 2 --executor together` trains and records its placement; a resume
    keeps it; --workers with it is a one-line usage error, and the Python API refuses it too."""
    from click.testing import CliRunner

    from helpers import one_line_error
    from world import tiny_args
    from zosoma.cli.main import cli
    from zosoma.errors import ConfigError
    from zosoma.workers.placement import Placement

    data = ["--data", str(two_domains / "prose.txt"), "--data", str(two_domains / "digits.txt")]
    run = lambda args: CliRunner().invoke(cli, args)  # noqa: E731
    args = ["train", "--experts", "2", "--chunk-size", "256", "--steps", "3", "--run-dir", str(tmp_path / "r"),
            "--heldout", str(two_domains / "prose.txt")] + data + tiny_args(2, 2)
    result = run(args + ["--executor", "together"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r" / "placement.json").read_text())["executor"] == "together"
    result = run(["train", "--resume", str(tmp_path / "r"), "--steps", "5"])
    assert result.exit_code == 0, result.output
    assert [RunFolder(tmp_path / "r").expert(i).read_checkpoint().step for i in range(2)] == [5, 5]
    line = one_line_error(run(args[:-2] + ["--executor", "together", "--workers", "2"]), code=2)
    assert line.endswith("--workers counts local processes; --executor together runs every unit in this process")
    with pytest.raises(ConfigError, match="--executor together runs every unit"):
        Placement(executor="together", workers=2)
    assert Placement(executor="local", workers=2).replaced({"executor": "together"}).workers is None


def test_together_is_the_default_on_a_device_and_asked_for_on_the_cpu(monkeypatch):
    """SOMA's experts go together where the forwards run on an accelerator, and where asked; on
    the CPU they stay in local processes (results/soma-together.txt); units that open no model
    (a study's runs) run inline under together."""
    from zosoma.workers.placement import Placement
    from zosoma.workers.executor import LocalProcesses
    from zosoma.workers.placement import executor

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert isinstance(executor(Placement(), 4), LocalProcesses)
    assert isinstance(executor(Placement(executor="together"), 4), Together)
    # the run tells it whether its engine is an accelerator's (Run.start: ops.on_device)
    assert isinstance(executor(Placement(device="cuda"), 4, on_device=True), Together)
    assert isinstance(executor(Placement(device="cuda", executor="local"), 4, on_device=True), LocalProcesses)
    ran = list(Together().run([lambda stopping: iter(["a"]), lambda stopping: iter(["b"])]))
    assert ran == ["a", "b"]


@pytest.mark.slow
def test_an_expert_that_cannot_open_fails_alone_and_a_failed_step_fails_those_it_held(tmp_path, monkeypatch):
    """Together as Inline: an expert whose folder cannot be read is Failed (its unit index), the
    others train; a step that raises fails every expert still training (they shared it), once;
    what one expert's own bookkeeping raises fails it alone."""
    from zosoma.training import together
    from zosoma.training.records import Failed

    text = text_corpus(tmp_path)
    cfg = dataclasses.replace(CFG, steps=3)
    create_soma(tmp_path / "r", MODEL, cfg, 3, chunk_size=256, train_paths=[str(text)])
    run = open_soma(tmp_path / "r")
    for f in RunFolder(tmp_path / "r").expert(1).path.glob("checkpoint*.h5"):
        f.unlink()
    units = [ExpertUnit(str(run.folder), run.soma, run.corpora[i], i, Ops()) for i in range(3)]
    records = list(Together().run(units))
    assert [r.unit for r in records if isinstance(r, Failed)] == [1]
    assert {r.expert for r in records if isinstance(r, Finished)} == {0, 2}

    create_soma(tmp_path / "s", MODEL, cfg, 2, chunk_size=256, train_paths=[str(text)])
    run = open_soma(tmp_path / "s")
    real, calls = together.step_together, []

    def failing(trainers):
        calls.append(len(trainers))
        if len(calls) == 2:
            raise RuntimeError("the device fell over\nand more")
        return real(trainers)

    monkeypatch.setattr(together, "step_together", failing)
    units = [ExpertUnit(str(run.folder), run.soma, run.corpora[i], i, Ops()) for i in range(2)]
    records = list(Together().run(units))
    assert [(r.unit, r.error) for r in records if isinstance(r, Failed)] == [
        (0, "RuntimeError: the device fell over"), (1, "RuntimeError: the device fell over")]
    assert [RunFolder(tmp_path / "s").expert(i).read_checkpoint().step for i in range(2)] == [0, 0]  # none taken

    monkeypatch.setattr(together, "step_together", real)  # now one expert's own bookkeeping fails, alone
    from zosoma.training.trainer import Trainer
    went_on = Trainer.went_on
    monkeypatch.setattr(Trainer, "went_on", lambda t: (_ for _ in ()).throw(OSError("disk full")) if t.expert == 1
                        and t.state.step == 2 else went_on(t))
    records = list(Together().run(units))
    assert [(r.unit, r.error) for r in records if isinstance(r, Failed)] == [(1, "OSError: disk full")]
    assert [r.expert for r in records if isinstance(r, Finished)] == [0]
    assert max(r.step for r in records if isinstance(r, Step) and r.expert == 1) == 2


@pytest.mark.slow
def test_the_summed_ablation_evaluates_every_experts_members_in_one_launch(tmp_path, rt, monkeypatch):
    """The summed-loss ablation's lockstep (zosoma.runs.soma.train_lockstep) takes its losses
    together too: on the CUDA engine one fused launch a step for all its experts' members."""
    from zosoma.engines.cuda import custom_kernels
    from zosoma.engines.cuda.cuda_ops import CudaOps
    from zosoma.runs.soma import lockstep_trainers, train_lockstep

    text = text_corpus(tmp_path)
    cfg = TrainConfig(optimizer="sgd", steps=2, batch=2, seq_len=16, perturbations=2, lr=0.5, checkpoint_every=2)
    create_soma(tmp_path / "s", MODEL, cfg, 3, loss="summed", chunk_size=256, train_paths=[str(text)])
    names, real = [], custom_kernels.launch_blocks
    monkeypatch.setattr(custom_kernels, "launch_blocks", lambda *a, **k: names.append(a[0]) or real(*a, **k))
    records = list(train_lockstep(lockstep_trainers(open_soma(tmp_path / "s"), CudaOps())))
    assert {r.expert for r in records if isinstance(r, Finished)} == {0, 1, 2}
    assert names == ["fused_population_loss"] * cfg.steps
