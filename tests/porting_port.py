"""zosoma's own float32 code run as a port would run it: every stage of the porting kit, computed
from the stage's inputs (and, where the manifest says so, the kit's values of other outputs), written
to PORT/<stage>.npz. tests/test_porting.py checks that it passes every stage with a margin, and
derives each deliberately wrong port from it by changing one convention."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, load_corpus
from zosoma.engines.ops import Ops
from zosoma.engines.cpu import forward, noisy_forward
from zosoma.engines.emulated import precision_kernels, precision_reference
from zosoma.model import node_perturbation, noise as noise_spec, number_formats
from zosoma.model.reference import sigmoid
from zosoma.model.noise import noise, philox4x32_10, stream_key
from zosoma.model.params import Layout, init_params
from zosoma.porting import approx_activations, kit_activity_run, kit_default_run, kit_run
from zosoma.model.population import Population
from zosoma.model.number_formats import Q_ACT, Q_CELL, Q_GATE, Q_H, SIGMOID_TABLE, TANH_TABLE, round_to, table_lookup
from zosoma.training.guard import DivergenceGuard, healthy_steps, rollback_index, window_for
from zosoma.training.stepper import stream
from zosoma.config import ClusterConfig
from zosoma.mixture.cluster import Clustering, _ngram_counts, _tfidf
from zosoma.mixture.routing import Router, cut_segments, mix_nll, segment_sums
from zosoma.strategies import make_strategy
from zosoma.strategies.base import learning_rate
from zosoma.strategies.es import centered_ranks
from zosoma.strategies.onesided import one_sided
from zosoma.strategies.shaping import Chain
from zosoma.strategies.spsa import central_differences


def load(folder: Path, name: str) -> dict:
    with np.load(folder / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def sigmoid32(x):
    return (1 / (1 + np.exp(-x))).astype(np.float32)


def float32_forward(p, tokens, h0, c0, L, H):
    """The forward in float32, every intermediate kept: what a straightforward port computes."""
    x = p["embed"][tokens]
    out = {"embedded": x}
    for layer in range(L):
        h, c = h0[layer], c0[layer]
        keep = {k: [] for k in ("gates", "activations", "cells", "hidden")}
        for t in range(tokens.shape[1]):
            z = x[:, t] @ p[f"lstm{layer}.w_ih"] + h @ p[f"lstm{layer}.w_hh"] + p[f"lstm{layer}.bias"]
            a = np.concatenate([sigmoid32(z[:, :2 * H]), np.tanh(z[:, 2 * H:3 * H]), sigmoid32(z[:, 3 * H:])], axis=1)
            c = a[:, H:2 * H] * c + a[:, :H] * a[:, 2 * H:3 * H]
            h = a[:, 3 * H:] * np.tanh(c)
            for k, v in zip(keep, (z, a, c, h)):
                keep[k].append(v)
        for k, v in keep.items():
            out[f"{k}{layer}"] = np.stack(v, axis=1).astype(np.float32)
        x = out[f"hidden{layer}"]
    return out


def _corpus(f) -> Corpus:
    docs = tuple(f["text"][a:b] for a, b in zip(f["offsets"][:-1], f["offsets"][1:]))
    return Corpus(tuple(f"doc{i}" for i in range(len(docs))), docs)


def _pop(f, P=None, scale=None, kind="rademacher", rank=0):
    return Population(int(f["P"] if P is None else P), float(scale), int(f["seed"]), int(f["expert"]),
                      int(f["step"]), kind, rank)


def port_forward(kit, layout, cfg):
    f = load(kit, "forward")
    out = float32_forward(layout.views(f["theta"]), f["tokens"], f["h0"], f["c0"], cfg.layers, cfg.hidden)
    import onnxruntime as ort  # the onnx extra's: imported here, so that the tests collect without it
    session = ort.InferenceSession(str(kit / "model.onnx"), providers=["CPUExecutionProvider"])
    out["logits"], out["hT"], out["cT"] = session.run(None, {"tokens": f["tokens"].astype(np.int64),
                                                              "h0": f["h0"], "c0": f["c0"]})
    return out


def port_losses(kit, layout):
    f = load(kit, "losses")
    nll, _ = forward.nll_stream(f["theta"], layout, f["batch"][:, :-1], f["batch"][:, 1:])
    return {"nll": nll, "loss": forward.population_loss(f["theta"][None], layout, f["batch"])[0]}


def port_noise(kit):
    f = load(kit, "noise")
    counters = [(int(s), int(e), int(t), int(m)) for s, e, t, m in zip(f["seed"], f["expert"], f["step"], f["member"])]
    n = int(f["length"])
    return {"philox": np.array([philox4x32_10(0, m, t, e, *stream_key(s)) for s, e, t, m in counters], np.uint32),
            "rademacher": np.stack([noise(n, *c) for c in counters]),
            "gaussian": np.stack([noise(n, *c, kind="gaussian") for c in counters])}


def port_init(kit):
    f = load(kit, "init")
    cfg = ModelConfig(int(f["embed"]), int(f["hidden"]), int(f["layers"]))
    return {"theta": init_params(cfg, int(f["seed"]), int(f["expert"]))}


def port_batches(kit):
    f = load(kit, "batches")
    sampler = BatchSampler(_corpus(f), int(f["T"]) + 1)
    seed, st, B = int(f["seed"]), int(f["stream"]), int(f["B"])
    steps = [int(s) for s in f["steps"]]
    doc, start = (np.stack(a) for a in zip(*(sampler.positions(seed, st, s, B) for s in steps)))
    return {"draws": np.stack([np.random.default_rng([seed, st, s]).integers(0, sampler.n_windows, size=B)
                               for s in steps]),
            "doc": doc, "start": start, "batches": np.stack([sampler.batch(seed, st, s, B) for s in steps])}


def port_schedule(kit):
    f = load(kit, "schedule")
    return {"rates": np.array([[learning_rate(t, float(f["lr"]), int(n), int(w), str(k)) * float(s)
                                for t in range(int(f["count"]))]
                               for k, w, n, s in zip(f["schedule"], f["warmup"], f["total"], f["factor"])])}


def port_spsa(kit, layout):
    f = load(kit, "spsa_step")
    pop = _pop(f, scale=f["eps"])
    plus, minus = Ops().perturbed_losses(f["theta"], layout, f["batch"], pop)
    scalars, _ = central_differences(plus, minus, pop.scale)
    theta_new = Ops().sgd_update(f["theta"], f["scalars"], pop, float(f["lr"]))  # from the kit's scalars
    return {"plus": plus, "minus": minus, "scalars": scalars, "theta_new": theta_new}


def port_onesided(kit, layout):
    """The default strategy's own pieces: the engine's one-sided members, OneSided.coefficients and
    the fused update over the 2P directions."""
    f = load(kit, "onesided_step")
    pop = one_sided(_pop(f, scale=f["eps"]))
    plus, minus = Ops().perturbed_losses(f["theta"], layout, f["batch"], pop)
    strategy = make_strategy(TrainConfig(optimizer="onesided", eps=float(f["eps"])))
    scalars, loss = strategy.coefficients(plus, minus)
    theta_new = Ops().sgd_update(f["theta"], f["scalars"], pop, float(f["lr"]))  # from the kit's scalars
    return {"losses": np.stack([plus, minus], axis=1).ravel(), "loss": np.float64(loss), "scalars": scalars,
            "theta_new": theta_new}


def activity_onesided(kit):
    """(the stage's inputs, the strategy activity-onesided with its settings, its population)."""
    f = load(kit, "activity_onesided_step")
    strategy = make_strategy(TrainConfig(optimizer="activity-onesided", eps=float(f["eps"]), perturbations=int(f["P"]),
                                         seed=int(f["seed"])))
    return f, strategy, strategy.ask(int(f["expert"]), int(f["step"]))


def port_activity_onesided(kit, layout):
    """activity-onesided's own pieces, each from the kit's values of the one before: the CPU engine's
    noise and noisy forward over the 2P members, the strategy's scalars, node_perturbation's credit,
    the engine's combination of the noise, node_perturbation's estimate (the engine's float32
    update) and the strategy's step down."""
    f, strategy, pop = activity_onesided(kit)
    B, T = f["batch"].shape[0], f["batch"].shape[1] - 1
    Z = noisy_forward.draw(layout, B, T, pop.seed, pop.expert, pop.step, range(pop.directions), pop.kind,
                           strategy.readout)
    plus, minus = strategy.losses(Ops(), f["theta"], layout, f["batch"], pop, {})
    scalars, _ = strategy.coefficients(f["nats"][0::2], f["nats"][1::2])  # from the kit's nats
    w = node_perturbation.credit(f["scalars"], causal=True)[0]
    zeta = noisy_forward.weighted_noise(f["credit"], f["credit"], Z, Z.shape[-1])
    ghat = node_perturbation.estimate(f["theta"], layout, f["batch"], f["zeta"].astype(np.float32))
    nats = np.stack([plus, minus], axis=1).reshape((-1, B, T))
    return {"gate_noise": Z.astype(np.int8), "nats": nats, "loss": np.float64(nats.mean()),
            "scalars": scalars.reshape(nats.shape), "credit": w, "zeta": zeta, "ghat": ghat,
            "theta_new": strategy.descend(Ops(), f["theta"], f["ghat"], float(f["lr"]))}


def port_momentum(kit, layout):
    f = load(kit, "momentum")
    cfg = TrainConfig(optimizer="momentum", momentum=float(f["momentum"]), weight_decay=float(f["weight_decay"]))
    pop = _pop(f, scale=1e-3)
    ops = Ops()
    theta_new, state = make_strategy(cfg).update(ops, None, f["theta"], {"m": f["m"]}, f["scalars"], pop,
                                                 float(f["lr"]))
    return {"ghat": ops.noise_sum(f["scalars"], f["theta"].size, pop), "m_new": state["m"], "theta_new": theta_new}


def port_adam(kit, layout):
    f = load(kit, "adam")
    cfg = TrainConfig(optimizer="adam", momentum=float(f["beta1"]), beta2=float(f["beta2"]),
                      weight_decay=float(f["weight_decay"]))
    pop = _pop(f, scale=1e-3)
    ops = Ops()
    theta_new, state = make_strategy(cfg).update(ops, None, f["theta"], {"m": f["m"], "v": f["v"]}, f["scalars"],
                                                 pop, float(f["lr"]))
    return {"ghat": ops.noise_sum(f["scalars"], f["theta"].size, pop), "m_new": state["m"], "v_new": state["v"],
            "theta_new": theta_new}


def port_es(kit, layout):
    f = load(kit, "es")
    cfg = TrainConfig(optimizer="es", eps=float(f["sigma"]), lr=float(f["lr"]), weight_decay=float(f["weight_decay"]),
                      perturbations=int(f["P"]), seed=int(f["seed"]))
    strategy = make_strategy(cfg)
    pop = strategy.ask(int(f["expert"]), int(f["step"]))
    ops = Ops()
    plus, minus = ops.perturbed_losses(f["theta"], layout, f["batch"], pop)
    coefficients, _ = strategy.coefficients(plus, minus)
    theta_new, _ = strategy.update(ops, layout, f["theta"], {}, f["coefficients"], pop, float(f["lr"]))
    return {"plus": plus, "minus": minus, "ranks": centered_ranks(-np.stack([plus, minus], axis=1).ravel()),
            "coefficients": coefficients, "theta_new": theta_new, "tie_ranks": centered_ranks(-f["tie_losses"])}


def port_eggroll(kit, layout):
    f = load(kit, "eggroll")
    cfg = TrainConfig(optimizer="eggroll", eps=float(f["sigma"]), rank=int(f["rank"]), perturbations=int(f["P"]),
                      seed=int(f["seed"]))
    strategy = make_strategy(cfg)
    pop = strategy.ask(int(f["expert"]), int(f["step"]))
    ops = Ops()
    plus, minus = ops.perturbed_losses(f["theta"], layout, f["batch"], pop)
    coefficients, _ = strategy.coefficients(plus, minus)
    return {"perturbation": noise_spec.materialise(layout, pop.scale, pop.rank, pop.seed, pop.expert, pop.step, 0,
                                                np.float32),
            "plus": plus, "minus": minus, "coefficients": coefficients,
            "theta_new": strategy.update(ops, layout, f["theta"], {}, f["coefficients"], pop, float(f["lr"]))[0]}


def port_train(kit, layout, schedule=True, skip_counts=True, stage="train", shape=None):
    """The training loop with zosoma's engine, updating from the kit's scalars (Strategy.apply: the
    trainer's rate and skip rule), shaped by zosoma's shaping Chain in stage train_normalize.
    schedule / skip_counts False: a port that takes the peak rate every step, or whose counter does
    not advance on a skipped step; shape: a port's own shaping of the kit's scalars (the deliberately
    wrong ports)."""
    f = load(kit, stage)
    N, P, eps, wd = int(f["steps"]), int(f["P"]), float(f["eps"]), float(f["weight_decay"])
    normalize = stage == "train_normalize"
    cfg = TrainConfig(optimizer="sgd", steps=N, batch=int(f["B"]), seq_len=int(f["T"]), perturbations=P, eps=eps, lr=float(f["lr"]),
                      warmup=int(f["warmup"]), weight_decay=wd, seed=int(f["seed"]),
                      shaping=("normalize",) if normalize else (),
                      normalize_window=int(f["normalize_window"]) if normalize else 50)
    chain, state = Chain(cfg), Chain(cfg).init()
    shaped, states = [], []
    if not schedule:  # the peak rate at every step
        cfg = dataclasses.replace(cfg, schedule="constant", warmup=0)
    sampler = BatchSampler(_corpus(f), int(f["T"]) + 1)
    strategy, ops = make_strategy(cfg), Ops()
    theta = f["theta"].copy()
    out = {k: [] for k in ("batches", "rates", "plus", "minus", "scalars")}
    skips = 0
    for t in range(N):
        c = t if skip_counts else t - skips  # the step counter
        batch = sampler.batch(cfg.seed, int(f["stream"]), c, cfg.batch)
        pop = strategy.ask(int(f["stream"]), c)
        plus, minus = ops.perturbed_losses(theta, layout, batch, pop)
        if t == int(f["fault_step"]):
            plus[0] = np.nan
        g = f["scalars"][t]
        if normalize:
            g, state, _ = chain(g, state)
            shaped.append(g)
            states.append(list(state["normalize"].values()))
        theta, _, lr, skipped = strategy.apply(ops, layout, theta, {}, f["shaped"][t] if normalize else g, pop)
        skips += skipped
        for k, v in zip(out, (batch, lr, plus, minus, central_differences(plus, minus, eps)[0])):
            out[k].append(v)
    extra = {"shaped": np.array(shaped) if shape is None else shape(f["scalars"]),
             "normalize_states": np.array(states, np.float64)} if normalize else {}
    return {**{k: np.array(v) for k, v in out.items()}, "theta_final": theta, **extra}


def port_shaping(kit):
    f = load(kit, "shaping")
    out = {}
    state_in = {"clip": dict(zip(("steps", "median"), (int(f["clip_state"][0]), float(f["clip_state"][1])))),
                "normalize": dict(zip(("steps", "sum"), (int(f["normalize_state"][0]),
                                                         float(f["normalize_state"][1]))))}
    for chain in (("clip",), ("normalize",), ("clip", "normalize")):
        pieces = Chain(TrainConfig(optimizer="sgd", shaping=chain, clip_at=float(f["clip_at"]),
                                   normalize_window=int(f["normalize_window"])))
        state = {k: dict(state_in[k]) for k in chain}
        rows, states = [], {p: [] for p in chain}
        for g in f["scalars"]:
            g, state, _ = pieces(g, state)
            rows.append(g)
            for p in chain:
                states[p].append(list(state[p].values()))
        name = "_".join(chain)
        out[f"{name}_scalars"] = np.array(rows)
        out.update({f"{name}_{p}_states": np.array(v, np.float64) for p, v in states.items()})
    return out


def port_restart(kit):
    f = load(kit, "restart")
    sampler = BatchSampler(_corpus(f), int(f["T"]) + 1)
    keys = ("window", "verdict_step", "verdict", "smoothed", "best", "window_start", "healthy", "action",
            "rollback_to", "lr_scale", "stream", "batches_after", "rates_after", "philox_after")
    out = {k: [] for k in keys}
    after, B, seed = int(f["after"]), int(f["B"]), int(f["seed"])
    for n in range(len(f["length"])):
        metrics = [{"step": k + 1, "loss": float(f["losses"][n, k]), "skipped": bool(f["skipped"][n, k])}
                   for k in range(int(f["length"][n]))]
        window = window_for(int(f["run_steps"][n]))
        guard, at, verdict = DivergenceGuard(window), 0, ""
        for rec in metrics:
            said = guard.observe(rec["loss"], rec["skipped"])
            if said:
                at, verdict = rec["step"], said.split(":")[0]
                break
        ok = healthy_steps(metrics[:at])
        restarts = int(f["restarts"][n])
        drop = restarts >= int(f["max_restarts"])
        restarts += not drop
        course = [int(c) for c in f["checkpoints"][n] if c >= 0]
        to = -1 if drop else course[rollback_index(course, guard.window_start(), ok.__contains__)]
        scale, st = float(f["restart_lr_factor"]) ** restarts, stream(int(f["expert"][n]), restarts)
        steps = [max(to, 0) + j for j in range(after)]
        values = (window, at, verdict, guard.smoothed, guard.best, guard.window_start(),
                  [k in ok for k in range(f["losses"].shape[1] + 1)], "drop" if drop else "restart", to, scale, st,
                  np.zeros((after, B, int(f["T"]) + 1), np.uint8) if drop else
                  np.stack([sampler.batch(seed, st, t, B) for t in steps]),
                  np.zeros(after) if drop else [learning_rate(t, float(f["lr"]), int(f["run_steps"][n]),
                                                              int(f["warmup"]), str(f["schedule"])) * scale for t in steps],
                  np.zeros(4, np.uint32) if drop else np.array(philox4x32_10(0, 0, to, st, *stream_key(seed)),
                                                               np.uint32))
        for k, v in zip(keys, values):
            out[k].append(v)
    return {k: np.array(v) for k, v in out.items()}


def port_router(kit):
    f = load(kit, "router")
    config = ClusterConfig.from_json(str(f["config"]))
    clustering = Clustering(config, f["idf"], f["projection"], f["centroids"])
    contexts = [f["contexts"][a:b] for a, b in zip(f["offsets"][:-1], f["offsets"][1:])]
    counts_csr = _ngram_counts(contexts, config)
    indptr, indices, data = _tfidf(counts_csr, clustering.idf, config.sublinear_tf)
    counts = np.zeros((len(contexts), config.n_features), np.int64)
    features = np.zeros((len(contexts), config.n_features), np.float32)
    for r in range(len(contexts)):
        cols = slice(indptr[r], indptr[r + 1])
        counts[r, counts_csr[1][cols]] = counts_csr[2][cols]
        features[r, indices[cols]] = data[cols]
    emb = clustering.embed(contexts)
    k, tau = int(f["top_k"]), float(f["temperature"])
    experts, weights = Router(clustering, k, tau).select(contexts)
    gone, gone_w = Router(clustering, k, tau, tuple(int(i) for i in f["dropped"])).select(contexts)
    logits = -f["tie_distances"].astype(np.float64) / tau  # as Router.select ranks them
    tie = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, tie, axis=1)
    tie_w = np.exp(top - top[:, :1])
    return {"counts": counts, "features": features, "embeddings": emb, "distances": clustering.sq_distances(emb),
            "experts": experts, "weights": weights, "experts_dropped": gone, "weights_dropped": gone_w,
            "tie_experts": tie, "tie_weights": tie_w / tie_w.sum(axis=1, keepdims=True)}


