"""One runner for every study (the comparison and its N-curve, the precision study): a list of
jobs, each one run trained in a folder of its own and scored once.

A study supplies its jobs and their scoring; a job (the Job protocol) says

    name          its run folder, OUT/runs/<name>/
    label, kind   how messages name it and its study ("SPSA P=64, seed 1"; "comparison")
    record_shape  what its record must hold to be read back (zosoma.training.json_shape):
                  the keys its study's report reads
    spec          what its run is (Spec: model, training configuration, experts, loss, ...)
    device        where its forwards run
    expected()    the configuration its folder must hold: spec.record() and the study's own keys
    score(run, stopping)   train the opened JobRun (run.advance) and score it: its record, or None
                  when stopping() turned true first

and the runner does the rest, the same for every study:

    OUT/settings.json        the study's settings (RunFolder.bind): a folder that other settings,
                             or another kind of study, left is refused in one line naming what changed
    OUT/runs/<name>/         a single-model or SOMA run folder (zosoma.runs.single, zosoma.runs.soma)
                             plus result.json, the finished job's record: read back, never repeated
                             while it is of the run's newest checkpoints (its checkpoint_steps);
                             a folder that holds another configuration (its record, else its
                             checkpoints) is refused before anything trains (check_job)

Each job is an idempotent unit of work (Unit, naming its folder as unit.run_dir) for an executor
(zosoma.workers.executor: inline, local processes, Ray): it takes its folder's lock, resumes from the
run's checkpoints, and writes atomically, so a killed study resumes every unfinished run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np

from zosoma.config import ABSENT, RETIRED, ModelConfig, TrainConfig
from zosoma.errors import ConfigError
from zosoma.experiments.scoring import Scored
from zosoma.training.folder import CheckpointFallback, RunFolder, changes, noting_fallbacks
from zosoma.workers.placement import Placement
from zosoma.training.records import Failed, Note, Result
# Spec: what a job's run is (compare and precision take it here)
from zosoma.runs.run import Run, Spec, check_run, engine
from zosoma.workers.executor import Inline
from zosoma.mixture.cluster import load_clustering
from zosoma.mixture.routing import Ensemble, Router, Whole


class Job(Protocol):
    name: str
    spec: Spec
    device: str
    record_shape: dict

    @property
    def label(self) -> str: ...

    @property
    def kind(self) -> str: ...

    def expected(self) -> dict: ...

    def score(self, run: "JobRun", stopping: Callable[[], bool]) -> dict | None: ...


# ------------------------------------------------------------------ a folder bound to its job

def _from_result(result: dict, keys) -> dict:
    """What a finished job's record says it was, by the keys given that it holds (a model or
    training field an older zosoma did not write takes what it meant then, as in a checkpoint:
    zosoma.config.ABSENT, else today's default)."""
    def config(cls, fields):
        retired = RETIRED.get(cls.__name__, ())
        return {**dataclasses.asdict(cls(**ABSENT.get(cls.__name__, {}))),
                **{k: v for k, v in fields.items() if k not in retired}}
    classes = {"model": ModelConfig, "train": TrainConfig}
    return {k: config(classes[k], result[k]) if k in classes else result[k] for k in keys if k in result}


def _check(job: Job, folder: RunFolder, found: dict) -> None:
    """Refuse a run folder whose recorded configuration (the fields in `found`) is not the job's."""
    expected = job.expected()
    diffs = changes(found, {k: expected[k] for k in found})
    if diffs:
        raise ConfigError(f"{folder} ({job.label}) was made with another configuration ({'; '.join(diffs)}): give "
                          f"this {job.kind} another --out")


def finished(job: Job, folder: RunFolder) -> dict | None:
    """The job's finished record in its folder, refused when it is another configuration's; None
    when there is none."""
    result = folder.read_result(job.record_shape)
    if result is not None:
        _check(job, folder, _from_result(result, job.expected()))
    return result


