"""Stop signals: the first Ctrl-C or SIGTERM asks training to stop at the end of its step (with
a checkpoint); a second one ends the command at once."""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """First Ctrl-C (SIGINT) or SIGTERM (SLURM preemption, `docker stop`, systemd): finish the
    step, checkpoint, exit 128 + the signal's number. A second signal ends the command at once
    with that code, whatever it is doing (a step of minutes included), and one line saying how to
    go on (`resume`): every checkpoint is complete at every instant (zosoma.training.folder), so the
    newest one is kept. After `at_once` (the final evaluation: training is over and saved) the
    first signal does so too. The handlers stay for the life of the command's process; calling
    the object says whether a stop was asked for.

    Signals are seen twice: by the Python handler, which runs in the main thread between two
    bytecodes (not while that thread is inside one long compiled call), and at once by a thread
    reading the interpreter's wakeup file descriptor (_watch). Each counts the signals it sees,
    and the larger count is acted on once."""

    def __init__(self, resume: str = ""):
        self.signum = None
        self.resume = resume  # how to go on after stopping at once (set when the run is known)
        self._final = None  # the line a stop ends the command with at once (at_once)
        self._seen = {"handler": 0, "watcher": 0}
        self._acted = 0
        self._lock = threading.RLock()  # re-entrant: a handler may run while the main thread holds it
        for s in STOP_SIGNALS:
            signal.signal(s, self._handler)
        _watch(self)

    def __call__(self) -> bool:
        return self.signum is not None

    def at_once(self, line: str) -> None:
        """From now on a stop signal ends the command at once, with `line` (and at once if one came already)."""
        self._final = line
        if self.signum is not None:
            self._end(self.signum)

    def _handler(self, signum, frame):
        self._signal(signum, "handler")

    def _signal(self, signum: int, seen_by: str) -> None:
        with self._lock:
            self._seen[seen_by] += 1
            count = max(self._seen.values())
            if count <= self._acted:
                return  # the other one saw this signal first
            self._acted = count
        if count > 1 or self._final is not None:
            self._end(signum)
        self.signum = signum
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        click.echo(f"\n{what}: stopping after this step (a second signal stops at once, keeping the newest "
                   "checkpoint)", err=True)

    def _end(self, signum: int) -> None:
        line = self._final or ("stopped at once; the newest checkpoint is kept"
                               + (f". Continue with: {self.resume}" if self.resume else ""))
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.write(2, f"\n{line}\n".encode(errors="backslashreplace"))
        os._exit(128 + (self.signum or signum))  # now: threads still in a long step are not waited for

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


_current: StopRequest | None = None  # the request the watcher reports to
_wakeup: int | None = None  # the write end of its pipe


def _watch(request: StopRequest) -> None:
    """Report every stop signal to `request` as it arrives, from a thread of its own that reads
    the wakeup file descriptor (signal.set_wakeup_fd: the C-level handler writes each signal's
    number there at once). One thread and pipe per process; in a thread other than the main one
    (where no handler can be set either) the handler alone sees the signals."""
    global _current, _wakeup
    if threading.current_thread() is not threading.main_thread():
        return
    _current = request
    if _wakeup is None:
        read, _wakeup = os.pipe()
        os.set_blocking(_wakeup, False)
        threading.Thread(target=_read_signals, args=(read,), daemon=True, name="zosoma-stop").start()
    signal.set_wakeup_fd(_wakeup, warn_on_full_buffer=False)


def _read_signals(fd: int) -> None:
    while True:
        for signum in os.read(fd, 64):
            request = _current
            # only while its handler is the one set (not another's, not one holding signals back)
            if signum in STOP_SIGNALS and request is not None and signal.getsignal(signum) == request._handler:
                request._signal(signum, "watcher")


class Interrupted(KeyboardInterrupt):
    """A stop signal outside training: abort now (ZosomaGroup exits with 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def abort(signum, frame):
    """SIGTERM outside training: as Ctrl-C (cleanups run)."""
    raise Interrupted(signum)
