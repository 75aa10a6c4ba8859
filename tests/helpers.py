"""Shared test helpers: explicit tolerances that say where and by how much a check failed, and the
installed console script for subprocess tests."""

import sys
from pathlib import Path

import numpy as np


def assert_close(actual, reference, atol=0.0, rtol=1e-5, name="value"):
    """Assert |actual - reference| <= atol + rtol * |reference| elementwise; on failure report the
    max difference and the first mismatches (after llm.c's check_tensor)."""
    actual = np.asarray(actual, np.float64)
    reference = np.asarray(reference, np.float64)
    assert actual.shape == reference.shape, f"{name}: shape {actual.shape} != {reference.shape}"
    diff = np.abs(actual - reference)
    bad = diff > atol + rtol * np.abs(reference)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        firsts = ", ".join(f"{tuple(i)}: {actual[tuple(i)]:.7g} vs {reference[tuple(i)]:.7g}" for i in idx)
        raise AssertionError(f"{name}: {bad.sum()} of {bad.size} mismatches (atol={atol}, rtol={rtol}); "
                             f"max abs diff {diff.max():.3g}; first: {firsts}")


def zosoma_cmd() -> list[str]:
    """The installed console script (a `python -c` from the checkout would import the source tree,
    where zosoma.cli does not exist: it is mapped from cli/ at install time)."""
    return [str(Path(sys.executable).parent / "zosoma")]
