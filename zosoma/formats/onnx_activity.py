"""ONNX graphs of activity perturbation's two forwards, for an inference-only runtime
(zosoma.engines.onnxruntime; the rule: zosoma.model.node_perturbation).

The standard LSTM operator cannot add anything to its gates, so both graphs are zosoma.formats.onnx's
unrolled cell (MatMul, Add, Split, Sigmoid, Tanh, Mul; T fixed when the graph is built, B and the
members free) with the flat parameters theta (d,) float32 as an input, sliced in the graph as the
training graph does. Shape letters: J noises, M members, B batch, R = M B rows (row m B + b: member
m's copy of batch row b), T time, E embedding, H hidden, L layers, G = 4H, V = 256, S the noisy
pre-activations of one position (L G gates, then the V logits when they take noise).

"noisy": the members' forward, one model at theta over R rows.

    inputs   theta (d,); tokens, targets (B, T) int64; Z (J, B, T, S) float32 the step's noise;
             index (M,) int64, sign (M,) float32: member m's noise is sign[m] Z[index[m]] (sign: the
             member's sign times eps, a float32 product, as the CPU engine's)
    outputs  nll (R, T) float32: every row's every target's nats
    body     layer 0's input projection embed[tokens] @ w_ih + bias once for the B rows, tiled to the
             R rows; each layer's projection + its rows' noise on its G columns, then the T steps
             (gates = that + h @ w_hh: the noise is inside the pre-activation, before the cell);
             logits + the noise's last V columns (S > L G) before the log-softmax

"clean": what the outer products read from a clean forward (node_perturbation.clean_forward).

    inputs   theta (d,); tokens (B, T) int64
    outputs  x0 (B, T, E) the embedded bytes; h0 .. h{L-1} (B, T, H) every layer's outputs;
             with probs, probs (B, T, V) the softmax of the logits (the local readout's delta rule)
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.formats.onnx import Graph, require_onnx, target_nll, theta_view, unrolled_body
from zosoma.model.params import Layout


def _views(g: Graph, layout: Layout) -> dict[str, str]:
    """The unrolled body's weights (zosoma's orientation and gate order) sliced from theta."""
    w = {"embed": theta_view(g, layout, "embed"), "out_w": theta_view(g, layout, "out.w"),
         "out_b": theta_view(g, layout, "out.b")}
    for layer in range(layout.config.layers):
        for name in ("w_ih", "w_hh", "bias"):
            w[f"{name}{layer}"] = theta_view(g, layout, f"lstm{layer}.{name}")
    return w


def _zero_state(g: Graph, layout: Layout, rows: str) -> str:
    """(L, rows, H) float32 zeros: the initial state of every row (rows: a (1,) int64 value)."""
    cfg = layout.config
    shape = g.op("Concat", [g.const(np.array([cfg.layers])), rows, g.const(np.array([cfg.hidden]))], axis=0)
    return g.op("ConstantOfShape", [shape], value=g.onnx.numpy_helper.from_array(np.zeros(1, np.float32)))


def _first(g: Graph, value: str) -> str:
    """The first dimension of a value, as a (1,) int64 value."""
    return g.op("Slice", [g.op("Shape", [value]), g.const(np.array([0])), g.const(np.array([1]))])


def build_noisy_model(layout: Layout, T: int, S: int):
    """The members' forward with the noise as an input (module docstring)."""
    onnx = require_onnx()
    cfg = layout.config
    G, LG = 4 * cfg.hidden, 4 * cfg.hidden * cfg.layers
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    g = Graph()
    g.input("theta", f32, [layout.size])
    w = _views(g, layout)
    tokens = g.input("tokens", i64, ["B", T])
    targets = g.input("targets", i64, ["B", T])
    Z = g.input("Z", f32, ["J", "B", T, S])
    index = g.input("index", i64, ["M"])
    sign = g.input("sign", f32, ["M"])
    member = g.op("Gather", [Z, index], axis=0)  # (M, B, T, S)
    noise = g.op("Reshape", [g.op("Mul", [member, g.op("Reshape", [sign, g.const(np.array([-1, 1, 1, 1]))])]),
                             g.const(np.array([-1, T, S]))])  # (R, T, S)
    members = _first(g, index)

    def columns(lo, hi):
        return g.op("Slice", [noise, g.const(np.array([lo])), g.const(np.array([hi])), g.const(np.array([2]))])

    def project(layer, xw):
        if layer == 0:  # the same for every member: computed for the B rows, then tiled
            xw = g.op("Tile", [xw, g.op("Concat", [members, g.const(np.array([1, 1]))], axis=0)])
        return g.op("Add", [xw, columns(layer * G, (layer + 1) * G)])

    zeros = _zero_state(g, layout, _first(g, noise))
    logits, _, _ = unrolled_body(g, layout, w, tokens, zeros, zeros, T, project)
    if S > LG:
        logits = g.op("Add", [logits, columns(LG, S)])
    rows = g.op("Tile", [targets, g.op("Concat", [members, g.const(np.array([1]))], axis=0)])
    g.output(target_nll(g, logits, rows), "nll", f32, ["R", T])
    return g.model("zosoma_activity_noisy", f"zosoma activity perturbation's members E={cfg.embed} H={cfg.hidden} "
                                            f"L={cfg.layers} T={T} S={S}: theta and noise in, every row's nats out")


def build_clean_model(layout: Layout, T: int, probs: bool):
    """The clean forward's inputs of the outer products (module docstring)."""
    onnx = require_onnx()
    cfg = layout.config
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    g = Graph()
    g.input("theta", f32, [layout.size])
    w = _views(g, layout)
    tokens = g.input("tokens", i64, ["B", T])
    zeros = _zero_state(g, layout, _first(g, tokens))
    outputs = []
    logits, _, _ = unrolled_body(g, layout, w, tokens, zeros, zeros, T, outputs=outputs)
    g.output(g.op("Gather", [w["embed"], tokens], axis=0), "x0", f32, ["B", T, cfg.embed])
    for layer, hs in enumerate(outputs):
        g.output(hs, f"h{layer}", f32, ["B", T, cfg.hidden])
    if probs:
        g.output(g.op("Softmax", [logits], axis=-1), "probs", f32, ["B", T, VOCAB])
    return g.model("zosoma_activity_clean", f"zosoma activity perturbation's clean forward E={cfg.embed} "
                                            f"H={cfg.hidden} L={cfg.layers} T={T}: theta in, the outer products' "
                                            "inputs out")
