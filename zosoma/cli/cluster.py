"""zosoma cluster: the clustering `train --experts N` makes, on its own."""

from __future__ import annotations

from pathlib import Path

import click

from zosoma.cli.options import emit_json, json_option, nonneg, positive


@click.command()
@click.option("--data", multiple=True, type=click.Path(), help="Text to cluster (default: the shipped training corpus).")
@click.option("--experts", "-N", type=int, default=4, show_default=True, callback=positive, help="N: number of clusters.")
@click.option("--chunk-size", type=int, default=2048, show_default=True, callback=positive, help="Bytes per chunk (document).")
@click.option("--unbalanced", is_flag=True, help="Plain k-means instead of balanced cluster sizes.")
@click.option("--seed", type=int, default=0, show_default=True, callback=nonneg)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the clustering (router) to this HDF5 file.")
@json_option
def cluster(data, experts, chunk_size, unbalanced, seed, out, as_json):
    """Cluster the corpus as `train --experts N` does and print each cluster's size and mix of
    sources (domains for the shipped corpus) and the purity against them."""
    from zosoma.config import ClusterConfig
    from zosoma.mixture.cluster import cluster_report, fit_clusters, format_report, purity, save_clustering
    from zosoma.corpus import chunk, load_corpus

    if out and Path(out).exists():
        raise click.ClickException(f"{out} exists; choose another --out")
    chunks = chunk(load_corpus(list(data) or None, split="train"), chunk_size)
    clustering, labels = fit_clusters(chunks, ClusterConfig(n_clusters=experts, balanced=not unbalanced, seed=seed))
    report, score = cluster_report(labels, chunks.names, experts), purity(labels, chunks.names)
    if out:
        save_clustering(out, clustering)
    if as_json:
        emit_json("cluster", {"chunks": len(chunks), "chunk_size": chunk_size, "experts": experts, "seed": seed,
                              "balanced": not unbalanced, "clusters": report, "purity": score,
                              "out": str(out) if out else None})
        return
    click.echo(f"{len(chunks):,} chunks of {chunk_size} bytes into {experts} clusters:")
    click.echo(format_report(report))
    click.echo(f"purity against source names: {score:.3f}")
    if out:
        click.echo(f"wrote {out}")
