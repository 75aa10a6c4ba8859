"""ONNX export of a run: a single model, one SOMA expert, or a whole SOMA run with its router.

A single model or one expert's folder (RUN/expertI) becomes one .onnx file
(zosoma.formats.onnx). A whole SOMA run becomes a folder:

    OUT/manifest.json   format "zosoma-onnx-soma", version 1: the experts' files and model shapes,
                        top_k and temperature, the router file and the featurizer's settings,
                        and under "files" the names of every file below (itself included)
    OUT/expert{i}.onnx  expert i, in the chosen form (each checked with onnx.checker)
    OUT/router.npz      the router (zosoma.mixture.cluster / routing; PORTING.md, "Router"):
                          idf         (F,) float32   smoothed idf of every hash bucket
                          projection  (F, D) float32 tf-idf row -> embedding (then L2-normalise)
                          centroids   (N, D) float32 one per expert, in expert order
                          config      JSON text: ngram_min, ngram_max, n_features (F = 2^bits),
                                      sublinear_tf, svd_dim (D), ... (ClusterConfig)
                        features of a context: FNV-1a hashes of its byte n-grams, xor-folded to
                        F buckets, counted; tf = 1 + ln(count); times idf; L2-normalised
                        weights: d_i = |e - c_i|^2, w = softmax(-d / T) over the top_k nearest,
                        an all-zero embedding gets 1/top_k on the top_k centroids nearest 0

The manifest's "files" lists the files zosoma owns in OUT. The folder is built aside and moved in
(zosoma.porting.output_folder): a reader who finds a manifest finds all of its files, and --force
replaces the files of an earlier export, leaving anything else in OUT alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.errors import ConfigError
from zosoma.formats.checkpoint import load_checkpoint
from zosoma.formats.onnx import export_onnx
from zosoma.model.params import Layout
from zosoma.porting.output_folder import MANIFEST, output_folder
from zosoma.runs.folder import RunFolder, checkpoint_path
from zosoma.mixture.cluster import load_clustering

SOMA_FORMAT, SOMA_VERSION = "zosoma-onnx-soma", 1
ROUTER = "router.npz"
TEMPERATURE = 0.1  # c-BTM's routing temperature, the one `zosoma eval` and training use


def _shape(model) -> str:
    return f"E={model.embed} H={model.hidden} L={model.layers}"


def export_run(run, out, form: str = "lstm", seq_len: int | None = None, force: bool = False,
               fallback: bool = False) -> list[str]:
    """Export a checkpoint file, a run folder, one expert's folder or a SOMA run folder to `out`
    (a .onnx file, or a folder for a SOMA run). Returns lines describing what was written."""
    out, folder = Path(out), RunFolder(run)
    if not folder.is_soma:
        if out.exists() and not force:
            raise ConfigError(f"{out} exists; pass --force to overwrite it")
        ckpt = load_checkpoint(checkpoint_path(run, fallback=fallback))
        layout = Layout(ckpt.model)
        if out.is_dir():
            raise ConfigError(f"{out} is a folder; a single model is exported to a file")
        export_onnx(ckpt.theta, layout, out, form, seq_len)
        return [f"wrote {out}: ONNX ({form}) of {run}, step {ckpt.step}, {_shape(ckpt.model)}, "
                f"{layout.size:,} parameters"]
    soma = folder.read_soma()
    n = soma["experts"]
    clustering = load_clustering(folder.router)
    ckpts = [folder.expert(i).read_checkpoint(fallback=fallback) for i in range(n)]
    files = sorted([f"expert{i}.onnx" for i in range(n)] + [ROUTER, MANIFEST])
    with output_folder(out, files, SOMA_FORMAT, force, "ONNX export") as tmp:
        for i, ckpt in enumerate(ckpts):
            export_onnx(ckpt.theta, Layout(ckpt.model), tmp / f"expert{i}.onnx", form, seq_len)
        with atomic_path(tmp / ROUTER, "router") as path, open(path, "wb") as f:
            np.savez(f, idf=clustering.idf, projection=clustering.projection, centroids=clustering.centroids,
                     config=np.array(clustering.config.to_json()))
        manifest = {"format": SOMA_FORMAT, "format_version": SOMA_VERSION, "form": form, "seq_len": seq_len,
                    "experts": [{"file": f"expert{i}.onnx", "step": c.step, "embed": c.model.embed,
                                 "hidden": c.model.hidden, "layers": c.model.layers} for i, c in enumerate(ckpts)],
                    "top_k": soma["top_k"], "temperature": TEMPERATURE, "router": ROUTER,
                    "featurizer": json.loads(clustering.config.to_json()),
                    "spec": "zosoma.porting.export_run and PORTING.md, 'Router'", "files": files}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2), "manifest")
    return [f"wrote {out}/: {n} experts as ONNX ({form}), router.npz ({clustering.n_clusters} centroids, "
            f"{clustering.config.n_features} features, {clustering.config.svd_dim} dims) and manifest.json"]
