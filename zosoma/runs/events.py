"""TensorBoard event files in every run folder: what researchers watch a run with.

Written with tensorboardX (NumPy and protobuf; W&B and MLflow import the files) beside
metrics.jsonl, which stays the record of a run: `tensorboard --logdir runs/` lists every run
folder, and a SOMA run as its experts (RUN/expert{i}) plus the routed ensemble (RUN). Tags:

    train/loss, train/lr, train/tokens_per_s, train/spread      every step (spread: rms of the P
    train/normalize_scale, train/clip_count                      scalars before shaping)
    time/data_s, time/noise_s, time/forward_s, time/update_s     the step's time split
    guard/smoothed, guard/best, guard/above                      the divergence guard's state
    eval/heldout, eval/wikitext103                               each evaluation (the curve of a
                                                                 comparison, the final one)

A resumed run, or one rolled back by a restart, marks the step it continues from so TensorBoard
drops the events after it that the checkpoint does not cover (tensorboardX's purge_step).
"""

from __future__ import annotations

from pathlib import Path

STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "spread": "train/spread",
             "normalize_scale": "train/normalize_scale", "clip_count": "train/clip_count",
             "data_s": "time/data_s", "noise_s": "time/noise_s", "forward_s": "time/forward_s",
             "update_s": "time/update_s", "exchange_s": "time/exchange_s"}


class EventLog:
    """The event file of one run folder, opened at the first write; `since` is the step a resumed
    run continues from (events past it in older files are purged)."""

    def __init__(self, path, since: int = 0):
        self.path, self.since, self._writer = Path(path), since, None

    def _open(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(str(self.path), purge_step=self.since + 1 if self.since else None,
                                         flush_secs=10, max_queue=1000)
            self.since = 0  # purged once: a later file of this session continues it
        return self._writer

    def step(self, record: dict, guard=None) -> None:
        """One step's metrics.jsonl record (and the guard after it) as scalars at record["step"]."""
        w, step = self._open(), record["step"]
        for key, tag in STEP_TAGS.items():
            value = record.get(key)
            if value is not None:
                w.add_scalar(tag, float(value), step)
        if guard is not None and guard.smoothed is not None:
            w.add_scalar("guard/smoothed", guard.smoothed, step)
            w.add_scalar("guard/best", guard.best, step)
            w.add_scalar("guard/above", guard.above, step)

    def evaluation(self, step: int, heldout: float | None, wikitext: float | None = None,
                   tag: str = "eval/heldout") -> None:
        w = self._open()
        for name, value in ((tag, heldout), ("eval/wikitext103", wikitext)):
            if value is not None:
                w.add_scalar(name, float(value), step)
        w.flush()  # few and precious: on disk now

    def rolled_back(self, step: int) -> None:
        """A restart took the run back to `step`: events after it belong to the abandoned course."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        self._open().file_writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """The run's settings and final figures, for TensorBoard's HParams view (a comparison)."""
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        self._open().add_hparams(clean, {k: float(v) for k, v in metrics.items() if v is not None}, name=".")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
