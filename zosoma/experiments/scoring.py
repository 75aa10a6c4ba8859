"""How a study's run is scored: its (routed) model by the segment protocol, on zosoma's own
evaluator, whatever trained it (zero-order: zosoma.experiments.study.JobRun; backprop:
zosoma.experiments.backprop.BackpropRun)."""

from __future__ import annotations

import numpy as np

from zosoma.corpus import Corpus
from zosoma.engines.ops import Ops
from zosoma.mixture.routing import evaluate_routed, evaluate_routed_corpus
from zosoma.model.protocol import PROTOCOL


class Scored:
    """Scoring for a run that has `ensemble(top_k)` and `ops` (its device's fp32 engine)."""

    def score(self, corpus: Corpus, segment: int = PROTOCOL.segment, context: int = PROTOCOL.context,
              top_k: int | None = None, ops: Ops | None = None) -> dict:
        """Nats/byte of the (routed) model on each name of corpus, and "overall", by the segment
        protocol (zosoma.mixture.routing), with `ops` (default: the device's fp32 engine)."""
        by = evaluate_routed_corpus(self.ensemble(top_k), corpus, ops or self.ops, segment=segment, context=context)
        return {name: r["routed"].nats_per_byte for name, r in by.items()}

    def score_bytes(self, data: np.ndarray, segment: int = PROTOCOL.segment, context: int = PROTOCOL.context) -> float:
        return evaluate_routed(self.ensemble(), data, segment=segment, context=context,
                               ops=self.ops)["routed"].nats_per_byte
