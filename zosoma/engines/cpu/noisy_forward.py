"""The CPU forward of activity perturbation: 2P members x B rows, one set of weights, noisy pre-activations.

Checked against zosoma.model.node_perturbation (the reference: its layout of the noise, its
estimate). Shapes: K pairs, B batch, T time, E embedding, H hidden, G = 4H, L layers, V = 256,
S = L*G + V.

The members of activity perturbation share theta, so a step's 2K members are one forward over
R = 2K*B rows (row m*B + b: member m on batch row b): every GEMM is R rows tall, against a dense
population's K separate B-row forwards. Layer 0's input projection is the same for every member,
computed once for the B rows. Member m's noise is what the member table says, sign[m] * scale *
Z[index[m], b, t] (antithetic pairs share a noise with signs +/-, one-sided members have one each),
on each layer's gates before the cell and on the logits before the softmax; the cell and the softmax are the fast forward's vectorised ones (lstm_cell_rows,
output_rows: rational tanh, a polynomial exp).
"""

from __future__ import annotations

import numba
import numpy as np

from zosoma.config import VOCAB
from zosoma.engines.cpu import threads
from zosoma.engines.cpu.row_kernels import lstm_cell_rows, output_rows
from zosoma.model import noise
from zosoma.model.node_perturbation import width
from zosoma.model.params import Layout

_jit = numba.njit(cache=True, error_model="numpy", nogil=True)  # nogil: run on zosoma.engines.cpu.threads
_CHUNK = 8  # pairs per work item: 16 B rows per GEMM


@_jit
def _add_noise(rows, Z, t, lo, hi, scale, B, index, sign):
    """rows (R, hi - lo) += sign[m] * scale * Z[index[m], b, t, lo:hi] for row r = m B + b: member
    m's noise as the member table says (index into Z, sign +1 or -1)."""
    for r in range(rows.shape[0]):
        m, b = r // B, r % B
        y = rows[r]
        z = Z[index[m], b, t, lo:hi]
        s = sign[m] * scale
        for j in range(hi - lo):
            y[j] += s * z[j]


