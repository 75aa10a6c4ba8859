"""SOMA runs: cluster the corpus, then train N experts, one per cluster; evaluate the routed ensemble.

Independent losses (SOMA): each expert trains on its own cluster with its own noise stream
(expert index i in every counter) and shares nothing, so each expert is one unit of work for an
executor (zosoma.workers.executor): it opens its folder, resumes from its last checkpoint and trains;
a crash or a stop in one loses nothing of the others.

Summed loss (the ablation, zosoma.strategies.summed): the same experts, starting weights, batches
and perturbations, but every expert's update uses the shared scalars of the summed loss. That
couples the experts at every step, so they run in lockstep in one process (every expert's members
evaluated together: zosoma.training.together.losses_together); a resumed run restarts
all of them from the newest step every expert has a checkpoint for (checkpoint.prev.h5 covers one
that was already one checkpoint ahead). Given `workers` (zosoma.workers.population_workers: local processes
or Ray actors), each expert lives on a worker of its own and only the losses and the shared P
scalars travel each step, with the same numbers.

The folder's files are zosoma.training.folder's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from zosoma.config import LOSSES, ClusterConfig, ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, chunk, describe, load_text
from zosoma.download import check_wikitext103, find_wikitext103
from zosoma.engines import SendsEngine
from zosoma.engines.ops import Ops
from zosoma.errors import CheckpointError, ConfigError, OptionError
from zosoma.model.params import Layout
from zosoma.model.protocol import PROTOCOL
from zosoma.training.events import EventLog
from zosoma.workers.executor import Inline
from zosoma.training.folder import (CHECKPOINT, ROUTER, CheckpointFallback, RunFolder, noting_fallbacks,
                                 warn_if_training)
from zosoma.workers.population_workers import borrower, summed_trainers
from zosoma.training.records import Clusters, Diverged, Dropped, Evaluated, Evaluating, Finished, Started, Stopped
from zosoma.workers.placement import Placement
from zosoma.training.shape import DataPaths, SomaShape
from zosoma.runs.single import check_trained, data_record, extended, load_data, no_heldout, recorded_data
from zosoma.training.together import losses_together
from zosoma.training.trainer import Trainer, from_checkpoint, new_state, summary_of, train
from zosoma.mixture.cluster import cluster_report, fit_clusters, load_clustering, save_clustering
from zosoma.mixture.routing import Ensemble, Router, evaluate_routed, evaluate_routed_corpus
from zosoma.strategies import make_strategy
from zosoma.strategies.summed import Summed
from zosoma.yardsticks import lookup


def expert_corpora(chunks: Corpus, assignments: np.ndarray, n: int) -> list[Corpus]:
    return [chunks.subset(np.flatnonzero(assignments == i)) for i in range(n)]


@dataclass(frozen=True)
class SomaRun:
    """An opened SOMA run: its folder, description (soma.json), each expert's cluster of the
    training corpus, and the held-out corpus (None when there is none)."""
    folder: RunFolder
    soma: SomaShape
    train_corpus: Corpus
    corpora: tuple
    heldout: Corpus | None

    @property
    def n_experts(self) -> int:
        return self.soma.experts

    def extra(self) -> dict:
        return {"data": self.soma.data.to_json(), "loss": self.soma.loss}

    def trainer(self, i: int, ops: Ops, step: int | None = None) -> Trainer:
        """Expert i's Trainer from its newest checkpoint (or the one at `step`); a damaged newest
        one is set aside (with a CheckpointFallback warning)."""
        folder = self.folder.expert(i)
        ckpt = folder.read_checkpoint(step, set_aside=True)
        cfg = run_length(self.soma, ckpt.train)
        return Trainer(folder, ckpt.model, cfg, BatchSampler(self.corpora[i], cfg.seq_len + 1),
                       from_checkpoint(ckpt), ops, expert=i, extra=self.extra())


def run_length(soma: SomaShape, cfg: TrainConfig) -> TrainConfig:
    """An expert's config with the run's length: a resume that extended a SOMA run records the new
    length in soma.json first, so every expert takes it, checkpointed yet or not."""
    steps = cfg.steps if soma.steps is None else soma.steps
    return cfg if steps == cfg.steps else dataclasses.replace(cfg, steps=steps)


def start_soma(run_dir, model: ModelConfig, cfg: TrainConfig, n_experts: int, loss: str = "independent",
               executor=None, chunk_size: int = 2048, train_paths=None, heldout_paths=None, wikitext=None,
               top_k: int = 2, should_stop: Callable[[], bool] = lambda: False, *, ops: Ops,
               workers=None, placement: Placement | None = None) -> Iterator:
    """Cluster, initialise and train a new SOMA run in run_dir (new or empty); yields Clusters,
    Started, the experts' Step records, Finished / Stopped / Failed per expert, then Evaluated.
    The run folder is locked while it runs; each expert's folder by the unit training it.
    `ops` is the run's engine (zosoma.runs.run.engine); `placement`, where it all runs, is
    recorded for a resume."""
    folder = RunFolder(run_dir)
    folder.require_empty()
    with folder.lock():
        report, n_chunks = create_soma(run_dir, model, cfg, n_experts, loss, chunk_size, train_paths,
                                       heldout_paths, wikitext, top_k)
        if placement is not None:
            folder.write_placement(placement)
        run = open_soma(run_dir)
        yield Clusters(report, n_chunks, chunk_size)
        yield Started(str(run_dir), model, cfg, describe(run.train_corpus), n_experts, loss, (0,) * n_experts, ops.name)
        yield from no_heldout(train_paths, heldout_paths)
        yield from _train_and_evaluate(run, executor, should_stop, ops, workers)


def create_soma(run_dir, model: ModelConfig, cfg: TrainConfig, n_experts: int, loss: str = "independent",
                chunk_size: int = 2048, train_paths=None, heldout_paths=None, wikitext=None,
                top_k: int = 2, new_folder: bool = True) -> tuple[list[dict], int]:
    """Cluster the corpus and write a new SOMA run folder, every expert at step 0 (nothing is
    trained). Returns the clusters' report and the number of chunks. The folder must be new or
    empty, unless new_folder=False (a study redoing its own interrupted creation: the
    clustering and step-0 checkpoints are seeded, so the same files are written again)."""
    folder = RunFolder(run_dir)
    if folder.is_soma:
        raise ConfigError(f"{run_dir} already holds a run: use --resume {run_dir} or another --run-dir")
    if new_folder:
        folder.require_empty()
    if loss not in LOSSES:
        raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    strategy = make_strategy(cfg)
    strategy.check(Layout(model))  # before anything is written
    if loss == "summed":
        Summed([strategy])  # refuses strategies whose scalars do not add up
    if chunk_size < cfg.seq_len + 1:
        raise OptionError(f"chunk size {chunk_size} is shorter than a training window of {cfg.seq_len + 1} bytes")
    train_corpus, _ = load_data(train_paths, heldout_paths)  # the held-out files are checked here too
    found = check_wikitext103(wikitext)  # a bad --wikitext fails now, not after training
    data = data_record(train_corpus, train_paths, heldout_paths, found if wikitext else None)
    chunks = chunk(train_corpus, chunk_size)
    if n_experts > len(chunks):
        raise OptionError(f"cannot make {n_experts} clusters from {len(chunks)} chunks of {chunk_size} bytes: "
                          f"use at most {len(chunks)} --experts, or a smaller --chunk-size")  # a usage error
    check_cluster_size(train_corpus.n_bytes, n_experts, model)
    clustering, assignments = fit_clusters(chunks, ClusterConfig(n_clusters=n_experts, seed=cfg.seed))
    report = cluster_report(assignments, chunks.names, n_experts)
    folder.make()
    save_clustering(folder.router, clustering)
    soma = SomaShape(n_experts, loss, chunk_size, top_k, DataPaths.from_json(data),
                     tuple(r["size"] for r in report), tuple(assignments.tolist()))
    corpora = expert_corpora(chunks, assignments, n_experts)
    for i in range(n_experts):  # step-0 checkpoints: every expert can resume from the start
        # (no forward runs here: the CPU engine only writes the NumPy arrays; training hands its own down)
        Trainer(folder.expert(i), model, cfg, BatchSampler(corpora[i], cfg.seq_len + 1),
                new_state(model, cfg, expert=i), Ops(), expert=i, extra={"data": data, "loss": loss}).checkpoint()
    folder.write_soma(soma)  # last: a folder without soma.json holds no run yet
    return report, len(chunks)


# A SOMA run's clusters must hold on average at least this many bytes of text per parameter of an
# expert: a model fits about as many bytes as it has parameters, and one with several times more
# parameters than text learns its cluster by heart (while a thousand such experts cost a long
# clustering and a folder of step-0 checkpoints before the first step).
MIN_BYTES_PER_PARAMETER = 0.5


def check_cluster_size(n_bytes: int, n_experts: int, model: ModelConfig) -> None:
    """A ConfigError in one line, before any clustering, when the experts' clusters would hold on
    average fewer than MIN_BYTES_PER_PARAMETER bytes of text per parameter of an expert."""
    d = model.n_params()
    if n_bytes < MIN_BYTES_PER_PARAMETER * n_experts * d:
        most = int(n_bytes // (MIN_BYTES_PER_PARAMETER * d))
        raise OptionError(f"--experts {n_experts}: clusters of about {n_bytes // n_experts:,} bytes of text for "
                          f"experts of {d:,} parameters, {n_bytes / n_experts / d:.2g} bytes per parameter, under the "
                          f"{MIN_BYTES_PER_PARAMETER:g} an expert needs: at most {most} experts of this size for "
                          f"these {n_bytes:,} bytes (or more text, or smaller experts)")


def open_soma(run_dir) -> SomaRun:
    """A SOMA run folder opened once: refuses training data that changed since the run started."""
    folder = RunFolder(run_dir)
    soma = folder.read_soma()
    train_corpus, heldout = recorded_data(soma.data.to_json(), run_dir)
    chunks = chunk(train_corpus, soma.chunk_size)
    corpora = expert_corpora(chunks, np.asarray(soma.assignments), soma.experts)
    return SomaRun(folder, soma, train_corpus, tuple(corpora), heldout)


def soma_description(run_dir, fallback: bool = False) -> dict:
    """What `zosoma info --json RUN` prints: the run's description and how far each expert got. A
    damaged newest checkpoint is an error unless `fallback` (then a CheckpointFallback warning)."""
    folder = RunFolder(run_dir)
    soma = folder.read_soma()
    experts = []
    for i in range(soma.experts):
        c = folder.expert(i).read_checkpoint(fallback=fallback)
        t, last = summary_of(c), folder.expert(i).last_metrics(c)
        experts.append({"expert": i, "step": c.step, "steps": c.train.steps, "n_params": c.model.n_params(),
                        "last_loss": last["loss"] if last else None, "restarts": t["restarts"],
                        "dropped": t["dropped"]})
    return {"run": str(run_dir), **{k: getattr(soma, k) for k in ("experts", "loss", "chunk_size", "top_k")},
            "cluster_sizes": list(soma.cluster_sizes), "experts_status": experts}


def soma_summary(d: dict) -> str:
    """A few lines for `zosoma info RUN`: a soma_description as text."""
    run_dir = d["run"]
    lines = [f"SOMA run {run_dir}: {d['experts']} experts, {d['loss']} losses, chunks of "
             f"{d['chunk_size']} bytes, cluster sizes {d['cluster_sizes']}"]
    for e in d["experts_status"]:
        fate = (f", {len(e['restarts'])} restart(s)" if e["restarts"] else "") + (
            f", DROPPED at step {e['dropped']['step']} (left out of routing)" if e["dropped"] else "")
        lines.append((f"  expert{e['expert']}: step {e['step']}/{e['steps']}, {e['n_params']:,} parameters, "
                      f"last loss {e['last_loss']:.4f}" if e["last_loss"] is not None else
                      f"  expert{e['expert']}: step 0") + fate)
    lines.append(f"details: zosoma info {RunFolder(run_dir).expert(0)}")
    return "\n".join(lines)


def resume_soma(run_dir, executor=None, should_stop: Callable[[], bool] = lambda: False, *,
                ops: Ops, workers=None, placement: Placement | None = None, steps: int | None = None,
                wikitext=None) -> Iterator:
    """Continue every expert of a SOMA run where it stopped, then evaluate, on `ops` (the run's
    engine, zosoma.runs.run.engine); `steps` extends the run to that many steps per
    expert, `wikitext` replaces the WikiText-103 file it is scored on, and `placement` is
    recorded as where it now runs."""
    folder = RunFolder(run_dir)
    with folder.lock():
        run = open_soma(run_dir)
        soma = run.soma
        if wikitext:
            soma = soma.replaced(data=dataclasses.replace(soma.data, wikitext=str(check_wikitext103(wikitext))))
        else:
            check_wikitext103(soma.data.wikitext)
        with warnings.catch_warnings():  # each expert's unit reports its own fallback
            warnings.simplefilter("ignore", CheckpointFallback)
            ckpts = [run.folder.expert(i).read_checkpoint() for i in range(run.n_experts)]
        first, done = ckpts[0], tuple(c.step for c in ckpts)
        cfg, notes = extended(run_length(soma, first.train), min(done), steps, run_dir)
        if notes:
            soma = soma.replaced(steps=cfg.steps)
        if soma != run.soma:
            folder.write_soma(soma)  # before any expert trains on: each unit reads it
            run = open_soma(run_dir)
        if placement is not None:
            folder.write_placement(placement)
        yield from notes
        yield Started(str(run_dir), first.model, cfg, describe(run.train_corpus), run.n_experts,
                      run.soma.loss, done, ops.name, resumed=True)
        yield from _train_and_evaluate(run, executor, should_stop, ops, workers)


def _train_and_evaluate(run: SomaRun, executor, should_stop, ops: Ops, workers=None):
    """Train every expert on the run's engine `ops` (a unit in another process rebuilds it from its
    record, SendsEngine), then evaluate the routed ensemble on it."""
    finished = set()
    if run.soma.loss == "summed":
        with noting_fallbacks() as fallbacks:
            trainers = lockstep_trainers(run, ops)
        yield from fallbacks()
        if workers is not None:  # one worker per expert, exchanging scalars (zosoma.workers.population_workers)
            trainers = summed_trainers(trainers, workers)
        records = train_lockstep(trainers, should_stop)
    else:
        units = [ExpertUnit(str(run.folder), run.soma, run.corpora[i], i, ops) for i in range(run.n_experts)]
        records = (executor or Inline()).run(units, should_stop)
    for record in records:
        if isinstance(record, (Finished, Dropped)):  # a dropped expert is done: routing leaves it out
            finished.add(record.expert)
        yield record
    if len(finished) == run.n_experts and not should_stop():  # stopped or failed experts: nothing to evaluate yet
        yield from _evaluate(run, ops)


@dataclass(frozen=True)
class ExpertUnit(SendsEngine):
    """One expert's training as an idempotent unit of work: open its folder, resume, train."""
    run_dir: str
    soma: SomaShape
    corpus: Corpus
    expert: int
    ops: Ops  # the run's engine: this one inline, rebuilt from its record in another process

    def __call__(self, stopping: Callable[[], bool]) -> Iterator:
        with self.opened() as (trainer, notes):
            yield from notes
            # cores that other experts left free at the end of the run share this one's population
            yield from train(trainer, stopping, borrower(trainer))

    @contextlib.contextmanager
    def opened(self):
        """Within the block, the expert's folder locked and (its Trainer at the newest checkpoint,
        the Note records of a damaged checkpoint or metrics.jsonl passed over): `train` it, or
        train it together with others (zosoma.workers.executor.Together)."""
        folder = RunFolder(self.run_dir).expert(self.expert)
        # wait: a worker of a killed run may still be finishing its step in this folder
        with folder.lock(wait=True), noting_fallbacks() as fallbacks:
            ckpt = folder.read_checkpoint(set_aside=True)
            cfg = run_length(self.soma, ckpt.train)
            trainer = Trainer(folder, ckpt.model, cfg, BatchSampler(self.corpus, cfg.seq_len + 1),
                              from_checkpoint(ckpt), self.ops, expert=self.expert,
                              extra={"data": self.soma.data.to_json(), "loss": self.soma.loss})
            yield trainer, fallbacks()


