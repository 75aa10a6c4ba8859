"""Checkpoint I/O: one HDF5 file that says what it is (after Keras' legacy H5 format and anndata's
`encoding-type` / `encoding-version`).

Layout of format "zosoma-checkpoint", version 3:

    /                    attrs: format, format_version, zosoma_version, config (config.to_json of
                         ModelConfig and TrainConfig), created (ISO 8601, UTC), step, checksum
                         (SHA-256 of the content, h5util.content_digest), metrics_records and
                         metrics_sha256 (how far the run's metrics.jsonl went: its first
                         metrics_records lines, whose bytes have that SHA-256); texts are
                         fixed-length UTF-8 bytes
    /extra               JSON object (uint8 text): seeds, data record, compute totals, the
                         divergence guard's and the coefficient shaping's state
    /params/layout       JSON list of [name, shape, offset] rebuilding theta (d,) (uint8 text)
    /params/<name>       float32 tensor in zosoma's "x @ W" orientation (zosoma.model.params), attr offset
    /optimizer/<name>    one dataset per optimizer state array (e.g. m, v for Adam)

The file's size does not grow with the run: the step records live in the run's metrics.jsonl
(zosoma.training.logs.MetricsLog), which the checkpoint only counts and checksums.

Versions 1 and 2 (still read) held the step records themselves as /metrics, a JSON list (uint8
text), and no metrics_records or metrics_sha256: read, their records come back as
`stored_metrics`. Version 1 also kept extra and layout as attributes and every text as a
variable-length string; version 2 keeps text out of HDF5's global heap, which the HDF5 library
loops on when it is damaged (zosoma.formats.h5util). HDF5 checksums neither raw data nor
attributes, so a flipped byte inside a tensor would load silently; the `checksum` attribute covers
every value the reader returns.

Writes are atomic: the file is built in memory, then written to a temporary file in the target's
folder, fsynced and renamed onto the target, so a crash or a full disk mid-write leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import textwrap
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Union

import numpy as np

from zosoma.config import ModelConfig, TrainConfig, from_json, to_json
from zosoma.errors import CheckpointError, ConfigError
from zosoma.atomic import atomic_write
from zosoma.version import __version__
from zosoma.formats.h5util import (attr_int, attr_text, check_global_heaps, content_digest, dataset_text,
                                   text_array, text_attr)
from zosoma.model.params import Layout

FORMAT = "zosoma-checkpoint"
FORMAT_VERSION = 3  # 3: the step records left for metrics.jsonl; 2: text without HDF5's global heap (h5util)
EMPTY_SHA256 = hashlib.sha256().hexdigest()  # the checksum of no metrics records

PathLike = Union[str, Path]

# What a damaged or foreign file can make h5py, json or the config classes raise while reading.
_READ_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError,
                UnicodeError, ConfigError)


@dataclass(eq=False)  # eq=False: fields hold arrays, whose == is elementwise
class Checkpoint:
    model: ModelConfig
    train: TrainConfig
    theta: np.ndarray  # (d,) float32 flat parameters, d = Layout(model).size
    step: int  # optimizer steps completed
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. {"m": (d,), "v": (d,)}
    extra: dict = field(default_factory=dict)  # JSON-able run state: seeds, data cursors, ...
    metrics_records: int = 0  # the run's metrics.jsonl held this many records at this step ...
    metrics_sha256: str = EMPTY_SHA256  # ... whose bytes have this SHA-256 ("" read from version 1-2 files)
    stored_metrics: list[dict] | None = None  # the records themselves: read from version 1-2 files only


def _json_default(value):
    """Let NumPy scalars and arrays from the training loop into JSON records."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _layout_json(layout: Layout) -> str:
    return json.dumps([[e.name, list(e.shape), e.offset] for e in layout.entries])


