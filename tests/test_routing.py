"""Routing (zosoma.mixture.routing), sampling (zosoma.sample) and the routed-inference benchmark's helpers.

Tiny experts (E=8, H=16) with random weights, and clusterings fitted on three synthetic byte
"domains" with small settings, so the whole file runs in seconds.
"""

import math

import numpy as np
import pytest

from world import ALPHABETS, TINY_MODEL as TINY, TINY_MODEL_L2, synthetic_corpus
from zosoma.benchmarks.bench_route import bench_route, format_route, matched_config, matched_configs
from zosoma.formats.checkpoint import Checkpoint
from zosoma.config import ClusterConfig
from zosoma.mixture.cluster import fit_clusters, save_clustering
from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import Corpus
from zosoma.errors import CheckpointError, ConfigError, DataError
from zosoma.engines.cpu.forward import log_probs, nll_stream
from zosoma.model.params import Layout, init_params
from zosoma.mixture.routing import (Ensemble, Router, Segments, cut_segments, evaluate_routed,
                            evaluate_routed_corpus, mix_nll, run_selected,
                            segment_sums)
from zosoma.mixture.sample import sample
from zosoma.training.folder import RunFolder
from zosoma.runs.soma import load_ensemble

from helpers import assert_close


def small_config(n):
    return ClusterConfig(n_clusters=n, n_features=2**10, svd_dim=8, svd_oversample=4, seed=3)


@pytest.fixture(scope="module")
def clusterings():
    corpus = synthetic_corpus()
    return {n: fit_clusters(corpus, small_config(n))[0] for n in (1, 3)}


def mixed_text(n=1500, seed=1) -> np.ndarray:
    """Stretches of each synthetic domain back to back, so routing changes along the file."""
    rng = np.random.default_rng(seed)
    parts = []
    while sum(p.size for p in parts) < n:
        alphabet = list(ALPHABETS.values())[rng.integers(3)]
        parts.append(np.frombuffer(alphabet, np.uint8)[rng.integers(0, len(alphabet), 120)])
    return np.concatenate(parts)[:n]


def ensemble_of(clustering, top_k, thetas=None, model=TINY, temperature=0.1):
    layout = Layout(model)
    if thetas is None:
        thetas = [init_params(model, seed=7, expert=i) for i in range(clustering.n_clusters)]
    return Ensemble(tuple((t, layout) for t in thetas), Router(clustering, top_k, temperature))


def reference_weights(clustering, contexts, k, T):
    """softmax(-d^2 / T) over all N in float64, keep the k largest (ties: lower index), renormalise."""
    d2 = clustering.sq_distances(clustering.embed(contexts)).astype(np.float64)
    p = np.exp(-(d2 - d2.min(axis=1, keepdims=True)) / T)
    p /= p.sum(axis=1, keepdims=True)
    out = np.zeros_like(p)
    for s in range(p.shape[0]):
        top = np.argsort(-p[s], kind="stable")[:k]
        out[s, top] = p[s, top] / p[s, top].sum()
    return out


# --- router --------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3])
def test_weights_are_top_k_softmax(clusterings, k):
    cl = clusterings[3]
    contexts = [b"abc defg hij", b"0123 456", b"?!.,;", b"a1!b2?", b"x"]
    w = Router(cl, k).weights(contexts)
    assert w.shape == (5, 3) and w.dtype == np.float32
    assert (w >= 0).all()
    assert ((w > 0).sum(axis=1) <= k).all()
    assert_close(w.sum(axis=1), np.ones(5), atol=1e-6, name="row sums")
    assert_close(w, reference_weights(cl, contexts, k, 0.1), atol=1e-6, name="weights")


def test_each_domain_routes_to_its_own_expert(clusterings):
    cl = clusterings[3]
    contexts = [np.frombuffer(a, np.uint8)[np.random.default_rng(0).integers(0, len(a), 64)]
                for a in ALPHABETS.values()]
    top1 = Router(cl, 1).weights(contexts).argmax(axis=1)
    assert sorted(top1.tolist()) == [0, 1, 2]  # three domains, three different experts


def test_weights_ignore_the_bytes_being_predicted(clusterings):
    """Changing a segment's own bytes, context kept, leaves that segment's weights unchanged."""
    router = Router(clusterings[3], 2)
    data = mixed_text(800)
    segs = cut_segments(data, segment=50, context=40)
    before = router.weights(segs.contexts)
    rng = np.random.default_rng(5)
    for s in range(len(segs)):
        p0 = 1 + 50 * s
        changed = data.copy()
        changed[p0:p0 + 50] = rng.integers(0, 256, changed[p0:p0 + 50].size)
        after = router.weights(cut_segments(changed, segment=50, context=40).contexts)
        np.testing.assert_array_equal(after[s], before[s])
        # ... and the context is exactly the bytes just before the first predicted one
        np.testing.assert_array_equal(segs.contexts[s], data[max(0, p0 - 40):p0])


