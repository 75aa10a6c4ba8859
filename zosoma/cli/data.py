"""zosoma data: the shipped corpus and the evaluation data."""

from __future__ import annotations

import math
import sys

import click

from zosoma.cli import render
from zosoma.cli.options import emit_json, json_option, positive
from zosoma.model.protocol import PROTOCOL


@click.group()
def data():
    """The shipped corpus and evaluation data."""


@data.command("show")
@json_option
def data_show(as_json):
    """Describe the shipped corpus (after verifying its checksums)."""
    from zosoma.corpus import default_corpus_dir, describe, load_corpus
    from zosoma.yardsticks import ngram_baselines
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
    click.echo("Kneser-Ney n-grams to order 8 and compressors on the same bytes: zosoma data yardsticks")
    click.echo(f"location: {default_corpus_dir()} (licences in LICENSES/)")


def _orders(ctx, param, value):
    from zosoma.errors import ConfigError
    from zosoma.yardsticks import check_orders
    try:
        return check_orders([int(v) for v in value.split(",")])
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected orders separated by commas, e.g. 4,5,8") from None
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None


@data.command("yardsticks")
@click.option("--orders", default="4,5,8", show_default=True, callback=_orders, help="Kneser-Ney n-gram orders to report, 1 to 8, separated by commas.")
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder); found automatically when downloaded.")
@click.option("--segment", type=int, default=PROTOCOL.segment, show_default=True, callback=positive, help="Bytes predicted per segment.")
@click.option("--context", type=int, default=PROTOCOL.context, show_default=True, callback=positive, help="Bytes before each segment a yardstick may read.")
@click.option("--no-cache", is_flag=True, help="Measure again, neither reading nor writing the cache.")
@click.option("--ship", is_flag=True, help="Also write the records beside the shipped corpus (data/corpus/yardsticks/ in a source checkout), where every evaluation table finds them.")
@json_option
def data_yardsticks(orders, wikitext, segment, context, no_cache, ship, as_json):
    """Held-out nats/byte of byte n-grams counted on the train split (Witten-Bell 3-gram,
    Kneser-Ney) and of zlib, bz2 and xz, by the segment protocol every results table uses, per
    domain and on WikiText-103. The first run takes about a minute; the figures are then cached
    (~/.cache/zosoma/yardsticks; the shipped corpus's ship with it), and `zosoma eval` and
    `zosoma train` print them under their tables."""
    from zosoma.yardsticks import shipped
    found = shipped(orders, segment, context, wikitext, cache=not no_cache, ship=ship)
    held, wiki = found["heldout"], found.get("wikitext103")
    if as_json:
        emit_json("data-yardsticks", {
            "segment": segment, "context": context, "orders": list(orders), "train": held.train, "heldout": held.nats,
            "wikitext103": wiki and {key: wiki.overall(key) for key in wiki.nats}})
        return
    click.echo(f"nats/byte, segments of {segment} bytes after {context} bytes of context; n-grams counted on the "
               f"train split: {held.train}")
    click.echo(render.yardsticks_table(held, wiki))
    if wiki is None:
        click.echo("WikiText-103: not found (zosoma data download wikitext-103, or --wikitext PATH)")


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
