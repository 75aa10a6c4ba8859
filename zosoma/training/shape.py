"""The records a run folder keeps of what the run is, typed once: the text it trains and is
scored on (DataPaths) and a SOMA run's shape (SomaShape, the folder's soma.json). Each checks
itself and reads and writes the JSON that run folders have always held.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from zosoma.config import LOSSES
from zosoma.errors import ConfigError


def _paths(x, what: str) -> tuple[str, ...]:
    """None, one path, or a list of them, as a tuple of strings."""
    if x is None:
        return ()
    items = [x] if isinstance(x, (str, os.PathLike)) else x
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in items):
        raise ConfigError(f"{what} must be a path or a list of paths, got {x!r}")
    return tuple(str(p) for p in items)


@dataclass(frozen=True)
class DataPaths:
    """The text of a run: training files (none: the shipped corpus), held-out files (none: the
    shipped held-out slices when training on the shipped corpus), the WikiText-103 file (None:
    found when downloaded). As a run folder records it (zosoma.runs.single.data_record) the paths
    are absolute and `fingerprint` is the sha256 of the training bytes, which a resume checks."""
    train: tuple = ()
    heldout: tuple = ()
    wikitext: str | None = None
    fingerprint: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "train", _paths(self.train, "data"))
        object.__setattr__(self, "heldout", _paths(self.heldout, "heldout"))
        if self.wikitext is not None:
            object.__setattr__(self, "wikitext", _paths(self.wikitext, "wikitext")[0])

    def to_json(self) -> dict:
        return {"train": list(self.train), "heldout": list(self.heldout), "wikitext": self.wikitext,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, d: dict) -> "DataPaths":
        return cls(tuple(d.get("train") or ()), tuple(d.get("heldout") or ()), d.get("wikitext"), d.get("fingerprint"))


@dataclass(frozen=True)
class SomaShape:
    """What a SOMA run is (soma.json): N experts, their losses (independent, or the summed
    ablation), the chunks the corpus was cut into for clustering, the router's top-k, the run's
    data, each cluster's size and each chunk's cluster. A resume that extended the run records
    its new length (`steps`); the final evaluation each expert's fate (`experts_status`)."""
    experts: int
    loss: str
    chunk_size: int
    top_k: int
    data: DataPaths
    cluster_sizes: tuple
    assignments: tuple  # one cluster per chunk of chunk_size bytes, in corpus order
    steps: int | None = None
    experts_status: tuple | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not (self.experts >= 2 and self.chunk_size >= 1 and 1 <= self.top_k):
            raise ConfigError(f"a SOMA run has 2 or more experts, chunks and a top-k of at least 1: got "
                              f"{self.experts}, {self.chunk_size}, {self.top_k}")
        if len(self.cluster_sizes) != self.experts:
            raise ConfigError(f"{len(self.cluster_sizes)} cluster sizes for {self.experts} experts")

    def to_json(self) -> dict:
        d = {"experts": self.experts, "loss": self.loss, "chunk_size": self.chunk_size, "top_k": self.top_k,
             "data": self.data.to_json(), "cluster_sizes": list(self.cluster_sizes),
             "assignments": list(self.assignments)}
        if self.steps is not None:
            d["steps"] = self.steps
        if self.experts_status is not None:
            d["experts_status"] = list(self.experts_status)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SomaShape":
        """The folder's SOMA description (a dict) as a SomaShape; a ConfigError in one line when a
        field is missing or wrong."""
        try:
            return cls(int(d["experts"]), d["loss"], int(d["chunk_size"]), int(d["top_k"]),
                       DataPaths.from_json(d["data"]), tuple(d["cluster_sizes"]), tuple(d["assignments"]),
                       d.get("steps"), tuple(d["experts_status"]) if d.get("experts_status") is not None else None)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a SOMA run's description ({type(e).__name__}: {e})") from None

    def replaced(self, **changes) -> "SomaShape":
        return dataclasses.replace(self, **changes)
