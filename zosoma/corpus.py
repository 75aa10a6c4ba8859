"""The byte corpus: documents as uint8 arrays, random training windows, fixed-size chunks.

Shape letters: B batch, T time; a training window holds T1 = T + 1 bytes (T inputs, and the T
next-byte targets shifted by one).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

import numpy as np

from zosoma.errors import ConfigError, DataError

PathLike = Union[str, Path]

SPLITS = ("train", "validation", "heldout")
# The validation slice of a domain: the last bytes of its training file (at most an eighth of it),
# just before the held-out slice, held back from the train split. Tuning reads it; training never
# does; tables report held-out.
VALIDATION_BYTES = 1 << 16
TEXT_SUFFIXES = (".txt", ".gz")  # what a user directory contributes
MANIFEST = "MANIFEST.json"
MAX_BYTES = 4 << 30  # one text file, after decompression: the corpus is held in memory


@dataclass(frozen=True)
class Corpus:
    """Documents of raw bytes, each named by its domain (shipped corpus) or file stem (user files).

    Documents are read-only uint8 1-D arrays. Names need not be unique: chunks keep their source's.
    """

    names: tuple[str, ...]
    docs: tuple[np.ndarray, ...]

    def __post_init__(self):
        if len(self.names) != len(self.docs):
            raise ValueError(f"{len(self.names)} names for {len(self.docs)} documents")

    def __len__(self) -> int:
        return len(self.docs)

    @property
    def n_bytes(self) -> int:
        return sum(len(d) for d in self.docs)

    @property
    def lengths(self) -> np.ndarray:
        """(len(self),) int64 byte count of each document."""
        return np.array([len(d) for d in self.docs], dtype=np.int64)

    def subset(self, indices: Iterable[int]) -> "Corpus":
        """The documents at `indices`, in that order (e.g. the members of one cluster)."""
        idx = [int(i) for i in indices]
        return Corpus(tuple(self.names[i] for i in idx), tuple(self.docs[i] for i in idx))


def default_corpus_dir() -> Path:
    """Directory of the shipped corpus (MANIFEST.json, train/, heldout/)."""
    try:
        return Path(str(importlib.resources.files("zosoma.data") / "corpus"))
    except ModuleNotFoundError:
        # Source checkout on PYTHONPATH: data/ is only mapped to zosoma.data at install time.
        return Path(__file__).resolve().parents[1] / "data" / "corpus"


def load_text(path: PathLike) -> np.ndarray:
    """(n,) read-only uint8 bytes of one regular file (.gz decompressed), at most MAX_BYTES. An
    empty file, a device, a FIFO or a larger file is an error (the corpus lives in memory)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a file")
    if not path.is_file():  # /dev/zero would read for ever, a FIFO would wait for a writer
        raise DataError(f"{path}: not a regular file")
    try:
        if path.stat().st_size > MAX_BYTES:
            raise DataError(f"{path}: larger than {MAX_BYTES >> 30} GiB, the most one text file may hold")
        data = _gunzip(path) if path.suffix == ".gz" else np.frombuffer(path.read_bytes(), dtype=np.uint8)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from e
    if not data.size:
        raise DataError(f"{path}: empty file")
    return data


GZIP_BLOCK = 1 << 24  # decompressed bytes read at a time


def _gunzip(path: Path) -> np.ndarray:
    """A .gz file's bytes, read read-only: first streamed to measure them (refused past MAX_BYTES
    with nothing held), then decompressed straight into an array of that size."""
    try:
        n = 0
        with gzip.open(path, "rb") as f:
            while block := f.read(GZIP_BLOCK):
                n += len(block)
                if n > MAX_BYTES:
                    raise DataError(f"{path}: decompresses to more than {MAX_BYTES >> 30} GiB, the most one text "
                                    "file may hold")
        out = np.empty(n, dtype=np.uint8)
        with gzip.open(path, "rb") as f:
            filled = 0
            while filled < n and (got := f.readinto(memoryview(out)[filled:filled + GZIP_BLOCK])):  # no copy
                filled += got
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # EOF: truncated; any other OSError: cannot read
        raise DataError(f"{path}: not a valid gzip file ({e})") from e
    if filled != n:
        raise DataError(f"{path}: changed while it was read")
    out.flags.writeable = False
    return out


