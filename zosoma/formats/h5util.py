"""Small helpers shared by the HDF5 files zosoma writes (checkpoints, clusterings): content
checksums, text stored without HDF5's global heap, and reading attributes whatever h5py hands
back.

Text goes into fixed-length byte attributes (short texts) or uint8 datasets (long ones), never
variable-length strings: those live in HDF5's global heap, and a damaged heap makes the HDF5
library loop for ever instead of failing (found by tests/test_damaged_files.py). Files written
before (format version 1) still hold variable-length strings; `check_global_heaps` refuses a
file whose heap headers are damaged before HDF5 reads them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import numpy as np


def content_digest(texts: dict[str, str], arrays: list[tuple[str, np.ndarray]]) -> str:
    """SHA-256 over the text fields (sorted by key) and then the arrays (in the given order), each
    framed by its key, length / dtype and shape, arrays as little-endian C-order bytes."""
    h = hashlib.sha256()
    for key in sorted(texts):
        data = texts[key].encode("utf-8")
        h.update(f"{key}\0{len(data)}\0".encode())
        h.update(data)
    for key, a in arrays:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        h.update(f"{key}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.data if a.size else b"")
    return h.hexdigest()


def text_attr(text: str) -> np.bytes_:
    """A short text as a fixed-length byte attribute value (UTF-8; stored in the object header)."""
    return np.bytes_(text.encode("utf-8"))


def text_array(text: str) -> np.ndarray:
    """A text of any length as a uint8 array, for a dataset."""
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def dataset_text(ds, limit: int) -> str:
    """The text of a dataset written from text_array (or a version-1 variable-length string),
    refusing one that claims more than `limit` bytes (a damaged shape) or is no dataset at all (a
    damaged object header can read back as a named datatype)."""
    if not isinstance(ds, h5py.Dataset):
        raise TypeError(f"{ds.name} is a {type(ds).__name__}, not a text dataset")
    if ds.dtype == np.uint8:
        if ds.ndim != 1 or ds.size > limit:
            raise ValueError(f"text dataset {ds.name} claims {ds.shape} bytes")
        return ds[()].tobytes().decode("utf-8")
    return attr_text(ds[()])


def check_global_heaps(path, data: bytes | None = None) -> None:
    """ValueError when a global heap collection ("GCOL", version 1, then its 8-byte size) in the
    file claims a size below the 4 KiB minimum or past the end of the file: HDF5 would loop on it."""
    data = Path(path).read_bytes() if data is None else data
    at = data.find(b"GCOL")
    while at >= 0:
        if data[at + 4:at + 5] == b"\x01" and len(data) >= at + 16:
            size = int.from_bytes(data[at + 8:at + 16], "little")
            if size < 4096 or at + size > len(data):
                raise ValueError(f"global heap at byte {at} claims {size} bytes")
        at = data.find(b"GCOL", at + 4)


def attr_text(value) -> str:
    """An HDF5 string attribute as str (h5py gives bytes for fixed-length strings)."""
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string, found {type(value).__name__}")


def attr_int(value, what: str) -> int:
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} is not an integer: {value!r}")
    return int(value)
