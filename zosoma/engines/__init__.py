"""Where the forward runs: one Ops interface, one implementation per engine.

Owns the Ops interface (ops) and its engines: the CPU (NumPy and Numba, zosoma.model's kernels)
and CUDA (cuda, CuPy raw kernels in kernels/*.cu; only backend imports CuPy). `get_ops` is the
one place that maps a device name to an engine. May import the foundation and zosoma.model.
"""

from __future__ import annotations

from functools import lru_cache

from zosoma.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")


@lru_cache(maxsize=None)
def get_ops(device: str = "cpu"):
    """The engine for a device name: "cpu", "cuda" (a ConfigError line when CuPy finds no GPU) or
    "auto" (CUDA when CuPy finds a device, else the CPU; `auto_note` says which and why). The one
    place in zosoma where a device name becomes an engine."""
    from zosoma.engines import backend
    from zosoma.engines.ops import Ops

    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu" or (device == "auto" and backend.cuda_unavailable_reason() is not None):
        return Ops()
    from zosoma.engines.cuda import CudaOps
    return CudaOps()  # a ConfigError line when CuPy is missing or finds no device


def auto_note(ops) -> str:
    """One line saying which engine --device auto chose, and why not CUDA when it is the CPU."""
    from zosoma.engines import backend

    why = backend.cuda_unavailable_reason() if ops.name == "cpu" else None
    return f"--device auto: running on {ops.name}" + (f" ({why})" if why else "")
