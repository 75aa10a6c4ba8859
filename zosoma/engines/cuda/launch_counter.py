"""Counting what the CUDA engine launches, on a device or on tests' emulated runtime.

LaunchCounter counts, while active, zosoma's raw kernels (every one goes through
custom_kernels.launch) and its GEMMs (runtime().xp.matmul: one cuBLAS batched GEMM each), and
the rows the forward computes, read from the layer-0 cell kernel's own arguments (M members x B
rows at the first step of a sequence): padded rows count, as the device computes them.
"""

from __future__ import annotations

from zosoma.engines.cuda import custom_kernels

_CELL = "lstm_cell_embed"  # one launch per time step of layer 0; args ..., tt (5), ..., M (10), B (11)


class LaunchCounter:
    """with LaunchCounter() as n: ... ; then n.kernels, n.gemms, n.launches, n.rows."""

    def __init__(self):
        self.kernels = self.gemms = self.rows = 0

    @property
    def launches(self) -> int:
        return self.kernels + self.gemms

    def __enter__(self):
        self._xp = custom_kernels.runtime().xp
        self._launch, self._matmul = custom_kernels.launch, self._xp.matmul

        def launch(name, work, *args, **kwargs):
            self.kernels += 1
            if name == _CELL and args[5] == 0:  # a sequence's first step: its rows, once
                self.rows += int(args[10]) * int(args[11])
            return self._launch(name, work, *args, **kwargs)

        def matmul(*args, **kwargs):
            self.gemms += 1
            return self._matmul(*args, **kwargs)

        custom_kernels.launch, self._xp.matmul = launch, matmul
        return self

    def __exit__(self, *exc):
        custom_kernels.launch, self._xp.matmul = self._launch, self._matmul
