"""The emulated low-precision forward in plain NumPy: zosoma.model.number_formats' specification,
written for reading, the reference that the compiled version (precision_kernels) is checked
against. Shapes: B batch, T time, E embedding, H hidden, V = 256.
"""

from __future__ import annotations

import numpy as np

from zosoma.errors import ConfigError
from zosoma.model.number_formats import (INT16, Q_ACT, Q_CELL, Q_GATE, Q_H, SIGMOID_TABLE, TANH_TABLE,
                                         check_format, prepare, round_to, table_lookup, to_grid)
from zosoma.model.params import Layout
from zosoma.model.reference import sigmoid, zero_state


def _float_cell(z, c, fmt):
    """One step from rounded pre-activations z (B, 4H) and the cell c (B, H): activations in
    float64, each result rounded. Returns the new (h, c), format values."""
    H = c.shape[-1]
    z = z.astype(np.float64)
    i, f = round_to(sigmoid(z[:, :H]), fmt), round_to(sigmoid(z[:, H:2 * H]), fmt)
    g, o = round_to(np.tanh(z[:, 2 * H:3 * H]), fmt), round_to(sigmoid(z[:, 3 * H:]), fmt)
    c = round_to(f.astype(np.float64) * c + i.astype(np.float64) * g, fmt)
    return round_to(o * round_to(np.tanh(c.astype(np.float64)), fmt), fmt), c


def _int8_cell(z, c, H):
    """z (B, 4H) real pre-activations; c (B, H) real Q4.11 values. Returns real h, c."""
    qz = np.clip(np.rint(z * Q_GATE), *INT16).astype(np.int64)
    i = table_lookup(qz[:, :H], SIGMOID_TABLE)
    f = table_lookup(qz[:, H:2 * H], SIGMOID_TABLE)
    g = table_lookup(qz[:, 2 * H:3 * H], TANH_TABLE)
    o = table_lookup(qz[:, 3 * H:], SIGMOID_TABLE)
    qc = np.rint(c * Q_CELL)
    qc = np.clip(np.rint((f * qc / Q_ACT + i * g / (Q_ACT * Q_ACT) * Q_CELL)), *INT16)
    t = table_lookup(np.clip(2 * qc, *INT16).astype(np.int64), TANH_TABLE)
    qh = np.clip(np.rint(o * t * Q_H / (Q_ACT * Q_ACT)), -127, 127)
    return qh / Q_H, qc / Q_CELL


def forward(theta, layout: Layout, tokens, fmt: str, state=None, noise=None, outputs: list | None = None):
    """Logits (B, T, V) float32 of one model in format `fmt` and the final state (format values).
    tokens (B, T) uint8; state None (zeros) or one (h, c) pair of (B, H) per layer. noise (B, T, S)
    float32, if given: each row's, added to the gates' pre-activations (S columns layer * 4H ...)
    and, S > L 4H, the logits, in the accumulator before the format rounds (int8: requantises)
    them. outputs, if a list: each layer's outputs (B, T, H), real values, are appended to it."""
    check_format(fmt)
    if fmt == "fp32":
        raise ConfigError("fp32 is the ordinary forward (zosoma.model.reference, zosoma.engines.cpu.forward)")
    w = prepare(theta, layout, fmt)
    B, T = tokens.shape
    H, L = layout.config.hidden, layout.config.layers
    G = 4 * H
    noise = np.zeros((B, T, L * G), np.float32) if noise is None else np.asarray(noise, np.float32)
    state = to_grid(zero_state(layout, B) if state is None else state, fmt)
    tokens = np.asarray(tokens, np.intp)
    if fmt == "int8":
        x = w["q_embed"][tokens]  # (B, T, E) int8 values
        s_x = w["s_embed"]
    else:
        x = w["embed"][tokens]
    new_state = []
    for layer, (h, c) in enumerate(state):
        hs = np.empty((B, T, H), np.float64)
        for t in range(T):
            if fmt == "int8":
                acc_x = x[:, t] @ w[f"q_w_ih{layer}"] + w[f"q_bias{layer}"]  # exact integers
                acc_h = np.rint(h * Q_H) @ w[f"q_w_hh{layer}"]
                z = acc_x * (s_x * w[f"s_w_ih{layer}"]) + acc_h * (w[f"s_w_hh{layer}"] / Q_H)
                h, c = _int8_cell(z + noise[:, t, layer * G:(layer + 1) * G], c, H)
            else:
                z = (x[:, t].astype(np.float32) @ w[f"w_ih{layer}"]).astype(np.float64)
                z += (np.asarray(h, np.float32) @ w[f"w_hh{layer}"]).astype(np.float64)
                z = z + w[f"bias{layer}"] + noise[:, t, layer * G:(layer + 1) * G]
                h, c = _float_cell(round_to(z, fmt), c, fmt)
            hs[:, t] = h
        new_state.append((np.asarray(h, np.float32), np.asarray(c, np.float32)))
        if outputs is not None:
            outputs.append(hs.copy())
        x = np.rint(hs * Q_H) if fmt == "int8" else hs
        s_x = 1.0 / Q_H
    logit_noise = noise[..., L * G:] if noise.shape[-1] > L * G else 0.0
    if fmt == "int8":
        logits = (x @ w["q_out_w"] + w["q_out_b"]) * (w["s_out_w"] / Q_H) + logit_noise
    else:
        logits = round_to((x.astype(np.float32) @ w["out_w"]).astype(np.float64) + w["out_b"] + logit_noise, fmt)
    return np.asarray(logits, np.float32), new_state


def clean_inputs(theta, layout: Layout, batch, fmt: str, probs: bool = False):
    """(x0, hs, probs) of a clean forward in format `fmt` on the (B, T + 1) batch, from zero state:
    what the outer products of activity perturbation read (node_perturbation.clean_forward's),
    the values the device holds: x0 (B, T, E) the embedded bytes (int8: their int8 values times
    the scale), hs every layer's outputs (B, T, H), and with `probs` the fp32 softmax (B, T, V) of
    its logits (else None)."""
    w = prepare(theta, layout, fmt)
    tokens = np.asarray(batch, np.intp)[:, :-1]
    x0 = w["q_embed"][tokens] * w["s_embed"] if fmt == "int8" else w["embed"][tokens]
    hs = []
    logits, _ = forward(theta, layout, tokens, fmt, outputs=hs)
    if not probs:
        return x0, hs, None
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return x0, hs, e / e.sum(axis=-1, keepdims=True, dtype=np.float32)


def nll(logits, targets) -> np.ndarray:
    """Nats (...) float32 of each target byte from logits (..., V): log-softmax in fp32."""
    z = np.asarray(logits, np.float32)
    m = z.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True, dtype=np.float32))
    return np.take_along_axis(lse - z, np.asarray(targets, np.intp)[..., None], axis=-1)[..., 0]


def loss(theta, layout: Layout, batch, fmt: str) -> float:
    """Mean nats/byte of a (B, T+1) byte batch in format `fmt`, from zero state."""
    logits, _ = forward(theta, layout, batch[:, :-1], fmt)
    return float(nll(logits, batch[:, 1:]).mean(dtype=np.float64))
