"""The JSON records zosoma writes beside its runs: written atomically, read back whole (a damaged one
is one line saying how to write it again), and compared with the configuration asked for."""

from __future__ import annotations

import json
from pathlib import Path

from zosoma.atomic import atomic_write
from zosoma.errors import ConfigError
from zosoma.training.json_shape import record_problem


def write_json(path: Path, obj, what: str = "file") -> None:
    """Atomically write obj as indented JSON."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True), what)


def read_record(path: Path, redo: str, shape: dict | None = None) -> dict | None:
    """A JSON record zosoma wrote, or None when there is none; a damaged one (cut short, edited,
    or JSON of another shape than `shape`) is one line saying how to write it again."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is damaged ({e}): delete it; {redo}") from None
    problem = record_problem(record, shape) if shape is not None else None
    if problem:
        raise ConfigError(f"{path} is damaged ({problem}): delete it; {redo}")
    return record


def changes(found: dict, wanted: dict, prefix: str = "") -> list[str]:
    """'KEY was A, now B' for every key whose value differs between a recorded configuration and
    the one asked for (nested tables by dotted key: train.lr); [] when they agree."""
    found, wanted = plain(found), plain(wanted)
    out = []
    for key in dict.fromkeys([*found, *wanted]):
        a, b = found.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} was {json.dumps(a)}, now {json.dumps(b)}")
    return out


def plain(obj):
    """obj as JSON reads it back (tuples become lists), so recorded and asked-for values compare."""
    return json.loads(json.dumps(obj))
