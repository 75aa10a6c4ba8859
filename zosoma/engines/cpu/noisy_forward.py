"""The CPU forward of activity perturbation: 2P members x B rows, one set of weights, noisy pre-activations.

Checked against zosoma.model.node_perturbation (the reference: its layout of the noise, its
estimate). Shapes: K pairs, B batch, T time, E embedding, H hidden, G = 4H, L layers, V = 256,
S = L*G + V.

The members of activity perturbation share theta, so a step's 2K members are one forward over
R = 2K*B rows (row (2i + s)*B + b: pair i's member s, s = 0 plus, 1 minus, on batch row b): every
GEMM is R rows tall, against a dense population's K separate B-row forwards. Layer 0's input
projection is the same for every member, computed once for the B rows. The noise enters as
+/- scale * Z[i, b, t] on each layer's gates before the cell and on the logits before the
softmax. The gate and softmax math is libm's (math.exp, math.tanh), as the reference's.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from zosoma.config import VOCAB
from zosoma.model import noise
from zosoma.model.node_perturbation import width
from zosoma.model.params import Layout

_jit = numba.njit(cache=True, error_model="numpy", nogil=True)


@_jit
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@_jit
def _position_nats(theta, offsets, E, H, L, tokens, targets, Z, scale, plus, minus):
    """plus[i, b, t], minus[i, b, t] = nats of row b's target t under theta with its pre-activations
    +scale*Z[i, b] and -scale*Z[i, b] (S = L*G: no noise on the logits). offsets: embed, (w_ih, w_hh, bias) per layer, out.w, out.b;
    tokens, targets (B, T) uint8; Z (K, B, T, S) float32."""
    K, B, T, S = Z.shape
    G = 4 * H
    R = 2 * K * B
    embed = theta[offsets[0]:offsets[0] + VOCAB * E].reshape((VOCAB, E))
    x0 = np.empty((B * T, E), np.float32)
    for b in range(B):
        for t in range(T):
            x0[b * T + t] = embed[tokens[b, t]]
    hs = np.empty((T, R, H), np.float32)  # this layer's outputs, the next one's inputs
    xproj = np.empty((T, R, G), np.float32)
    h = np.empty((R, H), np.float32)
    c = np.empty((R, H), np.float32)
    gates = np.empty((R, G), np.float32)
    for layer in range(L):
        o = offsets[1 + 3 * layer]
        w_ih = theta[o:o + (E if layer == 0 else H) * G].reshape((E if layer == 0 else H, G))
        o = offsets[2 + 3 * layer]
        w_hh = theta[o:o + H * G].reshape((H, G))
        o = offsets[3 + 3 * layer]
        bias = theta[o:o + G]
        if layer == 0:  # the same for every member: B*T rows, broadcast
            p0 = np.dot(x0, w_ih)
            for r in range(R):
                b = r % B
                for t in range(T):
                    xproj[t, r] = p0[b * T + t]
        else:
            np.dot(hs.reshape((T * R, H)), w_ih, xproj.reshape((T * R, G)))
        h[:] = 0.0
        c[:] = 0.0
        for t in range(T):
            np.dot(h, w_hh, gates)
            for r in range(R):
                i, s, b = r // (2 * B), (r // B) % 2, r % B
                sign = scale if s == 0 else -scale
                z = Z[i, b, t, layer * G:(layer + 1) * G]
                a = gates[r]
                xp = xproj[t, r]
                for j in range(G):
                    a[j] += xp[j] + bias[j] + sign * z[j]
                for j in range(H):
                    cn = _sigmoid(a[H + j]) * c[r, j] + _sigmoid(a[j]) * math.tanh(a[2 * H + j])
                    c[r, j] = cn
                    h[r, j] = _sigmoid(a[3 * H + j]) * math.tanh(cn)
            hs[t] = h
    o = offsets[1 + 3 * L]
    out_w = theta[o:o + H * VOCAB].reshape((H, VOCAB))
    o = offsets[2 + 3 * L]
    out_b = theta[o:o + VOCAB]
    logits = np.empty((R, VOCAB), np.float32)
    noisy_logits = S > L * G
    for t in range(T):
        np.dot(hs[t], out_w, logits)
        for r in range(R):
            i, s, b = r // (2 * B), (r // B) % 2, r % B
            sign = scale if s == 0 else -scale
            y = logits[r]
            m = -np.inf
            for v in range(VOCAB):
                y[v] += out_b[v]
                if noisy_logits:
                    y[v] += sign * Z[i, b, t, L * G + v]
                m = max(m, y[v])
            total = 0.0
            for v in range(VOCAB):
                total += math.exp(y[v] - m)
            nats = m + math.log(total) - y[targets[b, t]]
            if s == 0:
                plus[i, b, t] = nats
            else:
                minus[i, b, t] = nats


def offsets(layout: Layout) -> np.ndarray:
    """The tensors' offsets in theta, in layout order: embed, (w_ih, w_hh, bias) per layer, out.w, out.b."""
    return np.array([e.offset for e in layout.entries], np.int64)


def draw(layout: Layout, B: int, T: int, seed: int, expert: int, step: int, members: range, kind: str,
         readout: str = "perturb", out: np.ndarray | None = None) -> np.ndarray:
    """(len(members), B, T, S) float32: the members' noise (zosoma.model.node_perturbation.member_noise)."""
    S = width(layout, readout)
    out = np.empty((len(members), B, T, S), np.float32) if out is None else out
    for j, k in enumerate(members):
        flat = out[j].reshape(-1)
        flat[:] = 0.0
        noise.add_noise(flat, flat, 1.0, seed, expert, step, k, kind)
    return out


def position_losses(theta, layout: Layout, batch, scale: float, Z) -> tuple[np.ndarray, np.ndarray]:
    """(plus, minus), each (K, B, T) float64: the nats of every row's every target with its
    pre-activations plus and minus scale * Z[k] (K, B, T, S) float32, on the step's (B, T + 1) batch."""
    cfg = layout.config
    batch = np.ascontiguousarray(batch, np.uint8)
    K, B = Z.shape[:2]
    T = batch.shape[1] - 1
    plus, minus = np.empty((K, B, T)), np.empty((K, B, T))
    _position_nats(np.ascontiguousarray(theta, np.float32), offsets(layout), cfg.embed, cfg.hidden, cfg.layers,
              np.ascontiguousarray(batch[:, :-1]), np.ascontiguousarray(batch[:, 1:]),
              np.ascontiguousarray(Z, np.float32), np.float32(scale), plus, minus)
    return plus, minus


def row_losses(theta, layout: Layout, batch, scale: float, Z) -> tuple[np.ndarray, np.ndarray]:
    """(plus, minus), each (K, B) float64: every row's mean nats/byte (position_losses' mean)."""
    plus, minus = position_losses(theta, layout, batch, scale, Z)
    return plus.mean(axis=-1), minus.mean(axis=-1)
