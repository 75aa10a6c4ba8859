"""TensorBoard event files in every run folder: what researchers watch a run with.

Event files in TensorBoard's format (TFRecord framing of Event protobufs, built with
tensorboardX's protobufs and checksummed by zosoma.training.crc32c; W&B and MLflow import them)
beside metrics.jsonl, which stays the record of a run: `tensorboard --logdir runs/` lists every
run folder, and a SOMA run as its experts (RUN/expert{i}) plus the routed ensemble (RUN). Tags:

    train/loss, train/lr, train/tokens_per_s, train/spread      every step (spread: rms of the P
    train/normalize_scale, train/clip_count                      scalars before shaping)
    time/data_s, time/noise_s, time/forward_s, time/update_s     the step's time split
    guard/smoothed, guard/best, guard/above                      the divergence guard's state
    eval/heldout, eval/wikitext103                               each evaluation (the final one;
    eval/heldout_curve, hparams/*                                a comparison's curve and HParams)

Records are buffered and appended whole at every checkpoint (and every 64 KiB or 10 s): no
thread, nothing at exit. So a run killed between checkpoints may leave events past its newest one:
a resumed run, or one rolled back by a restart, cuts the folder's event files back to the step it
continues from before it writes (as metrics.jsonl is cut), and an evaluation replaces an earlier
one at its step, so every reader (TensorBoard, W&B's import, a plain loop over the records) finds
each step once, in order. The events are a view: a write that fails (a full disk), or a
checkout run without tensorboardX, is said in one warning and the run goes on without them.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

from zosoma.atomic import atomic_write, reason
from zosoma.errors import WriteError
from zosoma.training.crc32c import masked_crc32c
from zosoma.training.folder import EVENTS

STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "spread": "train/spread",
             "normalize_scale": "train/normalize_scale", "clip_count": "train/clip_count",
             "data_s": "time/data_s", "noise_s": "time/noise_s", "forward_s": "time/forward_s",
             "update_s": "time/update_s", "exchange_s": "time/exchange_s"}
FLUSH_BYTES, FLUSH_S = 1 << 16, 10.0  # buffered events are appended past either
_told_missing: list = []  # the ImportError of a missing tensorboardX, once said


class EventsUnavailable(UserWarning):
    """A run's TensorBoard events could not be written; training goes on (one line: why)."""


