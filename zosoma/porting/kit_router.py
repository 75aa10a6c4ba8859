"""The porting kit's router stage: SOMA's c-BTM routing of contexts to experts (zosoma.mixture)."""

from __future__ import annotations

import numpy as np

from zosoma.corpus import Corpus, chunk, load_corpus
from zosoma.porting.stage import Out, Stage
from zosoma.config import ClusterConfig
from zosoma.mixture.cluster import fit_clusters
from zosoma.mixture.routing import Router

TOP_K, TAU = 2, 0.1
GAP = 1e-3  # the kit's contexts have no near-ties among their K + 1 nearest centroids


def fnv_counts(text: bytes, cfg: ClusterConfig) -> np.ndarray:
    """(F,) hashed n-gram counts of one text, from the specification (zosoma.mixture.cluster)."""
    bits = cfg.n_features.bit_length() - 1
    counts = np.zeros(cfg.n_features, np.int64)
    for t in range(len(text)):
        h = 2166136261
        for n in range(1, min(cfg.ngram_max, len(text) - t) + 1):
            h = ((h ^ text[t + n - 1]) * 16777619) & 0xFFFFFFFF
            if n >= cfg.ngram_min:
                counts[((h >> bits) ^ h) & (cfg.n_features - 1)] += 1
    return counts


def _route(counts, idf, projection, centroids, tf_of, top_k, dropped=()) -> dict:
    """Features, embeddings, distances, experts and weights of count rows (S, F), in float64."""
    tf = tf_of(counts) * idf.astype(np.float64)
    norm = np.linalg.norm(tf, axis=1, keepdims=True)
    features = tf / np.where(norm > 0, norm, 1.0)  # an all-zero row stays zero
    emb = features @ projection.astype(np.float64)
    norm = np.linalg.norm(emb, axis=1, keepdims=True)
    emb = emb / np.where(norm > 0, norm, 1.0)
    c = centroids.astype(np.float64)
    dist = ((emb[:, None, :] - c[None]) ** 2).sum(-1)
    live = np.setdiff1d(np.arange(c.shape[0]), dropped)
    ranked = live[np.argsort(dist[:, live], axis=1, kind="stable")]  # nearest first, ties to the lower index
    experts = ranked[:, :top_k]
    top = -np.take_along_axis(dist, experts, axis=1) / TAU
    weights = np.exp(top - top[:, :1])
    weights /= weights.sum(axis=1, keepdims=True)
    blank = ~emb.any(axis=1)
    norms = (c ** 2).sum(1)
    norms[list(dropped)] = np.inf
    experts[blank] = np.argsort(norms, kind="stable")[:top_k]
    weights[blank] = 1.0 / top_k
    return {"features": features, "embeddings": emb, "distances": dist, "experts": experts.astype(np.int64),
            "weights": weights}


def sublinear(counts):
    counts = np.asarray(counts, np.float64)
    return np.where(counts > 0, 1.0 + np.log(np.maximum(counts, 1)), 0.0)  # an empty bucket's tf is 0


def _near_tie(dist, k: int) -> bool:
    return bool(np.any(np.diff(np.sort(dist, axis=1)[:, :k + 1], axis=1) < GAP))


def kit_clustering(seed: int) -> tuple:
    """(a small clustering of the shipped corpus: 4 clusters, F = 1024, D = 8, its config)."""
    corpus = load_corpus(None, split="train")
    chunks = chunk(Corpus(corpus.names, tuple(d[:16384] for d in corpus.docs)), 1024)
    cfg = ClusterConfig(n_clusters=4, n_features=2**10, svd_dim=8, seed=seed)
    return fit_clusters(chunks, cfg)[0], cfg


