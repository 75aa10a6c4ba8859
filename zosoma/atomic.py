"""Durable writes: every file zosoma writes goes through here.

`atomic_path(path)` yields a temporary name in the target's folder; when the block ends without an
error the temporary is fsynced and renamed onto the target (and the folder fsynced), so a reader
sees the old file or the new one, never a half-written one. On any error the temporary is removed,
the target is left untouched, and an OSError (full disk, read-only folder, no permission) becomes
one WriteError line naming the path. `atomic_write` writes bytes or text that way;
`append_line` appends one whole line or nothing; `set_aside` renames a damaged file out of the way;
`no_interrupts` holds Ctrl-C back over a chain of renames that must happen whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import threading
from pathlib import Path
from typing import Iterator, Union

from zosoma.errors import WriteError

PathLike = Union[str, Path]


def reason(err: OSError) -> str:
    """One line for an OSError: the system's words for its errno (e.g. 'No space left on device'),
    else its text on one line. (h5py's errors carry multi-line text; its errno is what matters.)"""
    if err.errno in errno.errorcode:
        return os.strerror(err.errno)
    match = re.search(r"errno = (\d+)", str(err))  # h5py names the errno only inside its text
    if match and int(match.group(1)) in errno.errorcode:
        return os.strerror(int(match.group(1)))
    return " ".join(str(err).split()) or type(err).__name__


@contextlib.contextmanager
def atomic_path(path: PathLike, what: str = "file") -> Iterator[Path]:
    """A temporary path to write `path`'s new content to; renamed onto `path` when the block
    succeeds. `what` names the file in the error ("checkpoint", "results", ...)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise WriteError(f"cannot write {what} {path}: {reason(err)}") from err
        raise
    fsync_dir(path.parent)


def atomic_write(path: PathLike, data: Union[bytes, memoryview, str], what: str = "file") -> None:
    """Replace `path` with `data` (str is written as UTF-8) atomically."""
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data).cast("B")
    with atomic_path(path, what) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def append_line(path: PathLike, line: str, what: str = "log") -> None:
    """Append `line` + newline to `path` in one write; if it cannot be written whole (a full
    disk), the file is cut back to its previous length, so it never ends in a partial line."""
    path = Path(path)
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise WriteError(f"cannot write {what} {path}: {reason(err)}") from err
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise WriteError(f"cannot write {what} {path}: {reason(err)}") from err
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    # A fresh descriptor is enough: fsync flushes the file's pages whoever wrote them, and h5py's
    # close (which may still write metadata) has happened by now.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename durable. Best effort: Windows cannot open a folder and some network
    filesystems refuse to fsync one; the data file itself is already on disk."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def set_aside(path: Path, to: Path) -> None:
    """Rename a damaged file out of the way (to a name no rotation writes over)."""
    try:
        os.replace(path, to)
    except OSError as err:
        raise WriteError(f"cannot set aside damaged {path}: {reason(err)}") from None


@contextlib.contextmanager
def no_interrupts():
    """Hold Ctrl-C (SIGINT) and SIGTERM back during a short critical section: they are recorded
    and handed to their handlers once it is over (called, not sent again: a watcher of the wakeup
    fd, zosoma.cli.stop, saw each signal once already). (A signal mask would not do: BLAS threads
    take the signal, and Python raises it in the main thread at once.) Main thread only, where
    handlers run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in held:
            if callable(old[s]):
                old[s](s, None)
            else:  # SIG_DFL, SIG_IGN
                signal.raise_signal(s)
