"""EGGROLL: low-rank evolution strategies (Sarkar et al., "Evolution Strategies at the Hyperscale";
reference code ESHyperscale/HyperscaleES), the low-rank ES baseline of SOMA.md.

Noise (regenerated from counters, like SPSA's; nothing is stored)
-----------------------------------------------------------------
Population pair i (the `member` counter of zosoma.noise) draws ONE Gaussian stream

    z = noise(noise_length(layout, r), seed, expert, step, member=i, kind="gaussian")

and slices it, walking the Layout entries in order (embed, lstm0.w_ih, lstm0.w_hh, lstm0.bias,
..., out.w, out.b):

    matrix W (m, n) ("x @ W" orientation, m = fan-in rows, n = columns):
        A_i = next m*r values reshaped (m, r) row-major, then B_i = next n*r values reshaped (n, r)
        perturbation E_i = (sigma / sqrt(r)) A_i B_i^T   (never materialised by the forward)
    vector v (k,):
        e_i = sigma * next k values                       (full-rank Gaussian)

The embedding (V, E) is a matrix like any other. Antithetic pairs: population member 2i uses
theta + E_i, member 2i+1 uses theta - E_i, so a population has N = 2 * n_pairs members.

Population forward (shared GEMM)
--------------------------------
x @ (W + s E_i) = x @ W + s (sigma/sqrt(r)) (x @ A_i) @ B_i^T: the dense product is one GEMM over
all N members' rows stacked, and each member adds a rank-r correction (two skinny products, done
for both members of a pair in one batched matmul since they share A_i, B_i). Layer 0 goes further:
every member sees the same bytes, so its dense input projection is the shared table
embed @ w_ih (V, 4H), and the embedding perturbation enters through r-wide tables:
(embed + s E_e)[tok] @ (w_ih + s E_ih) expands exactly into gathers of embed @ w_ih,
embed @ A_ih, and small (r, .) products B_e^T @ w_ih, B_e^T @ A_ih (s^2 = 1).
Per timestep and layer: h @ [w_hh | A_0 .. A_{P-1}] is ONE GEMM over all N*B rows (the x_j @ A_i
are its block-diagonal columns; unfused when P*r is large next to 4H), then one batched rank-k
product per pair adds every member term (recurrent, input and bias noise) at once. The output
layer is one GEMM over all N*B*T rows, then per pair (in cache) a rank-(r+2) correction and the
log-softmax. Float32 populations use zosoma.forward's compiled LSTM cell and log-softmax
kernels; float64 runs the NumPy equivalents (the tests compare both with zosoma.reference).

Update (convention: the reference code's, WITHOUT 1/sigma)
----------------------------------------------------------
Fitness f_j = -loss_j, shaped by a pure function (default `zscore`, zero when all are equal), then

    theta <- theta + lr * N^(-1/2) * sum_j f~_j E_j

where E_j = +E_i for j = 2i and -E_i for j = 2i+1, and E_i includes its sigma (so the step size
scales with lr * sigma; no division by sigma). Per matrix this is
(sigma/sqrt(r)) * [A_0 c_0 | ... | A_{P-1} c_{P-1}] (m, r*P) @ [B_0 | ... | B_{P-1}]^T (r*P, n)
with c_i = f~_{2i} - f~_{2i+1}; vectors add sigma * sum_i c_i e_i.

Everything follows theta's dtype (float32 for training, float64 in the tests).
"""

from __future__ import annotations

import math
import time

import numpy as np

from .config import VOCAB
from .noise import noise
from .params import Layout, init_params


# --------------------------------------------------------------------------------------- noise

def noise_length(layout: Layout, r: int) -> int:
    """Length of one pair's Gaussian stream: sum over matrices of (m + n) * r, plus vector sizes."""
    return sum((e.shape[0] + e.shape[1]) * r if len(e.shape) == 2 else e.size
               for e in layout.entries)


def _check_rank(r: int) -> int:
    r = int(r)
    if r < 1:
        raise ValueError(f"EGGROLL rank r must be at least 1, got {r}")
    return r


