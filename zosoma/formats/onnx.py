"""ONNX graphs of a zosoma model, built with the `onnx` package (no torch).

Two forms of the same forward (zosoma.model.reference), opset 17, float32. Shape letters: B batch,
T time, E embedding, H hidden, L layers, V = 256, d parameters.

"lstm": the standard ONNX `LSTM` operator, one node per layer; B and T are free dimensions.

    inputs   tokens (B, T) int64 bytes; h0, c0 (L, B, H) float32 state carried in (zeros to start)
    outputs  logits (B, T, V) float32; hT, cT (L, B, H) the state after the last step, to feed back
             as h0, c0 for the next piece of a long text
    body     x = Gather(embed, tokens) -> Transpose to (T, B, E) (layout 0, the operator's default)
             per layer l: Y, Y_h, Y_c = LSTM(x, W_l, R_l, B_l, initial_h=h0[l], initial_c=c0[l]);
                          x = Squeeze(Y, axis 1)            (T, B, H)
             logits = Transpose(x) to (B, T, H) @ out.w + out.b

    The operator's weights differ from zosoma's in two ways (ONNX operator docs, LSTM):
    - gate order: ONNX stacks i, o, f, c where zosoma (and torch) stack i, f, g, o (c = g), so the
      column blocks of zosoma's w_ih, w_hh and bias are taken in the order 0, 3, 1, 2 (ONNX_GATES);
    - orientation: W_l = w_ih^T (1, 4H, E_in), R_l = w_hh^T (1, 4H, H), "x @ W^T" as torch;
      B_l = [Wb, Rb] (1, 8H): zosoma's one bias as Wb and zeros as Rb (the operator adds both).
    Its activations are the defaults (Sigmoid, Tanh, Tanh), no clip, no peepholes, forward only.

"unrolled": the same cell written as MatMul, Add, Split, Sigmoid, Tanh, Mul, for runtimes without
an LSTM operator. T is fixed when the graph is built (the time loop is unrolled); B is free. The
weights keep zosoma's orientation and gate order (gates = x @ w_ih + h @ w_hh + bias, blocks
i, f, g, o). Inputs and outputs as above.

Weights are initializers for an export; for training on an inference-only runtime
(zosoma.engines.onnxruntime) the "lstm" graph instead takes the flat parameter vector as an
input:

    training graph: inputs theta (d,) float32 (zosoma.model.params' layout), tokens and targets
    (B, T) int64, h0, c0; outputs nll (B, T) nats of each target byte, loss (mean nats/byte,
    a scalar), hT, cT. The graph slices theta and makes W, R, B itself, so a host feeds perturbed
    parameter vectors as they are and reads back only losses.

Activity perturbation's two graphs (the unrolled form, theta and the noise as inputs) are
zosoma.formats.onnx_activity's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path
from zosoma.config import VOCAB
from zosoma.errors import ConfigError, ZosomaError
from zosoma.model.params import Layout

OPSET = 17
ONNX_GATES = (0, 3, 1, 2)  # ONNX gate block k (i, o, f, c) is zosoma's block ONNX_GATES[k] (i, f, g, o)
FORMS = ("lstm", "unrolled")


def require_onnx():
    """The onnx module, or a one-line ZosomaError saying how to install it."""
    try:
        import onnx
    except ImportError:
        raise ZosomaError("ONNX export needs the onnx package: pip install 'zosoma[onnx]'") from None
    return onnx


def gate_rows(H: int, order=ONNX_GATES) -> np.ndarray:
    """(4H,) int64 zosoma gate columns in the order of the ONNX operator's gate rows."""
    return np.concatenate([np.arange(k * H, (k + 1) * H) for k in order]).astype(np.int64)


def onnx_weights(theta: np.ndarray, layout: Layout, order=ONNX_GATES) -> dict[str, np.ndarray]:
    """The LSTM operator's tensors from theta (d,): embed (V, E); W{l} (1, 4H, E_in), R{l} (1, 4H, H),
    B{l} (1, 8H) per layer; out_w (H, V); out_b (V,). All float32."""
    p = layout.views(np.asarray(theta, np.float32))
    rows = gate_rows(layout.config.hidden, order)
    out = {"embed": p["embed"], "out_w": p["out.w"], "out_b": p["out.b"]}
    for layer in range(layout.config.layers):
        bias = p[f"lstm{layer}.bias"][rows]
        out[f"W{layer}"] = p[f"lstm{layer}.w_ih"].T[rows][None]
        out[f"R{layer}"] = p[f"lstm{layer}.w_hh"].T[rows][None]
        out[f"B{layer}"] = np.concatenate([bias, np.zeros_like(bias)])[None]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