def _check_for_writing(ckpt: Checkpoint, layout: Layout) -> None:
    """Refuse to write a checkpoint that could not be read back (caller bugs, so ValueError)."""
    theta = ckpt.theta
    if not isinstance(theta, np.ndarray) or theta.dtype != np.float32 or theta.shape != (layout.size,):
        raise ValueError(f"theta must be a float32 array of shape ({layout.size},) for {ckpt.model}, got "
                         f"{getattr(theta, 'dtype', type(theta))} {getattr(theta, 'shape', '')}")
    if isinstance(ckpt.step, bool) or not isinstance(ckpt.step, (int, np.integer)) or ckpt.step < 0:
        raise ValueError(f"step must be a non-negative integer, got {ckpt.step!r}")
    for name, value in ckpt.optimizer.items():
        if not isinstance(name, str) or not name or "/" in name or name == ".":
            raise ValueError(f"optimizer state name {name!r} cannot name an HDF5 dataset")
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biufc":
            raise ValueError(f"optimizer state {name!r} must be a numeric NumPy array")
    if not isinstance(ckpt.extra, dict):
        raise ValueError("extra must be a dict")
    records = ckpt.metrics_records
    if isinstance(records, bool) or not isinstance(records, (int, np.integer)) or records < 0:
        raise ValueError(f"metrics_records must be a non-negative integer, got {records!r}")
    if not isinstance(ckpt.metrics_sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", ckpt.metrics_sha256):
        raise ValueError(f"metrics_sha256 must be a SHA-256 in hex, got {ckpt.metrics_sha256!r}")


def save_checkpoint(path: PathLike, ckpt: Checkpoint) -> None:
    """Write `ckpt` to `path` atomically (zosoma.atomic: temporary file, fsync, rename). On any
    failure the temporary is removed and an existing file at `path` is left untouched; an OSError
    (full disk, missing folder, no permission) becomes a one-line WriteError naming the path."""
    import h5py

    path = Path(path)
    layout = Layout(ckpt.model)
    _check_for_writing(ckpt, layout)
    # Serialise first so a record that is not JSON-able fails before any file is touched.
    try:
        texts = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "zosoma_version": __version__,
            "config": to_json(ckpt.model, ckpt.train),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "step": str(int(ckpt.step)),
            "extra": json.dumps(ckpt.extra, sort_keys=True, default=_json_default),
            "metrics_records": str(int(ckpt.metrics_records)),
            "metrics_sha256": ckpt.metrics_sha256,
            "layout": _layout_json(layout),
        }
    except TypeError as err:
        raise TypeError(f"checkpoint extra must be JSON serialisable: {err}") from None
    numbers = {"format_version": np.int64(FORMAT_VERSION), "step": np.int64(ckpt.step),
               "metrics_records": np.int64(ckpt.metrics_records), "metrics_sha256": text_attr(ckpt.metrics_sha256)}

    # Built in memory, then written by zosoma.atomic: the HDF5 library never meets a full disk
    # (it leaves half-flushed objects behind that fail again, noisily, until the process crashes).
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        write_contents(f, texts, numbers, layout, ckpt.theta, ckpt.optimizer)
    atomic_write(path, image.getbuffer(), "checkpoint")


def write_contents(f, texts: dict, numbers: dict, layout: Layout, theta: np.ndarray, optimizer: dict) -> None:
    """Write into the open HDF5 file `f` what format versions 2 and 3 share: the text attributes,
    then `numbers` (the version's other root attributes, in their order), the checksum of `texts`
    and the arrays, /extra, /params (theta (d,) cut by `layout`) and /optimizer. The tests write a
    version-2 checkpoint with it."""
    params = [(e.name, layout.view(theta, e.name)) for e in layout.entries]
    optimizer = [(name, optimizer[name]) for name in sorted(optimizer)]
    checksum = content_digest(texts, [("params/" + n, a) for n, a in params] +
                              [("optimizer/" + n, a) for n, a in optimizer])
    for key in ("format", "zosoma_version", "config", "created"):
        f.attrs[key] = text_attr(texts[key])
    for key, value in numbers.items():
        f.attrs[key] = value
    f.attrs["checksum"] = text_attr(checksum)
    f.create_dataset("extra", data=text_array(texts["extra"]))
    group = f.create_group("params")
    group.create_dataset("layout", data=text_array(texts["layout"]))
    for (name, values), entry in zip(params, layout.entries):
        group.create_dataset(name, data=values).attrs["offset"] = np.int64(entry.offset)
    group = f.create_group("optimizer")
    for name, values in optimizer:
        group.create_dataset(name, data=values)


class _Damaged(Exception):
    """A reason the file is not a usable checkpoint; turned into CheckpointError with the path."""


