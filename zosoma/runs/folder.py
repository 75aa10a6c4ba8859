"""The run folder: the one module that knows the files inside a run.

A single model's run (or one SOMA expert's folder):

    RUN/checkpoint.h5        the newest checkpoint (written as checkpoint.next.h5, then rotated)
    RUN/checkpoint.prev.h5   the one before it
    RUN/metrics.jsonl        one JSON record per training step, cut back to the checkpoint on resume
    RUN/results.json         the final evaluation

A SOMA run:

    RUN/soma.json            what the run is: N, loss mode, chunking, data (written once, last)
    RUN/router.h5            the clustering the router needs
    RUN/expert{i}/           one single-model folder per expert
    RUN/results.json         the routed evaluation

A comparison (zosoma.experiments.compare): OUT/runs/<method>-seed<s>/ is a single or SOMA run
folder plus curve.jsonl (the held-out curve) and result.json (the finished run's record).

Every write is atomic (zosoma.atomic): at every instant each file is complete, and at least one
of checkpoint.h5, checkpoint.next.h5, checkpoint.prev.h5 holds a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zosoma.atomic import append_line, atomic_write
from zosoma.errors import CheckpointError, ConfigError
from zosoma.formats.checkpoint import Checkpoint, load_checkpoint, read_step, save_checkpoint

CHECKPOINT = "checkpoint.h5"
PREVIOUS = "checkpoint.prev.h5"
NEXT = "checkpoint.next.h5"
CHECKPOINTS = (CHECKPOINT, NEXT, PREVIOUS)  # newest first
METRICS = "metrics.jsonl"
RESULTS = "results.json"
SOMA = "soma.json"
ROUTER = "router.h5"
CURVE = "curve.jsonl"
RESULT = "result.json"


class RunFolder:
    """One run's folder (a single model, a SOMA expert, or a SOMA run)."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    # --- what the folder holds --------------------------------------------------------------

    @property
    def is_soma(self) -> bool:
        return (self.path / SOMA).exists()

    @property
    def has_checkpoint(self) -> bool:
        return any((self.path / name).is_file() for name in CHECKPOINTS)

    @property
    def holds_run(self) -> bool:
        return self.is_soma or self.has_checkpoint

    def expert(self, i: int) -> "RunFolder":
        return RunFolder(self.path / f"expert{i}")

    @property
    def router(self) -> Path:
        return self.path / ROUTER

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    # --- checkpoints ------------------------------------------------------------------------

    def write_checkpoint(self, ckpt: Checkpoint) -> None:
        """Atomically make `ckpt` the newest checkpoint, keeping the one it replaces as
        checkpoint.prev.h5."""
        save_checkpoint(self.path / NEXT, ckpt)
        if (self.path / CHECKPOINT).exists():
            os.replace(self.path / CHECKPOINT, self.path / PREVIOUS)
        os.replace(self.path / NEXT, self.path / CHECKPOINT)

    def read_checkpoint(self, step: int | None = None) -> Checkpoint:
        """The newest complete checkpoint, or the one at `step`. A damaged file is passed over only
        when another one can take its place; otherwise its error is raised."""
        found, errors = [], []
        for name in CHECKPOINTS:
            if (self.path / name).exists():
                try:
                    found.append(load_checkpoint(self.path / name))
                except CheckpointError as e:
                    errors.append(e)
        if step is not None:
            found = [c for c in found if c.step == step]
        if not found:
            if errors:
                raise errors[0]
            where = f"at step {step} " if step is not None else ""
            raise CheckpointError(f"{self.path}: no {CHECKPOINT} {where}to resume from")
        return max(found, key=lambda c: c.step)

    def checkpoint_step(self) -> int:
        """The step of the newest checkpoint, read from its header only (no tensors)."""
        steps = []
        for name in CHECKPOINTS:
            if (self.path / name).is_file():
                try:
                    steps.append(read_step(self.path / name))
                except CheckpointError:
                    pass
        if not steps:
            return self.read_checkpoint().step  # raises the reason
        return max(steps)

    # --- logs and results -------------------------------------------------------------------

    def rewrite_metrics(self, records: list[dict]) -> None:
        atomic_write(self.path / METRICS, "".join(json.dumps(r) + "\n" for r in records), "metrics")

    def append_metrics(self, record: dict) -> None:
        append_line(self.path / METRICS, json.dumps(record), "metrics")

    def write_results(self, results: dict) -> None:
        write_json(self.path / RESULTS, results, "results")

    # --- SOMA ---------------------------------------------------------------------------------

    def read_soma(self) -> dict:
        try:
            return json.loads((self.path / SOMA).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.path}: not a SOMA run folder ({SOMA} unreadable: {e})") from None

    def write_soma(self, soma: dict) -> None:
        write_json(self.path / SOMA, soma, "run description")

    # --- comparison runs ----------------------------------------------------------------------

    def read_result(self) -> dict | None:
        """A finished comparison run's record, or None."""
        path = self.path / RESULT
        return json.loads(path.read_text()) if path.exists() else None

    def write_result(self, result: dict) -> None:
        write_json(self.path / RESULT, result, "result")

    def read_curve(self) -> list[dict]:
        path = self.path / CURVE
        if not path.exists():
            return []
        points = []
        for line in path.read_text().splitlines():
            try:
                points.append(json.loads(line))
            except ValueError:
                break  # a line cut short by a kill: drop it and what follows
        return points

    def append_curve(self, point: dict) -> None:
        append_line(self.path / CURVE, json.dumps(point), "curve")


def checkpoint_path(path) -> Path:
    """A checkpoint file named by itself, or by its run folder (the folder's checkpoint.h5)."""
    path = Path(path)
    return path / CHECKPOINT if path.is_dir() else path


def write_json(path: Path, obj, what: str = "file") -> None:
    """Atomically write obj as indented JSON."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True), what)
