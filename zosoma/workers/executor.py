"""Executors: where units of work run. SOMA's experts and the comparison's runs both go through one.

A unit is a picklable callable `unit(stopping) -> iterator of records` (zosoma.runs.records) that
is idempotent: it opens its run folder, resumes from its last checkpoint, writes atomically, and
returns early (after checkpointing) once `stopping()` is true, so it can be retried anywhere. An
executor runs units and yields their records as they come, plus Failed(unit index, one line) for
a unit that raised:

    Inline()               one unit after another in this process
    LocalProcesses(n)      n spawned worker processes on this machine, one BLAS thread each on a
                           machine with n cores; Ctrl-C reaches only the parent, which asks every
                           unit to stop through a shared Event; a worker whose parent died exits
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

from zosoma.runs.records import Failed

Unit = Callable[[Callable[[], bool]], Iterator]

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


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


class LocalProcesses:
    """Units in `workers` spawned processes (spawn, not fork: BLAS threads do not survive a fork)."""

    def __init__(self, workers: int, threads: int | None = None):
        self.workers = max(1, int(workers))
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.workers)

    def run(self, units: Sequence[Unit], should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        quiet_resource_tracker()
        ctx = multiprocessing.get_context("spawn")
        records, stop = ctx.Queue(), ctx.Event()
        with child_threads(self.threads), ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_init_worker,
                initargs=(records, stop, os.getpid())) as pool:
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


# --- in the worker processes ---------------------------------------------------------------------

_records = _stop = None
_terminated = False  # this worker got SIGTERM


@dataclass(frozen=True)
class _Done:
    """Unit `unit` returned: every record it made is in the queue before this one."""
    unit: int


def _init_worker(records, stop, parent: int) -> None:
    global _records, _stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which asks the units to stop
    # SLURM and systemd send SIGTERM to every process: the unit stops as if asked (checkpointed)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _records, _stop = records, stop
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
    for record in unit(lambda: _terminated or _stop.is_set()):
        _records.put(record)
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