def check_job(job: Job, folder: RunFolder) -> dict | None:
    """Refuse a job's folder that holds another configuration, reading only: its finished record,
    else its SOMA description and every expert's checkpoint, else its checkpoint. Returns the
    finished record, or None (nothing yet, an unfinished run, or a SOMA run whose creation was cut
    short: it is redone). A zero-order job's run is first checked as `zosoma train` checks it
    (zosoma.runs.run.check_run: the same one-line refusals)."""
    if job.spec.train.optimizer != "backprop":
        check_run(job.spec, placement(job))
    result = finished(job, folder)
    if result is not None:
        return result
    opened = Run.open(folder.path)
    if opened.is_soma:
        soma = opened.shape
        _check(job, folder, {k: getattr(soma, k) for k in ("experts", "loss", "chunk_size")})
        held = [folder.expert(i) for i in range(soma.experts)]
    elif folder.has_checkpoint:
        _check(job, folder, {"experts": 1})
        held = [folder]
    else:
        held = []
    for f in held:
        ckpt = f.read_checkpoint()
        _check(job, folder, {"model": dataclasses.asdict(ckpt.model), "train": dataclasses.asdict(ckpt.train)})
    return None


def run_job(job: Job, run_dir, stopping: Callable[[], bool] = lambda: False) -> dict | None:
    """Train one job's run in run_dir (resumed from its checkpoints) and score it; a finished run
    (result.json) of the same job is read back instead, and one of another configuration refused.
    The record names the checkpoint step of each model it scored (checkpoint_steps): one the run
    has trained past since is stale, and the run is scored again (RunFolder.read_result).
    Returns the job's record, or None when stopping() turned true first (the run is checkpointed
    where it was)."""
    folder = RunFolder(run_dir)
    if folder.read_result() is None:
        with folder.lock(wait=True):  # one writer per run folder (a killed study's worker may linger)
            if folder.read_result() is None:
                check_job(job, folder)
                run = open_job_run(folder, job)
                result = job.score(run, stopping)
                if result is None:
                    return None
                folder.write_result({**result, "checkpoint_steps": run.checkpoint_steps})
                return folder.read_result()  # as a rerun reads it back (JSON: tuples are lists)
    return check_job(job, folder)


def placement(job: Job) -> Placement:
    """Where a job's run trains: in the process that holds the job (a job crosses to a worker with
    its device's name: a process boundary), its forwards on job.device."""
    return Placement(executor="inline", device=job.device)


def open_job_run(folder: RunFolder, job: Job):
    """The job's JobRun; a backprop method's BackpropRun (zosoma.experiments.backprop: PyTorch)."""
    if job.spec.train.optimizer == "backprop":
        from zosoma.experiments.backprop import BackpropRun
        return BackpropRun(folder, job.spec, job.device)
    return JobRun(folder, job.spec, placement(job))


@dataclass(frozen=True)
class Unit:
    """One job as an idempotent unit of work (zosoma.workers.executor) in its folder run_dir."""
    job: Job
    run_dir: str

    def __call__(self, stopping: Callable[[], bool]) -> Iterator:
        with noting_fallbacks() as fallbacks:
            result = run_job(self.job, self.run_dir, stopping)
        yield from fallbacks()
        if result is not None:
            yield Result(self.job.name, result)


# ---------------------------------------------------------------------------------- the study

class StudyFolder:
    """A study's output folder: OUT/settings.json, the study's settings (its `kind` and what its
    results depend on besides each run's configuration), and OUT/runs/<job name>/."""

    def __init__(self, out, kind: str, settings: dict):
        self.out, self.kind, self.settings = Path(out), kind, settings

    def run_dir(self, job: Job) -> Path:
        return self.out / "runs" / job.name

    def check(self, jobs: list[Job]) -> dict[str, dict]:
        """Refuse (ConfigError, one line naming what changed) a folder that other settings, or
        another configuration of any of these jobs' runs, left; writes nothing. Returns the
        finished jobs' records by job name."""
        RunFolder(self.out).bind(self.kind, self.settings, write=False)
        done = {job.name: check_job(job, RunFolder(self.run_dir(job))) for job in jobs}
        return {name: result for name, result in done.items() if result is not None}

    @contextlib.contextmanager
    def open(self, jobs: list[Job]):
        """Own the folder for the block (one study at a time in it), with every job's folder
        checked and the settings recorded before anything trains."""
        with RunFolder(self.out).lock():
            self.check(jobs)
            RunFolder(self.out).bind(self.kind, self.settings)
            yield self

    def run(self, jobs: list[Job], executor=None, should_stop: Callable[[], bool] = lambda: False,
            on_result: Callable[[Job, dict | None, str | None], None] = lambda j, r, e: None
            ) -> tuple[dict[str, dict], list[str]]:
        """Run every job through `executor` (zosoma.workers.executor; default inline): the finished
        ones are read back. on_result(job, result, error) is called as each job ends. Returns the
        records by job name and one line per failed job (the others still run to the end)."""
        results, errors = {}, []
        units = [Unit(job, str(self.run_dir(job))) for job in jobs]
        for record in (executor or Inline()).run(units, should_stop):
            if isinstance(record, Note):
                warnings.warn(record.message, CheckpointFallback, stacklevel=2)
            elif isinstance(record, Result):
                results[record.unit] = record.value
                on_result(next(j for j in jobs if j.name == record.unit), record.value, None)
            elif isinstance(record, Failed):
                errors.append(f"{units[record.unit].run_dir}: {record.error}")
                on_result(jobs[record.unit], None, errors[-1])
        return results, errors

    def finished(self, jobs: list[Job]) -> dict[str, dict | None]:
        """Each job's record, checked against the job, or None where it has not finished (its
        folder is not read further); trains nothing, for a report of a study under way."""
        return {job.name: finished(job, RunFolder(self.run_dir(job))) for job in jobs}


