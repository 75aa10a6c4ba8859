"""The kernels path's population forward captured once as a CUDA graph and replayed every step
(issue 47, 3b): for models whose member does not fit one block's shared memory (fused_forward.fits),
the ~2T + 5 launches of cuda_forward's forward (weight copies, the state zeroed, a GEMM and a cell
kernel per timestep, the logits, the log-softmax) become ONE graph launch.

A graph fixes its kernels' arguments, so it reads from buffers of its own that keep their address:
the population (M, d), which the perturb kernel fills before each replay (its step counter changes
every step, so it stays outside), and the batch (B, T+1), copied in. The graph writes the nll
(M, B, T), summed on the host. A step is then perturb + the graph + the update: 3 launches.

Graphs are kept per runtime, shape (layout, M, B, T) and GEMM format (cuBLAS's compute type is
captured with the GEMMs: zosoma.engines.cuda.tensor_cores); the first step of a shape captures it
(the runtime's `capture`: cupy stream capture on a GPU; on the emulated runtime of
tests/test_kernels.py, the launch list recorded and replayed, so a replayed step is checked
against an uncaptured one on the CPU).
"""

from __future__ import annotations

import weakref

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.engines.cuda import tensor_cores
from zosoma.engines.cuda.custom_kernels import runtime
from zosoma.model.params import Layout

_graphs = weakref.WeakKeyDictionary()  # runtime -> {(ModelConfig, M, B, T, GEMM format): _Captured}


class _Captured:
    """One shape's forward as a graph: its input buffers and the graph that reads them."""

    def __init__(self, layout: Layout, M: int, B: int, T: int, forward):
        rt = runtime()
        self.thetas = rt.xp.zeros((M, layout.size), np.float32)
        self.batch = rt.xp.zeros((B, T + 1), np.uint8)
        self.graph = rt.capture(lambda: forward(self.thetas, self.batch[None, :, :-1], self.batch[None, :, 1:]))


def replay(graph) -> None:
    """Launch a captured graph (zosoma.engines.cuda.launches counts these)."""
    graph.replay()


def captured(layout: Layout, M: int, B: int, T: int, forward) -> _Captured:
    """The graph of this shape on the active runtime, captured on first use; forward(thetas,
    tokens, targets) is the population forward to capture (cuda_forward's, handed in so that this
    module does not import it back)."""
    per_runtime = _graphs.setdefault(runtime(), {})
    key = (layout.config, M, B, T, tensor_cores.active())  # cuBLAS's compute type is captured too
    if key not in per_runtime:
        per_runtime[key] = _Captured(layout, M, B, T, forward)
    return per_runtime[key]


def chunk_losses(layout: Layout, batch, chunks: list[range], build, forward):
    """plus, minus losses of each chunk of pairs (cuda_forward.spsa_losses' chunks) on one (B, T+1)
    device batch: per chunk build(chunk, out) fills the graph's population with the chunk's
    members (the perturb kernel), the batch is copied in, the graph replays. Returns (plus,
    minus) over all chunks, float64 NumPy."""
    B, T = batch.shape[0], batch.shape[1] - 1
    out = []
    for chunk in chunks:
        step = captured(layout, 2 * len(chunk), B, T, forward)
        build(chunk, step.thetas)
        step.batch[...] = batch
        replay(step.graph)
        out.append(to_numpy(step.graph.outputs).sum(axis=(1, 2), dtype=np.float64) / (B * T))
    losses = np.concatenate(out)
    return losses[0::2], losses[1::2]
