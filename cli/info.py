"""zosoma info: what a checkpoint or a run folder holds."""

from __future__ import annotations

from pathlib import Path

import click

from zosoma.cli.options import previous_option


@click.command()
@click.argument("checkpoint", type=click.Path())
@previous_option
def info(checkpoint, previous):
    """Summarise a checkpoint (file, or run folder): format, config, step, tensors, last metrics.
    For a SOMA run folder: its experts, loss mode and cluster sizes, and each expert's step."""
    from zosoma.formats.checkpoint import summary
    from zosoma.runs.folder import RunFolder, checkpoint_path
    from zosoma.runs.soma import soma_summary
    if RunFolder(checkpoint).is_soma:
        click.echo(soma_summary(checkpoint, fallback=previous))
    else:
        click.echo(summary(checkpoint_path(checkpoint, fallback=previous)))