class Graph:
    """Nodes, initializers, inputs and outputs of one graph, with unique value names."""

    def __init__(self):
        self.onnx = require_onnx()
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, hint: str = "c") -> str:
        name = self.name(hint)
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, value: np.ndarray) -> str:
        self.inits.append(self.onnx.numpy_helper.from_array(np.ascontiguousarray(value, np.float32), name))
        return name

    def op(self, op_type: str, inputs, n_out: int = 1, hint: str | None = None, **attrs):
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), outs, name=self.name("n"), **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, elem, shape) -> str:
        self.inputs.append(self.onnx.helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value: str, name: str, elem, shape) -> None:
        self.nodes.append(self.onnx.helper.make_node("Identity", [value], [name], name=self.name("n")))
        self.outputs.append(self.onnx.helper.make_tensor_value_info(name, elem, shape))

    def model(self, graph_name: str, doc: str):
        h = self.onnx.helper
        graph = h.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.inits, doc_string=doc)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="zosoma",
                             doc_string=doc)
        model.ir_version = 8  # the IR of opset 17: runtimes of that generation accept it
        return model


def theta_view(g: Graph, layout: Layout, name: str) -> str:
    """The graph value of tensor `name` (its shape, zosoma's orientation), sliced from the graph
    input theta (d,)."""
    e = layout[name]
    flat = g.op("Slice", ["theta", g.const(np.array([e.offset])), g.const(np.array([e.offset + e.size]))])
    return g.op("Reshape", [flat, g.const(np.array(e.shape, np.int64))], hint=name.replace(".", "_"))


def _theta_weights(g: Graph, layout: Layout, order) -> dict[str, str]:
    """Graph values of onnx_weights' tensors, sliced from the graph input theta (d,)."""
    H = layout.config.hidden
    rows = g.const(gate_rows(H, order), "gate_rows")

    def view(name):
        return theta_view(g, layout, name)

    def operator_matrix(name):  # (E_in, 4H) -> (1, 4H, E_in) in the operator's gate order
        return g.op("Unsqueeze", [g.op("Gather", [g.op("Transpose", [view(name)], perm=[1, 0]), rows], axis=0),
                                  g.const(np.array([0]))])

    out = {"embed": view("embed"), "out_w": view("out.w"), "out_b": view("out.b")}
    zeros = g.const(np.zeros(4 * H, np.float32), "zero_bias")
    for layer in range(layout.config.layers):
        out[f"W{layer}"] = operator_matrix(f"lstm{layer}.w_ih")
        out[f"R{layer}"] = operator_matrix(f"lstm{layer}.w_hh")
        bias = g.op("Gather", [view(f"lstm{layer}.bias"), rows], axis=0)
        out[f"B{layer}"] = g.op("Unsqueeze", [g.op("Concat", [bias, zeros], axis=0), g.const(np.array([0]))])
    return out


def _lstm_body(g: Graph, layout: Layout, w: dict[str, str], tokens: str, h0: str, c0: str):
    """logits (B, T, V), hT, cT (L, B, H) values of the LSTM-operator form."""
    H, L = layout.config.hidden, layout.config.layers
    x = g.op("Transpose", [g.op("Gather", [w["embed"], tokens], axis=0)], perm=[1, 0, 2])  # (T, B, E)
    hs, cs = [], []
    for layer in range(L):
        at = [g.const(np.array([layer])), g.const(np.array([layer + 1]))]
        h_l, c_l = g.op("Slice", [h0] + at), g.op("Slice", [c0] + at)  # (1, B, H)
        y, y_h, y_c = g.op("LSTM", [x, w[f"W{layer}"], w[f"R{layer}"], w[f"B{layer}"], "", h_l, c_l], n_out=3,
                           hidden_size=H, direction="forward")
        x = g.op("Squeeze", [y, g.const(np.array([1]))])  # (T, B, H)
        hs.append(y_h)
        cs.append(y_c)
    logits = g.op("Add", [g.op("MatMul", [g.op("Transpose", [x], perm=[1, 0, 2]), w["out_w"]]), w["out_b"]])
    state = [g.op("Concat", v, axis=0) if L > 1 else g.op("Identity", v) for v in (hs, cs)]
    return logits, state[0], state[1]


