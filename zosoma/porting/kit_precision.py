"""The porting kit's low-precision stages: the bf16, fp16 and int8 forwards, operation by operation.

The specification is zosoma.model.number_formats (PORTING.md, "Low-precision forwards", writes it out).
Each stage holds one chain of the forward in the format, with every intermediate, computed from
the kit's weights, bytes and carried state; a port checks each operation from the KIT's values of
what it consumes (step t's gates from the kit's h of step t-1, the cell from the kit's
activations, ...), so a one-ulp difference never carries into the next value, and a free-running
loss from zero state checks that the port chains the operations the same way. Edge vectors hit
every rounding and saturation point: ties, overflow, subnormals, the double rounding through fp32,
int8's tables, requantisation and the cell's half-to-even ties.

The float formats' reference accumulates each dot product exactly and rounds it to fp32 (what
an fp32 accumulator holds, up to its order of summation), so a port that sums in another order
is at most one value of the format away where that straddles a rounding point. int8 is integer
arithmetic and float64 rescales: a port that follows the specification matches it exactly.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.engines.emulated import precision_reference
from zosoma.model import number_formats
from zosoma.model.params import Layout
from zosoma.model.number_formats import Q_ACT, Q_CELL, Q_GATE, Q_H, SIGMOID_TABLE, TANH_TABLE, round_to, table_lookup
from zosoma.porting.stage import Out, Stage

B, T = 3, 12  # the op-by-op chain
LOSS_BATCH = (4, 25)  # the free-running loss's batch: B windows of T + 1 bytes


def _sigmoid(x):
    with np.errstate(over="ignore"):  # exp(inf) = inf: sigmoid(-inf) = 0
        return 1.0 / (1.0 + np.exp(-x))


def nll64(logits, targets) -> np.ndarray:
    """Per-byte nats in float64 of float logits (..., V)."""
    z = np.asarray(logits, np.float64)
    m = z.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
    return np.take_along_axis(lse - z, np.asarray(targets, np.intp)[..., None], axis=-1)[..., 0]


def _inputs(layout: Layout, rng) -> dict:
    cfg = layout.config
    L, H = cfg.layers, cfg.hidden
    return {"tokens": rng.integers(0, VOCAB, (B, T), dtype=np.uint8),
            "targets": rng.integers(0, VOCAB, (B, T), dtype=np.uint8),
            "h0": (0.5 * rng.standard_normal((L, B, H))).astype(np.float32),
            "c0": rng.standard_normal((L, B, H)).astype(np.float32),
            "batch": rng.integers(0, VOCAB, LOSS_BATCH, dtype=np.uint8)}


INPUTS = {
    "theta": "(d,) float32 the kit's weights (the forward stage's)",
    "tokens": "(B, T) uint8 input bytes of the op-by-op chain",
    "targets": "(B, T) uint8 the byte each position predicts (for nll)",
    "h0": "(L, B, H) float32 carried-in h, real values (put on the format's grid first)",
    "c0": "(L, B, H) float32 carried-in c, real values (put on the format's grid first)",
    "batch": "(B', T'+1) uint8 a batch for the free-running loss from zero state",
}


def _needs(layout: Layout) -> dict:
    """What each per-layer output is computed from: the kit's values of the previous operation."""
    L = layout.config.layers
    out = {}
    for layer in range(L):
        x = "tokens" if layer == 0 else f"hidden{layer - 1} (kit's, step t)"
        out[f"gates{layer}"] = ("theta", x, "h0 (on the grid, at t = 0)", f"hidden{layer} (kit's, step t-1)")
        out[f"activations{layer}"] = (f"gates{layer} (kit's)",)
        out[f"cells{layer}"] = (f"activations{layer} (kit's)", "c0 (on the grid, at t = 0)",
                                f"cells{layer} (kit's, step t-1)")
        out[f"hidden{layer}"] = (f"activations{layer} (kit's o)", f"cells{layer} (kit's, step t)")
    out["logits"] = ("theta", f"hidden{L - 1} (kit's)")
    return out


# --- bf16 and fp16 ---------------------------------------------------------------------------------