def router_stage(seed: int) -> Stage:
    """The kit's clustering and held-out contexts through the router (top-2, tau = 0.1): one
    context per held-out document, without near-ties, and the empty context."""
    clustering, cfg = kit_clustering(seed)
    router = Router(clustering, top_k=TOP_K, temperature=TAU)
    heldout = load_corpus(None, split="heldout")
    contexts = []
    for i, d in enumerate(heldout.docs):  # the first window of each document with no near-tie
        for start in range(1000, len(d) - 600, 257):
            text = bytes(d[start:start + 200 + 37 * i])
            one = _route(fnv_counts(text, cfg)[None], clustering.idf, clustering.projection, clustering.centroids,
                         sublinear, TOP_K)
            if not _near_tie(one["distances"], TOP_K):
                contexts.append(text)
                break
    contexts.append(b"")  # no n-grams: embeds to zero
    counts = np.stack([fnv_counts(c, cfg) for c in contexts])
    args = (clustering.idf, clustering.projection, clustering.centroids)
    out = _route(counts, *args, sublinear, TOP_K)
    assert np.allclose(out["embeddings"], clustering.embed(contexts), atol=1e-5)  # the spec reproduces the library
    experts, weights = router.select(contexts)
    assert np.array_equal(experts, out["experts"]) and np.allclose(weights, out["weights"], atol=1e-5)
    dropped = (int(out["experts"][0, 0]),)
    gone = _route(counts, *args, sublinear, TOP_K, dropped)
    check, _ = Router(clustering, TOP_K, TAU, dropped).select(contexts)
    assert np.array_equal(check, gone["experts"])
    offsets = np.cumsum([0] + [len(c) for c in contexts]).astype(np.int64)
    inputs = {"idf": (clustering.idf, "(F,) float32"), "projection": (clustering.projection, "(F, D) float32"),
              "centroids": (clustering.centroids, "(N, D) float32"),
              "config": (np.array(cfg.to_json()), "JSON: ngram_min, ngram_max, n_features (F), sublinear_tf, svd_dim"),
              "contexts": (np.frombuffer(b"".join(contexts), np.uint8), "(total,) uint8 the contexts back to back"),
              "offsets": (offsets, "(S + 1,) int64 context s is contexts[offsets[s]:offsets[s+1]] (the last is empty)"),
              "top_k": (np.int64(TOP_K), "K"), "temperature": (np.float64(TAU), "tau"),
              "dropped": (np.array(dropped, np.int64), "experts a SOMA run dropped: never routed to")}
    order = "nearest first (smallest d), ties to the lower index"
    outputs = {
        "counts": Out(counts, "counts", ("contexts", "offsets", "config"),
                      "FNV-1a of every n-gram (n = ngram_min..ngram_max, not crossing the context's ends), bucket "
                      "((h >> bits) ^ h) mod 2^bits; (S, F) dense"),
        "features": Out(out["features"], "features", ("counts (kit's)", "idf", "config"),
                        "tf = 1 + ln(count) for count >= 1 and 0 for an EMPTY bucket; x = tf idf; x / |x|, an "
                        "all-zero x stays zero"),
        "embeddings": Out(out["embeddings"], "embeddings", ("features (kit's)", "projection"),
                          "e = x @ projection (F, D), then e / |e| (a zero e stays zero)"),
        "distances": Out(out["distances"], "distances", ("embeddings (kit's)", "centroids"), "|e - c_i|^2, (S, N)"),
        "experts": Out(out["experts"], "experts", ("distances (kit's)", "top_k"),
                       f"the K nearest, {order}; a zero embedding: the K centroids nearest the origin"),
        "weights": Out(out["weights"], "weights", ("distances (kit's)", "experts (kit's)", "temperature",
                                                   "embeddings (kit's)"),
                       "softmax(-d / tau) over the K chosen, in the experts' order; a zero embedding: 1/K each"),
        "experts_dropped": Out(gone["experts"], "experts", ("distances (kit's)", "top_k", "dropped"),
                               f"the K nearest among the experts not dropped, {order}"),
        "weights_dropped": Out(gone["weights"], "weights", ("distances (kit's)", "experts_dropped (kit's)",
                                                            "temperature", "embeddings (kit's)"),
                                   "softmax over the K chosen; a zero embedding: 1/K each"),
    }
    tie_experts, tie_weights = top_k_of(TIES, TOP_K)
    inputs["tie_distances"] = (TIES, "(n, N) float32 given squared distances with exact ties")
    outputs["tie_experts"] = Out(tie_experts, "exact", ("tie_distances", "top_k"),
                                 f"the K nearest, {order}: an exact tie goes to the LOWER index (a stable sort)")
    outputs["tie_weights"] = Out(tie_weights, "weights", ("tie_distances", "tie_experts (kit's)", "temperature"),
                                 "softmax(-d / tau) over the K chosen, in their order")
    every = _route(counts, *args, lambda c: 1.0 + np.log(np.maximum(np.asarray(c, np.float64), 1)), TOP_K)
    misreadings = {"experts": [("experts in index order, not nearest first", np.sort(out["experts"], axis=1))],
                   "features": [("tf = 1 + ln(max(count, 1)) for every bucket: an empty bucket's tf must be 0",
                                 every["features"])],
                   "weights": [("softmax over all N then cut to the top-k (not renormalised)", _uncut(out))],
                   "tie_experts": [("an exact tie to the higher index", TIES.shape[1] - 1 - top_k_of(TIES[:, ::-1], TOP_K)[0])]}
    return Stage("router", "hashed n-gram counts, tf-idf features, embedding, distances, top-k experts and weights, "
                           "the empty context, a dropped expert", inputs, outputs, misreadings=misreadings)


# Distances with exact ties (the contexts above avoid them): between the nearest two, the second and
# third, all four, and a pair nearer than the rest
TIES = np.array([[0.5, 0.3, 0.3, 0.9], [0.2, 0.7, 0.2, 0.2], [0.4, 0.4, 0.4, 0.4], [1.0, 0.6, 0.8, 0.6]], np.float32)


def top_k_of(dist, k: int) -> tuple:
    """(experts (n, k) int64, weights (n, k) float64) of given distances: nearest first, ties to the
    lower index; softmax(-d / tau) over the chosen."""
    d = np.asarray(dist, np.float64)
    experts = np.argsort(d, axis=1, kind="stable")[:, :k]
    top = -np.take_along_axis(d, experts, axis=1) / TAU
    w = np.exp(top - top[:, :1])
    return experts.astype(np.int64), w / w.sum(axis=1, keepdims=True)


def _uncut(out: dict) -> np.ndarray:
    logits = -out["distances"] / TAU
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.take_along_axis(w, out["experts"], axis=1)
