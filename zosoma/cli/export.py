"""zosoma export: a checkpoint as a PyTorch state_dict or ONNX."""

from __future__ import annotations

import click

from zosoma.cli.options import positive, previous_option


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["torch", "onnx"]), default="torch", show_default=True)
@click.option("--out", "out", type=click.Path(), required=True, help="Output file (model.pt, model.onnx), or a folder for a SOMA run as ONNX; an existing one is not overwritten without --force.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists (never a run's own files: a checkpoint, metrics.jsonl, results.json, ... in a run folder). A SOMA run's folder: only the files an earlier export wrote there (its manifest.json lists them) are replaced; anything else in it is left alone, and a file of the user's with a name the export uses stops it before anything changes.")
@click.option("--unrolled", is_flag=True, help="ONNX: the cell as MatMul/Add/Sigmoid/Tanh/Mul, unrolled over --seq-len steps, for runtimes without an LSTM operator.")
@click.option("--seq-len", type=int, callback=positive, help="ONNX --unrolled: the time steps of the graph.  [default: 64]")
@previous_option
def export(checkpoint, fmt, out, force, unrolled, seq_len, previous):
    """Write a checkpoint's weights as a PyTorch state_dict for nn.Embedding + nn.LSTM + nn.Linear
    (modules named embedding, lstm, linear; batch_first=True), or as ONNX (--format onnx): the
    standard LSTM operator with h0/c0 in and hT/cT out, for a single model, one SOMA expert
    (RUN/expertI), or a whole SOMA run (a folder: one graph per expert, router.npz, manifest.json;
    see PORTING.md)."""
    from zosoma.porting.export_run import export_run, export_torch_run

    if fmt != "onnx" and (unrolled or seq_len):
        raise click.UsageError("--unrolled and --seq-len are options of --format onnx")
    if seq_len and not unrolled:
        raise click.UsageError("--seq-len sets the steps of an --unrolled graph (the LSTM operator takes any length)")
    if fmt == "onnx":
        lines = export_run(checkpoint, out, "unrolled" if unrolled else "lstm", (seq_len or 64) if unrolled else None,
                           force=force, fallback=previous)
    else:
        lines = export_torch_run(checkpoint, out, force=force, fallback=previous)
    for line in lines:
        click.echo(line)
