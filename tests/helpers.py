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


RAY_OPTIONS = dict(include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)


def start_ray():
    """Ray on this machine with 2 CPUs and a small object store, quiet (tests' session cluster)."""
    import logging

    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, logging_level=logging.ERROR, **RAY_OPTIONS)
    return ray


def one_line_error(result, code=None):
    """The last line of a failed CliRunner result, checked to be an error without a traceback
    (exit code `code` if given, else any non-zero)."""
    assert result.exit_code != 0 if code is None else result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return [x for x in result.output.strip().splitlines() if x.strip()][-1]


def run_cli(args):
    """zosoma's command line in this process; an unexpected exception propagates."""
    from click.testing import CliRunner
    from zosoma.cli.main import cli
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def scaled_model(embed, hidden, layers, seed=0, scale=3.0):
    """float32 parameters of a model, the default initialisation times `scale` (gates saturate,
    predictions far from uniform: a harder test than the initialisation), and its Layout."""
    from zosoma.config import ModelConfig
    from zosoma.model.params import Layout, init_params
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, seed) * scale).astype(np.float32), layout


def random_bytes(seed, shape):
    """uint8 bytes uniform over the vocabulary, seeded."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
