"""The run folder: the one module that knows the files inside a run.

A single model's run (or one SOMA expert's folder):

    RUN/checkpoint.h5        the newest checkpoint (written as checkpoint.next.h5, then rotated)
    RUN/checkpoint.prev.h5   the one before it
    RUN/checkpoint.prev2.h5  older ones, where a run that restarts on divergence keeps more
                             (TrainConfig.on_divergence "restart": zosoma.training.trainer)
    RUN/metrics.jsonl        one JSON record per training step, cut back to the checkpoint on resume
                             (each checkpoint records its line count and their SHA-256: MetricsLog)
    RUN/results.json         the final evaluation, naming the checkpoint step it was computed from
                             (checkpoint_steps): a run that went on since is seen to (RunFolder.stale)
    RUN/placement.json       where the run trains (zosoma.workers.placement), so a plain resume goes on there
    RUN/scalars.jsonl        a population sharded over workers (zosoma.workers.population_workers): each
                             step's scalars, so a lost worker is rebuilt by replay

A SOMA run:

    RUN/soma.json            what the run is: N, loss mode, chunking, data (written once, last)
    RUN/router.h5            the clustering the router needs
    RUN/expert{i}/           one single-model folder per expert
    RUN/results.json         the routed evaluation (checkpoint_steps: each expert's step)

A study (zosoma.experiments.study: the comparison, the precision study): OUT/runs/<name>/ is a
single or SOMA run folder plus result.json (the finished run's record) and, for a comparison,
curve.jsonl (the held-out curve); OUT/settings.json records the settings the whole folder was
made with (RunFolder.bind), those that change results without being part of any run's
configuration.

Every run folder also holds TensorBoard event files, RUN/events.out.tfevents.<stamp>
(zosoma.training.events). All of these names are the run's: a tool writing its own outputs (an export)
never writes over one of them, --force or not (refuse_run_files).

A run driven on a cluster (zosoma.workers.ray_executor) holds RUN/.token, a random token the driver
writes and every worker reads back, so a worker that does not see the driver's folder says so.

One owner per folder: whoever trains in a folder holds its lock (RUN/.lock, an flock(2) lock that
the kernel releases when the process dies, the file naming the owner's pid and host); a second
writer is refused in one line, and a lock left by a dead process is simply taken over. A command
that reads a run while its owner trains it says so (StillTraining: which checkpoint step it reads).

Every write is atomic (zosoma.atomic): at every instant each file is complete, and at least one
of checkpoint.h5, checkpoint.next.h5, checkpoint.prev.h5 holds a complete checkpoint. A damaged
checkpoint is never used silently: readers say which file they fall back to and why
(CheckpointFallback, a warning the command line prints as one line), or refuse when told not to
fall back; a resume sets the damaged file aside as checkpoint.damaged-<time>.h5 so that rotation
never writes over the good one. A metrics.jsonl that does not hold what the checkpoint recorded is
said in one line too (MetricsDamaged), set aside as metrics.damaged-<time>.jsonl, and begun anew:
training never reads it back, so the run's parameters do not depend on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import re
import warnings
from datetime import datetime, timezone
from pathlib import Path

from zosoma.atomic import append_line, atomic_write, no_interrupts, reason, set_aside
from zosoma.errors import CheckpointError, ConfigError, WriteError
from zosoma.formats.checkpoint import Checkpoint, load_checkpoint, save_checkpoint, stored_step
from zosoma.training import folder_lock
from zosoma.training.folder_lock import in_use
from zosoma.training.guard import rollback_index
from zosoma.training.json_records import changes, plain, read_record, write_json
from zosoma.training import logs
from zosoma.training.logs import MetricsLog, MetricsMark, covered, not_held, records_of
from zosoma.training.notices import CheckpointFallback, MetricsDamaged, StaleResults, StillTraining
from zosoma.training.records import Note
from zosoma.training.shape import SomaShape

CHECKPOINT = "checkpoint.h5"
PREVIOUS = "checkpoint.prev.h5"
NEXT = "checkpoint.next.h5"
OLDER = "checkpoint.prev{n}.h5"  # n = 2, 3, ...: kept where a restart may roll back further
CHECKPOINTS = (CHECKPOINT, NEXT, PREVIOUS)  # newest first, then OLDER by n
METRICS = "metrics.jsonl"
RESULTS = "results.json"
SOMA = "soma.json"
ROUTER = "router.h5"
CURVE = "curve.jsonl"
RESULT = "result.json"
LOCK = ".lock"
SCALARS = "scalars.jsonl"
TOKEN = ".token"
PLACEMENT = "placement.json"
SETTINGS = "settings.json"
DAMAGED = "checkpoint.damaged-{time}.h5"
METRICS_DAMAGED = "metrics.damaged-{time}.jsonl"
EVENTS = "events.out.tfevents.{stamp}"
EXPERT = "expert{i}"
# Every name above, as a glob: the files a run folder (or a study's) holds that are the run's.
RUN_FILES = (CHECKPOINT, PREVIOUS, NEXT, OLDER.format(n="[0-9]*"), METRICS, RESULTS, SOMA, ROUTER, CURVE, RESULT,
             LOCK, SCALARS, TOKEN, PLACEMENT, SETTINGS, DAMAGED.format(time="*"), METRICS_DAMAGED.format(time="*"),
             EVENTS.format(stamp="*"), EXPERT.format(i="[0-9]*"))


@contextlib.contextmanager
def noting_fallbacks():
    """Within the block, warnings are recorded instead of shown (every CheckpointFallback, a
    damaged checkpoint passed over); the function it gives returns those recorded since its last
    call as Note records, for a unit of work to yield: its records reach the command line from
    any worker process, where its warnings would not."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointFallback)
        said = 0

        def notes() -> list[Note]:
            nonlocal said
            new, said = caught[said:], len(caught)
            return [Note(str(w.message)) for w in new]
        yield notes