def lockstep_trainers(run: SomaRun, ops: Ops) -> list[Trainer]:
    """Every expert's Trainer at the newest step that all of them have a checkpoint for."""
    with warnings.catch_warnings():  # said once, when each trainer reads its checkpoint below
        warnings.simplefilter("ignore", CheckpointFallback)
        step = min(run.folder.expert(i).read_checkpoint().step for i in range(run.n_experts))
    return [run.trainer(i, ops, step) for i in range(run.n_experts)]


def train_lockstep(trainers: list[Trainer], should_stop: Callable[[], bool] = lambda: False) -> Iterator:
    """The summed-loss ablation: every expert updated with the shared scalars of the summed loss
    (zosoma.strategies.summed); records as `train` yields them."""
    summed = Summed([t.strategy for t in trainers])
    for t in trainers:
        t.couple()  # a restart would roll one expert back alone: coupled experts stop together
    while not trainers[0].done:
        if should_stop():
            for t in trainers:
                t.checkpoint()
                yield Stopped(t.expert, t.state.step)
            return
        shared, losses = summed.coefficients(losses_together(trainers))  # all members at once
        for t, loss in zip(trainers, losses):
            yield t.update(shared, loss)
            if said := t.went_on():
                yield said
        if any(t.halted for t in trainers):  # coupled experts stop together
            for t in trainers:
                if t.halted:
                    yield t.halt()
                else:
                    t.checkpoint()
                    yield Stopped(t.expert, t.state.step)
            return
    for t in trainers:
        said = t.ran_out()  # the budget ran out mid-divergence (zosoma.training.trainer)
        if said:
            yield said
        if not isinstance(said, Diverged):
            yield Finished(t.expert, t.state.step)


