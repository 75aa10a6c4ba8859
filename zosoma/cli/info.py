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
    from zosoma.formats.checkpoint import description, summary
    from zosoma.runs.folder import RunFolder, checkpoint_path, last_metrics, warn_if_training
    from zosoma.training.soma import soma_description, soma_summary
    if RunFolder(checkpoint).is_soma:
        d = {"kind": "soma", **soma_description(checkpoint, fallback=previous)}
        steps, text = [e["step"] for e in d["experts_status"]], lambda: soma_summary(d)
    else:
        path = checkpoint_path(checkpoint, fallback=previous)
        last = last_metrics(path)
        d = {"kind": "checkpoint", **description(path, last)}
        steps, text = [d["step"]], lambda: summary(path, last)
    status = {"trained_by": warn_if_training(checkpoint, steps), "results_stale": warn_about_results(checkpoint)}
    if as_json:
        emit_json("info", {**d, **status} if Path(checkpoint).is_dir() else d)
    else:
        click.echo(text())