class RunFolder:
    """One run's folder (a single model, a SOMA expert, or a SOMA run)."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    # --- what the folder holds --------------------------------------------------------------

    @property
    def is_soma(self) -> bool:
        return (self.path / SOMA).exists()

    @property
    def has_checkpoint(self) -> bool:
        return any((self.path / name).is_file() for name in CHECKPOINTS)

    @property
    def holds_run(self) -> bool:
        return self.is_soma or self.has_checkpoint

    def expert(self, i: int) -> "RunFolder":
        return RunFolder(self.path / EXPERT.format(i=i))

    @property
    def soma_run(self) -> "RunFolder | None":
        """The SOMA run this folder is an expert of (RUN for RUN/expert3), or None."""
        parent = RunFolder(self.path.resolve().parent)
        if re.fullmatch(r"expert\d+", self.path.resolve().name) and parent.is_soma:
            return parent
        return None

    @property
    def router(self) -> Path:
        return self.path / ROUTER

    def make(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"{self.path} exists and is not a folder")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteError(f"cannot create run folder {self.path}: {reason(err)}") from None

    def require_empty(self) -> None:
        """A new run starts only in a folder that is new or empty: nothing already there is ever
        replaced (the lock file of a run that never wrote anything does not count)."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"{self.path} exists and is not a folder")
        held = sorted(p.name for p in self.path.iterdir() if p.name != LOCK) if self.path.is_dir() else []
        owner = self.owner() if held else None
        if owner:
            raise in_use(self.path, owner)
        if held and self.holds_run:
            run = self.soma_run or self
            raise ConfigError(f"{self.path} already holds a run: continue it with --resume {run.path}, or choose "
                              "an empty or new folder; nothing in it was changed")
        if held:
            listed = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise ConfigError(f"{self.path} is not empty ({listed}): choose an empty or new folder; nothing in it "
                              "was changed")

    def owner(self) -> str | None:
        """'pid N on HOST' of the live process that holds this folder's lock, or None."""
        return folder_lock.owner(self.path / LOCK)

    def trained_by(self) -> str | None:
        """'pid N on HOST' of the live process training this run (the owner of this folder, or of
        the SOMA run it is an expert of), or None."""
        run = self.soma_run
        return self.owner() or (run.owner() if run else None)

    @contextlib.contextmanager
    def lock(self, wait: bool = False):
        """Own this folder for the block: an exclusive flock on RUN/.lock (released by the kernel
        if this process dies), the file naming this pid and host. Another owner: RunInUse, or with
        `wait`, block until it is gone (a worker of a killed run lives on for up to a second). A
        folder this made and the block left empty (a start that failed) is removed again."""
        created = not self.path.exists()
        self.make()
        with folder_lock.held(self.path / LOCK, self.path, wait, self.remove_if_empty if created else None):
            yield self

    def remove_if_empty(self) -> None:
        """Remove this folder if it holds nothing but its lock file (a run that never started)."""
        with contextlib.suppress(OSError):
            if {p.name for p in self.path.iterdir()} <= {LOCK}:
                (self.path / LOCK).unlink(missing_ok=True)
                self.path.rmdir()

    # --- checkpoints ------------------------------------------------------------------------

    def write_checkpoint(self, ckpt: Checkpoint, keep: int = 2, stride: int | None = None) -> None:
        """Atomically make `ckpt` the newest checkpoint, keeping the `keep` - 1 it replaces as
        checkpoint.prev.h5, checkpoint.prev2.h5, ... Ctrl-C cannot fall between the renames. With
        `stride`, those past checkpoint.prev.h5 are kept only at steps that are multiples of it (a
        long chain thinned: one checkpoint every `stride` steps is enough to roll back to)."""
        save_checkpoint(self.path / NEXT, ckpt)
        chain = [CHECKPOINT, PREVIOUS] + [OLDER.format(n=n) for n in range(2, max(2, keep))]
        try:
            with no_interrupts():
                for newer, older in reversed(list(zip(chain, chain[1:]))):  # oldest first: one rename each
                    if (self.path / newer).exists():
                        os.replace(self.path / newer, self.path / older)
                os.replace(self.path / NEXT, self.path / CHECKPOINT)
            # each file passes checkpoint.prev2.h5 once: judged there
            if stride and len(chain) > 2 and (self.path / chain[2]).exists():
                step = stored_step(self.path / chain[2])
                if step is not None and step % stride:
                    (self.path / chain[2]).unlink()
        except OSError as err:
            raise WriteError(f"cannot write checkpoint {self.path / CHECKPOINT}: {reason(err)}") from None

    def _names(self) -> list[str]:
        """The checkpoint files here, newest name first."""
        older = sorted((p.name for p in self.path.glob(OLDER.format(n="*"))),
                       key=lambda name: int(name[len("checkpoint.prev"):-len(".h5")] or 0))
        return [n for n in CHECKPOINTS if (self.path / n).exists()] + older

    def _checkpoints(self):
        """[(name, Checkpoint or the CheckpointError that reading it raised)], newest name first."""
        found = []
        for name in self._names():
            try:
                found.append((name, load_checkpoint(self.path / name)))
            except CheckpointError as e:
                found.append((name, e))
        return found

    def read_checkpoint(self, step: int | None = None, fallback: bool = True, set_aside: bool = False) -> Checkpoint:
        """The newest complete checkpoint (the most restarts, then the highest step: a restart
        writes an earlier step anew), or the one at `step`. When a damaged file stands before the
        one returned, a CheckpointFallback warning says so in one line; with fallback=False a
        CheckpointError is raised instead (naming the intact file), and with set_aside the
        damaged file is renamed checkpoint.damaged-<time>.h5 (for a resume, so that rotation
        never moves it over the good one)."""
        found = self._checkpoints()
        good = [(n, c) for n, c in found if isinstance(c, Checkpoint) and (step is None or c.step == step)]
        damaged = [(n, e) for n, e in found if isinstance(e, CheckpointError)]
        if not good:
            if damaged:
                raise damaged[0][1]
            if not self.path.is_dir():
                raise CheckpointError(f"{self.path}: no such run folder")
            where = f" at step {step}" if step is not None else ""
            raise CheckpointError(f"{self.path}: no {CHECKPOINT}{where} (not a run folder, or a run that never "
                                  "wrote its first checkpoint)")
        name, ckpt = max(good, key=lambda nc: recency(nc[1]))
        order = [n for n, _ in found]
        passed = [(n, e) for n, e in damaged if order.index(n) < order.index(name)]
        if passed and step is None:
            why = "; ".join(f"{self.path / n} is damaged ({_cause(e)})" for n, e in passed)
            if not fallback:
                raise CheckpointError(f"{why}; {name} (step {ckpt.step}) is intact: pass --previous to use it")
            warnings.warn(f"{why}; using {self.path / name} (step {ckpt.step})", CheckpointFallback, stacklevel=2)
            if set_aside:
                for n, _ in passed:
                    self._set_aside(n)
        return ckpt

    def rollback_checkpoint(self, before: int, healthy=lambda ckpt: True) -> Checkpoint:
        """The newest intact checkpoint of the run's current course (as many restarts as the
        newest) from before step `before` for which healthy(checkpoint); with none, the oldest of
        that course (where its last restart put it)."""
        checkpoints = [c for _, c in self._checkpoints() if isinstance(c, Checkpoint)]
        if not checkpoints:
            return self.read_checkpoint()  # raises the reason
        restarts = max(recency(c)[0] for c in checkpoints)
        course = sorted((c for c in checkpoints if recency(c)[0] == restarts), key=lambda c: c.step)
        ok = {c.step for c in course if healthy(c)}
        return course[rollback_index([c.step for c in course], before, ok.__contains__)]

    def checkpoint_file(self, fallback: bool = True) -> Path:
        """The file read_checkpoint would read (for commands that show or convert one file)."""
        ckpt = self.read_checkpoint(fallback=fallback)
        for name, c in self._checkpoints():
            if isinstance(c, Checkpoint) and recency(c) == recency(ckpt):
                return self.path / name
        raise CheckpointError(f"{self.path}: its checkpoint vanished while being read")

    def newest_checkpoints(self) -> list[Checkpoint] | None:
        """Each model's newest checkpoint: this folder's, or every expert's of a SOMA run; None
        where one has none (a record kept without its checkpoints). A damaged newest one is passed
        over in silence: the reader that uses the model says so."""
        return self._newest()[0]

    def _newest(self) -> tuple[list[Checkpoint] | None, bool]:
        """newest_checkpoints(), and whether a damaged newest checkpoint was passed over for one."""
        folders = [self.expert(i) for i in range(self.read_soma().experts)] if self.is_soma else [self]
        if not all(f.has_checkpoint for f in folders):
            return None, False
        ckpts, damaged = [], False
        for f in folders:
            try:
                ckpts.append(f.read_checkpoint(fallback=False))
            except CheckpointError:
                damaged = True
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CheckpointFallback)
                    ckpts.append(f.read_checkpoint())
        return ckpts, damaged

    def _set_aside(self, name: str) -> None:
        set_aside(self.path / name, self.path / DAMAGED.format(time=_stamp()))

    # --- logs and results -------------------------------------------------------------------

    def metrics_log(self, mark: MetricsMark) -> MetricsLog:
        """This run's metrics.jsonl, opened to go on from a checkpoint's `mark` (MetricsLog). A file
        that does not hold what the mark covers is said in one line (MetricsDamaged) and set aside
        as metrics.damaged-<time>.jsonl when the log is cut; the log begins anew from there."""
        log = MetricsLog(self.path / METRICS, mark)
        if log.damaged:
            log.aside = self.path / METRICS_DAMAGED.format(time=_stamp())
            warnings.warn(f"{log.damaged}: set aside as {log.aside.name}; the log begins anew at the checkpoint",
                          MetricsDamaged, stacklevel=2)
        return log

    def read_metrics(self, ckpt: Checkpoint | None = None) -> list[dict]:
        """The step records of metrics.jsonl: those `ckpt` covers, checked against the record count
        and checksum it holds (a CheckpointError naming the file when they differ; a version 1-2
        checkpoint's own records), or without `ckpt` all of them (a line cut short by a kill ends
        the log)."""
        path = self.path / METRICS
        if ckpt is None:
            return records_of(path.read_bytes() if path.is_file() else b"")
        if ckpt.stored_metrics is not None:
            return list(ckpt.stored_metrics)
        head, why = covered(path, MetricsMark.of(ckpt))
        if head is None:
            raise CheckpointError(not_held(path, ckpt.metrics_records, why))
        return records_of(head)

    def last_metrics(self, ckpt: Checkpoint) -> dict | None:
        """The last step record `ckpt` covers (read_metrics), or None: when it covers none, when
        there is no metrics.jsonl here (a checkpoint file copied on its own), or, with a
        MetricsDamaged warning, when the file does not hold them."""
        if ckpt.stored_metrics is None and not (self.path / METRICS).is_file():
            return None
        try:
            records = self.read_metrics(ckpt)
        except CheckpointError as err:
            warnings.warn(str(err), MetricsDamaged, stacklevel=2)
            return None
        return records[-1] if records else None

    def read_results(self) -> dict | None:
        """The final evaluation (results.json), or None before the run finished; whether it is
        still of the run's newest checkpoint is stale()'s to say."""
        return read_record(self.path / RESULTS, f"zosoma train --resume {self.path} evaluates the finished run "
                                                 "again")

    def write_results(self, results: dict) -> None:
        write_json(self.path / RESULTS, results, "results")

    def current_results(self) -> dict | None:
        """results.json when it is of the run's newest checkpoints, None before the run finished;
        StaleResults (one line: of which step, and what makes it current) when the run trained on
        after it was evaluated (an extension with --steps that was stopped, say)."""
        results = self.read_results()
        why = results and self.stale(results)
        if why:
            raise StaleResults(f"{why}; zosoma train --resume {self.path} finishes the run and evaluates it again, "
                               f"zosoma eval {self.path} scores its checkpoint as it is")
        return results

    def stale(self, record: dict, name: str = RESULTS) -> str | None:
        """One line saying that `record` (this folder's results.json, or a study's result.json:
        `name`) is not of the run's newest checkpoints, or None when it is, or when there are
        none to judge by. A record names the steps it was computed from (checkpoint_steps, one per
        model); one an older zosoma wrote without them is judged by its "step" (a single model's;
        a study's SOMA record: its slowest expert's), else by its forward "tokens" (an older SOMA
        results.json), which every step adds to, a restart's too."""
        ckpts, damaged = self._newest()
        if ckpts is None:
            return None
        now, tokens = [c.step for c in ckpts], sum(int(c.extra.get("tokens", 0)) for c in ckpts)
        was = record.get("checkpoint_steps")
        if was is None and "step" in record:
            was, now = [record["step"]], [min(now)]
        newest = "the newest intact checkpoint" if damaged else "the newest checkpoint"
        if was is not None and list(was) != now:
            why = f"is of step {_steps(was)}, but {newest} is at step {_steps(now)}"
        elif "tokens" in record and record["tokens"] != tokens:
            why = f"is of {record['tokens']:,} forward tokens of training, but {newest} is of {tokens:,}"
        else:
            return None
        cause = ("the newest checkpoint is damaged, so the model it scored cannot be read" if damaged else
                 "the run trained on after it was evaluated")
        return f"{self.path / name} {why}: it is stale ({cause})"

    # --- SOMA ---------------------------------------------------------------------------------

    def read_soma(self) -> SomaShape:
        try:
            return SomaShape.from_json(json.loads((self.path / SOMA).read_text()))
        except (OSError, ValueError, ConfigError) as e:
            raise ConfigError(f"{self.path}: {SOMA} is damaged ({e}), so this SOMA run cannot be read") from None

    def write_soma(self, soma: SomaShape) -> None:
        write_json(self.path / SOMA, soma.to_json(), "run description")

    # --- comparison runs ----------------------------------------------------------------------

    def read_result(self, shape: dict | None = None) -> dict | None:
        """A finished study run's record, or None; None too for a stale one (stale(): the run
        trained on since), which the study scores again from the checkpoints. One that is not of
        `shape` (record_problem: the keys its study reads) is reported as damaged, as a record that
        is not JSON."""
        result = read_record(self.path / RESULT, "run the same command again: it scores the run again from its "
                                                  "checkpoints", shape)
        return None if result is None or self.stale(result, RESULT) else result

    def write_result(self, result: dict) -> None:
        write_json(self.path / RESULT, result, "result")

    def read_curve(self) -> list[dict]:
        path = self.path / CURVE
        if not path.exists():
            return []
        points = []
        for line in path.read_text().splitlines():
            try:
                points.append(json.loads(line))
            except ValueError:
                break  # a line cut short by a kill: drop it and what follows
        return points

    def append_curve(self, point: dict) -> None:
        append_line(self.path / CURVE, json.dumps(point), "curve")

    def clear_curve(self) -> None:
        """Forget the curve: for a run that starts again from step 0 (a backprop run an older zosoma began,
        without checkpoints)."""
        (self.path / CURVE).unlink(missing_ok=True)

    # --- a folder of runs bound to its settings ----------------------------------------------

    def bind(self, study: str, settings: dict, write: bool = True) -> None:
        """Bind this folder of runs to `settings` (JSON-able): the first call records them in
        SETTINGS; a later one with other settings, or another kind of `study`, is refused in one
        line naming what changed. write=False checks only (a plan writes nothing)."""
        wanted = plain({"study": study, **settings})
        path = self.path / SETTINGS
        if path.exists():
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path} is unreadable ({e}): give this {study} another --out") from None
            diffs = changes(found, wanted) if isinstance(found, dict) else [f"{SETTINGS} holds {json.dumps(found)}"]
            if diffs:
                raise ConfigError(f"{self.path} was made with another configuration ({'; '.join(diffs)}): give "
                                  f"this {study} another --out")
        elif write:
            self.make()
            write_json(path, wanted, "settings")

    # --- populations sharded over workers and runs on a cluster ------------------------------

    def append_scalars(self, step: int, coeffs) -> None:
        logs.append_scalars(self.path / SCALARS, step, coeffs)

    def read_scalars(self, start: int = 0) -> dict[int, list[float]]:
        """{step: the step's scalars} for the logged steps >= start (zosoma.training.logs)."""
        return logs.read_scalars(self.path / SCALARS, start)

    def cut_scalars(self, step: int) -> None:
        """Drop the logged scalars of steps >= step (those past the checkpoint a run resumes from)."""
        logs.cut_scalars(self.path / SCALARS, step)

    def read_placement(self, kind):
        """Where the run last trained, as `kind` (zosoma.workers.placement.Placement, which stands
        above this module) made from the recorded fields; the defaults when none was recorded."""
        path = self.path / PLACEMENT
        if not path.is_file():
            return kind()
        try:
            return kind(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path} is damaged ({e}): delete it and give the placement options again") from None

    def write_placement(self, placement) -> None:
        write_json(self.path / PLACEMENT, dataclasses.asdict(placement), "placement")

    def write_token(self, token: str) -> None:
        self.make()
        atomic_write(self.path / TOKEN, token, "token")

    def read_token(self) -> str | None:
        try:
            return (self.path / TOKEN).read_text()
        except OSError:
            return None


