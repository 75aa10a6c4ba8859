"""Counting what a step asks of the device: kernel launches, as `zosoma bench spsa` and
studies/gpu_check.py report them per step (on a GPU, or on the emulated runtime of
zosoma.engines.cuda.emulated, which issues the same launches).

Counted: zosoma's raw kernels (custom_kernels.launch and launch_blocks) and its GEMMs (xp.matmul:
one cuBLAS batched GEMM each). CuPy's own small kernels (contiguous copies of the members'
weights, fills, the loss sum) are not counted.
"""

from __future__ import annotations

from zosoma.engines.cuda import custom_kernels


class Launches:
    """Counts launches while active (a context manager): .kernels, .gemms, .total."""

    def __init__(self, xp):
        self.xp, self.kernels, self.gemms = xp, 0, 0

    @property
    def total(self) -> int:
        return self.kernels + self.gemms

    def __enter__(self):
        self._saved = custom_kernels.launch, custom_kernels.launch_blocks, self.xp.matmul

        def counted(fn, field):
            def wrapper(*args, **kwargs):
                setattr(self, field, getattr(self, field) + 1)
                return fn(*args, **kwargs)
            return wrapper

        custom_kernels.launch = counted(self._saved[0], "kernels")
        custom_kernels.launch_blocks = counted(self._saved[1], "kernels")
        self.xp.matmul = counted(self._saved[2], "gemms")
        return self

    def __exit__(self, *exc):
        custom_kernels.launch, custom_kernels.launch_blocks, self.xp.matmul = self._saved
