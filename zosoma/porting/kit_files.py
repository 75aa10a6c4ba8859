"""The porting kit's files beside its stages: the two ONNX graphs of the kit's model (`model.onnx`,
weights inside; `train_model.onnx`, theta an input, as `zosoma train --engine onnxruntime` runs it),
the default run's batch indices (so a host without Python reproduces `zosoma train`'s batches), and
the kit's README. The graphs need the onnx package; without it the kit is written without them and
its manifest says so (`skipped`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zosoma.errors import ZosomaError
from zosoma.formats.onnx import build_model, build_training_model, require_onnx, save_model
from zosoma.model.params import Layout
from zosoma.porting.kit_default_run import batch_indices
from zosoma.training.stepper import stream
from zosoma.strategies.settings import resolve

MODEL, TRAIN_MODEL = "model.onnx", "train_model.onnx"
BATCHES, README = "default_run_batches.npz", "README.md"
INSTALL = "pip install 'zosoma[onnx]'"


def onnx_missing() -> str | None:
    """Why the ONNX graphs cannot be written here (one line with the install line), or None."""
    try:
        require_onnx()
    except ZosomaError:
        return f"the onnx package is not installed ({INSTALL})"
    return None


def graph_files() -> list[str]:
    """The graphs' file names, or none without the onnx package."""
    return [] if onnx_missing() else [MODEL, TRAIN_MODEL]


def write_graphs(folder: Path, theta: np.ndarray, layout: Layout) -> dict:
    """Write both graphs into `folder` (when onnx is installed); returns their manifest entry."""
    entry = {
        MODEL: "the kit's model (its weights, init(seed, 0) x 2, inside) as stage 1's standard-LSTM graph: inputs "
               "tokens (B, T) int64, h0, c0 (L, B, H) float32; outputs logits (B, T, 256), hT, cT",
        TRAIN_MODEL: {"what": "the training graph: theta an input, the graph slices it and builds the LSTM's "
                              "weights itself (PORTING.md, 'Training through an inference-only runtime')",
                      "inputs": "theta (d,) float32, tokens (B, T) int64, targets (B, T) int64, h0, c0 (L, B, H) "
                                "float32",
                      "outputs": "nll (B, T) float32, loss (a scalar, the mean of nll), hT, cT",
                      "check": "feed losses.npz's theta, tokens = batch[:, :-1], targets = batch[:, 1:] and zero h0, "
                               "c0: nll and loss are losses.npz's nll and loss, within that stage's tolerances"}}
    if not onnx_missing():
        save_model(build_model(theta, layout), folder / MODEL)
        save_model(build_training_model(layout), folder / TRAIN_MODEL)
    return entry


def write_batches(folder: Path, save) -> dict:
    """The default single run's batch indices (`zosoma train`, seed 0: every step on stream 0, and on
    stream 65536, a first restart's) into BATCHES with `save`; returns its manifest entry."""
    _, cfg = resolve("tiny", {})
    streams = [stream(0, 0), stream(0, 1)]
    doc, start = batch_indices(cfg, streams)
    save(folder / BATCHES, {"batch_doc": doc, "batch_start": start, "streams": np.array(streams, np.int64),
                            "seed": np.int64(cfg.seed),
                            "B": np.int64(cfg.batch), "T": np.int64(cfg.seq_len), "steps": np.int64(cfg.steps)})
    return {"file": BATCHES,
            "what": f"the batches of zosoma train's default run (seed {cfg.seed}, {cfg.steps:,} steps of B = "
                    f"{cfg.batch} windows of T + 1 = {cfg.seq_len + 1} bytes): batch_doc, batch_start "
                    f"({len(streams)}, steps, B) int64, each window's train document (manifest order) and first "
                    "byte, on the streams in `streams` (0, and 65536: a first restart's); a host that does not "
                    "reproduce NumPy's generator reads its batches here (PORTING.md, 'Batches outside Python')"}


def readme(manifest: dict) -> str:
    """The kit folder's README.md: what the kit is, how to check a port, every file and stage."""
    m = manifest["model"]
    stages = "\n".join(f"- `{s['file']}`: {s['what']}" for s in manifest["stages"])
    skipped = "".join(f"\n**Not written here**: {s}\n" for s in manifest.get("skipped", ()))
    return f"""# zosoma porting kit

The conformance vectors a port of zosoma (zero-order LSTM training) must reproduce, stage by stage.
The specification is PORTING.md in the zosoma repository (zosoma {manifest['zosoma_version']}).

This kit: format {manifest['format_version']}, seed {manifest['seed']}, a model of E = {m['embed']}, \
H = {m['hidden']}, L = {m['layers']} ({m['parameters']:,} parameters); the whole-run stages use the `tiny` \
preset's model, as their settings say.

## Checking a port

For each stage, read its inputs (and the kit's values its outputs' `from` lists name) from
`<stage>.npz`, write your outputs under the same names and shapes to `PORT/<stage>.npz`
(`numpy.savez`), then run the standalone checker (plain NumPy):

```bash
python check_port.py . PORT/                 # every stage the port wrote
python check_port.py . PORT/ --strict        # a stage or output not written fails (optional ones aside)
python check_port.py . PORT/ --stage run_restart
```

`manifest.json` holds, per stage, its settings, its inputs and per output the tolerance, why, what
it is computed from and the hint printed when it fails. An input another output of the KIT
stands in for (teacher forcing) is named "(kit's)" in its `from` list.
{skipped}
## Files

- `manifest.json`, `check_port.py`, `misreadings.npz` (wrong readings the checker names)
- `{MODEL}`: {manifest['graphs'][MODEL]}
- `{TRAIN_MODEL}`: {manifest['graphs'][TRAIN_MODEL]['what']}; {manifest['graphs'][TRAIN_MODEL]['check']}
- `{BATCHES}`: {manifest['default_run_batches']['what']}

## Stages, in the order a port is best written

{stages}
"""
