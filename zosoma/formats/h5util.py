"""Small helpers shared by the HDF5 files zosoma writes (checkpoints, clusterings): content
checksums, and reading attributes whatever h5py hands back."""

from __future__ import annotations

import hashlib

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
