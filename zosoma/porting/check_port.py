#!/usr/bin/env python3
"""Check a port of zosoma against the porting kit's vectors, stage by stage.

Standalone: plain NumPy, no zosoma import, so it runs wherever the port's outputs are. Usage:

    python check_port.py KIT PORT [--strict] [--stage NAME ...]

KIT is a folder written by `zosoma porting-kit` (manifest.json, one .npz per stage,
misreadings.npz). PORT is a folder where the port wrote, for each stage it implements, an .npz of
the same name holding the stage's outputs under the names the manifest lists, each computed from
what the manifest's "from" says: the stage's inputs in the kit's .npz, and where it names another
output "(kit's)", the KIT's value of that output (so each output is checked in isolation).

Each output is compared with the kit's at the tolerance the manifest states: |port - kit| <= atol
+ rtol |kit| elementwise; integers and booleans within atol (0: exactly); outputs of a 16-bit
float format ("format", "ulps") must be values of that format at most `ulps` representable values
from the kit's; the kit's NaN and inf must be matched exactly (a 16-bit format's NaN bit for bit, as float32
bits), and NaN or inf from the port where the kit's value is finite fails at any tolerance. A failure prints the largest difference, the
first mismatches (port value vs kit value), what the output is computed from, the hint naming the
likeliest causes and, when the port's values match one, the wrong reading that produces them
(gate blocks in another order, rows in another order, a misreading the kit computed). Each stage
gets a verdict; stages or outputs the port did not write are listed as skipped (failures with
--strict, except a stage the manifest marks "optional", for some devices only). --stage checks only the stages named. Every .npz is read whole, so its CRC-32 catches
a damaged byte. Exit status: 0 all checked outputs agree, 1 some do not (or nothing was checked,
or a port's file is damaged), 2 the kit cannot be read or is damaged.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

KIT_FORMAT = "zosoma-porting-kit"
GATES = "ifgo"


class Unreadable(Exception):
    """A file that cannot be read, or is damaged: one line naming it."""


def read_npz(path: Path) -> dict:
    """Every array of an .npz, each read whole (so the archive's CRC-32 checks every byte)."""
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with f:
            return {name: f[name] for name in f.files}
    except OSError as e:
        raise Unreadable(f"cannot read {path}: {e.strerror or e}") from e
    except Exception as e:  # zipfile, zlib and numpy each have their own words for a damaged file
        raise Unreadable(f"{path} is damaged ({type(e).__name__}: {' '.join(str(e).split())})") from e


def read_kit(kit: Path) -> tuple[list[dict], dict]:
    """(the manifest's stages, each with its arrays under "arrays", the misreadings' arrays)."""
    path = kit / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError as e:
        raise Unreadable(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise Unreadable(f"{path} is damaged (not JSON: {e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != KIT_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise Unreadable(f"{kit}: not a zosoma porting kit (format {found!r})")
    try:
        stages = [{"name": str(s["name"]), "file": str(s["file"]), "what": str(s["what"]),
                   "outputs": {n: dict(t, atol=float(t["atol"]), rtol=float(t["rtol"]))
                               for n, t in s["outputs"].items()},
                   "misreadings": dict(s.get("misreadings") or {}), "optional": str(s.get("optional") or "")}
                  for s in manifest["stages"]]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise Unreadable(f"{path} is damaged (its stages cannot be read: {type(e).__name__} {e})") from e
    for stage in stages:
        stage["arrays"] = read_npz(kit / stage["file"])
        missing = [n for n in stage["outputs"] if n not in stage["arrays"]]
        if missing:
            raise Unreadable(f"{kit / stage['file']} is damaged (no {missing[0]!r} in it)")
    misreadings = read_npz(kit / manifest["misreadings"]) if manifest.get("misreadings") else {}
    return stages, misreadings


def _first(bad, got, want, fmt: str) -> str:
    return ", ".join(f"{tuple(int(i) for i in idx)}: port {got[tuple(idx)]:{fmt}} vs kit {want[tuple(idx)]:{fmt}}"
                     for idx in np.argwhere(bad)[:5])


def _grid(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(whether each value is one of the format's, its position in the format's ordered values)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "bf16":
            f = x.astype(np.float32)
            bits = f.view(np.uint32)
            on = (f.astype(np.float64) == x) & ((bits & 0xFFFF) == 0)
            u = (bits >> 16).astype(np.int64)
        elif fmt == "fp16":
            h = x.astype(np.float16)
            on = h.astype(np.float64) == x
            u = h.view(np.uint16).astype(np.int64)
        else:
            raise Unreadable(f"the manifest names an unknown format {fmt!r}")
    mag = u & 0x7FFF
    return on | np.isnan(x), np.where(u >> 15, -mag, mag)


def compare(name: str, got, want, atol: float, rtol: float, ulps: int = 0, fmt: str = "") -> tuple[bool, str]:
    """(ok, one line) for one output array: the port's `got` against the kit's `want`."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, f"{name}: shape {got.shape} from the port, {want.shape} in the kit"
    if (got.dtype.kind == "U") != (want.dtype.kind == "U") or got.dtype.kind not in "biufU":
        return False, f"{name}: dtype {got.dtype} from the port, {want.dtype} in the kit"
    if want.dtype.kind in "biuU":
        if want.dtype.kind == "U" or atol == 0:
            bad = got != want
            rule = "exact match required"
        else:
            bad = ~(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= atol)
            rule = f"within {atol:g} required"
        if not bad.any():
            return True, f"{name}: exact ({want.size} values)" if not np.any(got != want) else \
                f"{name}: within {atol:g} ({int(np.sum(got != want))} of {want.size} differ)"
        return False, (f"{name}: {int(bad.sum())} of {want.size} differ ({rule}); "
                       f"first: {_first(bad, got, want, '')}")
    with np.errstate(invalid="ignore"):  # a signalling NaN warns when cast
        g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore"):
        same = (g == w) | (np.isnan(g) & np.isnan(w))
        diff = np.where(finite, np.abs(g - w), np.where(same, 0.0, np.inf))  # the kit's NaN, inf: matched exactly
    diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN from the port is infinitely far from any value
    blown = finite & ~np.isfinite(g)  # fails at any tolerance, an infinite one included
    ok = diff <= atol + rtol * np.abs(np.where(finite, w, 0.0))
    off = np.zeros(w.shape, bool)
    nan_off = np.zeros(w.shape, bool)
    apart = 0
    if fmt:  # a format's NaN is matched bit for bit (its sign and payload follow the format's NaN rule)
        kit_nan = np.isnan(w)
        with np.errstate(invalid="ignore"):
            nan_off[kit_nan] = got[kit_nan].astype(np.float32).view(np.uint32) != want[kit_nan].astype(
                np.float32).view(np.uint32)
        on, pos = _grid(g, fmt)
        _, pos_w = _grid(w, fmt)
        steps = np.abs(pos - pos_w)
        off = finite & np.isfinite(g) & ~on
        ok = ok | (finite & np.isfinite(g) & on & (steps <= ulps))
        apart = int(np.where(finite & on & np.isfinite(g), steps, 0).max()) if w.size else 0
    bad = blown | off | nan_off | ~ok
    worst = float(diff.max()) if diff.size else 0.0
    within = f"within {ulps} {fmt} value{'s' if ulps != 1 else ''}" if fmt else f"within atol {atol:g} + rtol {rtol:g} |kit|"
    if not bad.any():
        spread = f" ({apart} apart at most)" if fmt else ""
        return True, f"{name}: max |diff| {worst:.3g} {within}{spread}"
    notes = []
    if blown.any():
        notes.append(f"{int(blown.sum())} NaN or inf from the port where the kit's is finite")
    if off.any():
        notes.append(f"{int(off.sum())} values that are not {fmt} values (round to the format)")
    if nan_off.any():
        i = tuple(int(k) for k in np.argwhere(nan_off)[0])
        with np.errstate(invalid="ignore"):
            bits = [f"{int(np.float32(a[i]).view(np.uint32)):#010x}" for a in (got, want)]
        notes.append(f"{int(nan_off.sum())} NaN not bit for bit the kit's (sign, quiet bit and payload: the format's "
                     f"NaN rule; at {i}: port {bits[0]} vs kit {bits[1]} as float32 bits)")
    note = f" ({'; '.join(notes)})" if notes else ""
    rule = f"{within}" if fmt else f"atol {atol:g}, rtol {rtol:g}"
    return False, (f"{name}: {int(bad.sum())} of {w.size} mismatches ({rule}); "
                   f"max |diff| {worst:.3g}{note}; first: {_first(bad, g, w, '.9g')}")


def _passes(got, want, tol: dict) -> bool:
    return compare("", got, want, tol["atol"], tol["rtol"], int(tol.get("ulps", 0)), tol.get("format", ""))[0]


def diagnose(output: str, got, stage: dict, produced: dict, misreadings: dict) -> str | None:
    """The wrong reading that produces the port's failing values, if one does."""
    tol, want = stage["outputs"][output], stage["arrays"][output]
    got = np.asarray(got)
    for found in stage["misreadings"].get(output, ()):
        values, stride = misreadings.get(found["array"]), int(found.get("stride", 1))
        if values is None or got.shape != want.shape:
            continue
        mine, kit_values = (got, want) if stride == 1 else (got.ravel()[::stride], want.ravel()[::stride])
        if "linear_in" in found:  # the kit's + factor (the port's - the kit's input) @ matrix
            of = found["linear_in"]
            if of not in produced or np.shape(produced[of]) != stage["arrays"][of].shape:
                continue
            change = np.asarray(produced[of], np.float64) - stage["arrays"][of].astype(np.float64)
            if not np.any(change) or not np.all(np.isfinite(change)):
                continue
            values = kit_values.astype(np.float64) + float(found["factor"]) * (change @ values.astype(np.float64))
        if values.shape == mine.shape and _passes(mine, values, tol):
            return found["reading"]
    if got.shape != want.shape or got.ndim == 0:
        return None
    n = want.shape[-1]
    if output.startswith(("gates", "activations", "edge_activations")) and n % 4 == 0:
        blocks = np.split(want, 4, axis=-1)
        for perm in itertools.permutations(range(4)):
            if perm != (0, 1, 2, 3) and _passes(got, np.concatenate([blocks[k] for k in perm], axis=-1), tol):
                return (f"the gate blocks in the order {', '.join(GATES[k] for k in perm)}: the kit's is i, f, g, o "
                        "(torch's; ONNX's LSTM operator uses i, o, f, c)")
    if want.ndim == 2 and want.dtype.kind in "iu" and np.array_equal(np.sort(got, axis=1), np.sort(want, axis=1)):
        return "the right values in each row, in another order"
    return None


def check(kit: Path, port: Path, strict: bool = False, out=sys.stdout, stages: list | None = None) -> int:
    """Compare every stage the port wrote (or those named in `stages`); print a report; return the
    exit status."""
    try:
        kit_stages, misreadings = read_kit(kit)
    except Unreadable as e:
        print(f"error: {e}; the kit cannot be used (write it again with `zosoma porting-kit`)", file=out)
        return 2
    if stages:
        unknown = [s for s in stages if s not in {k["name"] for k in kit_stages}]
        if unknown:
            print(f"error: no stage {unknown[0]!r} in the kit (its stages: "
                  f"{', '.join(k['name'] for k in kit_stages)})", file=out)
            return 2
        kit_stages = [k for k in kit_stages if k["name"] in stages]
    checked = failed = skipped = optional_skipped = 0
    verdicts = {"passed": [], "failed": [], "skipped": []}
    for stage in kit_stages:
        name = stage["name"]
        path = port / stage["file"]
        if not path.is_file():
            optional = stage.get("optional")  # a stage for some devices only: never a failure, --strict or not
            print(f"[skip] {name}: {path} not written by the port" + (f" (optional: {optional})" if optional else ""),
                  file=out)
            skipped += 1
            optional_skipped += bool(optional)
            verdicts["skipped"].append(name)
            continue
        try:
            produced = read_npz(path)
        except Unreadable as e:
            print(f"[FAIL] {name}: {e}", file=out)
            failed += 1
            verdicts["failed"].append(name)
            continue
        print(f"{name}: {stage['what']}", file=out)
        stage_failed = stage_skipped = 0
        for output, tol in stage["outputs"].items():
            if output not in produced:
                print(f"  [skip] {output}: not in {path.name}", file=out)
                skipped += 1
                stage_skipped += 1
                continue
            ok, line = compare(output, produced[output], stage["arrays"][output], tol["atol"], tol["rtol"],
                               int(tol.get("ulps", 0)), tol.get("format", ""))
            checked += 1
            failed += not ok
            stage_failed += not ok
            print(f"  [{'ok' if ok else 'FAIL'}] {line}", file=out)
            if not ok:
                if tol.get("from"):
                    print(f"      from: {', '.join(tol['from'])}", file=out)
                reading = diagnose(output, produced[output], stage, produced, misreadings)
                if reading:
                    print(f"      looks like: {reading}", file=out)
                if tol.get("hint"):
                    print(f"      hint: {tol['hint']}", file=out)
        total = len(stage["outputs"])
        if stage_failed:
            verdicts["failed"].append(name)
            print(f"[FAIL] {name}: {stage_failed} of {total} outputs failed", file=out)
        elif stage_skipped:
            verdicts["skipped" if strict else "passed"].append(name)
            print(f"[{'FAIL' if strict else 'pass'}] {name}: {total - stage_skipped} of {total} outputs checked, "
                  f"{stage_skipped} not written", file=out)
        else:
            verdicts["passed"].append(name)
            print(f"[PASS] {name}: all {total} outputs", file=out)
    status = 1 if failed or not checked or (strict and skipped > optional_skipped) else 0
    print("stages: " + "; ".join(f"{len(v)} {k}" + (f" ({', '.join(v)})" if v and k != "passed" else "")
                                 for k, v in verdicts.items()), file=out)
    print(f"{checked} outputs checked, {failed} failed, {skipped} skipped: {'PASS' if status == 0 else 'FAIL'}",
          file=out)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kit", type=Path, help="folder written by `zosoma porting-kit`")
    parser.add_argument("port", type=Path, help="folder holding the port's <stage>.npz outputs")
    parser.add_argument("--strict", action="store_true", help="a stage or output not written is a failure")
    parser.add_argument("--stage", action="append", metavar="NAME", help="check only this stage (repeatable)")
    args = parser.parse_args(argv)
    return check(args.kit, args.port, args.strict, stages=args.stage)


if __name__ == "__main__":
    sys.exit(main())