def port_routed(kit):
    """SOMA's evaluation with zosoma's router, float32 forward (Ops.models_nll) and mixture."""
    f = load(kit, "routed")
    config = ClusterConfig.from_json(str(f["config"]))
    router = Router(Clustering(config, f["idf"], f["projection"], f["centroids"]), int(f["top_k"]),
                    float(f["temperature"]))
    layout = Layout(ModelConfig(int(f["embed"]), int(f["hidden"]), int(f["layers"])))
    experts = [(theta, layout) for theta in f["experts"]]
    out = {k: [] for k in ("segment_experts", "segment_weights", "segment_nats")}
    for a, b in zip(f["offsets"][:-1], f["offsets"][1:]):
        segs = cut_segments(f["text"][a:b], int(f["segment"]), int(f["context"]))
        chosen, weights = router.select(segs.contexts)
        every = np.stack(Ops().models_nll(experts, [(segs.tokens, segs.targets)] * len(experts)))
        mixed = mix_nll(every[chosen, np.arange(len(segs))[:, None]], weights)
        for k, v in zip(out, (chosen, weights, segment_sums(mixed, segs.mask()))):
            out[k].append(v)
    out = {k: np.concatenate(v) for k, v in out.items()}
    return {**out, "routed": out["segment_nats"].sum() / int((np.diff(f["offsets"]) - 1).sum())}