# ------------------------------------------------------------------------------------ the run

class JobRun(Scored):
    """A job's Run (zosoma.runs.run.Run.create: one model, or one per SOMA expert, opened from
    its checkpoints or created at step 0 from the Spec and trained here a step target at a time)
    and how its study scores it."""

    def __init__(self, folder: RunFolder, spec: Spec, placement: Placement = Placement(executor="inline")):
        self.folder, self.spec, self.cfg = folder, spec, spec.train
        self.run = Run.create(spec, folder.path, placement)  # its trainers on the run's engine (engine)
        self.ops = engine(placement)  # the device's fp32 engine, which it is scored on (Scored)
        self.trainers, self.heldout = self.run.trainers, self.run.heldout
        self.router = Router(load_clustering(folder.router), spec.top_k) if spec.is_soma else Whole()

    @property
    def step(self) -> int:
        return self.run.step

    def advance(self, target: int, stopping: Callable[[], bool]) -> bool:
        """Train every expert to step `target` (Run.advance): False when asked to stop. A run the
        divergence guard stopped is scored where it stopped, and its record says so."""
        return self.run.advance(target, stopping)

    @property
    def diverged(self) -> bool:
        return self.run.diverged

    @property
    def checkpoint_steps(self) -> list[int]:
        """The step of each model's checkpoint (what its record is of: RunFolder.stale)."""
        return self.run.checkpoint_steps

    def training(self) -> dict:
        """Skipped steps summed over experts, the guards' verdicts (a run they stopped), every
        restart and dropped expert (--on-divergence restart), the mean final training loss."""
        s = [t.summary() for t in self.trainers]
        finals = [x["final_train_loss"] for x in s if x["final_train_loss"] is not None]
        verdicts = [dict(x["divergence"], expert=i) for i, x in enumerate(s) if x["divergence"]]
        return {"skipped_steps": sum(x["skipped_steps"] for x in s), "divergence": verdicts or None,
                "restarts": [dict(r, expert=i) for i, x in enumerate(s) for r in x["restarts"]],
                "dropped": [dict(x["dropped"], expert=i) for i, x in enumerate(s) if x["dropped"]],
                "final_train_loss": float(np.mean(finals)) if finals else None}

    def totals(self) -> dict:
        s = [t.state for t in self.trainers]
        tokens = sum(x.tokens for x in s)  # forward tokens
        return {"step": self.step, "tokens": tokens, "flops": float(tokens) * self.spec.model.flops_per_token(),
                "wall_s": sum(x.wall_s for x in s)}

    def ensemble(self, top_k: int | None = None) -> Ensemble:
        """The run's model; a SOMA run's router top-k (default the spec's) over the experts it
        did not drop (fewer when fewer are left), or over all of them as they were left when it
        dropped every one (a lost run, as its record says: scored as a dropped single model is)."""
        router = self.router
        if isinstance(router, Router):
            dropped = [i for i, t in enumerate(self.trainers) if t.state.dropped]
            if len(dropped) == len(self.trainers):
                dropped = []
            k = min(top_k or router.top_k, len(self.trainers) - len(dropped))
            router = Router(router.clustering, k, router.temperature, dropped)
        return Ensemble(tuple((t.state.theta, t.layout) for t in self.trainers), router)

