"""Clustering (zosoma.mixture.cluster): each stage against a plain reference on small inputs, then the whole
c-BTM pipeline on the shipped corpus (domain recovery, balance, determinism, held-out routing).

The small tests also pass with NUMBA_DISABLE_JIT=1; the shipped-corpus tests need the JIT (10 MB
of n-grams in pure Python would take many minutes) and skip without it.
"""

from collections import Counter
from pathlib import Path

import h5py
import numba
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from zosoma.config import ClusterConfig
from zosoma.formats import clustering as clustering_format
from zosoma.mixture import cluster as cl
from zosoma.mixture.cluster import (
    Clustering,
    balanced_assignment,
    cluster_report,
    fit_clusters,
    format_report,
    load_clustering,
    purity,
    save_clustering,
)
from zosoma.corpus import Corpus, chunk, load_corpus
from zosoma.errors import CheckpointError, ConfigError, DataError, WriteError

from helpers import assert_close
from world import synthetic_corpus

JIT = not numba.config.DISABLE_JIT
needs_jit = pytest.mark.skipif(not JIT, reason="the shipped corpus is too big without the JIT")

SMALL = ClusterConfig(n_clusters=3, n_features=2**10, svd_dim=8, svd_oversample=4, seed=3)


def texts_of(*strings):
    return tuple(np.frombuffer(s, np.uint8) for s in strings)


# --- features against plain Python -------------------------------------------------------------

def fnv1a_bucket(gram: bytes, bits: int) -> int:
    h = 2166136261
    for b in gram:
        h = ((h ^ b) * 16777619) % 2**32
    return ((h >> bits) ^ h) % 2**bits


def test_fnv1a_known_answers():
    # Published FNV-1a 32-bit test vectors (isthe.com/chongo/tech/comp/fnv): "" and "a", "foobar".
    def fnv(data):
        h = 2166136261
        for b in data:
            h = ((h ^ b) * 16777619) % 2**32
        return h
    assert fnv(b"") == 0x811C9DC5
    assert fnv(b"a") == 0xE40C292C
    assert fnv(b"foobar") == 0xBF9CF968
    # and the kernel hashes the same way: the 1-gram "a" alone lands in its folded bucket
    indptr, indices, counts = cl._ngram_counts(texts_of(b"a"), ClusterConfig(n_features=2**12))
    assert indices.tolist() == [fnv1a_bucket(b"a", 12)] and counts.tolist() == [1]


@pytest.mark.parametrize("nmin,nmax,bits", [(1, 4, 10), (2, 3, 6), (1, 1, 4), (3, 5, 12)])
def test_ngram_counts_match_python(nmin, nmax, bits):
    texts = texts_of(b"abracadabra", b"", b"xy", b"hello world, hello bytes\n\x00\xff\xfe",
                     bytes(range(256)))
    cfg = ClusterConfig(ngram_min=nmin, ngram_max=nmax, n_features=2**bits)
    indptr, indices, counts = cl._ngram_counts(texts, cfg)
    assert indptr.tolist()[0] == 0 and indptr.size == len(texts) + 1
    for r, text in enumerate(texts):
        data = bytes(text)
        want = Counter(fnv1a_bucket(data[t:t + n], bits)
                       for n in range(nmin, nmax + 1) for t in range(len(data) - n + 1))
        row = slice(indptr[r], indptr[r + 1])
        assert indices[row].tolist() == sorted(want), f"text {r}: buckets differ"
        assert counts[row].tolist() == [want[b] for b in sorted(want)], f"text {r}: counts differ"


def test_ngrams_do_not_cross_texts():
    cfg = ClusterConfig(ngram_min=2, ngram_max=2, n_features=2**16)
    together = cl._ngram_counts(texts_of(b"ab", b"cd"), cfg)
    assert fnv1a_bucket(b"bc", 16) not in together[1].tolist()
    assert together[1].tolist() == sorted([fnv1a_bucket(b"ab", 16)]) + sorted([fnv1a_bucket(b"cd", 16)])