def load_corpus(
    paths: PathLike | Sequence[PathLike] | None = None, split: str = "train", verify: bool = True
) -> Corpus:
    """Load the shipped corpus (paths=None) or the user's files.

    paths: a file (.gz decompressed, anything else raw bytes); a directory (its *.txt and *.gz
    files, sorted, not recursive), except that a directory holding MANIFEST.json is read like the
    shipped corpus: `split` picks train or heldout and, with `verify`, each file's size and sha256
    are checked; or a list of these. Every problem raises DataError naming the path.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if paths is None:
        return _load_manifest_dir(default_corpus_dir(), split, verify)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if len(paths) == 0:
        raise DataError("no corpus paths given")
    names, docs = [], []
    for p in map(Path, paths):
        part = _load_path(p, split, verify)
        names += part.names
        docs += part.docs
    return Corpus(tuple(names), tuple(docs))


def utf8_path(path: PathLike) -> Path:
    """`path`, refused in one line (naming it with its odd bytes as \\xff escapes) when its name is
    not UTF-8: a run records its files' names as text (JSON, HDF5, its report), and Python holds
    such a name with escapes that no text file takes."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise DataError(f"{shown}: the name is not UTF-8 text; rename it (or link to it under a UTF-8 name)") from None
    return Path(path)


def _load_path(path: Path, split: str, verify: bool) -> Corpus:
    path = utf8_path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if not path.is_dir():
        return Corpus((_doc_name(path),), (load_text(path),))
    if (path / MANIFEST).is_file():
        return _load_manifest_dir(path, split, verify)
    try:
        files = sorted(f for f in path.iterdir() if f.suffix in TEXT_SUFFIXES and f.is_file())
    except OSError as e:
        raise DataError(f"{path}: cannot list directory ({e.strerror or e})") from e
    if not files:
        raise DataError(f"{path}: no *.txt or *.gz files in this directory")
    files = [utf8_path(f) for f in files]
    return Corpus(tuple(_doc_name(f) for f in files), tuple(load_text(f) for f in files))


def _doc_name(path: Path) -> str:
    """File stem, looking through .gz: 'drama.txt.gz' -> 'drama', 'wiki.test.raw' -> 'wiki.test'."""
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    return Path(name).stem or name


def _load_manifest_dir(root: Path, split: str, verify: bool) -> Corpus:
    """A directory laid out like the shipped corpus: MANIFEST.json lists the train and heldout
    files; the validation split is carved from the end of each training file (validation_cut)."""
    manifest = root / MANIFEST
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))
        entries = [e for e in entries if e["split"] == ("train" if split == "validation" else split)]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(f"{manifest}: unreadable manifest ({e})") from e
    if not entries:
        raise DataError(f"{manifest}: no files listed for split {split!r}")
    names, docs = [], []
    for e in entries:
        path = root / e["file"]
        doc = load_text(path)
        if verify:
            if len(doc) != e["bytes"]:
                raise DataError(f"{path}: {len(doc)} bytes, manifest says {e['bytes']} (damaged)")
            digest = hashlib.sha256(doc).hexdigest()
            if digest != e["sha256_uncompressed"]:
                raise DataError(f"{path}: sha256 {digest} does not match the manifest (damaged)")
        cut = validation_cut(len(doc))
        if split != "heldout":  # training stops where the validation tail starts
            doc = doc[cut:] if split == "validation" else doc[:cut]
        names.append(e["domain"])
        docs.append(doc)
    return Corpus(tuple(names), tuple(docs))


