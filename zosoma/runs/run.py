"""A run, through one class: `Run.start(spec, data, placement)` makes a new run folder and trains
it, `Run.open(path)` opens one, `Run.create(spec, run_dir)` opens one to train here a step target
at a time (a study's runs: advance), and a single model and a SOMA run answer the same calls
(resume, ensemble, evaluate, describe). Whether a run is one model or N experts is decided here,
once; so is its engine (engine: the one place a run turns its placement and configuration into
an engine, which everything below takes as given).

Every rule about what a run may be lives here too (Spec, check_resume, check_run): the command
line, zosoma.api, the comparison and the studies refuse the same inputs with the same one-line
messages (OptionError, a ConfigError the command line answers with exit code 2).

    spec = Spec.resolve("tiny", {"steps": 300}, experts=2)
    for record in Run.start(spec, DataPaths(), Placement()):   # zosoma.training.records
        ...
    Run.open(path).evaluate(corpus)
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from zosoma.config import LOSSES, PRESETS, ModelConfig, TrainConfig, _typed
from zosoma.corpus import BatchSampler, Corpus
from zosoma.engines import get_ops
from zosoma.errors import ConfigError, OptionError
from zosoma.formats.checkpoint import description, load_checkpoint, summary
from zosoma.model.params import Layout
from zosoma.model.protocol import PROTOCOL, EvalProtocol
from zosoma.training.folder import (CheckpointFallback, RunFolder, checkpoint_path, last_metrics, new_run_dir,
                                    warn_if_training)
from zosoma.training.shape import DataPaths, SomaShape
from zosoma.strategies.settings import resolve
from zosoma.training.trainer import train
from zosoma.strategies import make_strategy
from zosoma.runs.single import (data_record, evaluate_run, load_data, load_model, new_trainer, open_run,
                                    resume_run, start_run)
from zosoma.runs.soma import (DroppedExperts, create_soma, evaluate_soma, load_ensemble, lockstep_trainers,
                                  open_soma, resume_soma, soma_description, soma_summary, start_soma, train_lockstep)
from zosoma.workers.placement import Placement, place
from zosoma.workers.population_workers import check_shardable

SOMA_OPTIONS = ("loss", "top_k", "chunk_size")  # what shapes a SOMA run: refused with one expert
RESUME_TAKES = ("steps", "wikitext")  # what a resume takes besides where it runs


def _soma_only(name: str) -> OptionError:
    return OptionError(f"--{name.replace('_', '-')} is an option of SOMA (--experts 2 or more)")


@dataclass(frozen=True)
class Spec:
    """What a run is: its model and training configuration, and for N > 1 experts (SOMA) how the
    experts train (their own losses or the summed ablation), the chunks clustering cuts the corpus
    into and the router's top-k. `preset` names the folder a run starts in."""
    model: ModelConfig
    train: TrainConfig  # the run's seed included
    experts: int = 1
    loss: str = "independent"
    chunk_size: int = 2048  # SOMA's chunks for clustering
    top_k: int = PROTOCOL.top_k  # SOMA's router
    preset: str | None = None

    def __post_init__(self):
        _typed(self)  # experts, chunk_size and top_k integers, loss a string
        for name in ("experts", "chunk_size", "top_k"):
            if getattr(self, name) < 1:
                raise OptionError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.loss not in LOSSES:
            raise OptionError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.is_soma and self.top_k > self.experts:
            raise OptionError(f"top-k {self.top_k} exceeds the {self.experts} experts")

    @classmethod
    def resolve(cls, preset: str = "tiny", options: dict = {}, experts: int = 1, loss: str | None = None,
                top_k: int | None = None, chunk_size: int | None = None) -> "Spec":
        """The spec of a new run from what a user gave (zosoma.strategies.settings.resolve for
        the model and training options); loss, top_k and chunk_size are None when not given, and
        given with one expert are refused, as options that would be silently ignored."""
        if not isinstance(preset, str) or preset not in PRESETS:
            raise OptionError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        soma = {k: v for k, v in zip(SOMA_OPTIONS, (loss, top_k, chunk_size)) if v is not None}
        if experts == 1 and soma:
            raise _soma_only(next(iter(soma)))
        model, cfg = resolve(preset, options, loss=soma.get("loss", "independent"))
        return cls(model, cfg, experts, preset=preset, **soma)

    @property
    def is_soma(self) -> bool:
        return self.experts > 1

    def record(self) -> dict:
        """What the folder of a run of this spec records, by the keys a study compares
        (zosoma.experiments.study.check_job)."""
        return {"experts": self.experts, "loss": self.loss, "model": dataclasses.asdict(self.model),
                "train": dataclasses.asdict(self.train), "chunk_size": self.chunk_size}

    def folder_prefix(self) -> str:
        """runs/<prefix><time>: tiny-..., tiny-soma2-..."""
        return f"{self.preset or 'run'}-{'soma%d-' % self.experts if self.is_soma else ''}"


