"""The CUDA engine's population forward (kernels/lstm.cu + cuBLAS), dense and EGGROLL's low-rank.

The forward (shapes: M members, B batch, T time, E embed, H hidden, G = 4H, V = 256, L layers):
every member has its own weights, so every GEMM is batched over members (cuBLAS strided-batched
through cupy.matmul) and the rest is two raw kernels from kernels/lstm.cu:

    table  = embed @ w_ih of layer 0           (M, V, E) x (M, E, G): the input projection of every
                                               byte, gathered by token as zosoma.engines.cpu.forward does
    per chunk of Tc timesteps (Tc * B ~ 1024 rows), per layer:
        xproj = hs_below @ w_ih                (M, Tc*B, H) x (M, H, G), layers >= 1
        per step: gates = h @ w_hh             (M, B, H) x (M, H, G)
                  lstm_cell_*: gates + input projection + bias -> i, f, g, o -> c, h
        logits = hs @ out.w                    (M, Tc*B, H) x (M, H, V)
        log_softmax_nll: + out.b, log-softmax, nll of the targets

The recurrent GEMM reads every member's w_hh at every step, so the forward is bound by memory
bandwidth at small B; batching members amortises the kernel launches, not those reads.

An SPSA step's population of a small model (one member's weights and state within a block's
shared memory: fused_forward.fits) runs instead as ONE launch of kernels/fused.cu, which builds
each member from its counters and runs the whole forward inside a block (fused_forward). The
forward above can also be captured once as a CUDA graph and replayed (graph_forward; the "graph"
path, the default where the kernels path is bound by launches: step_path). `forced_path` picks a
path for benchmarks and tests.

EGGROLL's population (eggroll_population_loss) shares one theta: members 2i, 2i+1 use
W +/- c A_i B_i^T, so each product above becomes ONE GEMM of all members' rows with the shared W
plus two skinny batched GEMMs for the rank-r corrections (x @ A_i, then @ B_i^T); the same kernels
do the rest. The factors are sliced from each pair's Gaussian stream, generated on the device by
the perturb kernel.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.config import VOCAB
from zosoma.engines.cuda import custom_kernels, fused_forward, graph_forward
from zosoma.engines.cuda.cuda_noise import antithetic, perturb, perturbed, plain_rows
from zosoma.engines.cuda.custom_kernels import runtime, to_device
from zosoma.model.noise import KINDS, noise_length, split_factors
from zosoma.model.params import Layout

# an SPSA step's population forward: fused.cu; the per-timestep kernels captured as a graph; the kernels
PATHS = ("fused", "graph", "kernels")
_forced_path = None
ROWS_PER_CHUNK = 1024  # target Tc*B rows of the per-chunk GEMMs (as zosoma.engines.cpu.forward)
WORKSPACE_BYTES = 4 << 30  # device memory the forward may use for work buffers, per call
# What member chunks promise: the same bits in emulation, where a member's products do not depend on
# the others; on a device, cuBLAS chooses its batched GEMM by the batch count, so chunks of other
# sizes agree within this relative tolerance (1.7e-8 measured on an H200: 1 ulp of the float32 nll)
CHUNK_RTOL = 1e-6
# The kernels path on the H200 of 2026-12-04 (results/gpu-check.txt): the host spends about 42 us per
# launch (Python, CuPy's dispatch, cuBLAS's), and the paper expert's forward ran at 1.85M tokens/s x
# 8.17 MFLOP/token = 15 TFLOP/s. Below 42 us of device work per launch the step waits on the host.
HOST_S_PER_LAUNCH = 42e-6
DEVICE_FLOPS = 15e12


@contextlib.contextmanager
def forced_path(path: str):
    """SPSA steps inside the block take `path` (one of PATHS) whatever the model's size (`zosoma
    bench spsa --launches` and studies/gpu_check.py time each)."""
    global _forced_path
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    before, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = before


def step_path(layout: Layout, B: int, T: int, M: int) -> str:
    """The path of an SPSA step's population forward, M members per forward (a chunk) on B rows of
    T steps: fused where a member fits shared memory (2 launches a step: docs/gpu.md); else the
    graph where the kernels path is bound by launches, i.e. where its device work per launch
    (FLOPs at DEVICE_FLOPS) takes less than the host's time per launch (HOST_S_PER_LAUNCH); else
    the kernels (the paper's expert at P = 64, where a graph saves no time and would hold a second
    copy of the work buffers)."""
    if _forced_path:
        return _forced_path
    if fused_forward.fits(layout, B):
        return "fused"
    flops = M * B * T * layout.config.flops_per_token()
    return "graph" if flops / kernels_launches(layout, B, T) < DEVICE_FLOPS * HOST_S_PER_LAUNCH else "kernels"


def kernels_launches(layout: Layout, B: int, T: int) -> int:
    """The launches (raw kernels and GEMMs) of one population forward on the kernels path: the
    layer-0 table GEMM; per chunk of Tc steps, per step and layer a recurrent GEMM and a cell
    kernel, each upper layer's input GEMM, the logits GEMM and the log-softmax (counted on the
    emulated runtime: tests/test_graph_forward.py)."""
    L = layout.config.layers
    return 1 + 2 * L * T + -(-T // _chunk_steps(B, T)) * (L + 1)


def _chunk_steps(B: int, T: int) -> int:
    return max(1, min(T, -(-ROWS_PER_CHUNK // B)))


def member_bytes(layout: Layout, B: int, T: int) -> int:
    """Device bytes of one member's forward work buffers (its weights' contiguous copies, the
    layer-0 table, one chunk's activations, gates, logits, state and nll)."""
    cfg = layout.config
    H, G, L = cfg.hidden, 4 * cfg.hidden, cfg.layers
    rows = _chunk_steps(B, T) * B
    floats = layout.size + VOCAB * G + rows * (2 * H + G + VOCAB) + B * G + 2 * L * B * H + B * T
    return 4 * floats


def _byte_strides(tokens, M: int) -> tuple[int, int]:
    """(member, row) strides in elements of a (1 or M, B, T) uint8 view; member stride 0 when one
    batch is shared by all M members."""
    if tokens.strides[2] != 1:
        raise ValueError("token rows must be contiguous in time")
    return (0 if tokens.shape[0] == 1 and M > 1 else tokens.strides[0]), tokens.strides[1]


class _Dense:
    """Every member's own weights, thetas (M, d): each product is one GEMM per member, batched over
    members (cuBLAS strided-batched through cupy.matmul)."""

    def __init__(self, thetas, layout: Layout):
        rt = runtime()
        self.M = thetas.shape[0]
        # contiguous per-member copies: cupy.matmul would copy a strided operand at every call
        self.w = {e.name: rt.contiguous(layout.view(thetas, e.name)) for e in layout.entries}

    def embed(self):
        """(M, V, E) every member's embedding."""
        return self.w["embed"]

    def vector(self, name: str):
        """(M, k) every member's vector `name` (a bias)."""
        return self.w[name]

    def matmul(self, x, name: str, out=None):
        """x (M, R, K) @ each member's matrix `name` (K, N) -> (M, R, N), into out when given."""
        return runtime().gemm(x, self.w[name], out)


class _LowRank:
    """EGGROLL's population around one theta (zosoma.engines.cpu.lowrank): members 2i and 2i+1 use the matrices
    W + s c A_i B_i^T (s = +1, -1; c = sigma / sqrt(r)) and the vectors v + s sigma e_i. A product
    splits into the dense part, ONE GEMM over all members' rows with the shared W, and each
    member's rank-r correction, two skinny batched GEMMs:
        x_m @ (W + s c A_i B_i^T) = x_m @ W + (x_m @ A_i) @ (s c B_i^T)
    z (P, n): each pair's Gaussian stream, sliced by zosoma.model.noise.split_factors."""

    def __init__(self, theta, layout: Layout, z, sigma: float, r: int):
        xp = runtime().xp
        P = z.shape[0]
        self.M = 2 * P
        sign = xp.asarray([1.0, -1.0], np.float32)[None, :, None, None]  # (1, 2, 1, 1): member 2i, 2i+1
        c = np.float32(sigma / math.sqrt(r))
        self.w, self.a, self.bs, self.v = {}, {}, {}, {}
        factors = split_factors(z, layout, r)
        for e in layout.entries:
            w = layout.view(theta, e.name)
            if len(e.shape) == 2:  # A_i (P, m, r), B_i (P, n, r)
                m, n = e.shape
                self.w[e.name] = xp.ascontiguousarray(w)
                self.a[e.name], b = factors[e.name]
                bt = b.transpose(0, 2, 1)  # (P, r, n)
                self.bs[e.name] = (sign * (c * bt)[:, None]).reshape(self.M, r, n)  # s c B_i^T
            else:  # e_i (P, k), full rank
                noise = factors[e.name][:, None] * np.float32(sigma)  # (P, 1, k)
                self.v[e.name] = (w + sign[..., 0] * noise).reshape(self.M, e.size)

    def embed(self):
        """(M, V, E): W_e + s c A_i B_i^T of every member (layer 0 needs its product with w_ih)."""
        xp = runtime().xp
        P, V, r = self.a["embed"].shape
        low = xp.matmul(self.a["embed"][:, None], self.bs["embed"].reshape(P, 2, r, -1))  # (P, 2, V, E)
        return (low + self.w["embed"]).reshape(self.M, V, -1)

    def vector(self, name: str):
        return self.v[name]

    def matmul(self, x, name: str, out=None):
        """x (M, R, K) @ (W + s c A_i B_i^T) of each member -> (M, R, N), into out when given."""
        xp = runtime().xp
        M, R, K = x.shape
        w = self.w[name]
        y = xp.matmul(x.reshape(M * R, K), w, out=None if out is None else out.reshape(M * R, w.shape[1]))
        xa = xp.matmul(x.reshape(M // 2, 2 * R, K), self.a[name])  # (P, 2R, r): a pair shares A_i
        y = y.reshape(M, R, w.shape[1])
        y += xp.matmul(xa.reshape(M, R, -1), self.bs[name])
        return y


def _forward(weights, layout: Layout, tokens, targets, h, c, want_logp: bool = False):
    """The population forward of the M members of `weights` (_Dense or _LowRank). tokens, targets
    (1 or M, B, T) uint8 device views (the kernels take their strides); h, c (L, M, B, H) float32
    initial state, updated in place to the final state. Returns nll (M, B, T) float32 and, when
    want_logp, logp (M, B, T, V)."""
    xp = runtime().xp
    cfg = layout.config
    H, G, L, V = cfg.hidden, 4 * cfg.hidden, cfg.layers, VOCAB
    M = weights.M
    B, T = tokens.shape[1], tokens.shape[2]
    table = weights.matmul(weights.embed(), "lstm0.w_ih")  # (M, V, G)
    tok_sm, tok_sb = _byte_strides(tokens, M)
    tgt_sm, tgt_sb = _byte_strides(targets, M)
    nll = xp.empty((M, B, T), np.float32)
    logp = xp.empty((M, B, T, V) if want_logp else (1,), np.float32)
    gates = xp.empty((M, B, G), np.float32)
    Tc = _chunk_steps(B, T)
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        below = None  # (M, n, B, H): the layer below's outputs over the chunk
        for layer in range(L):
            bias = weights.vector(f"lstm{layer}.bias")
            hs = xp.empty((M, n, B, H), np.float32)
            if layer > 0:
                xproj = weights.matmul(below.reshape(M, n * B, H), f"lstm{layer}.w_ih")  # (M, n*B, G)
            for t in range(n):
                weights.matmul(h[layer], f"lstm{layer}.w_hh", out=gates)  # (M, B, G)
                if layer == 0:
                    custom_kernels.launch("lstm_cell_embed", M * B * H, gates, table, tokens, tok_sm, tok_sb, t0 + t,
                                          bias, c[layer], h[layer], hs, M, B, H, n, t)
                else:
                    custom_kernels.launch("lstm_cell_proj", M * B * H, gates, xproj, bias, c[layer], h[layer], hs,
                                          M, B, H, n, t)
            below = hs
        logits = weights.matmul(below.reshape(M, n * B, H), "out.w")  # (M, n*B, V)
        custom_kernels.launch("log_softmax_nll", M * n * B, logits, weights.vector("out.b"), targets, tgt_sm, tgt_sb,
                              nll, logp, int(want_logp), M, B, T, t0, n)
    return nll, (logp if want_logp else None)


def _nll(weights, layout: Layout, tokens, targets):
    """nll (M, B, T) on the device of the members of `weights`, from zero state."""
    rt = runtime()
    cfg = layout.config
    shape = (cfg.layers, weights.M, tokens.shape[1], cfg.hidden)
    nll, _ = _forward(weights, layout, tokens, targets, rt.zeros(shape), rt.zeros(shape))
    return nll


def _check_thetas(thetas, layout: Layout, ndim: int):
    thetas = to_device(thetas)
    if thetas.ndim != ndim or thetas.shape[-1] != layout.size:
        want = "(M, d)" if ndim == 2 else "(d,)"
        raise ValueError(f"theta must have shape {want} with d={layout.size}, got {thetas.shape}")
    return thetas


def _check_bytes(tokens, name: str, ndim: int):
    xp = runtime().xp
    tokens = xp.asarray(tokens)
    if tokens.dtype != np.uint8 or tokens.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d uint8 array, got {tokens.dtype} {tokens.shape}")
    return xp.ascontiguousarray(tokens)


def _per_member_bytes(x, name: str, M: int):
    """x (B, T) read by all M members, or (M, B, T) one per member, as a (1 or M, B, T) device
    uint8 array."""
    x = runtime().xp.asarray(x)
    x = _check_bytes(x[None] if x.ndim == 2 else x, name, 3)
    if x.shape[0] not in (1, M):
        raise ValueError(f"{name} must be (B, T) or (M={M}, B, T), got {x.shape}")
    return x


def _member_chunks(M: int, per_member: int, workspace_bytes: int):
    """(m0, m1) ranges of members whose work buffers, per_member bytes each, fit workspace_bytes."""
    per = max(1, workspace_bytes // per_member)
    return [(m0, min(M, m0 + per)) for m0 in range(0, M, per)]


def population_loss(thetas, layout: Layout, batch, workspace_bytes: int = WORKSPACE_BYTES) -> np.ndarray:
    """Mean nats per predicted byte of each member, from zero state, as
    zosoma.engines.cpu.forward.population_loss. thetas (M, d) float32; batch (B, T+1) uint8 shared by all
    members, or (M, B, T+1) one per member. Members run in chunks whose work buffers fit
    workspace_bytes (the same bits in emulation; within CHUNK_RTOL on a device). Returns (M,)
    float64 NumPy."""
    thetas = _check_thetas(thetas, layout, 2)
    M = thetas.shape[0]
    batches = _per_member_bytes(batch, "batch", M)
    if batches.shape[2] < 2:
        raise ValueError(f"batch must hold T+1 >= 2 bytes per row, got {batches.shape}")
    B, T = batches.shape[1], batches.shape[2] - 1
    sums = np.empty(M, np.float64)
    for m0, m1 in _member_chunks(M, member_bytes(layout, B, T), workspace_bytes):
        sub = batches if batches.shape[0] == 1 else batches[m0:m1]
        nll = _nll(_Dense(thetas[m0:m1], layout), layout, sub[..., :-1], sub[..., 1:])
        sums[m0:m1] = to_numpy(nll.sum(axis=(1, 2), dtype=np.float64))
    return sums / (B * T)


def population_nll(thetas, layout: Layout, tokens, targets,
                   workspace_bytes: int = WORKSPACE_BYTES) -> np.ndarray:
    """Nats of each target byte under each of M models of one Layout, from zero state: the models
    of a batch of routed inference (zosoma.mixture.routing) in one forward. thetas (M, d) float32, or a
    sequence of M (d,) arrays; tokens, targets (B, T) uint8 read by every model, or (M, B, T) one
    batch per model. Returns (M, B, T) float32 NumPy."""
    if not hasattr(thetas, "ndim"):
        thetas = runtime().xp.stack([to_device(t) for t in thetas])
    thetas = _check_thetas(thetas, layout, 2)
    M = thetas.shape[0]
    tokens = _per_member_bytes(tokens, "tokens", M)
    targets = _per_member_bytes(targets, "targets", M)
    if targets.shape[1:] != tokens.shape[1:]:
        raise ValueError(f"targets {targets.shape} must match tokens {tokens.shape}")
    B, T = tokens.shape[1], tokens.shape[2]
    out = np.empty((M, B, T), np.float32)
    for m0, m1 in _member_chunks(M, member_bytes(layout, B, T), workspace_bytes):
        tok, tgt = (x if x.shape[0] == 1 else x[m0:m1] for x in (tokens, targets))
        out[m0:m1] = to_numpy(_nll(_Dense(thetas[m0:m1], layout), layout, tok, tgt))
    return out


def spsa_losses(theta, layout: Layout, batch, P: int, eps: float, seed: int, expert: int, step: int,
                kind: str, workspace_bytes: int = WORKSPACE_BYTES, pairs: range | None = None, table=None):
    """L of members 2k ("plus") and 2k+1 ("minus") for k in `pairs` (default range(P)) on one
    shared batch (B, T+1), member m = theta + sign_m * eps * delta_{direction_m} as `table` says
    ((direction, sign) of the 2 len(pairs) members; None: antithetic pairs, L(theta + eps*delta_k)
    and L(theta - eps*delta_k)), as Ops.perturbed_losses: the perturbed population is built on the
    device, chunk by chunk, and never leaves it (a small model's: in one fused launch, step_path).
    Returns (plus, minus), each (len(pairs),) float64 NumPy."""
    theta = _check_thetas(theta, layout, 1)
    batch = _check_bytes(batch, "batch", 2)
    pairs = range(P) if pairs is None else pairs
    direction, sign = antithetic(pairs) if table is None else table
    B, T = batch.shape[0], batch.shape[1] - 1
    per_direction = 2 * (4 * layout.size + member_bytes(layout, B, T))
    size = max(1, min(len(pairs), workspace_bytes // per_direction))  # pairs per forward
    path = step_path(layout, B, T, 2 * size)
    if path == "fused":
        return fused_forward.table_losses(theta, layout, batch, eps, seed, expert, step, kind, direction, sign)

    def build(chunk: range, out=None):  # the members of a chunk of pairs, on the device
        rows = slice(2 * (chunk.start - pairs.start), 2 * (chunk.stop - pairs.start))
        return perturbed(theta, eps, chunk, seed, expert, step, kind, out=out, table=(direction[rows], sign[rows]))

    chunks = [range(start, min(pairs.stop, start + size)) for start in range(pairs.start, pairs.stop, size)]
    if path == "graph":
        def forward(thetas, tokens, targets):  # what the graph captures
            return _nll(_Dense(thetas, layout), layout, tokens, targets)
        return graph_forward.chunk_losses(layout, batch, chunks, build, forward)
    plus, minus = np.empty(len(pairs)), np.empty(len(pairs))
    for chunk in chunks:
        losses = population_loss(build(chunk), layout, batch, workspace_bytes)
        at = slice(chunk.start - pairs.start, chunk.stop - pairs.start)
        plus[at], minus[at] = losses[0::2], losses[1::2]
    return plus, minus


def eggroll_population_loss(theta, layout: Layout, batch, sigma: float, r: int, seed: int, expert: int,
                            step: int, n_pairs: int, workspace_bytes: int = WORKSPACE_BYTES,
                            first: int = 0) -> np.ndarray:
    """Mean nats/byte of the N = 2*n_pairs EGGROLL members theta +/- E_i (member 2j is +E_i, 2j+1
    is -E_i, i = first + j), from zero state, on the shared (B, T+1) uint8 batch, as
    zosoma.engines.cpu.lowrank.eggroll_population_loss. Pair i's Gaussian stream is regenerated on the device
    (the Philox counters of zosoma.model.noise, member = i: within float32 rounding of the CPU's); no
    member's weights are ever built (_LowRank). Pairs run in chunks whose work buffers fit
    workspace_bytes. Returns (N,) float64 NumPy."""
    xp = runtime().xp
    theta = _check_thetas(theta, layout, 1)
    batch = _check_bytes(batch, "batch", 2)
    if batch.shape[1] < 2:
        raise ValueError(f"batch must hold T+1 >= 2 bytes per row, got {batch.shape}")
    if n_pairs < 1:
        raise ValueError(f"n_pairs must be at least 1, got {n_pairs}")
    if int(r) < 1:
        raise ValueError(f"EGGROLL rank r must be at least 1, got {r}")
    r = int(r)
    B, T = batch.shape[0], batch.shape[1] - 1
    n = noise_length(layout, r)
    zeros = xp.zeros(n, np.float32)
    sums = np.empty(2 * n_pairs, np.float64)
    # a pair: its z, and two members' work buffers: no weight copies but their embedding, and the
    # temporaries of the rank-r corrections (a second table, a chunk's input projection and logits)
    G, rows = 4 * layout.config.hidden, _chunk_steps(B, T) * B
    per_member = member_bytes(layout, B, T) + 4 * (VOCAB * (layout.config.embed + G) + rows * (G + VOCAB)
                                                   - layout.size)
    for p0, p1 in _member_chunks(n_pairs, 2 * per_member + 4 * n, workspace_bytes):
        z = xp.empty((p1 - p0, n), np.float32)
        perturb(z, zeros, 1.0, 0, seed, expert, step, *plain_rows(range(first + p0, first + p1)), KINDS["gaussian"])
        nll = _nll(_LowRank(theta, layout, z, sigma, r), layout, batch[None, :, :-1], batch[None, :, 1:])
        sums[2 * p0:2 * p1] = to_numpy(nll.sum(axis=(1, 2), dtype=np.float64))
    return sums / (B * T)


def _stream(theta, layout: Layout, tokens, targets, state, want_logp: bool):
    xp = runtime().xp
    cfg = layout.config
    theta = _check_thetas(theta, layout, 1)
    tokens = _check_bytes(tokens, "tokens", 2)
    targets = tokens if targets is None else _check_bytes(targets, "targets", 2)
    if targets.shape != tokens.shape:
        raise ValueError(f"targets {targets.shape} must match tokens {tokens.shape}")
    B = tokens.shape[0]
    h = xp.zeros((cfg.layers, 1, B, cfg.hidden), np.float32)
    c = xp.zeros_like(h)
    if state is not None:
        if len(state) != cfg.layers:
            raise ValueError(f"state must hold {cfg.layers} (h, c) pairs, got {len(state)}")
        for layer, (h_l, c_l) in enumerate(state):
            h[layer, 0], c[layer, 0] = xp.asarray(h_l), xp.asarray(c_l)  # broadcasting checks (B, H)
    nll, logp = _forward(_Dense(theta[None], layout), layout, tokens[None], targets[None], h, c, want_logp)
    state = [(to_numpy(h[layer, 0]), to_numpy(c[layer, 0])) for layer in range(cfg.layers)]
    return nll[0], logp, state


def nll_stream(theta, layout: Layout, tokens, targets, state=None):
    """Nats of each target byte under one model, carrying state, as zosoma.engines.cpu.forward.nll_stream.
    theta (d,); tokens, targets (B, T) uint8; state None or one (h, c) pair of (B, H) per layer.
    Returns nll (B, T) float32 NumPy and the final state (NumPy)."""
    nll, _, state = _stream(theta, layout, tokens, targets, state, False)
    return to_numpy(nll), state


def log_probs(theta, layout: Layout, tokens, state=None):
    """Next-byte log-probabilities of one model, as zosoma.engines.cpu.forward.log_probs. theta (d,); tokens
    (B, T) uint8. Returns logp (B, T, V) float32 NumPy and the final state."""
    _, logp, state = _stream(theta, layout, tokens, None, state, True)
    return to_numpy(logp[0]), state
