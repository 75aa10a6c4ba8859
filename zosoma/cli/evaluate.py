"""zosoma eval: nats/byte of a checkpoint, a run folder or a SOMA run."""

from __future__ import annotations

import click

from zosoma.cli import render
from zosoma.cli.options import (Checked, device_ops, device_option, emit_json, gemm_option, json_option,
                                previous_option, usage_errors, warn_about_results)
from zosoma.model.protocol import PROTOCOL


@click.command("eval")
@click.argument("checkpoint", type=click.Path())
@click.option("--data", multiple=True, type=click.Path(), help="Files or folders to evaluate (default: the shipped held-out slices).")
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder); found automatically when downloaded.")
@click.option("--streams", type=Checked(), help="Single model: score each whole file statefully in this many side-by-side parts (1 = one pass) instead of the segment protocol every table uses.")
@click.option("--top-k", type=Checked(), help=f"SOMA run: experts mixed per segment.  [default: {PROTOCOL.top_k}]")
@click.option("--temperature", type=Checked("number"), help="SOMA run: routing temperature T in softmax(-d^2 / T).  [default: 0.1]")
@click.option("--segment", type=Checked(), default=PROTOCOL.segment, show_default=True, help="Bytes predicted per segment (and per routing decision).")
@click.option("--context", type=Checked(), default=PROTOCOL.context, show_default=True, help="Bytes before each segment used for warm-up (and routing).")
@previous_option
@device_option
@gemm_option
@json_option
def eval_(checkpoint, data, wikitext, streams, top_k, temperature, segment, context, previous, device, gemm, as_json):
    """Nats/byte on held-out text and WikiText-103 of a checkpoint, a run folder, or a SOMA run
    folder (routed ensemble, each expert alone, and oracle routing)."""
    from zosoma.corpus import load_corpus
    from zosoma.download import check_wikitext103
    from zosoma.runs.run import Run
    from zosoma.runs.run_options import eval_options
    from zosoma.yardsticks import lookup

    run = Run.open(checkpoint)
    with usage_errors():
        checked = eval_options(run, streams, top_k, temperature, segment, context)
    ops = device_ops(device, gemm)
    corpus = load_corpus(list(data) if data else None, split="heldout")
    wikitext = check_wikitext103(wikitext)  # as train: a file that is not the official one says so
    scored = "the --data files" if data else None
    warn_about_results(checkpoint)
    r = run.evaluate(corpus, wikitext, ops=ops, fallback=previous, **checked)
    if as_json:
        emit_json("eval", {"run": str(checkpoint), **r})
        return
    if not run.is_soma:
        click.echo(f"{checkpoint}: step {r['step']}, {r['n_params']:,} parameters")
    click.echo(render.results(r, {} if streams else lookup(corpus, wikitext, segment, context), scored))