@_jit
def _position_nats(theta, offsets, E, H, L, tokens, targets, Z, scale, index, sign, nats_out):
    """nats_out[m, b, t] = nats of row b's target t under theta with its pre-activations
    + sign[m] * scale * Z[index[m], b] (S = L*G: no noise on the logits). offsets:
    embed, (w_ih, w_hh, bias) per layer, out.w, out.b; tokens, targets (B, T) uint8; Z (K, B, T, S)
    float32. The gate and softmax math is zosoma.engines.cpu.row_kernels' (lstm_cell_rows, output_rows)."""
    M, B, T, S = index.shape[0], Z.shape[1], Z.shape[2], Z.shape[3]
    G = 4 * H
    R = M * B
    embed = theta[offsets[0]:offsets[0] + VOCAB * E].reshape((VOCAB, E))
    x0 = np.empty((B * T, E), np.float32)
    for b in range(B):
        for t in range(T):
            x0[b * T + t] = embed[tokens[b, t]]
    hs = np.empty((T, R, H), np.float32)  # this layer's outputs, the next one's inputs
    xproj = np.empty((T * R, G), np.float32)
    zeros = np.zeros((R, H), np.float32)
    c = np.empty((R, H), np.float32)
    gates = np.empty((R, G), np.float32)
    rows = np.empty(R, np.int64)
    for layer in range(L):
        o = offsets[1 + 3 * layer]
        n_in = E if layer == 0 else H
        w_ih = theta[o:o + n_in * G].reshape((n_in, G))
        o = offsets[2 + 3 * layer]
        w_hh = theta[o:o + H * G].reshape((H, G))
        o = offsets[3 + 3 * layer]
        bias = theta[o:o + G]
        if layer == 0:  # the same for every member: B*T rows, gathered by lstm_cell_rows
            xsrc = np.dot(x0, w_ih)
        else:
            np.dot(hs.reshape((T * R, H)), w_ih, xproj)
            xsrc = xproj
        c[:] = 0.0
        for t in range(T):
            np.dot(zeros if t == 0 else hs[t - 1], w_hh, gates)
            _add_noise(gates, Z, t, layer * G, (layer + 1) * G, scale, B, index, sign)
            for r in range(R):
                rows[r] = (r % B) * T + t if layer == 0 else t * R + r
            lstm_cell_rows(gates, xsrc, rows, bias, c, hs[t])
    o = offsets[1 + 3 * L]
    out_w = theta[o:o + H * VOCAB].reshape((H, VOCAB))
    o = offsets[2 + 3 * L]
    out_b = theta[o:o + VOCAB]
    logits = np.empty((R, VOCAB), np.float32)
    row_targets = np.empty(R, np.uint8)
    nats = np.empty(R, np.float32)
    fold = np.empty(VOCAB // 2, np.float32)
    for t in range(T):
        np.dot(hs[t], out_w, logits)
        if S > L * G:
            _add_noise(logits, Z, t, L * G, S, scale, B, index, sign)
        for r in range(R):
            row_targets[r] = targets[r % B, t]
        output_rows(logits, out_b, row_targets, nats, False, fold)
        for r in range(R):
            nats_out[r // B, r % B, t] = nats[r]


@_jit
def _weighted_noise(w_gates, w_logits, Z, gates, zeta):
    """zeta[b, t, :gates] = sum_k w_gates[k, b, t] Z[k, b, t, :gates], and the logits' part with
    w_logits; accumulated in float64 (K, B, T weights; Z (K, B, T, S); zeta (B, T, S) float32)."""
    K, B, T, S = Z.shape
    acc = np.empty(S, np.float64)
    for b in range(B):
        for t in range(T):
            acc[:] = 0.0
            for k in range(K):
                z = Z[k, b, t]
                wg, wl = w_gates[k, b, t], w_logits[k, b, t]
                for j in range(gates):
                    acc[j] += wg * z[j]
                for j in range(gates, S):
                    acc[j] += wl * z[j]
            for j in range(S):
                zeta[b, t, j] = acc[j]


def weighted_noise(w_gates, w_logits, Z, gates: int) -> np.ndarray:
    """zeta (B, T, S) float32: each position's noise summed over the K pairs with its weights, the
    gates' (K, B, T, or broadcast to it) on the first `gates` of S, the logits' on the rest (the update's combination,
    zosoma.model.node_perturbation.combined and .causal)."""
    K, B, T, S = Z.shape
    zeta = np.empty((B, T, S), np.float32)
    w_gates, w_logits = (np.ascontiguousarray(np.broadcast_to(w, (K, B, T)), np.float64) for w in (w_gates, w_logits))
    _weighted_noise(w_gates, w_logits, np.ascontiguousarray(Z, np.float32), gates, zeta)
    return zeta


def offsets(layout: Layout) -> np.ndarray:
    """The tensors' offsets in theta, in layout order: embed, (w_ih, w_hh, bias) per layer, out.w, out.b."""
    return np.array([e.offset for e in layout.entries], np.int64)


def draw(layout: Layout, B: int, T: int, seed: int, expert: int, step: int, directions, kind: str,
         readout: str = "perturb", out: np.ndarray | None = None) -> np.ndarray:
    """(len(directions), B, T, S) float32: the directions' noise (zosoma.model.node_perturbation.member_noise)."""
    S = width(layout, readout)
    out = np.empty((len(directions), B, T, S), np.float32) if out is None else out
    for j, k in enumerate(directions):
        flat = out[j].reshape(-1)
        flat[:] = 0.0
        noise.add_noise(flat, flat, 1.0, seed, expert, step, k, kind)
    return out


def member_losses(theta, layout: Layout, batch, scale: float, Z, index, sign) -> np.ndarray:
    """(M, B, T) float64: the nats of every row's every target under member m, its pre-activations
    plus sign[m] * scale * Z[index[m]], on the step's (B, T + 1) batch. Z (J, B, T, S) float32 the
    noise drawn; index (M,) and sign (M,) the member table (M = 2K: pairs' members 2k and 2k + 1).
    Pairs run _CHUNK at a time on the member threads (one-thread BLAS): fixed chunks, so the
    numbers do not depend on the thread count."""
    cfg = layout.config
    batch = np.ascontiguousarray(batch, np.uint8)
    index, sign = np.ascontiguousarray(index, np.int64), np.ascontiguousarray(sign, np.float32)
    M, B = len(index), Z.shape[1]
    T = batch.shape[1] - 1
    theta, Z = np.ascontiguousarray(theta, np.float32), np.ascontiguousarray(Z, np.float32)
    tokens, targets = np.ascontiguousarray(batch[:, :-1]), np.ascontiguousarray(batch[:, 1:])
    nats = np.empty((M, B, T))
    chunks = [slice(m, min(M, m + 2 * _CHUNK)) for m in range(0, M, 2 * _CHUNK)]

    def work(item, _):
        at = chunks[item]
        _position_nats(theta, offsets(layout), cfg.embed, cfg.hidden, cfg.layers, tokens, targets, Z,
                       np.float32(scale), index[at], sign[at], nats[at])

    threads.run_items(work, len(chunks))
    return nats
