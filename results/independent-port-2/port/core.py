"""NumPy port of zosoma's forward, noise, batches, schedule, step, shaping, router (from PORTING.md)."""
import numpy as np

V = 256
M32 = np.uint64(0xFFFFFFFF)


# ---------------- stage 0: layout and init ----------------
def layout(E, H, L):
    out, off = [], 0
    def add(name, shape):
        nonlocal off
        out.append((name, shape, off)); off += int(np.prod(shape))
    add("embed", (V, E))
    for l in range(L):
        ein = E if l == 0 else H
        add(f"lstm{l}.w_ih", (ein, 4 * H)); add(f"lstm{l}.w_hh", (H, 4 * H)); add(f"lstm{l}.bias", (4 * H,))
    add("out.w", (H, V)); add("out.b", (V,))
    return out, off


def init(E, H, L, seed, expert):
    lay, d = layout(E, H, L)
    rng = np.random.default_rng([int(seed), int(expert), 0x1D1])
    theta = np.zeros(d, np.float32)
    a = 1.0 / np.sqrt(H)
    for name, shape, off in lay:
        n = int(np.prod(shape))
        if name == "embed":
            v = rng.standard_normal(n)
        elif name == "out.b":
            continue
        else:
            v = rng.uniform(-a, a, n)
        theta[off:off + n] = v.astype(np.float32)
    return theta


def unpack(theta, E, H, L):
    """theta (..., d) -> dict of views with leading member dims."""
    lay, d = layout(E, H, L)
    lead = theta.shape[:-1]
    p = {}
    for name, shape, off in lay:
        n = int(np.prod(shape))
        p[name] = theta[..., off:off + n].reshape(lead + tuple(shape))
    return p


# ---------------- stage 1/2: forward and loss ----------------
def sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def forward(theta, E, H, L, tokens, h0=None, c0=None, dtype=np.float64, record=False):
    """theta (d,) or (M, d); tokens (B, T) or (M, B, T). Returns logits (..., B, T, V), hT, cT (L, ..., B, H), rec."""
    th = np.asarray(theta).astype(dtype)
    p = unpack(th, E, H, L)
    memb = th.ndim == 2
    tokens = np.asarray(tokens).astype(np.int64)
    if memb and tokens.ndim == 2:
        tokens = np.broadcast_to(tokens, (th.shape[0],) + tokens.shape)
    lead = tokens.shape[:-1]          # (B,) or (M, B)
    T = tokens.shape[-1]
    emb = p["embed"]
    if memb:
        x = emb[np.arange(th.shape[0])[:, None, None], tokens]
    else:
        x = emb[tokens]               # (B, T, E)
    rec = {"embedded": x.copy()} if record else None
    hT, cT = [], []
    for l in range(L):
        wih, whh, b = p[f"lstm{l}.w_ih"], p[f"lstm{l}.w_hh"], p[f"lstm{l}.bias"]
        h = np.zeros(lead + (H,), dtype) if h0 is None else np.asarray(h0[l]).astype(dtype).copy()
        c = np.zeros(lead + (H,), dtype) if c0 is None else np.asarray(c0[l]).astype(dtype).copy()
        if memb:
            xw = np.matmul(x.reshape(x.shape[0], -1, x.shape[-1]), wih).reshape(lead + (T, 4 * H)) + b[:, None, None, :]
        else:
            xw = x @ wih + b
        hs = np.empty(lead + (T, H), dtype)
        if record:
            G = np.empty(lead + (T, 4 * H), dtype); A = np.empty_like(G); C = np.empty(lead + (T, H), dtype)
        for t in range(T):
            z = xw[..., t, :] + (np.matmul(h, whh) if memb else h @ whh)
            i = sigmoid(z[..., :H]); f = sigmoid(z[..., H:2 * H]); g = np.tanh(z[..., 2 * H:3 * H]); o = sigmoid(z[..., 3 * H:])
            c = f * c + i * g
            h = o * np.tanh(c)
            hs[..., t, :] = h
            if record:
                G[..., t, :] = z; A[..., t, :] = np.concatenate([i, f, g, o], -1); C[..., t, :] = c
        if record:
            rec[f"gates{l}"] = G; rec[f"activations{l}"] = A; rec[f"cells{l}"] = C; rec[f"hidden{l}"] = hs.copy()
        hT.append(h); cT.append(c)
        x = hs
    if memb:
        logits = np.matmul(x.reshape(x.shape[0], -1, H), p["out.w"]).reshape(lead + (T, V)) + p["out.b"][:, None, None, :]
    else:
        logits = x @ p["out.w"] + p["out.b"]
    return logits, np.stack(hT), np.stack(cT), rec