def port_run(kit, run_dir: Path, **options):
    """The run stage with zosoma's trainer and evaluation (a minute): its batches are the kit's."""
    f = load(kit, "run")
    model, cfg = kit_run.run_config()
    sampler = BatchSampler(load_corpus(None, split="train"), cfg.seq_len + 1)
    for t in (0, 1, cfg.steps - 1):
        doc, start = sampler.positions(int(f["seed"]), 0, t, int(f["batch"]))
        assert np.array_equal(doc, f["batch_doc"][t]) and np.array_equal(start, f["batch_start"][t])
    ran = kit_run.train_reference(run_dir, **options)
    return {"losses": np.array(ran["losses"]), "heldout": np.float64(ran["heldout"])}


def port_approx(kit, layout, sigmoid=approx_activations.sigmoid):
    """The approx stage in float32, as a device computes it (approx_activations; `sigmoid` its
    elementwise function, for a wrong port)."""
    f = load(kit, "approx")
    out = {}
    for mode in str(f["modes"]).split(","):
        x = f["edge_x"]
        run = approx_activations.forward(f["theta"], layout, f["tokens"], mode, f["h0"][None], f["c0"][None])
        free = approx_activations.forward(f["theta"], layout, f["batch"][:, :-1], mode)
        out.update({f"{mode}_sigmoid": sigmoid(x, mode), f"{mode}_tanh": approx_activations.tanh(x, mode),
                    f"{mode}_logits": run["logits"][0],
                    f"{mode}_loss": np.float64(approx_activations.nll(free["logits"][0], f["batch"][:, 1:]).mean(
                        dtype=np.float64))})
    return out


