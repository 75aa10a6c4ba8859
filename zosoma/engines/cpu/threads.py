"""Member-parallel CPU work: a few threads, each running compiled (nogil) kernels on whole work
items (population members, or blocks of batch rows) with BLAS held to one thread.

Why not BLAS's own threads: the forwards of small models are many small GEMMs. OpenBLAS runs a
GEMM under about 2.6e5 multiply-adds on one thread (the recurrent product of the tiny preset, every
timestep), and splitting a larger one costs a synchronisation per call; on a shared machine a split
GEMM whose second thread waits for a busy core ran 10x slower or worse (the 2-core development
machine). Members are independent, so each thread here runs whole members, one-thread BLAS calls
and all.

The threads are as many as BLAS would use (OPENBLAS_NUM_THREADS, else the cores), so a worker
process given one BLAS thread (zosoma.workers.executor) runs everything inline. Each thread sets its
own BLAS thread count to one with OpenBLAS's `openblas_set_num_threads_local` (0.3.27+), found in
the OpenBLAS libraries loaded in this process (SciPy's, behind Numba's np.dot, and NumPy's). Where
that control is missing (another BLAS, another OS), everything runs inline, BLAS as configured.
An item's numbers do not depend on which thread ran it, so whole members give the same numbers
whatever the thread count; a single member's batch rows split into blocks (one block per thread)
may differ in the last bit, as BLAS can round a row of a smaller GEMM differently.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Sequence

_GET_THREADS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads",
                "scipy_openblas_get_num_threads64_")


@lru_cache(maxsize=None)
def _openblas_libs() -> tuple:
    """(set_num_threads_local, get_num_threads or None) of each loaded OpenBLAS library that has
    a thread-local thread count (looked up once: a ctypes lookup costs about 20 microseconds)."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS that Numba's np.dot calls)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return ()
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "openblas_set_num_threads_local"):
            set_local = lib.openblas_set_num_threads_local
            set_local.argtypes = [ctypes.c_int]
            get = next((getattr(lib, name) for name in _GET_THREADS if hasattr(lib, name)), None)
            libs.append((set_local, get))
    return tuple(libs)


@lru_cache(maxsize=None)
def n_threads() -> int:
    """Threads for member-parallel work: the BLAS thread count (1 without a thread-local control),
    read once (the executor fixes it in the environment before a worker starts)."""
    libs = _openblas_libs()
    if not libs:
        return 1
    counts = [get() for _, get in libs if get is not None]
    return max(1, max(counts, default=os.cpu_count() or 1))


def _one_blas_thread() -> None:
    for set_local, _ in _openblas_libs():
        set_local(1)


_pool: dict = {}
_pool_lock = threading.Lock()
os.register_at_fork(after_in_child=_pool.clear)  # a forked child has none of the parent's threads


def _executor(n: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if n not in _pool:
            _pool[n] = ThreadPoolExecutor(n, thread_name_prefix="zosoma-members",
                                          initializer=_one_blas_thread)
        return _pool[n]


def run_items(work: Callable[[int, int], None], n_items: int, make_state: Callable[[], object] | None = None,
              threads: int | None = None) -> None:
    """Call work(item, state) for item in range(n_items), spread over the threads, each thread
    taking the next item when it is done (a core slowed by another job takes fewer). `state`
    comes from make_state(), once per thread (work buffers); `work` must release the GIL (a
    nogil Numba function) for the threads to overlap."""
    n = min(n_items, threads or n_threads())
    make_state = make_state or (lambda: None)
    if n <= 1:
        state = make_state()
        for item in range(n_items):
            work(item, state)
        return
    counter = itertools.count()  # next() on it is atomic under the GIL
    given_up = threading.Event()

    def loop():
        state = make_state()
        while not given_up.is_set() and (item := next(counter)) < n_items:
            work(item, state)

    futures = [_executor(n).submit(loop) for _ in range(n)]
    try:
        for f in futures:
            f.result()  # re-raises a worker's exception here
    except BaseException:  # a worker's error, or Ctrl-C: the other threads take no further item
        given_up.set()
        raise


def split(n: int, parts: int) -> Sequence[range]:
    """range(n) cut into `parts` nearly equal consecutive ranges (none empty when parts <= n)."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