def _f32(x):
    """A float64 value as an fp32 register holds it (then back to float64)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def float_chain(theta, layout: Layout, tokens, fmt: str, h0, c0) -> dict:
    """Every value of the forward in bf16 or fp16 (float64 arrays of format values): the rounded
    weights, the state on the grid, per layer gates, activations (i, f, g, o), cells, hidden
    (batch first), and the logits."""
    R = lambda x: round_to(x, fmt).astype(np.float64)  # noqa: E731  via fp32, then the format
    weights = round_to(theta, fmt)
    p = layout.views(weights.astype(np.float64))
    H, L = layout.config.hidden, layout.config.layers
    out = {"weights": weights, "state_h": R(h0), "state_c": R(c0)}
    x = p["embed"][tokens]  # (B, T, E)
    Bn, Tn = tokens.shape
    for layer in range(L):
        h, c = out["state_h"][layer], out["state_c"][layer]
        keep = {k: np.empty((Bn, Tn, n)) for k, n in (("gates", 4 * H), ("activations", 4 * H), ("cells", H),
                                                       ("hidden", H))}
        for t in range(Tn):
            # each dot product exact (float64 holds these few exact products), then as fp32 holds it
            z = R(_f32(x[:, t] @ p[f"lstm{layer}.w_ih"]) + _f32(h @ p[f"lstm{layer}.w_hh"]) + p[f"lstm{layer}.bias"])
            a = np.concatenate([R(_sigmoid(z[:, :2 * H])), R(np.tanh(z[:, 2 * H:3 * H])), R(_sigmoid(z[:, 3 * H:]))],
                               axis=1)
            c = R(a[:, H:2 * H] * c + a[:, :H] * a[:, 2 * H:3 * H])
            h = R(a[:, 3 * H:] * R(np.tanh(c)))
            for k, v in zip(keep, (z, a, c, h)):
                keep[k][:, t] = v
        out.update({f"{k}{layer}": v for k, v in keep.items()})
        x = keep["hidden"]
    out["logits"] = R(_f32(x @ p["out.w"]) + p["out.b"])
    return out


def float_cell(gates, c, fmt: str) -> tuple:
    """(activations (n, 4), cell (n,), hidden (n,)) of one cell from format values: gates (n, 4)
    columns i, f, g, o and the carried c (n,); each from the previous one's values."""
    R = lambda x: round_to(x, fmt).astype(np.float64)  # noqa: E731
    g = np.asarray(gates, np.float64)
    a = np.stack([R(_sigmoid(g[:, 0])), R(_sigmoid(g[:, 1])), R(np.tanh(g[:, 2])), R(_sigmoid(g[:, 3]))], axis=1)
    cell = R(a[:, 1] * np.asarray(c, np.float64) + a[:, 0] * a[:, 2])
    return a, cell, R(a[:, 3] * R(np.tanh(cell)))


def _float_edges(fmt: str) -> dict:
    """Values at every rounding and saturation point of the format."""
    if fmt == "bf16":
        ulp1 = 2.0 ** -7
        values = [1 + ulp1 / 2, 1 + 3 * ulp1 / 2, 1 + ulp1 / 2 + 2.0 ** -23, -(1 + ulp1 / 2), -(1 + 3 * ulp1 / 2),
                  3.3961e38, 3.4028235e38, 1e-40, -1e-40, 2.0 ** -126, 0.0, -0.0, np.inf, -np.inf, 0.1, -7.3, 1234.5]
        wide = [1 + ulp1 / 2 + 2.0 ** -30, -(1 + ulp1 / 2 + 2.0 ** -30), 1 + 3 * ulp1 / 2 - 2.0 ** -30, 0.1, -2.5e-3]
    else:
        ulp1 = 2.0 ** -10
        values = [1 + ulp1 / 2, 1 + 3 * ulp1 / 2, 1 + ulp1 / 2 + 2.0 ** -20, -(1 + ulp1 / 2), 65504.0, 65519.0, 65520.0,
                  -65520.0, 1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 2.0 ** -14, 1e-8,
                  -3 * 2.0 ** -26, 0.0, -0.0, np.inf, -np.inf, 0.1, -7.3, 1234.5]
        wide = [1 + ulp1 / 2 + 2.0 ** -30, -(1 + ulp1 / 2 + 2.0 ** -30), 1 + 3 * ulp1 / 2 - 2.0 ** -30, 0.1, -2.5e-3]
    big = 1e4 if fmt == "fp16" else 1e30
    rng = np.random.default_rng(0xED6E)
    gates = np.concatenate([
        np.array([[0.0, 0.0, 0.0, 0.0], [np.inf, -np.inf, np.inf, -np.inf], [-np.inf, np.inf, -np.inf, np.inf],
                  [20.0, -20.0, 20.0, -20.0], [-20.0, 20.0, -20.0, 20.0], [big, -big, 1e-6, 2.0 ** -20],
                  [-8.0, 8.0, -0.5, 0.5], [1e-7, -1e-7, 3.0, -3.0]]),
        rng.standard_normal((8, 4)) * 3.0])
    c = np.concatenate([[0.0, 5.0, -5.0, 100.0, -100.0, 3e4, 1e-5, -2.0], rng.standard_normal(8) * 2.0])
    gates, c = round_to(gates, fmt), round_to(c, fmt)
    rows, cs = _double_rounding_cells(fmt, rng)
    return {"edge_values": np.concatenate([np.array(values, np.float32), NANS.view(np.float32)]),
            "edge_wide": np.array(wide, np.float64),
            "edge_gates": np.concatenate([gates, rows]), "edge_c": np.concatenate([c, cs])}


