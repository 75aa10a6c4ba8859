"""One owner per run folder: an flock(2) lock on a file in it, which the kernel releases when the
process dies, the file naming the owner's pid and host. A second writer is refused in one line
(RunInUse), and a lock left by a dead process is simply taken over. Which file it is, and what a
folder does around it, is the run folder's (zosoma.training.folder).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from zosoma.atomic import reason
from zosoma.errors import ConfigError, WriteError


class RunInUse(ConfigError):
    """Another live process owns the run folder."""


def in_use(folder: Path, owner: str) -> RunInUse:
    return RunInUse(f"{folder} is in use by {owner}: a run folder has one writer; wait for it to finish or stop "
                    "it first")


def owner(path: Path) -> str | None:
    """'pid N on HOST' of the live process that holds the lock file `path`, or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return _holder(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(path: Path, folder: Path, wait: bool = False, failed=None):
    """Hold the lock file `path` of the run folder `folder` for the block, naming this pid and host
    in it. Another owner: RunInUse, or with `wait`, block until it is gone. When the block (or
    taking the lock) raises, `failed()` is called while the lock is still held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise WriteError(f"cannot lock run folder {folder}: {reason(err)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WriteError(f"cannot lock run folder {folder}: {reason(err)}") from None
            raise in_use(folder, _holder(fd)) from None
        with contextlib.suppress(OSError):  # who holds it: for the message above, best effort
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    except (Exception, KeyboardInterrupt):  # a start that failed (not a block merely abandoned)
        if failed is not None:
            failed()
        raise
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """'pid N on HOST' from a held lock file. Its owner writes that just after taking the lock, so
    an empty file is waited on for up to a tenth of a second before the owner goes unnamed."""
    for _ in range(10):
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "another process"
