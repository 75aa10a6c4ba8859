"""Core pieces of the port, written from PORTING.md only."""
import math
import numpy as np

V = 256
M64 = 0xFFFFFFFF


def layout(E, H, L):
    out = [("embed", (V, E))]
    for l in range(L):
        ein = E if l == 0 else H
        out += [(f"lstm{l}.w_ih", (ein, 4 * H)), (f"lstm{l}.w_hh", (H, 4 * H)), (f"lstm{l}.bias", (4 * H,))]
    out += [("out.w", (H, V)), ("out.b", (V,))]
    res, off = [], 0
    for name, shape in out:
        n = int(np.prod(shape))
        res.append((name, shape, off))
        off += n
    return res, off


def unpack(theta, E, H, L):
    lay, d = layout(E, H, L)
    assert theta.shape == (d,), (theta.shape, d)
    P = {}
    for name, shape, off in lay:
        n = int(np.prod(shape))
        P[name] = theta[off:off + n].reshape(shape)
    return P


def dims_from_theta(d, E=16, H=32, L=2):
    return E, H, L


# ---------------------------------------------------------------- stage 0
def init(E, H, L, seed, expert):
    rng = np.random.default_rng([int(seed), int(expert), 0x1D1])
    lay, d = layout(E, H, L)
    theta = np.empty(d, np.float32)
    b = 1.0 / math.sqrt(H)
    for name, shape, off in lay:
        n = int(np.prod(shape))
        if name == "embed":
            v = rng.standard_normal(n)
        elif name == "out.b":
            v = np.zeros(n)
        else:
            v = rng.uniform(-b, b, n)
        theta[off:off + n] = v.astype(np.float32)
    return theta


# ---------------------------------------------------------------- stage 1
def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward(theta, tokens, h0, c0, E=16, H=32, L=2, dtype=np.float32, trace=False):
    P = unpack(np.asarray(theta), E, H, L)
    P = {k: v.astype(dtype) for k, v in P.items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    x_seq = P["embed"][tokens.astype(np.int64)]  # (B, T, E)
    tr = {"embedded": x_seq}
    hT, cT = [], []
    for l in range(L):
        wih, whh, bias = P[f"lstm{l}.w_ih"], P[f"lstm{l}.w_hh"], P[f"lstm{l}.bias"]
        h = np.asarray(h0[l], dtype)
        c = np.asarray(c0[l], dtype)
        Z = np.empty((B, T, 4 * H), dtype)
        A = np.empty((B, T, 4 * H), dtype)
        C = np.empty((B, T, H), dtype)
        Hs = np.empty((B, T, H), dtype)
        for t in range(T):
            z = x_seq[:, t] @ wih + h @ whh + bias
            i = sigmoid(z[:, :H]); f = sigmoid(z[:, H:2 * H])
            g = np.tanh(z[:, 2 * H:3 * H]); o = sigmoid(z[:, 3 * H:])
            c = f * c + i * g
            h = o * np.tanh(c)
            Z[:, t] = z
            A[:, t] = np.concatenate([i, f, g, o], axis=1)
            C[:, t] = c
            Hs[:, t] = h
        tr[f"gates{l}"], tr[f"activations{l}"], tr[f"cells{l}"], tr[f"hidden{l}"] = Z, A, C, Hs
        hT.append(h); cT.append(c)
        x_seq = Hs
    tr["logits"] = x_seq @ P["out.w"] + P["out.b"]
    tr["hT"] = np.stack(hT); tr["cT"] = np.stack(cT)
    return tr


# ---------------------------------------------------------------- stage 2
def nll_from_logits(logits, targets):
    logits = np.asarray(logits, np.float32)
    m = logits.max(axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(axis=-1))
    tgt = np.take_along_axis(logits, np.asarray(targets).astype(np.int64)[..., None], axis=-1)[..., 0]
    return (lse - tgt).astype(np.float32)


def loss(theta, batch, E=16, H=32, L=2):
    batch = np.asarray(batch)
    B = batch.shape[0]
    z = np.zeros((L, B, H), np.float32)
    tr = forward(theta, batch[:, :-1], z, z, E, H, L)
    nll = nll_from_logits(tr["logits"], batch[:, 1:])
    return nll, float(np.mean(nll.astype(np.float64)))


# ---------------------------------------------------------------- stage 3
def philox(seed, c0, c1, c2, c3):
    """Philox4x32-10; counters may be arrays (broadcast). Returns 4 uint64 arrays of uint32 values."""
    seed = int(seed)
    if not (0 <= seed < 2 ** 64):
        raise ValueError("seed out of range")
    k0 = np.uint64(seed & M64); k1 = np.uint64(seed >> 32)
    c = [np.asarray(x, dtype=np.uint64) & np.uint64(M64) for x in (c0, c1, c2, c3)]
    c = list(np.broadcast_arrays(*c))
    c = [x.copy() for x in c]
    M0 = np.uint64(0xD2511F53); M1 = np.uint64(0xCD9E8D57); mask = np.uint64(M64)
    s32 = np.uint64(32)
    for _ in range(10):
        p0 = M0 * c[0]; p1 = M1 * c[2]   # < 2^64, exact in uint64
        hi0, lo0 = p0 >> s32, p0 & mask
        hi1, lo1 = p1 >> s32, p1 & mask
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = np.uint64((int(k0) + 0x9E3779B9) & M64)
        k1 = np.uint64((int(k1) + 0xBB67AE85) & M64)
    return c


def rademacher(seed, stream, step, member, n):
    nb = (n + 127) // 128
    x = philox(seed, np.arange(nb), member, step, stream)
    X = np.stack(x, axis=1)  # (nb, 4)
    i = np.arange(n)
    blk = i >> 7; j = i & 127
    w = X[blk, j >> 5]
    bit = (w >> (j & 31).astype(np.uint64)) & np.uint64(1)
    return (1 - 2 * bit.astype(np.int64)).astype(np.int8)


def gaussian(seed, stream, step, member, n):
    nb = (n + 3) // 4
    x = philox(seed, np.arange(nb), member, step, stream)
    X = np.stack(x, axis=1).astype(np.float64)  # (nb, 4)
    i = np.arange(n)
    blk = i >> 2; p = (i >> 1) & 1
    a = X[blk, 2 * p]; b = X[blk, 2 * p + 1]
    u1 = (a + 0.5) * 2.0 ** -32; u2 = (b + 0.5) * 2.0 ** -32
    r = np.sqrt(-2.0 * np.log(u1))
    v = np.where(i % 2 == 0, r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2))
    return v.astype(np.float32)


