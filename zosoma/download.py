"""WikiText-103 (Merity et al., 2016, "Pointer Sentinel Mixture Models"): fetch and locate the
raw test and validation text that byte-level language models are evaluated on.

The official archive is about 180 MB; only the members we need are extracted, each checked against
its published size and sha256 before it is moved into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zipfile
import zlib
from http.client import HTTPException
from pathlib import Path
from typing import Callable, Optional

from zosoma.corpus import utf8_path
from zosoma.errors import DataError

WIKITEXT103_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip"
# name -> (bytes, sha256). WikiText-2 shares these two splits, so its raw archive works as well.
WIKITEXT103_FILES = {
    "wiki.test.raw":
        (1_290_590, "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"),
    "wiki.valid.raw":
        (1_146_846, "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"),
}
TRAIN_FILE = "wiki.train.raw"
ENV_VAR = "ZOSOMA_WIKITEXT103"
_BLOCK = 1 << 20

Progress = Callable[[int, Optional[int]], None]


def cache_root() -> Path:
    """zosoma's cache folder: $XDG_CACHE_HOME/zosoma (~/.cache if unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zosoma"


def wikitext103_cache_dir() -> Path:
    """Where downloads go by default: cache_root()/wikitext-103."""
    return cache_root() / "wikitext-103"


def download_wikitext103(
    dest_dir: str | Path | None = None,
    url: str = WIKITEXT103_URL,
    progress: Progress | None = None,
    train: bool = False,
) -> dict[str, Path]:
    """Download the raw archive and extract wiki.test.raw and wiki.valid.raw into `dest_dir`.

    dest_dir: defaults to wikitext103_cache_dir(). url: http(s), file:// or a local path.
    progress(done_bytes, total_bytes or None) is called as the archive streams in.
    train=True also extracts wiki.train.raw (about 540 MB); it has no published checksum here, so it
    is checked only for being non-empty.
    Files already present with the right sha256 are kept and the download is skipped when nothing is
    missing. Returns {name: path}. Any failure raises DataError and leaves no temporary file and no
    new file behind: members are verified before any is moved into place.
    """
    dest = Path(dest_dir) if dest_dir is not None else wikitext103_cache_dir()
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{dest}: cannot create directory ({e.strerror or e})") from e
    names = list(WIKITEXT103_FILES) + ([TRAIN_FILE] if train else [])
    result = {name: dest / name for name in names}
    missing = [name for name in names if not _is_good(dest / name)]
    if not missing:
        return result

    temps: list[Path] = []
    try:
        archive = _temp_path(dest, ".zip.part", temps)
        _fetch(url, archive, progress)
        staged = [_extract(archive, url, n, _temp_path(dest, ".part", temps)) for n in missing]
        for name, tmp in zip(missing, staged):
            os.replace(tmp, dest / name)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    return result


def find_wikitext103(explicit: str | Path | None = None) -> Path | None:
    """Path of wiki.test.raw for evaluation, or None when none is found.

    Looks at, in order: `explicit` (the file itself or its directory), $ZOSOMA_WIKITEXT103 and
    wikitext103_cache_dir(). An explicit path or environment variable that holds no such file
    raises DataError rather than being silently passed over.
    """
    for given, origin in ((explicit, "given path"), (os.environ.get(ENV_VAR), f"${ENV_VAR}")):
        if given:
            path = utf8_path(Path(given).expanduser())  # recorded with the run, as text
            found = path if path.is_file() else path / "wiki.test.raw"
            if not found.is_file():
                raise DataError(f"{path}: no wiki.test.raw here ({origin})")
            return found
    found = wikitext103_cache_dir() / "wiki.test.raw"
    return found if found.is_file() else None


class NotOfficial(UserWarning):
    """A WikiText-103 file given by path is not the official wiki.test.raw (one line: which)."""