def nll_from_logits(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    idx = np.broadcast_to(np.asarray(targets).astype(np.int64), logits.shape[:-1])
    tgt = np.take_along_axis(logits, idx[..., None], -1)[..., 0]
    return lse - tgt


def batch_loss(theta, E, H, L, batch, dtype=np.float64):
    """batch (B, T+1); theta (d,) or (M, d). Returns nll (..., B, T), loss (float64 mean over B*T)."""
    batch = np.asarray(batch)
    logits, _, _, _ = forward(theta, E, H, L, batch[:, :-1], dtype=dtype)
    nll = nll_from_logits(logits, batch[:, 1:])
    loss = nll.astype(np.float64).mean(axis=(-1, -2))
    return nll, loss


# ---------------- stage 3: Philox ----------------
def philox_words(seed, stream, step, member, blocks):
    """Block words (nblocks, 4) uint64 for counter (block, member, step, stream)."""
    seed = int(seed)
    k0 = np.uint64(seed & 0xFFFFFFFF); k1 = np.uint64(seed >> 32)
    blocks = np.asarray(blocks, np.uint64)
    c0 = blocks.copy()
    c1 = np.full_like(c0, np.uint64(int(member)))
    c2 = np.full_like(c0, np.uint64(int(step)))
    c3 = np.full_like(c0, np.uint64(int(stream)))
    A = np.uint64(0xD2511F53); Bm = np.uint64(0xCD9E8D57); s32 = np.uint64(32)
    for _ in range(10):
        p0 = A * c0; p1 = Bm * c2
        hi0, lo0 = p0 >> s32, p0 & M32
        hi1, lo1 = p1 >> s32, p1 & M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + np.uint64(0x9E3779B9)) & M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & M32
    return np.stack([c0, c1, c2, c3], -1)


def rademacher(seed, stream, step, member, n):
    nb = (n + 127) // 128
    x = philox_words(seed, stream, step, member, np.arange(nb)).astype(np.uint32)   # (nb, 4)
    bits = (x[:, :, None] >> np.arange(32, dtype=np.uint32)[None, None, :]) & 1       # (nb, 4, 32)
    return (1 - 2 * bits.reshape(-1)[:n].astype(np.int8)).astype(np.int8)


def gaussian(seed, stream, step, member, n):
    nb = (n + 3) // 4
    x = philox_words(seed, stream, step, member, np.arange(nb)).astype(np.float64)   # (nb, 4)
    out = np.empty((nb, 4), np.float64)
    for p in range(2):
        u1 = (x[:, 2 * p] + 0.5) * 2.0 ** -32
        u2 = (x[:, 2 * p + 1] + 0.5) * 2.0 ** -32
        r = np.sqrt(-2 * np.log(u1))
        out[:, 2 * p] = r * np.cos(2 * np.pi * u2)
        out[:, 2 * p + 1] = r * np.sin(2 * np.pi * u2)
    return out.reshape(-1)[:n].astype(np.float32)


def noise(kind, seed, stream, step, member, n):
    if kind == "rademacher":
        return rademacher(seed, stream, step, member, n).astype(np.float32)
    return gaussian(seed, stream, step, member, n)


# ---------------- stage 4: batches and schedule ----------------
class Windows:
    def __init__(self, text, offsets, T):
        self.text = np.asarray(text, np.uint8); self.offsets = np.asarray(offsets, np.int64); self.T = int(T)
        lens = np.diff(self.offsets)
        self.n = np.maximum(0, lens - self.T)
        self.ends = np.cumsum(self.n)
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def draws(self, seed, stream, step, B):
        rng = np.random.default_rng([int(seed), int(stream), int(step)])
        return rng.integers(0, self.total, size=B)

    def locate(self, g):
        doc = np.searchsorted(self.ends, g, side="right")
        start = g - (self.ends[doc] - self.n[doc])
        return doc.astype(np.int64), start.astype(np.int64)

    def gather(self, doc, start):
        base = self.offsets[doc] + start
        return self.text[base[..., None] + np.arange(self.T + 1)]

    def batch(self, seed, stream, step, B):
        d, s = self.locate(self.draws(seed, stream, step, B))
        return self.gather(d, s)