def check_resume(given: Iterable[str]) -> None:
    """Refuse options given with a resume (by name) other than RESUME_TAKES and the placement's:
    a resumed run's configuration comes from its checkpoints."""
    clashing = [n for n in given if n not in RESUME_TAKES]
    if clashing:
        raise OptionError("--resume takes its configuration from the checkpoint; drop "
                          + ", ".join("--" + n.replace("_", "-") for n in clashing)
                          + " (--steps extends the run, --wikitext replaces its WikiText-103 file)")


def engine(placement: Placement = Placement(), cfg: TrainConfig | None = None):
    """The engine of a run of `cfg` placed by `placement`: the one place a run resolves it, to hand
    it down (only a process boundary rebuilds one, from the record it was sent:
    zosoma.engines.SendsEngine). Its device's engine (placement.device, placement.gemm), unless cfg
    names another engine or a forward precision, which run on the CPU; without cfg, the device's
    own fp32 engine, which a run is scored on."""
    ops = get_ops(placement.device, gemm=placement.gemm)
    if cfg is None or (cfg.engine, cfg.forward_precision) == ("native", "fp32"):
        return ops
    if ops.on_device:
        raise ConfigError(f"--engine {cfg.engine} --forward-precision {cfg.forward_precision} runs on the CPU, "
                          f"not on {ops.name}")
    return get_ops("cpu", cfg.engine, cfg.forward_precision)


def newest_config(folder: RunFolder) -> TrainConfig | None:
    """The training configuration of `folder`'s newest checkpoint, read before a resume opens the
    run so that its engine is resolved first (a damaged newest file is said when the run opens);
    None where the folder holds no checkpoint, which the resume then refuses in its own words."""
    if not folder.has_checkpoint:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointFallback)
        return folder.read_checkpoint().train


def check_run(spec: Spec, placement: Placement = Placement()):
    """Refuse a run of `spec` placed by `placement` that cannot train, before any folder is made
    (Run.start, Run.create: `zosoma train`, zosoma.train and every study's runs): workers for a
    single model, an engine or forward precision not installed or not for the device, a
    population that cannot be sharded, a strategy that cannot train the model (where the work
    cannot go is refused by place, which Run.start calls next). Returns the run's engine."""
    cfg = spec.train
    if not spec.is_soma and placement.workers is not None:
        raise _soma_only("workers")
    ops = engine(placement, cfg)  # an engine not installed or not for the device: one line, now
    if placement.population_workers:
        check_shardable(cfg, placement.population_workers)  # W > P, or a strategy that cannot be split
    make_strategy(cfg).check(Layout(spec.model))  # e.g. an EGGROLL rank above the matrices' sides
    return ops


class Training:
    """A run's records as it trains (zosoma.training.records), in the run folder `path`, on the
    engine `engine`; a folder that Run.start named and made is taken back when the run fails
    before writing in it."""

    def __init__(self, path: Path, records: Iterator, engine, made: Path | None = None):
        self.path, self._records, self.engine, self._made = Path(path), records, engine, made

    def __iter__(self) -> Iterator:
        try:
            yield from self._records
        except BaseException:
            if self._made is not None:
                RunFolder(self._made).remove_if_empty()  # nothing written in it: the folder goes too
            raise


