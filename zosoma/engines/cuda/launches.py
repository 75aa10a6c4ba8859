"""Counting what a step asks of the device: kernel launches, as `zosoma bench spsa` and
studies/gpu_check.py report them per step (on a GPU, or on the emulated runtime of
zosoma.engines.cuda.emulated, which issues the same launches).

Counted: zosoma's raw kernels (custom_kernels.launch and launch_blocks), its GEMMs (xp.matmul:
one cuBLAS batched GEMM each) and replays of captured graphs (graph_forward.replay: one launch
each, whatever the graph holds). CuPy's own small kernels (contiguous copies of the members'
weights, fills, the loss sum) are not counted.
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.cuda import custom_kernels, graph_forward


class Launches:
    """Counts launches while active (a context manager): .kernels, .gemms, .graphs (replays of a
    captured graph, one launch each), .total. xp: the array module whose matmul is the GEMM
    (default: the active runtime's, read on entry)."""

    def __init__(self, xp=None):
        self.xp, self.kernels, self.gemms, self.graphs = xp, 0, 0, 0

    @property
    def total(self) -> int:
        return self.kernels + self.gemms + self.graphs

    def __enter__(self):
        self.xp = custom_kernels.runtime().xp if self.xp is None else self.xp
        self._saved = custom_kernels.launch, custom_kernels.launch_blocks, self.xp.matmul, graph_forward.replay

        def counted(fn, field):
            def wrapper(*args, **kwargs):
                setattr(self, field, getattr(self, field) + 1)
                return fn(*args, **kwargs)
            return wrapper

        custom_kernels.launch = counted(self._saved[0], "kernels")
        custom_kernels.launch_blocks = counted(self._saved[1], "kernels")
        self.xp.matmul = counted(self._saved[2], "gemms")
        graph_forward.replay = counted(self._saved[3], "graphs")
        return self

    def __exit__(self, *exc):
        custom_kernels.launch, custom_kernels.launch_blocks, self.xp.matmul, graph_forward.replay = self._saved


_CELL = "lstm_cell_embed"  # one launch per time step of layer 0; args ..., tt (5), ..., M (10), B (11)


class RowCounter(Launches):
    """Launches, plus the rows the forward computes, read from the layer-0 cell kernel's own
    arguments (M members x B rows at a sequence's first step): padded rows count, as the device
    computes them (`zosoma bench route`'s rows computed against rows needed)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __enter__(self):
        super().__enter__()
        counted = custom_kernels.launch

        def launch(name, work, *args, **kwargs):
            if name == _CELL and args[5] == 0:  # a sequence's first step: its rows, once
                self.rows += int(args[10]) * int(args[11])
            return counted(name, work, *args, **kwargs)

        custom_kernels.launch = launch
        return self


class _ShapesOnly:
    """NumPy, except that matmul only makes its result's shape (out, or an uninitialised array)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, out=None):
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return out if out is not None else np.empty(shape, np.result_type(a, b))


class _Replayed:
    """A graph on the recording runtime: its launches were recorded at capture; a replay is one."""

    def __init__(self, outputs):
        self.outputs = outputs

    def replay(self):
        pass


class RecordingRuntime:
    """custom_kernels' runtime without a device: NumPy arrays, every launch recorded (name, grid,
    block, shared bytes) and none run, GEMMs shaped and not computed. The launches of a step do not
    depend on the values computed, so this counts them at any size in no time (use it with
    custom_kernels.using). The limits are an H200's."""

    max_grid = (1 << 16, 65535)
    max_threads = 1024
    max_shared = 227 << 10

    def __init__(self):
        self.xp = _ShapesOnly()
        self.launched = []

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launched.append((name, grid, block, shared_mem))

    def gemm(self, a, b, out=None):
        return self.xp.matmul(a, b, out=out)

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    def capture(self, fn):
        return _Replayed(fn())
