"""The fast CPU forward: Numba kernels around BLAS, checked against zosoma.model.reference.

Shapes: M population members, B batch, T time, E embedding, H hidden, V = 256, L layers.

One member's forward (`_member_forward`, time loop compiled, so small models pay no Python
overhead per step) does, per chunk of Tc timesteps:

    layer 0:   x_t @ w_ih is a row of the table embed @ w_ih (V, 4H), computed once per member and
               gathered (an exact identity; 256*E*4H multiply-adds instead of B*T*E*4H)
    layer l>0: the input projection of all Tc steps as one (Tc*B, H) @ (H, 4H) GEMM
    each step: gates = h @ w_hh (BLAS), then `lstm_cell_rows` adds the input projection and bias
               and applies the gate and cell math in one vectorised pass (rational tanh, no libm
               calls)
    output:    logits = h @ out.w (one GEMM), then `output_rows`: log-softmax + NLL per row in
               float32 with a vectorisable exp, the loss sum accumulated in float64

Members run one after another with their own dense weights, so each member's weights stay in
cache (PERF_NOTES: stacking members' weights into one batched matmul streams them from RAM).
BLAS is called through Numba's np.dot (SciPy's OpenBLAS), keeping its two threads; the kernels
are serial on purpose (PERF_NOTES: numba threads beside BLAS threads are 10-40x slower).
Everything here stays valid Python, so the suite can run with NUMBA_DISABLE_JIT=1.
`lstm_cell_rows` and `output_rows` are public: zosoma.model.lowrank's population forward reuses them.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from zosoma.config import VOCAB
from zosoma.model.params import Layout

# fastmath without nnan/ninf: reductions and FMAs may reassociate, but a diverged model still
# yields inf/nan losses that the trainer can see. error_model="numpy" drops the division checks
# that would otherwise stop the gate loop from vectorising. Public: zosoma.model.lowrank's kernels use it.
JIT_OPTIONS = dict(cache=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})

_ROWS_PER_CHUNK = 1024  # target Tc*B: big enough for an efficient GEMM, small enough for cache

# Rational tanh approximation on [-7.905, 7.905] (Eigen's generic_fast_tanh_float): odd degree-13
# numerator over even degree-6 denominator, max abs error 3.9e-7 in float32. Constants are
# float32 so the arithmetic stays float32 (a float64 literal would promote the whole loop).
_F = np.float32
_TANH_CLAMP = _F(7.90531110763549805)
_A1, _A3, _A5, _A7 = (_F(4.89352455891786e-03), _F(6.37261928875436e-04),
                      _F(1.48572235717979e-05), _F(5.12229709037114e-08))
_A9, _A11, _A13 = _F(-8.60467152213735e-11), _F(2.00018790482477e-13), _F(-2.76076847742355e-16)
_B0, _B2, _B4, _B6 = (_F(4.89352518554385e-03), _F(2.26843463243900e-03),
                      _F(1.18534705686654e-04), _F(1.19825839466702e-06))
_HALF = _F(0.5)
_ONE = _F(1.0)

# exp(d) for d <= 0 (a row shifted by its max) as 2**-k * p(r), d = -k*ln2 + r, |r| <= ln2/2, p the
# degree-7 Taylor polynomial; 2**-k (k <= 126) is built from k's binary digits with compares and
# selects, since numba has no scalar bit-cast and a table gather does not vectorise on every CPU.
# Max relative error 3e-7.
_EXP_FLOOR = _F(-87.0)  # exp(-87) = 1.6e-38, just above the smallest normal float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)  # ln 2 in two parts (Cody-Waite): k * _LN2_HI is exact for k < 2**15
_LN2_LO = _F(-2.12194440e-4)
_C2, _C3, _C4, _C5, _C6, _C7 = (_F(1 / math.factorial(k)) for k in range(2, 8))
_POW2_STEPS = tuple((_F(2 ** i), _F(2.0 ** -(2 ** i))) for i in range(6, -1, -1))  # (64, 2**-64)..
_ZERO = _F(0.0)


@njit(inline="always", **JIT_OPTIONS)
def _tanh(x):
    x = min(max(x, -_TANH_CLAMP), _TANH_CLAMP)
    x2 = x * x
    p = ((((((_A13 * x2 + _A11) * x2 + _A9) * x2 + _A7) * x2 + _A5) * x2 + _A3) * x2 + _A1) * x
    q = ((_B6 * x2 + _B4) * x2 + _B2) * x2 + _B0
    return p / q


@njit(inline="always", **JIT_OPTIONS)
def _sigmoid(x):
    return _HALF + _HALF * _tanh(_HALF * x)


@njit(inline="always", **JIT_OPTIONS)
def _pow2_neg(k):
    """2**-k for an integral float32 k in [0, 127], exactly: one factor per binary digit."""
    s = _ONE
    for step, factor in _POW2_STEPS:
        t = k >= step
        s *= factor if t else _ONE
        k -= step if t else _ZERO
    return s


@njit(inline="always", **JIT_OPTIONS)
def _exp_nonpos(d):
    """exp(d) for d <= 0, float32, vectorisable."""
    d = max(d, _EXP_FLOOR)
    k = np.floor(_HALF - d * _LOG2E)  # round(-d / ln2), in [0, 126]
    r = (d + k * _LN2_HI) + k * _LN2_LO
    p = ((((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2) * r + _ONE) * r + _ONE
    return p * _pow2_neg(k)


@njit(**JIT_OPTIONS)
def lstm_cell_rows(gates, xsrc, rows, bias, c, h_out):
    """One LSTM step for B rows, in place. gates (B, 4H) = h_prev @ w_hh; the input projection of
    row b is xsrc[rows[b]] (4H,); bias (4H,); c (B, H) updated; h_out (B, H) written."""
    B, H = c.shape
    for b in range(B):
        gb = gates[b]
        xb = xsrc[rows[b]]
        cb = c[b]
        hb = h_out[b]
        for j in range(H):
            i = _sigmoid(gb[j] + xb[j] + bias[j])
            f = _sigmoid(gb[H + j] + xb[H + j] + bias[H + j])
            g = _tanh(gb[2 * H + j] + xb[2 * H + j] + bias[2 * H + j])
            o = _sigmoid(gb[3 * H + j] + xb[3 * H + j] + bias[3 * H + j])
            cn = f * cb[j] + i * g
            cb[j] = cn
            hb[j] = o * _tanh(cn)


@njit(**JIT_OPTIONS)
def _row_max(z, fold):
    """max of z (V,), V a power of two, by halving folds: elementwise maxima vectorise where a
    running-max loop does not (LLVM needs no-NaN semantics for that). fold (V/2,) scratch."""
    n = z.shape[0] // 2
    for k in range(n):
        fold[k] = max(z[k], z[k + n])
    while n > 16:
        n //= 2
        for k in range(n):
            fold[k] = max(fold[k], fold[k + n])
    m = fold[0]
    for k in range(1, n):
        m = max(m, fold[k])
    return m


@njit(**JIT_OPTIONS)
def output_rows(logits, bias, targets, nll, to_logp, fold):
    """Log-softmax + NLL per row. logits (R, V) = h @ out.w, bias not yet added; bias (V,);
    targets (R,) bytes; fold (V/2,) scratch. Writes nll (R,) float32 and returns its float64 sum;
    with to_logp, overwrites logits with the log-probabilities."""
    R, V = logits.shape
    total = 0.0
    for r in range(R):
        z = logits[r]
        for v in range(V):
            z[v] += bias[v]
        m = _row_max(z, fold)
        s = _ZERO
        for v in range(V):
            s += _exp_nonpos(z[v] - m)
        lse = m + _F(math.log(s))
        nll[r] = lse - z[targets[r]]
        total += nll[r]
        if to_logp:
            for v in range(V):
                z[v] -= lse
    return total


@njit(**JIT_OPTIONS)
def _workspace(E, H, B, T, rows_per_chunk):
    """Work buffers for one member's forward, reused across members and timesteps."""
    Tc = max(1, min(T, (rows_per_chunk + B - 1) // B))
    table = np.empty((VOCAB, 4 * H), np.float32)  # embed @ w_ih of layer 0
    xproj = np.empty((Tc * B, 4 * H), np.float32)  # input projection of layers >= 1, one chunk
    gates = np.empty((B, 4 * H), np.float32)
    hs = np.empty((Tc, B, H), np.float32)  # one layer's outputs over the chunk
    logits = np.empty((Tc * B, VOCAB), np.float32)
    rows = np.empty(B, np.intp)
    row_targets = np.empty(Tc * B, np.uint8)
    row_nll = np.empty(Tc * B, np.float32)
    fold = np.empty(VOCAB // 2, np.float32)
    return table, xproj, gates, hs, logits, rows, row_targets, row_nll, fold


@njit(**JIT_OPTIONS)
def _member_forward(theta, offsets, E, H, tokens, targets, h, c, want_nll, nll_out, want_logp,
                    logp_out, ws):
    """One model over one batch, time loop inside. theta (d,) float32; offsets (2 + 3L + 2,) of
    embed, (w_ih, w_hh, bias) per layer, out.w, out.b; tokens, targets (B, T) uint8; h, c
    (L, B, H) carried state, updated in place; nll_out (B, T) and logp_out (B, T, V) written when
    wanted (else may be empty). Returns the float64 sum of the B*T nlls."""
    table, xproj, gates, hs, logits, rows, row_targets, row_nll, fold = ws
    L = h.shape[0]
    B, T = tokens.shape
    Tc = hs.shape[0]
    G = 4 * H
    o = offsets[0]
    embed = theta[o:o + VOCAB * E].reshape((VOCAB, E))
    o = offsets[1]
    np.dot(embed, theta[o:o + E * G].reshape((E, G)), table)
    o = offsets[3 * L + 1]
    out_w = theta[o:o + H * VOCAB].reshape((H, VOCAB))
    o = offsets[3 * L + 2]
    out_b = theta[o:o + VOCAB]
    total = 0.0
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        for layer in range(L):
            o = offsets[3 * layer + 2]
            w_hh = theta[o:o + H * G].reshape((H, G))
            o = offsets[3 * layer + 3]
            bias = theta[o:o + G]
            if layer > 0:
                o = offsets[3 * layer + 1]
                w_ih = theta[o:o + H * G].reshape((H, G))
                np.dot(hs[:n].reshape((n * B, H)), w_ih, xproj[:n * B])
            for t in range(n):
                h_prev = h[layer] if t == 0 else hs[t - 1]
                np.dot(h_prev, w_hh, gates)
                if layer == 0:
                    for b in range(B):
                        rows[b] = tokens[b, t0 + t]
                    lstm_cell_rows(gates, table, rows, bias, c[layer], hs[t])
                else:
                    for b in range(B):
                        rows[b] = t * B + b
                    lstm_cell_rows(gates, xproj, rows, bias, c[layer], hs[t])
            h[layer] = hs[n - 1]
        R = n * B
        np.dot(hs[:n].reshape((R, H)), out_w, logits[:R])
        for t in range(n):
            for b in range(B):
                row_targets[t * B + b] = targets[b, t0 + t]
        total += output_rows(logits[:R], out_b, row_targets[:R], row_nll[:R], want_logp, fold)
        if want_nll:
            for t in range(n):
                for b in range(B):
                    nll_out[b, t0 + t] = row_nll[t * B + b]
        if want_logp:
            for t in range(n):
                for b in range(B):
                    logp_out[b, t0 + t] = logits[t * B + b]
    return total


@njit(**JIT_OPTIONS)
def _population_sums(thetas, offsets, E, H, L, batches, rows_per_chunk):
    """Summed nll of each member. thetas (M, d); batches (1 or M, B, T+1) uint8, one shared by
    all members or one per member."""
    M = thetas.shape[0]
    n_batches, B, T1 = batches.shape
    T = T1 - 1
    ws = _workspace(E, H, B, T, rows_per_chunk)
    tokens = np.empty((B, T), np.uint8)
    targets = np.empty((B, T), np.uint8)
    h = np.empty((L, B, H), np.float32)
    c = np.empty((L, B, H), np.float32)
    none2 = np.empty((0, 0), np.float32)
    none3 = np.empty((0, 0, VOCAB), np.float32)
    sums = np.empty(M, np.float64)
    for m in range(M):
        if m == 0 or n_batches > 1:
            batch = batches[m if n_batches > 1 else 0]
            tokens[:, :] = batch[:, :T]
            targets[:, :] = batch[:, 1:]
        h[:] = 0.0
        c[:] = 0.0
        sums[m] = _member_forward(thetas[m], offsets, E, H, tokens, targets, h, c,
                                  False, none2, False, none3, ws)
    return sums


def _offsets(layout: Layout) -> np.ndarray:
    names = ["embed"]
    for layer in range(layout.config.layers):
        names += [f"lstm{layer}.w_ih", f"lstm{layer}.w_hh", f"lstm{layer}.bias"]
    names += ["out.w", "out.b"]
    return np.array([layout[n].offset for n in names], np.int64)


def _check_theta(theta, layout: Layout, ndim: int) -> np.ndarray:
    theta = np.ascontiguousarray(theta, dtype=np.float32)
    if theta.ndim != ndim or theta.shape[-1] != layout.size:
        want = "(M, d)" if ndim == 2 else "(d,)"
        raise ValueError(f"theta must have shape {want} with d={layout.size}, got {theta.shape}")
    return theta


def _check_bytes(tokens, name: str, ndim: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.dtype != np.uint8 or tokens.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d uint8 array, "
                         f"got {tokens.dtype} {tokens.shape}")
    return np.ascontiguousarray(tokens)


def population_loss(thetas, layout: Layout, batch) -> np.ndarray:
    """Mean nats per predicted byte of each member, from zero state: the SPSA hot path.

    thetas (M, d) float32, one parameter vector per member (e.g. the 2P perturbed copies of a
    model); batch (B, T+1) uint8 shared by all members, or (M, B, T+1) one per member; inputs
    batch[..., :-1], targets batch[..., 1:]. Returns (M,) float64.
    """
    thetas = _check_theta(thetas, layout, 2)
    batch = np.asarray(batch)
    batches = _check_bytes(batch[None] if batch.ndim == 2 else batch, "batch", 3)
    if batches.shape[0] not in (1, thetas.shape[0]) or batches.shape[2] < 2:
        raise ValueError(f"batch must be (B, T+1) or (M={thetas.shape[0]}, B, T+1) with T >= 1, "
                         f"got {batch.shape}")
    cfg = layout.config
    sums = _population_sums(thetas, _offsets(layout), cfg.embed, cfg.hidden, cfg.layers, batches,
                            _ROWS_PER_CHUNK)
    B, T = batches.shape[1], batches.shape[2] - 1
    return sums / (B * T)


def _stream(theta, layout: Layout, tokens, targets, state, want_nll: bool, want_logp: bool):
    cfg = layout.config
    L, H = cfg.layers, cfg.hidden
    theta = _check_theta(theta, layout, 1)
    tokens = _check_bytes(tokens, "tokens", 2)
    targets = np.zeros_like(tokens) if targets is None else _check_bytes(targets, "targets", 2)
    if targets.shape != tokens.shape:
        raise ValueError(f"targets {targets.shape} must match tokens {tokens.shape}")
    B, T = tokens.shape
    h = np.zeros((L, B, H), np.float32)
    c = np.zeros((L, B, H), np.float32)
    if state is not None:
        if len(state) != L:
            raise ValueError(f"state must hold {L} (h, c) pairs, got {len(state)}")
        for layer, (h_l, c_l) in enumerate(state):
            for name, given in (("h", h_l), ("c", c_l)):
                if np.shape(given) != (B, H):
                    raise ValueError(f"state {name} of layer {layer} must be ({B}, {H}), "
                                     f"got {np.shape(given)}")
            h[layer], c[layer] = h_l, c_l
    nll = np.empty((B, T) if want_nll else (0, 0), np.float32)
    logp = np.empty((B, T, VOCAB) if want_logp else (0, 0, VOCAB), np.float32)
    ws = _workspace(cfg.embed, H, B, T, _ROWS_PER_CHUNK)
    _member_forward(theta, _offsets(layout), cfg.embed, H, tokens, targets, h, c, want_nll, nll,
                    want_logp, logp, ws)
    return nll, logp, [(h[layer], c[layer]) for layer in range(L)]


def nll_stream(theta, layout: Layout, tokens, targets, state=None):
    """Nats of each target byte under one model, carrying state across calls so a long text can be
    evaluated segment by segment. theta (d,) float32; tokens, targets (B, T) uint8; state None
    (zeros) or one (h, c) pair of (B, H) per layer, as reference.zero_state. Returns nll (B, T)
    float32 and the state after the last step."""
    nll, _, state = _stream(theta, layout, tokens, targets, state, True, False)
    return nll, state


def log_probs(theta, layout: Layout, tokens, state=None):
    """Next-byte log-probabilities of one model at every position. theta (d,) float32; tokens
    (B, T) uint8; state as in nll_stream. Returns logp (B, T, V) float32 and the final state."""
    _, logp, state = _stream(theta, layout, tokens, None, state, False, True)
    return logp, state