def test_empty_context_gets_equal_weights_on_the_broadest_clusters(clusterings):
    cl = clusterings[3]
    norms = (cl.centroids.astype(np.float64) ** 2).sum(axis=1)
    broadest = np.argsort(norms, kind="stable")[:2]
    w = Router(cl, 2).weights([b"", np.zeros(0, np.uint8)])
    for row in w:
        assert sorted(np.flatnonzero(row).tolist()) == sorted(broadest.tolist())
        assert_close(row[broadest], [0.5, 0.5], atol=0, rtol=0, name="uniform")


@pytest.mark.parametrize("k, T, message", [
    (4, 0.1, "top-k 4 exceeds the 3 experts"),
    (0, 0.1, "top-k must be at least 1, got 0"),
    (-1, 0.1, "top-k must be at least 1"),
    (2, 0.0, "temperature must be positive and finite, got 0.0"),
    (2, -1.0, "temperature must be positive"),
    (2, float("nan"), "temperature must be positive"),
    (2, float("inf"), "temperature must be positive"),
])
def test_router_errors(clusterings, k, T, message):
    with pytest.raises(ConfigError, match=message) as err:
        Router(clusterings[3], k, T)
    assert "\n" not in str(err.value)


# --- segments and routed evaluation ------------------------------------------------------------

def test_segments_score_every_predicted_byte_once():
    data = mixed_text(1000)
    segs = cut_segments(data, segment=64, context=100)
    scored_targets = np.concatenate([segs.targets[s, segs.start[s]:segs.stop[s]] for s in range(len(segs))])
    np.testing.assert_array_equal(scored_targets, data[1:])
    assert segs.n_bytes == data.size - 1
    for s in range(len(segs)):
        p0 = 1 + 64 * s
        c0 = max(0, p0 - 100)
        n = segs.stop[s]
        # the row is the context followed by the segment's inputs, then zero padding
        np.testing.assert_array_equal(segs.tokens[s, :n], data[c0:c0 + n])
        np.testing.assert_array_equal(segs.targets[s, :n], data[c0 + 1:c0 + 1 + n])
        assert segs.start[s] == p0 - c0 - 1 and not segs.tokens[s, n:].any()


def protocol_nll(theta, layout, data, segment, context) -> float:
    """The routed-evaluation protocol for one model, one segment at a time, unbatched."""
    total = 0.0
    for p0 in range(1, data.size, segment):
        p1 = min(p0 + segment, data.size)
        c0 = max(0, p0 - context)
        nll, _ = nll_stream(theta, layout, data[None, c0:p1 - 1].copy(), data[None, c0 + 1:p1].copy())
        total += float(nll[0, p0 - c0 - 1:].sum(dtype=np.float64))
    return total


def test_one_expert_top1_is_that_expert_exactly(clusterings):
    data = mixed_text(900)
    ens = ensemble_of(clusterings[1], 1)
    r = evaluate_routed(ens, data, segment=100, context=60, batch=4)
    assert list(r) == ["routed", "expert0", "oracle"]
    assert r["routed"] == r["expert0"] == r["oracle"]  # bit for bit
    assert r["routed"].n_bytes == data.size - 1
    theta, layout = ens.experts[0]
    assert_close(r["expert0"].nats, protocol_nll(theta, layout, data, 100, 60), rtol=1e-5,
                 name="batched vs one segment at a time")


def test_identical_experts_mix_to_each_of_them(clusterings):
    theta = init_params(TINY, seed=11)
    ens = ensemble_of(clusterings[3], 3, thetas=[theta] * 3, temperature=1.0)
    r = evaluate_routed(ens, mixed_text(700), segment=64, context=32)
    for key in ("expert0", "expert1", "expert2", "oracle"):
        assert r[key] == r["expert0"]
    assert_close(r["routed"].nats, r["expert0"].nats, rtol=1e-6, name="mixture of identical experts")


