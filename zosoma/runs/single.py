"""A training run end to end: its folder, its data, training, and the final evaluation.

This is what `zosoma train` drives; everything is a generator of records so the CLI only renders.
The data a run trains on is recorded in its checkpoint (paths and a sha256 of the bytes), so
`resume` reloads the same data and refuses data that changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, describe, load_corpus, load_text
from zosoma.download import check_wikitext103, find_wikitext103
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError, DataError, OptionError
from zosoma.formats.checkpoint import Checkpoint, load_checkpoint
from zosoma.model.evaluate import evaluate_bytes, evaluate_corpus
from zosoma.model.params import Layout
from zosoma.model.protocol import PROTOCOL
from zosoma.training.events import EventLog
from zosoma.training.folder import RunFolder, noting_fallbacks, warn_if_training
from zosoma.workers.placement import Placement
from zosoma.workers.population_workers import Sharding, make_trainer
from zosoma.training.records import Diverged, Dropped, Evaluated, Evaluating, Note, Started, Stopped
from zosoma.training.trainer import Trainer, from_checkpoint, new_state, train
from zosoma.strategies.base import learning_rate
from zosoma.mixture.routing import Ensemble, Whole, evaluate_routed, evaluate_routed_corpus
from zosoma.yardsticks import lookup


def fingerprint(corpus: Corpus) -> str:
    h = hashlib.sha256()
    for name, doc in zip(corpus.names, corpus.docs):
        h.update(name.encode() + b"\0" + len(doc).to_bytes(8, "little"))
        h.update(doc.tobytes())
    return h.hexdigest()


def data_record(train_corpus: Corpus, train_paths=None, heldout_paths=None, wikitext=None) -> dict:
    """What a run folder records of its data: the paths given (none: the shipped corpus), absolute
    so a resume from another folder finds them, and a fingerprint of the training bytes, which a
    resume checks."""
    return {"train": [str(Path(p).resolve()) for p in train_paths or []],
            "heldout": [str(Path(p).resolve()) for p in heldout_paths or []],
            "wikitext": str(Path(wikitext).resolve()) if wikitext else None, "fingerprint": fingerprint(train_corpus)}


def extended(cfg: TrainConfig, step: int, steps: int | None, where) -> tuple[TrainConfig, list[Note]]:
    """cfg run to `steps` in all instead (a resume that extends a run), and the note saying so;
    cfg itself when steps is None. Only a longer run: the steps already taken stay as they were,
    and a cosine schedule is laid out again over the new length from here on."""
    if steps is None:
        return cfg, []
    try:
        new = dataclasses.replace(cfg, steps=steps)  # an integer, at most MAX_STEPS (TrainConfig's checks)
    except ConfigError as e:
        raise OptionError(str(e)) from None
    if steps == cfg.steps:
        return cfg, []
    if steps < cfg.steps:
        raise ConfigError(f"--steps {steps} with --resume: {where} runs to {cfg.steps} steps; a resume can "
                          "extend a run, not shorten it")
    lr = learning_rate(step, new.lr, new.steps, new.warmup, new.schedule)
    return new, [Note(f"extending {where} from {cfg.steps} to {steps} steps"
                      + (f": the cosine schedule now ends at step {steps} (lr {lr:.4g} at step {step + 1})"
                         if cfg.schedule == "cosine" else ""))]


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


def recorded_data(data: dict, run_dir) -> tuple[Corpus, Corpus | None]:
    """The training and held-out corpora a run's data record (data_record) names; a DataError when
    the training bytes changed since the run started."""
    train_corpus, heldout = load_data(data.get("train") or None, data.get("heldout") or None)
    if fingerprint(train_corpus) != data.get("fingerprint"):
        raise DataError(f"the training data of {run_dir} changed since the run started; cannot resume exactly")
    return train_corpus, heldout


@dataclass(frozen=True)
class SingleRun:
    """A single model's run folder opened to train on: its newest checkpoint (a damaged newer one
    set aside, with a CheckpointFallback warning), the data it records and the corpora that data
    names, checked unchanged."""
    folder: RunFolder
    ckpt: Checkpoint
    data: dict
    train_corpus: Corpus
    heldout: Corpus | None

    def trainer(self, ops: Ops, cfg: TrainConfig | None = None, sharding: Sharding | None = None) -> Trainer:
        """The run's Trainer from its checkpoint on the engine `ops`, with `cfg` (default: the checkpoint's)."""
        cfg = cfg or self.ckpt.train
        return make_trainer(self.folder, self.ckpt.model, cfg, BatchSampler(self.train_corpus, cfg.seq_len + 1),
                            from_checkpoint(self.ckpt), ops, {"data": self.data}, sharding)


def open_run(run_dir) -> SingleRun:
    """The single-model run in run_dir, opened (SingleRun); where the run is opened for training,
    whoever drives it: `zosoma train --resume` and a study's runs."""
    folder = RunFolder(run_dir)
    ckpt = folder.read_checkpoint(set_aside=True)
    data = dict(ckpt.extra.get("data", {}))
    return SingleRun(folder, ckpt, data, *recorded_data(data, run_dir))


