"""zosoma info: what a checkpoint or a run folder holds."""

from __future__ import annotations

from pathlib import Path

import click

from zosoma.cli.options import emit_json, json_option, previous_option, warn_about_results


@click.command()
@click.argument("checkpoint", type=click.Path())
@previous_option
@json_option
def info(checkpoint, previous, as_json):
    """Summarise a checkpoint (file, or run folder): format, config, step, tensors, last metrics.
    For a SOMA run folder: its experts, loss mode and cluster sizes, and each expert's step. A run
    still training, and a results.json the run has trained past, are said in a warning line."""
    from zosoma.training.folder import warn_if_training
    from zosoma.runs.run import Run

    run = Run.open(checkpoint)
    d = run.describe(fallback=previous)
    status = {"trained_by": warn_if_training(checkpoint, run.steps(d)), "results_stale": warn_about_results(checkpoint)}
    if as_json:
        emit_json("info", {**d, **status} if Path(checkpoint).is_dir() else d)
    else:
        click.echo(run.summary(d))
