"""Routing on the device: the c-BTM router's choice of experts (zosoma.mixture.routing.Router.select)
computed where the experts run, so that a routed pass does not wait on the host's n-gram
embedding (35 ms of the 47 for 1,024 contexts at N = 256: docs/gpu.md).

Shapes: S contexts, C their longest length, F = n_features buckets, D = svd_dim, N experts, K top-k.

    the contexts, packed (S, C) uint8 with their lengths          one copy up
    hashed n-grams (FNV-1a, xor-folded: zosoma.mixture.cluster)   array ops: (S, C) uint32 per n
    distinct (row, bucket) keys and their counts                  array ops: sort, unique
    tf-idf, row norm, x projection, row norm                      route.cu: route_embed, a block a row
    squared distances to the centroids, softmax, top-k            array ops (float64, as the host)
    experts (S, K) and weights (S, K)                             one copy down each

Against the host (tests/test_device_routing.py, on the emulated runtime): the features, counts and
tf-idf values are the host's bits and route_embed sums in the host's order, so the embedding
matches up to its last norm (a double sum in another order than NumPy's einsum: at most an ulp of
the float32 norm; bit for bit in the test); the distances are the host's formula in float64 with
a GEMM of another order, rounded to float32 as the host rounds them. So the experts are the host's
but where two float32 distances tie within an ulp, and the weights agree within ROUTE_RTOL.
"""

from __future__ import annotations

import weakref

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.engines.cuda import custom_kernels
from zosoma.engines.cuda.custom_kernels import runtime, to_device

ROUTE_RTOL = 1e-6  # the weights against the host's (float32 distances an ulp apart)
_FNV_OFFSET, _FNV_PRIME = 2166136261, 16777619
_THREADS = 128  # per block of route_embed: about D = 100 columns
_tables = weakref.WeakKeyDictionary()  # runtime -> {id(clustering): (clustering, device arrays)}


def _device_tables(clustering) -> dict:
    """The clustering's idf, projection and centroids on the active runtime, copied once (the
    projection is F x D floats: 26 MB at the default 2**16 x 100)."""
    per_runtime = _tables.setdefault(runtime(), {})
    held = per_runtime.get(id(clustering))
    if held is None or held[0] is not clustering:
        xp = runtime().xp
        c = xp.asarray(clustering.centroids, np.float64)
        held = per_runtime[id(clustering)] = (clustering, {
            "idf": to_device(clustering.idf), "projection": to_device(clustering.projection),
            "centroids": c, "norms": (c * c).sum(axis=1)})
    return held[1]


def _pack(contexts) -> tuple[np.ndarray, np.ndarray]:
    """S byte strings as (S, C) uint8, right-padded with zeros, and their (S,) int64 lengths."""
    rows = [np.frombuffer(c, np.uint8) if isinstance(c, (bytes, bytearray, memoryview)) else np.asarray(c, np.uint8)
            for c in contexts]
    lengths = np.array([r.size for r in rows], np.int64)
    buf = np.zeros((len(rows), max(1, int(lengths.max()))), np.uint8)
    for s, r in enumerate(rows):
        buf[s, :r.size] = r
    return buf, lengths


def ngram_counts(buf, lengths, config):
    """Distinct hashed n-grams of each context with their counts, as zosoma.mixture.cluster's
    _scan_ngrams finds them, on the device: rows (nnz,) int64, buckets (nnz,) int64 (sorted by
    row, then bucket), counts (nnz,) int64. buf (S, C) uint8, lengths (S,) on the device."""
    xp = runtime().xp
    S, C = buf.shape
    F = config.n_features
    bits = F.bit_length() - 1
    mask = np.uint32(F - 1)
    h = xp.full((S, C), _FNV_OFFSET, np.uint32)  # h[:, t]: the hash of the n-gram starting at t
    keys = []
    for n in range(1, config.ngram_max + 1):
        if n > C:
            break
        h = (h[:, :C - n + 1] ^ buf[:, n - 1:].astype(np.uint32)) * np.uint32(_FNV_PRIME)
        if n >= config.ngram_min:
            bucket = ((h >> np.uint32(bits)) ^ h) & mask
            valid = xp.arange(C - n + 1)[None, :] + n <= lengths[:, None]  # the n-gram lies inside
            key = xp.arange(S, dtype=np.int64)[:, None] * F + bucket.astype(np.int64)
            keys.append(key[valid])
    keys, counts = xp.unique(xp.concatenate(keys) if keys else xp.zeros(0, np.int64), return_counts=True)
    return keys // F, keys % F, counts


def embed(clustering, contexts):
    """(S, D) float32 device embeddings of S contexts, as Clustering.embed (module docstring)."""
    xp = runtime().xp
    cfg = clustering.config
    tables = _device_tables(clustering)
    buf, lengths = _pack(contexts)
    S, C = buf.shape
    rows, buckets, counts = ngram_counts(xp.asarray(buf), xp.asarray(lengths), cfg)
    indptr = xp.searchsorted(rows, xp.arange(S + 1)).astype(np.int32)
    # the host's tf, 1 + ln(count) in float32 (or the count), for every count a context can reach
    most = np.arange(1, C * (cfg.ngram_max - cfg.ngram_min + 1) + 1, dtype=np.float32)
    tf = np.log(most) + np.float32(1.0) if cfg.sublinear_tf else most
    out = xp.empty((S, cfg.svd_dim), np.float32)
    values = xp.empty(max(1, int(buckets.size)), np.float32)
    custom_kernels.launch_blocks("route_embed", S, _THREADS, 0, out, values, indptr, buckets.astype(np.int32),
                                 counts.astype(np.int32), to_device(tf), tables["idf"], tables["projection"],
                                 S, cfg.svd_dim)
    return out


def select(router, contexts) -> tuple[np.ndarray, np.ndarray]:
    """Router.select on the device: experts (S, K) int64 and weights (S, K) float32, NumPy (the
    module docstring says how they compare with the host's)."""
    xp = runtime().xp
    S, K = len(contexts), router.top_k
    if S == 0:
        return router.select(contexts)
    tables = _device_tables(router.clustering)
    emb = embed(router.clustering, contexts)
    e = emb.astype(np.float64)
    # zosoma.mixture.cluster._sq_distances, then rounded to float32 as Clustering.sq_distances does
    d = (e * e).sum(axis=1)[:, None] - 2.0 * (e @ tables["centroids"].T) + tables["norms"][None]
    logits = -xp.maximum(d, 0.0).astype(np.float32).astype(np.float64) / router.temperature  # (S, N)
    if router.dropped:
        logits[:, xp.asarray(router.dropped)] = -np.inf
    experts = xp.argsort(-logits, axis=1, kind="stable")[:, :K]  # best first, ties by lower index
    top = xp.take_along_axis(logits, experts, axis=1)
    w = xp.exp(top - top[:, :1])
    w /= w.sum(axis=1, keepdims=True)
    blank = ~emb.any(axis=1)  # contexts that embed to zero: the fallback experts, equal weights
    experts[blank] = xp.asarray(router.fallback)
    w[blank] = 1.0 / K
    return to_numpy(experts).astype(np.int64), to_numpy(w).astype(np.float32)
