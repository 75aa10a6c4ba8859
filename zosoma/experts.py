"""SOMA training: cluster the corpus, then train N experts with SPSA, one per cluster.

Layout of a SOMA run folder:

    RUN/soma.json             what the run is: N, loss mode, chunking, data (written once, atomically)
    RUN/router.h5             the Clustering (idf, SVD projection, centroids) the router needs
    RUN/expert{i}/            one training folder per expert (checkpoint.h5, metrics.jsonl)
    RUN/results.json          the final evaluation

Independent losses (SOMA): each expert trains on its own cluster with its own noise stream
(expert index i in every counter) and shares nothing, so experts run in separate worker processes;
a crash or a stop in one loses nothing of the others, and each resumes from its own checkpoint.

Summed loss (the ablation): the same experts, starting weights, batches and perturbations, but every
expert's update uses the shared coefficients sum_j (L_j(+) - L_j(-)) / (2 eps). That couples the
experts at every step, so they run in lockstep in one process; a resumed run restarts all of them
from the newest step every expert has a checkpoint for (checkpoint.prev.h5 covers one that was
already one checkpoint ahead).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .backend import child_threads
from .cluster import ClusterConfig, cluster_report, fit_clusters, save_clustering
from .config import ModelConfig, TrainConfig
from .corpus import BatchSampler, Corpus, chunk, load_text
from .download import find_wikitext103
from .errors import ConfigError, DataError
from .routing import evaluate_routed, evaluate_routed_corpus, load_ensemble
from .runs import data_record, fingerprint, load_data, write_json
from .train import (CHECKPOINT, Trainer, central_differences, from_checkpoint, new_state,
                    read_checkpoint, train)

SOMA = "soma.json"
ROUTER = "router.h5"
LOSSES = ("independent", "summed")


def expert_dir(run_dir: Path, i: int) -> Path:
    return Path(run_dir) / f"expert{i}"


def expert_corpora(chunks: Corpus, assignments: np.ndarray, n: int) -> list[Corpus]:
    return [chunks.subset(np.flatnonzero(assignments == i)) for i in range(n)]


def start_soma(run_dir: Path, model: ModelConfig, cfg: TrainConfig, n_experts: int, loss: str = "independent",
               workers: int | None = None, chunk_size: int = 2048, train_paths=None, heldout_paths=None,
               wikitext=None, top_k: int = 2, should_stop: Callable[[], bool] = lambda: False,
               device: str = "cpu") -> Iterator[dict]:
    """Cluster, initialise and train a new SOMA run; yields "clusters", "start", per-step records
    (with "expert"), per-expert "done"/"stopped"/"failed", then "evaluated"."""
    report, n_chunks = create_soma(run_dir, model, cfg, n_experts, loss, chunk_size, train_paths,
                                   heldout_paths, wikitext, top_k)
    soma, train_corpus, corpora, heldout = open_soma(run_dir)
    yield {"event": "clusters", "report": report, "n_chunks": n_chunks, "chunk_size": chunk_size}
    yield {"event": "start", "run_dir": str(run_dir), "n_params": model.n_params(), "experts": n_experts,
           "loss_mode": loss, "data": train_corpus, "model": model, "train": cfg, "steps": [0] * n_experts}
    yield from _train_experts(run_dir, soma, corpora, workers, should_stop, device)
    yield from _evaluate(run_dir, soma, heldout, device)


def create_soma(run_dir: Path, model: ModelConfig, cfg: TrainConfig, n_experts: int, loss: str = "independent",
                chunk_size: int = 2048, train_paths=None, heldout_paths=None, wikitext=None,
                top_k: int = 2) -> tuple[list[dict], int]:
    """Cluster the corpus and write a new SOMA run folder, every expert at step 0 (nothing is
    trained). Returns the clusters' report and the number of chunks."""
    run_dir = Path(run_dir)
    if (run_dir / SOMA).exists() or (run_dir / CHECKPOINT).exists():
        raise ConfigError(f"{run_dir} already holds a run: use --resume {run_dir} or another --run-dir")
    if loss not in LOSSES:
        raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if loss == "summed" and cfg.optimizer == "eggroll":
        raise ConfigError("the summed-loss ablation shares SPSA central differences; use it with an SPSA optimizer")
    if chunk_size < cfg.seq_len + 1:
        raise ConfigError(f"chunk size {chunk_size} is shorter than a training window of {cfg.seq_len + 1} bytes")
    train_corpus, _ = load_data(train_paths, heldout_paths)
    chunks = chunk(train_corpus, chunk_size)
    if n_experts > len(chunks):
        raise ConfigError(f"cannot make {n_experts} clusters from {len(chunks)} chunks of {chunk_size} bytes")
    cluster_cfg = ClusterConfig(n_clusters=n_experts, seed=cfg.seed)
    clustering, assignments = fit_clusters(chunks, cluster_cfg)
    report = cluster_report(assignments, chunks.names, n_experts)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_clustering(run_dir / ROUTER, clustering)
    data = data_record(train_corpus, train_paths, heldout_paths, wikitext)
    soma = {"experts": n_experts, "loss": loss, "chunk_size": chunk_size, "top_k": top_k, "data": data,
            "cluster_sizes": [r["size"] for r in report], "assignments": assignments.tolist()}
    corpora = expert_corpora(chunks, assignments, n_experts)
    for i in range(n_experts):  # step-0 checkpoints: every expert can resume from the start
        Trainer(expert_dir(run_dir, i), model, cfg, BatchSampler(corpora[i], cfg.seq_len + 1),
                new_state(model, cfg, expert=i), expert=i, extra={"data": data, "loss": loss}).checkpoint()
    write_json(run_dir / SOMA, soma)  # last: a folder without soma.json holds no run yet
    return report, len(chunks)


