"""Tensor-core GEMMs in the CUDA engine's population forward: TF32 or bf16, fp32 by default.

An NVIDIA tensor core multiplies float32 matrices in a narrower format: the operands are
converted (TF32: 10 fraction bits, bf16: 7; both keep fp32's exponent), every product of two
converted values is exact in fp32, and the sums accumulate in fp32. Only the GEMMs change; the
raw kernels (cell, log-softmax) stay fp32. `gemm_format(fmt)` runs the engine's GEMMs so:

    on CuPy         cuBLAS's compute type for float32 (backend.cublas_compute_type)
    emulated (NumPy) every matmul's operands rounded to the format (round_operand), then an fp32
                    matmul: the same products, summed in another order

zosoma.experiments.gemm_precision measures what that does to SPSA's loss differences on the CPU
(the same rounding, in the reference forward); studies/gpu_check.py measures it, and the speed, on
a device.
"""

from __future__ import annotations

import contextlib

import numpy as np

from zosoma.engines.cuda import backend
from zosoma.engines.cuda.custom_kernels import runtime
from zosoma.errors import OptionError
from zosoma.model.number_formats import round_to

GEMM_FORMATS = ("fp32", "tf32", "bf16")
_active = "fp32"  # the format of the gemm_format block the engine is in
FRACTION_BITS = {"fp32": 23, "tf32": 10, "bf16": 7}


def check_gemm_format(fmt: str) -> str:
    if fmt not in GEMM_FORMATS:
        raise OptionError(f"gemm must be one of {', '.join(GEMM_FORMATS)}, got {fmt!r}")
    return fmt


def round_operand(x, fmt: str) -> np.ndarray:
    """x (float32) as a tensor core reads it in `fmt`, round-to-nearest-even (NaN kept a NaN)."""
    check_gemm_format(fmt)
    if fmt != "tf32":
        return round_to(x, fmt)
    x = np.asarray(x, np.float32)
    u = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    u = np.where(nan, u | 0x400000, u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def active() -> str:
    """The format the engine's GEMMs run in now (a captured graph keeps the format it was captured
    in: graph_forward keys its graphs by it)."""
    return _active


@contextlib.contextmanager
def gemm_format(fmt: str):
    """While active, the engine's float32 GEMMs (runtime().xp.matmul) run in `fmt`."""
    global _active
    check_gemm_format(fmt)
    before, _active = _active, fmt
    try:
        with _gemms_in(fmt):
            yield
    finally:
        _active = before


@contextlib.contextmanager
def _gemms_in(fmt: str):
    xp = runtime().xp
    if fmt == "fp32":
        yield
    elif xp is np:  # the emulated runtime: no tensor cores, their rounding
        matmul = np.matmul

        def rounded(a, b, out=None, **kwargs):
            return matmul(round_operand(a, fmt), round_operand(b, fmt), out=out, **kwargs)

        np.matmul = rounded
        try:
            yield
        finally:
            np.matmul = matmul
    else:
        with backend.cublas_compute_type(fmt):
            yield