def port_default_run(kit, run_dir: Path, stage: str, budget: bool = True):
    """run_onesided, run_restart or run_activity with zosoma's trainer and evaluation (a minute), its
    batches the kit's; budget=False is the deliberately wrong port that follows PORTING.md's old
    sentence (the counter runs on to `steps` after a rollback)."""
    f = load(kit, stage)
    which = stage.removeprefix("run_")
    model, cfg = {"onesided": kit_default_run.onesided_config, "restart": kit_default_run.restart_config,
                  "activity": kit_activity_run.activity_config}[which]()
    sampler = BatchSampler(load_corpus(None, split="train"), cfg.seq_len + 1)
    doc, start = (f["batch_doc"], f["batch_start"]) if which == "restart" else (f["batch_doc"][None],
                                                                               f["batch_start"][None])
    for row, s in enumerate((0, stream(0, 1))[:doc.shape[0]]):
        for t in (0, 1, cfg.steps - 1):
            d, st = sampler.positions(int(f["seed"]), s, t, int(f["batch"]))
            assert np.array_equal(d, doc[row, t]) and np.array_equal(st, start[row, t])
    ran = kit_default_run.train_run(run_dir, model, cfg, budget=budget)
    out = {"losses": np.array(ran["losses"]), "heldout": np.float64(ran["heldout"])}
    if which == "restart":  # the losses of the course after the (first) rollback
        (verdict, to), = ran["restarts"][:1]
        out.update(verdict_step=np.int64(verdict), rollback_to=np.int64(to), final_step=np.int64(ran["final_step"]),
                   attempted=np.int64(len(ran["losses"])), losses=out["losses"][verdict:])
    return out


