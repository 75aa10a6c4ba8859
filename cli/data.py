"""zosoma data: the shipped corpus and the evaluation data."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from zosoma.cli.options import emit_json, json_option


@click.group()
def data():
    """The shipped corpus and evaluation data."""


@data.command("show")
@json_option
def data_show(as_json):
    """Describe the shipped corpus (after verifying its checksums)."""
    from zosoma.corpus import default_corpus_dir, describe, load_corpus
    from zosoma.model.evaluate import ngram_baselines
    corpora = {split: load_corpus(None, split=split) for split in ("train", "heldout")}
    base = ngram_baselines(corpora["train"], corpora["heldout"])
    if as_json:
        emit_json("data-show", {"location": str(default_corpus_dir()), "baselines": {**base, "uniform": math.log(256)},
                                "splits": {split: {"description": describe(c), "documents": [
                                    {"name": n, "bytes": int(d.size)} for n, d in zip(c.names, c.docs)]}
                                    for split, c in corpora.items()}})
        return
    for split, c in corpora.items():
        click.echo(f"{split}: {describe(c)}")
        for name, doc in zip(c.names, c.docs):
            click.echo(f"  {name:<14} {doc.size:>10,} bytes")
    click.echo(f"held-out nats/byte of byte n-gram models counted on train (add-one): unigram "
               f"{base['unigram']:.3f}, bigram {base['bigram']:.3f}; trigram (Witten-Bell) {base['trigram']:.3f}; "
               "uniform 5.545")
    click.echo(f"location: {default_corpus_dir()} (licences in LICENSES/)")


@data.command("download")
@click.argument("name", type=click.Choice(["wikitext-103"]))
@click.option("--dest", type=click.Path(file_okay=False), help="Destination folder (default: ~/.cache/zosoma/wikitext-103).")
@click.option("--url", help="Archive URL or local path (default: the official wikitext-103-raw-v1.zip).")
@click.option("--train", "with_train", is_flag=True, help="Also extract wiki.train.raw (about 540 MB).")
def data_download(name, dest, url, with_train):
    """Download an evaluation data set and verify its sha256."""
    from zosoma.download import WIKITEXT103_URL, download_wikitext103
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, disable=None, file=sys.stderr) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)
        paths = download_wikitext103(dest, url=url or WIKITEXT103_URL, progress=progress, train=with_train)
    for p in paths.values():
        click.echo(f"ok {p}")
