"""Clustering chunks into N data clusters and embedding any text for the router (after c-BTM).

c-BTM (Gururangan et al., "Scaling Expert Language Models with Unsupervised Domain Discovery",
2023) clusters documents with tf-idf -> truncated SVD (100 dims) -> L2 normalisation -> balanced
k-means, trains one expert per cluster, and at inference weights the experts by the distance of
the context's embedding to each centroid. This module is that pipeline for raw bytes:

    chunk bytes -> counts of hashed byte n-grams (n = ngram_min..ngram_max)   (M, F) sparse
                -> tf (1 + log count when sublinear_tf) * idf, rows L2-normalised
                -> @ projection, the top svd_dim right singular vectors       (M, svd_dim)
                -> rows L2-normalised                                         embedding
                -> k-means with N centroids, balanced or not                  (N, svd_dim)

Shape letters: M chunks (or texts), F = n_features hash buckets, D = svd_dim, N clusters.

Hash (a spec, so other implementations reproduce the features): every n-gram of bytes
b_0..b_{n-1} is hashed with 32-bit FNV-1a (Fowler, Noll, Vo; http://www.isthe.com/chongo/tech/comp/fnv/),
    h = 2166136261;  for each byte b:  h = ((h XOR b) * 16777619) mod 2**32
and xor-folded to its bucket as the FNV authors advise for power-of-two tables,
    bucket = ((h >> bits) XOR h) mod 2**bits,  bits = log2(n_features).
n-grams never cross the boundary between two texts. idf is smoothed as in scikit-learn's
TfidfTransformer (the vectoriser c-BTM uses): idf = ln((1 + M) / (1 + df)) + 1.

Truncated SVD: seeded randomized SVD (Halko, Martinsson and Tropp 2011, Algorithms 4.4 and 5.1;
scikit-learn's TruncatedSVD default), uncentred as in c-BTM, deterministic for a given seed on a
given machine. The sparse products run in serial Numba loops; BLAS only sees M x l and l x l
matrices and two F x l products (l = svd_dim + svd_oversample).

Balanced k-means: c-BTM's k-means (a balanced fork of kmeans_pytorch, imported by
metaseq/scripts/train_clusterer.py in github.com/kernelmachine/cbtm) replaces the nearest-centroid
step by a balanced linear assignment solved with an auction algorithm (auction_lap, the balancing
of BASE layers, Lewis et al. 2021, after Bertsekas 1988). Here every assignment step solves
exactly that problem: minimise the total |e_i - c_j|^2 subject to cluster sizes floor(M/N) or
ceil(M/N) (the M mod N clusters most in demand by nearest centroid get the extra chunk), with the
forward auction for similar objects and epsilon-scaling (Bertsekas and Castanon, "The auction
algorithm for the transportation problem", 1989), optimal to within M * 5e-7 times the spread of
the distances.

The assignment `fit_clusters` returns for training is this balanced one when balanced=True, so
every expert gets the same amount of data (c-BTM's scripts instead label documents with
kmeans.predict, nearest centroid, after the balanced fit). The router, and `Clustering.assign`,
use plain nearest centroid. Balancing has a price when a domain is much smaller than M/N: it
cannot fill a cluster, so one cluster collects it with the overflow of the larger domains (the
shipped corpus at N=8: legal's 60 chunks plus about 95 from each of six other domains).

The config is zosoma.config.ClusterConfig; a fitted clustering's file is zosoma.formats.clustering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.sparse
from numba import njit

from zosoma.config import ClusterConfig
from zosoma.corpus import Corpus
from zosoma.errors import ConfigError, DataError
from zosoma.formats.clustering import (PathLike, load_clustering_file, read_clustering, save_clustering_file,
                                       write_clustering)

_FNV_OFFSET = 2166136261
_FNV_PRIME = 16777619
_MASK32 = 0xFFFFFFFF

# Serial loops, no fastmath: each output row is computed the same way whatever else is in the
# batch, so embed() of a chunk reproduces the embedding used while fitting bit for bit.
_jit = njit(cache=True)


# --- features ----------------------------------------------------------------------------------

@_jit
def _scan_ngrams(buf, offsets, nmin, nmax, bits, indptr, indices, counts, fill):
    """Distinct n-gram buckets of every text, sorted, with their counts.

    buf: (total,) uint8 texts back to back; offsets: (M + 1,) int64 text boundaries in buf.
    fill=False: only indptr[1:] (distinct buckets per text, not yet cumulated) is written.
    fill=True: indices and counts are written at indptr (the cumulated first pass).
    """
    mask = (1 << bits) - 1
    seen = np.zeros(1 << bits, np.int32)  # (F,) count of each bucket in the current text
    longest = 0
    for r in range(offsets.shape[0] - 1):
        longest = max(longest, offsets[r + 1] - offsets[r])
    touched = np.empty(max(longest * (nmax - nmin + 1), 1), np.int32)
    for r in range(offsets.shape[0] - 1):
        start, stop = offsets[r], offsets[r + 1]
        k = 0
        for t in range(start, stop):
            h = _FNV_OFFSET
            for n in range(1, min(nmax, stop - t) + 1):
                h = ((h ^ int(buf[t + n - 1])) * _FNV_PRIME) & _MASK32
                if n >= nmin:
                    b = ((h >> bits) ^ h) & mask
                    if seen[b] == 0:
                        touched[k] = b
                        k += 1
                    seen[b] += 1
        if fill:
            row = np.sort(touched[:k])
            base = indptr[r]
            for q in range(k):
                indices[base + q] = row[q]
                counts[base + q] = seen[row[q]]
        else:
            indptr[r + 1] = k
        for q in range(k):
            seen[touched[q]] = 0


def _ngram_counts(texts: Sequence[np.ndarray], cfg: ClusterConfig):
    """CSR (indptr (M+1,) int64, indices (nnz,) int32 sorted per row, counts (nnz,) int32)."""
    arrays = [_as_bytes(t) for t in texts]
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum(np.array([a.size for a in arrays], np.int64), out=offsets[1:])
    buf = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
    bits = cfg.n_features.bit_length() - 1
    indptr = np.zeros(len(arrays) + 1, np.int64)
    empty_i, empty_c = np.zeros(0, np.int32), np.zeros(0, np.int32)
    _scan_ngrams(buf, offsets, cfg.ngram_min, cfg.ngram_max, bits, indptr, empty_i, empty_c, False)
    np.cumsum(indptr, out=indptr)
    indices = np.empty(indptr[-1], np.int32)
    counts = np.empty(indptr[-1], np.int32)
    _scan_ngrams(buf, offsets, cfg.ngram_min, cfg.ngram_max, bits, indptr, indices, counts, True)
    return indptr, indices, counts


def _as_bytes(text) -> np.ndarray:
    if isinstance(text, (bytes, bytearray, memoryview)):
        return np.frombuffer(text, np.uint8)
    a = np.asarray(text)
    if a.dtype != np.uint8 or a.ndim != 1:
        raise TypeError(f"texts must be 1-D uint8 arrays or bytes, got {a.dtype} {a.shape}")
    return a


@_jit
def _normalize_rows(indptr, data):
    """Scale each CSR row of data (float32) to unit L2 norm in place; all-zero rows stay zero."""
    for r in range(indptr.shape[0] - 1):
        s = 0.0
        for p in range(indptr[r], indptr[r + 1]):
            s += np.float64(data[p]) * data[p]
        if s > 0.0:
            inv = np.float32(1.0 / math.sqrt(s))
            for p in range(indptr[r], indptr[r + 1]):
                data[p] *= inv


def _tfidf(counts_csr, idf: np.ndarray, sublinear: bool):
    """(indptr, indices, data float32) rows L2-normalised tf * idf."""
    indptr, indices, counts = counts_csr
    tf = counts.astype(np.float32)
    if sublinear:
        tf = np.log(tf) + np.float32(1.0)  # counts >= 1, so tf >= 1
    data = tf * idf[indices]
    _normalize_rows(indptr, data)
    return indptr, indices, data


def _smooth_idf(indices: np.ndarray, n_rows: int, n_features: int) -> np.ndarray:
    """(F,) float32 ln((1 + M) / (1 + df)) + 1, df = texts holding the bucket."""
    df = np.bincount(indices, minlength=n_features).astype(np.float64)
    return (np.log((1.0 + n_rows) / (1.0 + df)) + 1.0).astype(np.float32)


# --- sparse x dense products (the randomized SVD and the projection) -----------------------------

@_jit
def _csr_times_dense(indptr, indices, data, dense, out):
    """out (M, k) = X (M, F) @ dense (F, k), row by row."""
    k = dense.shape[1]
    acc = np.empty(k, out.dtype)  # a private row, so the inner loop vectorises
    for r in range(indptr.shape[0] - 1):
        acc[:] = 0.0
        for p in range(indptr[r], indptr[r + 1]):
            v, row = data[p], dense[indices[p]]
            for c in range(k):
                acc[c] += v * row[c]
        out[r, :] = acc


@_jit
def _csr_t_times_dense(indptr, indices, data, dense, out):
    """out (F, k) = X.T @ dense (M, k), scattered row by row of X."""
    k = dense.shape[1]
    out[:] = 0.0
    for r in range(indptr.shape[0] - 1):
        src = dense[r]
        for p in range(indptr[r], indptr[r + 1]):
            v, dst = data[p], out[indices[p]]
            for c in range(k):
                dst[c] += v * src[c]


def _matmul(X, dense):
    indptr, indices, data = X
    out = np.empty((indptr.size - 1, dense.shape[1]), np.float32)
    _csr_times_dense(indptr, indices, data, np.ascontiguousarray(dense, np.float32), out)
    return out


def _rmatmul(X, dense, n_features):
    indptr, indices, data = X
    out = np.empty((n_features, dense.shape[1]), np.float32)
    _csr_t_times_dense(indptr, indices, data, np.ascontiguousarray(dense, np.float32), out)
    return out


def _orthonormal(a: np.ndarray) -> np.ndarray:
    """(M, l) float32 orthonormal basis of the columns of a (M, l), M >= l."""
    return np.linalg.qr(a.astype(np.float64))[0].astype(np.float32)


def _randomized_svd_projection(X, n_features: int, cfg: ClusterConfig) -> np.ndarray:
    """(F, D) float32: the top-D right singular vectors of X as columns (zero columns beyond
    X's rank), each signed so that its largest-magnitude entry is positive.

    Halko et al. 2011, Algorithms 4.4 and 5.1, with every big product a sparse one: the range
    basis Q (M, l) is re-orthonormalised after each X X^T, and B = Q^T X (l, F) is decomposed
    through its l x l Gram matrix B B^T = W diag(s^2) W^T, so V = B^T W / s.
    """
    M, D = X[0].size - 1, cfg.svd_dim
    width = min(D + cfg.svd_oversample, M, n_features)
    rng = np.random.default_rng([cfg.seed, 0x5D])
    omega = rng.standard_normal((n_features, width), dtype=np.float32)  # (F, l)
    Q = _orthonormal(_matmul(X, omega))  # (M, l) basis of X's range
    for _ in range(cfg.svd_power_iterations):
        Q = _orthonormal(_matmul(X, _rmatmul(X, Q, n_features)))
    Bt = _rmatmul(X, Q, n_features).astype(np.float64)  # (F, l) = B^T
    s2, W = np.linalg.eigh(Bt.T @ Bt)  # ascending
    s2, W = s2[::-1], W[:, ::-1]
    s = np.sqrt(np.maximum(s2, 0.0))
    keep = min(D, int(np.sum(s > s[0] * 1e-5))) if s[0] > 0 else 0
    V = Bt @ (W[:, :keep] / s[:keep])  # (F, keep) right singular vectors
    signs = np.sign(V[np.abs(V).argmax(axis=0), np.arange(keep)])
    projection = np.zeros((n_features, D), np.float32)
    projection[:, :keep] = V * signs
    return projection


def _project(X, projection: np.ndarray) -> np.ndarray:
    """(M, D) float32 rows of X @ projection, L2-normalised (an all-zero row stays zero)."""
    emb = _matmul(X, projection)
    norms = np.sqrt(np.einsum("ij,ij->i", emb, emb, dtype=np.float64))
    emb /= np.where(norms > 0, norms, 1.0).astype(np.float32)[:, None]
    return emb


# --- balanced assignment ------------------------------------------------------------------------

@_jit
def _sift_down(price, owner, size, pos):
    """Restore the min-heap order of one cluster's slots (price, owner) from position pos."""
    while True:
        child = 2 * pos + 1
        if child >= size:
            return
        if child + 1 < size and price[child + 1] < price[child]:
            child += 1
        if price[child] >= price[pos]:
            return
        price[pos], price[child] = price[child], price[pos]
        owner[pos], owner[child] = owner[child], owner[pos]
        pos = child


@_jit
def _auction(benefit, caps, prices, epsilons, labels):
    """Assign M persons to N clusters of caps[j] identical slots (sum(caps) == M), maximising
    sum benefit[i, labels[i]] to within M * epsilons[-1]; forward auction with eps-scaling
    (Bertsekas and Castanon 1989), each phase restarting from the previous phase's prices.

    Each cluster keeps its slots' prices in a min-heap: a person values cluster j at
    benefit - (its cheapest slot), bids for the best cluster's cheapest slot by the margin over
    the second-best slot (the cluster's next-cheapest slot included) plus eps, and evicts the
    holder. prices (N,) are the starting prices and receive the final cheapest-slot prices.
    """
    M, N = benefit.shape
    cmax = caps.max()
    heap = np.empty((N, cmax))
    owner = np.empty((N, cmax), np.int64)
    for j in range(N):
        heap[j, :caps[j]] = prices[j]
    stack = np.empty(M, np.int64)
    for eps in epsilons:
        owner[:] = -1
        labels[:] = -1
        for q in range(M):
            stack[q] = M - 1 - q  # person 0 bids first
        top = M
        while top > 0:
            top -= 1
            i = stack[top]
            j1, w1, w2 = -1, -np.inf, -np.inf
            for j in range(N):
                v = benefit[i, j] - heap[j, 0]
                if v > w1:
                    j1, w1, w2 = j, v, w1
                elif v > w2:
                    w2 = v
            c = caps[j1]
            if c >= 2:
                second = heap[j1, 1]
                if c >= 3 and heap[j1, 2] < second:
                    second = heap[j1, 2]
                w2 = max(w2, benefit[i, j1] - second)
            if w2 == -np.inf:  # a single slot in all: nothing to outbid
                w2 = w1
            evicted = owner[j1, 0]
            heap[j1, 0] += w1 - w2 + eps
            owner[j1, 0] = i
            _sift_down(heap[j1], owner[j1], c, 0)
            labels[i] = j1
            if evicted >= 0:
                labels[evicted] = -1
                stack[top] = evicted
                top += 1
    for j in range(N):
        prices[j] = heap[j, 0]


def _balanced_caps(nearest: np.ndarray, M: int, N: int) -> np.ndarray:
    """(N,) sizes floor(M/N) or ceil(M/N); the M mod N extra chunks go to the clusters that
    nearest-centroid assignment fills most (ties: lower index)."""
    caps = np.full(N, M // N, np.int64)
    demand = np.bincount(nearest, minlength=N)
    caps[np.lexsort((np.arange(N), -demand))[: M % N]] += 1
    return caps


def balanced_assignment(sq_dist: np.ndarray) -> np.ndarray:
    """(M,) int64 labels minimising the total squared distance subject to cluster sizes
    floor(M/N) or ceil(M/N); optimal to within M * 5e-7 * (max - min of sq_dist).

    sq_dist: (M, N) squared distances, M >= N.
    """
    M, N = sq_dist.shape
    if M < N:
        raise ConfigError(f"cannot make {N} balanced clusters from {M} chunks")
    benefit = -np.asarray(sq_dist, np.float64)
    if not np.isfinite(benefit).all():
        raise ValueError("squared distances must be finite")
    caps = _balanced_caps(benefit.argmax(axis=1), M, N)
    span = float(benefit.max() - benefit.min()) or 1.0
    epsilons = span / 8.0 ** np.arange(1, 8)  # eps-scaling: span/8 down 8x a phase to span/8**7
    labels = np.empty(M, np.int64)
    _auction(benefit, caps, np.zeros(N), epsilons, labels)
    return labels


# --- k-means ------------------------------------------------------------------------------------

def _sq_distances(emb: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(M, N) float64 |emb_i - c_j|^2, clipped at 0 against rounding."""
    e = emb.astype(np.float64)
    c = centroids.astype(np.float64)
    d = np.einsum("ij,ij->i", e, e)[:, None] - 2.0 * (e @ c.T) + np.einsum("ij,ij->i", c, c)[None]
    return np.maximum(d, 0.0)


def _kmeans_pp(emb: np.ndarray, N: int, rng: np.random.Generator) -> np.ndarray:
    """(N, D) float64 seeds by greedy k-means++ (Arthur and Vassilvitskii 2007; greedy variant
    with 2 + ln N candidates per seed as in scikit-learn)."""
    e = emb.astype(np.float64)
    M = e.shape[0]
    trials = 2 + int(math.log(N))
    centers = np.empty((N, e.shape[1]))
    centers[0] = e[rng.integers(M)]
    closest = _sq_distances(e, centers[:1])[:, 0]
    for k in range(1, N):
        total = closest.sum()
        if total <= 0:  # every point sits on a centre already: take any
            candidates = rng.integers(M, size=trials)
        else:
            cum = np.cumsum(closest)
            candidates = np.minimum(np.searchsorted(cum, rng.random(trials) * cum[-1]), M - 1)
        d = np.minimum(closest[:, None], _sq_distances(e, e[candidates]))  # (M, trials)
        best = int(np.argmin(d.sum(axis=0)))
        centers[k] = e[candidates[best]]
        closest = d[:, best]
    return centers


def _lloyd(emb: np.ndarray, centers: np.ndarray, cfg: ClusterConfig):
    """k-means from `centers`: (centroids (N, D) float64, labels (M,), objective)."""
    e = emb.astype(np.float64)
    M, N = e.shape[0], centers.shape[0]

    def assign(c):
        d = _sq_distances(e, c)
        labels = balanced_assignment(d) if cfg.balanced else d.argmin(axis=1)
        return labels, float(d[np.arange(M), labels].sum())

    labels, objective = assign(centers)
    for _ in range(cfg.iterations):
        counts = np.bincount(labels, minlength=N)
        members = scipy.sparse.csr_matrix((np.ones(M), (labels, np.arange(M))), shape=(N, M))
        new = (members @ e) / np.maximum(counts, 1)[:, None]  # (N, D) cluster means
        empty = np.flatnonzero(counts == 0)  # only without balancing
        if empty.size:
            # reseed each empty cluster at the point worst served by its centroid
            far = np.argsort(-_sq_distances(e, new)[np.arange(M), labels], kind="stable")
            new[empty] = e[far[: empty.size]]
        centers = new.astype(np.float32).astype(np.float64)  # the stored precision, so that
        new_labels, objective = assign(centers)  # unbalanced labels equal Clustering.assign's
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return centers, new_labels, objective


# --- the fitted clustering ----------------------------------------------------------------------

@dataclass(frozen=True, eq=False)  # eq=False: fields hold arrays
class Clustering:
    """Everything the router needs to embed a text and measure it against the N centroids."""

    config: ClusterConfig
    idf: np.ndarray  # (F,) float32
    projection: np.ndarray  # (F, D) float32: the truncated-SVD components, transposed
    centroids: np.ndarray  # (N, D) float32

    @property
    def n_clusters(self) -> int:
        return self.centroids.shape[0]

    def embed(self, texts: Sequence[np.ndarray]) -> np.ndarray:
        """(M, D) float32 unit-norm embeddings of byte strings (uint8 arrays or bytes), by the
        same pipeline as fitting. A text with no n-gram (shorter than ngram_min) embeds to 0."""
        X = _tfidf(_ngram_counts(texts, self.config), self.idf, self.config.sublinear_tf)
        return _project(X, self.projection)

    def sq_distances(self, emb: np.ndarray) -> np.ndarray:
        """(M, N) float32 squared Euclidean distances from embeddings (M, D) to the centroids."""
        emb = np.asarray(emb)
        if emb.ndim != 2 or emb.shape[1] != self.centroids.shape[1]:
            raise ValueError(f"embeddings must have shape (M, {self.centroids.shape[1]}), "
                             f"got {emb.shape}")
        return _sq_distances(emb, self.centroids).astype(np.float32)

    def assign(self, texts: Sequence[np.ndarray]) -> np.ndarray:
        """(M,) int64 index of the nearest centroid of each text (no balancing)."""
        return _sq_distances(self.embed(texts), self.centroids).argmin(axis=1)

    def save(self, group) -> None:
        """Write into an h5py Group (zosoma.formats.clustering)."""
        write_clustering(group, self.config, self.arrays())

    def __post_init__(self):
        F, D, N = self.config.n_features, self.config.svd_dim, self.config.n_clusters
        for name, shape in (("idf", (F,)), ("projection", (F, D)), ("centroids", (N, D))):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape:
                raise ValueError(f"{name} must be a float32 array of shape {shape} for "
                                 f"{self.config}, got {getattr(a, 'dtype', type(a))} "
                                 f"{getattr(a, 'shape', '')}")

    @classmethod
    def load(cls, group) -> "Clustering":
        """Read what `save` wrote; CheckpointError (naming file and group) on anything amiss."""
        config, arrays = read_clustering(group)
        return cls(config, **arrays)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"idf": self.idf, "projection": self.projection, "centroids": self.centroids}


def save_clustering(path: PathLike, clustering: Clustering) -> None:
    """Write a clustering alone to an HDF5 file, atomically (zosoma.formats.clustering)."""
    save_clustering_file(path, clustering.config, clustering.arrays())


def load_clustering(path: PathLike) -> Clustering:
    """Read a file written by save_clustering; CheckpointError naming the path when it is
    missing or damaged."""
    config, arrays = load_clustering_file(path)
    return Clustering(config, **arrays)


def fit_clusters(chunks: Corpus, cfg: ClusterConfig) -> tuple[Clustering, np.ndarray]:
    """Fit the c-BTM pipeline on `chunks`: (the Clustering, (M,) int64 cluster of each chunk).

    The returned assignment is the balanced one when cfg.balanced (sizes floor(M/N) or
    ceil(M/N)), else nearest centroid. Deterministic for a given cfg.seed on a given machine.
    """
    M, N = len(chunks), cfg.n_clusters
    if M == 0:
        raise DataError("cannot cluster an empty corpus: it has no chunks")
    if N > M:
        raise ConfigError(f"cannot make {N} clusters from {M} chunks: use at most {M} clusters "
                          "or smaller chunks")
    counts = _ngram_counts(chunks.docs, cfg)
    idf = _smooth_idf(counts[1], M, cfg.n_features)
    X = _tfidf(counts, idf, cfg.sublinear_tf)
    projection = _randomized_svd_projection(X, cfg.n_features, cfg)
    emb = _project(X, projection)
    best = None
    for restart in range(cfg.restarts):
        rng = np.random.default_rng([cfg.seed, 0xC1, restart])
        run = _lloyd(emb, _kmeans_pp(emb, N, rng), cfg)
        if best is None or run[2] < best[2]:
            best = run
    centroids, labels, _ = best
    return Clustering(cfg, idf, projection, centroids.astype(np.float32)), labels.astype(np.int64)


# --- reports ------------------------------------------------------------------------------------

def cluster_report(assignments: np.ndarray, names: Sequence[str],
                   n_clusters: int | None = None) -> list[dict]:
    """Per cluster, in index order: {"cluster", "size" (chunks), "share" (of all chunks),
    "mix" {name: fraction of the cluster}, largest first (ties by name)}.

    n_clusters: report this many clusters (empty ones included); default max(assignments) + 1.
    """
    a = np.asarray(assignments, np.int64)
    if a.shape != (len(names),):
        raise ValueError(f"{a.shape[0] if a.ndim == 1 else a.shape} assignments for {len(names)} names")
    N = int(a.max()) + 1 if n_clusters is None and a.size else int(n_clusters or 0)
    total = max(a.size, 1)
    report = []
    for j in range(N):
        members = [names[i] for i in np.flatnonzero(a == j)]
        kinds, counts = np.unique(np.array(members, dtype=object).astype(str), return_counts=True)
        order = sorted(range(len(kinds)), key=lambda q: (-counts[q], kinds[q]))
        report.append({
            "cluster": j,
            "size": len(members),
            "share": len(members) / total,
            "mix": {str(kinds[q]): counts[q] / len(members) for q in order},
        })
    return report


def format_report(report: list[dict], max_names: int = 4) -> str:
    """One line per cluster: 'cluster 0: 1,234 chunks (24%): code_python 61%, code_c 30%, ...'.
    At most max_names names are listed, none under 0.5%; the remainder is shown as 'other'."""
    lines = []
    for entry in report:
        shown = [(name, frac) for name, frac in list(entry["mix"].items())[:max_names]
                 if frac >= 0.005]
        parts = [f"{name} {frac:.0%}" for name, frac in shown]
        rest = (1.0 - sum(frac for _, frac in shown)) if entry["size"] else 0.0
        if rest >= 0.005:
            parts.append(f"other {rest:.0%}")
        noun = "chunk" if entry["size"] == 1 else "chunks"
        mix = ": " + ", ".join(parts) if parts else ""
        lines.append(f"cluster {entry['cluster']}: {entry['size']:,} {noun} ({entry['share']:.0%}){mix}")
    return "\n".join(lines)


def purity(assignments: np.ndarray, labels: Sequence[str]) -> float:
    """Fraction of items whose cluster's majority label equals their own label."""
    a = np.asarray(assignments, np.int64)
    if a.shape != (len(labels),):
        raise ValueError(f"{a.size} assignments for {len(labels)} labels")
    if a.size == 0:
        raise ValueError("purity of an empty assignment is undefined")
    _, lab = np.unique(np.asarray(labels, dtype=object).astype(str), return_inverse=True)
    table = np.zeros((a.max() + 1, lab.max() + 1), np.int64)
    np.add.at(table, (a, lab), 1)
    return float(table.max(axis=1).sum() / a.size)
