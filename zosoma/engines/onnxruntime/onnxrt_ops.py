"""The ONNX Runtime engine: training with nothing but an inference runtime.

Every forward runs in ONNX Runtime on zosoma.formats.onnx's training graph, the standard LSTM
operator with the flat parameters as an input: for each member of a step's population the host
feeds theta +/- eps * delta_k (made from counters, ForwardOnlyOps) and the batch, and reads back
the per-byte losses, summed in float64 like the CPU engine's. The step's scalars and the update stay on
the host. The runtime never sees a gradient, an optimizer or a perturbation: only weights in,
losses out, which is all an inference-only accelerator offers. Evaluation (nll_stream) runs in
the runtime too, state carried; sampling (log_probs) stays on the host's CPU engine.

Activity perturbation (ForwardOnlyOps' hooks) runs zosoma.formats.onnx_activity's two graphs: the
members' forward with the step's noise as an input (noisy_nats: every row's every target's nats
back), and the clean forward's inputs of the outer products (clean_inputs); the noise is drawn,
and the credit, zeta, the outer products and the update are made, on the host.

One session per model shape, on the CPU execution provider. Intra-op threads: one for models
whose LSTM matrices hold under 256k entries (the tiny preset's per-member work is too small to
split: 1.3 ms per member on one thread against 2.7 on two, measured on the development machine),
else as many as BLAS uses (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else one per core), the same
resources as the CPU engine.
"""

from __future__ import annotations

import os

import numpy as np

from zosoma.engines.forward_only import ForwardOnlyOps
from zosoma.errors import ConfigError
from zosoma.model.params import Layout


def require_onnxruntime():
    """The onnxruntime module, or a one-line ConfigError saying how to install it."""
    try:
        import onnx  # noqa: F401  (the graph builder)
        import onnxruntime
    except ImportError:
        raise ConfigError("--engine onnxruntime needs the onnx and onnxruntime packages: "
                          "pip install 'zosoma[onnx]'") from None
    return onnxruntime


class OnnxRuntimeOps(ForwardOnlyOps):
    """Ops whose forwards run in ONNX Runtime (CPU execution provider)."""

    name = "onnxruntime"
    engine = "onnxruntime"

    def __init__(self):
        self.ort = require_onnxruntime()
        self._sessions: dict = {}

    @staticmethod
    def threads(layout: Layout) -> int:
        """Intra-op threads for this model shape (module docstring)."""
        cfg = layout.config
        if 4 * cfg.hidden * (cfg.embed + cfg.hidden) < 2**18:
            return 1
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            if os.environ.get(var, "").isdigit():
                return max(1, int(os.environ[var]))
        return os.cpu_count() or 1

    def session(self, layout: Layout, graph: tuple = ("training",)):
        """The InferenceSession of a graph for this model shape (built once): ("training",) the
        training graph (zosoma.formats.onnx); ("noisy", T, S), ("clean", T, probs) activity
        perturbation's (zosoma.formats.onnx_activity)."""
        key = (layout.config, graph)
        if key not in self._sessions:
            from zosoma.formats import onnx_activity
            from zosoma.formats.onnx import build_training_model

            build = {"training": build_training_model, "noisy": onnx_activity.build_noisy_model,
                     "clean": onnx_activity.build_clean_model}[graph[0]]
            options = self.ort.SessionOptions()
            options.intra_op_num_threads = self.threads(layout)
            options.inter_op_num_threads = 1
            options.execution_mode = self.ort.ExecutionMode.ORT_SEQUENTIAL
            model = build(layout, *graph[1:]).SerializeToString()
            self._sessions[key] = self.ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return self._sessions[key]

    def _run(self, theta, layout: Layout, tokens, targets, h0, c0, outputs):
        feeds = {"theta": np.ascontiguousarray(theta, np.float32), "tokens": tokens.astype(np.int64),
                 "targets": targets.astype(np.int64), "h0": h0, "c0": c0}
        return self.session(layout).run(outputs, feeds)

    def population_loss(self, thetas, layout: Layout, batch) -> np.ndarray:
        """(M,) float64 mean nats/byte of M models thetas (M, d) on one (B, T+1) batch or one per
        model (M, B, T+1), from zero state: one runtime call per model."""
        thetas = np.asarray(thetas, np.float32)
        if thetas.ndim != 2 or thetas.shape[1] != layout.size:
            raise ValueError(f"thetas must be (M, {layout.size}), got {thetas.shape}")
        batch = np.asarray(batch)
        batches = batch[None] if batch.ndim == 2 else batch
        if batches.dtype != np.uint8 or batches.ndim != 3 or batches.shape[0] not in (1, len(thetas)):
            raise ValueError(f"batch must be (B, T+1) or (M, B, T+1) uint8, got {batch.dtype} {batch.shape}")
        B = batches.shape[1]
        zeros = np.zeros((layout.config.layers, B, layout.config.hidden), np.float32)
        out = np.empty(len(thetas))
        for m, theta in enumerate(thetas):
            b = batches[m if len(batches) > 1 else 0]
            (nll,) = self._run(theta, layout, b[:, :-1], b[:, 1:], zeros, zeros, ["nll"])
            out[m] = nll.sum(dtype=np.float64) / nll.size
        return out

    def nll_stream(self, theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):  # every column
        """Nats (B, T) float32 of each target byte and the state after the last step, carried in
        from `state` (one (h, c) pair of (B, H) per layer; None: zeros)."""
        cfg = layout.config
        B = tokens.shape[0]
        if state is None:
            h0 = c0 = np.zeros((cfg.layers, B, cfg.hidden), np.float32)
        else:
            h0 = np.stack([np.asarray(h, np.float32) for h, _ in state])
            c0 = np.stack([np.asarray(c, np.float32) for _, c in state])
        nll, hT, cT = self._run(theta, layout, tokens, targets, h0, c0, ["nll", "hT", "cT"])
        return nll, [(hT[layer], cT[layer]) for layer in range(cfg.layers)]

    def noisy_nats(self, theta, layout: Layout, batch, scale: float, Z, index, sign) -> np.ndarray:
        batch = np.asarray(batch)
        B, T = batch.shape[0], batch.shape[1] - 1
        feeds = {"theta": np.ascontiguousarray(theta, np.float32), "tokens": batch[:, :-1].astype(np.int64),
                 "targets": batch[:, 1:].astype(np.int64), "Z": np.ascontiguousarray(Z, np.float32),
                 "index": np.asarray(index, np.int64), "sign": np.asarray(sign, np.float32) * np.float32(scale)}
        (nll,) = self.session(layout, ("noisy", T, np.shape(Z)[3])).run(["nll"], feeds)
        return nll.reshape(len(index), B, T).astype(np.float64)

    def clean_inputs(self, theta, layout: Layout, batch, probs: bool = False):
        batch = np.asarray(batch)
        feeds = {"theta": np.ascontiguousarray(theta, np.float32), "tokens": batch[:, :-1].astype(np.int64)}
        out = self.session(layout, ("clean", batch.shape[1] - 1, probs)).run(None, feeds)
        L = layout.config.layers
        return out[0], out[1:1 + L], out[1 + L] if probs else None
