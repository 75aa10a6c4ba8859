"""The porting kit: the vectors a port of zosoma to other hardware must reproduce, stage by stage.

`write_kit(out)` writes (the specification of every stage is PORTING.md at the repository root):

    OUT/manifest.json   format "zosoma-porting-kit" v1; the model's layout; per stage its file,
                        what it checks, its input names and its outputs with their tolerances
                        (atol, rtol) and why
    OUT/forward.npz     embedding, gate pre-activations, activations, cell, hidden and logits
                        of every step and layer, for given weights, bytes and carried state
    OUT/losses.npz      per-byte nats and the mean loss of a batch
    OUT/noise.npz       Philox words and Rademacher and Gaussian perturbations of given
                        (seed, expert, step, member) counters
    OUT/spsa_step.npz   one complete SPSA step: the 2P losses, the P scalars, the updated theta
    OUT/router.npz      the router's n-gram counts, tf-idf features, embeddings, distances,
                        experts and weights for given contexts
    OUT/model.onnx      the kit's model as the standard-LSTM ONNX graph (zosoma.formats.onnx)
    OUT/check_port.py   the standalone checker (plain NumPy): python check_port.py OUT PORT/

The manifest's "files" lists these eight, the files zosoma owns in OUT: `--force` replaces them
and leaves anything else in OUT alone.

Reference values are computed in float64 (the NumPy reference of zosoma.model.reference, run in
float64 on the float32 weights), so every tolerance measures only what a float32 port may differ
by. Each stage's inputs are the kit's own, so errors never compound from stage to stage: the
update is checked from the kit's scalars, not the port's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zosoma import __version__
from zosoma.atomic import atomic_path, atomic_write
from zosoma.config import VOCAB, ModelConfig
from zosoma.corpus import Corpus, chunk, load_corpus
from zosoma.errors import ConfigError
from zosoma.formats.onnx import build_model, save_model
from zosoma.model import reference
from zosoma.model.noise import noise, philox4x32_10, stream_key
from zosoma.model.params import Layout, init_params
from zosoma.porting.output_folder import MANIFEST, output_folder
from zosoma.mixture.cluster import ClusterConfig, fit_clusters
from zosoma.mixture.routing import Router

KIT_FORMAT, KIT_VERSION = "zosoma-porting-kit", 1
CHECKER = Path(__file__).with_name("check_port.py")
MODEL = "model.onnx"

# Tolerances for a float32 port against the float64 reference (atol, rtol, why). zosoma's own
# float32 paths run as a port (a float32 forward, ONNX Runtime on model.onnx, the Numba forward,
# the CPU engine's SPSA step, the router) stay under 1/20 of every one (tests/test_porting.py).
F32_SUMS = "float32 rounding of dot products over E + H terms (about sqrt(K) ulps) and of exp/tanh"
TOL = {
    "embedded": (0.0, 0.0, "a row gather of the float32 weights: exact"),
    "gates": (2e-5, 1e-5, F32_SUMS),
    "activations": (1e-5, 1e-5, "sigmoid/tanh of the gates: bounded by the gates' error"),
    "cells": (2e-5, 1e-5, "f c + i g accumulated over the steps; a few ulps per step"),
    "hidden": (1e-5, 1e-5, "o tanh(c): bounded by c's error"),
    "logits": (5e-5, 1e-5, "a dot product over H terms plus the bias, then carried error of h"),
    "state": (2e-5, 1e-5, "the last step's h and c"),
    "nll": (1e-4, 1e-5, "log-softmax over 256 logits in float32 (the log-sum-exp's rounding)"),
    "loss": (2e-5, 1e-6, "the mean of the per-byte nats; accumulate it in float64 or pairwise"),
    "bits": (0, 0, "integers: Philox words and Rademacher signs must match bit for bit"),
    "gaussian": (5e-4, 1e-6, "Box-Muller in float32 agrees to a few ulps except where u1 rounds to 1 "
                             "(first word within 128 of 2^32): r = 0 instead of up to 2.4e-4; "
                             "float64 rounded to float32 agrees to 1e-6 everywhere"),
    "scalars": (2e-2, 1e-5, "(L+ - L-) / (2 eps): the losses' atol 2e-5 times 2 / (2 eps) = 1000; "
                            "this is why eps must stay well above the loss's rounding noise"),
    "update": (1e-6, 1e-6, "theta - lr (1/P) sum_k g_k delta_k from the kit's scalars: float32 rounding"),
    "counts": (0, 0, "hashed n-gram counts (FNV-1a, integers): exact"),
    "features": (1e-6, 1e-5, "tf-idf rows, L2-normalised, float32"),
    "embeddings": (1e-5, 1e-5, "a sparse dot product over the n-grams of the context, normalised"),
    "distances": (2e-5, 1e-5, "squared distances of unit vectors to the centroids"),
    "experts": (0, 0, "the top-k by distance (the kit's contexts have no near-ties)"),
    "weights": (1e-5, 1e-5, "softmax(-d / T) over the top-k, T = 0.1: d's error times 10"),
}


def _outputs(names: dict) -> dict:
    """{output name: tolerance key} -> the manifest's {name: {atol, rtol, why}}."""
    return {n: dict(zip(("atol", "rtol", "why"), TOL[k])) for n, k in names.items()}


