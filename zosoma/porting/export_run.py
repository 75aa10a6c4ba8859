"""Export of a run: ONNX of a single model, one SOMA expert, or a whole SOMA run with its router;
a torch state_dict of a single model or one SOMA expert.

A single model or one expert's folder (RUN/expertI) becomes one .onnx file
(zosoma.formats.onnx) or one torch state_dict (zosoma.formats.torch_state); a model whose
training gave up on it (dropped) is exported as it was left, with a warning. A whole SOMA run
becomes, as ONNX, a folder:

    OUT/manifest.json   format "zosoma-onnx-soma", version 2: the experts' files and model shapes,
                        the routing the run is evaluated with (top_k, temperature, dropped: the
                        same as `zosoma eval` of the run), the router file and the featurizer's
                        settings, and under "files" the names of every file below (itself included)
    OUT/expert{i}.onnx  expert i, in the chosen form (each checked with onnx.checker); a dropped
                        expert's too, its entry marked "dropped": true, so indices stay those of
                        the centroids
    OUT/router.npz      the router (zosoma.mixture.cluster / routing; PORTING.md, "Router"):
                          idf         (F,) float32   smoothed idf of every hash bucket
                          projection  (F, D) float32 tf-idf row -> embedding (then L2-normalise)
                          centroids   (N, D) float32 one per expert, in expert order
                          top_k       () int64       K, experts mixed per segment (at most the
                                                     experts not dropped)
                          temperature () float64     T
                          dropped     (n,) int64     experts the run dropped: never routed to
                          config      JSON text: ngram_min, ngram_max, n_features (F = 2^bits),
                                      sublinear_tf, svd_dim (D), ... (ClusterConfig)
                        features of a context: FNV-1a hashes of its byte n-grams, xor-folded to
                        F buckets, counted; tf = 1 + ln(count); times idf; L2-normalised
                        weights: d_i = |e - c_i|^2 over the experts not dropped,
                        w = softmax(-d / T) over the top_k nearest; an all-zero embedding gets
                        1/top_k on the top_k (not dropped) centroids nearest 0

Version 1 had no dropped experts and the run's top_k even when drops left fewer experts.
A run whose every expert was dropped has nothing to route to and is refused.

The manifest's "files" lists the files zosoma owns in OUT. The folder is built aside and moved in
(zosoma.porting.output_folder): a reader who finds a manifest finds all of its files, and --force
replaces the files of an earlier export, leaving anything else in OUT alone. No export is written
over a run's own files, --force or not (zosoma.training.folder.refuse_run_files).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.errors import ConfigError
from zosoma.formats.checkpoint import load_checkpoint
from zosoma.formats.onnx import export_onnx
from zosoma.formats.torch_state import export_torch
from zosoma.model.params import Layout
from zosoma.porting.output_folder import MANIFEST, output_folder
from zosoma.training.folder import checkpoint_path, refuse_run_files, warn_if_training
from zosoma.runs.run import Run
from zosoma.runs.soma import DroppedExperts, dropped_of, router_of

SOMA_FORMAT, SOMA_VERSION = "zosoma-onnx-soma", 2  # 2: dropped experts, top_k over those left
ROUTER = "router.npz"


def _shape(model) -> str:
    return f"E={model.embed} H={model.hidden} L={model.layers}"


def export_run(run, out, form: str = "lstm", seq_len: int | None = None, force: bool = False,
               fallback: bool = False) -> list[str]:
    """Export a checkpoint file, a run folder, one expert's folder or a SOMA run folder to `out`
    (a .onnx file, or a folder for a SOMA run). Returns lines describing what was written."""
    out = Path(out)
    refuse_run_files(out, "export")
    opened = Run.open(run)
    if not opened.is_soma:
        if out.exists() and not force:
            raise ConfigError(f"{out} exists; pass --force to overwrite it")
        ckpt = _read_model(run, fallback)
        layout = Layout(ckpt.model)
        if out.is_dir():
            raise ConfigError(f"{out} is a folder; a single model is exported to a file")
        export_onnx(ckpt.theta, layout, out, form, seq_len)
        return [f"wrote {out}: ONNX ({form}) of {run}, step {ckpt.step}, {_shape(ckpt.model)}, "
                f"{layout.size:,} parameters"]
    folder, soma = opened.folder, opened.shape
    n = soma.experts
    ckpts = [folder.expert(i).read_checkpoint(fallback=fallback) for i in range(n)]
    warn_if_training(run, [c.step for c in ckpts])
    router = router_of(folder, ckpts, soma.top_k)  # the routing the run is evaluated with
    clustering = router.clustering
    files = sorted([f"expert{i}.onnx" for i in range(n)] + [ROUTER, MANIFEST])
    with output_folder(out, files, SOMA_FORMAT, force, "ONNX export") as tmp:
        for i, ckpt in enumerate(ckpts):
            export_onnx(ckpt.theta, Layout(ckpt.model), tmp / f"expert{i}.onnx", form, seq_len)
        with atomic_path(tmp / ROUTER, "router") as path, open(path, "wb") as f:
            np.savez(f, idf=clustering.idf, projection=clustering.projection, centroids=clustering.centroids,
                     top_k=np.int64(router.top_k), temperature=np.float64(router.temperature),
                     dropped=np.array(router.dropped, np.int64), config=np.array(clustering.config.to_json()))
        manifest = {"format": SOMA_FORMAT, "format_version": SOMA_VERSION, "form": form, "seq_len": seq_len,
                    "experts": [{"file": f"expert{i}.onnx", "step": c.step, "embed": c.model.embed,
                                 "hidden": c.model.hidden, "layers": c.model.layers, "dropped": i in router.dropped}
                                for i, c in enumerate(ckpts)],
                    "top_k": router.top_k, "temperature": router.temperature, "dropped": list(router.dropped),
                    "router": ROUTER, "featurizer": json.loads(clustering.config.to_json()),
                    "spec": "zosoma.porting.export_run and PORTING.md, 'Router'", "files": files}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2), "manifest")
    dropped = f", experts {list(router.dropped)} dropped" if router.dropped else ""
    return [f"wrote {out}/: {n} experts as ONNX ({form}), router.npz ({clustering.n_clusters} centroids, "
            f"{clustering.config.n_features} features, {clustering.config.svd_dim} dims, top-{router.top_k}"
            f"{dropped}) and manifest.json"]


def export_torch_run(run, out, force: bool = False, fallback: bool = False) -> list[str]:
    """Export a checkpoint file, a run folder or one expert's folder as a torch state_dict to the
    file `out` (a SOMA run folder is refused: one expert at a time). Returns lines describing it."""
    out = Path(out)
    refuse_run_files(out, "export")
    opened = Run.open(run)
    if opened.is_soma:
        raise ConfigError(_one_expert(opened, fallback))
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it")
    ckpt = _read_model(run, fallback)
    export_torch(ckpt.theta, Layout(ckpt.model), out)
    m = ckpt.model
    return [f"wrote {out}: torch state_dict for Embedding(256, {m.embed}), "
            f"LSTM({m.embed}, {m.hidden}, num_layers={m.layers}, batch_first=True), Linear({m.hidden}, 256)"]


def _read_model(run, fallback: bool):
    """The checkpoint of a single model or one expert, with a warning when training dropped it."""
    ckpt = load_checkpoint(checkpoint_path(run, fallback=fallback))
    warn_if_training(run, [ckpt.step])
    dropped = ckpt.extra.get("dropped")
    if dropped:
        warnings.warn(f"{run} was dropped at step {dropped['step']} ({dropped['verdict']}): training gave up on it "
                      "and a SOMA run never routes to it; it is exported as it was left", DroppedExperts, stacklevel=3)
    return ckpt


def _one_expert(run: Run, fallback: bool) -> str:
    """Why a SOMA run is not exported whole to torch: its experts to export, one at a time."""
    folder, n = run.folder, run.shape.experts
    dropped = dropped_of([folder.expert(i).read_checkpoint(fallback=fallback) for i in range(n)])
    if len(dropped) == n:
        return f"{folder}: every expert was dropped (they all diverged): nothing to export"
    names = ", ".join(f"expert{i}" for i in dropped)
    return (f"{folder} is a SOMA run: export one expert, {folder.expert(0)} .. expert{n - 1}"
            + (f" ({names} dropped: routing leaves {'it' if len(dropped) == 1 else 'them'} out)" if dropped else ""))