def test_oracle_and_routed_against_single_experts(clusterings):
    ens = ensemble_of(clusterings[3], 2)
    data = mixed_text(1200)
    r = evaluate_routed(ens, data, segment=80, context=64, batch=5)
    assert all(res.n_bytes == data.size - 1 for res in r.values())
    # the oracle is the best single expert of each segment, recomputed one segment at a time
    best = 0.0
    for p0 in range(1, data.size, 80):
        p1, c0 = min(p0 + 80, data.size), max(0, p0 - 64)
        per_expert = [float(nll_stream(theta, layout, data[None, c0:p1 - 1].copy(), data[None, c0 + 1:p1].copy())[0]
                            [0, p0 - c0 - 1:].sum(dtype=np.float64)) for theta, layout in ens.experts]
        best += min(per_expert)
    assert_close(r["oracle"].nats, best, rtol=1e-5, name="oracle vs per-segment best expert")
    assert r["oracle"].nats < min(r[f"expert{i}"].nats for i in range(3))  # the experts differ per segment
    # the top-k-only inference path (grouped by expert) agrees with evaluation's all-N path
    segs = cut_segments(data, 80, 64)
    chosen, w = ens.router.select(segs.contexts)
    topk = segment_sums(mix_nll(run_selected(ens, segs, chosen, batch=3), w), segs.mask()).sum()
    assert_close(topk, r["routed"].nats, rtol=1e-5, name="top-k path vs evaluation")
    # the mixture's nats lie within the selected experts' range, position by position
    nll = run_selected(ens, segs, chosen)
    mixed = mix_nll(nll, w)
    mask = segs.mask()
    assert (mixed[mask] <= nll.max(axis=1)[mask] + 1e-5).all()
    assert (mixed[mask] >= nll.min(axis=1)[mask] - 1e-5).all()


def test_mix_nll_reference():
    rng = np.random.default_rng(0)
    nll = rng.uniform(0, 8, (3, 2, 5)).astype(np.float32)
    w = np.array([[0.7, 0.3], [1.0, 0.0], [0.5, 0.5]], np.float32)
    expected = -np.log((w[:, :, None] * np.exp(-nll.astype(np.float64))).sum(axis=1))
    assert_close(mix_nll(nll, w), expected, rtol=1e-12, name="mixture")


def test_evaluate_routed_corpus_pools_names(clusterings):
    ens = ensemble_of(clusterings[3], 2)
    docs = (mixed_text(300, seed=1), mixed_text(400, seed=2), mixed_text(250, seed=3))
    out = evaluate_routed_corpus(ens, Corpus(("a", "b", "a"), docs), segment=64, context=32)
    assert list(out) == ["a", "b", "overall"]
    assert out["a"]["routed"].n_bytes == 299 + 249
    assert out["overall"]["oracle"].n_bytes == 299 + 399 + 249
    for key in out["overall"]:
        assert math.isclose(out["overall"][key].nats, out["a"][key].nats + out["b"][key].nats)


def test_evaluation_errors(clusterings):
    ens = ensemble_of(clusterings[3], 2)
    with pytest.raises(DataError, match="at least 2 bytes"):
        evaluate_routed(ens, np.zeros(1, np.uint8))
    with pytest.raises(ConfigError, match="segment"):
        evaluate_routed(ens, mixed_text(100), segment=0)
    with pytest.raises(ConfigError, match="context"):
        evaluate_routed(ens, mixed_text(100), context=0)
    with pytest.raises(ConfigError, match="2 experts for a router of 3"):
        Ensemble(ens.experts[:2], ens.router)
    with pytest.raises(ConfigError, match="context 5 must leave"):
        Segments.from_windows(np.zeros((2, 5), np.uint8), 5)


# --- sampling ------------------------------------------------------------------------------------

def test_sampling_is_seeded_exact_length_and_validated(clusterings):
    ens = ensemble_of(clusterings[3], 2)
    a = sample(ens, b"abc def ", n_bytes=70, seed=1, reroute_every=16, context=64)
    assert isinstance(a, bytes) and len(a) == 70
    assert a == sample(ens, b"abc def ", n_bytes=70, seed=1, reroute_every=16, context=64)
    assert a != sample(ens, b"abc def ", n_bytes=70, seed=2, reroute_every=16, context=64)
    assert a != sample(ens, b"0123 456", n_bytes=70, seed=1, reroute_every=16, context=64)
    assert len(sample(ens, b"", n_bytes=33, reroute_every=4)) == 33
    assert sample(ens, b"abc", n_bytes=0) == b""
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")),
                dict(n_bytes=-1), dict(reroute_every=0), dict(context=0)):
        with pytest.raises(ConfigError):
            sample(ens, b"abc", **bad)