def new_trainer(folder: RunFolder, model: ModelConfig, cfg: TrainConfig, sampler: BatchSampler, data: dict,
                ops: Ops, sharding: Sharding | None = None) -> Trainer:
    """A new single-model run's Trainer at step 0, checkpointed there: a run killed before its
    first checkpoint can still resume. `data`: its data record (data_record)."""
    trainer = make_trainer(folder, model, cfg, sampler, new_state(model, cfg), ops, {"data": data}, sharding)
    trainer.checkpoint()
    return trainer


def start_run(run_dir, model: ModelConfig, cfg: TrainConfig, train_paths=None, heldout_paths=None,
              wikitext=None, should_stop: Callable[[], bool] = lambda: False, *, ops: Ops,
              sharding: Sharding | None = None, placement: Placement | None = None) -> Iterator:
    """A new run in run_dir, which must be new or empty. Every input (data, held-out, WikiText-103)
    is checked before anything is written. Yields Started, the training records, then Evaluated;
    the folder is locked (RunFolder.lock) while it runs. With `sharding` the population is spread
    over workers (zosoma.workers.population_workers); `placement`, where it all runs, is recorded for a
    resume."""
    folder = RunFolder(run_dir)
    folder.require_empty()
    train_corpus, heldout = load_data(train_paths, heldout_paths)
    found = check_wikitext103(wikitext)  # a bad --wikitext fails now, not after training
    sampler = BatchSampler(train_corpus, cfg.seq_len + 1)
    data = data_record(train_corpus, train_paths, heldout_paths, found if wikitext else None)
    with folder.lock():
        folder.require_empty()  # under the lock: another start may have won the race
        trainer = new_trainer(folder, model, cfg, sampler, data, ops, sharding)
        if placement is not None:
            folder.write_placement(placement)
        yield Started(str(run_dir), model, cfg, describe(train_corpus), device=trainer.ops.name)
        yield from no_heldout(train_paths, heldout_paths)
        yield from _train_and_evaluate(trainer, heldout, wikitext, should_stop)


def no_heldout(train_paths, heldout_paths) -> list[Note]:
    """The note that a run on the user's --data has no held-out text to be scored on (the shipped
    slices are another distribution), when it has none."""
    if train_paths and not heldout_paths:
        return [Note("--data without --heldout: there is no held-out evaluation (only WikiText-103, where "
                     "found); give --heldout FILES to score the model on text of your own it did not train on")]
    return []


def resume_run(run_dir, should_stop: Callable[[], bool] = lambda: False, *, ops: Ops,
               sharding: Sharding | None = None, placement: Placement | None = None, steps: int | None = None,
               wikitext=None) -> Iterator:
    """Continue the run in run_dir from its checkpoint, with the configuration and data it has;
    `steps` extends it to that many steps in all, `wikitext` replaces the WikiText-103 file it
    is scored on, and `placement` is recorded as where it now runs."""
    folder = RunFolder(run_dir)
    if folder.soma_run is not None:
        raise ConfigError(f"{run_dir} is an expert of the SOMA run {folder.soma_run}: resume the whole run with "
                          f"--resume {folder.soma_run}")
    with folder.lock(), noting_fallbacks() as fallbacks:
        run = open_run(run_dir)
        yield from fallbacks()
        data, ckpt = run.data, run.ckpt
        if ckpt.train.optimizer == "backprop":  # PyTorch trains it (zosoma.experiments.backprop), not zosoma
            raise ConfigError(f"{run_dir} is a backprop run of a comparison: run the same zosoma compare command "
                              "again to resume it")
        dropped = ckpt.extra.get("dropped")
        if dropped:  # it trains no further, whatever the resume: say so, and what can help
            raise ConfigError(f"{run_dir}: the model was dropped at step {dropped['step']} after "
                              f"{len(ckpt.extra.get('restarts') or ())} restart(s) ({dropped['verdict']}): "
                              f"{after_drop(run_dir)}")
        if wikitext:
            data["wikitext"] = str(check_wikitext103(wikitext))
        else:
            check_wikitext103(data.get("wikitext"))
        cfg, notes = extended(ckpt.train, ckpt.step, steps, run_dir)
        trainer = run.trainer(ops, cfg, sharding)
        yield from fallbacks()  # a damaged metrics.jsonl passed over
        if notes or wikitext:
            trainer.checkpoint()  # the new length and data are the run's from now on
        if placement is not None:
            folder.write_placement(placement)
        yield from notes
        yield Started(str(run_dir), ckpt.model, cfg, describe(run.train_corpus), steps=(ckpt.step,),
                      device=trainer.ops.name, resumed=True)
        yield from _train_and_evaluate(trainer, run.heldout, data.get("wikitext"), should_stop)