def pair_factors(layout: Layout, r: int, seed: int, expert: int, step: int, member: int,
                 dtype=np.float32) -> dict:
    """The unscaled noise of pair `member`: name -> (A (m, r), B (n, r)) for matrices, name -> (k,)
    standard Gaussian for vectors (callers apply the sigma and sigma/sqrt(r) scales)."""
    r = _check_rank(r)
    z = noise(noise_length(layout, r), seed, expert, step, member, kind="gaussian").astype(dtype)
    out, pos = {}, 0
    for e in layout.entries:
        if len(e.shape) == 2:
            m, n = e.shape
            a = z[pos:pos + m * r].reshape(m, r)
            pos += m * r
            b = z[pos:pos + n * r].reshape(n, r)
            pos += n * r
            out[e.name] = (a, b)
        else:
            out[e.name] = z[pos:pos + e.size]
            pos += e.size
    return out


def population_factors(layout: Layout, r: int, seed: int, expert: int, step: int, n_pairs: int,
                       dtype=np.float32) -> dict:
    """All pairs' factors stacked: name -> (A (P, m, r), B (P, n, r)) or (P, k)."""
    pairs = [pair_factors(layout, r, seed, expert, step, i, dtype) for i in range(n_pairs)]
    out = {}
    for e in layout.entries:
        if len(e.shape) == 2:
            out[e.name] = (np.stack([p[e.name][0] for p in pairs]),
                           np.stack([p[e.name][1] for p in pairs]))
        else:
            out[e.name] = np.stack([p[e.name] for p in pairs])
    return out


def materialise(layout: Layout, sigma: float, r: int, seed: int, expert: int, step: int,
                member: int, dtype=np.float64) -> np.ndarray:
    """The dense perturbation E_i of pair `member` as a flat (d,) vector (tests and small uses only;
    the forward and the update never build it)."""
    f = pair_factors(layout, r, seed, expert, step, member, dtype)
    out = np.empty(layout.size, dtype)
    c = sigma / math.sqrt(r)
    for e in layout.entries:
        v = f[e.name]
        block = c * (v[0] @ v[1].T) if len(e.shape) == 2 else sigma * v
        out[e.offset:e.offset + e.size] = block.ravel()
    return out


# ----------------------------------------------------------------------------- population forward

def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1/(1+exp(-x)), without overflow


_FUSE_MAX_FRACTION = 0.25  # fuse x @ [W | A_0..A_P-1] while P*r <= this fraction of W's columns


def _fast_cell() -> bool:
    """Whether float32 populations use zosoma.forward's compiled kernels (numba) for the LSTM gate
    math and the log-softmax + NLL; the NumPy path (always used for float64) is the readable
    equivalent, and the tests check both."""
    return _USE_NUMBA_CELL


_USE_NUMBA_CELL = True


def _lstm_cell(*args):
    from .forward import _lstm_cell as cell  # compiled on first use
    return cell(*args)


def _output_rows(*args):
    from .forward import _output_rows as rows  # compiled on first use
    return rows(*args)


class _Projector:
    """x @ W for all members' rows stacked, plus each member's x_j @ A_i (its pair's factor).

    When P*r is small next to W's width, both come from ONE GEMM x @ [W | A_0 | ... | A_{P-1}] and
    the block-diagonal x_j @ A_i are picked out (the off-diagonal P*r columns are wasted, cheaply);
    otherwise x @ W is one GEMM and x_j @ A_i a batched matmul per pair."""

    def __init__(self, w, a):  # w (m, n); a (P, m, r)
        self.P, m, self.r = a.shape
        self.n = w.shape[1]
        self.a = a
        self.fused = self.P * self.r <= _FUSE_MAX_FRACTION * self.n
        if self.fused:
            self.w = np.ascontiguousarray(
                np.concatenate([w, a.transpose(1, 0, 2).reshape(m, self.P * self.r)], axis=1))
        else:
            self.w = w
        self.pick = np.arange(self.P)

    def __call__(self, x):
        """x (P, 2, R, m) -> dense (P, 2, R, n), xa (P, 2, R, r)."""
        P, _, R, m = x.shape
        y = (x.reshape(-1, m) @ self.w).reshape(P, 2, R, -1)
        if self.fused:
            ext = y[..., self.n:].reshape(P, 2, R, P, self.r)
            return y[..., :self.n], ext[self.pick, :, :, self.pick, :]  # (P, 2, R, r)
        xa = np.matmul(x.reshape(P, 2 * R, m), self.a).reshape(P, 2, R, self.r)
        return y, xa


