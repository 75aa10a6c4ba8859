"""zosoma porting-kit: the conformance vectors a port must reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import click

from zosoma.cli.options import nonneg, positive


@click.command("porting-kit")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--embed", type=int, default=16, show_default=True, callback=positive, help="E of the kit's model.")
@click.option("--hidden", type=int, default=32, show_default=True, callback=positive, help="H of the kit's model.")
@click.option("--layers", type=int, default=2, show_default=True, callback=positive, help="L of the kit's model.")
@click.option("--seed", type=int, default=0, show_default=True, callback=nonneg)
@click.option("--force", is_flag=True, help="Write into OUT if it exists: only the files an earlier kit wrote there (OUT/manifest.json lists them) are replaced; anything else in OUT is left alone, and a file of the user's with a name the kit uses stops it before anything changes. A run folder is refused, --force or not.")
def porting_kit(out, embed, hidden, layers, seed, force):
    """Write the conformance vectors a port must reproduce, one .npz per stage (the forward, the
    loss, the noise, initialisation, batches, the schedule, one step of each strategy, N training
    steps, shaping, the restart rule, the router, the bf16, fp16 and int8 forwards, and whole runs:
    the paper estimator's, today's default and a run that restarts) with manifest.json of tolerances
    and hints, a README, the default run's batch indices, the kit's model and its training graph
    (theta an input) as ONNX, and the standalone checker: python OUT/check_port.py OUT
    PORT_OUTPUTS/ [--stage NAME]. The ONNX graphs need the onnx extra (pip install
    'zosoma[onnx]'); without it everything else is written and the command says what it skipped.
    PORTING.md is the specification."""
    from zosoma.config import ModelConfig
    from zosoma.porting.kit import STAGES, write_kit

    manifest = write_kit(Path(out), ModelConfig(embed=embed, hidden=hidden, layers=layers), seed, force)
    written = json.loads(manifest.read_text())
    click.echo(f"wrote {manifest.parent}/: {len(STAGES)} stages ({', '.join(STAGES)}) as .npz, "
               f"{', '.join(f for f in written['files'] if f[:-len('.npz')] not in STAGES)}")
    for line in written.get("skipped", ()):
        click.echo(f"skipped {line}")
    click.echo(f"check a port: python {manifest.parent / 'check_port.py'} {manifest.parent} PORT_OUTPUTS/")