def test_tfidf_matches_dense_reference():
    texts = synthetic_corpus(per_domain=3, size=50).docs
    cfg = ClusterConfig(n_features=2**8)
    indptr, indices, counts = cl._ngram_counts(texts, cfg)
    M, F = len(texts), cfg.n_features
    dense = np.zeros((M, F))
    for r in range(M):
        dense[r, indices[indptr[r]:indptr[r + 1]]] = counts[indptr[r]:indptr[r + 1]]
    df = (dense > 0).sum(axis=0)
    idf = np.log((1 + M) / (1 + df)) + 1  # scikit-learn's smooth idf
    want = np.where(dense > 0, 1 + np.log(np.maximum(dense, 1)), 0) * idf
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    got_idf = cl._smooth_idf(indices, M, F)
    assert_close(got_idf, idf, rtol=1e-6, name="idf")
    ip, ix, data = cl._tfidf((indptr, indices, counts), got_idf, sublinear=True)
    got = np.zeros((M, F))
    for r in range(M):
        got[r, ix[ip[r]:ip[r + 1]]] = data[ip[r]:ip[r + 1]]
    assert_close(got, want, atol=1e-7, rtol=1e-5, name="tf-idf")


def test_sparse_products_match_scipy():
    import scipy.sparse as sp

    texts = synthetic_corpus(per_domain=4, size=80).docs
    cfg = ClusterConfig(n_features=2**9)
    counts = cl._ngram_counts(texts, cfg)
    X = cl._tfidf(counts, cl._smooth_idf(counts[1], len(texts), cfg.n_features), True)
    ref = sp.csr_matrix((X[2].astype(np.float64), X[1], X[0]), shape=(len(texts), cfg.n_features))
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((cfg.n_features, 7)).astype(np.float32)
    assert_close(cl._matmul(X, dense), ref @ dense, atol=1e-5, rtol=1e-5, name="X @ dense")
    small = rng.standard_normal((len(texts), 5)).astype(np.float32)
    assert_close(cl._rmatmul(X, small, cfg.n_features), ref.T @ small, atol=1e-5, rtol=1e-5,
                 name="X.T @ dense")


def test_randomized_svd_is_exact_when_the_range_fits():
    """With M <= svd_dim + oversample the range finder spans X's whole row space, so the
    projection must equal the exact top right singular vectors (our sign convention)."""
    rng = np.random.default_rng(0)
    M, F, D = 12, 64, 5
    u = np.linalg.qr(rng.standard_normal((M, M)))[0]
    v = np.linalg.qr(rng.standard_normal((F, M)))[0]
    s = np.array([10, 8, 6, 4, 3, 1, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1])
    dense = (u * s) @ v.T
    X = (np.arange(M + 1, dtype=np.int64) * F, np.tile(np.arange(F, dtype=np.int32), M),
         dense.astype(np.float32).ravel())  # every entry stored
    cfg = ClusterConfig(n_features=F, svd_dim=D, svd_oversample=M - D)
    got = cl._randomized_svd_projection(X, F, cfg)
    _, _, vt = np.linalg.svd(dense.astype(np.float32).astype(np.float64))
    want = vt[:D].T * np.sign(vt[:D][np.arange(D), np.abs(vt[:D]).argmax(axis=1)])
    assert got.shape == (F, D) and got.dtype == np.float32
    assert_close(got, want, atol=1e-5, rtol=0, name="projection")


def test_projection_is_zero_padded_beyond_the_rank():
    texts = texts_of(b"aaaa", b"bbbb")  # rank 2 at most
    cfg = ClusterConfig(n_clusters=2, n_features=2**6, svd_dim=5)
    clustering, labels = fit_clusters(Corpus(("a", "b"), texts), cfg)
    assert clustering.projection.shape == (2**6, 5)
    assert np.count_nonzero(np.abs(clustering.projection).sum(axis=0)) == 2
    assert sorted(labels.tolist()) == [0, 1]


# --- balanced assignment against the Hungarian method ------------------------------------------