def kit_model(config: ModelConfig, seed: int) -> tuple[np.ndarray, Layout]:
    """The kit's weights: the seeded initialisation times 2, so gates reach their nonlinear range
    and predictions are far from uniform (an error then shows)."""
    layout = Layout(config)
    return (init_params(config, seed) * 2).astype(np.float32), layout


def forward_stage(theta, layout: Layout, rng) -> tuple[dict, dict, dict]:
    """(inputs, outputs, output tolerance keys): every intermediate value of the forward, float64,
    with a carried-in state. Output layouts: embedded (B, T, E); gates{l}, activations{l}
    (B, T, 4H) in blocks i, f, g, o (activations: sigmoid, sigmoid, tanh, sigmoid); cells{l},
    hidden{l} (B, T, H); logits (B, T, V); hT, cT (L, B, H)."""
    cfg = layout.config
    B, T, H, L = 3, 12, cfg.hidden, cfg.layers
    tokens = rng.integers(0, VOCAB, (B, T), dtype=np.uint8)
    h0 = (0.5 * rng.standard_normal((L, B, H))).astype(np.float32)
    c0 = rng.standard_normal((L, B, H)).astype(np.float32)
    p = layout.views(theta.astype(np.float64))
    x = p["embed"][tokens]
    out, keys = {"embedded": x}, {"embedded": "embedded"}
    hT, cT = [], []
    for layer in range(L):
        h, c = h0[layer].astype(np.float64), c0[layer].astype(np.float64)
        gates, acts = np.empty((B, T, 4 * H)), np.empty((B, T, 4 * H))
        cells, hidden = np.empty((B, T, H)), np.empty((B, T, H))
        for t in range(T):
            z = x[:, t] @ p[f"lstm{layer}.w_ih"] + h @ p[f"lstm{layer}.w_hh"] + p[f"lstm{layer}.bias"]
            a = np.concatenate([reference.sigmoid(z[:, :2 * H]), np.tanh(z[:, 2 * H:3 * H]),
                                reference.sigmoid(z[:, 3 * H:])], axis=1)
            c = a[:, H:2 * H] * c + a[:, :H] * a[:, 2 * H:3 * H]
            h = a[:, 3 * H:] * np.tanh(c)
            gates[:, t], acts[:, t], cells[:, t], hidden[:, t] = z, a, c, h
        out.update({f"gates{layer}": gates, f"activations{layer}": acts, f"cells{layer}": cells,
                    f"hidden{layer}": hidden})
        keys.update({f"gates{layer}": "gates", f"activations{layer}": "activations", f"cells{layer}": "cells",
                     f"hidden{layer}": "hidden"})
        hT.append(h)
        cT.append(c)
        x = hidden
    out.update(logits=x @ p["out.w"] + p["out.b"], hT=np.stack(hT), cT=np.stack(cT))
    keys.update(logits="logits", hT="state", cT="state")
    state = [(h0[layer].astype(np.float64), c0[layer].astype(np.float64)) for layer in range(L)]
    check, _ = reference.forward(theta.astype(np.float64), layout, tokens, state)
    assert np.allclose(check, out["logits"], rtol=1e-12, atol=1e-12)  # one forward, two readings
    return {"theta": theta, "tokens": tokens, "h0": h0, "c0": c0}, out, keys


def loss_stage(theta, layout: Layout, rng) -> tuple[dict, dict, dict]:
    batch = rng.integers(0, VOCAB, (4, 25), dtype=np.uint8)
    logits, _ = reference.forward(theta.astype(np.float64), layout, batch[:, :-1])
    nll = reference.nll(logits, batch[:, 1:])
    return {"theta": theta, "batch": batch}, {"nll": nll, "loss": np.float64(nll.mean())}, \
        {"nll": "nll", "loss": "loss"}


NOISE_COUNTERS = [(0, 0, 0, 0), (1234, 2, 7, 3), (2**33 + 5, 1, 100, 31), (2**63 + 17, 7, 123456, 1023)]
NOISE_LENGTH = 300  # more than two Rademacher blocks of 128, and not a multiple of either block


