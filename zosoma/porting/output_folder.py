"""A folder of zosoma's outputs (a porting kit, a SOMA run's ONNX export) that may hold the user's files too.

The folder's manifest.json lists under "files" every file zosoma wrote there, itself included; that
list is how zosoma knows what is its own. `output_folder` builds the new files in a temporary folder
and then moves them in:

- a new folder: the temporary folder is renamed onto it, so it appears whole or not at all;
- an existing folder (only with force): the old manifest's files are moved aside, manifest.json
  first, and the new ones moved in, manifest.json last, so whoever finds a manifest finds all of
  its files; every other file and folder in it is the user's and is left alone. A user's file that
  has one of the new files' names stops the write before anything is built.

On any failure (a full disk, a read-only folder, Ctrl-C) nothing temporary is left, the old files
are put back and the user's are untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from zosoma.atomic import fsync_dir, reason
from zosoma.errors import ConfigError, WriteError

MANIFEST = "manifest.json"


def owned(folder: Path, fmt: str) -> set[str]:
    """The files zosoma wrote in `folder`: those its manifest (of format `fmt`) lists that are still
    plain files. Only plain names count, so a damaged or edited manifest cannot point outside."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"] if manifest.get("format") == fmt else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    if not isinstance(files, list):
        return set()
    return {n for n in files if isinstance(n, str) and n == Path(n).name and not n.startswith(".")
            and (folder / n).is_file() and not (folder / n).is_symlink()}


@contextlib.contextmanager
def output_folder(out, files: Iterable[str], fmt: str, force: bool, what: str) -> Iterator[Path]:
    """Yield an empty folder to write `files` (manifest.json among them, listing them) into; when the
    block succeeds they replace zosoma's files in `out`. Refused before the block runs (ConfigError)
    if `out` exists without force, is not a folder, or holds a user's file of one of those names."""
    out, files = Path(out), set(files)
    ours: set[str] = set()
    exists = out.exists() or out.is_symlink()
    if exists:
        if not force:
            raise ConfigError(f"{out} exists; pass --force to replace the files zosoma wrote there")
        if not out.is_dir():
            raise ConfigError(f"{out} is not a folder; nothing was changed")
        ours = owned(out, fmt)
        theirs = sorted(n for n in files - ours if (out / n).exists() or (out / n).is_symlink())
        if theirs:
            raise ConfigError(f"{out / theirs[0]} was not written by zosoma; nothing was changed "
                              "(move it away, or choose another folder)")
    # Inside an existing folder, every rename stays on its filesystem (even if it is a mount point).
    tmp = (out if exists else out.parent) / f".{out.name}.tmp-{os.getpid()}"
    try:
        try:
            tmp.mkdir(parents=True)
            yield tmp
        except (OSError, WriteError) as err:
            raise _write_error(what, out, err) from err
        try:
            if exists:
                _move_in(tmp, out, ours, files)
            else:
                os.rename(tmp, out)
                fsync_dir(out.parent)
        except OSError as err:
            raise _write_error(what, out, err) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_error(what: str, out: Path, err: Exception) -> WriteError:
    """One line naming the folder, not the temporary file that could not be written."""
    cause = err.__cause__ if isinstance(err, WriteError) else err
    return WriteError(f"cannot write {what} {out}: {reason(cause) if isinstance(cause, OSError) else err}")


def _move_in(tmp: Path, out: Path, old: set[str], new: set[str]) -> None:
    """Replace `old` files of `out` with `new` ones from `tmp`; on any failure, put the old ones back."""
    aside = out / f".{out.name}.old-{os.getpid()}"
    aside.mkdir()
    moved_out, moved_in = [], []
    try:
        for n in sorted(old, key=lambda n: n != MANIFEST):  # the manifest first
            os.rename(out / n, aside / n)
            moved_out.append(n)
        for n in sorted(new, key=lambda n: n == MANIFEST):  # the manifest last
            os.rename(tmp / n, out / n)
            moved_in.append(n)
    except BaseException:
        try:
            for n in moved_in:
                os.rename(out / n, tmp / n)
            for n in reversed(moved_out):
                os.rename(aside / n, out / n)
        except OSError as err:
            raise WriteError(f"cannot put back the files zosoma wrote in {out}: {reason(err)}; "
                             f"they are in {aside}") from err
        aside.rmdir()
        raise
    fsync_dir(out)
    shutil.rmtree(aside, ignore_errors=True)