def validation_cut(n: int) -> int:
    """Where a training file of n bytes splits into training (before) and validation (after)."""
    return n - min(VALIDATION_BYTES, n // 8)


class BatchSampler:
    """Random training windows of T1 bytes, a pure function of (seed, stream, step).

    Every valid start position in the corpus is equally likely, so a document is chosen with
    probability proportional to its number of starts (len - T1 + 1) and the start is uniform in it.
    No state is kept between calls: a resumed run redraws exactly the batches it would have drawn.
    """

    def __init__(self, corpus: Corpus, T1: int):
        if T1 < 2:
            raise ConfigError(f"window of {T1} bytes: need at least 2 (one input and its target)")
        self.corpus, self.T1 = corpus, int(T1)
        self._starts = np.maximum(corpus.lengths - self.T1 + 1, 0)  # (n_docs,) valid starts per doc
        if self._starts.sum() == 0:
            largest = int(corpus.lengths.max()) if len(corpus) else 0
            raise DataError(
                f"corpus too small for windows of {self.T1} bytes: "
                f"largest document has {largest} bytes"
            )
        self._ends = np.cumsum(self._starts)  # (n_docs,) first global start of the next document

    @property
    def n_windows(self) -> int:
        """Number of distinct windows (valid start positions) in the corpus."""
        return int(self._ends[-1])

    def positions(self, seed: int, stream: int, step: int, B: int) -> tuple[np.ndarray, np.ndarray]:
        """(B,) document indices and (B,) start offsets of the windows that `batch` returns."""
        # Seeded by the entropy list [seed, stream, step] (a SeedSequence): no state, any machine.
        rng = np.random.default_rng([seed, stream, step])
        g = rng.integers(0, self.n_windows, size=B)  # (B,) uniform over all windows in the corpus
        doc = np.searchsorted(self._ends, g, side="right")
        start = g - (self._ends[doc] - self._starts[doc])
        return doc, start

    def batch(self, seed: int, stream: int, step: int, B: int) -> np.ndarray:
        """(B, T1) uint8 windows: inputs are [:, :-1], next-byte targets [:, 1:]."""
        doc, start = self.positions(seed, stream, step, B)
        out = np.empty((B, self.T1), dtype=np.uint8)
        for b in range(B):
            out[b] = self.corpus.docs[doc[b]][start[b] : start[b] + self.T1]
        return out


def chunk_spans(corpus: Corpus, size: int) -> list[tuple[int, int, int]]:
    """(doc index, start, stop) of consecutive `size`-byte chunks of every document.

    A trailing partial chunk is kept when it holds at least size // 2 bytes, else dropped.
    """
    if size < 1:
        raise ConfigError(f"chunk size {size}: must be at least 1 byte")
    spans = []
    for i, n in enumerate(corpus.lengths.tolist()):
        for start in range(0, n, size):
            stop = min(start + size, n)
            if stop - start == size or stop - start >= max(size // 2, 1):
                spans.append((i, start, stop))
    return spans


def chunk(corpus: Corpus, size: int) -> Corpus:
    """The corpus cut into `size`-byte chunks (views, not copies), each named after its source
    document, so names stay labels (e.g. the domain, to measure clustering purity)."""
    spans = chunk_spans(corpus, size)
    if not spans:
        raise DataError(
            f"no chunks of {size} bytes: every document is shorter than {max(size // 2, 1)} bytes"
        )
    return Corpus(
        tuple(corpus.names[i] for i, _, _ in spans),
        tuple(corpus.docs[i][start:stop] for i, start, stop in spans),
    )


def describe(corpus: Corpus) -> str:
    """One line for display: '8 documents, 10,420,452 bytes (drama, scripture, ...)'."""
    kinds = list(dict.fromkeys(corpus.names))
    shown = ", ".join(kinds[:8]) + (f", ... ({len(kinds)} names)" if len(kinds) > 8 else "")
    noun = "document" if len(corpus) == 1 else "documents"
    return f"{len(corpus)} {noun}, {corpus.n_bytes:,} bytes ({shown})"
