"""Streaming evaluation: every byte scored once, with its whole preceding stream as context."""

import math

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL_L2 as MODEL
from zosoma.model import reference
from zosoma.corpus import Corpus
from zosoma.errors import DataError
from zosoma.engines.ops import Ops
from zosoma.model.evaluate import evaluate_bytes, evaluate_corpus, stream_batches
from zosoma.model.params import Layout, init_params


def reference_nats(theta, layout, data):
    logits, _ = reference.forward(theta.astype(np.float64), layout, data[None, :-1])
    return reference.nll(logits, data[None, 1:]).sum()


@pytest.mark.parametrize("streams,segment", [(1, 7), (1, 1000), (4, 5), (3, 64)])
def test_streams_and_segments_match_one_reference_pass_per_stream(streams, segment):
    layout = Layout(MODEL)
    theta = init_params(MODEL, 1)
    data = np.random.default_rng(0).integers(0, 256, 103).astype(np.uint8)
    result = evaluate_bytes(theta, layout, data, Ops(), streams=streams, segment=segment)
    assert result.n_bytes == 102
    n_pred = data.size - 1
    length = -(-n_pred // streams)
    expected = sum(reference_nats(theta, layout, data[s * length:min((s + 1) * length, n_pred) + 1])
                   for s in range(streams))
    assert_close(result.nats, expected, rtol=1e-5, name="total nats")
    assert result.bits_per_byte == pytest.approx(result.nats_per_byte / math.log(2))


def test_stream_batches_cover_every_predicted_byte_once():
    data = np.arange(50, dtype=np.uint8)
    seen = []
    for tokens, targets, mask in stream_batches(data, 4, 6):
        assert np.array_equal(targets[mask], tokens[mask] + 1)
        seen += targets[mask].tolist()
    assert sorted(seen) == list(range(1, 50))


def test_corpus_pools_names_and_overall():
    layout = Layout(MODEL)
    theta = init_params(MODEL, 2)
    rng = np.random.default_rng(1)
    docs = tuple(rng.integers(0, 256, n).astype(np.uint8) for n in (40, 30, 50))
    results = evaluate_corpus(theta, layout, Corpus(("a", "b", "a"), docs), Ops(), streams=1)
    assert results["a"].n_bytes == 39 + 49 and results["b"].n_bytes == 29
    assert results["overall"].nats == pytest.approx(results["a"].nats + results["b"].nats)
    with pytest.raises(DataError):
        evaluate_bytes(theta, layout, docs[0][:1], Ops())

