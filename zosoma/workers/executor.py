"""Executors: where units of work run. SOMA's experts and the comparison's runs both go through one.

A unit is a picklable callable `unit(stopping) -> iterator of records` (zosoma.training.records) that
is idempotent: it opens its run folder, resumes from its last checkpoint, writes atomically, and
returns early (after checkpointing) once `stopping()` is true, so it can be retried anywhere. An
executor runs units and yields their records as they come, plus Failed(unit index, one line) for
a unit that raised:

    Inline()               one unit after another in this process
    LocalProcesses(n)      n spawned worker processes on this machine, one BLAS thread each on a
                           machine with n cores; Ctrl-C reaches only the parent, which asks every
                           unit to stop through a shared Event; a worker whose parent died exits.
                           Once every unit has started, the cores that no unit uses are lent to the
                           units still running (spare_cores: a SOMA expert spreads its population
                           over them), so no core idles while a unit still has work
    Together()             units that open a model (SOMA's experts) stepped together in this
                           process, each step of all of them in one population (one launch on a
                           GPU: zosoma.training.together); other units inline
    RayExecutor(...)       Ray tasks on this machine or a cluster, retried when a worker or node
                           dies (zosoma.workers.ray_executor; units name their folder as unit.run_dir)

The rest of zosoma never asks which executor it got.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from zosoma.errors import one_line
from zosoma.training.records import Failed

Unit = Callable[[Callable[[], bool]], Iterator]

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


class Inline:
    """Units one after another, in this process."""

    def run(self, units: Sequence[Unit], should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        for i, unit in enumerate(units):
            if should_stop():
                return
            try:
                yield from unit(should_stop)
            except Exception as e:  # one failed unit must not take the others with it
                yield Failed(i, one_line(e))


class Together:
    """Units that open a model to train (unit.opened(): SOMA's experts) trained together in this
    process, each step of all of them in one population (zosoma.training.together: on a GPU, one
    launch for every expert's members); other units inline."""

    def run(self, units: Sequence[Unit], should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        if not all(hasattr(u, "opened") for u in units):
            yield from Inline().run(units, should_stop)
            return
        from zosoma.training.together import train_together
        with contextlib.ExitStack() as stack:
            opened = []
            for i, unit in enumerate(units):
                try:
                    trainer, notes = stack.enter_context(unit.opened())
                except Exception as e:  # one that cannot open must not take the others with it
                    yield Failed(i, one_line(e))
                    continue
                yield from notes
                opened.append((i, trainer))
            yield from train_together([t for _, t in opened], should_stop, [i for i, _ in opened])


class LocalProcesses:
    """Units in `workers` spawned processes (spawn, not fork: BLAS threads do not survive a fork)."""

    def __init__(self, workers: int, threads: int | None = None):
        self.workers = max(1, int(workers))
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.workers)

    def run(self, units: Sequence[Unit], should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        quiet_resource_tracker()
        ctx = multiprocessing.get_context("spawn")
        records, stop = ctx.Queue(), ctx.Event()
        cores = Cores(ctx, self.workers, len(units), self.threads)
        with child_threads(self.threads), ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_init_worker,
                initargs=(records, stop, os.getpid(), cores)) as pool:
            futures = {pool.submit(_run_unit, i, unit): i for i, unit in enumerate(units)}
            pending, done = set(futures), set()
            while pending or not records.empty():
                if should_stop() and not stop.is_set():
                    stop.set()
                    for f in pending:
                        f.cancel()  # not started yet: nothing to stop
                try:
                    record = records.get(timeout=0.2)
                except queue.Empty:
                    record = None
                if isinstance(record, _Done):
                    done.add(record.unit)
                elif record is not None:
                    yield record
                    continue
                for f in [f for f in pending if f.done()]:
                    pending.discard(f)
                    # A unit that returned is not failed by the pool breaking after it (a worker
                    # leaves at once after SIGTERM); nor, once a stop was asked, is one never run.
                    error = None if f.cancelled() else f.exception()
                    lost = isinstance(error, BrokenProcessPool) and stop.is_set()
                    if error is not None and futures[f] not in done and not lost:
                        yield Failed(futures[f], one_line(error))


class Cores:
    """A LocalProcesses pool's cores, counted across its workers: each running unit holds one, and
    may borrow those no unit holds once every unit has started (a unit waiting for a worker comes
    first). Borrowed cores come back when the unit ends. `threads`: BLAS threads per core's process."""

    def __init__(self, ctx, cores: int, units: int, threads: int = 1):
        self.cores, self.units, self.threads = cores, units, threads
        self._lock = ctx.Lock()
        self._started, self._busy = ctx.RawValue("i", 0), ctx.RawValue("i", 0)
        self._borrowed = 0  # by this process's unit

    def start(self) -> None:
        """A unit starts in this worker, on a core of its own."""
        with self._lock:
            self._started.value += 1
            self._busy.value += 1

    def end(self) -> None:
        """This worker's unit ended: its core and those it borrowed are free."""
        with self._lock:
            self._busy.value -= 1 + self._borrowed
        self._borrowed = 0

    def borrow(self, most: int) -> int:
        """How many of at most `most` free cores this worker's unit now holds besides its own."""
        with self._lock:
            n = max(0, min(most, self.cores - self._busy.value)) if self._started.value == self.units else 0
            self._busy.value += n
        self._borrowed += n
        return n


def spare_cores() -> Cores | None:
    """In a LocalProcesses worker, the pool's Cores its unit may borrow from; None elsewhere."""
    return _cores


# --- in the worker processes ---------------------------------------------------------------------

_records = _stop = _cores = None
_terminated = False  # this worker got SIGTERM


@dataclass(frozen=True)
class _Done:
    """Unit `unit` returned: every record it made is in the queue before this one."""
    unit: int


def _init_worker(records, stop, parent: int, cores: Cores) -> None:
    global _records, _stop, _cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which asks the units to stop
    # SLURM and systemd send SIGTERM to every process: the unit stops as if asked (checkpointed)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _records, _stop, _cores = records, stop, cores
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()


def _on_sigterm(signum, frame) -> None:
    global _terminated
    _terminated = True


def exit_with_parent(parent: int) -> None:
    """End this worker as soon as its parent is gone (killed, even with SIGKILL): a worker must
    never train on, or write into a run folder, without the process that owns the run."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _run_unit(index: int, unit: Unit) -> None:
    _cores.start()
    try:
        for record in unit(lambda: _terminated or _stop.is_set()):
            _records.put(record)
    finally:
        _cores.end()
    _records.put(_Done(index))
    if _terminated:  # a pool that signalled its workers (it broke) waits for them to exit, not to return
        _records.close()
        _records.join_thread()  # every record sent first
        os._exit(0)


def quiet_resource_tracker() -> None:
    """The resource tracker that the queues start warns of "leaked semaphore objects" when this
    process is killed, although it then removes them: cleanup, not news. It takes its warning
    filters from sys.warnoptions when it starts, so add one there first."""
    rule = "ignore:resource_tracker:UserWarning"
    if rule not in sys.warnoptions:
        sys.warnoptions.append(rule)


@contextlib.contextmanager
def child_threads(threads: int):
    """Within the block, processes spawned from this one start with `threads` BLAS/OpenMP/Numba
    threads (they read the environment when they import NumPy); this process is unaffected."""
    saved = {k: os.environ.get(k) for k in THREAD_VARS}
    os.environ.update({k: str(threads) for k in THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
