"""The clustering file (a SOMA run's router.h5): a fitted clustering's config and arrays in HDF5.

A group holds the datasets idf (F,), projection (F, D) and centroids (N, D), all float32, and the
attributes format, format_version, config (ClusterConfig as JSON) and checksum (SHA-256 over all
of them, zosoma.formats.h5util). The pipeline that fits and uses them is zosoma.mixture.cluster.
Shape letters: F = n_features hash buckets, D = svd_dim, N clusters.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Union

import numpy as np

from zosoma.atomic import atomic_write
from zosoma.config import ClusterConfig
from zosoma.errors import CheckpointError, ConfigError
from zosoma.formats.h5util import attr_int, attr_text, check_global_heaps, content_digest, text_attr

FORMAT = "zosoma-clustering"
FORMAT_VERSION = 2  # 2: fixed-length text attributes (zosoma.formats.h5util); 1 is still read

PathLike = Union[str, Path]


def shapes(config: ClusterConfig) -> dict[str, tuple]:
    """The arrays a clustering of `config` holds, in the order they are stored and checksummed."""
    F, D, N = config.n_features, config.svd_dim, config.n_clusters
    return {"idf": (F,), "projection": (F, D), "centroids": (N, D)}


def write_clustering(group, config: ClusterConfig, arrays: dict[str, np.ndarray]) -> None:
    """Write into an h5py Group: datasets idf, projection, centroids; attrs format,
    format_version, config (JSON) and checksum (SHA-256 over all of them)."""
    group.attrs["format"] = text_attr(FORMAT)  # fixed-length text: no global heap (h5util)
    group.attrs["format_version"] = np.int64(FORMAT_VERSION)
    group.attrs["config"] = text_attr(config.to_json())
    group.attrs["checksum"] = text_attr(content_digest(*_digest_parts(config, arrays)))
    for name in shapes(config):
        group.create_dataset(name, data=arrays[name])


def read_clustering(group) -> tuple[ClusterConfig, dict[str, np.ndarray]]:
    """Read what `write_clustering` wrote: (config, arrays); CheckpointError (naming file and
    group) on anything amiss."""
    where = f"{getattr(group.file, 'filename', '?')}:{group.name}"
    try:
        return _read(group, where)
    except CheckpointError:
        raise
    except (_Damaged, OSError, KeyError, ValueError, TypeError, RuntimeError, ConfigError) as err:
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        reason = " ".join(text.split()) or type(err).__name__
        raise CheckpointError(f"{where} is damaged or not a zosoma clustering: {reason}") from None


def _read(group, where: str) -> tuple[ClusterConfig, dict[str, np.ndarray]]:
    import h5py

    fmt = attr_text(group.attrs["format"]) if "format" in group.attrs else None
    if fmt != FORMAT:
        raise _Damaged(f"format is {fmt!r}, expected {FORMAT!r}")
    version = attr_int(group.attrs["format_version"], "format_version")
    if version not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{where}: clustering format version {version} is not supported "
                              f"(this zosoma reads version {FORMAT_VERSION})")
    config = ClusterConfig.from_json(attr_text(group.attrs["config"]))
    arrays = {}
    for name, shape in shapes(config).items():
        ds = group[name]
        if not isinstance(ds, h5py.Dataset) or ds.shape != shape or ds.dtype != np.float32:
            raise _Damaged(f"{name} is {getattr(ds, 'dtype', '?')} {getattr(ds, 'shape', '?')}, "
                           f"expected float32 {shape}")
        arrays[name] = np.ascontiguousarray(ds[()])
    if content_digest(*_digest_parts(config, arrays, version)) != attr_text(group.attrs["checksum"]):
        raise _Damaged("checksum mismatch (modified or corrupted after writing)")
    return config, arrays


def _digest_parts(config: ClusterConfig, arrays: dict[str, np.ndarray], version: int = None):
    texts = {"format": FORMAT, "format_version": str(version or FORMAT_VERSION), "config": config.to_json()}
    return texts, [(name, arrays[name]) for name in shapes(config)]


class _Damaged(Exception):
    """A reason a stored clustering is unusable; becomes a CheckpointError naming the group."""


def save_clustering_file(path: PathLike, config: ClusterConfig, arrays: dict[str, np.ndarray]) -> None:
    """Write a clustering alone to an HDF5 file, atomically (zosoma.atomic)."""
    import h5py

    path = Path(path)
    image = io.BytesIO()  # built in memory: the HDF5 library never meets a full disk (checkpoint.py)
    with h5py.File(image, "w") as f:
        write_clustering(f, config, arrays)
    atomic_write(path, image.getbuffer(), "clustering")


def load_clustering_file(path: PathLike) -> tuple[ClusterConfig, dict[str, np.ndarray]]:
    """Read a file written by save_clustering_file: (config, arrays); CheckpointError naming the
    path when it is missing or damaged."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"clustering {path} does not exist or is not a file")
    try:
        check_global_heaps(path)
        with h5py.File(path, "r") as f:
            return read_clustering(f)
    except ValueError as err:  # from check_global_heaps
        raise CheckpointError(f"{path} is damaged or not an HDF5 file: {err}") from None
    except OSError as err:
        reason = " ".join(str(err).split())
        raise CheckpointError(f"{path} is damaged or not an HDF5 file: {reason}") from None
