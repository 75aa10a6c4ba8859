"""What training and the executors yield: typed progress records.

Library code yields these; the command line renders them (isinstance, never event strings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zosoma.config import ModelConfig, TrainConfig


@dataclass(frozen=True)
class Clusters:
    """A SOMA run clustered its corpus: one report row per cluster (zosoma.mixture.cluster)."""
    report: list
    n_chunks: int
    chunk_size: int


@dataclass(frozen=True)
class Started:
    """A run (new or resumed) is about to train. steps: each expert's step so far; resumed: it goes
    on from its checkpoints."""
    run_dir: str
    model: ModelConfig
    train: TrainConfig
    data: str  # one line describing the training data
    experts: int = 1
    loss: str = "independent"
    steps: tuple = (0,)
    device: str = "cpu"
    resumed: bool = False

    @property
    def n_params(self) -> int:
        return self.model.n_params()


@dataclass(frozen=True)
class Step:
    """One optimizer step of one expert; `metrics` is the record written to metrics.jsonl; `notes`
    are lines the user should read about the step (a population worker rebuilt)."""
    expert: int
    metrics: dict = field(repr=False)
    notes: tuple = ()

    @property
    def step(self) -> int:
        return self.metrics["step"]

    @property
    def loss(self) -> float:
        return self.metrics["loss"]

    @property
    def skipped(self) -> bool:
        return self.metrics["skipped"]

    @property
    def tokens_per_s(self) -> float:
        return self.metrics["tokens_per_s"]


@dataclass(frozen=True)
class Finished:
    """An expert (or single model) reached its last step."""
    expert: int
    step: int


@dataclass(frozen=True)
class Diverged:
    """An expert's loss ran away (zosoma.training.guard): it stopped at `step`, checkpointed."""
    expert: int
    step: int
    verdict: str


@dataclass(frozen=True)
class Continued:
    """An expert's guard found divergence at `step` and, as --on-divergence continue asks, it
    trains on regardless (the verdict is in its results)."""
    expert: int
    step: int
    verdict: str


@dataclass(frozen=True)
class Restarted:
    """An expert's guard fired at `step` and it restarted (zosoma.training.trainer): rolled back to
    step `to`, its rate now `lr_scale` times the configured one."""
    expert: int
    step: int
    verdict: str
    to: int
    lr_scale: float


@dataclass(frozen=True)
class Dropped:
    """An expert diverged again after `restarts` restarts, or was still diverging when its
    budget ran out: it trains no further, and a SOMA run routes around it."""
    expert: int
    step: int
    verdict: str
    restarts: int


@dataclass(frozen=True)
class Stopped:
    """An expert stopped on request, checkpointed at `step`; a resume continues it."""
    expert: int
    step: int


@dataclass(frozen=True)
class Failed:
    """A unit of work raised: `unit` names it (an expert index, a run folder), `error` is one line."""
    unit: Any
    error: str


@dataclass(frozen=True)
class Result:
    """A unit of work's final value (e.g. a comparison run's result record)."""
    unit: Any
    value: Any = field(repr=False)


@dataclass(frozen=True)
class Note:
    """Something the user should read, one line (e.g. a damaged checkpoint passed over)."""
    message: str


@dataclass(frozen=True)
class Evaluating:
    """Training is over and every model checkpointed: the final evaluation starts (a stop now
    loses nothing but the evaluation, which a resume does again)."""


@dataclass(frozen=True)
class Evaluated:
    """The final evaluation, as written to results.json, and the yardsticks measured on the same
    texts (zosoma.yardsticks.lookup: {"heldout": Yardsticks, "wikitext103": ...}, those cached)."""
    results: dict = field(repr=False)
    yardsticks: dict = field(default_factory=dict, repr=False)
