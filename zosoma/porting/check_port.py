#!/usr/bin/env python3
"""Check a port of zosoma against the porting kit's vectors, stage by stage.

Standalone: plain NumPy, no zosoma import, so it runs wherever the port's outputs are. Usage:

    python check_port.py KIT PORT [--strict]

KIT is a folder written by `zosoma porting-kit` (manifest.json and one .npz per stage). PORT is a
folder where the port wrote, for each stage it implements, an .npz of the same name holding the
stage's outputs under the names the manifest lists (computed from that stage's inputs in the
kit's .npz). Each output is compared with the kit's at the tolerance the manifest states:
|port - kit| <= atol + rtol * |kit| elementwise (integers and booleans exactly), and a failure
prints the largest difference and the first mismatches (port value vs kit value); NaN or inf from
the port where the kit's value is finite fails at any tolerance. Stages or outputs the port did
not write are listed as skipped (failures with --strict). Every .npz is read whole, so its CRC-32
catches a damaged byte. Exit status: 0 all checked outputs agree, 1 some do not (or nothing was
checked, or a port's file is damaged), 2 the kit cannot be read or is damaged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

KIT_FORMAT = "zosoma-porting-kit"


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


def read_kit(kit: Path) -> list[tuple[str, str, str, dict, dict]]:
    """(name, file, what, {output: (atol, rtol)}, the kit's arrays) of every stage."""
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
        stages = [(s["name"], s["file"], s["what"],
                   {n: (float(t["atol"]), float(t["rtol"])) for n, t in s["outputs"].items()})
                  for s in manifest["stages"]]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise Unreadable(f"{path} is damaged (its stages cannot be read: {type(e).__name__} {e})") from e
    kits = []
    for name, file, what, outputs in stages:
        arrays = read_npz(kit / file)
        missing = [n for n in outputs if n not in arrays]
        if missing:
            raise Unreadable(f"{kit / file} is damaged (no {missing[0]!r} in it)")
        kits.append((name, file, what, outputs, arrays))
    return kits


def _first(bad, got, want, fmt: str) -> str:
    return ", ".join(f"{tuple(int(i) for i in idx)}: port {got[tuple(idx)]:{fmt}} vs kit {want[tuple(idx)]:{fmt}}"
                     for idx in np.argwhere(bad)[:5])


def compare(name: str, got, want, atol: float, rtol: float) -> tuple[bool, str]:
    """(ok, one line) for one output array: the port's `got` against the kit's `want`."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, f"{name}: shape {got.shape} from the port, {want.shape} in the kit"
    if (got.dtype.kind == "U") != (want.dtype.kind == "U") or got.dtype.kind not in "biufU":
        return False, f"{name}: dtype {got.dtype} from the port, {want.dtype} in the kit"
    if want.dtype.kind in "biuU":
        bad = got != want
        if not bad.any():
            return True, f"{name}: exact ({want.size} values)"
        return False, (f"{name}: {int(bad.sum())} of {want.size} differ (exact match required); "
                       f"first: {_first(bad, got, want, '')}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore"):
        diff = np.where(finite, np.abs(g - w), np.where(g == w, 0.0, np.inf))  # the kit's inf: matched exactly
    diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN from the port is infinitely far from any value
    blown = finite & ~np.isfinite(g)  # fails at any tolerance, an infinite one included
    bad = blown | ~(diff <= atol + rtol * np.abs(np.where(finite, w, 0.0)))
    worst = float(diff.max()) if diff.size else 0.0
    if not bad.any():
        return True, f"{name}: max |diff| {worst:.3g} within atol {atol:g} + rtol {rtol:g} |kit|"
    nonfinite = f" ({int(blown.sum())} NaN or inf from the port where the kit's is finite)" if blown.any() else ""
    return False, (f"{name}: {int(bad.sum())} of {w.size} mismatches (atol {atol:g}, rtol {rtol:g}); "
                   f"max |diff| {worst:.3g}{nonfinite}; first: {_first(bad, g, w, '.9g')}")


def check(kit: Path, port: Path, strict: bool = False, out=sys.stdout) -> int:
    """Compare every stage the port wrote; print a report; return the exit status."""
    try:
        stages = read_kit(kit)
    except Unreadable as e:
        print(f"error: {e}; the kit cannot be used (write it again with `zosoma porting-kit`)", file=out)
        return 2
    checked = failed = skipped = 0
    for name, file, what, outputs, reference in stages:
        path = port / file
        if not path.is_file():
            print(f"[skip] {name}: {path} not written by the port", file=out)
            skipped += 1
            continue
        try:
            produced = read_npz(path)
        except Unreadable as e:
            print(f"[FAIL] {name}: {e}", file=out)
            failed += 1
            continue
        print(f"{name}: {what}", file=out)
        for output, (atol, rtol) in outputs.items():
            if output not in produced:
                print(f"  [skip] {output}: not in {path.name}", file=out)
                skipped += 1
                continue
            ok, line = compare(output, produced[output], reference[output], atol, rtol)
            checked += 1
            failed += not ok
            print(f"  [{'ok' if ok else 'FAIL'}] {line}", file=out)
    status = 1 if failed or not checked or (strict and skipped) else 0
    print(f"{checked} outputs checked, {failed} failed, {skipped} skipped: {'PASS' if status == 0 else 'FAIL'}",
          file=out)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kit", type=Path, help="folder written by `zosoma porting-kit`")
    parser.add_argument("port", type=Path, help="folder holding the port's <stage>.npz outputs")
    parser.add_argument("--strict", action="store_true", help="a stage or output not written is a failure")
    args = parser.parse_args(argv)
    return check(args.kit, args.port, args.strict)


if __name__ == "__main__":
    sys.exit(main())
