"""The low-precision forwards of zosoma.model.number_formats, compiled with Numba.

Same specification, same arithmetic as the NumPy version (precision_reference), organised like
zosoma.engines.cpu.forward: members spread over threads (zosoma.engines.cpu.threads), each one's weights
prepared once (rounded, or quantised to int8 with their scales), the time loop compiled, layer 0's
input projection a table (embed @ w_ih: exact for int8, whose products are integers; float
formats as one fp32 GEMM), then the log-softmax and NLL of zosoma.engines.cpu.forward (fp32). Integer
arithmetic is carried in float64, where every sum of int8 products is exact.

Activations are table lookups, exact by construction: a bf16 or fp16 input is one of 65,536
values, so each format has a table of its rounded sigmoid and tanh indexed by the input's bit
pattern; int8's interpolated tables are expanded to all 65,536 Q3.12 inputs.

No fastmath here: rounding, saturation and overflow to infinity must happen exactly as specified.
Shapes: M members, B batch, T time, E embedding, H hidden, L layers, V = 256.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from zosoma.config import VOCAB
from zosoma.engines.cpu import threads
from zosoma.engines.cpu.row_kernels import output_rows
from zosoma.model.number_formats import (FP16_MAX, FP16_MIN_NORMAL, Q_ACT, Q_CELL, Q_GATE, Q_H, SIGMOID_TABLE,
                                         TANH_TABLE, check_format, table_lookup, to_grid)
from zosoma.model.params import Layout
from zosoma.model.reference import zero_state

_JIT = dict(cache=True, error_model="numpy")
BF16, FP16, INT8 = 1, 2, 3
CODES = {"bf16": BF16, "fp16": FP16, "int8": INT8}
# int8's interpolated table activations at every Q3.12 input, -32768..32767 (index q + 32768):
# a lookup instead of the interpolation, the same integers
_Q_INPUTS = np.arange(-32768, 32768)
_SIG = table_lookup(_Q_INPUTS, SIGMOID_TABLE).astype(np.float32)
_TANH = table_lookup(_Q_INPUTS, TANH_TABLE).astype(np.float32)


@njit(**_JIT)
def round_array(a, code):
    """Round the float32 values of a (contiguous, any shape) to bf16 or fp16 in place."""
    flat = a.reshape(a.size)
    u = flat.view(np.uint32)
    if code == BF16:
        for k in range(flat.size):
            v = np.uint64(u[k])
            if (v & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):  # NaN: quiet, payload cut (the carry would not)
                u[k] = np.uint32((v | np.uint64(0x400000)) & np.uint64(0xFFFF0000))
            else:
                u[k] = np.uint32((v + np.uint64(0x7FFF) + ((v >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000))
        return
    for k in range(flat.size):  # written as selects, so that the loop vectorizes
        x = flat[k]
        v = np.uint64(u[k])
        normal = np.uint32((v + np.uint64(0xFFF) + ((v >> np.uint64(13)) & np.uint64(1))) & np.uint64(0xFFFFE000))
        sub = np.rint(x * np.float32(16777216.0)) * np.float32(1.0 / 16777216.0)  # exact: powers of 2
        # a NaN stays one: quiet, payload cut (the carry would make one with a low payload inf)
        u[k] = np.uint32((v | np.uint64(0x400000)) & np.uint64(0xFFFFE000)) if x != x else normal
        r = flat[k]
        r = sub if abs(x) < FP16_MIN_NORMAL else r
        flat[k] = np.float32(np.copysign(np.inf, x)) if abs(r) > FP16_MAX else r


@njit(**_JIT)
def _lut(q, table):
    """The table activation (_SIG, _TANH) of one Q3.12 integer q (float64): a Q0.15 integer."""
    return np.float64(table[int(q) + 32768])


@njit(**_JIT)
def _clip(x, lo, hi):
    return min(max(x, lo), hi)


@njit(**_JIT)
def _sigmoid64(x):
    return 1.0 / (1.0 + math.exp(-x))


@njit(**_JIT)
def _activation_tables(values, code):
    """(sigmoid, tanh) of every value of a 16-bit format, as the format's values (float32): the
    activation in float64, rounded to fp32, then to the format, as the specification says."""
    sig = np.empty(values.size, np.float32)
    tanh = np.empty(values.size, np.float32)
    for k in range(values.size):
        sig[k] = np.float32(_sigmoid64(np.float64(values[k])))
        tanh[k] = np.float32(math.tanh(np.float64(values[k])))
    round_array(sig, code)
    round_array(tanh, code)
    return sig, tanh


def _format_values(code: int) -> np.ndarray:
    """(65536,) float32: the value of each bit pattern of bf16 or fp16."""
    patterns = np.arange(65536, dtype=np.uint32)
    if code == BF16:
        return (patterns << 16).view(np.float32)
    return patterns.astype(np.uint16).view(np.float16).astype(np.float32)


_TABLES: dict = {}
_QUIET = (np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32))  # no noise
_CHUNK = 16  # members per work item of noisy_nats: fixed, so the numbers do not depend on the threads


def activation_tables(code: int) -> tuple[np.ndarray, np.ndarray]:
    """The format's (sigmoid, tanh) tables indexed by bit pattern (`_pattern`). A bf16 or fp16
    input has 65,536 possible values, so a lookup gives exactly what the activation would."""
    if code not in _TABLES:
        _TABLES[code] = _activation_tables(_format_values(code), code)
    return _TABLES[code]


@njit(**_JIT)
def _pattern(x, u, code):
    """The bf16 or fp16 bit pattern of a float32 value x (bits u) that the format holds."""
    if code == BF16:
        return u >> np.uint32(16)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf, or a NaN (any NaN pattern: the table holds NaN)
        return sign | np.uint32(0x7C00) | (np.uint32(0x200) if a > np.uint32(0x7F800000) else np.uint32(0))
    if a >= np.uint32(0x38800000):  # normal: rebias the exponent (127 -> 15), keep 10 fraction bits
        return sign | ((a - np.uint32(0x38000000)) >> np.uint32(13))
    return sign | np.uint32(abs(x) * 16777216.0)  # zero or subnormal: k x 2^-24


@njit(**_JIT)
def _layer(w, offsets, layer, H, table, xs):
    """Layer `layer`'s w_hh (H, 4H) and bias (4H,), views of the prepared weights w, and its input
    projection: layer 0's byte table, else the layer below's outputs xs (T, B, H) @ w_ih."""
    G = 4 * H
    T, B = xs.shape[0], xs.shape[1]
    o = offsets[3 * layer + 2]
    w_hh = w[o:o + H * G].reshape((H, G))
    o = offsets[3 * layer + 3]
    bias = w[o:o + G]
    xproj = table
    if layer > 0:
        o = offsets[3 * layer + 1]
        xproj = np.dot(xs.reshape((T * B, H)), w[o:o + H * G].reshape((H, G)))
    return w_hh, bias, xproj


@njit(**_JIT)
def _float_member(w, offsets, E, H, L, code, sig, tanh, tokens, targets, h, c, nll_out, Z, index, sign):
    """One model in bf16/fp16. w (d,) float32 already rounded; sig, tanh the format's activation
    tables; h, c (L, B, H) float32 format values, updated in place; writes nll_out (B, T).
    Returns the float64 sum of the nlls. With noise (Z (J, B0, T, S), index and sign (B / B0,):
    _noise), row b's pre-activations take member b // B0's in the accumulator, before rounding."""
    B, T = tokens.shape
    G = 4 * H
    o = offsets[0]
    embed = w[o:o + VOCAB * E].reshape((VOCAB, E))
    o = offsets[1]
    table = np.dot(embed, w[o:o + E * G].reshape((E, G)))  # (V, 4H): x @ w_ih of every byte
    gates = np.empty((B, G), np.float32)
    z = np.empty((B, G), np.float32)
    zu = z.reshape(B * G).view(np.uint32)
    act = np.empty((B, G), np.float32)
    xs = np.empty((T, B, H), np.float32)  # a layer's outputs, the next layer's inputs
    for layer in range(L):
        w_hh, bias, xproj = _layer(w, offsets, layer, H, table, xs)
        cu = c[layer].reshape(B * H).view(np.uint32)
        for t in range(T):
            np.dot(h[layer], w_hh, gates)
            for b in range(B):
                row = tokens[b, t] if layer == 0 else t * B + b
                if Z.shape[0] == 0:
                    for j in range(G):
                        z[b, j] = np.float32(np.float64(xproj[row, j]) + np.float64(gates[b, j])
                                             + np.float64(bias[j]))
                else:
                    zb, zs = _noise(Z, index, sign, b, t)
                    for j in range(G):
                        z[b, j] = np.float32(np.float64(xproj[row, j]) + np.float64(gates[b, j])
                                             + np.float64(bias[j]) + np.float64(zs * zb[layer * G + j]))
            round_array(z, code)
            for b in range(B):
                for j in range(2 * H):  # i, f
                    act[b, j] = sig[_pattern(z[b, j], zu[b * G + j], code)]
                for j in range(2 * H, 3 * H):  # g
                    act[b, j] = tanh[_pattern(z[b, j], zu[b * G + j], code)]
                for j in range(3 * H, G):  # o
                    act[b, j] = sig[_pattern(z[b, j], zu[b * G + j], code)]
            for b in range(B):
                for j in range(H):
                    c[layer, b, j] = np.float32(np.float64(act[b, H + j]) * c[layer, b, j]
                                                + np.float64(act[b, j]) * act[b, 2 * H + j])
            round_array(c[layer], code)
            for b in range(B):
                for j in range(H):
                    h[layer, b, j] = act[b, 3 * H + j] * tanh[_pattern(c[layer, b, j], cu[b * H + j], code)]
            round_array(h[layer], code)
            xs[t] = h[layer]
    o = offsets[3 * L + 1]
    logits = np.dot(xs.reshape((T * B, H)), w[o:o + H * VOCAB].reshape((H, VOCAB)))  # row t*B + b
    o = offsets[3 * L + 2]
    logit_noise = Z.shape[0] > 0 and Z.shape[3] > L * G
    for r in range(T * B):
        if logit_noise:
            zb, zs = _noise(Z, index, sign, r % B, r // B)
            for v in range(VOCAB):
                logits[r, v] = np.float32(np.float64(logits[r, v]) + np.float64(w[o + v])
                                          + np.float64(zs * zb[L * G + v]))
        else:
            for v in range(VOCAB):
                logits[r, v] = np.float32(np.float64(logits[r, v]) + np.float64(w[o + v]))
    round_array(logits, code)
    return _scores(logits, tokens, targets, nll_out)


@njit(**_JIT)
def _noise(Z, index, sign, b, t):
    """Row b's noise at position t: member m = b // B0's Z[index[m], b mod B0, t] (S,) and its
    sign[m] (already times the scale); the row adds sign[m] * Z[...][s] to pre-activation s, a
    float32 product, as the CPU engine's."""
    B0 = Z.shape[1]
    m = b // B0
    return Z[index[m], b % B0, t], sign[m]