def _evaluate(run: SomaRun, ops: Ops):
    """The routed ensemble scored on the engine the experts trained on (in their forwards' format)."""
    yield Evaluating()
    ckpts = [run.folder.expert(i).read_checkpoint() for i in range(run.n_experts)]
    training = [summary_of(c) for c in ckpts]
    for i, c in enumerate(ckpts):
        if not c.extra.get("dropped"):  # routing leaves a dropped one out
            check_trained(c.theta, training[i]["skipped_steps"], c.step, run.folder.expert(i).path)
    soma = run.soma.replaced(experts_status=tuple({"restarts": len(t["restarts"]), "dropped": t["dropped"]}
                                                  for t in training))
    if soma != run.soma:
        run.folder.write_soma(soma)  # what `zosoma info` shows of each expert
    ensemble = Ensemble(tuple((c.theta, Layout(c.model)) for c in ckpts), router_of(run.folder, ckpts, run.soma.top_k))
    results = evaluate_soma(ensemble, run.heldout, run.soma.data.wikitext, ops=ops)
    results.update(tokens=sum(int(c.extra.get("tokens", 0)) for c in ckpts),
                   flops=sum(float(c.extra.get("flops", 0)) for c in ckpts),
                   wall_s=sum(float(c.extra.get("wall_s", 0)) for c in ckpts), training=training,
                   dropped=list(ensemble.router.dropped), checkpoint_steps=[c.step for c in ckpts])
    run.folder.write_results(results)
    _evaluation_events(run, ckpts, results)
    yield Evaluated(results, lookup(run.heldout, run.soma.data.wikitext))