def refuse_run_files(path, what: str) -> None:
    """Refuse (ConfigError) to write `what` at `path` when it is a run folder, or names one of a
    run's own files in a folder that holds a run or a study (RUN_FILES): --force replaces a tool's
    own outputs, never a run's checkpoints, records or results."""
    path = Path(path)
    if RunFolder(path).holds_run:
        raise ConfigError(f"{path} is a run folder: write the {what} elsewhere; nothing was changed")
    parent = RunFolder(path.parent)
    if (parent.holds_run or (parent.path / SETTINGS).is_file()) and \
            any(fnmatch.fnmatchcase(path.name, name) for name in RUN_FILES):
        raise ConfigError(f"{path} is a file of the run in {parent.path}: write the {what} elsewhere; nothing "
                          "was changed")


def new_run_dir(prefix: str) -> Path:
    """runs/<prefix><time>, made now and so unique: two runs started in the same second get
    runs/...-<time> and runs/...-<time>-2 (remove_if_empty takes it back if the run never starts)."""
    stem = Path("runs") / f"{prefix}{datetime.now():%Y%m%d-%H%M%S}"
    try:
        stem.parent.mkdir(exist_ok=True)
        for n in range(1, 1000):
            path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as err:
        raise WriteError(f"cannot create a run folder in runs/: {reason(err)}") from None
    raise WriteError(f"cannot find a free run folder name beside {stem}")


