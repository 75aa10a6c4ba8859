"""The plain NumPy forward: the ground truth every fast path (Numba, CUDA) is checked against.

Written for reading, not speed. It follows the dtype of theta, so tests can run it in float64.
Shapes: B batch, T time, E embedding, H hidden, V = 256.
"""

from __future__ import annotations

import numpy as np

from zosoma.model.params import Layout


def sigmoid(x):
    with np.errstate(over="ignore"):  # exp(-x) is inf below x = -88 (float32): 1 / inf is the 0 wanted
        return 1.0 / (1.0 + np.exp(-x))


def lstm_cell(gates, c):
    """One LSTM step from pre-activations gates (..., 4H) in blocks i, f, g, o and the cell c
    (..., H): returns the new (h, c)."""
    H = c.shape[-1]
    i, f = sigmoid(gates[..., :H]), sigmoid(gates[..., H:2 * H])
    g, o = np.tanh(gates[..., 2 * H:3 * H]), sigmoid(gates[..., 3 * H:])
    c = f * c + i * g
    return o * np.tanh(c), c


def zero_state(layout: Layout, B: int, dtype=np.float32) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (h, c) pair of shape (B, H) per layer."""
    H = layout.config.hidden
    return [(np.zeros((B, H), dtype), np.zeros((B, H), dtype)) for _ in range(layout.config.layers)]


def forward(theta, layout: Layout, tokens, state=None):
    """Logits for every position. tokens (B, T) uint8; returns logits (B, T, V) and the final state
    (one (h, c) per layer), which a later call can continue from."""
    p = layout.views(theta)
    B, T = tokens.shape
    H = layout.config.hidden
    state = zero_state(layout, B, theta.dtype) if state is None else state
    x = p["embed"][tokens]  # (B, T, E)
    new_state = []
    for layer, (h, c) in enumerate(state):
        w_ih, w_hh, bias = (p[f"lstm{layer}.{n}"] for n in ("w_ih", "w_hh", "bias"))
        hs = np.empty((B, T, H), theta.dtype)
        for t in range(T):
            h, c = lstm_cell(x[:, t] @ w_ih + h @ w_hh + bias, c)  # gates (B, 4H)
            hs[:, t] = h
        new_state.append((h, c))
        x = hs
    return x @ p["out.w"] + p["out.b"], new_state


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def nll(logits, targets) -> np.ndarray:
    """Negative log-likelihood in nats of each target byte. logits (..., V), targets (...)."""
    logp = log_softmax(logits)
    return -np.take_along_axis(logp, targets[..., None].astype(np.intp), axis=-1)[..., 0]


def loss(theta, layout: Layout, batch, state=None) -> float:
    """Mean nats/byte of a (B, T+1) byte batch: inputs batch[:, :-1], targets batch[:, 1:]."""
    logits, _ = forward(theta, layout, batch[:, :-1], state)
    return float(nll(logits, batch[:, 1:]).mean(dtype=np.float64))