def _evaluation_events(run: SomaRun, ckpts, results: dict) -> None:
    """The routed ensemble's figures in RUN's event file, each expert's alone in its folder's."""
    step = max(c.step for c in ckpts)
    held = (results["heldout"] or {}).get("overall", {})
    wiki = results["wikitext103"] or {}
    for folder, key, at in [(run.folder, "routed", step)] + [(run.folder.expert(i), f"expert{i}", c.step)
                                                            for i, c in enumerate(ckpts)]:
        log = EventLog(folder.path)
        log.evaluation(at, held.get(key), wiki.get(key))
        log.close()


def router_of(folder: RunFolder, ckpts, top_k: int, temperature: float = 0.1) -> Router:
    """The run's router over the experts it did not drop; top-k falls to the experts left (with a
    warning) when fewer than k are."""
    dropped = dropped_of(ckpts)
    live = len(ckpts) - len(dropped)
    if live == 0:
        raise ConfigError(f"{folder}: every expert was dropped (they all diverged): nothing to route to")
    if top_k > live:
        warnings.warn(f"{folder}: experts {dropped} were dropped; routing top-{live} instead of top-{top_k}",
                      DroppedExperts, stacklevel=2)
    return Router(load_clustering(folder.router), min(top_k, live), temperature, dropped)