def last_metrics(path) -> dict | None:
    """The last record of metrics.jsonl, the log beside the checkpoint file `path`, that the
    checkpoint covers (RunFolder.last_metrics)."""
    path = Path(path)
    return RunFolder(path.parent).last_metrics(load_checkpoint(path))


def recency(ckpt: Checkpoint) -> tuple[int, int]:
    """Which of two checkpoints of one run is newer: the one after more restarts, then the later
    step."""
    return len(ckpt.extra.get("restarts") or ()), ckpt.step


def checkpoint_path(path, fallback: bool = True) -> Path:
    """A checkpoint file named by itself, or by its run folder (its newest complete checkpoint,
    RunFolder.checkpoint_file)."""
    path = Path(path)
    return RunFolder(path).checkpoint_file(fallback) if path.is_dir() else path


def warn_if_training(path, steps) -> str | None:
    """Warn (StillTraining, one line) when a live process trains the run `path` belongs to (a run
    folder, an expert's, or a checkpoint file in one): who, and `steps`, the step of each
    checkpoint the caller read, so not the finished model. Returns who ('pid N on HOST'), or None."""
    path = Path(path)
    folder = RunFolder(path if path.is_dir() else path.parent)
    owner = folder.trained_by()
    if owner is not None:
        what = "its experts' checkpoints" if len(steps) > 1 else "its checkpoint" if path.is_dir() else str(path)
        warnings.warn(f"{folder.soma_run or folder} is still training ({owner}): this uses {what} at step "
                      f"{_steps(steps)}, not the finished model", StillTraining, stacklevel=2)
    return owner


def _steps(steps) -> str:
    """'300', or an expert per step: '300, 298'."""
    return ", ".join(str(s) for s in steps)


def _stamp() -> str:
    """The time in a damaged file's new name."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def _cause(err: CheckpointError) -> str:
    """The reason part of a checkpoint reader's message ('... is damaged or not ...: REASON')."""
    return str(err).split(": ", 1)[-1] if ": " in str(err) else str(err)