def lr_at(t, lr, total, warmup=20, schedule="cosine", factor=1.0):
    if t < warmup:
        r = lr * (t + 1) / warmup
    elif schedule == "constant":
        r = lr
    else:
        r = lr * 0.5 * (1 + np.cos(np.pi * min(1.0, (t - warmup) / max(1, total - warmup))))
    return r * factor


# ---------------- stage 5: update ----------------
def sgd_update(theta, coeffs, deltas, lr, wd=0.0):
    """theta float32 (d,), coeffs (P,) float64, deltas list/array of (d,) float32."""
    P = len(coeffs)
    acc = np.zeros_like(theta, dtype=np.float32)
    for k in range(P):
        acc += np.float32(coeffs[k] / P) * deltas[k]
    new = theta - np.float32(lr) * acc
    if wd:
        new = new - np.float32(lr * wd) * theta
    return new.astype(np.float32)


def ghat(coeffs, deltas):
    P = len(coeffs)
    acc = np.zeros(deltas[0].shape, np.float32)
    for k in range(P):
        acc += np.float32(coeffs[k] / P) * deltas[k]
    return acc


# ---------------- stage 7: shaping ----------------
def clip_piece(g, state, c):
    s, m = state
    g = np.asarray(g, np.float64).copy()
    if s >= 10:
        g = np.clip(g, -c * m, c * m)
    med = float(np.median(np.abs(g)))
    m = med if s == 0 else 0.98 * m + 0.02 * med
    return g, [s + 1, m]


def normalize_piece(g, state, W):
    s, S = state
    g = np.asarray(g, np.float64).copy()
    spread = float(np.sqrt(np.mean(g ** 2)))
    if s >= min(10, W):
        g = np.zeros_like(g) if spread == 0 else g * (S / s) / spread
    if s < W:
        S = S + (min(spread, 2 * S / s) if s >= 10 else spread)
        s = s + 1
    return g, [s, S]


# ---------------- stage 9: router ----------------
def ngram_counts(ctx, nmin, nmax, F):
    bits = int(F).bit_length() - 1
    ctx = np.asarray(ctx, np.uint64)
    counts = np.zeros(F, np.int64)
    n_ = len(ctx)
    for n in range(nmin, nmax + 1):
        if n_ < n:
            continue
        h = np.full(n_ - n + 1, 2166136261, np.uint64)
        for j in range(n):
            h = ((h ^ ctx[j:n_ - n + 1 + j]) * np.uint64(16777619)) & M32
        bkt = ((h >> np.uint64(bits)) ^ h) % np.uint64(F)
        counts += np.bincount(bkt.astype(np.int64), minlength=F)
    return counts


def features(counts, idf, sublinear=True):
    counts = np.asarray(counts)
    with np.errstate(divide="ignore"):
        tf = np.where(counts >= 1, 1 + np.log(np.maximum(counts, 1)), 0.0) if sublinear else counts.astype(np.float64)
    x = tf * np.asarray(idf, np.float64)
    nrm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.where(nrm > 0, x / np.where(nrm > 0, nrm, 1), 0.0)


def embed_features(x, projection):
    e = x @ np.asarray(projection, np.float64)
    nrm = np.linalg.norm(e, axis=-1, keepdims=True)
    return np.where(nrm > 0, e / np.where(nrm > 0, nrm, 1), 0.0)


def distances(e, centroids):
    c = np.asarray(centroids, np.float64)
    d = ((e[..., None, :] - c) ** 2).sum(-1)
    return np.maximum(d, 0).astype(np.float32).astype(np.float64)


def route(d, K, tau, dropped=(), zero=False, centroids=None):
    N = len(d)
    allowed = [i for i in range(N) if i not in set(int(x) for x in dropped)]
    K = min(K, len(allowed))
    if zero:
        c = np.asarray(centroids, np.float64)
        key = (c ** 2).sum(-1)
        order = sorted(allowed, key=lambda i: (key[i], i))[:K]
        return np.array(order), np.full(K, 1.0 / K)
    order = sorted(allowed, key=lambda i: (d[i], i))[:K]
    dd = np.array([d[i] for i in order], np.float64)
    z = -dd / tau
    z = z - z.max()
    w = np.exp(z); w /= w.sum()
    return np.array(order), w
