"""SOMA training: clusters, independent experts, the summed-loss ablation, resumption, errors."""

import copy
import json
import multiprocessing

import numpy as np
import pytest

from world import TINY_MODEL as MODEL
from zosoma.engines.ops import Ops
from zosoma.engines.cpu import forward
from zosoma.config import TrainConfig
from zosoma.errors import ConfigError
from zosoma.workers.executor import Cores, Inline, LocalProcesses
from zosoma.training.folder import SOMA, RunFolder
from zosoma.workers.population_workers import exchange_bytes
from zosoma.training.records import Clusters, Evaluated, Step
from zosoma.runs.soma import resume_soma, start_soma

CFG = TrainConfig(optimizer="sgd", steps=6, batch=2, seq_len=16, perturbations=2, lr=0.5, checkpoint_every=2)


def records_of(gen):
    return [r for r in gen]


def expert_checkpoint(run_dir, i):
    return RunFolder(run_dir).expert(i).read_checkpoint()


def soma_run(tmp_path, data, **kw):
    args = dict(n_experts=2, chunk_size=256, train_paths=[str(data / "prose.txt"), str(data / "digits.txt")],
                heldout_paths=[str(data / "prose.txt")], executor=Inline(), top_k=2)
    args.update(kw)
    return records_of(start_soma(tmp_path, MODEL, args.pop("cfg", CFG), **args, ops=Ops()))


@pytest.mark.slow
def test_soma_clusters_trains_and_evaluates(tmp_path, two_domains):
    records = soma_run(tmp_path, two_domains)
    clusters = next(r for r in records if isinstance(r, Clusters))
    mixes = [r["mix"] if "mix" in r else r for r in clusters.report]
    assert len(mixes) == 2
    assert {r.expert for r in records if isinstance(r, Step)} == {0, 1}
    done = next(r for r in records if isinstance(r, Evaluated))
    row = done.results["heldout"]["prose"]
    assert {"routed", "expert0", "expert1", "oracle"} <= set(row)
    for i in range(2):
        assert expert_checkpoint(tmp_path, i).step == CFG.steps
    assert json.loads((tmp_path / SOMA).read_text())["experts"] == 2


@pytest.mark.slow
def test_trained_experts_learn_and_specialise(tmp_path, two_domains):
    """After training, each domain's best expert is the one trained on its cluster, and routing
    sends each domain's text to it: the routed mixture beats the other expert by a margin."""
    rng = np.random.default_rng(7)  # held-out text from the same two distributions
    words = [b"river", b"stone", b"light", b"green", b"house", b"quiet"]
    (tmp_path / "prose.txt").write_bytes(b" ".join(words[i] for i in rng.integers(0, 6, 400)))
    (tmp_path / "digits.txt").write_bytes(b",".join(b"%d" % v for v in rng.integers(0, 10**6, 400)))
    cfg = TrainConfig(optimizer="sgd", steps=300, batch=4, seq_len=16, perturbations=8, lr=0.5, checkpoint_every=300)
    records = soma_run(tmp_path / "run", two_domains, cfg=cfg,
                       heldout_paths=[str(tmp_path / "prose.txt"), str(tmp_path / "digits.txt")])
    report = next(r for r in records if isinstance(r, Clusters)).report
    results = next(r for r in records if isinstance(r, Evaluated)).results["heldout"]
    for domain in ("prose", "digits"):
        own = next(i for i, r in enumerate(report) if next(iter(r["mix"])) == domain)  # the cluster it leads
        row = results[domain]
        other = f"expert{1 - own}"
        assert row[f"expert{own}"] < row[other] - 0.2, (domain, row)  # specialised
        assert row["routed"] < row[other] - 0.2 and row["routed"] < 4.5, (domain, row)  # learned, routed well


def counters(monkeypatch):
    """Record every perturbation counter and every batch the trainers use."""
    seen = {"noise": [], "batches": []}
    sums = forward.perturbed_sums

    def recording(theta, layout, batch, scale, seed, expert, step, kind, pairs, *rest):
        for k in pairs:  # each pair's two members, theta + scale*delta_k and theta - scale*delta_k
            seen["noise"] += [(seed, expert, step, k, kind, 1.0), (seed, expert, step, k, kind, -1.0)]
        return sums(theta, layout, batch, scale, seed, expert, step, kind, pairs, *rest)

    monkeypatch.setattr(forward, "perturbed_sums", recording)
    from zosoma.corpus import BatchSampler
    batch = BatchSampler.batch

    def recording_batch(self, seed, stream, step, B):
        out = batch(self, seed, stream, step, B)
        seen["batches"].append((stream, step, out.tobytes()))
        return out

    monkeypatch.setattr(BatchSampler, "batch", recording_batch)
    return seen


