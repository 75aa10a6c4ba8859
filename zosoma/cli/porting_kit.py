"""zosoma porting-kit: the conformance vectors a port must reproduce."""

from __future__ import annotations

from pathlib import Path

import click

from zosoma.cli.options import nonneg, positive


@click.command("porting-kit")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--embed", type=int, default=16, show_default=True, callback=positive, help="E of the kit's model.")
@click.option("--hidden", type=int, default=32, show_default=True, callback=positive, help="H of the kit's model.")
@click.option("--layers", type=int, default=2, show_default=True, callback=positive, help="L of the kit's model.")
@click.option("--seed", type=int, default=0, show_default=True, callback=nonneg)
@click.option("--force", is_flag=True, help="Write into OUT if it exists: only the files an earlier kit wrote there (OUT/manifest.json lists them) are replaced; anything else in OUT is left alone, and a file of the user's with a name the kit uses stops it before anything changes.")
def porting_kit(out, embed, hidden, layers, seed, force):
    """Write the conformance vectors a port must reproduce, one .npz per stage (the forward, the
    loss, the noise, initialisation, batches, the schedule, one step of each strategy, N training
    steps, shaping, the restart rule, the router, the bf16, fp16 and int8 forwards) with
    manifest.json of tolerances and hints, the kit's model as ONNX, and the standalone checker:
    python OUT/check_port.py OUT PORT_OUTPUTS/ [--stage NAME]. PORTING.md is the specification."""
    from zosoma.config import ModelConfig
    from zosoma.porting.kit import STAGES, write_kit

    manifest = write_kit(Path(out), ModelConfig(embed=embed, hidden=hidden, layers=layers), seed, force)
    click.echo(f"wrote {manifest.parent}/: manifest.json, {len(STAGES)} stages ({', '.join(STAGES)}) as .npz, "
               f"misreadings.npz, model.onnx, "
               f"check_port.py\ncheck a port: python {manifest.parent / 'check_port.py'} {manifest.parent} PORT_OUTPUTS/")