def _read(path: Path) -> tuple[Checkpoint, dict]:
    """The checkpoint and its header (format, format_version, zosoma_version, created)."""
    import h5py

    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a file")
    limit = path.stat().st_size  # no stored text can be longer than the file
    check_global_heaps(path)
    with h5py.File(path, "r") as f:
        if "format" not in f.attrs:
            raise _Damaged("no 'format' attribute (not written by zosoma)")
        fmt = attr_text(f.attrs["format"])
        if fmt != FORMAT:
            raise _Damaged(f"format is {fmt!r}, expected {FORMAT!r}")
        version = attr_int(f.attrs.get("format_version"), "format_version")
        written_by = attr_text(f.attrs.get("zosoma_version", "unknown"))
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path} was written by a newer zosoma ({written_by}, format version "
                f"{version}); zosoma {__version__} reads up to version {FORMAT_VERSION}: upgrade zosoma")
        if version < 1:
            raise _Damaged(f"invalid format_version {version}")

        texts = {"format": fmt, "format_version": str(version), "zosoma_version": written_by}
        for key in ("config", "created"):
            texts[key] = attr_text(f.attrs[key])
        texts["extra"] = attr_text(f.attrs["extra"]) if version == 1 else dataset_text(f["extra"], limit)
        step = attr_int(f.attrs["step"], "step")
        if step < 0:
            raise _Damaged(f"negative step {step}")
        texts["step"] = str(step)
        configs = from_json(texts["config"])
        model, train = configs["ModelConfig"], configs["TrainConfig"]
        extra = json.loads(texts["extra"])
        if not isinstance(extra, dict):
            raise _Damaged("'extra' is not a JSON object")

        layout = Layout(model)
        group = f["params"]
        texts["layout"] = attr_text(group.attrs["layout"]) if version == 1 else dataset_text(group["layout"], limit)
        stored = [(str(n), tuple(int(s) for s in shape), int(o)) for n, shape, o in json.loads(texts["layout"])]
        expected = [(e.name, e.shape, e.offset) for e in layout.entries]
        if stored != expected:
            raise CheckpointError(
                f"checkpoint {path} has a parameter layout that does not match its {model} "
                f"(shape mismatch: {_first_difference(stored, expected)})")
        if set(group.keys()) - {"layout"} != {e.name for e in layout.entries}:
            raise _Damaged(f"params holds {sorted(group.keys())}, expected the tensors of {model}")
        theta = np.empty(layout.size, np.float32)
        params = []
        for e in layout.entries:
            ds = group[e.name]
            if not isinstance(ds, h5py.Dataset) or ds.shape != e.shape:
                raise CheckpointError(f"checkpoint {path}: parameter {e.name!r} has shape "
                                      f"{getattr(ds, 'shape', None)}, expected {e.shape} for {model}")
            if ds.dtype.kind != "f" or ds.dtype.itemsize != 4:
                raise _Damaged(f"parameter {e.name!r} has dtype {ds.dtype}, expected float32")
            if attr_int(ds.attrs["offset"], "offset") != e.offset:
                raise _Damaged(f"parameter {e.name!r} has offset {ds.attrs['offset']}, expected {e.offset}")
            view = layout.view(theta, e.name)
            view[...] = ds[()]
            params.append(("params/" + e.name, view))

        optimizer = {}
        for name in sorted(f["optimizer"].keys()):
            ds = f["optimizer"][name]
            if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "biufc" or ds.size > limit:
                raise _Damaged(f"optimizer state {name!r} is not a numeric dataset of at most the file's size")
            optimizer[name] = np.asarray(ds[()])

        if version < 3:  # the records themselves
            texts["metrics"] = dataset_text(f["metrics"], limit)
            stored_metrics = json.loads(texts["metrics"])
            if not isinstance(stored_metrics, list):
                raise _Damaged("'metrics' is not a JSON list")
            records, sha256 = len(stored_metrics), ""
        else:  # how far metrics.jsonl went
            stored_metrics, records = None, attr_int(f.attrs["metrics_records"], "metrics_records")
            sha256 = texts["metrics_sha256"] = attr_text(f.attrs["metrics_sha256"])
            if records < 0:
                raise _Damaged(f"negative metrics_records {records}")
            texts["metrics_records"] = str(records)

        checksum = attr_text(f.attrs["checksum"])
    arrays = params + [("optimizer/" + n, a) for n, a in optimizer.items()]
    if content_digest(texts, arrays) != checksum:
        raise _Damaged("checksum mismatch (the file was modified or corrupted after writing)")
    header = {"format": fmt, "format_version": version, "zosoma_version": written_by,
              "created": texts["created"]}
    return Checkpoint(model, train, theta, step, optimizer, extra, records, sha256, stored_metrics), header


