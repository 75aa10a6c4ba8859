"""A training run end to end: its folder, its data, training, and the final evaluation.

This is what `zosoma train` drives; everything is a generator of records so the CLI only renders.
The data a run trains on is recorded in its checkpoint (paths and a sha256 of the bytes), so
`resume` reloads the same data and refuses data that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from .config import ModelConfig, TrainConfig
from .corpus import BatchSampler, Corpus, load_corpus, load_text
from .download import find_wikitext103
from .errors import ConfigError, DataError
from .evaluate import evaluate_bytes, evaluate_corpus
from .params import Layout
from .train import CHECKPOINT, Trainer, from_checkpoint, new_state, read_checkpoint, train

RESULTS = "results.json"


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


def start_run(run_dir: Path, model: ModelConfig, cfg: TrainConfig, train_paths=None, heldout_paths=None,
              wikitext=None, should_stop: Callable[[], bool] = lambda: False, device: str = "cpu") -> Iterator[dict]:
    """A new run in run_dir (which must not hold one). Yields a "start" record, the training
    records, then the evaluation records."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINT).exists():
        raise ConfigError(f"{run_dir} already holds a run: use --resume {run_dir} or another --run-dir")
    train_corpus, heldout = load_data(train_paths, heldout_paths)
    sampler = BatchSampler(train_corpus, cfg.seq_len + 1)
    data = data_record(train_corpus, train_paths, heldout_paths, wikitext)
    trainer = Trainer(run_dir, model, cfg, sampler, new_state(model, cfg), extra={"data": data}, device=device)
    trainer.checkpoint()  # step 0: a run killed before its first checkpoint can still resume
    yield {"event": "start", "run_dir": str(run_dir), "n_params": model.n_params(), "data": train_corpus,
           "model": model, "train": cfg, "step": 0}
    yield from _train_and_evaluate(trainer, heldout, wikitext, should_stop)


def resume_run(run_dir: Path, should_stop: Callable[[], bool] = lambda: False, device: str = "cpu") -> Iterator[dict]:
    """Continue the run in run_dir from its checkpoint, with the configuration and data it has."""
    run_dir = Path(run_dir)
    ckpt = read_checkpoint(run_dir)
    state = from_checkpoint(ckpt)
    data = ckpt.extra.get("data", {})
    train_corpus, heldout = load_data(data.get("train") or None, data.get("heldout") or None)
    if fingerprint(train_corpus) != data.get("fingerprint"):
        raise DataError(f"the training data of {run_dir} changed since the run started; cannot resume exactly")
    sampler = BatchSampler(train_corpus, ckpt.train.seq_len + 1)
    yield {"event": "start", "run_dir": str(run_dir), "n_params": ckpt.model.n_params(), "data": train_corpus,
           "model": ckpt.model, "train": ckpt.train, "step": state.step}
    trainer = Trainer(run_dir, ckpt.model, ckpt.train, sampler, state, extra={"data": data}, device=device)
    yield from _train_and_evaluate(trainer, heldout, data.get("wikitext"), should_stop)


def _train_and_evaluate(trainer: Trainer, heldout, wikitext, should_stop):
    for record in train(trainer, should_stop):
        yield record
        if record.get("event") == "stopped":
            return
    state, model, run_dir = trainer.state, trainer.model, trainer.run_dir
    results = evaluate_run(state.theta, trainer.layout, heldout, wikitext, device=trainer.device)
    results.update(step=state.step, tokens=state.tokens, flops=state.tokens * model.flops_per_token(),
                   wall_s=state.wall_s, n_params=model.n_params())
    write_json(run_dir / RESULTS, results)
    yield {"event": "evaluated", **results}


def evaluate_run(theta, layout: Layout, heldout: Corpus | None, wikitext=None, streams: int = 16,
                 device: str = "cpu") -> dict:
    """{"heldout": {domain: nats/byte, ..., "overall": ...}, "wikitext103": nats/byte or None}."""
    out: dict = {"heldout": None, "wikitext103": None}
    if heldout is not None:
        out["heldout"] = {k: r.nats_per_byte for k, r in evaluate_corpus(theta, layout, heldout, streams=streams,
                                                                               device=device).items()}
    wiki = find_wikitext103(wikitext)
    if wiki is not None:
        out["wikitext103"] = evaluate_bytes(theta, layout, load_text(wiki), streams=streams,
                                              device=device).nats_per_byte
        out["wikitext103_path"] = str(wiki)
    return out


def write_json(path: Path, obj) -> None:
    """Atomically (temporary file + rename) write obj as JSON."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)