def eggroll_population_loss(theta, layout: Layout, batch, sigma: float, r: int, seed: int,
                            expert: int, step: int, n_pairs: int) -> np.ndarray:
    """Mean nats/byte of each of the N = 2*n_pairs population members theta +/- E_i (member 2i is
    +E_i, 2i+1 is -E_i), from zero state, on the shared (B, T+1) uint8 batch. Returns (N,) float64.
    Equal (to rounding) to zosoma.reference.loss of the materialised theta +/- E_i.

    Per LSTM step and layer the work is one dense GEMM over all N*B rows, (h @ [w_hh | A's]), and
    one batched rank-k product per pair [s c h A_hh | input and bias terms] @ [B_hh^T; ...]."""
    theta = np.asarray(theta)
    if theta.ndim != 1 or theta.shape[0] != layout.size:
        raise ValueError(f"theta must be ({layout.size},), got {theta.shape}")
    batch = np.asarray(batch)
    if batch.dtype != np.uint8 or batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be a (B, T+1) uint8 array with T >= 1, got {batch.dtype} "
                         f"{batch.shape}")
    if n_pairs < 1:
        raise ValueError(f"n_pairs must be at least 1, got {n_pairs}")
    r = _check_rank(r)
    dt = theta.dtype
    P, M = n_pairs, 2 * n_pairs
    cfg = layout.config
    H, L = cfg.hidden, cfg.layers
    tokens = batch[:, :-1].astype(np.intp)
    B, T = tokens.shape
    p = layout.views(theta)
    f = population_factors(layout, r, seed, expert, step, P, dt)
    c = dt.type(sigma / math.sqrt(r))
    sgn = np.array([1.0, -1.0], dt)[None, :, None, None]  # member sign, broadcast (1, 2, 1, 1)
    sig = np.broadcast_to(sgn * dt.type(sigma), (P, 2, 1, 1))  # coefficient of the vector noise

    def bt(name):  # (P, r, n)
        return np.swapaxes(f[name][1], 1, 2)

    # ---- layer 0 input: every member reads the same bytes, so the dense part is the shared table
    # (embed @ w_ih + bias)[tok]; the member part is rank (2r+1) through per-pair (V, .) tables:
    # (W_e + s c A_e B_e^T)(W_ih + s c A_ih B_ih^T)
    #   = W_e W_ih + s c A_e (B_e^T W_ih) + [s c W_e A_ih + c^2 A_e (B_e^T A_ih)] B_ih^T   (s^2 = 1)
    w_e, w_ih = p["embed"], p["lstm0.w_ih"]
    a_e, _ = f["embed"]  # (P, V, r)
    a_ih, _ = f["lstm0.w_ih"]  # (P, E, r)
    bt_e = bt("embed")  # (P, r, E)
    table = w_e @ w_ih + p["lstm0.bias"]  # (V, 4H)
    dense_in = table[tokens.T][:, None, None]  # (T, 1, 1, B, 4H), shared by all members
    g = np.matmul(w_e[None], a_ih)  # (P, V, r)
    aek = np.matmul(a_e, bt_e @ a_ih)  # (P, V, r)
    u_tab = np.concatenate([
        np.broadcast_to(sgn * c * a_e[:, None], (P, 2) + a_e.shape[1:]),
        sgn * c * g[:, None] + (c * c) * aek[:, None],
        np.broadcast_to(sig, (P, 2, VOCAB, 1))], axis=-1)  # (P, 2, V, 2r+1)
    u_in = np.ascontiguousarray(np.moveaxis(u_tab[:, :, tokens.T], 2, 0))  # (T, P, 2, B, 2r+1)
    v_in = np.concatenate([bt_e @ w_ih, bt("lstm0.w_ih"), f["lstm0.bias"][:, None]], axis=1)

    fast_cell = dt == np.float32 and _fast_cell()
    zero_x = np.zeros((1, 4 * H), dt)
    zero_rows = np.zeros(M * B, np.intp)
    hs = None
    for layer in range(L):
        if layer > 0:  # input projection of all members' rows: one GEMM, plus the A_ih picks
            x = hs.reshape(P, 2, T * B, H)  # hs is time-major per member: (P, 2, T, B, H)
            d, xa = _Projector(p[f"lstm{layer}.w_ih"], f[f"lstm{layer}.w_ih"][0])(x)
            dense_in = np.moveaxis((d + p[f"lstm{layer}.bias"]).reshape(P, 2, T, B, 4 * H), 2, 0)
            xa = np.moveaxis(xa.reshape(P, 2, T, B, r), 2, 0)
            u_in = np.concatenate([sgn * c * xa, np.broadcast_to(sig[None], (T, P, 2, B, 1))],
                                  axis=-1)  # (T, P, 2, B, r+1)
            v_in = np.concatenate([bt(f"lstm{layer}.w_ih"), f[f"lstm{layer}.bias"][:, None]],
                                  axis=1)
        proj_hh = _Projector(p[f"lstm{layer}.w_hh"], f[f"lstm{layer}.w_hh"][0])
        v_all = np.ascontiguousarray(np.concatenate([bt(f"lstm{layer}.w_hh"), v_in], axis=1))
        h = np.zeros((P, 2, B, H), dt)
        cell = np.zeros((P, 2, B, H), dt)
        hs = np.empty((P, 2, T, B, H), dt)
        for t in range(T):
            gates, xa = proj_hh(h)  # one GEMM over all N*B rows
            u = np.concatenate([(sgn * c) * xa, u_in[t]], axis=-1)  # (P, 2, B, k)
            gates = gates + dense_in[t]
            gates += np.matmul(u.reshape(P, 2 * B, -1), v_all).reshape(P, 2, B, 4 * H)
            if fast_cell:  # the Numba cell of zosoma.forward (float32, rational tanh)
                h = np.empty((P, 2, B, H), dt)
                _lstm_cell(gates.reshape(M * B, 4 * H), zero_x, zero_rows, zero_x[0],
                           cell.reshape(M * B, H), h.reshape(M * B, H))
            else:
                i, fg = _sigmoid(gates[..., :H]), _sigmoid(gates[..., H:2 * H])
                gg, o = np.tanh(gates[..., 2 * H:3 * H]), _sigmoid(gates[..., 3 * H:])
                cell = fg * cell + i * gg
                h = o * np.tanh(cell)
            hs[:, :, t] = h

    # ---- output layer: one dense GEMM over all members' rows; then, pair by pair while the block
    # is in cache, the rank-(r+2) member part [s c x A_o | s sigma | 1] @ [B_o^T; e_out.b; out.b]
    # and the log-softmax + NLL
    x = hs.reshape(P, 2 * T * B, H)
    logits = (x.reshape(-1, H) @ p["out.w"]).reshape(P, 2 * T * B, VOCAB)
    xa = np.matmul(x, f["out.w"][0]).reshape(P, 2, T * B, r)
    ones = np.ones((2, T * B, 1), dt)
    v_out = np.concatenate([bt("out.w"), f["out.b"][:, None],
                            np.broadcast_to(p["out.b"], (P, 1, VOCAB))], axis=1)  # (P, r+2, V)
    tgt8 = np.ascontiguousarray(batch[:, 1:].T).reshape(-1)  # time-major, like the rows
    tgt = tgt8.astype(np.intp)
    losses = np.empty(M, np.float64)
    if fast_cell:
        nll = np.empty(T * B, dt)
        fold, zero_b = np.empty(VOCAB // 2, dt), np.zeros(VOCAB, dt)
    for i in range(P):
        u = np.concatenate([(sgn[0] * c) * xa[i], sig[i] * ones, ones], axis=-1)  # (2, TB, r+2)
        block = logits[i]  # (2*T*B, V), contiguous
        block += u.reshape(2 * T * B, -1) @ v_out[i]
        for k in range(2):
            rows = block[k * T * B:(k + 1) * T * B]
            if fast_cell:  # zosoma.forward's compiled log-softmax + NLL
                losses[2 * i + k] = _output_rows(rows, zero_b, tgt8, nll, False, fold) / (T * B)
            else:
                shifted = rows - rows.max(axis=-1, keepdims=True)
                lse = np.log(np.exp(shifted).sum(axis=-1))
                losses[2 * i + k] = np.mean(lse - shifted[np.arange(T * B), tgt], dtype=np.float64)
    return losses


# ---------------------------------------------------------------------------------------- update

def zscore(fitness) -> np.ndarray:
    """Fitness shaping: (f - mean) / std across the population (float64); all zeros when every
    fitness is equal (zero variance), never NaN. Non-finite fitness raises ValueError."""
    f = np.asarray(fitness, np.float64)
    if not np.all(np.isfinite(f)):
        raise ValueError("fitness values must be finite (a member diverged)")
    if f.size == 0 or f.max() == f.min():
        return np.zeros_like(f)
    std = f.std()
    if not std > 1e-12 * max(1.0, float(np.abs(f).max())):
        return np.zeros_like(f)
    return (f - f.mean()) / std


def eggroll_update(theta, layout: Layout, losses, lr: float, sigma: float, r: int, seed: int,
                   expert: int, step: int, shaping=zscore) -> np.ndarray:
    """New theta = theta + lr * N^(-1/2) * sum_j shaping(-losses)_j E_j (no 1/sigma: E_j carries
    sigma, the reference code's convention). losses (2*n_pairs,) from eggroll_population_loss with
    the same (sigma, r, seed, expert, step). Returns a new array of theta's dtype."""
    theta = np.asarray(theta)
    losses = np.asarray(losses, np.float64)
    if losses.ndim != 1 or losses.size < 2 or losses.size % 2:
        raise ValueError(f"losses must be (2*n_pairs,), got {losses.shape}")
    r = _check_rank(r)
    N = losses.size
    P = N // 2
    fz = np.asarray(shaping(-losses), np.float64)
    coef = fz[0::2] - fz[1::2]  # (P,): +E_i weighted by fz_2i, -E_i by fz_2i+1
    scale = lr / math.sqrt(N)
    f = population_factors(layout, r, seed, expert, step, P, np.float64)
    new = theta.astype(np.float64)
    c = sigma / math.sqrt(r)
    for e in layout.entries:
        block = new[e.offset:e.offset + e.size]
        if len(e.shape) == 2:
            a, b = f[e.name]  # (P, m, r), (P, n, r)
            m, n = e.shape
            a_cat = (a * coef[:, None, None]).transpose(1, 0, 2).reshape(m, P * r)
            b_cat = b.transpose(1, 0, 2).reshape(n, P * r)
            block += (scale * c) * (a_cat @ b_cat.T).ravel()
        else:
            block += (scale * sigma) * (coef @ f[e.name])
    return new.astype(theta.dtype)


# ----------------------------------------------------------------------------------------- bench

def bench_eggroll_vs_spsa(model, B: int = 8, T: int = 64, members: int = 16, sigma: float = 1e-2,
                          r: int = 1, repeats: int = 3, seed: int = 0) -> dict:
    """Per-member forward seconds: EGGROLL's shared-GEMM population forward (all `members` at once)
    vs full-rank SPSA's, i.e. `members` dense perturbed copies evaluated one by one by
    zosoma.forward.population_loss: `dense_s_per_member` times the forward alone (copies built
    beforehand), `dense_with_noise_s_per_member` also regenerates the copies (Rademacher, as SPSA
    trains). EGGROLL's time includes regenerating its factors. Best of `repeats` after one
    warm-up; speedup = dense forward / EGGROLL. `model` is a ModelConfig or Layout. Returns a
    dict."""
    from . import forward  # numba-compiled; imported lazily
    from .noise import add_noise

    layout = model if isinstance(model, Layout) else Layout(model)
    if members < 2 or members % 2:
        raise ValueError(f"members must be even and >= 2, got {members}")
    theta = init_params(layout.config, seed)
    batch = np.random.default_rng(seed).integers(0, VOCAB, (B, T + 1), dtype=np.uint8)
    thetas = np.empty((members, layout.size), np.float32)
    for j in range(members):
        add_noise(thetas[j], theta, (1 - 2 * (j % 2)) * sigma, seed, 0, 0, j // 2)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_egg = best(lambda: eggroll_population_loss(theta, layout, batch, sigma, r, seed, 0, 0,
                                                 members // 2))
    t_dense = best(lambda: forward.population_loss(thetas, layout, batch))

    def dense_with_noise():  # SPSA as trained: regenerate each perturbed copy, then evaluate
        for j in range(members):
            add_noise(thetas[j], theta, (1 - 2 * (j % 2)) * sigma, seed, 0, 0, j // 2)
        forward.population_loss(thetas, layout, batch)

    t_dense_noise = best(dense_with_noise)
    cfg = layout.config
    return {"embed": cfg.embed, "hidden": cfg.hidden, "layers": cfg.layers, "params": layout.size,
            "batch": B, "seq_len": T, "members": members, "rank": r,
            "eggroll_s_per_member": t_egg / members, "dense_s_per_member": t_dense / members,
            "dense_with_noise_s_per_member": t_dense_noise / members,
            "speedup": t_dense / t_egg}