# ---------------------------------------------------------------- stage 4
def window_table(offsets, T):
    lens = np.diff(np.asarray(offsets, np.int64))
    n = np.maximum(0, lens - T)
    ends = np.cumsum(n)
    return n, ends


def batch_draws(offsets, T, B, seed, stream, step):
    n, ends = window_table(offsets, T)
    g = np.random.default_rng([int(seed), int(stream), int(step)]).integers(0, int(ends[-1]), size=int(B))
    return g


def doc_start(offsets, T, g):
    n, ends = window_table(offsets, T)
    doc = np.searchsorted(ends, g, side="right")
    start = g - (ends[doc] - n[doc])
    return doc.astype(np.int64), start.astype(np.int64)


def gather_batch(text, offsets, T, doc, start):
    offsets = np.asarray(offsets, np.int64)
    doc = np.asarray(doc); start = np.asarray(start)
    base = offsets[doc] + start
    idx = base[..., None] + np.arange(T + 1)
    return np.asarray(text)[idx].astype(np.uint8)


def batch_of(text, offsets, T, B, seed, stream, step):
    g = batch_draws(offsets, T, B, seed, stream, step)
    doc, start = doc_start(offsets, T, g)
    return gather_batch(text, offsets, T, doc, start)


def lr_at(t, lr, schedule, warmup, total, factor=1.0):
    if t < warmup:
        r = lr * (t + 1) / warmup
    elif schedule == "constant":
        r = lr
    elif schedule == "cosine":
        r = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warmup) / max(1, total - warmup))))
    else:
        raise ValueError(schedule)
    return r * factor


# ---------------------------------------------------------------- stage 5
def sgd_direction(scalars, deltas):
    """acc = sum_k float32(g_k / P) delta_k in float32."""
    P = len(scalars)
    acc = np.zeros(deltas[0].shape, np.float32)
    for k in range(P):
        w = np.float32(scalars[k] / P)
        acc = acc + w * deltas[k].astype(np.float32)
    return acc


def sgd_update(theta, scalars, deltas, lr, wd=0.0):
    acc = sgd_direction(scalars, deltas)
    new = theta - np.float32(lr) * acc
    if wd:
        new = new - np.float32(lr * wd) * theta
    return new.astype(np.float32)
