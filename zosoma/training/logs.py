"""A run's append-only logs: its metrics log as a trainer writes it, with the mark a checkpoint
keeps of it, and a sharded population's log of each step's scalars.

The metrics log is one JSON line per step, appended whole. Its mark (lines so far and the SHA-256
of their bytes, `head -n N metrics.jsonl | sha256sum`) goes into every checkpoint, so that a run
going on from one finds out whether the file still holds what the checkpoint saw. The scalars log
holds each step's scalars of a population sharded over workers, so a lost worker is rebuilt by
replay. Which files they are, and what is said and done when one is damaged, is the run folder's
(zosoma.training.folder).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from zosoma.atomic import append_line, atomic_write, reason, set_aside
from zosoma.formats.checkpoint import EMPTY_SHA256, Checkpoint


@dataclasses.dataclass(frozen=True)
class MetricsMark:
    """How far a run's metrics.jsonl went at a checkpoint: its first `records` lines, whose bytes
    have SHA-256 `sha256`. A checkpoint of format version 1-2 holds the records themselves
    instead (`stored`)."""
    records: int = 0
    sha256: str = EMPTY_SHA256
    stored: list | None = None

    @classmethod
    def of(cls, ckpt: Checkpoint) -> "MetricsMark":
        return cls(ckpt.metrics_records, ckpt.metrics_sha256, ckpt.stored_metrics)


class MetricsLog:
    """The metrics log at `path`, opened at a mark: it keeps the lines the mark covers (`cut` drops
    those past it). A file that does not hold them has `damaged` (one line: why); the run folder
    says so and names `aside`, where `cut` sets the file aside before the log begins anew."""

    def __init__(self, path: Path, mark: MetricsMark):
        self.path = path
        head, why = covered(path, mark)
        self.damaged = None if head is not None else not_held(path, mark.records, why)
        self.aside: Path | None = None
        self.records = 0 if head is None else mark.records
        self._head = head or b""  # what the file is cut back to, until `cut`
        self._rewrite = mark.stored is not None  # a version 1-2 checkpoint's records: written out anew
        self._hash = hashlib.sha256(self._head)

    @property
    def mark(self) -> MetricsMark:
        return MetricsMark(self.records, self._hash.hexdigest())

    def cut(self) -> None:
        """Make the file hold just the lines the log was opened with (those past its checkpoint
        dropped, or none after a damaged one was set aside)."""
        if self.aside is not None and self.path.exists():
            set_aside(self.path, self.aside)
        if self._rewrite or not self.path.is_file() or self.path.stat().st_size != len(self._head):
            atomic_write(self.path, self._head, "metrics")
        self.aside, self._rewrite, self._head = None, False, b""

    def append(self, record: dict) -> None:
        line = json.dumps(record)
        append_line(self.path, line, "metrics")
        self._hash.update(line.encode() + b"\n")  # what append_line wrote
        self.records += 1


def covered(path: Path, mark: MetricsMark) -> tuple[bytes | None, str]:
    """The bytes of the metrics log at `path` that `mark` covers, or None and why not."""
    if mark.stored is not None:
        return b"".join((json.dumps(r) + "\n").encode() for r in mark.stored), ""
    if not path.exists():
        return (b"", "") if mark.records == 0 else (None, "it is missing")
    try:
        data = path.read_bytes()
    except OSError as err:
        return None, reason(err)
    end, newline = 0, b"\n"
    for _ in range(mark.records):
        end = data.find(newline, end) + 1
        if end == 0:
            return None, f"it has only {data.count(newline)} complete lines"
    if hashlib.sha256(data[:end]).hexdigest() != mark.sha256:
        return None, f"its first {mark.records} lines are not those the checkpoint saw (SHA-256 differs)"
    return data[:end], ""


def not_held(path: Path, records: int, why: str) -> str:
    return f"{path} does not hold the {records} records its checkpoint counts ({why})"


def records_of(data: bytes) -> list[dict]:
    """The JSON records of a metrics log's bytes, up to a line cut short by a kill."""
    records = []
    for line in data.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def append_scalars(path: Path, step: int, coeffs) -> None:
    """Log step `step`'s scalars (JSON floats round-trip float64 exactly)."""
    append_line(path, json.dumps({"step": step, "coeffs": [float(c) for c in coeffs]}), "scalars")


def read_scalars(path: Path, start: int = 0) -> dict[int, list[float]]:
    """{step: the step's scalars} for the logged steps >= start (a line cut short by a kill ends the log)."""
    out = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            record = json.loads(line)
        except ValueError:
            break
        if record["step"] >= start:
            out[record["step"]] = record["coeffs"]
    return out


def cut_scalars(path: Path, step: int) -> None:
    """Drop the logged scalars of steps >= step (those past the checkpoint a run resumes from)."""
    kept = {s: c for s, c in read_scalars(path).items() if s < step}
    atomic_write(path, "".join(json.dumps({"step": s, "coeffs": c}) + "\n" for s, c in sorted(kept.items())),
                 "scalars")