def after_drop(run_dir) -> str:
    """What can help a single model that training gave up on (its restarts spent): not a resume,
    which can only find it dropped again, but a new run."""
    return (f"training gave up on it, so resuming cannot help; start a new run with a lower --lr (or --shaping "
            f"clip, or more --max-restarts); zosoma eval {run_dir} scores the model as it was dropped")


def _train_and_evaluate(trainer: Trainer, heldout, wikitext, should_stop):
    for record in train(trainer, should_stop):
        yield record
        if isinstance(record, (Stopped, Diverged, Dropped)):
            return
    if should_stop():  # asked during the last step, which is saved: a resume evaluates
        yield Stopped(trainer.expert, trainer.state.step)
        return
    state, model = trainer.state, trainer.model
    check_trained(trainer.theta, trainer.guard.skipped, state.step, trainer.folder.path)
    yield Evaluating()
    results = evaluate_run(trainer.theta, trainer.layout, heldout, wikitext, ops=trainer.ops)
    results.update(step=state.step, checkpoint_steps=[state.step], tokens=state.tokens,
                   flops=state.tokens * model.flops_per_token(),
                   wall_s=state.wall_s, n_params=model.n_params(), **trainer.summary())
    trainer.folder.write_results(results)
    held = results["heldout"]["overall"] if results["heldout"] else None
    log = EventLog(trainer.folder.path)
    log.evaluation(state.step, held, results["wikitext103"])
    log.close()
    yield Evaluated(results, lookup(heldout, wikitext))


def check_trained(theta, skipped: int, step: int, where) -> None:
    """A ConfigError when training left nothing to evaluate: parameters that are not finite (an
    update overflowed float32) or a run whose every step's loss was non-finite (none updated it);
    a figure of NaN, or of the untouched initialisation, is not a result."""
    if not np.isfinite(theta).all():
        raise ConfigError(f"{where}: the model's parameters are not finite after step {step} (an update "
                          "overflowed float32): it diverged; start again with a lower --lr or --weight-decay")
    if step and skipped >= step:
        raise ConfigError(f"{where}: every one of its {step} steps had a non-finite loss, so none updated the "
                          "model: start again with a smaller --eps or --lr")


def load_model(path, fallback: bool = False) -> Ensemble:
    """A single model, from a checkpoint file or its run folder's newest checkpoint, as an ensemble
    of one (what sampling and routed scoring take); a run still training is said (StillTraining)."""
    path = Path(path)
    ckpt = RunFolder(path).read_checkpoint(fallback=fallback) if path.is_dir() else load_checkpoint(path)
    warn_if_training(path, [ckpt.step])
    return Ensemble(((ckpt.theta, Layout(ckpt.model)),), Whole())


def evaluate_run(theta, layout: Layout, heldout: Corpus | None, wikitext, ops: Ops,
                 segment: int = PROTOCOL.segment, context: int = PROTOCOL.context, streams: int | None = None) -> dict:
    """{"heldout": {domain: nats/byte, ..., "overall": ...}, "wikitext103": nats/byte or None}.

    By the one protocol every table uses (zosoma.mixture.routing: segments of `segment` bytes after
    `context` bytes of warm-up; the model as a one-expert ensemble, so SOMA runs and single
    models compare like for like); with `streams`, instead, the model runs statefully over each
    whole file in that many side-by-side parts (zosoma.model.evaluate)."""
    out: dict = {"heldout": None, "wikitext103": None,
                 "protocol": (f"each file streamed statefully in {streams} parts" if streams else
                              f"segments of {segment} bytes after {context} bytes of context")}
    if streams:
        score_corpus = lambda corpus: evaluate_corpus(theta, layout, corpus, ops, streams=streams)  # noqa: E731
        score_bytes = lambda data: evaluate_bytes(theta, layout, data, ops, streams=streams)  # noqa: E731
    else:
        one = Ensemble(((theta, layout),), Whole())
        score_corpus = lambda corpus: {k: r["routed"] for k, r in evaluate_routed_corpus(  # noqa: E731
            one, corpus, ops, segment=segment, context=context).items()}
        score_bytes = lambda data: evaluate_routed(one, data, segment, context, ops=ops)["routed"]  # noqa: E731
    if heldout is not None:
        out["heldout"] = {k: r.nats_per_byte for k, r in score_corpus(heldout).items()}
    wiki = find_wikitext103(wikitext)
    if wiki is not None:
        out["wikitext103"] = score_bytes(load_text(wiki)).nats_per_byte
        out["wikitext103_path"] = str(wiki)
    return out
