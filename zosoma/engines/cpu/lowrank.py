"""The CPU engine's EGGROLL kernels: low-rank evolution strategies (Sarkar et al., "Evolution
Strategies at the Hyperscale"; reference code ESHyperscale/HyperscaleES), a baseline of the SOMA
paper.

Pair i's factors A_i, B_i (matrices) and e_i (vectors) are sliced from its Gaussian stream as
zosoma.model.noise specifies (split_factors); E_i = (sigma / sqrt(r)) A_i B_i^T is never
materialised here. Population member 2i uses theta + E_i, member 2i+1 uses theta - E_i, so a
population has N = 2 * n_pairs members.

Population forward (shared GEMM)
--------------------------------
x @ (W + s E_i) = x @ W + s (sigma/sqrt(r)) (x @ A_i) @ B_i^T: the dense product is one GEMM over
all members' rows stacked (row m*B + b is member m's sequence b), and each row adds a rank-k
correction u @ V_i: u holds the row's scaled skinny products (x @ A_i, r values per matrix) and
V_i stacks its pair's B_i^T; the vector noise s sigma e_i is folded into per-member biases. Layer 0
goes further: every member sees the same bytes, so its dense input projection is the shared table
embed @ w_ih (V, 4H), and the embedding perturbation enters through r-wide per-member tables
indexed by the byte (c = sigma/sqrt(r)): (embed + s c A_e B_e^T)[tok] @ (w_ih + s c A_ih B_ih^T)
expands exactly (s^2 = 1) into

    embed @ w_ih + s c A_e[tok] (B_e^T w_ih)
                 + [s c (embed @ A_ih)[tok] + c^2 A_e[tok] (B_e^T A_ih)] B_ih^T

Per timestep and layer: gates = h @ w_hh (+ x @ w_ih above layer 0), one GEMM each over the rows
of a group of members (up to 1,024 rows), then member by member the rank-k correction and the
LSTM cell while the rows are in cache; the output layer likewise per step (GEMM, correction,
log-softmax + NLL). Against SPSA's dense copies (zosoma.engines.cpu.forward, one member at a time) this saves
each member's table embed @ w_ih, and its GEMMs have N*B rows instead of B, which BLAS runs faster
(weights reused across rows, both threads busy). The recurrent and output products, the gate math
and the log-softmax stay per-member work, so at small H the saving is the table's share.

Float32 runs this as one compiled loop (`_population_sums`) around BLAS with zosoma.engines.cpu.forward's cell
and log-softmax kernels; other dtypes (float64 in the tests) run `_population_sums_numpy`, the
same algebra in plain NumPy with zosoma.model.reference's cell, the readable version. The tests compare
both with zosoma.model.reference on materialised perturbations.

Update (`eggroll_step`; the reference code's convention, WITHOUT 1/sigma)
------------------------------------------------------------------------
Fitness f_j = -loss_j, shaped by a pure function (zosoma.strategies.eggroll: `zscore`), then

    theta <- theta + lr * N^(-1/2) * sum_j f~_j E_j

where E_j = +E_i for j = 2i and -E_i for j = 2i+1, and E_i includes its sigma (so the step size
scales with lr * sigma; no division by sigma). Per matrix this is
(sigma/sqrt(r)) * [A_0 c_0 | ... | A_{P-1} c_{P-1}] (m, r*P) @ [B_0 | ... | B_{P-1}]^T (r*P, n)
with c_i = f~_{2i} - f~_{2i+1} (the coefficients `eggroll_step` takes); vectors add
sigma * sum_i c_i e_i.

Everything follows theta's dtype (float32 for training, float64 in the tests).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from zosoma.arrays import get_array_module
from zosoma.config import VOCAB
from zosoma.engines.cpu.row_kernels import JIT_OPTIONS, lstm_cell_rows, output_rows
from zosoma.model import reference
from zosoma.model.noise import check_rank, population_factors
from zosoma.model.params import Layout


# ----------------------------------------------------------------------------- population forward

@njit(**JIT_OPTIONS)
def _dot(a, b):
    """a @ b of 2-D arrays through Numba's np.dot, i.e. SciPy's OpenBLAS, the BLAS that the kernels
    (here and in zosoma.engines.cpu.forward) call. NumPy's `@` would call NumPy's own OpenBLAS, whose threads
    keep spinning for a while after a call and halve the speed of the next kernel's GEMMs."""
    return np.dot(a, b)