class Run:
    """A run folder: a single model (SingleModel) or a SOMA run (Soma), one interface."""

    is_soma = False

    def __init__(self, path, ops=None):
        self.path, self.folder = Path(path), RunFolder(path)
        self.ops = ops  # the engine it trains on (Run.create), else None: opened to read or resume
        self.trainers, self.heldout, self.lockstep = [], None, False  # what Run.create opens to train

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    @staticmethod
    def open(path) -> "Run":
        """The run in `path` (a run folder, or a single model's checkpoint file)."""
        return Soma(path) if RunFolder(path).is_soma else SingleModel(path)

    @staticmethod
    def start(spec: Spec, data: DataPaths = DataPaths(), placement: Placement = Placement(), run_dir=None,
              should_stop: Callable[[], bool] = lambda: False) -> Training:
        """A new run of `spec` on `data`, placed by `placement`, in run_dir (new or empty; default
        runs/<preset>-<time>, made here and taken back if the run fails before writing in it). Every
        option is checked before any folder is made (check_run); training happens as the records are read."""
        ops = check_run(spec, placement)
        placement = placement.on(ops)
        executor, summed, sharding = place(placement, spec.experts, spec.loss, ops.on_device)
        made = None if run_dir else new_run_dir(spec.folder_prefix())
        run_dir = Path(run_dir or made)
        paths = dict(train_paths=list(data.train) or None, heldout_paths=list(data.heldout) or None,
                     wikitext=data.wikitext)
        if spec.is_soma:
            records = start_soma(run_dir, spec.model, spec.train, spec.experts, spec.loss, executor,
                                 spec.chunk_size, top_k=spec.top_k, should_stop=should_stop, ops=ops,
                                 workers=summed, placement=placement, **paths)
        else:
            records = start_run(run_dir, spec.model, spec.train, should_stop=should_stop, ops=ops,
                                sharding=sharding, placement=placement, **paths)
        return Training(run_dir, records, ops, made)

    @staticmethod
    def create(spec: Spec, run_dir, placement: Placement = Placement(executor="inline")) -> "Run":
        """The run of `spec` in run_dir (on the shipped corpus, its forwards where `placement` puts
        them) opened to train in this process a step target at a time (advance), as a study trains
        its runs: resumed from its checkpoints, or made at step 0 as Run.start leaves a new run
        before its first step (a SOMA run whose creation was cut short is made again: the same
        files). Checked as Run.start checks (check_run), which resolves its engine."""
        ops = check_run(spec, placement)
        folder = RunFolder(run_dir)
        if spec.is_soma:
            if not folder.is_soma:
                create_soma(folder.path, spec.model, spec.train, spec.experts, spec.loss, spec.chunk_size,
                            top_k=spec.top_k, new_folder=False)
            run, opened = Soma(run_dir, ops), open_soma(folder.path)
            if spec.loss == "summed":
                run.trainers = lockstep_trainers(opened, ops)
            else:
                run.trainers = [opened.trainer(i, ops) for i in range(spec.experts)]
            run.heldout = opened.heldout
        elif folder.has_checkpoint:
            run, opened = SingleModel(run_dir, ops), open_run(folder.path)
            run.trainers, run.heldout = [opened.trainer(ops)], opened.heldout
        else:
            run = SingleModel(run_dir, ops)
            train_corpus, run.heldout = load_data(None, None)
            sampler = BatchSampler(train_corpus, spec.train.seq_len + 1)
            run.trainers = [new_trainer(folder, spec.model, spec.train, sampler, data_record(train_corpus), ops)]
        run.lockstep = spec.loss == "summed"
        return run

    # --- a run created to train in this process (Run.create) ---------------------------------

    @property
    def step(self) -> int:
        """How far training got: the step of the least advanced model still training, or once
        every model has stopped (finished, its compute spent by restarts, dropped), the furthest."""
        training = [t.state.step for t in self.trainers if not t.done]
        return min(training) if training else max(t.state.step for t in self.trainers)

    def advance(self, target: int, stopping: Callable[[], bool]) -> bool:
        """Train every model to step `target` (checkpointed there); False when asked to stop
        (every model is checkpointed where it was). A run the divergence guard stopped trains no
        further."""
        if self.diverged:
            return not stopping()
        if self.lockstep:
            _drain(train_lockstep(self.trainers, lambda: self.trainers[0].state.step >= target or stopping()))
        else:
            for t in self.trainers:
                _drain(train(t, lambda t=t: t.state.step >= target or stopping() or self.diverged))
        return not stopping()

    @property
    def diverged(self) -> bool:
        return any(t.state.divergence is not None and t.cfg.on_divergence == "stop" for t in self.trainers)

    @property
    def checkpoint_steps(self) -> list[int]:
        """The step of each model's checkpoint."""
        return [t.state.step for t in self.trainers]

    # --- what every run answers ---------------------------------------------------------------

    def resume(self, steps: int | None = None, wikitext=None, placement: Placement | None = None,
               should_stop: Callable[[], bool] = lambda: False) -> Training:
        """Train on where the run stopped, with the configuration and data its checkpoints hold;
        `steps` extends it, `wikitext` replaces the WikiText-103 file it is scored on, `placement`
        (default: where it last ran) is recorded as where it runs now."""
        raise NotImplementedError

    def ensemble(self, top_k: int = PROTOCOL.top_k, temperature: float = 0.1, fallback: bool = False):
        """The run's model as a routed ensemble (zosoma.mixture.routing.Ensemble; one expert for a
        single model); with `fallback` an older intact checkpoint stands in for a damaged newest."""
        raise NotImplementedError

    def evaluate(self, corpus: Corpus | None, wikitext=None, protocol: EvalProtocol = PROTOCOL, ops=None,
                 temperature: float = 0.1, fallback: bool = False, streams: int | None = None) -> dict:
        """Nats/byte on `corpus` and WikiText-103 by `protocol` (zosoma.runs.single.evaluate_run,
        zosoma.runs.soma.evaluate_soma), with what the figures are of: kind, n_params, and the step
        (a single model) or the experts routing left out (SOMA)."""
        raise NotImplementedError

    def describe(self, fallback: bool = False) -> dict:
        """What `zosoma info --json` says of the run, "kind" first."""
        raise NotImplementedError

    def steps(self, description: dict) -> list[int]:
        """The step of each model's newest checkpoint, from describe()'s dict."""
        raise NotImplementedError

    def summary(self, description: dict) -> str:
        """describe()'s dict as the few lines of `zosoma info`."""
        raise NotImplementedError


