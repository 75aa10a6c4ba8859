"""Held-out evaluation in nats/byte, streaming statefully over whole files.

A file of n bytes has n - 1 predicted bytes. It is cut into `streams` contiguous parts evaluated
side by side as one batch; each part runs statefully from its first byte to its last, carrying
(h, c) across segments of `segment` bytes. streams=1 is one pass over the whole file; more streams
only cost each part's first few bytes of context and make evaluation much faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zosoma.corpus import Corpus
from zosoma.errors import DataError
from zosoma.model.params import Layout


@dataclass(frozen=True)
class EvalResult:
    nats: float  # total nats over all predicted bytes
    n_bytes: int  # predicted bytes

    @property
    def nats_per_byte(self) -> float:
        return self.nats / self.n_bytes

    @property
    def bits_per_byte(self) -> float:
        return self.nats_per_byte / math.log(2)


def stream_batches(data: np.ndarray, streams: int, segment: int):
    """Yield (tokens, targets, mask) of shape (S, T<=segment) covering every predicted byte of data
    once: stream s predicts positions [s*length + 1, (s+1)*length + 1) of data."""
    n_pred = data.size - 1
    streams = max(1, min(streams, n_pred))
    length = -(-n_pred // streams)
    padded = np.zeros(streams * length + 1, np.uint8)
    padded[:data.size] = data
    mask = np.zeros(streams * length, bool)
    mask[:n_pred] = True
    inputs = padded[:-1].reshape(streams, length)
    targets = padded[1:].reshape(streams, length)
    mask = mask.reshape(streams, length)
    for t in range(0, length, segment):
        sl = slice(t, t + segment)
        yield inputs[:, sl], targets[:, sl], mask[:, sl]


def evaluate_bytes(theta: np.ndarray, layout: Layout, data: np.ndarray, ops, streams: int = 16,
                   segment: int = 256) -> EvalResult:
    """Total nats of every byte of `data` (uint8, at least 2 bytes) given all bytes before it;
    the forwards run on `ops` (zosoma.engines: ops.nll_stream)."""
    if data.size < 2:
        raise DataError(f"need at least 2 bytes to evaluate, got {data.size}")
    total, state = 0.0, None
    for tokens, targets, mask in stream_batches(data, streams, segment):
        nll, state = ops.nll_stream(theta, layout, np.ascontiguousarray(tokens), np.ascontiguousarray(targets), state)
        total += float(nll[mask].sum(dtype=np.float64))
    return EvalResult(total, data.size - 1)


def evaluate_corpus(theta: np.ndarray, layout: Layout, corpus: Corpus, ops, **kwargs) -> dict[str, EvalResult]:
    """One result per document name (documents sharing a name are pooled) plus "overall"."""
    results: dict[str, EvalResult] = {}
    for name, doc in zip(corpus.names, corpus.docs):
        r = evaluate_bytes(theta, layout, doc, ops, **kwargs)
        prev = results.get(name, EvalResult(0.0, 0))
        results[name] = EvalResult(prev.nats + r.nats, prev.n_bytes + r.n_bytes)
    results["overall"] = EvalResult(sum(r.nats for r in results.values()),
                                    sum(r.n_bytes for r in results.values()))
    return results