def unrolled_body(g: Graph, layout: Layout, w: dict[str, str], tokens: str, h0: str, c0: str, T: int,
                  project=None, outputs: list | None = None):
    """logits, hT, cT of the unrolled form: T steps of MatMul/Add/Split/Sigmoid/Tanh/Mul.
    project(layer, xw), if given, returns the value that replaces a layer's input projection xw
    (B, T, 4H) before the steps (activity perturbation adds its noise there: zosoma.formats.
    onnx_activity); outputs, if a list, receives each layer's outputs (B, T, H)."""
    H, L = layout.config.hidden, layout.config.layers
    x = g.op("Gather", [w["embed"], tokens], axis=0)  # (B, T, E)
    hs, cs = [], []
    four = g.const(np.array([H, H, H, H]), "gate_sizes")
    for layer in range(L):
        at = [g.const(np.array([layer])), g.const(np.array([layer + 1])), g.const(np.array([0]))]
        h = g.op("Squeeze", [g.op("Slice", [h0] + at), g.const(np.array([0]))])  # (B, H)
        c = g.op("Squeeze", [g.op("Slice", [c0] + at), g.const(np.array([0]))])
        # the input projection of all T steps at once, then one (B, 4H) slice per step
        xw = g.op("Add", [g.op("MatMul", [x, w[f"w_ih{layer}"]]), w[f"bias{layer}"]])  # (B, T, 4H)
        if project is not None:
            xw = project(layer, xw)
        steps = g.op("Split", [xw], n_out=T, axis=1) if T > 1 else [xw]
        outs = []
        for t in range(T):
            gates = g.op("Add", [g.op("Squeeze", [steps[t], g.const(np.array([1]))]),
                                 g.op("MatMul", [h, w[f"w_hh{layer}"]])], hint=f"gates{layer}_t{t}")
            i, f, gg, o = g.op("Split", [gates, four], n_out=4, axis=1)
            i, f, o, gg = g.op("Sigmoid", [i]), g.op("Sigmoid", [f]), g.op("Sigmoid", [o]), g.op("Tanh", [gg])
            c = g.op("Add", [g.op("Mul", [f, c]), g.op("Mul", [i, gg])], hint=f"c{layer}_t{t}")
            h = g.op("Mul", [o, g.op("Tanh", [c])], hint=f"h{layer}_t{t}")
            outs.append(g.op("Unsqueeze", [h, g.const(np.array([1]))]))
        x = g.op("Concat", outs, axis=1) if T > 1 else outs[0]  # (B, T, H)
        if outputs is not None:
            outputs.append(x)
        hs.append(g.op("Unsqueeze", [h, g.const(np.array([0]))]))
        cs.append(g.op("Unsqueeze", [c, g.const(np.array([0]))]))
    logits = g.op("Add", [g.op("MatMul", [x, w["out_w"]]), w["out_b"]])
    state = [g.op("Concat", v, axis=0) if L > 1 else g.op("Identity", v) for v in (hs, cs)]
    return logits, state[0], state[1]