def dropped_of(ckpts) -> list[int]:
    """The experts whose training gave up on them (zosoma.training.trainer): routing never chooses them."""
    return [i for i, c in enumerate(ckpts) if c.extra.get("dropped")]


class DroppedExperts(UserWarning):
    """A SOMA run routes over fewer experts than asked, because some were dropped; or a dropped
    model is used alone (exported)."""


def load_ensemble(run_dir, top_k: int, temperature: float = 0.1, fallback: bool = False) -> Ensemble:
    """The ensemble of a SOMA run folder: its router (the clustering) and, for each of its N
    clusters, the newest checkpoint of expert i. CheckpointError names the missing or damaged
    file (with `fallback`, an older intact checkpoint is used instead, with a CheckpointFallback
    warning); ConfigError for an impossible top-k or temperature (checked before reading
    experts). A run still training is said (StillTraining: the steps of the checkpoints read)."""
    folder = RunFolder(run_dir)
    if not folder.path.is_dir():
        raise CheckpointError(f"{run_dir}: no such run folder")
    if not folder.router.is_file():
        raise CheckpointError(f"{run_dir}: no {ROUTER} (the clustering the router needs); "
                              "is this a SOMA run folder?")
    Router(load_clustering(folder.router), top_k, temperature)  # an impossible top-k or temperature: now
    N = load_clustering(folder.router).n_clusters
    ckpts = []
    for i in range(N):
        expert = folder.expert(i)
        if not expert.has_checkpoint:
            raise CheckpointError(f"{expert}: no {CHECKPOINT} (the router has {N} clusters, so "
                                  f"the run needs expert0 .. expert{N - 1})")
        ckpts.append(expert.read_checkpoint(fallback=fallback))
    warn_if_training(run_dir, [c.step for c in ckpts])
    return Ensemble(tuple((c.theta, Layout(c.model)) for c in ckpts), router_of(folder, ckpts, top_k, temperature))


def evaluate_soma(ensemble: Ensemble, heldout: Corpus | None, wikitext, ops: Ops,
                  segment: int = PROTOCOL.segment, context: int = PROTOCOL.context) -> dict:
    """Routed ensemble, each expert alone and oracle routing, in nats/byte: per held-out domain
    ({"heldout": {name: {"routed": x, "expert0": y, ..., "oracle": z}}}) and on WikiText-103."""
    ensemble = ensemble.on(ops)
    kw = dict(segment=segment, context=context)
    out: dict = {"heldout": None, "wikitext103": None, "top_k": ensemble.top_k,
                 "temperature": ensemble.router.temperature, **kw}
    if heldout is not None:
        out["heldout"] = {name: {k: r.nats_per_byte for k, r in by.items()}
                          for name, by in evaluate_routed_corpus(ensemble, heldout, ops, **kw).items()}
    wiki = find_wikitext103(wikitext)
    if wiki is not None:
        out["wikitext103"] = {k: r.nats_per_byte for k, r in evaluate_routed(ensemble, load_text(wiki), ops=ops, **kw).items()}
        out["wikitext103_path"] = str(wiki)
    return out