def _shifted(kit_values, first):
    """(B, T, n) the kit's values of step t-1 at t, `first` (B, n) at t = 0: teacher forcing."""
    return np.concatenate([first[:, None], kit_values[:, :-1]], axis=1)


def port_float_format(kit, layout, fmt):
    """bf16/fp16 op by op with zosoma.model.number_formats's rounding, float32 products as its forward
    computes them, each operation from the kit's values of what it consumes."""
    f = load(kit, fmt)
    H, L = layout.config.hidden, layout.config.layers
    R = lambda x: round_to(x, fmt)  # noqa: E731
    w = layout.views(R(f["theta"]))
    out = {"weights": R(f["theta"]), "state_h": R(f["h0"]), "state_c": R(f["c0"])}
    x = w["embed"][f["tokens"]]
    for layer in range(L):
        h_prev = _shifted(f[f"hidden{layer}"], out["state_h"][layer]).astype(np.float32)
        c_prev = _shifted(f[f"cells{layer}"], out["state_c"][layer])
        z = (x @ w[f"lstm{layer}.w_ih"]).astype(np.float64) + (h_prev @ w[f"lstm{layer}.w_hh"]).astype(np.float64)
        out[f"gates{layer}"] = R(z + w[f"lstm{layer}.bias"])
        g = f[f"gates{layer}"].astype(np.float64)  # the kit's
        a = np.concatenate([R(sigmoid(g[..., :2 * H])), R(np.tanh(g[..., 2 * H:3 * H])),
                            R(sigmoid(g[..., 3 * H:]))], axis=-1)
        out[f"activations{layer}"] = a
        k = f[f"activations{layer}"].astype(np.float64)
        out[f"cells{layer}"] = R(k[..., H:2 * H] * c_prev + k[..., :H] * k[..., 2 * H:3 * H])
        out[f"hidden{layer}"] = R(k[..., 3 * H:].astype(np.float32)
                                  * R(np.tanh(f[f"cells{layer}"].astype(np.float64))))
        x = f[f"hidden{layer}"].astype(np.float32)
    out["logits"] = R((x @ w["out.w"]).astype(np.float64) + w["out.b"])
    out["nll"] = precision_reference.nll(f["logits"], f["targets"])
    out["loss"] = precision_kernels.population_loss(f["theta"][None], layout, f["batch"], fmt)[0]
    out["edge_rounded"] = R(f["edge_values"])
    out["edge_wide_rounded"] = R(f["edge_wide"])
    e = f["edge_gates"].astype(np.float64)
    with np.errstate(over="ignore"):
        out["edge_activations"] = np.stack([R(sigmoid(e[:, 0])), R(sigmoid(e[:, 1])),
                                            R(np.tanh(e[:, 2])), R(sigmoid(e[:, 3]))], axis=1)
    k = f["edge_activations"].astype(np.float64)
    out["edge_cells"] = R(k[:, 1] * f["edge_c"] + k[:, 0] * k[:, 2])
    out["edge_hidden"] = R(k[:, 3].astype(np.float32) * R(np.tanh(f["edge_cells"].astype(np.float64))))
    return out


