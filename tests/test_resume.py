"""A run stopped midway and resumed ends exactly where the uninterrupted run ends: every strategy on
the training loop, SOMA's experts (their own and the summed losses) on the inline executor, and one
model's population over workers (stopped on 2, resumed on 4, against a run on none). Theta and the
optimizer state bit for bit, and the metrics log holds each step once, with the same losses."""

import hashlib
import json
import warnings

import h5py
import numpy as np
import pytest

from world import TINY_MODEL as MODEL
from zosoma.engines.ops import Ops
from zosoma.config import TrainConfig, to_json
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.formats.checkpoint import load_checkpoint, write_contents
from zosoma.formats.h5util import text_array
from zosoma.model.params import Layout
from zosoma.workers.executor import Inline
from zosoma.training.folder import METRICS, MetricsDamaged, RunFolder
from zosoma.workers.population_workers import InProcess, Sharding
from zosoma.training.records import Stopped
from zosoma.runs.single import resume_run, start_run
from zosoma.runs.soma import resume_soma, start_soma
from zosoma.training.trainer import Trainer, from_checkpoint, guard_of, new_state, train

BASE = dict(steps=12, batch=2, seq_len=16, perturbations=4, warmup=2, checkpoint_every=5)
STRATEGY = {"sgd": dict(lr=0.2, weight_decay=0.01), "momentum": dict(lr=0.05, momentum=0.8),
            "adam": dict(lr=0.01, weight_decay=0.01), "eggroll": dict(eps=0.01, lr=0.5, rank=2),
            "es": dict(eps=0.02, lr=0.05),
            # the stateful pieces (docs/cut-price.md): the last update kept, the schedule's P
            "guided": dict(optimizer="sgd", probes="guided", lr=0.2),
            "es-adam-guided": dict(optimizer="es", transforms=("adam",), probes="guided", eps=0.02, lr=0.01),
            "doubling": dict(optimizer="sgd", queries="doubling", lr=0.2),
            "onesided": dict(optimizer="onesided", lr=0.2),
            "readout": dict(lr=0.2, readout_lr=2.0), "rowwise": dict(lr=0.4)}
STOP = 7  # steps before the stop: past one checkpoint (5), short of the next (10)


def stop_after(n: int):
    """A should_stop that turns true at its (n+1)-th call."""
    calls = iter(range(n + 1))
    return lambda: next(calls, n) >= n


class TrainingLoop:
    """The loop itself (zosoma.training.trainer), resumed from the checkpoint it left."""

    def __init__(self, data):
        self.corpus = load_corpus([str(data / "prose.txt")])

    def _train(self, run_dir, cfg, state, stop):
        trainer = Trainer(run_dir, MODEL, cfg, BatchSampler(self.corpus, cfg.seq_len + 1), state, ops=Ops())
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
                               **self.args, ops=Ops()))

    def resume(self, run_dir, cfg):
        return list(resume_soma(run_dir, Inline(), ops=Ops()))

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
                              should_stop=stop_after(STOP) if stop else lambda: False, ops=Ops()))

    def resume(self, run_dir, cfg):
        return list(resume_run(run_dir, sharding=Sharding(InProcess(), 4), ops=Ops()))

    def models(self, run_dir):
        return [RunFolder(run_dir)]


RUNS = {"loop": TrainingLoop, "soma": lambda data: Soma(data, "independent"),
        "soma-summed": lambda data: Soma(data, "summed"), "population-workers": PopulationWorkers}
CASES = [(s, "loop") for s in STRATEGY] + [("sgd", "soma"), ("eggroll", "soma"), ("es-adam-guided", "soma"),
                                            ("readout", "soma"), ("sgd", "soma-summed"), ("sgd", "population-workers"),
                                            ("guided", "population-workers"), ("onesided", "population-workers")]


def logged(folder: RunFolder) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (folder.path / METRICS).read_text().splitlines())]


@pytest.mark.usefixtures("scratch_cwd")
@pytest.mark.parametrize("optimizer, run", CASES, ids=[f"{s}-{r}" for s, r in CASES])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, two_domains, optimizer, run):
    cfg = TrainConfig(**{"optimizer": optimizer, **BASE, **STRATEGY[optimizer]})
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


# --- the step records live in metrics.jsonl, which a checkpoint counts and checksums ---------------

