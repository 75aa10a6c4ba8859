"""CuPy and CUDA devices: the only module that imports CuPy.

Code that must run on either device derives its array module from its inputs
(zosoma.arrays.get_array_module); zosoma.engines.get_ops picks the engine. Two questions are kept
apart here (as thinc's compat.py does), because they fail differently: does CuPy import (the optional extra `pip install zosoma[gpu]`), and
does CUDA then find a device (driver, visibility, a machine without a GPU)? CuPy is imported on
first use only: it is slow to import and most runs are on the CPU.

    require_cupy()          CuPy with a device, else ConfigError saying why
    cupy_or_none()          CuPy if it imports, else None (says nothing about devices)
    cuda_device_count()     devices CuPy can use (0 without CuPy)
    cuda_unavailable_reason()   why CUDA cannot run (one line), or None
    cublas_compute_type(fmt)    a context: float32 GEMMs on tensor cores (tf32, bf16)
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from zosoma.errors import ConfigError

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


def require_cupy():
    """CuPy, when it imports and finds a device; else a one-line ConfigError saying why not."""
    why = cuda_unavailable_reason()
    if why is not None:
        raise ConfigError(f"--device cuda: no CUDA device ({why})")
    return cupy_or_none()


@contextlib.contextmanager
def cublas_compute_type(fmt: str):
    """While active, CuPy's float32 GEMMs (cupy.matmul, cuBLAS) run on tensor cores in `fmt`:
    "tf32" (CUBLAS_COMPUTE_32F_FAST_TF32) or "bf16" (..._FAST_16BF): fp32 in memory, the operands
    converted inside the GEMM, fp32 accumulation. CuPy's own switch (as CUPY_TF32=1 sets for tf32);
    compute capability 8.0 or more, else CuPy warns and keeps fp32."""
    from cupy._core import _routines_linalg as linalg

    code = {"tf32": linalg.COMPUTE_TYPE_TF32, "bf16": linalg.COMPUTE_TYPE_BF16}[fmt]
    before = linalg.get_compute_type(np.float32)
    linalg.set_compute_type(np.float32, code)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, before)
