"""Routing: the c-BTM top-k mixture of SOMA's experts, and routed evaluation.

Router (after c-BTM, Gururangan et al. 2023): embed the context that precedes the
bytes being predicted (never those bytes) with the training clustering, take its squared distances
d_i to the N centroids, weight the experts by softmax(-d^2 / T) (c-BTM: T = 0.1), keep the top-k
and renormalise. The mixture predicts the next byte with p = sum_i w_i p_i.

Shape letters: S segments (batch rows), T time, K = top_k, N experts, V = 256.

A context that embeds to the zero vector carries no routing information: the empty context, or
one whose every n-gram is unknown to the clusterer. Such a context gets EQUAL weights 1/K on the
K experts whose centroids lie nearest the origin, i.e. where the zero vector sits (the smallest
|c_i|: the broadest clusters, the least specialised experts; ties by lower index). The experts are
the ones plain distance routing would pick; the weights are uniform because the differences
between the |c_i|^2 describe how spread out each cluster is, not evidence about this context, and
balanced clusters make the cluster prior uniform. In routed evaluation it is rare (every context
holds at least the byte before the first predicted one, so only bytes the clusterer never saw
embed to zero); sampling from an empty prompt starts with it.

Routed evaluation protocol (`evaluate_routed`); it differs from evaluate.evaluate_bytes, which
streams one model statefully over a whole file:

    the n - 1 predicted bytes of a file (positions 1 .. n-1) are cut into segments of `segment`
    bytes; for a segment whose first predicted byte is at position p0,
    - the routing context is data[max(0, p0 - context) : p0], the bytes just before it;
    - each expert starts from zero state, consumes those context bytes as warm-up (its
      predictions of context bytes are not scored; the last context byte is the input that
      predicts p0), then scores the segment's bytes, carrying its state through the segment;
    - the mixture's weights are fixed for the whole segment.
    So every scored byte sees between `context` and `context + segment - 1` bytes of history (fewer
    only near the start of the file), and every segment is independent of the others.

Segments are batched: row s of the batch is the segment's context followed by its inputs,
right-padded with zeros to the longest row. The LSTM is causal and every row starts from zero
state at column 0, so padding after a row's last scored column changes nothing before it.

The experts' forwards run on the Ops they are handed (zosoma.engines; on a GPU experts of one
size run together), and so does routing (Ops.route: on a GPU the embedding, distances and top-k
run on the device, zosoma.engines.cuda.device_routing); mixing stays on the host. The nats agree
across engines within float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from zosoma.arrays import get_array_module
from zosoma.mixture.cluster import Clustering
from zosoma.corpus import Corpus
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError, DataError
from zosoma.model.evaluate import EvalResult
from zosoma.model.protocol import PROTOCOL


_BATCH = 64  # S per expert forward in evaluation: bounds memory to about batch * T * (K + 2) floats


class Router:
    """c-BTM top-k routing over the centroids of a fitted Clustering. Experts in `dropped` (a SOMA
    run gave up on them: zosoma.training.trainer) are never chosen: routing is over the others."""

    def __init__(self, clustering: Clustering, top_k: int, temperature: float = 0.1, dropped=()):
        N = clustering.n_clusters
        dropped = tuple(sorted({int(i) for i in dropped}))
        if any(not 0 <= i < N for i in dropped):
            raise ConfigError(f"dropped experts {list(dropped)} outside 0 .. {N - 1}")
        live = N - len(dropped)
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
            raise ConfigError(f"top-k must be an integer, got {top_k!r}")
        if top_k < 1:
            raise ConfigError(f"top-k must be at least 1, got {top_k}")
        if top_k > live:
            noun = "expert" if live == 1 else "experts"
            left = f" left ({len(dropped)} dropped)" if dropped else ""
            raise ConfigError(f"top-k {top_k} exceeds the {live} {noun}{left}")
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ConfigError(f"routing temperature must be a number, got {temperature!r}") from None
        if not (math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"routing temperature must be positive and finite, got {temperature}")
        self.clustering, self.top_k, self.temperature = clustering, int(top_k), temperature
        self.dropped = dropped
        c = clustering.centroids.astype(np.float64)
        # experts for a context with no information: the K centroids nearest the origin
        norms = np.einsum("ij,ij->i", c, c)
        norms[list(dropped)] = np.inf
        self._fallback = np.argsort(norms, kind="stable")[:self.top_k]

    @property
    def fallback(self) -> np.ndarray:
        """(K,) the experts of a context that embeds to zero (the module docstring)."""
        return self._fallback

    @property
    def live(self) -> np.ndarray:
        """The experts routing may choose (all but the dropped)."""
        return np.setdiff1d(np.arange(self.n_experts), self.dropped)

    @property
    def n_experts(self) -> int:
        return self.clustering.n_clusters

    def select(self, contexts: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """The top-k experts of each context and their weights.

        contexts: S byte strings (bytes or 1-D uint8 arrays), each the bytes BEFORE what is to be
        predicted. Returns experts (S, K) int64 and weights (S, K) float32, non-negative, summing
        to 1 per row, in order of decreasing weight (ties: lower expert index first).
        """
        S, K = len(contexts), self.top_k
        if S == 0:
            return np.zeros((0, K), np.int64), np.zeros((0, K), np.float32)
        emb = self.clustering.embed(contexts)  # (S, D) unit rows, or zero rows
        logits = -self.clustering.sq_distances(emb).astype(np.float64) / self.temperature  # (S, N)
        logits[:, list(self.dropped)] = -np.inf
        experts = top_k(logits, K)  # (S, K) best first
        top = np.take_along_axis(logits, experts, axis=1)
        # softmax over all N, then keep the top-k and renormalise == softmax over the top-k logits
        w = np.exp(top - top[:, :1])
        w /= w.sum(axis=1, keepdims=True)
        blank = ~emb.any(axis=1)  # (S,) contexts that embed to zero
        experts[blank] = self._fallback
        w[blank] = 1.0 / K
        return experts.astype(np.int64), w.astype(np.float32)

    def weights(self, contexts: Sequence) -> np.ndarray:
        """(S, N) float32 mixture weights of each context: top-k non-zero, summing to 1."""
        experts, w = self.select(contexts)
        out = np.zeros((len(contexts), self.n_experts), np.float32)
        np.put_along_axis(out, experts, w, axis=1)
        return out


def top_k(scores: np.ndarray, K: int) -> np.ndarray:
    """(S, K) int64 indices of each row's K largest scores (S, N), largest first, ties by lower
    index: np.argsort(-scores, kind="stable")[:, :K] without sorting all N (at N = 256 the full
    sort was a fifth of routing). A row with a tie at the K-th place takes the full sort."""
    S, N = scores.shape
    if K >= N:
        return np.argsort(-scores, axis=1, kind="stable")[:, :K]
    part = np.argpartition(-scores, K - 1, axis=1)[:, :K]  # the K largest, unordered
    vals = np.take_along_axis(scores, part, axis=1)
    out = np.take_along_axis(part, np.lexsort((part, -vals)), axis=1)  # by score, then index
    tied = (scores >= vals.min(axis=1, keepdims=True)).sum(axis=1) > K  # more than K reach the K-th
    if tied.any():
        out[tied] = np.argsort(-scores[tied], axis=1, kind="stable")[:, :K]
    return out.astype(np.int64)


class Whole:
    """The router of a one-model "ensemble": every segment goes to expert 0 with weight 1, so a
    single model is scored by exactly the routed protocol (and its nats equal the model's)."""
    n_experts = top_k = 1
    temperature = None
    dropped = ()
    live = np.arange(1)

    def select(self, contexts):
        return np.zeros((len(contexts), 1), np.int64), np.ones((len(contexts), 1), np.float32)


@dataclass(frozen=True, eq=False)  # eq=False: holds arrays
class Ensemble:
    """N experts, each (theta (d_i,) float32, its Layout), and the router over their clusters.
    Experts may have different ModelConfigs."""

    experts: tuple
    router: Router

    def __post_init__(self):
        object.__setattr__(self, "experts", tuple(
            (get_array_module(t).ascontiguousarray(t, np.float32), lay) for t, lay in self.experts))
        if len(self.experts) != self.router.n_experts:
            raise ConfigError(f"{len(self.experts)} experts for a router of "
                              f"{self.router.n_experts} clusters")
        for i, (theta, layout) in enumerate(self.experts):
            if theta.shape != (layout.size,):
                raise ConfigError(f"expert {i}: theta has shape {theta.shape}, its layout "
                                  f"needs ({layout.size},)")

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def n_params(self) -> int:
        return sum(layout.size for _, layout in self.experts)

    def on(self, ops) -> "Ensemble":
        """This ensemble with every expert's weights on the engine `ops`, copied once (no copy
        when they are there already), so that the forwards do not copy them each call."""
        return Ensemble(tuple((ops.asarray(theta), layout) for theta, layout in self.experts), self.router)


# --- segments ------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Segments:
    """S segments laid out as batch rows (see the module docstring).

    tokens, targets: (S, T) uint8, row s = the segment's context bytes then its inputs, and the
    next byte of each, right-padded with zeros; the scored columns of row s are
    [start[s], stop[s]); contexts: S routing contexts (1-D uint8 views), the bytes before the
    segment's first predicted byte.
    """

    tokens: np.ndarray
    targets: np.ndarray
    start: np.ndarray  # (S,) int64
    stop: np.ndarray  # (S,) int64
    contexts: tuple

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_bytes(self) -> int:
        """Scored bytes."""
        return int((self.stop - self.start).sum())

    def mask(self, rows: slice = slice(None), T: int | None = None) -> np.ndarray:
        """(S', T) bool: scored positions of rows."""
        T = self.tokens.shape[1] if T is None else T
        cols = np.arange(T)
        return (cols >= self.start[rows, None]) & (cols < self.stop[rows, None])

    @classmethod
    def from_windows(cls, windows: np.ndarray, context: int) -> "Segments":
        """Windows (S, C + G) uint8, each C = context bytes of routing context and warm-up then
        G >= 1 bytes to score, as one Segments (T = C + G - 1)."""
        windows = np.ascontiguousarray(windows, np.uint8)
        S, W = windows.shape
        if not 1 <= context < W:
            raise ConfigError(f"context {context} must leave at least one of the {W} window bytes "
                              "to score")
        return cls(windows[:, :-1].copy(), windows[:, 1:].copy(), np.full(S, context - 1),
                   np.full(S, W - 1), tuple(windows[s, :context] for s in range(S)))


def segment_bounds(n: int, segment: int = PROTOCOL.segment,
                   context: int = PROTOCOL.context) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(S,) int64 each: the first context byte c0, the first predicted position p0 and one past
    the last p1 of the segments of a file of n bytes, by the protocol of the module docstring:
    segment s predicts positions [1 + s*segment, min(1 + (s+1)*segment, n)) after the context
    data[c0:p0]."""
    for name, value in (("segment", segment), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive number of bytes, got {value!r}")
    if n < 2:
        raise DataError(f"need at least 2 bytes to evaluate, got {n}")
    p0 = np.arange(1, n, segment, dtype=np.int64)  # (S,) first predicted position
    p1 = np.minimum(p0 + segment, n)  # (S,) one past the last
    c0 = np.maximum(p0 - context, 0)  # (S,) first context byte
    return c0, p0, p1


def cut_segments(data: np.ndarray, segment: int = PROTOCOL.segment, context: int = PROTOCOL.context) -> Segments:
    """The segments of one file (uint8, at least 2 bytes): segment_bounds's, as batch rows."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise DataError(f"data must be 1-D uint8 bytes, got {data.dtype} {data.shape}")
    n = data.size
    c0, p0, p1 = segment_bounds(n, segment, context)
    start, stop = p0 - c0 - 1, p1 - c0 - 1  # scored columns of each row
    T = int(stop.max())
    cols = c0[:, None] + np.arange(T)  # (S, T) position of each input byte
    valid = np.arange(T) < stop[:, None]
    safe = np.minimum(cols, n - 2)
    tokens = np.where(valid, data[safe], 0).astype(np.uint8)
    targets = np.where(valid, data[safe + 1], 0).astype(np.uint8)
    contexts = tuple(data[a:b] for a, b in zip(c0.tolist(), p0.tolist()))
    return Segments(tokens, targets, start, stop, contexts)


# --- mixing --------------------------------------------------------------------------------------

def mix_nll(nll: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Nats of the mixture p = sum_k w_k p_k at each position, -log sum_k w_k exp(-nll_k), by a
    stable logsumexp in float64. nll (S, K, T) each selected expert's nats; weights (S, K).
    Returns (S, T) float64; with K = 1 and weight 1 it is exactly nll."""
    with np.errstate(divide="ignore"):  # a weight that underflowed to 0 contributes exp(-inf)
        x = np.log(np.asarray(weights, np.float64))[:, :, None] - np.asarray(nll, np.float64)
    m = x.max(axis=1)  # (S, T)
    return -(m + np.log(np.exp(x - m[:, None]).sum(axis=1)))


def run_selected(ensemble: Ensemble, segs: Segments, experts: np.ndarray, batch: int = 256,
                 ops: Ops | None = None) -> np.ndarray:
    """(S, K, T) float32 nats of each segment's selected experts, running only those: rows are
    grouped by expert and each expert scores its rows in batches of at most `batch` (the top-k
    inference path; experts[s] (K,) are the expert indices of segment s), all batches through one
    ops.models_nll call (a GPU runs the batches of experts of one size together; keep the weights
    there with Ensemble.on). Columns outside a row's [start, stop) are context or padding: 0,
    or nats no one reads."""
    ops = ops or Ops()
    S, K = experts.shape
    T = segs.tokens.shape[1]
    out = np.zeros((S, K, T), np.float32)
    jobs = []  # (expert, rows, slots): a batch of at most `batch` rows of one expert
    order = np.argsort(experts, axis=None, kind="stable")  # (S*K,) grouped by expert
    flat = experts.reshape(-1)[order]
    for group in np.split(order, np.flatnonzero(np.diff(flat)) + 1):
        if group.size == 0:
            continue
        expert = int(experts.reshape(-1)[group[0]])
        rows, slots = np.divmod(group, K)
        jobs += [(expert, rows[a:a + batch], slots[a:a + batch]) for a in range(0, rows.size, batch)]
    stops = [int(segs.stop[r].max()) for _, r, _ in jobs]
    nlls = ops.models_nll([ensemble.experts[e] for e, _, _ in jobs],
                          [(segs.tokens[r, :Tb], segs.targets[r, :Tb]) for (_, r, _), Tb in zip(jobs, stops)],
                          [int(segs.start[r].min()) for _, r, _ in jobs])  # the context needs no output layer
    for (_, r, k), Tb, nll in zip(jobs, stops, nlls):
        out[r, k, :Tb] = nll
    return out


def segment_sums(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(S,) float64 sums of the scored positions, one fixed order for every model and the mixture
    (so that a mixture equal to an expert position by position also equals it in total)."""
    return np.where(mask, np.asarray(values, np.float64), 0.0).sum(axis=1)


# --- routed evaluation ---------------------------------------------------------------------------

def evaluate_routed(ensemble: Ensemble, data: np.ndarray, segment: int = PROTOCOL.segment,
                    context: int = PROTOCOL.context, batch: int = _BATCH,
                    ops: Ops | None = None) -> dict[str, EvalResult]:
    """Nats of every predicted byte of one file (uint8) by the protocol of the module docstring,
    for:
        "routed"   the top-k mixture p = sum_i w_i p_i, nats -log sum_i w_i exp(-nll_i)
        "expert0".. each expert alone, under the same protocol (every expert is run on every
                   segment, so these come at no extra cost)
        "oracle"   per segment, the single expert with the lowest total nats on that segment:
                   an ORACLE, it peeks at the targets, an upper bound on hard (top-1) routing
                   (over the experts routing may choose: a dropped expert is scored alone only)
    Segments are scored `batch` at a time by every expert (ops.models_nll: on a GPU, experts of
    one size at once)."""
    segs = cut_segments(data, segment, context)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ConfigError(f"batch must be a positive number of segments, got {batch!r}")
    ops = ops or Ops()
    ensemble = ensemble.on(ops)
    experts, weights = ops.route(ensemble.router, segs.contexts)  # (S, K) each
    S, N = len(segs), ensemble.n_experts
    per_expert = np.empty((N, S))  # nats of each segment under each expert alone
    routed = np.empty(S)
    for a in range(0, S, batch):
        rows = slice(a, min(a + batch, S))
        T = int(segs.stop[rows].max())
        mask = segs.mask(rows, T)
        chosen = experts[rows]
        selected = np.zeros((chosen.shape[0], chosen.shape[1], T), np.float32)  # (S', K, T)
        every = ops.models_nll(ensemble.experts, [(segs.tokens[rows, :T], segs.targets[rows, :T])] * N)
        for i, nll in enumerate(every):
            per_expert[i, rows] = segment_sums(nll, mask)
            r, k = np.nonzero(chosen == i)
            selected[r, k] = nll[r]
        routed[rows] = segment_sums(mix_nll(selected, weights[rows]), mask)
    n = segs.n_bytes
    out = {"routed": EvalResult(float(routed.sum()), n)}
    out.update({f"expert{i}": EvalResult(float(per_expert[i].sum()), n) for i in range(N)})
    out["oracle"] = EvalResult(float(per_expert[ensemble.router.live].min(axis=0).sum()), n)
    return out


def evaluate_routed_corpus(ensemble: Ensemble, corpus: Corpus, ops: Ops | None = None,
                           **kwargs) -> dict[str, dict[str, EvalResult]]:
    """evaluate_routed of every document, pooled per document name, plus "overall":
    {name: {"routed": EvalResult, "expert0": ..., "oracle": ...}}. The oracle pools each
    segment's best expert, so it stays per segment."""
    ops = ops or Ops()
    ensemble = ensemble.on(ops)  # once for all documents
    results: dict[str, dict[str, EvalResult]] = {}
    for name, doc in zip(corpus.names, corpus.docs):
        by = evaluate_routed(ensemble, doc, ops=ops, **kwargs)
        prev = results.setdefault(name, {})
        for key, r in by.items():
            p = prev.get(key, EvalResult(0.0, 0))
            prev[key] = EvalResult(p.nats + r.nats, p.n_bytes + r.n_bytes)
    overall: dict[str, EvalResult] = {}
    for by in list(results.values()):
        for key, r in by.items():
            p = overall.get(key, EvalResult(0.0, 0))
            overall[key] = EvalResult(p.nats + r.nats, p.n_bytes + r.n_bytes)
    results["overall"] = overall
    return results