def int8_cell(f_, i, g, qc):
    return np.clip(np.rint(f_ * qc / Q_ACT + i * g / (Q_ACT * Q_ACT) * Q_CELL), -32768, 32767)


def int8_h(o, qc):
    t = table_lookup(np.clip(2 * qc, -32768, 32767).astype(np.int64), TANH_TABLE)
    return np.clip(np.rint(o * t * Q_H / (Q_ACT * Q_ACT)), -127, 127)


def port_int8(kit, layout):
    """int8 op by op with zosoma.model.number_formats's quantisation, tables and integer cell."""
    f = load(kit, "int8")
    H, L = layout.config.hidden, layout.config.layers
    w = number_formats.prepare(f["theta"], layout, "int8")
    scales = []
    quantized = []
    for e in layout.entries:
        if e.name.startswith("lstm"):
            layer, kind = e.name[4:].split(".")
            s_x = w["s_embed"] if layer == "0" else 1.0 / Q_H
            scales.append(s_x * w[f"s_w_ih{layer}"] if kind == "bias" else w[f"s_{kind}{layer}"])
            quantized.append(w[f"q_{kind}{layer}"].ravel())
        else:
            key = {"embed": "embed", "out.w": "out_w", "out.b": "out_b"}[e.name]
            scales.append(w["s_out_w"] / Q_H if key == "out_b" else w[f"s_{key}"])
            quantized.append(w[f"q_{key}"].ravel())
    h_grid = np.clip(np.rint(f["h0"].astype(np.float64) * Q_H), -127, 127)
    c_grid = np.clip(np.rint(f["c0"].astype(np.float64) * Q_CELL), -32768, 32767)
    out = {"scales": np.array(scales), "quantized": np.concatenate(quantized).astype(np.int64),
           "sigmoid_table": SIGMOID_TABLE, "tanh_table": TANH_TABLE, "state_h": h_grid, "state_c": c_grid}
    x, s_x = w["q_embed"][f["tokens"]], w["s_embed"]
    for layer in range(L):
        qh = _shifted(f[f"hidden{layer}"], h_grid[layer]).astype(np.float64)
        qc = _shifted(f[f"cells{layer}"], c_grid[layer]).astype(np.float64)
        z = (x @ w[f"q_w_ih{layer}"] + w[f"q_bias{layer}"]) * (s_x * w[f"s_w_ih{layer}"]) \
            + (qh @ w[f"q_w_hh{layer}"]) * (w[f"s_w_hh{layer}"] / Q_H)
        out[f"gates{layer}"] = np.clip(np.rint(z * Q_GATE), -32768, 32767)
        g = f[f"gates{layer}"]
        out[f"activations{layer}"] = np.concatenate(
            [table_lookup(g[..., :2 * H], SIGMOID_TABLE), table_lookup(g[..., 2 * H:3 * H], TANH_TABLE),
             table_lookup(g[..., 3 * H:], SIGMOID_TABLE)], axis=-1)
        a = f[f"activations{layer}"].astype(np.float64)
        out[f"cells{layer}"] = int8_cell(a[..., H:2 * H], a[..., :H], a[..., 2 * H:3 * H], qc)
        out[f"hidden{layer}"] = int8_h(a[..., 3 * H:], f[f"cells{layer}"])
        x, s_x = f[f"hidden{layer}"].astype(np.float64), 1.0 / Q_H
    out["logits"] = ((x @ w["q_out_w"] + w["q_out_b"]) * (w["s_out_w"] / Q_H)).astype(np.float32)
    out["nll"] = precision_reference.nll(f["logits"], f["targets"])
    out["loss"] = precision_kernels.population_loss(f["theta"][None], layout, f["batch"], "int8")[0]
    s = number_formats.int8_scale(f["edge_tensor"])
    out.update(edge_scale=s, edge_q=number_formats.quantize_int8(f["edge_tensor"], f["edge_scale"]),
               edge_qz=np.clip(np.rint(f["edge_z"] * Q_GATE), -32768, 32767))
    e = f["edge_gates"]
    out["edge_activations"] = np.stack([table_lookup(e[:, k], TANH_TABLE if k == 2 else SIGMOID_TABLE)
                                        for k in range(4)], axis=1)
    a = f["edge_activations"].astype(np.float64)
    out["edge_cells"] = int8_cell(a[:, 1], a[:, 0], a[:, 2], f["edge_c"].astype(np.float64))
    out["edge_hidden"] = int8_h(a[:, 3], f["edge_cells"])
    return {k: np.asarray(v) for k, v in out.items()}