def test_sampling_follows_the_prompt_and_carries_state(clusterings):
    """Without a re-route, sampling equals a reference that re-reads the whole history from zero
    state at every byte: the prompt's last `context` bytes, then everything generated."""
    model = TINY_MODEL_L2
    ens = ensemble_of(clusterings[3], 2, model=model)
    prompt, context, n, seed, temp = b"0123 99 4567 abc ", 12, 25, 3, 0.7
    got = sample(ens, prompt, n_bytes=n, temperature=temp, seed=seed, reroute_every=1000,
                 context=context)
    experts, w = ens.router.select([prompt[-context:]])
    rng = np.random.default_rng([seed, 0x5A4])
    history = bytearray(prompt[-context:])
    want = bytearray()
    for _ in range(n):
        tokens = np.frombuffer(bytes(history), np.uint8)[None]
        p = sum(float(wi) * np.exp(log_probs(*ens.experts[e], tokens)[0][0, -1].astype(np.float64))
                for e, wi in zip(experts[0], w[0]))
        q = p ** (1 / temp)
        cdf = np.cumsum(q)
        byte = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        want.append(byte)
        history.append(byte)
    assert got == bytes(want)


# --- a run folder --------------------------------------------------------------------------------

def fake_run(tmp_path, clustering, n):
    run = tmp_path / "run"
    run.mkdir()
    save_clustering(run / "router.h5", clustering)
    thetas = []
    for i in range(n):
        theta = init_params(TINY, seed=0, expert=i)
        (run / f"expert{i}").mkdir()
        RunFolder(run / f"expert{i}").write_checkpoint(Checkpoint(TINY, TrainConfig(optimizer="sgd", steps=1), theta, step=1))
        thetas.append(theta)
    return run, thetas


def test_load_ensemble(tmp_path, clusterings):
    cl = clusterings[3]
    run, thetas = fake_run(tmp_path, cl, 3)
    ens = load_ensemble(run, 2, 0.5)
    assert ens.n_experts == 3 and ens.top_k == 2 and ens.router.temperature == 0.5
    for (theta, layout), want in zip(ens.experts, thetas):
        np.testing.assert_array_equal(theta, want)
        assert layout.config == TINY
    np.testing.assert_array_equal(ens.router.clustering.centroids, cl.centroids)
    with pytest.raises(ConfigError, match="top-k 4 exceeds the 3 experts"):
        load_ensemble(run, 4)
    # a missing expert names its folder
    for f in (run / "expert1").iterdir():
        f.unlink()
    with pytest.raises(CheckpointError, match=r"expert1: no checkpoint\.h5 .*expert0 \.\. expert2"):
        load_ensemble(run, 2)
    (run / "expert1").rmdir()
    with pytest.raises(CheckpointError, match=r"expert1: no checkpoint\.h5"):
        load_ensemble(run, 2)
    (run / "router.h5").unlink()
    with pytest.raises(CheckpointError, match=r"no router\.h5"):
        load_ensemble(run, 2)
    with pytest.raises(CheckpointError, match="no such run folder"):
        load_ensemble(tmp_path / "nowhere", 2)


# --- the benchmark's helpers ---------------------------------------------------------------------

def test_matched_configs_have_similar_totals():
    for total in (2_000_000, 8_000_000, 30_000_000):
        small, large = matched_configs(total, 256, 8)
        assert abs(256 * small.n_params() / (8 * large.n_params()) - 1) < 0.10
    assert matched_config(2_000_000, 256) == ModelConfig(embed=8, hidden=16, layers=1)
    # 256 experts cannot be made small enough: refused before any clustering or timing
    with pytest.raises(ConfigError, match="cannot match 500,000 parameters with 256 and 8 experts"):
        bench_route(total_params=500_000)


def test_format_route():
    base = dict(top_k=4, n_segments=16, segment=128, context=128, repeats=3, threads=1,
                experts_used=8, max_segments_per_expert=9, routing_s=0.01, experts_s=1.0, mixing_s=0.001,
                cluster_fit_s=2.0, cluster_config="balanced k-means")
    records = [dict(base, name="N=8", n_experts=8, model=matched_config(2_000_000, 8),
                    params_per_expert=254_400, total_params=2_035_200, flops_per_token=1_847_296,
                    tokens_per_s=18_000.0),
               dict(base, name="N=256", n_experts=256, model=matched_config(2_000_000, 256),
                    params_per_expert=8_000, total_params=2_048_000, flops_per_token=45_056,
                    tokens_per_s=190_000.0),
               {"name": "ratio", "ratio": 10.56, "flops_ratio": 41.0, "params_ratio": 1.006,
                "n_small": 256, "n_large": 8,
                "paper": {"small_tokens_per_s": 2.36e6, "large_tokens_per_s": 257e3, "ratio": 9.19}}]
    text = format_route(records)
    assert "10.56x" in text and "9.19x" in text and "E=8 H=16 L=1" in text and "190,000" in text
