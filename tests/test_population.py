"""One model's population over W workers (zosoma.workers.population_workers): the single-process run's numbers
bit for bit, a lost worker rebuilt by replay, the summed-loss ablation through the same scalar
exchange, communication accounting, and bad input in one line."""

import dataclasses
import os
import signal

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import cli_json
from world import TINY_MODEL as MODEL, tiny_args
from zosoma.engines.ops import Ops
from zosoma.cli.main import cli
from zosoma.config import TrainConfig
from zosoma.engines import get_ops
from zosoma.errors import ConfigError
from zosoma.workers import population_workers
from zosoma.workers.executor import Inline
from zosoma.training.folder import RunFolder
from zosoma.workers.population_workers import InProcess, Processes, Sharding, exchange_bytes, shard_pairs
from zosoma.training.records import Step
from zosoma.runs.single import start_run
from zosoma.runs.soma import start_soma

CFG = TrainConfig(optimizer="sgd", steps=10, batch=2, seq_len=16, perturbations=4, lr=0.5, checkpoint_every=4)
TINY = tiny_args(2, 4)


pytestmark = pytest.mark.usefixtures("scratch_cwd")


def run(run_dir, two_domains, sharding=None, **kw):
    paths = [str(two_domains / "prose.txt")]
    return list(start_run(run_dir, MODEL, kw.pop("cfg", CFG), paths, paths, sharding=sharding,
                          ops=kw.pop("ops", Ops()), **kw))


def theta(run_dir):
    return RunFolder(run_dir).read_checkpoint().theta


def steps(records):
    return [r for r in records if isinstance(r, Step)]


class Spy:
    """A transport that keeps the handles it spawned (to kill one)."""

    def __init__(self, workers):
        self.workers, self.handles = workers, []

    def spawn(self, spec, step, replay=()):
        self.handles.append(self.workers.spawn(spec, step, replay))
        return self.handles[-1]