def _concat_pairs(a):
    """(P, m, r) -> (m, P*r), column i*r + k = a[i, :, k]: all pairs' factors side by side."""
    P, m, r = a.shape
    return get_array_module(a).ascontiguousarray(a.transpose(1, 0, 2)).reshape(m, P * r)


class _Terms(NamedTuple):
    """What the population forward needs, in theta's dtype. M = 2P members (member m of pair m//2,
    sign s = +1 for even m, -1 for odd), G = 4H gate columns, c = sigma/sqrt(r). Each rank-k
    correction u @ V_i lists its V_i here; `_population_sums` builds the row's u. The vector noise
    s sigma e_i is folded into per-member biases. Arrays of layers above 0 are empty when L = 1."""
    sc: np.ndarray  # (M,) s c, the scale of every x @ A_i
    table: np.ndarray  # (V, G) embed @ lstm0.w_ih, shared by all members
    u_tok: np.ndarray  # (M, V, 2r) layer 0's input u per byte, from the docstring's expansion:
    #                    [s c A_e | s c embed A_ih + c^2 A_e B_e^T A_ih]
    w_hh: np.ndarray  # (L, H, G)
    bias: np.ndarray  # (L, M, G) each member's gate bias: bias + s sigma e_bias
    at_hh: np.ndarray  # (L, P, r, H) A_hh^T
    v0: np.ndarray  # (P, 3r, G) layer 0's V: [B_hh^T; B_e^T w_ih; B_ih^T]
    w_ih: np.ndarray  # (L-1, H, G) layers above 0
    at_ih: np.ndarray  # (L-1, P, r, H) A_ih^T, layers above 0
    v_up: np.ndarray  # (L-1, P, 2r, G) V of layers above 0: [B_hh^T; B_ih^T]
    out_w: np.ndarray  # (H, V)
    out_b: np.ndarray  # (M, V) each member's output bias: out.b + s sigma e_out.b
    at_o: np.ndarray  # (P, r, H) A_out^T
    bt_o: np.ndarray  # (P, r, V) the output layer's V: B_out^T


def _terms(theta, layout: Layout, sigma: float, r: int, seed: int, expert: int, step: int,
           P: int, first: int) -> _Terms:
    dt = theta.dtype
    cfg = layout.config
    L, H = cfg.layers, cfg.hidden
    M = 2 * P
    c = sigma / math.sqrt(r)
    sign = np.tile(np.array([1.0, -1.0], dt), P)
    sc, ss = sign * dt.type(c), sign * dt.type(sigma)
    pair = np.arange(M) // 2  # the pair of each member
    p = layout.views(theta)
    f = population_factors(layout, r, seed, expert, step, P, dt, first)

    def at(name):  # A_i^T (P, r, m)
        return np.swapaxes(f[name][0], 1, 2)

    def bt(name):  # B_i^T (P, r, n)
        return np.swapaxes(f[name][1], 1, 2)

    def member_bias(name):  # (M, n): b + s sigma e_i
        return p[name] + ss[:, None] * f[name][pair]

    def stack(arrays, shape):  # np.stack that allows no arrays (no layers above 0)
        return np.stack(arrays) if arrays else np.empty((0,) + shape, dt)

    w_e, w_ih0 = p["embed"], p["lstm0.w_ih"]
    a_e, a_ih = f["embed"][0], f["lstm0.w_ih"][0]  # (P, V, r), (P, E, r)
    bt_e = bt("embed")  # (P, r, E)
    E = w_ih0.shape[0]
    e_a = _dot(w_e, _concat_pairs(a_ih)).reshape(VOCAB, P, r).transpose(1, 0, 2)  # embed A_ih
    a_b_a = np.einsum("pvr,prs->pvs", a_e, np.einsum("pre,pes->prs", bt_e, a_ih))
    scale = sc[:, None, None]
    u_tok = np.concatenate([scale * a_e[pair], scale * e_a[pair] + (c * c) * a_b_a[pair]], axis=-1)
    b_w = _dot(np.ascontiguousarray(bt_e).reshape(P * r, E), w_ih0).reshape(P, r, 4 * H)
    layers, above = range(L), [f"lstm{layer}" for layer in range(1, L)]
    terms = _Terms(
        sc=sc, table=_dot(w_e, w_ih0), u_tok=u_tok,
        w_hh=np.stack([p[f"lstm{layer}.w_hh"] for layer in layers]),
        bias=np.stack([member_bias(f"lstm{layer}.bias") for layer in layers]),
        at_hh=np.stack([at(f"lstm{layer}.w_hh") for layer in layers]),
        v0=np.concatenate([bt("lstm0.w_hh"), b_w, bt("lstm0.w_ih")], axis=1),
        w_ih=stack([p[f"{n}.w_ih"] for n in above], (H, 4 * H)),
        at_ih=stack([at(f"{n}.w_ih") for n in above], (P, r, H)),
        v_up=stack([np.concatenate([bt(f"{n}.w_hh"), bt(f"{n}.w_ih")], axis=1) for n in above],
                   (P, 2 * r, 4 * H)),
        out_w=p["out.w"], out_b=member_bias("out.b"), at_o=at("out.w"), bt_o=bt("out.w"))
    return _Terms(*(np.ascontiguousarray(a) for a in terms))


