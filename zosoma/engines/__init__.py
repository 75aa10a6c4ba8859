"""Where the forward runs: one Ops interface, one implementation per engine.

Owns the Ops interface (ops) and its engines: the CPU (NumPy and Numba, zosoma.model's kernels),
CUDA (cuda, CuPy raw kernels in kernels/*.cu; only backend imports CuPy), and the forward-only
engines (forward_only): ONNX Runtime (onnxrt) and the emulated low-precision forwards
(precision). `get_ops` is the one place that maps a device, engine and precision name to an
engine; workers and run folders carry the names. May import the foundation, zosoma.model and
zosoma.formats (the ONNX graph).
"""

from __future__ import annotations

from functools import lru_cache

from zosoma.config import ENGINES, PRECISIONS  # noqa: F401  (re-exported: the engine names)
from zosoma.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")


@lru_cache(maxsize=None)
def get_ops(device: str = "cpu", engine: str = "native", precision: str = "fp32"):
    """The engine for a device name: "cpu", "cuda" (a ConfigError line when CuPy finds no GPU) or
    "auto" (CUDA when CuPy finds a device, else the CPU; `auto_note` says which and why); with
    engine "onnxruntime" the forwards run in ONNX Runtime, with a precision other than fp32 they
    are emulated in that format (both on the CPU; a ConfigError line when the runtime is not
    installed). The one place in zosoma where these names become an engine."""
    from zosoma.engines import backend
    from zosoma.engines.ops import Ops

    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if precision not in PRECISIONS:
        raise ConfigError(f"forward precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if (engine, precision) != ("native", "fp32"):
        if device not in ("cpu", "auto"):
            raise ConfigError(f"--engine {engine} --forward-precision {precision} runs on the CPU, not on {device}")
        if engine == "onnxruntime" and precision != "fp32":
            raise ConfigError("--engine onnxruntime runs fp32 forwards; --forward-precision emulates other "
                              "formats on the native engine")
        if engine == "onnxruntime":
            from zosoma.engines.onnxrt import OnnxRuntimeOps
            return OnnxRuntimeOps()
        from zosoma.engines.precision import PrecisionOps
        return PrecisionOps(precision)
    if device == "cpu" or (device == "auto" and backend.cuda_unavailable_reason() is not None):
        return Ops()
    from zosoma.engines.cuda import CudaOps
    return CudaOps()  # a ConfigError line when CuPy is missing or finds no device


def run_ops(ops, engine: str = "native", precision: str = "fp32"):
    """The engine a run trains on: `ops` (its device's engine) unless the run's configuration
    names another engine or a forward precision, which then run on the CPU (get_ops)."""
    if (engine, precision) == ("native", "fp32"):
        return ops
    wanted = get_ops("cpu", engine, precision)
    if ops is not None and ops.name not in ("cpu", wanted.name):
        raise ConfigError(f"--engine {engine} --forward-precision {precision} runs on the CPU, not on {ops.name}")
    return wanted


def auto_note(ops) -> str:
    """One line saying which engine --device auto chose, and why not CUDA when it is the CPU."""
    from zosoma.engines import backend

    why = backend.cuda_unavailable_reason() if ops.name == "cpu" else None
    return f"--device auto: running on {ops.name}" + (f" ({why})" if why else "")