def test_pairs_split_into_contiguous_shares():
    assert shard_pairs(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert shard_pairs(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ConfigError, match="5 population workers for 4 perturbation pairs"):
        shard_pairs(4, 5)


def test_sharded_population_equals_the_single_process_run(tmp_path, two_domains):
    reference = run(tmp_path / "one", two_domains)
    assert {r.metrics["comm_bytes"] for r in steps(reference)} == {0}
    for W in (1, 2, 4):
        records = run(tmp_path / f"w{W}", two_domains, Sharding(InProcess(), W))
        assert np.array_equal(theta(tmp_path / f"w{W}"), theta(tmp_path / "one")), W
        assert [r.loss for r in steps(records)] == [r.loss for r in steps(reference)]
        assert {r.metrics["comm_bytes"] for r in steps(records)} == {exchange_bytes(4, W)} == {8 * (2 * 4 + W * 4)}
    run(tmp_path / "processes", two_domains, Sharding(Processes(), 2))
    assert np.array_equal(theta(tmp_path / "processes"), theta(tmp_path / "one"))
    logged = RunFolder(tmp_path / "processes").read_scalars()
    assert sorted(logged) == list(range(CFG.steps)) and all(len(c) == CFG.perturbations for c in logged.values())


@pytest.mark.slow
def test_workers_open_the_engine_the_run_hands_them(tmp_path, two_domains):
    """A run handed its own engine (bf16 forwards on the CPU) hands it to its population workers
    (in another process rebuilt from its record: device "cpu", not its label "cpu-bf16"), so each
    evaluates on the same engine: the single-process run's numbers."""
    cfg, ops = dataclasses.replace(CFG, forward_precision="bf16", steps=4), get_ops("cpu", precision="bf16")
    run(tmp_path / "one", two_domains, cfg=cfg, ops=ops)
    run(tmp_path / "w2", two_domains, Sharding(InProcess(), 2), cfg=cfg, ops=ops)
    assert np.array_equal(theta(tmp_path / "w2"), theta(tmp_path / "one"))


class Lending:
    """An executor's Cores lending one core at every ask, two in all."""
    threads = 1

    def __init__(self):
        self.left = 2

    def borrow(self, most):
        n = min(1, most, self.left)
        self.left -= n
        return n


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_expert_spreads_over_lent_cores_with_the_same_bits(tmp_path, two_domains, monkeypatch):
    """Lent a core at two checkpoints, an independent expert goes from one worker to 2, then 3 (its
    population's P pairs over them), and ends with the bits of the expert alone."""
    kw = dict(n_experts=2, chunk_size=256, executor=Inline(), top_k=2,
              train_paths=[str(two_domains / "prose.txt"), str(two_domains / "digits.txt")])
    list(start_soma(tmp_path / "alone", MODEL, CFG, **kw, ops=Ops()))
    lending = Lending()
    monkeypatch.setattr(population_workers, "spare_cores", lambda: lending)
    records = list(start_soma(tmp_path / "spread", MODEL, CFG, **kw, ops=Ops()))
    for i in range(2):
        a = RunFolder(tmp_path / "alone").expert(i).read_checkpoint().theta
        b = RunFolder(tmp_path / "spread").expert(i).read_checkpoint().theta
        assert np.array_equal(a, b)
    sent = [r.metrics["comm_bytes"] for r in steps(records) if r.expert == 0]
    assert sent == [exchange_bytes(4, 2)] * 4 + [exchange_bytes(4, 3)] * 6  # from steps 0 and 4 (checkpoint_every)
    assert {r.metrics["comm_bytes"] for r in steps(records) if r.expert == 1} == {0}  # nothing left to lend


def test_a_killed_worker_is_rebuilt_by_replay(tmp_path, two_domains):
    run(tmp_path / "one", two_domains)
    spy = Spy(Processes())
    records = []
    for r in start_run(tmp_path / "w2", MODEL, CFG, [str(two_domains / "prose.txt")], sharding=Sharding(spy, 2),
                       ops=Ops()):
        records.append(r)
        if isinstance(r, Step) and r.step == 6:  # checkpoint at 4: rebuilt from it plus 2 logged steps
            os.kill(spy.handles[1].pid, signal.SIGKILL)
            spy.handles[1].process.join(10)
    notes = [n for r in steps(records) for n in r.notes]
    assert len(notes) == 1 and "population worker 1 was lost" in notes[0]
    assert "rebuilt from the checkpoint at step 4 and 2 logged steps" in notes[0]
    assert len(spy.handles) == 3
    assert np.array_equal(theta(tmp_path / "w2"), theta(tmp_path / "one"))


@pytest.mark.slow
def test_summed_ablation_through_the_scalar_exchange(tmp_path, two_domains):
    kw = dict(n_experts=2, loss="summed", chunk_size=256, executor=Inline(), top_k=2,
              train_paths=[str(two_domains / "prose.txt"), str(two_domains / "digits.txt")])
    list(start_soma(tmp_path / "lockstep", MODEL, CFG, **kw, ops=Ops()))
    records = list(start_soma(tmp_path / "workers", MODEL, CFG, workers=Processes(), **kw, ops=Ops()))
    assert {r.metrics["comm_bytes"] for r in steps(records)} == {exchange_bytes(4, 1)}
    for i in range(2):
        a = RunFolder(tmp_path / "lockstep").expert(i).read_checkpoint().theta
        b = RunFolder(tmp_path / "workers").expert(i).read_checkpoint().theta
        assert np.array_equal(a, b)


def test_population_bad_input_is_one_line(tmp_path, two_domains):
    with pytest.raises(ConfigError, match="not sharded over --population-workers"):
        eggroll = TrainConfig(**{**CFG.__dict__, "optimizer": "eggroll"})
        run(tmp_path / "eggroll", two_domains, Sharding(InProcess(), 2), cfg=eggroll)
    base = ["train", "--data", str(two_domains / "prose.txt"), "--steps", "2", *TINY]
    cases = {("--population-workers", "5"): "5 population workers for 4 perturbation pairs",
             ("--population-workers", "2", "--experts", "2"): "--population-workers spreads one model's population",
             ("--address", "auto"): "--address is for --executor ray",
             ("--executor", "ray", "--workers", "2", "--experts", "2"): "--workers counts local processes"}
    for i, (extra, message) in enumerate(cases.items()):
        result = CliRunner().invoke(cli, base + ["--run-dir", str(tmp_path / f"bad{i}"), *extra])
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output
        assert message in result.output.strip().splitlines()[-1], result.output
        assert not (tmp_path / f"bad{i}").exists()


def test_train_command_shards_a_population(tmp_path, two_domains):
    import json
    for optimizer, per_step in (("onesided", exchange_bytes(4, 2, 8)),  # 2P losses, 2P scalars to each worker
                                (None, 8 * 2 * 16 * (2 * 4 + 2 * 8))):  # the default, activity: each per target (B T = 2 x 16)
        run_dir = tmp_path / f"run-{optimizer}"
        result = CliRunner().invoke(cli, ["train", "--data", str(two_domains / "prose.txt"), "--heldout", str(two_domains / "prose.txt"),
                                          "--steps", "4", *TINY, "--run-dir", str(run_dir), "--population-workers", "2",
                                          "--executor", "inline", *(["--optimizer", optimizer] if optimizer else [])])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["comm_bytes"] for r in records] == [per_step] * 4, optimizer


def test_bench_comm_table():
    tiny = next(r for r in cli_json(["bench", "comm", "-W", "8"], "bench-comm")["results"] if r["preset"] == "tiny")
    d = tiny["d"]
    # the default run's step (activity perturbation) sends each worker a scalar per member and target
    assert (d, tiny["P"], tiny["D"], tiny["V"], tiny["soma"]) == (49_664, 32, 64, 8 * 32, 0)
    assert tiny["population"] == exchange_bytes(32, 8, 64, 256) == 8 * 256 * (2 * 32 + 8 * 64)
    assert tiny["allreduce_per_worker"] == round(2 * 7 / 8 * 4 * d)  # ring all-reduce of fp32 gradients