def open_soma(run_dir: Path) -> tuple[dict, Corpus, list[Corpus], Corpus | None]:
    """A SOMA run folder's description, its training corpus, each expert's cluster of it, and the
    held-out corpus; refuses training data that changed since the run started."""
    soma = read_soma(run_dir)
    data = soma["data"]
    train_corpus, heldout = load_data(data["train"] or None, data["heldout"] or None)
    if fingerprint(train_corpus) != data["fingerprint"]:
        raise DataError(f"the training data of {run_dir} changed since the run started; cannot resume exactly")
    chunks = chunk(train_corpus, soma["chunk_size"])
    corpora = expert_corpora(chunks, np.asarray(soma["assignments"]), soma["experts"])
    return soma, train_corpus, corpora, heldout


def read_soma(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / SOMA).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run_dir}: not a SOMA run folder ({SOMA} unreadable: {e})") from None


def soma_summary(run_dir: Path) -> str:
    """A few lines for `zosoma info RUN`: what the run is and how far each expert got."""
    soma = read_soma(run_dir)
    lines = [f"SOMA run {run_dir}: {soma['experts']} experts, {soma['loss']} losses, chunks of "
             f"{soma['chunk_size']} bytes, cluster sizes {soma['cluster_sizes']}"]
    for i in range(soma["experts"]):
        c = read_checkpoint(expert_dir(run_dir, i))
        lines.append(f"  expert{i}: step {c.step}/{c.train.steps}, {c.model.n_params():,} parameters, "
                     f"last loss {c.metrics[-1]['loss']:.4f}" if c.metrics else f"  expert{i}: step 0")
    lines.append(f"details: zosoma info {Path(run_dir) / 'expert0'}")
    return "\n".join(lines)


def resume_soma(run_dir: Path, workers: int | None = None, should_stop: Callable[[], bool] = lambda: False,
                device: str = "cpu") -> Iterator[dict]:
    """Continue every expert of a SOMA run where it stopped, then evaluate."""
    run_dir = Path(run_dir)
    soma, train_corpus, corpora, heldout = open_soma(run_dir)
    ckpts = [read_checkpoint(expert_dir(run_dir, i)) for i in range(soma["experts"])]
    first = ckpts[0]
    yield {"event": "start", "run_dir": str(run_dir), "n_params": first.model.n_params(),
           "experts": soma["experts"], "loss_mode": soma["loss"], "data": train_corpus, "model": first.model,
           "train": first.train, "steps": [c.step for c in ckpts]}
    yield from _train_experts(run_dir, soma, corpora, workers, should_stop, device)
    yield from _evaluate(run_dir, soma, heldout, device)


def _train_experts(run_dir, soma, corpora, workers, should_stop, device):
    if soma["loss"] == "summed":
        yield from train_lockstep(lockstep_trainers(run_dir, soma, corpora, device), should_stop)
    else:
        yield from _train_parallel(run_dir, soma, corpora, workers, should_stop, device)


def expert_trainer(run_dir: Path, soma: dict, corpus: Corpus, i: int, step: int | None = None,
                   device: str = "cpu") -> Trainer:
    """Expert i's Trainer from its newest checkpoint (or the one at `step`)."""
    ckpt = read_checkpoint(expert_dir(run_dir, i), step)
    return Trainer(expert_dir(run_dir, i), ckpt.model, ckpt.train, BatchSampler(corpus, ckpt.train.seq_len + 1),
                   from_checkpoint(ckpt), expert=i, extra={"data": soma["data"], "loss": soma["loss"]},
                   device=device)


