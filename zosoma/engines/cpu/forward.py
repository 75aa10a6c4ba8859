"""The fast CPU forward: Numba kernels around BLAS, checked against zosoma.model.reference.

Shapes: M population members, P pairs of members, B batch, T time, E embedding, H hidden, G = 4H
gates, V = 256, L layers.

One member's forward (`_member_forward`, time loop compiled, so small models pay no Python
overhead per step) does, per chunk of Tc timesteps:

    layer 0:   x_t @ w_ih is a row of the table embed @ w_ih (U, G) over the U distinct bytes of
               the batch, computed once per member and gathered (an exact identity; U*E*G
               multiply-adds instead of B*T*E*G, U <= 256, about 60 for the tiny preset's 256
               bytes of text)
    layer l>0: the input projection of all Tc steps as one (Tc*B, H) @ (H, G) GEMM
    each step: the recurrent GEMM, for B <= 32 rows and H >= 32 in the transposed orientation
               gates^T (G, B) = w_hh^T (G, H) @ h^T (H, B) (w_hh^T copied once per call;
               OpenBLAS runs this shape 1.5-2.8x faster than h (B, H) @ w_hh at B = 8..32,
               H = 64..512), else gates = h @ w_hh; then `lstm_cell_rows` adds the input
               projection and bias and applies the gate and cell math in one vectorised pass
               (rational tanh, no libm calls) on the gates in (B, G) rows (transposed back: a
               copy that costs a tenth of what the orientation saves)
    output:    logits = h @ out.w, max(128, 4H) rows at a time (the block stays in cache), then
               `output_rows`: log-softmax + NLL per row in float32 with a vectorisable exp
               (2**-k by a bit cast), the loss sum accumulated in float64

Small models (GEMM_ENV, uses_loops) run every GEMM above as compiled loops instead (`_small_dot`,
no BLAS call; logits one timestep's B rows at a time): at B = 8 and H = 20..64 a BLAS call costs
more than its arithmetic. The two paths differ only in the GEMMs' summation order.

Members run one after another with their own dense weights, so each member's weights stay in
cache (stacking members' weights into one batched matmul streams them from RAM: at 4.46M
parameters it ran at about half the speed, on the development machine), and the members are
spread over threads (zosoma.engines.cpu.threads), each thread running whole members with
one-thread BLAS; the kernels themselves are serial (Numba's parallel=True gate kernels beside
BLAS threads ran 10-40x slower there). A single member's batch rows are split over the threads
instead.

A dense population (`perturbed_sums`) is never materialised: each thread builds a pair's two
members theta + sign_m * scale * delta_{direction_m}, as the population's member table says, from
the counters (zosoma.model.noise) into its own two buffers right before their forwards, one noise
pass for an antithetic pair's two members, one pass each otherwise.

Everything here stays valid Python, so the suite can run with NUMBA_DISABLE_JIT=1.
The cell and output kernels on the rows, with their float32 tanh, sigmoid and exp, are
zosoma.engines.cpu.row_kernels', which every CPU forward shares.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
from numba import njit

from zosoma.config import VOCAB
from zosoma.engines.cpu import noise_kernels, threads
from zosoma.engines.cpu.row_kernels import JIT_OPTIONS, lstm_cell_rows, output_rows
from zosoma.errors import ConfigError
from zosoma.model import noise
from zosoma.model.params import Layout

# the thread-parallel entry points release the GIL (zosoma.engines.cpu.threads)
_NOGIL = dict(JIT_OPTIONS, nogil=True)

_ROWS_PER_CHUNK = 1024  # target Tc*B: big enough for an efficient GEMM, small enough for cache
# The recurrent GEMM runs transposed up to this many rows and from this hidden size: from 64 rows
# at H = 512, and at H = 16 (a GEMM too small to repay the two transposes), h @ w_hh was faster.
_TRANSPOSED_MAX_ROWS = 32
_TRANSPOSED_MIN_HIDDEN = 32
# Logits rows per output GEMM: few enough that the block is still in cache when the softmax reads
# it, enough for an efficient GEMM; measured best: 128 rows at H = 16, 256 at H = 64, 1,024 from
# H = 176 on (a small K makes the GEMM cheap and the softmax's memory traffic the cost).
_OUTPUT_ROWS_PER_H = 4
_OUTPUT_ROWS_MIN = 128
# The GEMMs as BLAS calls (the default) or as compiled loops (_small_dot), as GEMM_ENV says. The
# loops are 1.17-1.35x faster at SOMA's expert shapes against OpenBLAS's Haswell kernels but
# 0.85-1.00x against its SkylakeX kernels (what an AVX-512 machine gets by default), and they sum
# in another order (a run's bits differ at 1e-6): so they are a choice, not the default
# (results/bench-spsa-shapes-after.txt).
GEMM_ENV = "ZOSOMA_CPU_GEMM"
GEMM_PATHS = ("blas", "loops")
_PAIRS_PER_ITEM = 4  # SPSA pairs per thread work item (perturbed_sums)

_ZERO = np.float32(0.0)


@njit(**JIT_OPTIONS)
def _transpose(a, out):
    """out (n, m) = a (m, n)^T for small a (a timestep's rows): each output row in one pass."""
    m, n = a.shape
    for j in range(n):
        oj = out[j]
        for i in range(m):
            oj[i] = a[i, j]


@njit(**JIT_OPTIONS)
def _transpose_tiled(a, out):
    """out (n, m) = a (m, n)^T for a large a (a weight matrix), through a 16 x 16 tile buffer:
    rows of a weight matrix lie a power of two apart, and reading them in place would thrash the
    cache sets."""
    m, n = a.shape
    tile = np.empty((16, 16), np.float32)
    for i0 in range(0, m, 16):
        i1 = min(i0 + 16, m)
        for j0 in range(0, n, 16):
            j1 = min(j0 + 16, n)
            for i in range(i0, i1):
                for j in range(j0, j1):
                    tile[j - j0, i - i0] = a[i, j]
            for j in range(j0, j1):
                for i in range(i0, i1):
                    out[j, i] = tile[j - j0, i - i0]


@njit(inline="always", **JIT_OPTIONS)
def _dot_rows2(xa, xb, w, a, b):
    """a = xa @ w and b = xb @ w (xa, xb (K,); w (K, N); a, b (N,)): four rows of w at a time, so
    each weight loaded serves both rows and each output element is loaded and stored once per
    four multiply-adds; the loops over N vectorise."""
    K, N = w.shape
    for j in range(N):
        a[j] = _ZERO
        b[j] = _ZERO
    k = 0
    while k + 4 <= K:
        w0, w1, w2, w3 = w[k], w[k + 1], w[k + 2], w[k + 3]
        a0, a1, a2, a3 = xa[k], xa[k + 1], xa[k + 2], xa[k + 3]
        b0, b1, b2, b3 = xb[k], xb[k + 1], xb[k + 2], xb[k + 3]
        for j in range(N):
            a[j] += (a0 * w0[j] + a1 * w1[j]) + (a2 * w2[j] + a3 * w3[j])
            b[j] += (b0 * w0[j] + b1 * w1[j]) + (b2 * w2[j] + b3 * w3[j])
        k += 4
    while k < K:
        wk = w[k]
        ak, bk = xa[k], xb[k]
        for j in range(N):
            a[j] += ak * wk[j]
            b[j] += bk * wk[j]
        k += 1


@njit(**JIT_OPTIONS)
def _small_dot(x, w, out, spare):
    """out (R, N) = x (R, K) @ w (K, N) in compiled loops, for the small models whose forward
    pays more for a BLAS call per timestep than for its arithmetic; rows two at a time (an odd
    last row is paired with itself, its twin written to spare (N,)). Sums run in a fixed order,
    so a member's losses do not depend on the thread or the rows beside it."""
    R = x.shape[0]
    for r in range(0, R - 1, 2):
        _dot_rows2(x[r], x[r + 1], w, out[r], out[r + 1])
    if R % 2:
        _dot_rows2(x[R - 1], x[R - 1], w, out[R - 1], spare)


@njit(**JIT_OPTIONS)
def _transposed(B, H):
    """Whether the recurrent GEMM of B rows and hidden size H runs transposed."""
    return B <= _TRANSPOSED_MAX_ROWS and H >= _TRANSPOSED_MIN_HIDDEN


@njit(**JIT_OPTIONS)
def _workspace(E, H, L, B, T, rows_per_chunk, loops):
    """Work buffers for one member's forward, reused across members and timesteps; `loops`:
    its GEMMs are _small_dot's loops (its logits one timestep's B rows at a time), else BLAS's."""
    Tc = max(1, min(T, (rows_per_chunk + B - 1) // B))
    G = 4 * H
    table = np.empty((VOCAB, G), np.float32)  # embed @ w_ih of layer 0, rows of the batch's bytes
    embed_rows = np.empty((VOCAB, E), np.float32)  # their embeddings
    slot = np.empty(VOCAB, np.intp)  # byte -> its table row, -1 when absent
    xproj = np.empty((Tc * B, G), np.float32)  # input projection of layers >= 1, one chunk
    gates = np.empty((B, G), np.float32)
    hs = np.empty((Tc, B, H), np.float32)  # one layer's outputs over the chunk
    out_rows = B if loops else min(Tc * B, max(_OUTPUT_ROWS_MIN, _OUTPUT_ROWS_PER_H * H))
    logits = np.empty((out_rows, VOCAB), np.float32)
    rows = np.empty(B, np.intp)
    row_targets = np.empty(Tc * B, np.uint8)
    row_nll = np.empty(Tc * B, np.float32)
    fold = np.empty(VOCAB // 2, np.float32)
    Lt = L if _transposed(B, H) and not loops else 0
    w_hh_t = np.empty((Lt, G, H), np.float32)  # w_hh^T of each layer (transposed orientation only)
    gates_t = np.empty((G, B), np.float32)
    h_t = np.empty((H, B), np.float32)
    spare = np.empty(max(VOCAB, G), np.float32)  # _small_dot's odd row
    return (table, embed_rows, slot, xproj, gates, hs, logits, rows, row_targets, row_nll, fold, w_hh_t,
            gates_t, h_t, loops, spare)


@njit(**JIT_OPTIONS)
def _matmul(x, w, out, loops, spare):
    """out = x @ w: _small_dot's compiled loops when `loops`, else BLAS (Numba's np.dot)."""
    if loops:
        _small_dot(x, w, out, spare)
    else:
        np.dot(x, w, out)


@njit(**JIT_OPTIONS)
def _member_forward(theta, offsets, E, H, tokens, targets, h, c, want_nll, nll_out, want_logp,
                    logp_out, ws, scored_from=0):
    """One model over one batch, time loop inside. theta (d,) float32; offsets (2 + 3L + 2,) of
    embed, (w_ih, w_hh, bias) per layer, out.w, out.b; tokens, targets (B, T) uint8; h, c
    (L, B, H) carried state, updated in place; nll_out (B, T) and logp_out (B, T, V) written when
    wanted (else may be empty). Positions t < scored_from only carry the state: no logits (their
    nll is 0, not counted). Returns the float64 sum of the scored nlls."""
    (table, embed_rows, slot, xproj, gates, hs, logits, rows, row_targets, row_nll, fold, w_hh_t, gates_t,
     h_t, loops, spare) = ws
    L = h.shape[0]
    B, T = tokens.shape
    Tc = hs.shape[0]
    G = 4 * H
    o = offsets[0]
    embed = theta[o:o + VOCAB * E].reshape((VOCAB, E))
    slot[:] = -1
    U = 0
    for b in range(B):
        for t in range(T):
            v = tokens[b, t]
            if slot[v] < 0:
                slot[v] = U
                embed_rows[U] = embed[v]
                U += 1
    o = offsets[1]
    _matmul(embed_rows[:U], theta[o:o + E * G].reshape((E, G)), table[:U], loops, spare)
    transposed = _transposed(B, H) and not loops
    for layer in range(L):
        if transposed:
            o = offsets[3 * layer + 2]
            _transpose_tiled(theta[o:o + H * G].reshape((H, G)), w_hh_t[layer])
    o = offsets[3 * L + 1]
    out_w = theta[o:o + H * VOCAB].reshape((H, VOCAB))
    o = offsets[3 * L + 2]
    out_b = theta[o:o + VOCAB]
    total = 0.0
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        for layer in range(L):
            o = offsets[3 * layer + 3]
            bias = theta[o:o + G]
            if layer > 0:
                o = offsets[3 * layer + 1]
                w_ih = theta[o:o + H * G].reshape((H, G))
                _matmul(hs[:n].reshape((n * B, H)), w_ih, xproj[:n * B], loops, spare)
            for t in range(n):
                h_prev = h[layer] if t == 0 else hs[t - 1]
                if transposed:
                    _transpose(h_prev, h_t)
                    np.dot(w_hh_t[layer], h_t, gates_t)
                    _transpose(gates_t, gates)
                else:
                    o = offsets[3 * layer + 2]
                    _matmul(h_prev, theta[o:o + H * G].reshape((H, G)), gates, loops, spare)
                if layer == 0:
                    for b in range(B):
                        rows[b] = slot[tokens[b, t0 + t]]
                    lstm_cell_rows(gates, table, rows, bias, c[layer], hs[t])
                else:
                    for b in range(B):
                        rows[b] = t * B + b
                    lstm_cell_rows(gates, xproj, rows, bias, c[layer], hs[t])
            h[layer] = hs[n - 1]
        R = n * B
        h_rows = hs[:n].reshape((R, H))
        for t in range(n):
            for b in range(B):
                row_targets[t * B + b] = targets[b, t0 + t]
        skip = min(n, max(0, scored_from - t0)) * B  # rows before scored_from: state only
        first = skip - skip % logits.shape[0]  # whole blocks only: the scored rows' GEMMs stay the same
        row_nll[:first] = 0.0
        for r0 in range(first, R, logits.shape[0]):  # logits in blocks that stay in cache for the softmax
            r1 = min(R, r0 + logits.shape[0])
            block = logits[:r1 - r0]
            _matmul(h_rows[r0:r1], out_w, block, loops, spare)
            total += output_rows(block, out_b, row_targets[r0:r1], row_nll[r0:r1], want_logp, fold)
            if want_logp:
                for r in range(r0, r1):
                    logp_out[r % B, t0 + r // B] = block[r - r0]
        for r in range(first, skip):
            total -= row_nll[r]
            row_nll[r] = 0.0
        if want_nll:
            for t in range(n):
                for b in range(B):
                    nll_out[b, t0 + t] = row_nll[t * B + b]
    return total


@njit(**_NOGIL)
def _members_sums(thetas, members, rows, offsets, E, H, L, batches, sums, ws):
    """sums[i] = summed nll of member members[i] on batch rows rows[0]:rows[1]. thetas (M, d);
    batches (1 or M, B, T+1) uint8, one shared by all members or one per member; ws: _workspace
    for rows[1] - rows[0] rows."""
    n_batches, _, T1 = batches.shape
    T = T1 - 1
    B = rows[1] - rows[0]
    tokens = np.empty((B, T), np.uint8)
    targets = np.empty((B, T), np.uint8)
    h = np.empty((L, B, H), np.float32)
    c = np.empty((L, B, H), np.float32)
    none2 = np.empty((0, 0), np.float32)
    none3 = np.empty((0, 0, VOCAB), np.float32)
    for i in range(members.shape[0]):
        m = members[i]
        batch = batches[m if n_batches > 1 else 0, rows[0]:rows[1]]
        tokens[:, :] = batch[:, :T]
        targets[:, :] = batch[:, 1:]
        h[:] = 0.0
        c[:] = 0.0
        sums[i] = _member_forward(thetas[m], offsets, E, H, tokens, targets, h, c,
                                  False, none2, False, none3, ws)


@njit(**_NOGIL)
def _pair_sums(theta, offsets, E, H, L, batch, scale, kind, k0, k1, expert, step, direction, sign, plus, minus,
               bufs, deltas, ws):
    """plus[i], minus[i] = summed nll of members 2i and 2i+1 of a member table (direction int32,
    sign float32, (2n,)): theta + sign_m * scale * delta_{direction_m}, both built from the
    counters into bufs (2, d) right before their forwards (as zosoma.engines.ops.perturbed builds them).
    batch (B, T+1) uint8; deltas (D, d) keeps each direction at its row, or is empty; ws: _workspace."""
    B, T1 = batch.shape
    T = T1 - 1
    tokens = np.ascontiguousarray(batch[:, :T])
    targets = np.ascontiguousarray(batch[:, 1:])
    h = np.empty((L, B, H), np.float32)
    c = np.empty((L, B, H), np.float32)
    none2 = np.empty((0, 0), np.float32)
    none3 = np.empty((0, 0, VOCAB), np.float32)
    none = deltas[0:0, 0]
    for i in range(plus.shape[0]):
        a, b = direction[2 * i], direction[2 * i + 1]
        if a == b and sign[2 * i] == -sign[2 * i + 1]:  # antithetic: one generation for both
            noise_kernels.antithetic_pair(bufs[0], bufs[1], theta, sign[2 * i] * scale, kind, k0, k1, a, step, expert,
                                          deltas[a] if deltas.shape[0] else none)
        else:
            noise_kernels.antithetic_pair(bufs[0], none, theta, sign[2 * i] * scale, kind, k0, k1, a, step, expert,
                                          deltas[a] if deltas.shape[0] else none)
            noise_kernels.antithetic_pair(bufs[1], none, theta, sign[2 * i + 1] * scale, kind, k0, k1, b, step,
                                          expert, deltas[b] if deltas.shape[0] else none)
        for s in range(2):
            h[:] = 0.0
            c[:] = 0.0
            total = _member_forward(bufs[s], offsets, E, H, tokens, targets, h, c,
                                    False, none2, False, none3, ws)
            if s == 0:
                plus[i] = total
            else:
                minus[i] = total


def gemm_path() -> str:
    """The forward's GEMMs as the environment asks (GEMM_ENV): "blas" (the default) or "loops"."""
    path = os.environ.get(GEMM_ENV, "") or "blas"
    if path not in GEMM_PATHS:
        raise ConfigError(f"{GEMM_ENV} must be one of {', '.join(GEMM_PATHS)}, got {path!r}")
    return path


@contextmanager
def forced_gemm(path: str):
    """GEMM_ENV set to `path` ("blas", "loops") inside the block (`zosoma bench spsa` times both)."""
    before = os.environ.get(GEMM_ENV)
    os.environ[GEMM_ENV] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ[GEMM_ENV]
        else:
            os.environ[GEMM_ENV] = before


def uses_loops(config, B: int) -> bool:
    """Whether the forward of a model (ModelConfig) on B batch rows runs its GEMMs as compiled
    loops (_small_dot) rather than BLAS calls: as GEMM_ENV says (the model and B do not decide it
    today; kept in the signature for a rule by shape once one pays on every BLAS kernel)."""
    return gemm_path() == "loops"


def _offsets(layout: Layout) -> np.ndarray:
    return _config_offsets(layout.config)


@lru_cache(maxsize=64)
def _config_offsets(config) -> np.ndarray:
    layout = Layout(config)
    names = ["embed"]
    for layer in range(config.layers):
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


def _check_batch(batch, M: int | None) -> np.ndarray:
    """batch (B, T+1), or (M, B, T+1) when M is given, as a contiguous uint8 array with T >= 1."""
    batch = np.asarray(batch)
    batches = _check_bytes(batch[None] if batch.ndim == 2 else batch, "batch", 3)
    if batches.shape[0] not in (1, M or 1) or batches.shape[2] < 2:
        per = f" or (M={M}, B, T+1)" if M else ""
        raise ValueError(f"batch must be (B, T+1){per} with T >= 1, got {batch.shape}")
    return batches


def _row_blocks(M: int, B: int) -> list:
    """How to cut M members x B rows into work items: whole members when there are enough of
    them for the threads, else each member's rows in blocks."""
    n = threads.n_threads()
    parts = 1 if M >= n else -(-n // M)
    return [(r.start, r.stop) for r in threads.split(B, parts)]


def population_loss(thetas, layout: Layout, batch) -> np.ndarray:
    """Mean nats per predicted byte of each member, from zero state.

    thetas (M, d) float32, one parameter vector per member (e.g. the 2P perturbed copies of a
    model); batch (B, T+1) uint8 shared by all members, or (M, B, T+1) one per member; inputs
    batch[..., :-1], targets batch[..., 1:]. Returns (M,) float64.
    """
    thetas = _check_theta(thetas, layout, 2)
    batches = _check_batch(batch, thetas.shape[0])
    cfg = layout.config
    M, (B, T) = thetas.shape[0], (batches.shape[1], batches.shape[2] - 1)
    blocks = _row_blocks(M, B)
    sums = np.zeros((M, len(blocks)))
    offsets = _offsets(layout)

    def work(item, workspaces):  # workspaces: this thread's, by block size
        m, r = divmod(item, len(blocks))
        a, b = blocks[r]
        if b - a not in workspaces:
            workspaces[b - a] = _workspace(cfg.embed, cfg.hidden, cfg.layers, b - a, T, _ROWS_PER_CHUNK,
                                           uses_loops(cfg, b - a))
        out = np.empty(1)
        _members_sums(thetas, np.array([m]), np.array([a, b]), offsets, cfg.embed, cfg.hidden, cfg.layers,
                      batches, out, workspaces[b - a])
        sums[m, r] = out[0]

    threads.run_items(work, M * len(blocks), dict)
    return sums.sum(axis=1) / (B * T)


def perturbed_sums(theta, layout: Layout, batch, scale: float, seed: int, expert: int, step: int,
                   kind: str, pairs: range, deltas: np.ndarray | None = None,
                   table: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean nats per predicted byte of the members of pairs `pairs` of a member table
    (zosoma.model.population): "plus" of member 2k, "minus" of member 2k+1, member m = theta +
    sign_m * scale * delta_{direction_m}, delta_j = noise(seed, expert, step, j, kind); each
    (len(pairs),) float64. table: (direction int32, sign float32) of the pairs' 2 len(pairs)
    members, or None for antithetic pairs (member 2k = (k, +1), 2k+1 = (k, -1)). theta (d,)
    float32; batch (B, T+1) uint8. The members are built from the counters inside the forward
    (two buffers per thread), never all at once; deltas (D, d) float32, if given, receives each
    direction at its row."""
    theta = _check_theta(theta, layout, 1)
    batch = _check_batch(batch, None)[0]
    cfg = layout.config
    k0, k1 = noise.stream_key(seed)
    code = noise.kind_code(kind)
    n = len(pairs)
    if table is None:
        direction = np.repeat(np.arange(pairs.start, pairs.stop, dtype=np.int32), 2)
        sign = np.tile(np.array([1, -1], np.float32), n)
    else:
        direction, sign = np.array(table[0], np.int32), np.array(table[1], np.float32)  # writable: one Numba type
        if direction.shape != (2 * n,) or sign.shape != (2 * n,):
            raise ValueError(f"the member table of {n} pairs must hold 2 x {n} directions and signs, "
                             f"got {direction.shape} and {sign.shape}")
    plus, minus = np.empty(n), np.empty(n)
    offsets = _offsets(layout)

    kept = np.empty((0, theta.size), np.float32) if deltas is None else deltas
    B, T = batch.shape[0], batch.shape[1] - 1
    loops = uses_loops(cfg, B)

    def buffers():  # per thread: the pair's two members and the forward's work buffers
        return (np.empty((2, theta.size), np.float32),
                _workspace(cfg.embed, cfg.hidden, cfg.layers, B, T, _ROWS_PER_CHUNK, loops))

    # a few pairs per work item: a call into _pair_sums costs about 10 us of dispatch, 5% of a
    # small model's pair; at least 4 items per thread keep the threads evenly loaded
    per_item = max(1, min(_PAIRS_PER_ITEM, n // (4 * threads.n_threads())))

    def work(item, state):
        i, j = item * per_item, min(n, (item + 1) * per_item)
        _pair_sums(theta, offsets, cfg.embed, cfg.hidden, cfg.layers, batch, np.float32(scale), code, k0, k1,
                   expert, step, direction[2 * i:2 * j], sign[2 * i:2 * j], plus[i:j], minus[i:j], state[0],
                   kept, state[1])

    threads.run_items(work, -(-n // per_item), buffers)
    return plus / (B * T), minus / (B * T)


def _stream(theta, layout: Layout, tokens, targets, state, want_nll: bool, want_logp: bool, scored_from: int = 0):
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
    offsets = _offsets(layout)
    blocks = _row_blocks(1, B)

    def work(item, _):
        a, b = blocks[item]
        hb, cb = np.ascontiguousarray(h[:, a:b]), np.ascontiguousarray(c[:, a:b])
        nb = nll[a:b] if want_nll else nll
        lb = logp[a:b] if want_logp else logp
        _stream_rows(theta, offsets, cfg.embed, H, L, tokens[a:b], targets[a:b], hb, cb, want_nll, nb,
                     want_logp, lb, _ROWS_PER_CHUNK, scored_from, uses_loops(cfg, b - a))
        h[:, a:b], c[:, a:b] = hb, cb

    threads.run_items(work, len(blocks))
    return nll, logp, [(h[layer], c[layer]) for layer in range(L)]


@njit(**_NOGIL)
def _stream_rows(theta, offsets, E, H, L, tokens, targets, h, c, want_nll, nll, want_logp, logp,
                 rows_per_chunk, scored_from, loops):
    B, T = tokens.shape
    ws = _workspace(E, H, L, B, T, rows_per_chunk, loops)
    _member_forward(theta, offsets, E, H, np.ascontiguousarray(tokens), np.ascontiguousarray(targets),
                    h, c, want_nll, nll, want_logp, logp, ws, scored_from)


def nll_stream(theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):
    """Nats of each target byte under one model, carrying state across calls so a long text can be
    evaluated segment by segment. theta (d,) float32; tokens, targets (B, T) uint8; state None
    (zeros) or one (h, c) pair of (B, H) per layer, as reference.zero_state. Returns nll (B, T)
    float32 and the state after the last step. Columns before scored_from are context only: the
    state runs through them, their output layer is skipped and their nll is 0."""
    nll, _, state = _stream(theta, layout, tokens, targets, state, True, False, scored_from)
    return nll, state


def log_probs(theta, layout: Layout, tokens, state=None):
    """Next-byte log-probabilities of one model at every position. theta (d,) float32; tokens
    (B, T) uint8; state as in nll_stream. Returns logp (B, T, V) float32 and the final state."""
    _, logp, state = _stream(theta, layout, tokens, None, state, False, True)
    return logp, state