def _first_difference(stored, expected) -> str:
    for s, e in zip(stored, expected):
        if s != e:
            return f"file has {s[0]!r} {s[1]} at offset {s[2]}, config needs {e[0]!r} {e[1]} at offset {e[2]}"
    return f"file has {len(stored)} tensors, config needs {len(expected)}"


def _read_or_raise(path: PathLike) -> tuple[Checkpoint, dict]:
    path = Path(path)
    try:
        return _read(path)
    except CheckpointError:
        raise
    except (_Damaged, *_READ_ERRORS) as err:
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)  # no KeyError quotes
        reason = " ".join(text.split()) or type(err).__name__
        raise CheckpointError(f"{path} is damaged or not a zosoma checkpoint: {reason}") from None


def stored_step(path: PathLike) -> int | None:
    """The step a checkpoint file's header names (not verified: for choosing which files to keep),
    or None when it cannot be read."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return attr_int(f.attrs["step"], "step")
    except (OSError, KeyError, ValueError, TypeError, CheckpointError):
        return None


def load_checkpoint(path: PathLike) -> Checkpoint:
    """Read and verify a checkpoint: format and version, every tensor's shape against the layout of
    the stored ModelConfig, and the content checksum. Values need not be finite. Raises
    CheckpointError (one line, naming the path) for anything else."""
    return _read_or_raise(path)[0]


def description(path: PathLike, last_metrics: dict | None = None) -> dict:
    """What `zosoma info --json` prints of a checkpoint (verified as load_checkpoint does);
    `last_metrics`: the last metrics.jsonl record it covers (zosoma.training.folder.last_metrics)."""
    ckpt, header = _read_or_raise(path)
    layout = Layout(ckpt.model)
    return {"checkpoint": str(path), **{k: header[k] for k in ("format", "format_version", "zosoma_version", "created")},
            "step": ckpt.step, "n_params": layout.size, "model": asdict(ckpt.model), "train": asdict(ckpt.train),
            "tensors": [{"name": e.name, "shape": list(e.shape), "offset": e.offset} for e in layout.entries],
            "optimizer": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in ckpt.optimizer.items()},
            "metrics": ckpt.metrics_records, "last_metrics": last_metrics,
            "extra": ckpt.extra}


def summary(path: PathLike, last_metrics: dict | None = None) -> str:
    """A multi-line human summary of a checkpoint (what `zosoma info` prints, with the last
    metrics.jsonl record it covers); verifies the file like load_checkpoint and raises
    CheckpointError when it is damaged."""
    ckpt, header = _read_or_raise(path)
    layout = Layout(ckpt.model)
    n = layout.size
    width = max(len(e.name) for e in layout.entries)
    lines = [
        f"checkpoint   {path}",
        f"format       {header['format']} v{header['format_version']}, "
        f"written by zosoma {header['zosoma_version']}",
        f"created      {header['created']}",
        f"step         {ckpt.step}",
        f"model        {_fields(ckpt.model)}: {n} parameters ({n / 1e6:.2f}M)",
    ]
    lines += [f"  {e.name:<{width}}  {str(e.shape):<12}  offset {e.offset}" for e in layout.entries]
    lines.append("train        " + "\n             ".join(textwrap.wrap(_fields(ckpt.train), 86)))
    if ckpt.optimizer:
        states = ", ".join(f"{k} {v.shape} {v.dtype}" for k, v in ckpt.optimizer.items())
    else:
        states = "none"
    lines.append(f"optimizer    {states}")
    lines.append(f"metrics      {ckpt.metrics_records} records")
    if last_metrics is not None:
        lines.append(f"  last       {_json_line(last_metrics)}")
    lines.append("extra" + ("" if ckpt.extra else "        none"))
    lines += [f"  {k}: {_json_line(v)}" for k, v in sorted(ckpt.extra.items())]
    return "\n".join(lines)


def _fields(config) -> str:
    return ", ".join(f"{k}={v}" for k, v in asdict(config).items())


def _json_line(value, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."