def noise_stage() -> tuple[dict, dict, dict]:
    """Counters (K,) each of seed (uint64), expert, step, member; outputs philox (K, 4) uint32
    (block 0 of each counter), rademacher and gaussian (K, NOISE_LENGTH) float32."""
    seed, expert, step, member = (np.array(c, dtype) for c, dtype in
                                  zip(zip(*NOISE_COUNTERS), (np.uint64, np.uint32, np.uint32, np.uint32)))
    words = np.array([[int(w) for w in philox4x32_10(0, m, s, e, *stream_key(int(sd)))]
                      for sd, e, s, m in NOISE_COUNTERS], np.uint32)
    rad = np.stack([noise(NOISE_LENGTH, *c, kind="rademacher") for c in NOISE_COUNTERS])
    gauss = np.stack([_gaussian64(NOISE_LENGTH, *c) for c in NOISE_COUNTERS])
    return ({"seed": seed, "expert": expert, "step": step, "member": member, "length": np.int64(NOISE_LENGTH)},
            {"philox": words, "rademacher": rad.astype(np.int8), "gaussian": gauss},
            {"philox": "bits", "rademacher": "bits", "gaussian": "gaussian"})


def _gaussian64(n, seed, expert, step, member) -> np.ndarray:
    """The Gaussian perturbation in float64, unrounded (zosoma.model.noise's Box-Muller)."""
    k0, k1 = stream_key(seed)
    out = np.empty(n)
    for b in range((n + 3) // 4):
        x = philox4x32_10(b, member, step, expert, k0, k1)
        for p in range(2):
            u1, u2 = (int(x[2 * p]) + 0.5) * 2.0 ** -32, (int(x[2 * p + 1]) + 0.5) * 2.0 ** -32
            r = np.sqrt(-2.0 * np.log(u1))
            for j, v in ((4 * b + 2 * p, r * np.cos(2 * np.pi * u2)), (4 * b + 2 * p + 1, r * np.sin(2 * np.pi * u2))):
                if j < n:
                    out[j] = v
    return out


def spsa_stage(theta, layout: Layout, rng) -> tuple[dict, dict, dict]:
    """One ZO-SGD step with Rademacher noise: losses of theta +/- eps delta_k (float64 reference),
    scalars g_k = (L+ - L-) / (2 eps), theta_new = theta - lr (1/P) sum_k g_k delta_k."""
    P, eps, lr, seed, expert, step = 4, 1e-3, 0.15, 2**33 + 5, 1, 7
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    deltas = [noise(layout.size, seed, expert, step, k).astype(np.float64) for k in range(P)]
    base = theta.astype(np.float32)
    plus = np.array([reference.loss((base + np.float32(eps) * d.astype(np.float32)).astype(np.float64), layout, batch)
                     for d in deltas])
    minus = np.array([reference.loss((base - np.float32(eps) * d.astype(np.float32)).astype(np.float64), layout, batch)
                      for d in deltas])
    scalars = (plus - minus) / (2 * eps)
    theta_new = theta.astype(np.float64) - lr * sum(g * d for g, d in zip(scalars, deltas)) / P
    inputs = {"theta": theta, "batch": batch, "P": np.int64(P), "eps": np.float64(eps), "lr": np.float64(lr),
              "seed": np.uint64(seed), "expert": np.uint32(expert), "step": np.uint32(step)}
    return (inputs, {"plus": plus, "minus": minus, "scalars": scalars, "theta_new": theta_new},
            {"plus": "loss", "minus": "loss", "scalars": "scalars", "theta_new": "update"})


def _fnv_counts(text: bytes, cfg: ClusterConfig) -> np.ndarray:
    """(F,) hashed n-gram counts of one text, from the specification (zosoma.mixture.cluster)."""
    bits = cfg.n_features.bit_length() - 1
    counts = np.zeros(cfg.n_features, np.int64)
    for t in range(len(text)):
        h = 2166136261
        for n in range(1, min(cfg.ngram_max, len(text) - t) + 1):
            h = ((h ^ text[t + n - 1]) * 16777619) & 0xFFFFFFFF
            if n >= cfg.ngram_min:
                counts[((h >> bits) ^ h) & (cfg.n_features - 1)] += 1
    return counts


def router_stage(seed: int) -> tuple[dict, dict, dict]:
    """A small clustering of the shipped corpus and S contexts through the router (top-2, T = 0.1)."""
    corpus = load_corpus(None, split="train")
    chunks = chunk(Corpus(corpus.names, tuple(d[:16384] for d in corpus.docs)), 1024)
    cfg = ClusterConfig(n_clusters=4, n_features=2**10, svd_dim=8, seed=seed)
    clustering, _ = fit_clusters(chunks, cfg)
    router = Router(clustering, top_k=2, temperature=0.1)
    heldout = load_corpus(None, split="heldout")
    contexts = [bytes(d[1000:1000 + 200 + 37 * i]) for i, d in enumerate(heldout.docs)]
    counts = np.stack([_fnv_counts(c, cfg) for c in contexts])
    tf = np.where(counts > 0, 1.0 + np.log(np.maximum(counts, 1)), 0.0) * clustering.idf.astype(np.float64)
    features = tf / np.linalg.norm(tf, axis=1, keepdims=True)
    emb = features @ clustering.projection.astype(np.float64)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    assert np.allclose(emb, clustering.embed(contexts), atol=1e-5)  # the spec reproduces the library
    dist = ((emb[:, None, :] - clustering.centroids.astype(np.float64)[None]) ** 2).sum(-1)
    experts, _ = router.select(contexts)
    top = np.take_along_axis(-dist / router.temperature, experts, axis=1)
    weights = np.exp(top - top[:, :1])
    weights /= weights.sum(axis=1, keepdims=True)
    gaps = np.sort(dist, axis=1)
    if np.any(np.diff(gaps[:, :3], axis=1) < 1e-3):
        raise ConfigError("router stage: a context sits on a tie between experts; choose another seed")
    offsets = np.cumsum([0] + [len(c) for c in contexts]).astype(np.int64)
    inputs = {"idf": clustering.idf, "projection": clustering.projection, "centroids": clustering.centroids,
              "config": np.array(cfg.to_json()), "contexts": np.frombuffer(b"".join(contexts), np.uint8),
              "offsets": offsets, "top_k": np.int64(2), "temperature": np.float64(0.1)}
    outputs = {"counts": counts, "features": features, "embeddings": emb, "distances": dist,
               "experts": experts.astype(np.int64), "weights": weights}
    return inputs, outputs, {k: k for k in outputs}


STAGES = (
    ("forward", "embedding, gates, activations, cell, hidden and logits of every step and layer, "
                "state carried in (h0, c0) and out (hT, cT)"),
    ("losses", "per-byte nats (log-softmax NLL) and the mean loss of a batch, from zero state"),
    ("noise", "Philox4x32-10 words and the Rademacher and Gaussian perturbations of given counters"),
    ("spsa_step", "one SPSA step: losses of theta +/- eps delta_k, the P scalars, the updated theta"),
    ("router", "hashed n-gram counts, tf-idf features, embedding, distances, top-k experts and weights"),
)


def write_kit(out, config: ModelConfig = ModelConfig(embed=16, hidden=32, layers=2), seed: int = 0,
              force: bool = False) -> Path:
    """Write the kit into folder `out`: a new one, or with force one where the kit's files replace
    those an earlier kit wrote (zosoma.porting.output_folder; other files are left alone). Returns
    the manifest's path."""
    out = Path(out)
    files = sorted([f"{name}.npz" for name, _ in STAGES] + [MODEL, CHECKER.name, MANIFEST])
    with output_folder(out, files, KIT_FORMAT, force, "porting kit") as tmp:
        theta, layout = kit_model(config, seed)
        rng = np.random.default_rng([seed, 0x9017])
        built = {"forward": forward_stage(theta, layout, rng), "losses": loss_stage(theta, layout, rng),
                 "noise": noise_stage(), "spsa_step": spsa_stage(theta, layout, rng), "router": router_stage(seed)}
        stages = []
        for name, what in STAGES:
            inputs, outputs, keys = built[name]
            with atomic_path(tmp / f"{name}.npz", "porting kit") as path, open(path, "wb") as f:
                np.savez(f, **inputs, **outputs)
            stages.append({"name": name, "file": f"{name}.npz", "what": what, "inputs": sorted(inputs),
                           "outputs": _outputs(keys)})
        save_model(build_model(theta, layout), tmp / MODEL)
        atomic_write(tmp / CHECKER.name, CHECKER.read_bytes(), "porting kit")
        manifest = {"format": KIT_FORMAT, "format_version": KIT_VERSION, "zosoma_version": __version__,
                    "spec": "PORTING.md in the zosoma repository", "seed": seed,
                    "model": {"embed": config.embed, "hidden": config.hidden, "layers": config.layers,
                              "vocab": VOCAB, "parameters": layout.size,
                              "layout": [[e.name, list(e.shape), e.offset] for e in layout.entries]},
                    "tolerance": "|port - kit| <= atol + rtol * |kit| elementwise; integers exactly",
                    "stages": stages, "files": files}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2), "porting kit")
    return out / MANIFEST
