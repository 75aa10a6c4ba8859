"""A watchdog that ends a process's descendants once that process is gone, even by SIGKILL.

    start()                       runs `python -m zosoma.workers.reaper PID` for this process
                                  (Linux only: it reads /proc; elsewhere it does nothing)
    watch(parent)                 in the reaper: every PERIOD_S seconds, note every process below
                                  `parent`; once the reaper is no longer its child (the parent
                                  died), SIGKILL those still running, and return

Why (zosoma.workers.ray_executor starts one with Ray): Ray's kernel fate sharing kills the GCS and
the raylet with the driver that started them, but not the raylet's own children. Its two agents
then spend 60 s reporting the raylet's death to the dead GCS (ray._private.utils.
publish_error_to_driver) before they exit, and its workers take seconds to notice.
A process is known by its pid and start time, so a pid reused since is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PERIOD_S = 0.5


def start() -> subprocess.Popen | None:
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        return None
    return subprocess.Popen([sys.executable, "-m", "zosoma.workers.reaper", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def watch(parent: int) -> None:
    seen: dict[int, int] = {}  # pid -> start time
    while os.getppid() == parent:
        seen = {pid: t for pid, t in seen.items() if start_time(pid) == t}  # forget the dead
        seen.update(descendants(parent))
        time.sleep(PERIOD_S)
    for pid, t in seen.items():
        if start_time(pid) == t:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass


def descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every process below `pid`, this reaper left out."""
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            t = start_time(child)
            if child != os.getpid() and t is not None:
                found[child] = t
                todo.append(child)
    return found


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (Ray starts its processes from several threads)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return children


def start_time(pid: int) -> int | None:
    """Clock ticks after boot at which `pid` started (field 22 of /proc/PID/stat); None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # after "pid (comm)", from field 3
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; the reaper ends after it
    watch(int(sys.argv[1]))
