"""Routing on the device (zosoma.engines.cuda.device_routing) against the host's Router: the same
hashed n-grams and counts, the embedding bit for bit, the same experts and weights within
ROUTE_RTOL. Runs on the emulated runtime of tests/test_kernels.py (and on CuPy where there is a GPU)."""

import numpy as np
import pytest

from helpers import assert_close
from test_kernels import emulated_libs, rt  # noqa: F401  the CUDA engine's runtimes
from zosoma.arrays import to_numpy
from zosoma.config import ClusterConfig
from zosoma.corpus import BatchSampler, chunk, load_corpus
from zosoma.engines.cuda import cuda_ops, device_routing
from zosoma.mixture.cluster import _ngram_counts, fit_clusters
from zosoma.mixture.routing import Router


@pytest.fixture(scope="module")
def fitted():
    """A clustering of part of the shipped corpus (fast settings) and held-out contexts of the
    benchmark's shape, plus the edge cases: empty, one and two bytes, mixed lengths, bytes."""
    train = chunk(load_corpus(None, "train"), 2048)
    part = type(train)(train.names[::8], train.docs[::8])
    clustering, _ = fit_clusters(part, ClusterConfig(n_clusters=12, restarts=1, iterations=5, seed=0))
    windows = BatchSampler(load_corpus(None, "heldout"), 128).batch(0, 0, 0, 48)
    contexts = [windows[s] for s in range(48)] + [windows[0, :0], windows[1, :1], windows[2, :2], windows[3, :77],
                                                  bytes(windows[4, :50]), np.zeros(9, np.uint8)]
    return clustering, contexts


def test_ngram_counts_are_the_hosts(rt, fitted):
    clustering, contexts = fitted
    buf, lengths = device_routing._pack(contexts)
    rows, buckets, counts = (to_numpy(a) for a in device_routing.ngram_counts(
        rt.xp.asarray(buf), rt.xp.asarray(lengths), clustering.config))
    indptr, indices, want = _ngram_counts([np.frombuffer(bytes(c), np.uint8) for c in contexts], clustering.config)
    np.testing.assert_array_equal(np.repeat(np.arange(len(contexts)), np.diff(indptr)), rows)
    np.testing.assert_array_equal(indices, buckets)
    np.testing.assert_array_equal(want, counts)


def test_the_embedding_is_the_hosts(rt, fitted):
    clustering, contexts = fitted
    got = to_numpy(device_routing.embed(clustering, contexts))
    want = clustering.embed([np.frombuffer(bytes(c), np.uint8) for c in contexts])
    if rt.xp is np:  # the float part in the host's order (route.cu); the last norm's sum may differ by an ulp
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, atol=1e-7, rtol=1e-6, name="embedding")
    assert not got[48].any() and got[:48].any(axis=1).all()  # the empty context embeds to zero


@pytest.mark.parametrize("top_k, dropped", [(4, ()), (2, (0, 5)), (12, ())])
def test_the_device_router_chooses_as_the_host(rt, fitted, top_k, dropped):
    clustering, contexts = fitted
    router = Router(clustering, top_k, dropped=dropped)
    experts, weights = cuda_ops.CudaOps().route(router, contexts)
    want_e, want_w = router.select(contexts)
    assert experts.dtype == np.int64 and weights.dtype == np.float32
    np.testing.assert_array_equal(experts, want_e)
    assert_close(weights, want_w, rtol=device_routing.ROUTE_RTOL, atol=0, name="routing weights")
    assert not np.isin(experts, dropped).any()
    np.testing.assert_array_equal(experts[48], router.fallback)  # the empty context
