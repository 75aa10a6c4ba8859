"""The evaluation protocol every table uses, defined once: each held-out file cut into segments
of `segment` bytes, each scored after `context` bytes of warm-up (the router of a SOMA run reads
the same context and mixes the `top_k` nearest experts). The evaluation, the yardsticks, the
comparison and every command's defaults take it from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zosoma.errors import ConfigError


@dataclass(frozen=True)
class EvalProtocol:
    segment: int = 256  # bytes predicted per segment (and per routing decision)
    context: int = 512  # bytes before each segment, for warm-up (and routing)
    top_k: int = 2  # SOMA: experts mixed per segment

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{f.name} must be an integer, got {value!r}")
            if value < 1:
                raise ConfigError(f"{f.name} must be at least 1, got {value}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "EvalProtocol":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


PROTOCOL = EvalProtocol()  # the tables' protocol