class EventLog:
    """The event file this process writes in one run folder, made at the first write; `since`, given,
    is the step the run trains on from (0 for a new one): events past it, which its checkpoint does
    not cover, are cut from the folder's files before the first write."""

    def __init__(self, path, since: int | None = None):
        self.path, self.since = Path(path), since
        self._file: Path | None = None
        self._buffer: list[bytes] = []
        self._size, self._failed, self._flushed = 0, False, time.monotonic()

    def step(self, record: dict, guard=None) -> None:
        """One step's metrics.jsonl record (and the guard after it) as scalars at record["step"]."""
        values = {tag: record[key] for key, tag in STEP_TAGS.items() if record.get(key) is not None}
        if guard is not None and guard.smoothed is not None:
            values.update({"guard/smoothed": guard.smoothed, "guard/best": guard.best, "guard/above": guard.above})
        self._scalars(record["step"], values)

    def evaluation(self, step: int, heldout: float | None, wikitext: float | None = None,
                   tag: str = "eval/heldout") -> None:
        values = {k: v for k, v in ((tag, heldout), ("eval/wikitext103", wikitext)) if v is not None}
        self.flush()
        self._cut(lambda event: event.step == step and any(v.tag in values for v in event.summary.value))
        self._scalars(step, values)  # replacing an evaluation at this step (a finished run resumed)
        self.flush()  # few and precious: on disk now

    def rolled_back(self, step: int) -> None:
        """A restart took the run back to `step`: events after it belong to the abandoned course."""
        self.flush()
        self._cut(lambda event: event.step > step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """The run's settings and final figures, for TensorBoard's HParams view (a comparison)."""
        if not self._writable():
            return
        from tensorboardX.summary import hparams as hparams_summaries
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        for summary in hparams_summaries(clean, metrics):
            self._event(summary=summary)
        self._scalars(0, metrics)
        self.flush()

    def flush(self) -> None:
        """Append what is buffered to the file, whole."""
        if not self._buffer or self._failed:
            return
        data = b"".join(self._buffer)
        self._buffer, self._size, self._flushed = [], 0, time.monotonic()
        if self._file is None and self.since is not None:
            since, self.since = self.since, None
            self._cut(lambda event: event.step > since)
            if self._failed:
                return
        try:
            if self._file is None:
                stamp = f"{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
                self._file = self.path / EVENTS.format(stamp=stamp)
                data = _record(_proto().Event(wall_time=time.time(), file_version="brain.Event:2")) + data
            with open(self._file, "ab") as f:
                f.write(data)
        except OSError as err:
            self._failed = True
            warnings.warn(f"TensorBoard events of {self.path} are no longer written ({reason(err)}); metrics.jsonl "
                          "still is", EventsUnavailable, stacklevel=2)

    close = flush

    def _cut(self, drop) -> None:
        """Rewrite the folder's event files without the events `drop(event)` names (and without a
        record a kill left half-written)."""
        if not self._writable():
            return
        try:
            for path in sorted(self.path.glob(EVENTS.format(stamp="*"))):
                data = path.read_bytes()
                kept = [record for record, event in _records(data) if not drop(event)]
                if sum(map(len, kept)) != len(data):
                    atomic_write(path, b"".join(kept), "TensorBoard events")
        except (OSError, WriteError) as err:
            self._failed = True
            why = reason(err) if isinstance(err, OSError) else str(err)
            warnings.warn(f"TensorBoard events of {self.path} are no longer written ({why}); metrics.jsonl "
                          "still is", EventsUnavailable, stacklevel=3)

    def _scalars(self, step: int, values: dict) -> None:
        if values and self._writable():
            p = _proto()
            self._event(step=step, summary=p.Summary(value=[p.Summary.Value(tag=t, simple_value=float(v))
                                                            for t, v in values.items()]))

    def _writable(self) -> bool:
        """False once writing failed, or when tensorboardX is missing (said once)."""
        if not self._failed:
            try:
                _proto()
            except ImportError as err:
                self._failed = True
                if not _told_missing:  # once per process, not once per run folder
                    _told_missing.append(err)
                    warnings.warn(f"TensorBoard events are not written ({err}); metrics.jsonl still is",
                                  EventsUnavailable, stacklevel=3)
        return not self._failed

    def _event(self, **fields) -> None:
        if not self._writable():
            return
        record = _record(_proto().Event(wall_time=time.time(), **fields))
        self._buffer.append(record)
        self._size += len(record)
        if self._size >= FLUSH_BYTES or time.monotonic() - self._flushed > FLUSH_S:
            self.flush()


@functools.cache
def _proto():
    """tensorboardX's Event and Summary protobufs (loaded when first needed)."""
    from tensorboardX.proto import event_pb2, summary_pb2
    return SimpleNamespace(Event=event_pb2.Event, Summary=summary_pb2.Summary)


def _record(event) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the serialised event, its masked CRC-32C."""
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def _records(data: bytes) -> list[tuple[bytes, object]]:
    """(the TFRecord, framing included, its Event) for each whole record of an event file's bytes;
    reading stops at a record cut short (a write a kill interrupted) or not an Event."""
    from google.protobuf.message import DecodeError
    out, at = [], 0
    while at + 12 <= len(data):
        end = at + 12 + struct.unpack_from("<Q", data, at)[0] + 4
        if end > len(data):
            break
        try:
            out.append((data[at:end], _proto().Event.FromString(data[at + 12:end - 4])))
        except DecodeError:
            break
        at = end
    return out