@pytest.mark.slow
def test_summed_and_independent_share_perturbations_and_batches(tmp_path, two_domains, monkeypatch):
    seen = {}
    for loss in ("independent", "summed"):
        with monkeypatch.context() as m:
            seen[loss] = counters(m)
            soma_run(tmp_path / loss, two_domains, loss=loss)
    assert sorted(seen["independent"]["noise"]) == sorted(seen["summed"]["noise"])
    assert sorted(seen["independent"]["batches"]) == sorted(seen["summed"]["batches"])
    assert len(seen["summed"]["noise"]) == 2 * CFG.steps * CFG.perturbations * 2
    # Same start, same data and noise, different scalars: the experts end up elsewhere.
    for i in range(2):
        a = expert_checkpoint(tmp_path / "independent", i).theta
        b = expert_checkpoint(tmp_path / "summed", i).theta
        assert not np.array_equal(a, b)


@pytest.mark.slow
def test_worker_processes_match_in_process_training(tmp_path, two_domains):
    soma_run(tmp_path / "serial", two_domains, executor=Inline())
    soma_run(tmp_path / "pool", two_domains, executor=LocalProcesses(2))
    for i in range(2):
        a = expert_checkpoint(tmp_path / "serial", i).theta
        b = expert_checkpoint(tmp_path / "pool", i).theta
        assert np.array_equal(a, b)


def test_free_cores_are_lent_once_every_unit_has_started():
    """Two workers, three units: a core freed while a unit waits for a worker goes to that unit;
    one freed after every unit started is lent to the unit still running."""
    first = Cores(multiprocessing.get_context("spawn"), 2, 3)
    second = copy.copy(first)  # the other worker's view of the same counts
    first.start(), second.start()  # units 0 and 1
    assert second.borrow(1) == 0  # every core is held
    first.end()  # unit 0 ends; unit 2 has not started yet
    assert second.borrow(1) == 0
    first.start()  # unit 2
    second.end()  # unit 1 ends: its core is free until the run ends
    assert first.borrow(5) == 1 and first.borrow(5) == 0


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_last_expert_takes_the_freed_core_with_the_same_bits(tmp_path, two_domains):
    """Three experts over two worker processes, two of them already trained: the third spreads its
    population over both cores from its next checkpoint to its end (its steps exchange scalars
    between two workers), and every expert ends with the bits of the in-process run."""
    cfg = TrainConfig(optimizer="sgd", steps=60, batch=2, seq_len=16, perturbations=4, lr=0.5, checkpoint_every=4)
    soma_run(tmp_path / "serial", two_domains, n_experts=3, cfg=cfg, executor=Inline())
    stopped = []  # expert 2 stopped at step 4, experts 0 and 1 done
    for r in start_soma(tmp_path / "pool", MODEL, cfg, n_experts=3, chunk_size=256, executor=Inline(),
                        train_paths=[str(two_domains / "prose.txt"), str(two_domains / "digits.txt")],
                        should_stop=lambda: bool(stopped), ops=Ops()):
        if isinstance(r, Step) and r.expert == 2 and r.step == 4:
            stopped.append(r)
    records = list(resume_soma(tmp_path / "pool", executor=LocalProcesses(2), ops=Ops()))
    for i in range(3):
        assert np.array_equal(expert_checkpoint(tmp_path / "serial", i).theta,
                              expert_checkpoint(tmp_path / "pool", i).theta)
    assert {r.expert for r in records if isinstance(r, Step)} == {2}
    spread = [r.step for r in records if isinstance(r, Step) and r.expert == 2
              and r.metrics["comm_bytes"] == exchange_bytes(cfg.perturbations, 2)]
    assert spread == list(range(spread[0], cfg.steps + 1))  # once spread, to the end
    assert (spread[0] - 1) % cfg.checkpoint_every == 0  # from a checkpoint, which its new workers read
    # once the others' units ended (slack for a loaded machine: their cores are freed just after their Finished)
    assert spread[0] - 1 <= 4 + 2 * cfg.checkpoint_every


@pytest.mark.slow
def test_soma_errors(tmp_path, two_domains):
    with pytest.raises(ConfigError, match="cannot make 500 clusters"):
        soma_run(tmp_path / "a", two_domains, n_experts=500)
    with pytest.raises(ConfigError, match="shorter than a training window"):
        soma_run(tmp_path / "b", two_domains, chunk_size=8)
    soma_run(tmp_path / "c", two_domains)
    with pytest.raises(ConfigError, match="already holds a run"):
        soma_run(tmp_path / "c", two_domains)