def build_model(theta: np.ndarray, layout: Layout, form: str = "lstm", seq_len: int | None = None,
                order=ONNX_GATES):
    """The onnx.ModelProto of one model with its weights as initializers. form "lstm" (the
    operator; `order` is the gate order it is given, only tests change it) or "unrolled"
    (seq_len = T, the steps unrolled)."""
    onnx = require_onnx()
    if form not in FORMS:
        raise ConfigError(f"ONNX form must be one of {', '.join(FORMS)}, got {form!r}")
    theta = np.asarray(theta, np.float32)
    if theta.shape != (layout.size,):
        raise ConfigError(f"theta has shape {theta.shape}, the model needs ({layout.size},)")
    cfg = layout.config
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    g = Graph()
    T = "T"
    if form == "unrolled":
        if seq_len is None or seq_len < 1:
            raise ConfigError(f"an unrolled graph needs seq_len >= 1 steps, got {seq_len}")
        T = int(seq_len)
        p = layout.views(theta)
        w = {"embed": g.weight("embed", p["embed"]), "out_w": g.weight("out_w", p["out.w"]),
             "out_b": g.weight("out_b", p["out.b"])}
        for layer in range(cfg.layers):
            for name in ("w_ih", "w_hh", "bias"):
                w[f"{name}{layer}"] = g.weight(f"{name}{layer}", p[f"lstm{layer}.{name}"])
    else:
        w = {k: g.weight(k, v) for k, v in onnx_weights(theta, layout, order).items()}
    tokens = g.input("tokens", i64, ["B", T])
    h0 = g.input("h0", f32, [cfg.layers, "B", cfg.hidden])
    c0 = g.input("c0", f32, [cfg.layers, "B", cfg.hidden])
    if form == "unrolled":
        logits, hT, cT = unrolled_body(g, layout, w, tokens, h0, c0, T)
    else:
        logits, hT, cT = _lstm_body(g, layout, w, tokens, h0, c0)
    g.output(logits, "logits", f32, ["B", T, VOCAB])
    g.output(hT, "hT", f32, [cfg.layers, "B", cfg.hidden])
    g.output(cT, "cT", f32, [cfg.layers, "B", cfg.hidden])
    doc = (f"zosoma byte-level LSTM E={cfg.embed} H={cfg.hidden} L={cfg.layers} V={VOCAB}, form {form}; "
           "inputs tokens (B, T) int64, h0/c0 (L, B, H); outputs logits (B, T, 256), hT/cT (L, B, H)")
    return g.model(f"zosoma_{form}", doc)


def build_training_model(layout: Layout, order=ONNX_GATES):
    """The LSTM-operator graph with the flat parameters as an input (module docstring)."""
    onnx = require_onnx()
    cfg = layout.config
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    g = Graph()
    g.input("theta", f32, [layout.size])
    w = _theta_weights(g, layout, order)
    tokens = g.input("tokens", i64, ["B", "T"])
    targets = g.input("targets", i64, ["B", "T"])
    h0 = g.input("h0", f32, [cfg.layers, "B", cfg.hidden])
    c0 = g.input("c0", f32, [cfg.layers, "B", cfg.hidden])
    logits, hT, cT = _lstm_body(g, layout, w, tokens, h0, c0)
    nll = target_nll(g, logits, targets)
    g.output(nll, "nll", f32, ["B", "T"])
    g.output(g.op("ReduceMean", [nll], keepdims=0), "loss", f32, [])
    g.output(hT, "hT", f32, [cfg.layers, "B", cfg.hidden])
    g.output(cT, "cT", f32, [cfg.layers, "B", cfg.hidden])
    return g.model("zosoma_training", f"zosoma training graph E={cfg.embed} H={cfg.hidden} L={cfg.layers}: "
                                      "theta (d,) in, per-byte nats and mean loss out")


def target_nll(g: Graph, logits: str, targets: str) -> str:
    """(B, T) nats of each target byte: -LogSoftmax(logits (B, T, V))[targets (B, T) int64]."""
    logp = g.op("LogSoftmax", [logits], axis=-1)
    picked = g.op("GatherElements", [logp, g.op("Unsqueeze", [targets, g.const(np.array([-1]))])], axis=2)
    return g.op("Neg", [g.op("Squeeze", [picked, g.const(np.array([-1]))])])


def save_model(model, path) -> None:
    """Write an onnx.ModelProto atomically (zosoma.atomic)."""
    with atomic_path(Path(path), "ONNX model") as tmp:
        tmp.write_bytes(model.SerializeToString())


def export_onnx(theta: np.ndarray, layout: Layout, path, form: str = "lstm", seq_len: int | None = None) -> None:
    """Write one model as an ONNX file (build_model), checked by onnx.checker before writing."""
    model = build_model(theta, layout, form, seq_len)
    require_onnx().checker.check_model(model, full_check=True)
    save_model(model, path)
