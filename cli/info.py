"""zosoma info: what a checkpoint or a run folder holds."""

from __future__ import annotations

from pathlib import Path

import click

from zosoma.cli.options import emit_json, json_option, previous_option


@click.command()
@click.argument("checkpoint", type=click.Path())
@previous_option
@json_option
def info(checkpoint, previous, as_json):
    """Summarise a checkpoint (file, or run folder): format, config, step, tensors, last metrics.
    For a SOMA run folder: its experts, loss mode and cluster sizes, and each expert's step."""
    from zosoma.formats.checkpoint import description, summary
    from zosoma.runs.folder import RunFolder, checkpoint_path, last_metrics
    from zosoma.runs.soma import soma_description, soma_summary
    if RunFolder(checkpoint).is_soma:
        if as_json:
            emit_json("info", {"kind": "soma", **soma_description(checkpoint, fallback=previous)})
        else:
            click.echo(soma_summary(checkpoint, fallback=previous))
    else:
        path = checkpoint_path(checkpoint, fallback=previous)
        last = last_metrics(path)
        if as_json:
            emit_json("info", {"kind": "checkpoint", **description(path, last)})
        else:
            click.echo(summary(path, last))