def scoring(ops):
    """The engine a run is scored on: the one given, or the CPU's (resolved here, at the door)."""
    return engine() if ops is None else ops


def _drain(records: Iterator) -> None:
    for _ in records:
        pass


class SingleModel(Run):
    """One model's run folder, or its checkpoint file."""

    def resume(self, steps=None, wikitext=None, placement=None, should_stop=lambda: False) -> Training:

        placement = placement or self.folder.read_placement(Placement)
        _, _, sharding = place(placement, 1)
        ops = engine(placement, newest_config(self.folder))  # the engine its configuration names
        placement = placement.on(ops)
        return Training(self.path, resume_run(self.path, should_stop, ops=ops, sharding=sharding,
                                              placement=placement, steps=steps, wikitext=wikitext), ops)

    def ensemble(self, top_k=PROTOCOL.top_k, temperature=0.1, fallback=False):
        return load_model(self.path, fallback=fallback)

    def evaluate(self, corpus, wikitext=None, protocol=PROTOCOL, ops=None, temperature=0.1, fallback=False,
                 streams=None) -> dict:

        ckpt = self.folder.read_checkpoint(fallback=fallback) if self.path.is_dir() else load_checkpoint(self.path)
        warn_if_training(self.path, [ckpt.step])
        dropped = ckpt.extra.get("dropped")
        if dropped:
            warnings.warn(f"{self.path} was dropped at step {dropped['step']} after "
                          f"{len(ckpt.extra.get('restarts') or ())} restart(s) ({dropped['verdict']}): training gave "
                          "up on it, and it is scored as it was left", DroppedExperts, stacklevel=2)
        r = evaluate_run(ckpt.theta, Layout(ckpt.model), corpus, wikitext, scoring(ops), segment=protocol.segment,
                         context=protocol.context, streams=streams)
        return {"kind": "single", "step": ckpt.step, "n_params": ckpt.model.n_params(), **r}

    def describe(self, fallback=False) -> dict:

        path = checkpoint_path(self.path, fallback=fallback)
        return {"kind": "checkpoint", **description(path, last_metrics(path))}

    def steps(self, description: dict) -> list[int]:
        return [description["step"]]

    def summary(self, description: dict) -> str:

        path = description["checkpoint"]  # the file describe() read
        return summary(path, last_metrics(path))


class Soma(Run):
    """A SOMA run folder: N experts, the router and soma.json (SomaShape)."""

    is_soma = True

    @property
    def shape(self) -> SomaShape:
        return self.folder.read_soma()

    def resume(self, steps=None, wikitext=None, placement=None, should_stop=lambda: False) -> Training:

        placement = placement or self.folder.read_placement(Placement)
        shape = self.shape
        ops = engine(placement, newest_config(self.folder.expert(0)))  # the experts' configuration's engine
        placement = placement.on(ops)
        executor, summed, _ = place(placement, shape.experts, shape.loss, ops.on_device)
        return Training(self.path, resume_soma(self.path, executor, should_stop, ops=ops,
                                               workers=summed, placement=placement, steps=steps, wikitext=wikitext), ops)

    def ensemble(self, top_k=PROTOCOL.top_k, temperature=0.1, fallback=False):
        self.folder.read_soma()  # a damaged soma.json is refused here, not routed around
        return load_ensemble(self.path, top_k, temperature, fallback=fallback)

    def evaluate(self, corpus, wikitext=None, protocol=PROTOCOL, ops=None, temperature=0.1, fallback=False,
                 streams=None) -> dict:

        if streams is not None:
            raise OptionError(f"--streams is an option of single models; {self.path} is a SOMA run")
        ensemble = self.ensemble(protocol.top_k, temperature, fallback)
        r = evaluate_soma(ensemble, corpus, wikitext, scoring(ops), segment=protocol.segment, context=protocol.context)
        return {"kind": "soma", "n_params": ensemble.n_params, "dropped": list(ensemble.router.dropped), **r}

    def describe(self, fallback=False) -> dict:

        return {"kind": "soma", **soma_description(self.path, fallback=fallback)}

    def steps(self, description: dict) -> list[int]:
        return [e["step"] for e in description["experts_status"]]

    def summary(self, description: dict) -> str:
        return soma_summary(description)
