"""The one backend seam: which array library and device a computation runs on.

Nothing else in zosoma imports CuPy; code that must run on either device derives its array module
from its inputs with `get_array_module`. Two questions are kept apart (as thinc's compat.py does),
because they fail differently: does CuPy import (the optional extra `pip install zosoma[gpu]`), and
does CUDA then find a device (driver, visibility, a machine without a GPU)? CuPy is imported on
first use only: it is slow to import and most runs are on the CPU.

    resolve_device("cpu" | "cuda" | "auto") -> "cpu" | "cuda"
    require_cupy()          CuPy with a device, else ConfigError saying why
    cupy_or_none()          CuPy if it imports, else None (says nothing about devices)
    cuda_device_count()     devices CuPy can use (0 without CuPy)
    get_array_module(*xs)   numpy or cupy, from the arrays given
    to_numpy(x)             a NumPy array, copied from the device when needed
"""

from __future__ import annotations

import contextlib
import os

import functools
import sys

import numpy as np

from .errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")
INSTALL_HINT = "pip install zosoma[gpu]"


@functools.lru_cache(maxsize=None)
def _import_cupy():
    """(cupy module or None, why not). Cached: an import is attempted once per process."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "cupy":
            return None, f"CuPy not installed: {INSTALL_HINT}"
        return None, f"CuPy failed to import: {_first_line(e)}"
    except Exception as e:  # a CuPy built for another CUDA, missing libraries, ...
        return None, f"CuPy failed to import: {_first_line(e)}"
    return cupy, None


@functools.lru_cache(maxsize=None)
def _probe_devices() -> tuple[int, str | None]:
    """(number of CUDA devices, why none). Cached like the import."""
    cupy, why = _import_cupy()
    if cupy is None:
        return 0, why
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError: no driver, no device, driver too old
        return 0, f"CuPy found no device: {_first_line(e)}"
    if count == 0:
        return 0, "CuPy found no device"
    return count, None


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def cupy_or_none():
    """The cupy module if it imports, else None. Says nothing about whether a GPU exists."""
    return _import_cupy()[0]


def cuda_device_count() -> int:
    """CUDA devices CuPy can use: 0 when CuPy is missing or finds none."""
    return _probe_devices()[0]


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run (one line), or None when it can."""
    return _probe_devices()[1]


def resolve_device(name: str) -> str:
    """"cpu", "cuda" or "auto" -> "cpu" or "cuda". "auto" picks CUDA when CuPy imports and finds a
    device; "cuda" without one raises ConfigError with a one-line reason."""
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return "cpu"
    why = cuda_unavailable_reason()
    if why is None:
        return "cuda"
    if name == "auto":
        return "cpu"
    raise ConfigError(f"--device cuda: no CUDA device ({why})")


def require_cupy():
    """CuPy, when it imports and finds a device; else ConfigError as resolve_device("cuda")."""
    resolve_device("cuda")
    return cupy_or_none()


def get_array_module(*arrays):
    """numpy, or cupy when any argument is a CuPy array. Never imports CuPy: if it was never
    imported, no argument can be a CuPy array."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return np
    return cupy.get_array_module(*arrays)


def to_numpy(x) -> np.ndarray:
    """A NumPy array of x: a CuPy array is copied from the device, anything else is np.asarray'd."""
    if get_array_module(x) is not np:
        return x.get()
    return np.asarray(x)


THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


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