def check_wikitext103(explicit: str | Path | None = None) -> Path | None:
    """find_wikitext103's file, absolute, checked before anything trains on its behalf: an empty
    or binary file is a DataError; text that is not the official wiki.test.raw (its published
    size and sha256) is scored, with a NotOfficial warning that its figure is not WikiText-103's."""
    path = find_wikitext103(explicit)
    if path is None:
        return None
    path = path.resolve()
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if size == 0:
        raise DataError(f"{path} is empty, not WikiText-103's wiki.test.raw (zosoma data download wikitext-103)")
    if (size, _sha256_file(path)) != WIKITEXT103_FILES["wiki.test.raw"]:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 4:  # not a character cut at the end of the sample
                raise DataError(f"{path} is not text, so not WikiText-103's wiki.test.raw") from None
        if b"\0" in head:
            raise DataError(f"{path} is not text, so not WikiText-103's wiki.test.raw") from None
        warnings.warn(f"{path} is not the official wiki.test.raw ({size:,} bytes, not "
                      f"{WIKITEXT103_FILES['wiki.test.raw'][0]:,}, or another sha256): its score is labelled "
                      "WikiText-103 but is not comparable with published figures", NotOfficial, stacklevel=2)
    return path


def _is_good(path: Path) -> bool:
    """A finished file: the published size and sha256 (files without a checksum: non-empty)."""
    if not path.is_file():
        return False
    if path.name not in WIKITEXT103_FILES:
        return path.stat().st_size > 0
    size, sha = WIKITEXT103_FILES[path.name]
    return path.stat().st_size == size and _sha256_file(path) == sha


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _temp_path(dest: Path, suffix: str, temps: list[Path]) -> Path:
    """A new hidden file in dest (same filesystem, so os.replace is atomic), noted for cleanup."""
    fd, name = tempfile.mkstemp(prefix=".wikitext-103-", suffix=suffix, dir=dest)
    os.close(fd)
    temps.append(Path(name))
    return Path(name)


def _fetch(url: str, out: Path, progress: Progress | None) -> None:
    """Stream `url` (or a local path) into `out`."""
    if not urllib.parse.urlsplit(url).scheme or os.path.exists(url):  # a local path
        path = Path(url).expanduser()
        if not path.is_file():
            raise DataError(f"{url}: no such file")
        url = path.resolve().as_uri()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(out, "wb") as f:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            while block := response.read(_BLOCK):
                f.write(block)
                done += len(block)
                if progress is not None:
                    progress(done, total)
    except urllib.error.HTTPError as e:
        raise DataError(f"cannot download {url}: HTTP {e.code} {e.reason}") from e
    except urllib.error.URLError as e:
        raise DataError(f"cannot download {url}: {e.reason}") from e
    except (OSError, HTTPException, ValueError) as e:  # ValueError: a URL urllib cannot parse
        raise DataError(f"cannot download {url}: {e}") from e


def _extract(archive: Path, url: str, name: str, out: Path) -> Path:
    """Copy member `name` (in any folder, e.g. wikitext-103-raw/) to `out` and verify it."""
    try:
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.namelist() if m.rsplit("/", 1)[-1] == name]
            if len(members) != 1:
                found = "no" if not members else f"{len(members)} members named"
                raise DataError(f"{url}: archive has {found} {name}")
            with z.open(members[0]) as src, open(out, "wb") as f:
                shutil.copyfileobj(src, f, _BLOCK)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # BadZipFile also covers a bad CRC
        raise DataError(f"{url}: not a valid zip archive ({e})") from e
    except OSError as e:
        raise DataError(f"{url}: cannot extract {name} ({e.strerror or e})") from e
    if name in WIKITEXT103_FILES:
        size, sha = WIKITEXT103_FILES[name]
        got_size, got_sha = out.stat().st_size, _sha256_file(out)
        if (got_size, got_sha) != (size, sha):
            raise DataError(
                f"{url}: {name} has {got_size} bytes, sha256 {got_sha}; "
                f"expected {size} bytes, sha256 {sha}"
            )
    elif out.stat().st_size == 0:
        raise DataError(f"{url}: {name} is empty")
    return out