# NaNs as float32 bits: low payloads (the rounding's carry would make them inf, -inf or -0), signs,
# a signalling one, a payload the format keeps in part
NANS = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFA00000, 0x7FC12345], np.uint32)


def single_rounded_h(o, cell, fmt: str) -> np.ndarray:
    """A misreading: h = R(o tanh(c)), tanh(c) not rounded to the format before the product."""
    return round_to(np.asarray(o, np.float64) * np.tanh(np.asarray(cell, np.float64)), fmt).astype(np.float64)


def _double_rounding_cells(fmt: str, rng, n: int = 4) -> tuple:
    """(n, 4) gates and (n,) cells (format values) whose h = R(o R(tanh(c))) is not R(o tanh(c)):
    rows where rounding tanh(c) first moves h by a value of the format."""
    rows, cs = [], []
    while len(rows) < n:
        g, c = round_to(rng.standard_normal((1, 4)) * 2.0, fmt), round_to(rng.standard_normal(1), fmt)
        a, cell, h = float_cell(g, c, fmt)
        if h[0] != single_rounded_h(a[:, 3], cell, fmt)[0]:
            rows.append(g[0])
            cs.append(c[0])
    return np.array(rows), np.array(cs, np.float32)


def _toward_zero(x, fmt):
    """A misreading: rounding by truncation (toward zero)."""
    x = np.asarray(x, np.float32)
    if fmt == "bf16":
        return (np.ascontiguousarray(x).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    r = round_to(x, fmt)
    over = np.abs(r) > np.abs(x)  # rounded away: step back one value of the format toward zero
    down = r.astype(np.float16).view(np.uint16) - over.astype(np.uint16)
    with np.errstate(invalid="ignore"):
        return np.where(np.isinf(x), x, np.where(over, down.view(np.float16).astype(np.float32), r))


def float_stage(fmt: str, theta, layout: Layout, rng) -> Stage:
    inputs = _inputs(layout, rng)
    chain = float_chain(theta, layout, inputs["tokens"], fmt, inputs["h0"], inputs["c0"])
    L = layout.config.layers
    zeros = np.zeros((L, LOSS_BATCH[0], layout.config.hidden), np.float32)
    free = float_chain(theta, layout, inputs["batch"][:, :-1], fmt, zeros, zeros)
    loss = float(nll64(free["logits"], inputs["batch"][:, 1:]).mean())
    assert abs(loss - precision_reference.loss(theta, layout, inputs["batch"], fmt)) < 2e-5  # the spec reproduces the library
    edges = _float_edges(fmt)
    acts, cells, hidden = float_cell(edges["edge_gates"], edges["edge_c"], fmt)
    needs = _needs(layout)
    grid = "round h0 and c0 to the format (round-to-nearest-even via fp32)"
    outputs = {
        "weights": Out(chain["weights"], "format", ("theta",), f"every weight rounded to {fmt}: "
                       "round-to-nearest-even (ties to even), not truncation"),
        "state_h": Out(chain["state_h"], "format", ("h0",), grid),
        "state_c": Out(chain["state_c"], "format", ("c0",), grid),
    }
    for layer in range(L):
        outputs[f"gates{layer}"] = Out(
            chain[f"gates{layer}"], "format_ulp", needs[f"gates{layer}"],
            "z = R(x @ w_ih + h @ w_hh + bias) from the ROUNDED weights, x and h the kit's (teacher forcing); "
            "the sum rounded to fp32, then once to the format; matrices x @ W (w_ih is (E_in, 4H))", 1, fmt)
        outputs[f"activations{layer}"] = Out(
            chain[f"activations{layer}"], "format_ulp", needs[f"activations{layer}"],
            "sigmoid of blocks i, f, o and tanh of block g of the kit's gates, each rounded; order i, f, g, o", 1, fmt)
        outputs[f"cells{layer}"] = Out(
            chain[f"cells{layer}"], "format_ulp", needs[f"cells{layer}"],
            "c = R(f c_prev + i g) from the kit's activations and the kit's previous cell (c0 on the grid at t=0)",
            1, fmt)
        outputs[f"hidden{layer}"] = Out(
            chain[f"hidden{layer}"], "format_ulp", needs[f"hidden{layer}"],
            "h = R(o R(tanh(c))): tanh(c) is rounded before the product", 1, fmt)
    outputs["logits"] = Out(chain["logits"], "format_ulp", needs["logits"],
                            "logits = R(h @ out.w + out.b) from the rounded weights", 1, fmt)
    outputs["nll"] = Out(nll64(chain["logits"], inputs["targets"]), "nll", ("logits (kit's)", "targets"),
                         "log-softmax of the kit's logits in fp32 (not in the format)")
    outputs["loss"] = Out(np.float64(loss), "loss", ("theta", "batch"),
                          "your own free-running forward in the format from zero state: per-op outputs pass but "
                          "this fails when the operations are chained differently (state carried, layers)")
    outputs["edge_rounded"] = Out(round_to(edges["edge_values"], fmt), "format", ("edge_values",),
                                  "round-to-nearest-even with ties to even" + (
                                      ", subnormals kept (not flushed), overflow to +-inf past 65504"
                                      if fmt == "fp16" else ", fp32's exponent range (overflow to inf)")
                                  + f"; a NaN stays a NaN, bit for bit: (u | 0x00400000) & {NAN_MASK[fmt]} "
                                    "(quiet, sign kept, payload cut), not through the carry", 0, fmt)
    outputs["edge_wide_rounded"] = Out(round_to(edges["edge_wide"], fmt), "format", ("edge_wide",),
                                       "a float64 value is rounded to fp32 FIRST, then to the format "
                                       "(two roundings, as a wide accumulator written through fp32)")
    outputs["edge_activations"] = Out(acts, "format", ("edge_gates",),
                                      "sigmoid/tanh computed exactly (float64) and rounded; columns i, f, g, o; "
                                      "saturating inputs (+-inf) give 0, 1, -1", 0, fmt)
    outputs["edge_cells"] = Out(cells, "format", ("edge_activations (kit's)", "edge_c"),
                                "c = R(f c + i g): the products exact, the sum rounded to fp32, then R", 0, fmt)
    outputs["edge_hidden"] = Out(hidden, "format", ("edge_activations (kit's o)", "edge_cells (kit's)"),
                                 "h = R(o R(tanh(c))): tanh(c) is rounded to the format BEFORE the product", 0, fmt)
    misreadings = {
        "edge_rounded": [("truncation (rounding toward zero) instead of round-to-nearest-even",
                          _toward_zero(edges["edge_values"], fmt))],
        "edge_wide_rounded": [("rounded straight from float64 to the format, skipping fp32",
                               _direct(edges["edge_wide"], fmt))],
        "weights": [("truncation (rounding toward zero) instead of round-to-nearest-even",
                     _toward_zero(theta, fmt))],
        "edge_hidden": [("h = R(o tanh(c)): one rounding, tanh(c) not rounded first",
                         single_rounded_h(acts[:, 3], cells, fmt))],
    }
    misreadings["edge_rounded"].append(("a NaN rounded through the carry like a number (the NaN rule keeps it a "
                                        "NaN: quiet, sign kept, payload cut)", _nan_by_carry(edges["edge_values"], fmt)))
    if fmt == "fp16":
        flushed = np.where(np.abs(round_to(edges["edge_values"], fmt)) < 2.0 ** -14, 0.0,
                           round_to(edges["edge_values"], fmt)).astype(np.float32)
        misreadings["edge_rounded"].append(("subnormals flushed to zero (fp16 keeps them)", flushed))
    all_inputs = {**{k: (v, INPUTS[k]) for k, v in inputs.items()}, "theta": (theta, INPUTS["theta"]),
                  "edge_values": (edges["edge_values"], "(n,) float32 values to round"),
                  "edge_wide": (edges["edge_wide"], "(n,) float64 values to round (a wide accumulator's)"),
                  "edge_gates": (edges["edge_gates"], "(n, 4) format values: pre-activations i, f, g, o"),
                  "edge_c": (edges["edge_c"], "(n,) format values: the carried cell")}
    return Stage(fmt, f"the {fmt} forward op by op (teacher-forced from the kit's values), its rounding "
                      "edge cases and a free-running loss", all_inputs, outputs,
                 settings={"format": (fmt, "bf16: 8 significant bits, fp32's range; fp16: IEEE binary16")},
                 misreadings=misreadings)


NAN_MASK = {"bf16": "0xFFFF0000", "fp16": "0xFFFFE000"}


def _nan_by_carry(x, fmt):
    """A misreading: NaNs rounded by the numbers' rule, the carry included (low payloads become inf)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    shift = 16 if fmt == "bf16" else 13
    carried = ((u + (1 << (shift - 1)) - 1 + ((u >> shift) & 1)) & int(NAN_MASK[fmt], 16)).astype(np.uint32)
    return np.where(np.isnan(x), carried.view(np.float32), round_to(x, fmt))


def _direct(x, fmt):
    """A misreading: float64 rounded straight to the format."""
    x = np.asarray(x, np.float64)
    if fmt == "fp16":
        return x.astype(np.float16).astype(np.float32)
    m, e = np.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1: 8 significant bits, ties to even
    return np.ldexp(np.round(m * 256.0) / 256.0, e).astype(np.float32)


# --- int8 ----------------------------------------------------------------------------------------

def int8_scales(layout: Layout, w: dict) -> np.ndarray:
    """(entries,) float64 each layout tensor's scale: a weight's max|W| / 127, a bias's the scale of
    the accumulator it is added to (the input's scale times w_ih's; out.b: s_out / 127)."""
    out = []
    for e in layout.entries:
        if e.name in ("embed", "out.w"):
            out.append(w["s_embed" if e.name == "embed" else "s_out_w"])
        elif e.name == "out.b":
            out.append(w["s_out_w"] / Q_H)
        else:
            layer, kind = e.name[4:].split(".")
            s_x = w["s_embed"] if layer == "0" else 1.0 / Q_H
            out.append(s_x * w[f"s_w_ih{layer}"] if kind == "bias" else w[f"s_{kind}{layer}"])
    return np.array(out, np.float64)


def int8_chain(theta, layout: Layout, tokens, h0, c0) -> dict:
    """Every value of the int8 forward: scales and integers (int64 arrays), the logits float64."""
    w = number_formats.prepare(theta, layout, "int8")
    H, L = layout.config.hidden, layout.config.layers
    q = np.concatenate([w[_qname(e.name)].ravel() for e in layout.entries]).astype(np.int64)
    out = {"scales": int8_scales(layout, w), "quantized": q,
           "state_h": np.clip(np.rint(np.asarray(h0, np.float64) * Q_H), -127, 127).astype(np.int64),
           "state_c": np.clip(np.rint(np.asarray(c0, np.float64) * Q_CELL), -32768, 32767).astype(np.int64)}
    x, s_x = w["q_embed"][tokens], w["s_embed"]
    Bn, Tn = tokens.shape
    for layer in range(L):
        qh, qc = out["state_h"][layer].astype(np.float64), out["state_c"][layer].astype(np.float64)
        keep = {k: np.empty((Bn, Tn, n), np.int64) for k, n in (("gates", 4 * H), ("activations", 4 * H),
                                                                 ("cells", H), ("hidden", H))}
        for t in range(Tn):
            acc_x = x[:, t] @ w[f"q_w_ih{layer}"] + w[f"q_bias{layer}"]  # exact integers (float64 holds them)
            acc_h = qh @ w[f"q_w_hh{layer}"]
            z = acc_x * (s_x * w[f"s_w_ih{layer}"]) + acc_h * (w[f"s_w_hh{layer}"] / Q_H)
            qz = requantize(z)
            a = int8_activations(qz.reshape(Bn, 4, H).transpose(0, 2, 1).reshape(-1, 4))  # (B H, 4) i, f, g, o
            a = a.reshape(Bn, H, 4).transpose(0, 2, 1).reshape(Bn, 4 * H)  # back to blocks i, f, g, o
            qc = int8_cell(a[:, H:2 * H], a[:, :H], a[:, 2 * H:3 * H], qc).astype(np.float64)
            qh = int8_hidden(a[:, 3 * H:], qc).astype(np.float64)
            for k, v in zip(keep, (qz, a, qc, qh)):
                keep[k][:, t] = v
        out.update({f"{k}{layer}": v for k, v in keep.items()})
        x, s_x = keep["hidden"].astype(np.float64), 1.0 / Q_H
    out["logits"] = (x @ w["q_out_w"] + w["q_out_b"]) * (w["s_out_w"] / Q_H)
    return out


def _qname(name: str) -> str:
    """prepare()'s key of a layout tensor's integers: q_embed, q_w_ih0, q_bias0, ..., q_out_b."""
    if name in ("embed", "out.w", "out.b"):
        return "q_" + name.replace(".", "_")
    layer, kind = name[4:].split(".")
    return f"q_{kind}{layer}"


def requantize(z) -> np.ndarray:
    """Real pre-activations -> Q3.12 integers: round half to even, saturate to int16."""
    return np.clip(np.rint(np.asarray(z, np.float64) * Q_GATE), -32768, 32767).astype(np.int64)


def int8_activations(qz) -> np.ndarray:
    """(n, 4) Q3.12 gates, columns i, f, g, o -> Q0.15 activations (sigmoid, sigmoid, tanh, sigmoid)."""
    qz = np.asarray(qz, np.int64)
    return np.stack([table_lookup(qz[:, k], TANH_TABLE if k == 2 else SIGMOID_TABLE) for k in range(4)], axis=1)


def int8_cell(f, i, g, qc) -> np.ndarray:
    """Q4.11 cell from Q0.15 f, i, g and the Q4.11 cell before: round((16 f c + i g) / 2^19), half to
    even, saturated to int16 (exact in float64: every term is an integer times a power of two)."""
    f, i, g, qc = (np.asarray(v, np.float64) for v in (f, i, g, qc))
    return np.clip(np.rint(f * qc / Q_ACT + i * g / (Q_ACT * Q_ACT) * Q_CELL), -32768, 32767).astype(np.int64)


def int8_hidden(o, qc) -> np.ndarray:
    """int8 h from Q0.15 o and the Q4.11 cell: tanh through the table on clip(2 c) (Q3.12), then
    round(127 o tanh / 2^30), half to even, saturated to +-127."""
    t = table_lookup(np.clip(2 * np.asarray(qc, np.int64), -32768, 32767), TANH_TABLE)
    return np.clip(np.rint(np.asarray(o, np.float64) * t * Q_H / (Q_ACT * Q_ACT)), -127, 127).astype(np.int64)


def _half_up(x):
    return np.floor(np.asarray(x, np.float64) + 0.5)


def _int8_edges() -> dict:
    """Ties of every rounding (weights, requantisation, the cell, h), saturation of each integer."""
    tensor = np.array([127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.4999999, -127.0, 0.0, 64.5],
                      np.float32)
    z = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 4.5, 7.99987, 8.0, 9.0, -8.0, -8.5, 1e9, -1e9, 0.0],
                 np.float64) / np.array([Q_GATE] * 7 + [1, 1, 1, 1, 1, 1, 1, 1])
    rng = np.random.default_rng(0x1E8)
    rows, cs = [], []
    # cell ties: (16 f c + i g) = (2m + 1) 2^18 exactly; both parities of m, both signs
    while len(rows) < 6:
        qz = rng.integers(-20000, 20000, 4)
        i, f, g, _ = int8_activations(qz[None])[0]
        c = np.arange(-32768, 32768)
        num = 16 * f * c + i * g
        tie = c[(num % (1 << 19)) == (1 << 18)]
        if tie.size:
            want = len(rows) % 4  # m even/odd, c positive/negative
            pick = [k for k in tie if ((16 * f * k + i * g) >> 19) % 2 == want % 2 and (k > 0) == (want < 2)]
            if pick:
                rows.append(qz)
                cs.append(pick[len(pick) // 2])
    rows += [[0, 32767, 32767, 0], [32767, -32768, -32768, 32767], [-32768, 32767, 32767, -32768],
             [32767, 32767, 32767, 32767], [0, 0, 0, 0], [12345, -23456, 5000, -77]]
    cs += [-20000, 32767, -32768, 32767, 0, 1000]  # o = 0.5 with tanh = -1: h = -63.5, a tie; saturations
    return {"edge_tensor": tensor, "edge_z": z, "edge_gates": np.array(rows, np.int64),
            "edge_c": np.array(cs, np.int64)}


def int8_stage(theta, layout: Layout, rng) -> Stage:
    inputs = _inputs(layout, rng)
    chain = int8_chain(theta, layout, inputs["tokens"], inputs["h0"], inputs["c0"])
    state = [(inputs["h0"][layer], inputs["c0"][layer]) for layer in range(layout.config.layers)]
    check, _ = precision_reference.forward(theta, layout, inputs["tokens"], "int8", state)
    assert np.array_equal(check, chain["logits"].astype(np.float32))  # the spec reproduces the library bit for bit
    L = layout.config.layers
    zeros = np.zeros((L, LOSS_BATCH[0], layout.config.hidden), np.float32)
    free = int8_chain(theta, layout, inputs["batch"][:, :-1], zeros, zeros)
    loss = float(nll64(free["logits"].astype(np.float32), inputs["batch"][:, 1:]).mean())
    edges = _int8_edges()
    e_scale = number_formats.int8_scale(edges["edge_tensor"])
    e_acts = int8_activations(edges["edge_gates"])
    e_cells = int8_cell(e_acts[:, 1], e_acts[:, 0], e_acts[:, 2], edges["edge_c"])
    e_hidden = int8_hidden(e_acts[:, 3], e_cells)
    needs = _needs(layout)
    rint_hint = "every rounding is half to even (NumPy's rint), not half up or away from zero, nor truncation"
    outputs = {
        "scales": Out(chain["scales"], "scale", ("theta",),
                      "per tensor in layout order: max|W| / 127 (float64); a bias's entry is its accumulator's "
                      "scale s_x s_w_ih (layer 0: s_x = s_embed, above: 1/127), out.b's is s_out / 127"),
        "quantized": Out(chain["quantized"], "exact", ("theta", "scales (kit's)"),
                         "q = clip(rint(W / s), -127, 127); biases clip(rint(b / s_acc)) in int32; " + rint_hint),
        "sigmoid_table": Out(SIGMOID_TABLE, "exact", ("nothing: a constant",), "rint(32768 sigmoid(-8 + k / 16)), k = 0..256, "
                             "saturated to int16 (tanh(8) gives 32767)"),
        "tanh_table": Out(TANH_TABLE, "exact", ("nothing: a constant",), "rint(32768 tanh(-8 + k / 16)), k = 0..256, saturated to int16"),
        "state_h": Out(chain["state_h"], "exact", ("h0",), "q_h = clip(rint(127 h), -127, 127)"),
        "state_c": Out(chain["state_c"], "exact", ("c0",), "q_c = clip(rint(2048 c), -32768, 32767) (Q4.11)"),
    }
    for layer in range(L):
        outputs[f"gates{layer}"] = Out(
            chain[f"gates{layer}"], "int_lsb", needs[f"gates{layer}"],
            "acc = q_x @ q_w_ih + q_bias and q_h @ q_w_hh in integers, z = acc_x (s_x s_w_ih) + acc_h (s_w_hh / 127) "
            "in float64, then clip(rint(4096 z)) (Q3.12); x and h the kit's (teacher forcing)")
        outputs[f"activations{layer}"] = Out(
            chain[f"activations{layer}"], "exact", needs[f"activations{layer}"],
            "table lookup with interpolation: u = q + 32768, k = u >> 8, r = u & 255, "
            "T[k] + ((T[k+1] - T[k]) r + 128) >> 8 (floor); blocks i, f, g, o (tanh for g)")
        outputs[f"cells{layer}"] = Out(
            chain[f"cells{layer}"], "exact", needs[f"cells{layer}"],
            "c = clip(rint((16 f c_prev + i g) / 2^19)) with f, i, g the kit's Q0.15 activations; " + rint_hint)
        outputs[f"hidden{layer}"] = Out(
            chain[f"hidden{layer}"], "exact", needs[f"hidden{layer}"],
            "h = clip(rint(127 o T_tanh(clip(2 c)) / 2^30), -127, 127): tanh(c) through the table at Q3.12")
    outputs["logits"] = Out(chain["logits"].astype(np.float32), "dequant", needs["logits"],
                            "(q_h @ q_out_w + q_out_b) (s_out / 127), the bias at the accumulator's scale")
    outputs["nll"] = Out(nll64(chain["logits"].astype(np.float32), inputs["targets"]), "nll",
                         ("logits (kit's)", "targets"), "log-softmax of the kit's logits in fp32")
    outputs["loss"] = Out(np.float64(loss), "loss", ("theta", "batch"),
                          "your own free-running int8 forward from zero state: per-op outputs pass but this fails "
                          "when the operations are chained differently (state carried, layers)")
    outputs["edge_scale"] = Out(np.float64(e_scale), "scale", ("edge_tensor",), "max|W| / 127")
    outputs["edge_q"] = Out(number_formats.quantize_int8(edges["edge_tensor"], e_scale).astype(np.int64), "exact",
                            ("edge_tensor", "edge_scale (kit's)"), rint_hint)
    outputs["edge_qz"] = Out(requantize(edges["edge_z"]), "exact", ("edge_z",),
                             "clip(rint(4096 z), -32768, 32767): " + rint_hint)
    outputs["edge_activations"] = Out(e_acts, "exact", ("edge_gates",), outputs["activations0"].hint)
    outputs["edge_cells"] = Out(e_cells, "exact", ("edge_activations (kit's)", "edge_c"),
                                "c = clip(rint((16 f c + i g) / 2^19)): " + rint_hint)
    outputs["edge_hidden"] = Out(e_hidden, "exact", ("edge_activations (kit's o)", "edge_cells (kit's)"),
                                 "h = clip(rint(127 o T_tanh(clip(2 c)) / 2^30)): " + rint_hint)
    half_up_cells = np.clip(_half_up(e_acts[:, 1] * edges["edge_c"].astype(np.float64) / Q_ACT
                                     + e_acts[:, 0] * e_acts[:, 2].astype(np.float64) / (Q_ACT * Q_ACT) * Q_CELL),
                            -32768, 32767).astype(np.int64)
    away = lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5)  # noqa: E731
    misreadings = {
        "edge_q": [("round half up (floor(x + 0.5)) instead of half to even",
                    np.clip(_half_up(edges["edge_tensor"] / e_scale), -127, 127).astype(np.int64)),
                   ("round half away from zero instead of half to even",
                    np.clip(away(edges["edge_tensor"].astype(np.float64) / e_scale), -127, 127).astype(np.int64)),
                   ("truncation toward zero instead of rounding to nearest",
                    np.trunc(edges["edge_tensor"] / e_scale).astype(np.int64))],
        "edge_qz": [("round half up (floor(x + 0.5)) instead of half to even",
                     np.clip(_half_up(edges["edge_z"] * Q_GATE), -32768, 32767).astype(np.int64)),
                    ("round half away from zero instead of half to even",
                     np.clip(away(edges["edge_z"] * Q_GATE), -32768, 32767).astype(np.int64))],
        "edge_cells": [("round half up (floor(x + 0.5)) instead of half to even", half_up_cells)],
        "sigmoid_table": [("interpolation table sampled at k / 16 - 8 + 1/32 (bucket centres)",
                           np.clip(np.rint(_sigmoid(-8.0 + np.arange(257) / 16.0 + 1 / 32) * Q_ACT), -32768,
                                   32767).astype(np.int64))],
    }
    all_inputs = {**{k: (v, INPUTS[k]) for k, v in inputs.items()}, "theta": (theta, INPUTS["theta"]),
                  "edge_tensor": (edges["edge_tensor"], "(n,) float32 a tensor to quantise (its max is 127)"),
                  "edge_z": (edges["edge_z"], "(n,) float64 real pre-activations to requantise"),
                  "edge_gates": (edges["edge_gates"], "(n, 4) int Q3.12 pre-activations i, f, g, o"),
                  "edge_c": (edges["edge_c"], "(n,) int Q4.11 carried cell")}
    return Stage("int8", "the int8 forward op by op (teacher-forced from the kit's integers): scales, "
                         "quantised weights, tables, requantisation, cell, h; its edge cases and a free-running loss",
                 all_inputs, outputs, settings={"format": ("int8", "8x8_16-style integer LSTM, zosoma.model.number_formats")},
                 misreadings=misreadings)
