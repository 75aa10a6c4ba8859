"""Approximate activations, as NPUs compute sigmoid and tanh: the specification, a float32 forward
with them, and an engine that trains and evaluates through it (for what they cost in training).

Two modes, each a sigmoid and tanh = 2 sigmoid(2x) - 1 (the identity, so one table serves both):

    plan   PLAN, the piecewise-linear sigmoid of Amin, Curtis & Hayes-Gill (IEE Proc. Circuits,
           Devices and Systems 144(6), 1997): on |x|, 1 from 5; 0.03125 |x| + 0.84375 from 2.375;
           0.125 |x| + 0.625 from 1; 0.25 |x| + 0.5 below; 1 - that for x < 0 (largest error 0.019)
    hard   ONNX's HardSigmoid at its defaults (alpha 0.2, beta 0.5; Keras' hard_sigmoid):
           clip(0.2 x + 0.5, 0, 1) (largest error 0.076)

Everything else is stage 1's float32 forward (PORTING.md). `ApproxOps` is zosoma's CPU engine with
this forward for the members' losses and for evaluation, so zosoma's own trainer runs the rest
of the step (studies/approx_activations.py).
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.ops import Ops
from zosoma.model.params import Layout

MODES = ("plan", "hard")
# PLAN's segments on |x|: (from, slope, offset), the last that applies wins
PLAN = ((0.0, 0.25, 0.5), (1.0, 0.125, 0.625), (2.375, 0.03125, 0.84375), (5.0, 0.0, 1.0))
BREAKPOINTS = {"plan": (1.0, 2.375, 5.0), "hard": (2.5,)}  # |x| where a segment starts (hard: saturates)


def sigmoid(x, mode: str) -> np.ndarray:
    """The mode's sigmoid of x, in x's float dtype (float32 arithmetic for float32 x)."""
    x = np.asarray(x)
    one, dtype = x.dtype.type(1), x.dtype
    if mode == "hard":
        return np.clip(dtype.type(0.2) * x + dtype.type(0.5), 0, one)
    a = np.minimum(np.abs(x), dtype.type(PLAN[-1][0]))  # flat from 5: no 0 x inf
    y = np.full_like(x, PLAN[0][2])
    for start, slope, offset in PLAN:
        y = np.where(a >= start, dtype.type(slope) * a + dtype.type(offset), y)
    return np.where(x < 0, one - y, y)


def tanh(x, mode: str) -> np.ndarray:
    """2 sigmoid(2x) - 1 with the mode's sigmoid."""
    x = np.asarray(x)
    two = x.dtype.type(2)
    return two * sigmoid(two * x, mode) - x.dtype.type(1)


def forward(theta, layout: Layout, tokens, mode: str, h0=None, c0=None) -> dict:
    """Stage 1's forward with the mode's activations, for M models at once: theta (M, d) or (d,),
    tokens (B, T) uint8 or (M, B, T). Returns "gates{l}", "cells{l}", "hidden{l}" (M, B, T, .),
    "logits" (M, B, T, V) and "hT", "cT" (M, L, B, H): float64 for float64 theta (the kit's
    reference), else float32 (a device's arithmetic)."""
    theta = np.atleast_2d(np.asarray(theta))
    dt = np.float64 if theta.dtype == np.float64 else np.float32
    theta = theta.astype(dt, copy=False)
    M, cfg = theta.shape[0], layout.config
    tokens = np.broadcast_to(np.asarray(tokens), (M,) + np.shape(tokens)[-2:])
    B, T, H = tokens.shape[1], tokens.shape[2], cfg.hidden
    views = [dict(layout.views(t)) for t in theta]
    stack = lambda name: np.stack([v[name] for v in views])  # noqa: E731  (M, ...) of one tensor
    x = np.take_along_axis(stack("embed"), tokens.reshape(M, -1, 1).astype(np.intp), axis=1).reshape(M, B, T, -1)
    zeros = np.zeros((M, cfg.layers, B, H), dt)
    h0 = zeros if h0 is None else np.broadcast_to(np.asarray(h0, dt), zeros.shape)
    c0 = zeros if c0 is None else np.broadcast_to(np.asarray(c0, dt), zeros.shape)
    out, hT, cT = {}, [], []
    for layer in range(cfg.layers):
        w_ih, w_hh, bias = (stack(f"lstm{layer}.{n}") for n in ("w_ih", "w_hh", "bias"))
        pre = x @ w_ih[:, None] + bias[:, None, None, :]  # (M, B, T, 4H): the input's part of every step at once
        h, c = h0[:, layer].copy(), c0[:, layer].copy()
        gates, cells, hidden = (np.empty((M, B, T, n), dt) for n in (4 * H, H, H))
        for t in range(T):
            z = pre[:, :, t] + h @ w_hh
            i, f, o = (sigmoid(z[..., k * H:(k + 1) * H], mode) for k in (0, 1, 3))
            c = f * c + i * tanh(z[..., 2 * H:3 * H], mode)
            h = o * tanh(c, mode)
            gates[:, :, t], cells[:, :, t], hidden[:, :, t] = z, c, h
        out.update({f"gates{layer}": gates, f"cells{layer}": cells, f"hidden{layer}": hidden})
        hT.append(h)
        cT.append(c)
        x = hidden
    out["logits"] = x @ stack("out.w")[:, None] + stack("out.b")[:, None, None, :]
    out["hT"], out["cT"] = np.stack(hT, axis=1), np.stack(cT, axis=1)
    return out


def nll(logits, targets) -> np.ndarray:
    """Per-byte nats (stage 2) of logits (..., V), in their precision (float32 or float64)."""
    z = np.asarray(logits)
    m = z.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
    return np.take_along_axis(lse - z, np.asarray(targets, np.intp)[..., None], axis=-1)[..., 0]


class ApproxOps(Ops):
    """zosoma's CPU engine with the mode's activations in every forward: the members' losses
    (materialised on the host, then one batched NumPy forward) and evaluation."""

    precision = "fp32"

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.name = mode, f"cpu-approx-{mode}"

    def population_loss(self, thetas, layout: Layout, batch) -> np.ndarray:
        batch = np.asarray(batch)
        logits = forward(thetas, layout, batch[..., :-1], self.mode)["logits"]
        return nll(logits, np.broadcast_to(batch[..., 1:], logits.shape[:-1])).mean(axis=(1, 2), dtype=np.float64)

    def nll_stream(self, theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):
        h0 = c0 = None
        if state is not None:
            h0, c0 = (np.stack([s[k] for s in state])[None] for k in (0, 1))
        out = forward(theta, layout, tokens, self.mode, h0, c0)
        return nll(out["logits"][0], targets), [(out["hT"][0, k], out["cT"][0, k]) for k in range(layout.config.layers)]

    def log_probs(self, theta, layout: Layout, tokens, state=None):
        raise NotImplementedError("approximate activations: losses and evaluation only")
