"""Stop signals: the first Ctrl-C or SIGTERM asks training to stop at the end of its step (with
a checkpoint); a second one aborts."""

from __future__ import annotations

import signal

import click


class StopRequest:
    """First Ctrl-C (SIGINT) or SIGTERM (SLURM preemption, `docker stop`, systemd): finish the
    step, checkpoint, exit 128 + the signal's number. A second signal aborts at once (with that
    code too). The handlers stay for the life of the command's process; calling the object says
    whether a stop was asked for."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handler)

    def __call__(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame):
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        click.echo(f"\n{what}: stopping after this step (a second signal aborts without saving)", err=True)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A second stop signal: abort now (ZosomaGroup exits with 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def abort(signum, frame):
    """SIGTERM outside training: as Ctrl-C (cleanups run)."""
    raise Interrupted(signum)