@njit(**_JIT)
def _scores(logits, tokens, targets, nll_out):
    """fp32 log-softmax + NLL of rows t*B + b (bias already added): sum of nlls; nll_out (B, T)."""
    B, T = tokens.shape
    row_targets = np.empty(T * B, np.uint8)
    for t in range(T):
        for b in range(B):
            row_targets[t * B + b] = targets[b, t]
    row_nll = np.empty(T * B, np.float32)
    total = output_rows(logits, np.zeros(VOCAB, np.float32), row_targets, row_nll, False,
                        np.empty(VOCAB // 2, np.float32))
    for t in range(T):
        for b in range(B):
            nll_out[b, t] = row_nll[t * B + b]
    return total


@njit(**_JIT)
def _is_bias(e, L):
    """Whether layout entry e (embed, (w_ih, w_hh, bias) per layer, out.w, out.b) is a bias."""
    return e == 3 * L + 2 or (0 < e <= 3 * L and e % 3 == 0)


@njit(**_JIT)
def _int8_prepare(theta, offsets, sizes, L):
    """(q (d,) float64 integer values, scales per layout entry): weights symmetric int8, biases
    int32 at their accumulator's scale (the input's scale times the weight's)."""
    q = np.empty(theta.size, np.float64)
    scales = np.ones(offsets.size, np.float64)
    for e in range(offsets.size):
        if _is_bias(e, L):
            continue
        o, n = offsets[e], sizes[e]
        m = 0.0
        for k in range(n):
            m = max(m, abs(np.float64(theta[o + k])))
        scales[e] = m / 127.0 if m > 0 else 1.0
        for k in range(n):
            q[o + k] = _clip(np.rint(np.float64(theta[o + k]) / scales[e]), -127.0, 127.0)
    for layer in range(L):
        s_x = scales[0] if layer == 0 else 1.0 / Q_H
        scales[3 * layer + 3] = s_x * scales[3 * layer + 1]
    scales[3 * L + 2] = scales[3 * L + 1] / Q_H
    for e in range(offsets.size):
        if _is_bias(e, L):
            o, n = offsets[e], sizes[e]
            for k in range(n):
                q[o + k] = _clip(np.rint(np.float64(theta[o + k]) / scales[e]), -2.0 ** 31, 2.0 ** 31 - 1)
    return q, scales


@njit(**_JIT)
def _int8_member(theta, offsets, sizes, E, H, L, tokens, targets, h, c, nll_out, Z, index, sign):
    """One model in int8 (zosoma.model.number_formats). theta (d,) float32 master weights; h, c
    (L, B, H) float64 real values on the int8 / Q4.11 grids, updated in place; writes nll_out.
    With noise (as _float_member's), row b's real pre-activations take it before they are
    requantised to Q3.12, its logits before the fp32 log-softmax."""
    B, T = tokens.shape
    G = 4 * H
    q, s = _int8_prepare(theta, offsets, sizes, L)
    o = offsets[0]
    embed = q[o:o + VOCAB * E].reshape((VOCAB, E))
    o = offsets[1]
    table = np.dot(embed, q[o:o + E * G].reshape((E, G)))  # exact integer sums
    qh = np.empty((B, H), np.float64)
    qz = np.empty(4, np.float64)
    xs = np.empty((T, B, H), np.float64)  # int8 h values of a layer, the next layer's inputs
    for layer in range(L):
        w_hh, q_b, xproj = _layer(q, offsets, layer, H, table, xs)
        sx_sw = s[3 * layer + 3]  # the input's scale times w_ih's, the bias's scale
        sh_sw = s[3 * layer + 2] / Q_H
        for t in range(T):
            for b in range(B):
                for j in range(H):
                    qh[b, j] = np.rint(h[layer, b, j] * Q_H)
            acc_h = np.dot(qh, w_hh)
            for b in range(B):
                row = tokens[b, t] if layer == 0 else t * B + b
                if Z.shape[0] > 0:
                    zb, zs = _noise(Z, index, sign, b, t)
                for j in range(H):
                    for k in range(4):
                        jj = k * H + j
                        zr = (xproj[row, jj] + q_b[jj]) * sx_sw + acc_h[b, jj] * sh_sw
                        if Z.shape[0] > 0:
                            zr += np.float64(zs * zb[layer * G + jj])
                        qz[k] = _clip(np.rint(zr * Q_GATE), -32768.0, 32767.0)
                    i = _lut(qz[0], _SIG)
                    f = _lut(qz[1], _SIG)
                    g = _lut(qz[2], _TANH)
                    og = _lut(qz[3], _SIG)
                    qc = np.rint(c[layer, b, j] * Q_CELL)
                    qc = _clip(np.rint(f * qc / Q_ACT + i * g / (Q_ACT * Q_ACT) * Q_CELL), -32768.0, 32767.0)
                    tq = _lut(_clip(2.0 * qc, -32768.0, 32767.0), _TANH)
                    qhn = _clip(np.rint(og * tq * Q_H / (Q_ACT * Q_ACT)), -127.0, 127.0)
                    c[layer, b, j] = qc / Q_CELL
                    h[layer, b, j] = qhn / Q_H
                    xs[t, b, j] = qhn
    o = offsets[3 * L + 1]
    acc = np.dot(xs.reshape((T * B, H)), q[o:o + H * VOCAB].reshape((H, VOCAB)))
    o = offsets[3 * L + 2]
    scale = s[3 * L + 2]
    logits = np.empty((T * B, VOCAB), np.float32)
    logit_noise = Z.shape[0] > 0 and Z.shape[3] > L * G
    for r in range(T * B):
        if logit_noise:
            zb, zs = _noise(Z, index, sign, r % B, r // B)
            for v in range(VOCAB):
                logits[r, v] = np.float32((acc[r, v] + q[o + v]) * scale + np.float64(zs * zb[L * G + v]))
        else:
            for v in range(VOCAB):
                logits[r, v] = np.float32((acc[r, v] + q[o + v]) * scale)
    return _scores(logits, tokens, targets, nll_out)


@njit(nogil=True, **_JIT)
def _member_sum(thetas, m, offsets, sizes, E, H, L, code, sig, tanh, batches, sums):
    """sums[m] = summed nll of member m (float64) on its batch (batches (1 or M, B, T+1) uint8),
    from zero state. Without the GIL: members run on threads (zosoma.engines.cpu.threads)."""
    n_batches, B, T1 = batches.shape
    T = T1 - 1
    batch = batches[m if n_batches > 1 else 0]
    tokens = np.ascontiguousarray(batch[:, :T])
    targets = np.ascontiguousarray(batch[:, 1:])
    nll = np.empty((B, T), np.float32)
    Z, index, sign = np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32)  # no noise
    sums[m] = _from_zero(thetas[m], offsets, sizes, E, H, L, code, sig, tanh, tokens, targets, nll, Z, index, sign)


@njit(**_JIT)
def _from_zero(theta, offsets, sizes, E, H, L, code, sig, tanh, tokens, targets, nll, Z, index, sign):
    """One model in the format from zero state, its rows' noise as _float_member's (an empty Z:
    none): the summed nll, nll (B, T) written."""
    B = tokens.shape[0]
    if code == INT8:
        h = np.zeros((L, B, H), np.float64)
        c = np.zeros((L, B, H), np.float64)
        return _int8_member(theta, offsets, sizes, E, H, L, tokens, targets, h, c, nll, Z, index, sign)
    w = theta.copy()
    round_array(w, code)
    h = np.zeros((L, B, H), np.float32)
    c = np.zeros((L, B, H), np.float32)
    return _float_member(w, offsets, E, H, L, code, sig, tanh, tokens, targets, h, c, nll, Z, index, sign)


@njit(nogil=True, **_JIT)
def _noisy_rows(theta, offsets, sizes, E, H, L, code, sig, tanh, tokens, targets, Z, index, sign, nats_out):
    """nats_out (M, B, T) float64: every target's nats under member m, one model over the M B rows
    (row m B + b: member m's copy of batch row b) with its noise (_float_member's). Without the
    GIL: chunks of members run on threads."""
    M = index.shape[0]
    B, T = tokens.shape
    rows_in, rows_out = np.empty((M * B, T), np.uint8), np.empty((M * B, T), np.uint8)
    for m in range(M):
        rows_in[m * B:(m + 1) * B] = tokens
        rows_out[m * B:(m + 1) * B] = targets
    nll = np.empty((M * B, T), np.float32)
    _from_zero(theta, offsets, sizes, E, H, L, code, sig, tanh, rows_in, rows_out, nll, Z, index, sign)
    for m in range(M):
        for b in range(B):
            for t in range(T):
                nats_out[m, b, t] = nll[m * B + b, t]


def _offsets(layout: Layout) -> np.ndarray:
    """Offsets of embed, (w_ih, w_hh, bias) per layer, out.w, out.b: the layout's entry order."""
    return np.array([e.offset for e in layout.entries], np.int64)


def _sizes(layout: Layout) -> np.ndarray:
    return np.array([e.size for e in layout.entries], np.int64)


def _tables_for(code: int) -> tuple[np.ndarray, np.ndarray]:
    """The activation tables _member_sum takes (int8 uses _SIG and _TANH)."""
    return activation_tables(code) if code != INT8 else (np.empty(0, np.float32), np.empty(0, np.float32))


def _code(fmt: str) -> int:
    check_format(fmt)
    if fmt not in CODES:
        raise ValueError("fp32 runs the ordinary forward (zosoma.engines.cpu.forward)")
    return CODES[fmt]


def population_loss(thetas, layout: Layout, batch, fmt: str) -> np.ndarray:
    """(M,) float64 mean nats/byte of M models thetas (M, d) float32 in format `fmt`, on one
    (B, T+1) uint8 batch or one per member (M, B, T+1), from zero state."""
    code = _code(fmt)
    thetas = np.ascontiguousarray(thetas, np.float32)
    if thetas.ndim != 2 or thetas.shape[1] != layout.size:
        raise ValueError(f"thetas must be (M, {layout.size}), got {thetas.shape}")
    batch = np.asarray(batch)
    batches = np.ascontiguousarray(batch[None] if batch.ndim == 2 else batch)
    if batches.dtype != np.uint8 or batches.ndim != 3 or batches.shape[0] not in (1, len(thetas)) \
            or batches.shape[2] < 2:
        raise ValueError(f"batch must be (B, T+1) or (M, B, T+1) uint8 with T >= 1, got {batch.dtype} {batch.shape}")
    cfg = layout.config
    args = (_offsets(layout), _sizes(layout), cfg.embed, cfg.hidden, cfg.layers, code, *_tables_for(code))
    sums = np.empty(len(thetas), np.float64)
    threads.run_items(lambda m, _: _member_sum(thetas, m, *args, batches, sums), len(thetas))
    return sums / (batches.shape[1] * (batches.shape[2] - 1))


def nll_stream(theta, layout: Layout, tokens, targets, fmt: str, state=None):
    """Nats (B, T) float32 of each target byte of one model in format `fmt`, and the state after
    the last step (format values), carried in from `state` (None: zeros)."""
    code = _code(fmt)
    cfg = layout.config
    theta = np.ascontiguousarray(theta, np.float32)
    tokens, targets = np.ascontiguousarray(tokens, np.uint8), np.ascontiguousarray(targets, np.uint8)
    B, T = tokens.shape
    state = to_grid(zero_state(layout, B) if state is None else state, fmt)
    dtype = np.float64 if code == INT8 else np.float32
    h = np.ascontiguousarray(np.stack([s[0] for s in state]), dtype)
    c = np.ascontiguousarray(np.stack([s[1] for s in state]), dtype)
    nll = np.empty((B, T), np.float32)
    args = (_offsets(layout), _sizes(layout), cfg.embed, cfg.hidden, cfg.layers)
    if code == INT8:
        _int8_member(theta, *args, tokens, targets, h, c, nll, *_QUIET)
    else:
        w = theta.copy()
        round_array(w, code)
        _float_member(w, args[0], cfg.embed, cfg.hidden, cfg.layers, code, *activation_tables(code), tokens,
                      targets, h, c, nll, *_QUIET)
    return nll, [(h[layer].astype(np.float32), c[layer].astype(np.float32)) for layer in range(cfg.layers)]


def noisy_nats(theta, layout: Layout, batch, fmt: str, scale: float, Z, index, sign) -> np.ndarray:
    """(M, B, T) float64: the nats of every row's every target under member m, one model theta (d,)
    float32 in format `fmt` over the M B rows of the (B, T + 1) uint8 batch, from zero state,
    member m's pre-activations plus sign[m] * scale * Z[index[m]] (Z (J, B, T, S) float32: the
    gates of every layer, then with S > L 4H the logits). The noise is added where a device adds it,
    to the pre-activation's accumulator before the nonlinearity: a float format rounds the sum once
    (gates and logits), int8 requantises it to Q3.12 (the logits: before the fp32 log-softmax).
    Members run _CHUNK at a time on threads, each chunk one forward of its rows."""
    code = _code(fmt)
    cfg = layout.config
    theta = np.ascontiguousarray(theta, np.float32)
    batch = np.ascontiguousarray(batch, np.uint8)
    tokens, targets = np.ascontiguousarray(batch[:, :-1]), np.ascontiguousarray(batch[:, 1:])
    Z = np.ascontiguousarray(Z, np.float32)
    index = np.ascontiguousarray(index, np.int64)
    sign = np.ascontiguousarray(np.asarray(sign, np.float32) * np.float32(scale))  # float32, as the CPU engine's
    nats = np.empty((len(index), batch.shape[0], batch.shape[1] - 1))
    args = (_offsets(layout), _sizes(layout), cfg.embed, cfg.hidden, cfg.layers, code, *_tables_for(code))
    chunks = [slice(m, min(len(index), m + _CHUNK)) for m in range(0, len(index), _CHUNK)]
    threads.run_items(lambda k, _: _noisy_rows(theta, *args, tokens, targets, Z, index[chunks[k]], sign[chunks[k]],
                                               nats[chunks[k]]), len(chunks))
    return nats
