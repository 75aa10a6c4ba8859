"""Where the forward runs: one Ops interface, one folder per engine.

    ops            the Ops interface, implemented by the CPU engine (NumPy and Numba)
    cpu/           the CPU engine's compiled kernels (forward, lowrank, noise_kernels, threads)
    cuda/          CUDA: CudaOps (cuda_ops) over cuda_forward, cuda_noise and custom_kernels
                   (the launchers of the CuPy raw kernels in kernels/*.cu); only backend imports CuPy
    forward_only   the base of engines that run whole models only, fed perturbed copies:
    onnxruntime/     ONNX Runtime (onnxrt_ops)
    emulated/        the low-precision forwards, bf16, fp16 and int8 (precision_ops)

`get_ops` is the one place that maps a device, engine and precision name to an engine; workers
and run folders carry the names, and the rest of zosoma asks an engine what it is through its
attributes (Ops.device, Ops.on_device, Ops.precision). An engine folder imports the shared modules here, the
CPU engine's kernels (every engine is an Ops) and its own files. May import the foundation,
zosoma.model and zosoma.formats (the ONNX graph).
"""

from __future__ import annotations

from functools import lru_cache

from zosoma.config import ENGINES, PRECISIONS  # noqa: F401  (re-exported: the engine names)
from zosoma.errors import ConfigError, OptionError

DEVICES = ("cpu", "cuda", "auto")


def check_device(device) -> None:
    """A device name get_ops takes, or an OptionError (a usage error: exit code 2) in one line."""
    if device not in DEVICES:
        raise OptionError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


def cuda_engine_here():
    """The CUDA engine on the runtime custom_kernels is using now, not cached: the emulated one
    where a benchmark counts a step's launches on the CPU (zosoma.benchmarks.bench_together)."""
    from zosoma.engines.cuda.cuda_ops import CudaOps
    return CudaOps()


def check_gemm(device: str, gemm: str, engine: str = "native", precision: str = "fp32") -> None:
    """A GEMM format (zosoma.engines.cuda.tensor_cores) that `device` and the engine can run:
    tensor cores need --device cuda (or auto) and the native fp32 engine; a ConfigError line
    otherwise (get_ops adds: auto must find a GPU)."""
    from zosoma.engines.cuda.tensor_cores import check_gemm_format
    if check_gemm_format(gemm) != "fp32" and (device == "cpu" or (engine, precision) != ("native", "fp32")):
        raise _needs_cuda(gemm)


def _needs_cuda(gemm: str) -> ConfigError:
    return ConfigError(f"--gemm {gemm} runs the CUDA engine's GEMMs on tensor cores: it needs --device cuda "
                       "and the native fp32 engine (on the CPU, studies/gemm_precision.py emulates it)")


def get_ops(device: str = "cpu", engine: str = "native", precision: str = "fp32", gemm: str = "fp32"):
    """The engine for a device name: "cpu", "cuda" (a ConfigError line when CuPy finds no GPU) or
    "auto" (CUDA when CuPy finds a device, else the CPU; `device_note` says which and why); with
    engine "onnxruntime" the forwards run in ONNX Runtime, with a precision other than fp32 they
    are emulated in that format (both on the CPU; a ConfigError line when the runtime is not
    installed); gemm "tf32" or "bf16" runs the CUDA engine's GEMMs on tensor cores (a ConfigError
    line where the engine is not CUDA's). The one place in zosoma where these names become an engine;
    one engine per set of names, however they are passed. A bad ZOSOMA_CPU_GEMM is refused each time
    a CPU engine is asked for, not only when it is first built: a run is refused before it starts."""
    ops = _engine(device, engine, precision, gemm)
    if not ops.on_device:
        from zosoma.engines.cpu.forward import gemm_path
        gemm_path()
    return ops


@lru_cache(maxsize=None)
def _engine(device: str, engine: str, precision: str, gemm: str):
    from zosoma.engines.cuda import backend
    from zosoma.engines.ops import Ops

    check_device(device)
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if precision not in PRECISIONS:
        raise ConfigError(f"forward_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    check_gemm(device, gemm, engine, precision)
    if gemm != "fp32" and device == "auto" and backend.cuda_unavailable_reason() is not None:
        raise _needs_cuda(gemm)
    if (engine, precision) != ("native", "fp32"):
        if device not in ("cpu", "auto"):
            raise ConfigError(f"--engine {engine} --forward-precision {precision} runs on the CPU, not on {device}")
        if engine == "onnxruntime" and precision != "fp32":
            raise ConfigError("--engine onnxruntime runs fp32 forwards; --forward-precision emulates other "
                              "formats on the native engine")
        if engine == "onnxruntime":
            from zosoma.engines.onnxruntime.onnxrt_ops import OnnxRuntimeOps
            return OnnxRuntimeOps()
        from zosoma.engines.emulated.precision_ops import PrecisionOps
        return PrecisionOps(precision)
    if device == "cpu" or (device == "auto" and backend.cuda_unavailable_reason() is not None):
        return Ops()
    from zosoma.engines.cuda.cuda_ops import CudaOps
    return CudaOps(gemm)  # a ConfigError line when CuPy is missing or finds no device


get_ops.cache_clear = _engine.cache_clear  # tests that swap the CUDA backend forget the engines made


class SendsEngine:
    """A unit of work that carries the run's engine in its `ops` field (a population worker's spec,
    an expert unit): in this process the engine itself; sent to another process, its record
    (device, engine, precision, gemm), which get_ops turns back into the engine there. The one way a
    process boundary rebuilds an engine."""

    def __getstate__(self):
        ops = self.ops
        return {**self.__dict__, "ops": (ops.device, ops.engine, ops.precision, ops.gemm)}

    def __setstate__(self, state):
        self.__dict__.update(state, ops=get_ops(*state["ops"]))  # (frozen dataclasses too)


def resolved_device(device: str, ops) -> str:
    """`device` as a run on the engine `ops` records it: --device auto becomes the engine's device."""
    return ops.device if device == "auto" else device


def device_note(device: str, ops) -> str | None:
    """The line --device auto prints: which engine it chose and, on the CPU, why not CUDA (None for
    a device named outright)."""
    from zosoma.engines.cuda import backend

    if device != "auto":
        return None
    why = None if ops.on_device else backend.cuda_unavailable_reason()
    return f"--device auto: running on {ops.name}" + (f" ({why})" if why else "")
