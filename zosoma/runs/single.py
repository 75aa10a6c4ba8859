"""A training run end to end: its folder, its data, training, and the final evaluation.

This is what `zosoma train` drives; everything is a generator of records so the CLI only renders.
The data a run trains on is recorded in its checkpoint (paths and a sha256 of the bytes), so
`resume` reloads the same data and refuses data that changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterator

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, describe, load_corpus, load_text
from zosoma.download import find_wikitext103
from zosoma.engines import get_ops
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError, DataError
from zosoma.model.evaluate import evaluate_bytes, evaluate_corpus
from zosoma.model.params import Layout
from zosoma.runs.folder import RunFolder
from zosoma.runs.records import Evaluated, Started, Stopped
from zosoma.runs.trainer import Trainer, from_checkpoint, new_state, train


def fingerprint(corpus: Corpus) -> str:
    h = hashlib.sha256()
    for name, doc in zip(corpus.names, corpus.docs):
        h.update(name.encode() + b"\0" + len(doc).to_bytes(8, "little"))
        h.update(doc.tobytes())
    return h.hexdigest()


def data_record(train_corpus: Corpus, train_paths=None, heldout_paths=None, wikitext=None) -> dict:
    """What a run folder records of its data: the paths given (none: the shipped corpus) and a
    fingerprint of the training bytes, which a resume checks."""
    return {"train": [str(Path(p).resolve()) for p in train_paths or []],
            "heldout": [str(Path(p).resolve()) for p in heldout_paths or []],
            "wikitext": str(wikitext) if wikitext else None, "fingerprint": fingerprint(train_corpus)}


def load_data(train_paths: list[str] | None, heldout_paths: list[str] | None):
    """Training corpus and held-out corpus (None when there is none). Without --data the shipped
    corpus's train and heldout splits; with --data the user's files and their --heldout, if any."""
    train_corpus = load_corpus(train_paths or None, split="train")
    if heldout_paths:
        heldout = load_corpus(heldout_paths, split="heldout")
    elif not train_paths:
        heldout = load_corpus(None, split="heldout")
    else:
        heldout = None
    return train_corpus, heldout


def start_run(run_dir, model: ModelConfig, cfg: TrainConfig, train_paths=None, heldout_paths=None,
              wikitext=None, should_stop: Callable[[], bool] = lambda: False, ops: Ops | None = None) -> Iterator:
    """A new run in run_dir (which must not hold one). Yields Started, the training records, then
    Evaluated."""
    folder = RunFolder(run_dir)
    if folder.holds_run:
        raise ConfigError(f"{run_dir} already holds a run: use --resume {run_dir} or another --run-dir")
    train_corpus, heldout = load_data(train_paths, heldout_paths)
    sampler = BatchSampler(train_corpus, cfg.seq_len + 1)
    data = data_record(train_corpus, train_paths, heldout_paths, wikitext)
    trainer = Trainer(folder, model, cfg, sampler, new_state(model, cfg), extra={"data": data}, ops=ops)
    trainer.checkpoint()  # step 0: a run killed before its first checkpoint can still resume
    yield Started(str(run_dir), model, cfg, describe(train_corpus), device=trainer.ops.name)
    yield from _train_and_evaluate(trainer, heldout, wikitext, should_stop)


def resume_run(run_dir, should_stop: Callable[[], bool] = lambda: False, ops: Ops | None = None) -> Iterator:
    """Continue the run in run_dir from its checkpoint, with the configuration and data it has."""
    folder = RunFolder(run_dir)
    ckpt = folder.read_checkpoint()
    data = ckpt.extra.get("data", {})
    train_corpus, heldout = load_data(data.get("train") or None, data.get("heldout") or None)
    if fingerprint(train_corpus) != data.get("fingerprint"):
        raise DataError(f"the training data of {run_dir} changed since the run started; cannot resume exactly")
    sampler = BatchSampler(train_corpus, ckpt.train.seq_len + 1)
    trainer = Trainer(folder, ckpt.model, ckpt.train, sampler, from_checkpoint(ckpt), extra={"data": data}, ops=ops)
    yield Started(str(run_dir), ckpt.model, ckpt.train, describe(train_corpus), steps=(ckpt.step,),
                  device=trainer.ops.name)
    yield from _train_and_evaluate(trainer, heldout, data.get("wikitext"), should_stop)


def _train_and_evaluate(trainer: Trainer, heldout, wikitext, should_stop):
    for record in train(trainer, should_stop):
        yield record
        if isinstance(record, Stopped):
            return
    state, model = trainer.state, trainer.model
    results = evaluate_run(trainer.theta, trainer.layout, heldout, wikitext, ops=trainer.ops)
    results.update(step=state.step, tokens=state.tokens, flops=state.tokens * model.flops_per_token(),
                   wall_s=state.wall_s, n_params=model.n_params())
    trainer.folder.write_results(results)
    yield Evaluated(results)


def evaluate_run(theta, layout: Layout, heldout: Corpus | None, wikitext=None, streams: int = 16,
                 ops: Ops | None = None) -> dict:
    """{"heldout": {domain: nats/byte, ..., "overall": ...}, "wikitext103": nats/byte or None}."""
    ops = ops or get_ops("cpu")
    out: dict = {"heldout": None, "wikitext103": None}
    if heldout is not None:
        out["heldout"] = {k: r.nats_per_byte for k, r in evaluate_corpus(theta, layout, heldout, ops,
                                                                               streams=streams).items()}
    wiki = find_wikitext103(wikitext)
    if wiki is not None:
        out["wikitext103"] = evaluate_bytes(theta, layout, load_text(wiki), ops, streams=streams).nats_per_byte
        out["wikitext103_path"] = str(wiki)
    return out
