#!/usr/bin/env python3
"""Check a port of zosoma against the porting kit's vectors, stage by stage.

Standalone: plain NumPy, no zosoma import, so it runs wherever the port's outputs are. Usage:

    python check_port.py KIT PORT [--strict]

KIT is a folder written by `zosoma porting-kit` (manifest.json and one .npz per stage). PORT is a
folder where the port wrote, for each stage it implements, an .npz of the same name holding the
stage's outputs under the names the manifest lists (computed from that stage's inputs in the
kit's .npz). Each output is compared with the kit's at the tolerance the manifest states:
|port - kit| <= atol + rtol * |kit| elementwise (integers and booleans exactly), and a failure
prints the largest difference and the first mismatches. Stages or outputs the port did not write
are listed as skipped (failures with --strict). Exit status: 0 all checked outputs agree, 1 some
do not (or nothing was checked), 2 the kit cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

KIT_FORMAT = "zosoma-porting-kit"


def compare(name: str, got, want, atol: float, rtol: float) -> tuple[bool, str]:
    """(ok, one line) for one output array."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, f"{name}: shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "biu" or want.dtype.kind == "U":
        bad = got != want
        if not bad.any():
            return True, f"{name}: exact ({want.size} values)"
        first = ", ".join(f"{tuple(int(i) for i in idx)}: {got[tuple(idx)]} vs {want[tuple(idx)]}"
                          for idx in np.argwhere(bad)[:5])
        return False, f"{name}: {int(bad.sum())} of {want.size} differ (exact match required); first: {first}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    diff = np.where(finite, np.abs(g - w), np.where(g == w, 0.0, np.inf))
    limit = atol + rtol * np.abs(np.where(finite, w, 0.0))
    bad = ~(diff <= limit)  # NaN in the port's output is a mismatch
    worst = float(np.nanmax(diff)) if diff.size else 0.0
    if not bad.any():
        return True, f"{name}: max |diff| {worst:.3g} within atol {atol:g} + rtol {rtol:g} |kit|"
    first = ", ".join(f"{tuple(int(i) for i in idx)}: {g[tuple(idx)]:.9g} vs {w[tuple(idx)]:.9g}"
                      for idx in np.argwhere(bad)[:5])
    return False, (f"{name}: {int(bad.sum())} of {w.size} mismatches (atol {atol:g}, rtol {rtol:g}); "
                   f"max |diff| {worst:.3g}; first: {first}")


def check(kit: Path, port: Path, strict: bool = False, out=sys.stdout) -> int:
    """Compare every stage the port wrote; print a report; return the exit status."""
    try:
        manifest = json.loads((kit / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        print(f"cannot read {kit / 'manifest.json'}: {e}", file=out)
        return 2
    if manifest.get("format") != KIT_FORMAT:
        print(f"{kit}: not a zosoma porting kit (format {manifest.get('format')!r})", file=out)
        return 2
    checked = failed = skipped = 0
    for stage in manifest["stages"]:
        path = port / stage["file"]
        if not path.is_file():
            print(f"[skip] {stage['name']}: {path} not written by the port", file=out)
            skipped += 1
            continue
        try:
            with np.load(kit / stage["file"]) as k, np.load(path) as p:
                reference = {name: k[name] for name in stage["outputs"]}
                produced = {name: p[name] for name in stage["outputs"] if name in p.files}
        except (OSError, ValueError, KeyError) as e:
            print(f"[FAIL] {stage['name']}: cannot read {path}: {e}", file=out)
            failed += 1
            continue
        print(f"{stage['name']}: {stage['what']}", file=out)
        for name, tol in stage["outputs"].items():
            if name not in produced:
                print(f"  [skip] {name}: not in {path.name}", file=out)
                skipped += 1
                continue
            ok, line = compare(name, produced[name], reference[name], tol["atol"], tol["rtol"])
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
