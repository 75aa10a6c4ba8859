"""The shape a JSON record read back must have: what a report reads of it, checked whole before it
is read, so a damaged record is one line naming what is wrong (a study's result.json:
zosoma.training.folder, RunFolder.read_result), never a KeyError halfway through a report.

A shape maps each key a record must hold to its kind:

    a type, or a tuple of types        str; NUMBER (int or float, not true or false); (str, type(None))
    a dict                             the shape of a nested object
    ListOf(kind)                       a list whose every item is of kind
    ValuesOf(kind, keys)               an object whose every value is of kind, holding at least keys
    MayLack(kind)                      a key an older zosoma did not write: of kind when present

and a tuple may mix types with one of the others: (ListOf(...), type(None)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NUMBER = (int, float)  # a JSON number, in a record's shape


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose every item is of `kind`."""
    kind: object


@dataclass(frozen=True)
class ValuesOf:
    """A JSON object whose every value is of `kind`, holding at least `keys`."""
    kind: object
    keys: tuple = ()


@dataclass(frozen=True)
class MayLack:
    """A key the record may lack (records an older zosoma wrote), of `kind` where it is present."""
    kind: object


def record_problem(record, shape: dict, where: str = "") -> str | None:
    """What makes a record read from JSON other than `shape`, in a few words, or None."""
    if not isinstance(record, dict):
        return f"{where.rstrip('.') or 'it'} is {_short(record)}, not a JSON object"
    for key, kind in shape.items():
        if key not in record:
            if isinstance(kind, MayLack):
                continue
            return f"no {where}{key}"
        problem = _problem(record[key], kind.kind if isinstance(kind, MayLack) else kind, f"{where}{key}")
        if problem:
            return problem
    return None


def _problem(value, kind, where: str) -> str | None:
    """What makes `value`, found at `where`, other than `kind`, or None."""
    if isinstance(kind, dict):
        return record_problem(value, kind, f"{where}.")
    if isinstance(kind, ListOf):
        if not isinstance(value, list):
            return f"{where} is {_short(value)}, not a list"
        return next((p for i, item in enumerate(value) if (p := _problem(item, kind.kind, f"{where}[{i}]"))), None)
    if isinstance(kind, ValuesOf):
        if not isinstance(value, dict):
            return f"{where} is {_short(value)}, not a JSON object"
        missing = [k for k in kind.keys if k not in value]
        if missing:
            return f"no {where}.{missing[0]}"
        return next((p for k, v in value.items() if (p := _problem(v, kind.kind, f"{where}.{k}"))), None)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    types = tuple(k for k in kinds if isinstance(k, type))
    if isinstance(value, types) and (not isinstance(value, bool) or bool in types):  # true is no number
        return None
    shapes = [k for k in kinds if not isinstance(k, type)]
    return _problem(value, shapes[0], where) if shapes else f"{where} is {_short(value)}"


def _short(value) -> str:
    return json.dumps(value)[:40]
