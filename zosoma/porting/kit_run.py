"""The porting kit's whole-run stages: the paper estimator's run (`zosoma train --optimizer sgd`),
shortened, trained on the shipped corpus and scored by the evaluation protocol (`run`), and one
SOMA evaluation from given experts (`routed`).
PORTING.md ("A whole run") is the specification they serve.

The `run` stage's reference figures come from training the run with zosoma (a minute on two
cores): they are measured once and stored in run_reference.json beside this module
(`python -m zosoma.porting.kit_run` measures them again), so writing the kit stays fast;
tests/test_porting_run.py trains the run afresh and checks the stored figures.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, default_corpus_dir, load_corpus
from zosoma.model import reference
from zosoma.model.params import Layout, init_params
from zosoma.mixture.routing import Router, cut_segments, mix_nll, segment_sums
from zosoma.porting.kit_router import TAU, TOP_K, kit_clustering
from zosoma.porting.stage import Out, Stage
from zosoma.training.folder import RunFolder
from zosoma.training.records import Evaluated
from zosoma.strategies.settings import resolve
from zosoma.runs.run import Run, Spec

RUN_STEPS = 300  # the paper estimator's run, shortened: the cosine laid out over these steps
REFERENCE = Path(__file__).with_name("run_reference.json")
# The tolerances, from zosoma's own two engines (Numba, ONNX Runtime): see the stage's "why"
LOSS_ATOL, HELDOUT_ATOL = 2e-3, 0.006


def run_config() -> tuple[ModelConfig, TrainConfig]:
    """The run stage's run: the paper's estimator at the tiny preset (`zosoma train --optimizer
    sgd --steps 300`), resolved as the command resolves it."""
    return resolve("tiny", {"optimizer": "sgd", "steps": RUN_STEPS})


def train_reference(run_dir, **options) -> dict:
    """Train the run stage's run (with TrainConfig `options` changed) in the new folder run_dir:
    {"losses": each step's loss, "heldout": the overall held-out nats/byte, "restarts": n}."""
    model, cfg = run_config()
    results = None
    for r in Run.start(Spec(model, dataclasses.replace(cfg, **options)), run_dir=run_dir):
        if isinstance(r, Evaluated):
            results = r.results
    records = RunFolder(run_dir).read_metrics()
    return {"losses": [float(m["loss"]) for m in records], "heldout": float(results["heldout"]["overall"]),
            "restarts": len(results["restarts"])}


def corpus_sha256s() -> np.ndarray:
    entries = json.loads((default_corpus_dir() / "MANIFEST.json").read_text())
    return np.array([e["sha256_uncompressed"] for s in ("train", "heldout") for e in entries if e["split"] == s])


def run_stage() -> Stage:
    model, cfg = run_config()
    stored = json.loads(REFERENCE.read_text())
    sampler = BatchSampler(load_corpus(None, split="train"), cfg.seq_len + 1)
    doc, start = (np.stack(a) for a in zip(*(sampler.positions(cfg.seed, 0, t, cfg.batch) for t in range(cfg.steps))))
    settings = {"embed": (model.embed, "E"), "hidden": (model.hidden, "H"), "layers": (model.layers, "L"),
                **{k: (getattr(cfg, k), what) for k, what in (
                    ("steps", "the run's length: the cosine is laid out over it"), ("batch", "B"), ("seq_len", "T"),
                    ("perturbations", "P"), ("eps", "the perturbation scale"), ("noise", "the directions' kind"),
                    ("optimizer", "ZO-SGD"), ("lr", "the peak rate"), ("schedule", "after the warm-up"),
                    ("warmup", "warm-up steps"), ("weight_decay", "none"), ("normalize_window", "W"),
                    ("seed", "init, batches, noise"), ("on_divergence", "the reference run took no restart"))},
                "shaping": (",".join(cfg.shaping), "zosoma's default shaping"), "expert": (0, "a single model: stream 0")}
    inputs = {"batch_doc": (doc.astype(np.int64), "(steps, B) int64 each window's train document (manifest order)"),
              "batch_start": (start.astype(np.int64), "(steps, B) int64 each window's first byte in its document"),
              "sha256": (corpus_sha256s(), "the corpus files' sha256 (uncompressed): train, then held-out, manifest order")}
    why_loss = (f"zosoma's Numba and ONNX Runtime engines on this run differ by at most {stored['spread']['losses']:.1e} "
                "(seeds 0-4, results/porting-run.txt): float32 summation orders")
    why_heldout = (f"the two engines' largest held-out gap over the full run, seeds 0-4 (0.006, "
                   f"results/engine-agreement-robust.txt); on this run {stored['spread']['heldout']:.1e}")
    outputs = {
        "losses": Out(np.array(stored["losses"]), "run_losses", tuple(inputs) + ("the shipped corpus",),
                      "each step's loss (mean of the 2P members), training from init(seed, 0) with every default: "
                      "the normalize shaping, the cosine over `steps`, Rademacher noise at (seed, 0, t, k)"),
        "heldout": Out(np.float64(stored["heldout"]), "run_heldout", ("losses",),
                       "the overall held-out nats/byte of the final theta: segments of 256 bytes after 512 bytes "
                       "of context, each from zero state, pooled over every held-out document"),
    }
    tol = {"run_losses": (LOSS_ATOL, 0.0, why_loss), "run_heldout": (HELDOUT_ATOL, 0.0, why_heldout)}
    unshaped = stored["unshaped"]
    misreadings = {"losses": [("trained without shaping (zosoma's default is normalize)", np.array(unshaped["losses"]))],
                   "heldout": [("trained without shaping (zosoma's default is normalize)",
                                np.float64(unshaped["heldout"]))]}
    return Stage("run", f"the paper estimator's run (zosoma train --optimizer sgd) shortened to {cfg.steps} steps on the shipped corpus: every "
                        "step's loss and the held-out nats/byte by the evaluation protocol", inputs, outputs,
                 settings=settings, misreadings=misreadings, tol=tol)


# --- SOMA's evaluation from given experts --------------------------------------------------------

ROUTED_MODEL = ModelConfig(embed=8, hidden=16, layers=1)  # small experts keep the kit small
ROUTED_BYTES, SEGMENT, CONTEXT = 2000, 256, 512  # the first bytes of each held-out document


def routed_stage(seed: int) -> Stage:
    clustering, config = kit_clustering(seed)
    config = config.to_json()
    n = clustering.centroids.shape[0]
    layout = Layout(ROUTED_MODEL)
    experts = np.stack([init_params(ROUTED_MODEL, seed, i) * np.float32(2) for i in range(n)])
    router = Router(clustering, TOP_K, TAU)
    docs = [d[:ROUTED_BYTES] for d in load_corpus(None, split="heldout").docs]
    chosen, weights, nats = [], [], []
    for doc in docs:
        segs = cut_segments(doc, SEGMENT, CONTEXT)
        e, w = router.select(segs.contexts)
        every = np.stack([reference.nll(reference.forward(t.astype(np.float64), layout, segs.tokens)[0], segs.targets)
                          for t in experts])  # (N, S, T) float64
        selected = every[e, np.arange(len(segs))[:, None]]  # (S, K, T)
        nats.append(segment_sums(mix_nll(selected, w), segs.mask()))
        chosen.append(e)
        weights.append(w)
    chosen, weights, nats = np.concatenate(chosen), np.concatenate(weights), np.concatenate(nats)
    scored = sum(len(d) - 1 for d in docs)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    inputs = {"experts": (experts, "(N, d) float32 the experts' weights (stage 0's layout of the settings' model)"),
              "idf": (clustering.idf, "(F,) float32"), "projection": (clustering.projection, "(F, D) float32"),
              "centroids": (clustering.centroids, "(N, D) float32"), "config": (np.array(config), "the featurizer (JSON)"),
              "text": (np.concatenate(docs), "(total,) uint8 held-out documents back to back"),
              "offsets": (offsets, "(n_docs + 1,) int64 document j is text[offsets[j]:offsets[j+1]]"),
              "top_k": (np.int64(TOP_K), "K"), "temperature": (np.float64(TAU), "tau"),
              "segment": (np.int64(SEGMENT), "bytes predicted per segment"),
              "context": (np.int64(CONTEXT), "bytes of context (routing and warm-up) before a segment")}
    settings = {"embed": (ROUTED_MODEL.embed, "E of every expert"), "hidden": (ROUTED_MODEL.hidden, "H"),
                "layers": (ROUTED_MODEL.layers, "L")}
    protocol = ("segment s of a document predicts positions p0 = 1 + 256 s .. min(p0 + 256, n) - 1 after the context "
                "from max(p0 - 512, 0); documents in order, segments in order")
    outputs = {
        "segment_experts": Out(chosen, "experts", ("text", "offsets", "segment", "context", "idf", "projection",
                                                   "centroids", "config", "top_k"),
                               "the router (stage 9) on each segment's context bytes; " + protocol),
        "segment_weights": Out(weights, "weights", ("segment_experts (kit's)", "temperature"),
                               "softmax(-d / tau) over the K chosen"),
        "segment_nats": Out(nats, "segment_nats", ("experts", "segment_experts (kit's)", "segment_weights (kit's)"),
                            "each chosen expert from zero state over the context and the segment; the mixture's nats "
                            "-ln sum_k w_k exp(-nats_k) at each scored position, summed over the segment's positions"),
        "routed": Out(np.float64(nats.sum() / scored), "loss", ("segment_nats",),
                      f"the sum of every segment's nats / the scored bytes (n - 1 per document: {scored})"),
    }
    tol = {"segment_nats": (2e-3, 1e-5, "float32 nats of up to 256 positions summed (1e-4 each at most, stage 2)")}
    return Stage("routed", "one SOMA evaluation from given experts: segments, routing of each context, the "
                           "experts' nats, the mixture, nats/byte", inputs, outputs, settings=settings, tol=tol)


def measure(out=sys.stdout) -> dict:
    """Train the run stage's run (and the same without shaping) and write run_reference.json,
    keeping the engines' spread already recorded there (results/porting-run.txt measures it)."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = train_reference(Path(tmp) / "run")
        ref["unshaped"] = train_reference(Path(tmp) / "unshaped", shaping=())
    old = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    ref["spread"] = old.get("spread", {"losses": 0.0, "heldout": 0.0})
    REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"run: held-out {ref['heldout']:.4f}; without shaping {ref['unshaped']['heldout']:.4f}", file=out)
    return ref


if __name__ == "__main__":
    measure()