def lockstep_trainers(run_dir: Path, soma: dict, corpora: list[Corpus], device: str = "cpu") -> list[Trainer]:
    """Every expert's Trainer at the newest step that all of them have a checkpoint for."""
    n = soma["experts"]
    step = min(read_checkpoint(expert_dir(run_dir, i)).step for i in range(n))
    return [expert_trainer(run_dir, soma, corpora[i], i, step, device) for i in range(n)]


def train_lockstep(trainers: list[Trainer], should_stop: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """The summed-loss ablation: every expert updated with the shared central differences
    sum_j (L_j(+) - L_j(-)) / (2 eps); records as `train` yields them."""
    eps = trainers[0].cfg.eps
    while not trainers[0].done:
        if should_stop():
            for t in trainers:
                t.checkpoint()
                yield {"event": "stopped", "step": t.state.step, "expert": t.expert}
            return
        losses = [t.losses() for t in trainers]
        shared = sum(plus - minus for plus, minus in losses) / (2 * eps)
        for t, (plus, minus) in zip(trainers, losses):
            yield t.update(shared, central_differences(plus, minus, eps)[1])
    for t in trainers:
        yield {"event": "done", "step": t.state.step, "expert": t.expert}


# Worker processes: spawned (no fork under BLAS threads), SIGINT ignored so that only the parent
# reacts to Ctrl-C; it asks the workers to stop through an Event, and they checkpoint and return.
_queue = _stop = None


def _init_worker(records, stop):
    global _queue, _stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _queue, _stop = records, stop


def _run_expert(run_dir: str, soma: dict, corpus: Corpus, i: int, device: str) -> None:
    trainer = expert_trainer(Path(run_dir), soma, corpus, i, device=device)
    for record in train(trainer, should_stop=_stop.is_set):
        _queue.put(record)


def _train_parallel(run_dir, soma, corpora, workers, should_stop, device):
    n = soma["experts"]
    workers = max(1, min(n, workers or os.cpu_count() or 1))
    if workers == 1:  # one after another in this process
        for i in range(n):
            yield from train(expert_trainer(Path(run_dir), soma, corpora[i], i, device=device), should_stop)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")
    records, stop = ctx.Queue(), ctx.Event()
    with child_threads(threads), ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                     initargs=(records, stop)) as pool:
        futures = {pool.submit(_run_expert, str(run_dir), soma, corpora[i], i, device): i for i in range(n)}
        pending = set(futures)
        while pending or not records.empty():
            if should_stop() and not stop.is_set():
                stop.set()
            try:
                yield records.get(timeout=0.2)
                continue
            except queue.Empty:
                pass
            for f in [f for f in pending if f.done()]:
                pending.discard(f)
                if f.exception() is not None:
                    yield {"event": "failed", "expert": futures[f], "error": _one_line(f.exception())}


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _evaluate(run_dir, soma, heldout, device="cpu"):
    ckpts = [read_checkpoint(expert_dir(run_dir, i)) for i in range(soma["experts"])]
    if any(c.step < c.train.steps for c in ckpts):
        return  # stopped or failed experts: nothing to evaluate yet
    results = evaluate_soma(run_dir, heldout, soma["data"].get("wikitext"), top_k=soma["top_k"], device=device)
    results.update(tokens=sum(int(c.extra.get("tokens", 0)) for c in ckpts),
                   flops=sum(float(c.extra.get("flops", 0)) for c in ckpts),
                   wall_s=sum(float(c.extra.get("wall_s", 0)) for c in ckpts))
    write_json(Path(run_dir) / "results.json", results)
    yield {"event": "evaluated", **results}


def evaluate_soma(run_dir: Path, heldout: Corpus | None, wikitext=None, top_k: int = 2,
                  temperature: float = 0.1, segment: int = 256, context: int = 512, device: str = "cpu") -> dict:
    """Routed ensemble, each expert alone and oracle routing, in nats/byte: per held-out domain
    ({"heldout": {name: {"routed": x, "expert0": y, ..., "oracle": z}}}) and on WikiText-103."""
    ensemble = load_ensemble(run_dir, top_k, temperature).on(device)
    kw = dict(segment=segment, context=context)
    out: dict = {"heldout": None, "wikitext103": None, "top_k": top_k, "temperature": temperature, **kw}
    if heldout is not None:
        out["heldout"] = {name: {k: r.nats_per_byte for k, r in by.items()}
                          for name, by in evaluate_routed_corpus(ensemble, heldout, device=device, **kw).items()}
    wiki = find_wikitext103(wikitext)
    if wiki is not None:
        out["wikitext103"] = {k: r.nats_per_byte for k, r in evaluate_routed(ensemble, load_text(wiki), device=device, **kw).items()}
        out["wikitext103_path"] = str(wiki)
    return out
