"""A run stopped midway and resumed ends exactly where the uninterrupted run ends: every strategy on
the training loop, SOMA's experts (their own and the summed losses) on the inline executor, and one
model's population over workers (stopped on 2, resumed on 4, against a run on none). Theta and the
optimizer state bit for bit, and the metrics log holds each step once, with the same losses."""

import json

import numpy as np
import pytest

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.runs.executor import Inline
from zosoma.runs.folder import METRICS, RunFolder
from zosoma.runs.population_workers import InProcess, Sharding
from zosoma.runs.records import Stopped
from zosoma.runs.single import resume_run, start_run
from zosoma.runs.soma import resume_soma, start_soma
from zosoma.runs.trainer import Trainer, from_checkpoint, new_state, train

MODEL = ModelConfig(embed=8, hidden=16, layers=1)
BASE = dict(steps=12, batch=2, seq_len=16, perturbations=4, warmup=2, checkpoint_every=5)
STRATEGY = {"sgd": dict(lr=0.2, weight_decay=0.01), "momentum": dict(lr=0.05, momentum=0.8),
            "adam": dict(lr=0.01, weight_decay=0.01), "eggroll": dict(eps=0.01, lr=0.5, rank=2),
            "es": dict(eps=0.02, lr=0.05)}
STOP = 7  # steps before the stop: past one checkpoint (5), short of the next (10)


def stop_after(n: int):
    """A should_stop that turns true at its (n+1)-th call."""
    calls = iter(range(n + 1))
    return lambda: next(calls, n) >= n


class TrainingLoop:
    """The loop itself (zosoma.runs.trainer), resumed from the checkpoint it left."""

    def __init__(self, data):
        self.corpus = load_corpus([str(data / "prose.txt")])

    def _train(self, run_dir, cfg, state, stop):
        trainer = Trainer(run_dir, MODEL, cfg, BatchSampler(self.corpus, cfg.seq_len + 1), state)
        return list(train(trainer, lambda: stop and trainer.state.step >= STOP))

    def start(self, run_dir, cfg, stop):
        return self._train(run_dir, cfg, new_state(MODEL, cfg), stop)

    def resume(self, run_dir, cfg):
        return self._train(run_dir, cfg, from_checkpoint(RunFolder(run_dir).read_checkpoint()), False)

    def models(self, run_dir):
        return [RunFolder(run_dir)]


class Soma:
    """A SOMA run of two experts on the inline executor, with the experts' own or summed losses."""

    def __init__(self, data, loss):
        self.loss = loss
        self.args = dict(n_experts=2, chunk_size=256, train_paths=[str(data / "prose.txt"), str(data / "digits.txt")],
                         executor=Inline(), loss=loss)

    def start(self, run_dir, cfg, stop):
        return list(start_soma(run_dir, MODEL, cfg, should_stop=stop_after(STOP) if stop else lambda: False,
                               **self.args))

    def resume(self, run_dir, cfg):
        return list(resume_soma(run_dir, Inline()))

    def models(self, run_dir):
        return [RunFolder(run_dir).expert(i) for i in range(2)]


class PopulationWorkers:
    """One model whose population is spread over in-process workers: the uninterrupted run on none,
    the stopped one on 2, its resume on 4."""

    def __init__(self, data):
        self.paths = [str(data / "prose.txt")]

    def start(self, run_dir, cfg, stop):
        sharding = Sharding(InProcess(), 2) if stop else None
        return list(start_run(run_dir, MODEL, cfg, self.paths, self.paths, sharding=sharding,
                              should_stop=stop_after(STOP) if stop else lambda: False))

    def resume(self, run_dir, cfg):
        return list(resume_run(run_dir, sharding=Sharding(InProcess(), 4)))

    def models(self, run_dir):
        return [RunFolder(run_dir)]


RUNS = {"loop": TrainingLoop, "soma": lambda data: Soma(data, "independent"),
        "soma-summed": lambda data: Soma(data, "summed"), "population-workers": PopulationWorkers}
CASES = [(s, "loop") for s in STRATEGY] + [("sgd", "soma"), ("eggroll", "soma"), ("sgd", "soma-summed"),
                                            ("sgd", "population-workers")]


def logged(folder: RunFolder) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (folder.path / METRICS).read_text().splitlines())]


@pytest.mark.usefixtures("scratch_cwd")
@pytest.mark.parametrize("optimizer, run", CASES, ids=[f"{s}-{r}" for s, r in CASES])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, two_domains, optimizer, run):
    cfg = TrainConfig(optimizer=optimizer, **BASE, **STRATEGY[optimizer])
    runner = RUNS[run](two_domains)
    runner.start(tmp_path / "full", cfg, stop=False)
    records = runner.start(tmp_path / "part", cfg, stop=True)
    stopped = {r.expert: r.step for r in records if isinstance(r, Stopped)}
    assert stopped and min(stopped.values()) < cfg.steps and (run != "loop" or stopped == {0: STOP})
    for i, model in enumerate(runner.models(tmp_path / "part")):  # a stop writes its checkpoint
        assert i not in stopped or model.read_checkpoint().step == stopped[i]
    runner.resume(tmp_path / "part", cfg)
    for full, part in zip(runner.models(tmp_path / "full"), runner.models(tmp_path / "part"), strict=True):
        a, b = full.read_checkpoint(), part.read_checkpoint()
        assert a.step == b.step == cfg.steps
        assert np.array_equal(a.theta, b.theta)
        assert a.optimizer.keys() == b.optimizer.keys()
        for k in a.optimizer:
            assert np.array_equal(a.optimizer[k], b.optimizer[k]), k
        assert logged(part) == logged(full) and [s for s, _ in logged(part)] == list(range(1, cfg.steps + 1))
    if run == "population-workers":  # the scalars every step exchanged, kept for a worker's replay
        assert sorted(RunFolder(tmp_path / "part").read_scalars()) == list(range(cfg.steps))