def write_format_2(path, ckpt, records):
    """`ckpt` written as zosoma wrote checkpoints before format version 3: the step records inside
    (/metrics), no divergence guard in extra, no metrics_records or metrics_sha256."""
    layout = Layout(ckpt.model)
    extra = {k: v for k, v in ckpt.extra.items() if k != "guard"}
    texts = {"format": "zosoma-checkpoint", "format_version": "2", "zosoma_version": "0.1.0",
             "config": to_json(ckpt.model, ckpt.train), "created": "2026-12-01T00:00:00+00:00",
             "step": str(ckpt.step), "extra": json.dumps(extra, sort_keys=True), "metrics": json.dumps(records),
             "layout": json.dumps([[e.name, list(e.shape), e.offset] for e in layout.entries])}
    numbers = {"format_version": np.int64(2), "step": np.int64(ckpt.step)}
    with h5py.File(path, "w") as f:
        write_contents(f, texts, numbers, layout, ckpt.theta, ckpt.optimizer)
        f.create_dataset("metrics", data=text_array(texts["metrics"]))


def stopped_and_whole(tmp_path, two_domains):
    """The loop's sgd run whole, and the same run stopped at step STOP (checkpoints at 5 and 7)."""
    cfg = TrainConfig(optimizer="sgd", **BASE, **STRATEGY["sgd"])
    runner = TrainingLoop(two_domains)
    runner.start(tmp_path / "full", cfg, stop=False)
    runner.start(tmp_path / "part", cfg, stop=True)
    return runner, cfg, RunFolder(tmp_path / "full"), RunFolder(tmp_path / "part")


def assert_same_run(full: RunFolder, part: RunFolder, cfg):
    a, b = full.read_checkpoint(), part.read_checkpoint()
    assert a.step == b.step == cfg.steps and np.array_equal(a.theta, b.theta)
    assert b.extra["guard"] == a.extra["guard"]


@pytest.mark.parametrize("log", ["kept", "short", "missing"])
def test_a_checkpoint_of_format_version_2_resumes_bit_for_bit(tmp_path, two_domains, log):
    """Checkpoints written before the step records left them still resume: their records are the
    log (metrics.jsonl written anew from them) and the divergence guard is replayed over them."""
    runner, cfg, full, part = stopped_and_whole(tmp_path, two_domains)
    lines = (part.path / METRICS).read_text().splitlines(keepends=True)
    for name in ("checkpoint.h5", "checkpoint.prev.h5"):
        new = load_checkpoint(part.path / name)
        write_format_2(part.path / name, new, [json.loads(x) for x in lines[:new.step]])
        old = load_checkpoint(part.path / name)
        assert old.stored_metrics is not None and guard_of(old) == guard_of(new)
    if log == "short":
        (part.path / METRICS).write_text("".join(lines[:3]))
    elif log == "missing":
        (part.path / METRICS).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MetricsDamaged)  # the checkpoint's own records: nothing is damaged
        runner.resume(part.path, cfg)
    assert_same_run(full, part, cfg)
    assert logged(part) == logged(full)
    assert load_checkpoint(part.path / "checkpoint.prev.h5").step == 10  # rotation went on past the old files


@pytest.mark.parametrize("how", ["edited", "truncated", "missing"])
def test_a_damaged_metrics_log_is_said_and_set_aside_and_the_run_resumes_bit_for_bit(tmp_path, two_domains, how):
    runner, cfg, full, part = stopped_and_whole(tmp_path, two_domains)
    path = part.path / METRICS
    lines = path.read_text().splitlines(keepends=True)
    if how == "edited":  # one loss changed: the same number of lines, another checksum
        lines[2] = json.dumps({**json.loads(lines[2]), "loss": 1.0}) + "\n"
        path.write_text("".join(lines))
    elif how == "truncated":
        path.write_text("".join(lines[:4]))
    else:
        path.unlink()
    damaged = path.read_bytes() if path.exists() else None
    with pytest.warns(MetricsDamaged, match=f"{METRICS} does not hold the {STOP} records its checkpoint counts"):
        runner.resume(part.path, cfg)
    assert_same_run(full, part, cfg)  # training never reads the log back
    aside = list(part.path.glob("metrics.damaged-*.jsonl"))
    assert [p.read_bytes() for p in aside] == ([damaged] if damaged is not None else [])
    assert logged(part) == logged(full)[STOP:]  # the log begins anew at the checkpoint
    end = part.read_checkpoint()
    assert end.metrics_records == cfg.steps - STOP
    assert end.metrics_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert part.read_metrics(end) == [json.loads(x) for x in path.read_text().splitlines()]