def optimal_balanced_cost(sq_dist, caps):
    """Exact optimum: replicate cluster j into caps[j] identical columns and solve the square
    assignment problem (scipy's linear_sum_assignment)."""
    columns = np.repeat(np.arange(sq_dist.shape[1]), caps)
    rows, cols = linear_sum_assignment(sq_dist[:, columns])
    return sq_dist[rows, columns[cols]].sum()


def test_balanced_assignment_is_optimal_and_balanced():
    pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra)")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40 if JIT else 10, deadline=None)
    @given(M=st.integers(1, 40), N=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
    def optimal_and_balanced(M, N, seed):
        N = min(N, M)
        rng = np.random.default_rng(seed)
        points, centers = rng.standard_normal((M, 3)), rng.standard_normal((N, 3))
        sq = ((points[:, None] - centers[None]) ** 2).sum(-1)
        labels = balanced_assignment(sq)
        sizes = np.bincount(labels, minlength=N)
        assert sizes.sum() == M and sizes.max() - sizes.min() <= (1 if M % N else 0)
        caps = cl._balanced_caps(sq.argmin(axis=1), M, N)
        assert np.array_equal(sizes, caps)
        cost = sq[np.arange(M), labels].sum()
        bound = M * 5e-7 * (sq.max() - sq.min()) + 1e-9
        assert cost <= optimal_balanced_cost(sq, caps) + bound
    optimal_and_balanced()


def test_balanced_assignment_keeps_nearest_when_it_is_balanced():
    sq = np.array([[0.0, 4.0], [4.0, 0.0], [0.1, 3.0], [3.0, 0.2]])
    assert balanced_assignment(sq).tolist() == [0, 1, 0, 1]
    # all four prefer cluster 0: the two with the least to lose move
    sq = np.array([[0.0, 1.0], [0.0, 3.0], [0.0, 0.5], [0.0, 2.0]])
    assert balanced_assignment(sq).tolist() == [1, 0, 1, 0]


# --- fitting small corpora ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_fit():
    corpus = synthetic_corpus()
    clustering, labels = fit_clusters(corpus, SMALL)
    return corpus, clustering, labels


def test_small_corpus_clusters_perfectly(small_fit):
    corpus, clustering, labels = small_fit
    assert purity(labels, corpus.names) == 1.0
    assert np.bincount(labels).tolist() == [12, 12, 12]
    assert clustering.centroids.shape == (3, 8) and clustering.centroids.dtype == np.float32
    assert clustering.idf.shape == (2**10,) and clustering.projection.shape == (2**10, 8)


def test_embed_reproduces_fit_and_is_unit_norm(small_fit):
    corpus, clustering, labels = small_fit
    emb = clustering.embed(corpus.docs)
    assert emb.shape == (36, 8) and emb.dtype == np.float32
    assert_close(np.linalg.norm(emb, axis=1), np.ones(36), rtol=1e-6, name="norms")
    # one text at a time, as the router embeds contexts, gives the same bits as the batch
    for i in (0, 17, 35):
        assert np.array_equal(clustering.embed([corpus.docs[i]])[0], emb[i])
    # bytes objects are accepted too
    assert np.array_equal(clustering.embed([bytes(corpus.docs[3])])[0], emb[3])
    assert np.array_equal(clustering.assign(corpus.docs), labels)  # balanced == nearest here


def test_embed_edge_cases(small_fit):
    _, clustering, _ = small_fit
    assert clustering.embed([]).shape == (0, 8)
    empty = clustering.embed([b""])
    assert np.array_equal(empty, np.zeros((1, 8), np.float32))
    assert_close(clustering.sq_distances(empty)[0], (clustering.centroids.astype(np.float64) ** 2).sum(1),
                 rtol=1e-6, name="distances of the zero embedding")
    with pytest.raises(TypeError, match="uint8"):
        clustering.embed([np.zeros(3, np.int64)])
    with pytest.raises(ValueError, match="shape"):
        clustering.sq_distances(np.zeros((2, 5), np.float32))


def test_sq_distances_match_direct_formula(small_fit):
    corpus, clustering, _ = small_fit
    emb = clustering.embed(corpus.docs[:5])
    d = clustering.sq_distances(emb)
    want = ((emb[:, None, :].astype(np.float64) - clustering.centroids[None]) ** 2).sum(-1)
    assert d.shape == (5, 3) and d.dtype == np.float32
    assert_close(d, want, atol=1e-6, rtol=1e-5, name="squared distances")


def test_unbalanced_fit_returns_nearest_centroid():
    corpus = synthetic_corpus(per_domain=8, seed=1)
    corpus = corpus.subset(range(len(corpus) - 5))  # 8 letters, 8 digits, 3 marks: unequal
    clustering, labels = fit_clusters(corpus, ClusterConfig(**{**SMALL.__dict__, "balanced": False}))
    assert np.array_equal(labels, clustering.assign(corpus.docs))
    assert sorted(np.bincount(labels).tolist()) == [3, 8, 8]
    assert purity(labels, corpus.names) == 1.0


def test_balanced_fit_equalises_unequal_domains():
    corpus = synthetic_corpus(per_domain=8, seed=1)
    corpus = corpus.subset(range(len(corpus) - 5))  # 19 chunks: sizes must be 7, 6, 6
    _, labels = fit_clusters(corpus, SMALL)
    assert sorted(np.bincount(labels, minlength=3).tolist()) == [6, 6, 7]


def test_fit_is_deterministic_on_small_corpus(small_fit):
    corpus, clustering, labels = small_fit
    again, labels2 = fit_clusters(corpus, SMALL)
    assert np.array_equal(again.centroids, clustering.centroids)
    assert np.array_equal(again.projection, clustering.projection)
    assert np.array_equal(labels2, labels)


# --- errors ------------------------------------------------------------------------------------

def test_config_rejects_zero_clusters():
    with pytest.raises(ConfigError, match="n_clusters must be at least 1, got 0"):
        ClusterConfig(n_clusters=0)


@pytest.mark.parametrize("change,match", [
    ({"n_features": 1000}, "power of two"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max"),
    ({"svd_dim": 0}, "svd_dim must be at least 1"),
    ({"svd_power_iterations": -1}, "must not be negative"),
    ({"seed": -1}, "seed"),
])
def test_config_rejects_bad_settings(change, match):
    with pytest.raises(ConfigError, match=match):
        ClusterConfig(**change)


def test_more_clusters_than_chunks_is_a_config_error():
    corpus = synthetic_corpus(per_domain=3)
    with pytest.raises(ConfigError) as info:
        fit_clusters(corpus, ClusterConfig(n_clusters=10))
    assert "cannot make 10 clusters from 9 chunks" in str(info.value)
    assert "\n" not in str(info.value)


def test_empty_corpus_is_a_data_error():
    with pytest.raises(DataError, match="empty corpus"):
        fit_clusters(Corpus((), ()), ClusterConfig(n_clusters=1))


# --- save and load -----------------------------------------------------------------------------

def test_save_load_round_trip_in_a_group(small_fit, tmp_path):
    corpus, clustering, _ = small_fit
    path = tmp_path / "soma.h5"
    with h5py.File(path, "w") as f:
        clustering.save(f.create_group("clustering"))
    with h5py.File(path, "r") as f:
        loaded = Clustering.load(f["clustering"])
        assert f["clustering"].attrs["format_version"] == clustering_format.FORMAT_VERSION == 2
    assert loaded.config == clustering.config
    for name in ("idf", "projection", "centroids"):
        assert np.array_equal(getattr(loaded, name), getattr(clustering, name))
    emb = clustering.embed(corpus.docs)
    assert np.array_equal(loaded.embed(corpus.docs), emb)
    assert np.array_equal(loaded.sq_distances(emb), clustering.sq_distances(emb))


def test_save_clustering_file_round_trip(small_fit, tmp_path):
    _, clustering, _ = small_fit
    path = tmp_path / "clusters.h5"
    save_clustering(path, clustering)
    assert [p.name for p in tmp_path.iterdir()] == ["clusters.h5"]  # no temporary left behind
    loaded = load_clustering(path)
    assert np.array_equal(loaded.centroids, clustering.centroids)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_clustering(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(CheckpointError, match="junk.h5"):
        load_clustering(tmp_path / "junk.h5")


def test_clustering_checks_its_arrays(small_fit):
    _, clustering, _ = small_fit
    with pytest.raises(ValueError, match="centroids must be a float32 array of shape"):
        Clustering(clustering.config, clustering.idf, clustering.projection,
                   clustering.centroids.astype(np.float64))
    with pytest.raises(ValueError, match=r"idf must be a float32 array of shape \(1024,\)"):
        Clustering(clustering.config, clustering.idf[:10], clustering.projection,
                   clustering.centroids)


def test_save_clustering_reports_unwritable_path(small_fit, tmp_path):
    _, clustering, _ = small_fit
    with pytest.raises(WriteError, match="cannot write clustering"):
        save_clustering(tmp_path / "no" / "such" / "dir.h5", clustering)


def damage_checksum(g):
    g["centroids"][0, 0] += 1.0


def damage_shape(g):
    del g["idf"]
    g.create_dataset("idf", data=np.zeros(7, np.float32))


def damage_missing(g):
    del g["projection"]


def damage_format(g):
    g.attrs["format"] = "something-else"


def damage_version(g):
    g.attrs["format_version"] = np.int64(99)


def damage_config(g):
    g.attrs["config"] = '{"n_clusters": 0}'


@pytest.mark.parametrize("damage,match", [
    (damage_checksum, "checksum mismatch"),
    (damage_shape, "idf is float32 (7,), expected float32 (1024,)"),
    (damage_missing, "projection"),
    (damage_format, "format is 'something-else'"),
    (damage_version, "format version 99"),
    (damage_config, "n_clusters must be at least 1"),
])
def test_damaged_clustering_raises_checkpoint_error(small_fit, tmp_path, damage, match):
    _, clustering, _ = small_fit
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        clustering.save(f.create_group("clustering"))
    with h5py.File(path, "r+") as f:
        damage(f["clustering"])
    with h5py.File(path, "r") as f, pytest.raises(CheckpointError) as info:
        Clustering.load(f["clustering"])
    assert match in str(info.value) and "\n" not in str(info.value)


# --- reports -----------------------------------------------------------------------------------

def test_purity_counts_majorities():
    assert purity([0, 0, 0, 1, 1], ["a", "a", "b", "b", "b"]) == 4 / 5
    assert purity([0, 1, 2], ["a", "a", "a"]) == 1.0
    assert purity([0, 0, 0, 0], ["a", "b", "c", "d"]) == 1 / 4
    with pytest.raises(ValueError):
        purity([0, 1], ["a"])


def test_cluster_report_and_format():
    names = ["code_python"] * 61 + ["code_c"] * 30 + ["tech_docs"] * 9 + ["drama"] * 100
    labels = [0] * 100 + [1] * 100
    report = cluster_report(labels, names, n_clusters=3)
    assert [r["size"] for r in report] == [100, 100, 0]
    assert report[0]["share"] == 0.5
    assert list(report[0]["mix"]) == ["code_python", "code_c", "tech_docs"]
    assert report[0]["mix"]["code_c"] == 0.30
    assert report[2]["mix"] == {}
    text = format_report(report)
    assert text.splitlines() == [
        "cluster 0: 100 chunks (50%): code_python 61%, code_c 30%, tech_docs 9%",
        "cluster 1: 100 chunks (50%): drama 100%",
        "cluster 2: 0 chunks (0%)",
    ]
    many = cluster_report([0] * 6, list("abcdef"))
    assert format_report(many, max_names=2) == "cluster 0: 6 chunks (100%): a 17%, b 17%, other 67%"
    # names under 0.5% go to 'other' (or vanish when that is all there is)
    tail = cluster_report([0] * 1000, ["big"] * 996 + ["tiny"] * 4)
    assert format_report(tail) == "cluster 0: 1,000 chunks (100%): big 100%"
    tails = cluster_report([0] * 1000, ["big"] * 990 + [f"t{i}" for i in range(10)])
    assert format_report(tails) == "cluster 0: 1,000 chunks (100%): big 99%, other 1%"
    assert "1,234 chunks" in format_report(cluster_report([0] * 1234, ["x"] * 1234))


# --- the shipped corpus ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    chunks = chunk(load_corpus(None, "train"), 2048)
    clustering, labels = fit_clusters(chunks, ClusterConfig(n_clusters=8))
    return chunks, clustering, labels


@pytest.mark.slow
@needs_jit
def test_shipped_corpus_recovers_domains(shipped):
    chunks, _, labels = shipped
    # Exact balance caps purity at 0.894 here: six domains of 732 chunks fill six clusters of 636,
    # multilingual (634) a seventh, and the eighth takes legal's 60 chunks with the 96 left over
    # from each big domain. Measured 0.894 (0.873 to 0.894 over seeds 0-4).
    p = purity(labels, chunks.names)
    print(f"purity N=8 {p:.3f}\n" + format_report(cluster_report(labels, chunks.names, 8)))
    assert p >= 0.85, format_report(cluster_report(labels, chunks.names, 8))


@needs_jit
def test_shipped_corpus_clusters_are_balanced(shipped):
    chunks, _, labels = shipped
    sizes = np.bincount(labels, minlength=8)
    # Sizes are floor(M/N) or ceil(M/N) by construction, so largest/smallest <= 636/635 here.
    M = len(chunks)
    assert sizes.sum() == M and set(sizes.tolist()) <= {M // 8, -(-M // 8)}
    assert sizes.max() / sizes.min() <= (-(-M // 8)) / (M // 8)


@pytest.mark.slow
@needs_jit
def test_shipped_corpus_fit_is_deterministic(shipped):
    chunks, clustering, labels = shipped
    again, labels2 = fit_clusters(chunks, ClusterConfig(n_clusters=8))
    assert np.array_equal(again.centroids, clustering.centroids)
    assert np.array_equal(again.idf, clustering.idf)
    assert np.array_equal(labels2, labels)


@pytest.mark.slow
@needs_jit
def test_shipped_corpus_embed_reproduces_fit(shipped):
    chunks, clustering, labels = shipped
    idx = [0, 1000, 2500, len(chunks) - 1]
    # the fit's embedding, recomputed through the fit's own stages on the whole corpus
    counts = cl._ngram_counts(chunks.docs, clustering.config)
    emb = cl._project(cl._tfidf(counts, clustering.idf, True), clustering.projection)
    assert np.array_equal(clustering.embed([chunks.docs[i] for i in idx]), emb[idx])
    # nearest centroid agrees with the balanced training assignment for most chunks
    assert np.mean(clustering.assign(chunks.docs) == labels) > 0.9


@needs_jit
def test_heldout_text_lands_in_its_domains_cluster(shipped):
    chunks, clustering, labels = shipped
    held = chunk(load_corpus(None, "heldout"), 2048)
    home = {d: np.bincount(labels[[i for i, n in enumerate(chunks.names) if n == d]],
                           minlength=8).argmax() for d in set(chunks.names)}
    routed = clustering.assign(held.docs)
    hits = {d: np.mean([routed[i] == home[d] for i, n in enumerate(held.names) if n == d])
            for d in sorted(home)}
    overall = np.mean([routed[i] == home[n] for i, n in enumerate(held.names)])
    print(f"held-out agreement {overall:.3f}", {d: round(float(h), 3) for d, h in hits.items()})
    # Measured 0.81 (0.77 to 0.81 over seeds 0-4). The big miss is "dictionary": its training
    # slice is mostly the Jargon File, its held-out slice the Devil's Dictionary (literary prose),
    # which routes elsewhere; tech_docs lands home for 66%, the six other domains for 97-100%.
    assert overall >= 0.75, hits
    assert sum(h >= 0.9 for h in hits.values()) >= 5, hits


def test_a_version_1_router_is_still_read():
    """data/fixtures/router-v1.h5 was written by the previous zosoma (variable-length strings)."""
    got = load_clustering(Path(__file__).resolve().parents[1] / "data" / "fixtures" / "router-v1.h5")
    assert got.n_clusters == 3 and got.centroids.shape == (3, 4)