def zosoma_port(kit: Path, port: Path) -> dict:
    """Every stage's outputs from zosoma's own code, written as a port would; returns them too. All
    but the run stage, which trains for a minute (port_run; tests/test_porting_run.py)."""
    port.mkdir(exist_ok=True)
    manifest = json.loads((kit / "manifest.json").read_text())
    cfg = ModelConfig(**{k: manifest["model"][k] for k in ("embed", "hidden", "layers")})
    layout = Layout(cfg)
    stages = {"forward": port_forward(kit, layout, cfg), "losses": port_losses(kit, layout), "noise": port_noise(kit),
              "init": port_init(kit), "batches": port_batches(kit), "schedule": port_schedule(kit),
              "spsa_step": port_spsa(kit, layout), "onesided_step": port_onesided(kit, layout),
              "activity_onesided_step": port_activity_onesided(kit, layout),
              "momentum": port_momentum(kit, layout),
              "adam": port_adam(kit, layout), "es": port_es(kit, layout), "eggroll": port_eggroll(kit, layout),
              "train": port_train(kit, layout), "train_normalize": port_train(kit, layout, stage="train_normalize"),
              "shaping": port_shaping(kit), "restart": port_restart(kit),
              "router": port_router(kit), "routed": port_routed(kit), "bf16": port_float_format(kit, layout, "bf16"),
              "fp16": port_float_format(kit, layout, "fp16"), "int8": port_int8(kit, layout),
              "approx": port_approx(kit, layout)}
    for name, outputs in stages.items():
        np.savez(port / f"{name}.npz", **outputs)
    return stages