# Members evaluated together: their rows (group * B) make each step's GEMMs, big enough to be
# efficient and to use BLAS's threads, and bound the work buffers (zosoma.engines.cpu.forward's chunk size).
_ROWS_PER_GROUP = 1024


@njit(**JIT_OPTIONS)
def _low_rank(x, at, scale, u, k0):
    """u[:, k0:k0+r] = scale * (x @ A) for a block of rows x (B, n), at = A^T (r, n)."""
    for b in range(x.shape[0]):
        for k in range(at.shape[0]):
            s = np.float32(0.0)
            for j in range(x.shape[1]):
                s += x[b, j] * at[k, j]
            u[b, k0 + k] = scale * s


@njit(**JIT_OPTIONS)
def _add_rank_k(rows, u, v):
    """rows += u[:, :K] @ v for a block of rows (B, n), v (K, n)."""
    for b in range(rows.shape[0]):
        for k in range(v.shape[0]):
            ubk = u[b, k]
            for j in range(rows.shape[1]):
                rows[b, j] += ubk * v[k, j]


@njit(**JIT_OPTIONS)
def _group_sums(tokens, targets, m0, mg, sc, table, u_tok, w_hh, bias, at_hh, v0, w_ih, at_ih,
                v_up, out_w, out_b, at_o, bt_o):
    """Summed nll (mg,) float64 of members m0 .. m0+mg-1, float32 throughout. tokens (T, B) intp
    and targets (T, B) uint8: the bytes of step t; the rest as _Terms. Row (m-m0)*B + b is member
    m's sequence b. The helpers take whole member blocks: a view per row would cost more than its
    arithmetic."""
    T, B = tokens.shape
    R = mg * B
    L, H, G = w_hh.shape
    r = at_hh.shape[2]
    h = np.zeros((L, R, H), np.float32)
    c = np.zeros((L, R, H), np.float32)
    gates = np.empty((R, G), np.float32)
    xproj = np.empty((R if L > 1 else 0, G), np.float32)  # x @ w_ih above layer 0
    logits = np.empty((R, out_w.shape[1]), np.float32)
    nll = np.empty(B, np.float32)
    fold = np.empty(out_w.shape[1] // 2, np.float32)
    u = np.empty((B, 3 * r), np.float32)  # a member block's rows u, the widest being layer 0's
    row_ids = np.arange(R)  # lstm_cell_rows' input rows above layer 0: xproj's own
    sums = np.zeros(mg, np.float64)
    for t in range(T):
        for layer in range(L):
            np.dot(h[layer], w_hh[layer], gates)  # one GEMM over all the group's rows
            if layer > 0:
                np.dot(h[layer - 1], w_ih[layer - 1], xproj)
            for g in range(mg):  # member by member: correction, then the cell, rows still in cache
                m = m0 + g
                i = m // 2
                blk = slice(g * B, (g + 1) * B)
                _low_rank(h[layer, blk], at_hh[layer, i], sc[m], u, 0)  # s c h A_hh
                if layer == 0:
                    for b in range(B):
                        for k in range(2 * r):
                            u[b, r + k] = u_tok[m, tokens[t, b], k]
                    _add_rank_k(gates[blk], u, v0[i])
                    lstm_cell_rows(gates[blk], table, tokens[t], bias[0, m], c[0, blk], h[0, blk])
                else:
                    _low_rank(h[layer - 1, blk], at_ih[layer - 1, i], sc[m], u, r)  # s c x A_ih
                    _add_rank_k(gates[blk], u, v_up[layer - 1, i])
                    lstm_cell_rows(gates[blk], xproj, row_ids[blk], bias[layer, m],
                                   c[layer, blk], h[layer, blk])
        np.dot(h[L - 1], out_w, logits)
        for g in range(mg):
            m = m0 + g
            blk = slice(g * B, (g + 1) * B)
            _low_rank(h[L - 1, blk], at_o[m // 2], sc[m], u, 0)
            _add_rank_k(logits[blk], u, bt_o[m // 2])
            sums[g] += output_rows(logits[blk], out_b[m], targets[t], nll, False, fold)
    return sums


@njit(**JIT_OPTIONS)
def _population_sums(tokens, targets, group, sc, table, u_tok, w_hh, bias, at_hh, v0, w_ih, at_ih,
                     v_up, out_w, out_b, at_o, bt_o):
    """Summed nll (M,) float64 of every member, `group` members at a time."""
    M = sc.shape[0]
    sums = np.empty(M, np.float64)
    for m0 in range(0, M, group):
        mg = min(group, M - m0)
        sums[m0:m0 + mg] = _group_sums(tokens, targets, m0, mg, sc, table, u_tok, w_hh, bias,
                                       at_hh, v0, w_ih, at_ih, v_up, out_w, out_b, at_o, bt_o)
    return sums


def _population_sums_numpy(tokens, targets, sc, table, u_tok, w_hh, bias, at_hh, v0, w_ih, at_ih,
                           v_up, out_w, out_b, at_o, bt_o):
    """_population_sums in plain NumPy, in theta's dtype, with zosoma.model.reference's cell and NLL."""
    T, B = tokens.shape
    M = sc.shape[0]
    L, H, _ = w_hh.shape
    member = np.repeat(np.arange(M), B)  # the member of each row
    pair = member // 2

    def low_rank(x, at):  # every row's s c (x @ A_i), (R, r)
        return sc[member, None] * np.einsum("rn,rkn->rk", x, at[pair])

    def rank_k(u, v):  # every row's u @ V_i, (R, n)
        return np.einsum("rk,rkn->rn", u, v[pair])

    h = np.zeros((L, M * B, H), sc.dtype)
    c = np.zeros((L, M * B, H), sc.dtype)
    sums = np.zeros(M)
    for t in range(T):
        tok = np.tile(tokens[t], M)
        for layer in range(L):
            if layer == 0:
                u = np.concatenate([low_rank(h[0], at_hh[0]), u_tok[member, tok]], axis=1)
                gates = table[tok] + h[0] @ w_hh[0] + rank_k(u, v0)
            else:
                x = h[layer - 1]
                u = np.concatenate([low_rank(h[layer], at_hh[layer]),
                                    low_rank(x, at_ih[layer - 1])], axis=1)
                gates = x @ w_ih[layer - 1] + h[layer] @ w_hh[layer] + rank_k(u, v_up[layer - 1])
            h[layer], c[layer] = reference.lstm_cell(gates + bias[layer, member], c[layer])
        logits = h[-1] @ out_w + out_b[member] + rank_k(low_rank(h[-1], at_o), bt_o)
        sums += reference.nll(logits, np.tile(targets[t], M)).reshape(M, B).sum(axis=1)
    return sums


def eggroll_population_loss(theta, layout: Layout, batch, sigma: float, r: int, seed: int,
                            expert: int, step: int, n_pairs: int, first: int = 0) -> np.ndarray:
    """Mean nats/byte of each of the N = 2*n_pairs population members theta +/- E_i (member 2j is
    +E_i, 2j+1 is -E_i, i = first + j), from zero state, on the shared (B, T+1) uint8 batch.
    Returns (N,) float64.
    Equal (to rounding) to zosoma.model.reference.loss of the materialised theta +/- E_i.

    Per LSTM step and layer the work is one dense GEMM over all N*B rows (two above layer 0) and
    a rank-k correction per row; float32 runs compiled, other dtypes in NumPy (module docstring)."""
    theta = np.asarray(theta)
    if theta.ndim != 1 or theta.shape[0] != layout.size:
        raise ValueError(f"theta must be ({layout.size},), got {theta.shape}")
    batch = np.asarray(batch)
    if batch.dtype != np.uint8 or batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be a (B, T+1) uint8 array with T >= 1, got {batch.dtype} "
                         f"{batch.shape}")
    if n_pairs < 1:
        raise ValueError(f"n_pairs must be at least 1, got {n_pairs}")
    r = check_rank(r)
    terms = _terms(theta, layout, sigma, r, seed, expert, step, n_pairs, first)
    tokens = np.ascontiguousarray(batch[:, :-1].T).astype(np.intp)  # (T, B): step t's bytes
    targets = np.ascontiguousarray(batch[:, 1:].T)
    if theta.dtype == np.float32:
        group = max(1, _ROWS_PER_GROUP // batch.shape[0])
        sums = _population_sums(tokens, targets, group, *terms)
    else:
        sums = _population_sums_numpy(tokens, targets, *terms)
    return sums / targets.size


# ---------------------------------------------------------------------------------------- update

def eggroll_step(theta, layout: Layout, coef, lr: float, sigma: float, r: int, seed: int,
                 expert: int, step: int, factors: dict | None = None):
    """New theta = theta + lr * N^(-1/2) * sum_i coef_i E_i over the P = len(coef) pairs, N = 2P;
    coef_i = f~_{2i} - f~_{2i+1} from shaped fitness. Regenerates the factors (or takes them:
    `factors` as population_factors in float64, e.g. made on a GPU, whose theta is a CuPy array)
    and accumulates in float64 (products through `_dot` on the CPU, so the next forward's BLAS
    runs undisturbed); returns a new array of theta's dtype."""
    xp = get_array_module(theta)
    theta = xp.asarray(theta)
    if theta.ndim != 1 or theta.shape[0] != layout.size:
        raise ValueError(f"theta must be ({layout.size},), got {theta.shape}")
    coef = xp.asarray(coef, np.float64)
    if coef.ndim != 1 or coef.size < 1:
        raise ValueError(f"coef must be (n_pairs,), got {coef.shape}")
    r = check_rank(r)
    P = coef.size
    scale = lr / math.sqrt(2 * P)
    f = population_factors(layout, r, seed, expert, step, P, np.float64) if factors is None else factors
    dot = _dot if xp is np else xp.matmul
    new = theta.astype(np.float64)
    c = sigma / math.sqrt(r)
    for e in layout.entries:
        block = new[e.offset:e.offset + e.size]
        if len(e.shape) == 2:  # sum_i coef_i A_i B_i^T as one (m, P*r) @ (P*r, n) GEMM
            a, b = f[e.name]  # (P, m, r), (P, n, r)
            bt_cat = xp.ascontiguousarray(b.transpose(0, 2, 1)).reshape(P * r, e.shape[1])
            block += (scale * c) * dot(_concat_pairs(a * coef[:, None, None]), bt_cat).ravel()
        else:
            block += (scale * sigma) * dot(coef[None], f[e.name])[0]
    return new.astype(theta.dtype)
