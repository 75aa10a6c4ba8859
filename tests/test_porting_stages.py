"""Every stage of the porting kit, against ports: zosoma's own code (tests/porting_port.py) passes
each with a margin, and a port that reads one convention of PORTING.md wrong fails that stage,
with the output's hint and the wrong reading named. The wrong ports are computed here, from the
kit's inputs, independently of the kit's own misreadings."""

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import porting_port
from porting_port import load
from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.engines.ops import Ops
from zosoma.model import number_formats as precision
from zosoma.engines.cpu import forward
from zosoma.model import noise as noise_spec
from zosoma.model.noise import noise, philox4x32_10, stream_key
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.porting import approx_activations, check_port
from zosoma.porting.kit import STAGES
from zosoma.training.folder import RunFolder
from zosoma.training.records import Step
from zosoma.training.trainer import RunState, Trainer, train
from zosoma.strategies.base import learning_rate
from zosoma.strategies.es import centered_ranks
from zosoma.strategies.onesided import one_sided
from zosoma.strategies.shaping import Chain

pytest.importorskip("onnx", reason="the kit writes its model as ONNX (the onnx extra)")
pytest.importorskip("onnxruntime", reason="the port runs the kit's ONNX model in ONNX Runtime (the onnx extra)")


@pytest.fixture(scope="module")
def good(kit, tmp_path_factory):
    """(the folder zosoma's port wrote, its outputs by stage)."""
    folder = tmp_path_factory.mktemp("port") / "port"
    return folder, porting_port.zosoma_port(kit, folder)


@pytest.fixture(scope="module")
def layout(kit):
    m = json.loads((kit / "manifest.json").read_text())["model"]
    return Layout(ModelConfig(m["embed"], m["hidden"], m["layers"]))


def _manifest(kit) -> dict:
    return {s["name"]: s for s in json.loads((kit / "manifest.json").read_text())["stages"]}


def test_zosomas_own_code_passes_every_stage_with_a_margin(kit, good):
    """The stated tolerances are neither loose nor tight: zosoma's own float32 code (the Numba
    forward, ONNX Runtime on the kit's graph, the CPU engine's steps, the trainer's skip rule, the
    router, the low-precision emulation's operations) passes every stage, and every atol/rtol
    output with room to spare (1 value of a 16-bit format where its float32 sums straddle a
    rounding point)."""
    out = io.StringIO()
    stages = [s for s in STAGES if not s.startswith("run")]  # each run trains a minute: tests/test_porting_run.py
    assert check_port.check(kit, good[0], strict=True, out=out, stages=stages) == 0, out.getvalue()
    assert f"stages: {len(stages)} passed; 0 failed; 0 skipped" in out.getvalue()
    margins = {}
    for name, stage in _manifest(kit).items():
        if name not in stages:
            continue
        ref, got = load(kit, name), load(good[0], name)
        for output, tol in stage["outputs"].items():
            if tol.get("format") or ref[output].dtype.kind in "biuU":
                continue  # exact integers, or values of a format (checked in ulps above)
            w, g = ref[output].astype(np.float64), got[output].astype(np.float64)
            finite = np.isfinite(w)
            diff = np.abs(np.where(finite, g, 0) - np.where(finite, w, 0))
            allowed = tol["atol"] + tol["rtol"] * np.abs(np.where(finite, w, 0))
            margins[f"{name}/{output}"] = float(np.max(np.where(allowed > 0, diff / np.maximum(allowed, 1e-300),
                                                                np.where(diff > 0, np.inf, 0.0))))
    assert len(margins) > 60 and max(margins.values()) <= 0.2, {k: v for k, v in margins.items() if v > 0.2}


@pytest.mark.parametrize("stage", ["train", "train_normalize"])
def test_the_kits_training_loop_is_the_trainers(kit, layout, tmp_path, monkeypatch, stage):
    """The train stages describe zosoma's Trainer: run for real with the stage's settings (the
    fault injected into its engine; plain SPSA, or the default shaping), it takes the same rates,
    counts the skipped step and ends where the kit's trajectory ends, within what its own float32
    scalars add."""
    f = load(kit, stage)
    normalize = stage == "train_normalize"
    assert str(f["shaping"]) == ("normalize" if normalize else "none")
    cfg = TrainConfig(optimizer="sgd", steps=int(f["steps"]), batch=int(f["B"]), seq_len=int(f["T"]), perturbations=int(f["P"]),
                      eps=float(f["eps"]), lr=float(f["lr"]), warmup=int(f["warmup"]),
                      weight_decay=float(f["weight_decay"]), seed=int(f["seed"]), checkpoint_every=1000,
                      shaping=("normalize",) if normalize else (),  # as the stage's settings say
                      normalize_window=int(f["normalize_window"]) if normalize else 50)
    trainer = Trainer(tmp_path / "run", layout.config, cfg, BatchSampler(porting_port._corpus(f), cfg.seq_len + 1),
                      RunState(f["theta"].copy(), {}, shaping=Chain(cfg).init()), expert=int(f["stream"]), ops=Ops())
    losses = trainer.ops.perturbed_losses

    def faulty(theta, layout_, batch, pop, *args, **kw):
        plus, minus = losses(theta, layout_, batch, pop, *args, **kw)
        if pop.step == int(f["fault_step"]):
            plus[0] = np.nan
        return plus, minus

    monkeypatch.setattr(trainer.ops, "perturbed_losses", faulty)
    records = [r for r in train(trainer) if isinstance(r, Step)]
    assert [r.metrics["lr"] for r in records] == list(f["rates"])
    assert [r.skipped for r in records] == [t == int(f["fault_step"]) for t in range(int(f["steps"]))]
    assert np.abs(trainer.theta - f["theta_final"]).max() < 1e-4  # its own scalars: ~1e-5 from the kit's
    assert RunFolder(tmp_path / "run").read_checkpoint().step == int(f["steps"])


# --- deliberately wrong ports, one per convention ------------------------------------------------

def _views32(theta, layout, torch_layout=False):
    p = dict(layout.views(theta))
    if torch_layout:
        for e in layout.entries:
            if len(e.shape) == 2 and e.name != "embed":
                p[e.name] = p[e.name].reshape(e.shape[1], e.shape[0]).T
    return p


def wrong_orientation(kit, good, layout):
    f = load(kit, "forward")
    cfg = layout.config
    return porting_port.float32_forward(_views32(f["theta"], layout, True), f["tokens"], f["h0"], f["c0"],
                                        cfg.layers, cfg.hidden)


def wrong_activation_order(kit, good, layout):
    out = dict(good["forward"])
    for layer in range(layout.config.layers):
        i, f_, g, o = np.split(out[f"activations{layer}"], 4, axis=-1)
        out[f"activations{layer}"] = np.concatenate([i, f_, o, g], axis=-1)  # sigmoids together, then tanh
    return out


def wrong_counter_layout(kit, good, layout):
    f = load(kit, "noise")
    out = dict(good["noise"])
    out["philox"] = np.array([philox4x32_10(0, int(t), int(m), int(e), *stream_key(int(s)))
                              for s, e, t, m in zip(f["seed"], f["expert"], f["step"], f["member"])], np.uint32)
    return out


def wrong_scheduled_lr(kit, good, layout):
    f = load(kit, "spsa_step")
    pop = Population(int(f["P"]), float(f["eps"]), int(f["seed"]), int(f["expert"]), int(f["step"]))
    lr = learning_rate(int(f["step"]), float(f["lr"]), 4000, 20, "cosine")  # the default schedule, again
    return dict(good["spsa_step"], theta_new=Ops().sgd_update(f["theta"], f["scalars"], pop, lr))


def wrong_onesided_pairs(kit, good, layout):
    f = load(kit, "onesided_step")
    pop = Population(int(f["P"]), float(f["eps"]), int(f["seed"]), int(f["expert"]), int(f["step"]))  # antithetic
    plus, minus = Ops().perturbed_losses(f["theta"], layout, f["batch"], pop)
    return dict(good["onesided_step"], losses=np.stack([plus, minus], axis=1).ravel())


def wrong_onesided_two_eps(kit, good, layout):
    f = load(kit, "onesided_step")
    return dict(good["onesided_step"], scalars=(f["losses"] - f["losses"].mean()) / (2 * float(f["eps"])))


def wrong_onesided_over_p(kit, good, layout):
    f = load(kit, "onesided_step")
    pop = one_sided(Population(int(f["P"]), float(f["eps"]), int(f["seed"]), int(f["expert"]), int(f["step"])))
    # noise_sum divides by len(coeffs) = 2P: twice the coefficients give the 1/P reading
    return dict(good["onesided_step"], theta_new=Ops().sgd_update(f["theta"], 2 * f["scalars"], pop, float(f["lr"])))


def wrong_own_scalars(kit, good, layout):
    f = load(kit, "spsa_step")
    pop = Population(int(f["P"]), float(f["eps"]), int(f["seed"]), int(f["expert"]), int(f["step"]))
    return dict(good["spsa_step"], theta_new=Ops().sgd_update(f["theta"], good["spsa_step"]["scalars"], pop,
                                                              float(f["lr"])))


def wrong_unscheduled_train(kit, good, layout):
    return porting_port.port_train(kit, layout, schedule=False)


def wrong_skip_counter(kit, good, layout):
    return porting_port.port_train(kit, layout, skip_counts=False)


def wrong_cosine_end(kit, good, layout):
    f = load(kit, "schedule")
    rates = []
    for kind, w, total, factor in zip(f["schedule"], f["warmup"], f["total"], f["factor"]):
        row = []
        for t in range(int(f["count"])):
            if t < w:
                row.append(float(f["lr"]) * (t + 1) / w)
            elif kind == "constant":
                row.append(float(f["lr"]))
            else:  # reaching 0 at the last step
                row.append(float(f["lr"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - w) / max(1, total - 1 - w)))))
        rates.append(np.array(row) * factor)
    return {"rates": np.array(rates)}


def wrong_init_bounds(kit, good, layout):
    f = load(kit, "init")
    cfg = ModelConfig(int(f["embed"]), int(f["hidden"]), int(f["layers"]))
    rng = np.random.default_rng([int(f["seed"]), int(f["expert"]), 0x1D1])
    theta = np.empty(Layout(cfg).size, np.float32)
    for e in Layout(cfg).entries:
        fan_in = e.shape[0] if len(e.shape) == 2 else cfg.hidden
        theta[e.offset:e.offset + e.size] = (rng.standard_normal(e.size) if e.name == "embed" else
                                             np.zeros(e.size) if e.name == "out.b" else
                                             rng.uniform(-fan_in ** -0.5, fan_in ** -0.5, e.size))
    return {"theta": theta}


def wrong_batch_windows(kit, good, layout):
    f = load(kit, "batches")
    T1, B = int(f["T"]) + 1, int(f["B"])
    draws = np.stack([np.random.default_rng([int(f["seed"]), int(f["stream"]), int(s)]).integers(
        0, f["text"].size - T1 + 1, size=B) for s in f["steps"]])
    return dict(good["batches"], draws=draws)


def wrong_topk_order(kit, good, layout):
    out = dict(good["router"])
    order = np.argsort(out["experts"], axis=1)
    out["experts"] = np.take_along_axis(out["experts"], order, axis=1)
    out["weights"] = np.take_along_axis(out["weights"], order, axis=1)
    return out


def _features(kit, tf_of):
    f = load(kit, "router")
    counts = f["counts"].astype(np.float64)
    x = tf_of(counts) * f["idf"].astype(np.float64)
    with np.errstate(invalid="ignore"):
        return x / np.linalg.norm(x, axis=1, keepdims=True)


def wrong_tf_of_empty_buckets(kit, good, layout):
    return dict(good["router"], features=_features(kit, lambda c: 1.0 + np.log(np.maximum(c, 1))))


def wrong_zero_norm(kit, good, layout):
    return dict(good["router"], features=_features(kit, lambda c: np.where(c > 0, 1.0 + np.log(np.maximum(c, 1)), 0)))


def wrong_eggroll_factor_order(kit, good, layout):
    f = load(kit, "eggroll")
    r, sigma = int(f["rank"]), float(f["sigma"])
    z = noise(sum((e.shape[0] + e.shape[1]) * r if len(e.shape) == 2 else e.size for e in layout.entries),
              int(f["seed"]), int(f["expert"]), int(f["step"]), 0, kind="gaussian")
    E, pos = np.empty(layout.size, np.float32), 0
    for e in layout.entries:
        if len(e.shape) == 2:  # B (n, r) first, then A (m, r)
            m, n = e.shape
            b = z[pos:pos + n * r].reshape(n, r)
            a = z[pos + n * r:pos + (m + n) * r].reshape(m, r)
            E[e.offset:e.offset + e.size] = (sigma / math.sqrt(r) * a @ b.T).ravel()
            pos += (m + n) * r
        else:
            E[e.offset:e.offset + e.size] = sigma * z[pos:pos + e.size]
            pos += e.size
    return dict(good["eggroll"], perturbation=E)


def wrong_restart_stream(kit, good, layout):
    f = load(kit, "restart")
    out = dict(good["restart"])
    out["philox_after"] = np.array([np.array(philox4x32_10(0, 0, int(to), int(e) + int(r) + 1,
                                                           *stream_key(int(f["seed"]))), np.uint32)
                                    if a == "restart" else np.zeros(4, np.uint32)
                                    for to, e, r, a in zip(good["restart"]["rollback_to"], f["expert"], f["restarts"],
                                                           good["restart"]["action"])])
    return out


def wrong_es_ranks(kit, good, layout):
    out = dict(good["es"])
    out["ranks"] = centered_ranks(np.stack([out["plus"], out["minus"]], axis=1).ravel())  # of the losses
    return out


def wrong_adam_bias_correction(kit, good, layout):
    f = load(kit, "adam")
    out = dict(good["adam"])
    t = int(f["step"])  # not step + 1
    m_hat = out["m_new"] / (1 - float(f["beta1"]) ** t)
    v_hat = out["v_new"] / (1 - float(f["beta2"]) ** t)
    lr, wd = float(f["lr"]), float(f["weight_decay"])
    out["theta_new"] = f["theta"] - lr * m_hat / (np.sqrt(v_hat) + 1e-8) - lr * wd * f["theta"]
    return out


def wrong_momentum_dampening(kit, good, layout):
    f = load(kit, "momentum")
    b = float(f["momentum"])
    return dict(good["momentum"], m_new=b * f["m"] + (1 - b) * good["momentum"]["ghat"])


def _misclipped(kit, good, start: int, reference):
    """Clip alone with a misread rule: bounded from `start` steps on, at clip_at x reference(m, g)."""
    f = load(kit, "shaping")
    steps, m = int(f["clip_state"][0]), float(f["clip_state"][1])
    rows = []
    for g in f["scalars"]:
        if np.all(np.isfinite(g)):
            if steps >= start:
                ref = reference(m, g)
                g = np.clip(g, -f["clip_at"] * ref, f["clip_at"] * ref)
            m = 0.98 * m + 0.02 * float(np.median(np.abs(g)))
            steps += 1
        rows.append(g)
    return dict(good["shaping"], clip_scalars=np.array(rows))


def wrong_clip_bound(kit, good, layout):
    """Bounded with this step's median folded in first."""
    return _misclipped(kit, good, 10, lambda m, g: 0.98 * m + 0.02 * float(np.median(np.abs(g))))


def wrong_clip_start(kit, good, layout):
    """The clip bound applied from steps > 10, one step late (row 4 is the first it binds)."""
    return _misclipped(kit, good, 11, lambda m, g: m)


def wrong_healthy_index(kit, good, layout):
    """healthy[s] read as the state after the 0-based step s (s + 1 records)."""
    h = good["restart"]["healthy"]
    return dict(good["restart"], healthy=np.concatenate([h[:, :1] | True, h[:, 2:], h[:, :1] & False], axis=1))


def wrong_rollback_boundary(kit, good, layout):
    """A checkpoint eligible only when its step < window_start - 1."""
    f, out = load(kit, "restart"), good["restart"]
    to = []
    for n in range(len(f["length"])):
        course = [int(c) for c in f["checkpoints"][n] if c >= 0]
        if out["rollback_to"][n] < 0:
            to.append(-1)
            continue
        ok = [c for c in course if c < out["window_start"][n] - 1 and out["healthy"][n][c]]
        to.append(ok[-1] if ok else course[0])
    return dict(out, rollback_to=np.array(to))


def _half_up(x):
    return np.floor(np.asarray(x, np.float64) + 0.5)


def wrong_int8_rounding(kit, good, layout):
    """int8 rounding half up (floor(x + 0.5)), as a shift-and-add rounding does, everywhere."""
    f = load(kit, "int8")
    out = dict(good["int8"])
    out["edge_q"] = np.clip(_half_up(f["edge_tensor"] / f["edge_scale"]), -127, 127)
    out["edge_qz"] = np.clip(_half_up(f["edge_z"] * precision.Q_GATE), -32768, 32767)
    a = f["edge_activations"].astype(np.float64)
    out["edge_cells"] = np.clip(_half_up(a[:, 1] * f["edge_c"] / precision.Q_ACT
                                         + a[:, 0] * a[:, 2] / precision.Q_ACT ** 2 * precision.Q_CELL),
                                -32768, 32767)
    return out


def wrong_fp16_flush(kit, good, layout):
    out = dict(good["fp16"])
    r = out["edge_rounded"]
    out["edge_rounded"] = np.where(np.abs(r) < 2.0 ** -14, 0.0, r).astype(np.float32)
    return out


def wrong_bf16_direct(kit, good, layout):
    x = load(kit, "bf16")["edge_wide"]
    m, e = np.frexp(x)  # float64 rounded once, straight to 8 significant bits
    return dict(good["bf16"], edge_wide_rounded=np.ldexp(np.rint(m * 256) / 256, e))


def wrong_rollback_fallback(kit, good, layout):
    """With no eligible checkpoint, the course's newest instead of its oldest."""
    f, out = load(kit, "restart"), good["restart"]
    to = []
    for n in range(len(f["length"])):
        course = [int(c) for c in f["checkpoints"][n] if c >= 0]
        ok = [c for c in course if c < out["window_start"][n] and out["healthy"][n][c]]
        to.append(-1 if out["rollback_to"][n] < 0 else ok[-1] if ok else course[-1])
    return dict(out, rollback_to=np.array(to))


def wrong_single_rounding_h(kit, good, layout):
    """h = R(o tanh(c)): tanh(c) not rounded to the format before the product."""
    f = load(kit, "bf16")
    o, c = f["edge_activations"][:, 3].astype(np.float64), f["edge_cells"].astype(np.float64)
    return dict(good["bf16"], edge_hidden=precision.round_to(o * np.tanh(c), "bf16"))


def wrong_bf16_nan_carry(kit, good, layout):
    """NaNs rounded by the numbers' rule: the carry makes a low payload inf (or -0)."""
    u = load(kit, "bf16")["edge_values"].view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return dict(good["bf16"], edge_rounded=r)


def wrong_fp16_nan_payload(kit, good, layout):
    """NumPy's float16 cast: a signalling NaN stays signalling (the rule quiets it), a NaN's sign kept."""
    x = load(kit, "fp16")["edge_values"]
    with np.errstate(over="ignore"):
        return dict(good["fp16"], edge_rounded=x.astype(np.float16))


def wrong_router_ties(kit, good, layout):
    """Exact ties to the higher index (a descending sort of the weights, not stable)."""
    d = load(kit, "router")["tie_distances"].astype(np.float64)
    N, k = d.shape[1], good["router"]["experts"].shape[1]
    experts = N - 1 - np.argsort(d[:, ::-1], axis=1, kind="stable")[:, :k]
    return dict(good["router"], tie_experts=experts)


def wrong_es_tie_average(kit, good, layout):
    """Tied fitness given the average of their ranks (scipy.stats.rankdata's default)."""
    f = -load(kit, "es")["tie_losses"]
    ranks = np.array([np.flatnonzero(np.sort(f) == v).mean() for v in f])
    return dict(good["es"], tie_ranks=ranks / (f.size - 1) - 0.5)


def wrong_unshaped_train(kit, good, layout):
    """The default run's loop without its default shaping (the scalars as they are)."""
    return porting_port.port_train(kit, layout, stage="train_normalize", shape=lambda g: g)


def wrong_normalize_before_33(kit, good, layout):
    """Normalize as the independent port wrote it before the rule changed: W steps as they are, then their mean."""
    def shape(scalars):
        W, steps, total, rows = int(load(kit, "train_normalize")["normalize_window"]), 0, 0.0, []
        for g in scalars:
            if np.all(np.isfinite(g)):
                s = float(np.sqrt(np.mean(g * g)))
                g = g if steps < W else g * (total / steps) / s
                steps, total = (steps + 1, total + s) if steps < W else (steps, total)
            rows.append(g)
        return np.array(rows)
    return porting_port.port_train(kit, layout, stage="train_normalize", shape=shape)


def wrong_approx_segment_start(kit, good, layout):
    def strict(x, mode):  # PLAN's segments applied only past their start
        y = approx_activations.sigmoid(x, mode)
        below = approx_activations.sigmoid(np.nextafter(x, np.float32(0)), mode)
        return np.where(np.isin(np.abs(x), np.float32(2.375)), below, y)
    return porting_port.port_approx(kit, layout, sigmoid=strict)


WRONG = [  # (stage, output, the wrong port, what the checker should say it looks like)
    ("forward", "gates0", wrong_orientation, "torch's (out, in) layout"),
    ("forward", "activations0", wrong_activation_order, "gate blocks in the order i, f, o, g"),
    ("noise", "philox", wrong_counter_layout, "counter (block, step, member, expert)"),
    ("spsa_step", "theta_new", wrong_scheduled_lr, "lr scheduled again"),
    ("spsa_step", "theta_new", wrong_own_scalars, "the port's own scalars"),
    ("onesided_step", "losses", wrong_onesided_pairs, "antithetic pairs"),
    ("onesided_step", "scalars", wrong_onesided_two_eps, "divided by 2 eps"),
    ("onesided_step", "theta_new", wrong_onesided_over_p, "1/P instead of 1/(2P)"),
    ("train", "theta_final", wrong_unscheduled_train, "lr not scheduled"),
    ("train", "theta_final", wrong_skip_counter, "does not advance the step counter"),
    ("schedule", "rates", wrong_cosine_end, "cosine reaching 0 at the last step"),
    ("init", "theta", wrong_init_bounds, "1/sqrt(fan-in)"),
    ("batches", "draws", wrong_batch_windows, "concatenated text"),
    ("router", "experts", wrong_topk_order, "index order"),
    ("router", "features", wrong_tf_of_empty_buckets, "an empty bucket's tf must be 0"),
    ("eggroll", "perturbation", wrong_eggroll_factor_order, "B sliced before A"),
    ("restart", "philox_after", wrong_restart_stream, "offset by restarts"),
    ("es", "ranks", wrong_es_ranks, "ranks of the losses"),
    ("adam", "theta_new", wrong_adam_bias_correction, "t = step (not step + 1)"),
    ("momentum", "m_new", wrong_momentum_dampening, "dampened"),
    ("shaping", "clip_scalars", wrong_clip_bound, "this step's median"),
    ("shaping", "clip_scalars", wrong_clip_start, "one step late"),
    ("restart", "healthy", wrong_healthy_index, "after the 0-based step s"),
    ("restart", "rollback_to", wrong_rollback_boundary, "window_start - 1"),
    ("int8", "edge_q", wrong_int8_rounding, "round half up"),
    ("fp16", "edge_rounded", wrong_fp16_flush, "subnormals flushed"),
    ("bf16", "edge_wide_rounded", wrong_bf16_direct, "skipping fp32"),
    ("restart", "rollback_to", wrong_rollback_fallback, "the course's newest"),
    ("bf16", "edge_hidden", wrong_single_rounding_h, "one rounding"),
    ("bf16", "edge_rounded", wrong_bf16_nan_carry, "through the carry"),
    ("router", "tie_experts", wrong_router_ties, "higher index"),
    ("es", "tie_ranks", wrong_es_tie_average, "averaged"),
    ("train_normalize", "shaped", wrong_unshaped_train, "no shaping"),
    ("train_normalize", "shaped", wrong_normalize_before_33, "before the change log"),
    ("approx", "plan_sigmoid", wrong_approx_segment_start, "only past its start"),
    # no look-alike to name: the checker says what the port's NaN or all-zero input does
    ("router", "features", wrong_zero_norm, None),
    ("fp16", "edge_rounded", wrong_fp16_nan_payload, None),
]


@pytest.mark.parametrize("stage, output, port, looks_like", WRONG, ids=[w[2].__name__[6:] for w in WRONG])
def test_a_wrong_reading_fails_its_stage_with_its_hint(kit, good, layout, tmp_path, stage, output, port, looks_like):
    folder = tmp_path / "port"
    folder.mkdir()
    np.savez(folder / f"{stage}.npz", **port(kit, good[1], layout))
    out = io.StringIO()
    assert check_port.check(kit, folder, out=out, stages=[stage]) == 1, out.getvalue()
    text = out.getvalue()
    assert f"[FAIL] {output}:" in text and f"[FAIL] {stage}:" in text, text
    hint = _manifest(kit)[stage]["outputs"][output]["hint"]
    assert f"[FAIL] {output}:" in text.split(f"hint: {hint}")[0], text  # the output's own hint, after its line
    if looks_like:
        line = text.split(f"[FAIL] {output}:")[1].split("\n  [")[0]
        assert "looks like:" in line and looks_like in line, text
    elif stage == "fp16":
        assert "NaN not bit for bit the kit's" in text
    else:
        assert "NaN or inf from the port" in text and "an all-zero x stays zero" in text


@pytest.mark.subprocess
def test_the_checker_takes_a_stage_and_refuses_an_unknown_one(kit, good):
    run = lambda *a: subprocess.run([sys.executable, str(kit / "check_port.py"), str(kit), str(good[0]), *a],  # noqa
                                    capture_output=True, text=True)
    one = run("--stage", "router", "--stage", "int8", "--strict")
    assert one.returncode == 0, one.stdout
    assert "[PASS] router" in one.stdout and "[PASS] int8" in one.stdout and "] forward" not in one.stdout
    assert "stages: 2 passed; 0 failed; 0 skipped" in one.stdout
    bad = run("--stage", "routing")
    assert bad.returncode == 2 and bad.stdout.startswith("error: no stage 'routing' in the kit (its stages: forward,")


def test_a_port_value_off_the_formats_grid_fails(kit, good, tmp_path):
    """A 16-bit format's outputs must be values of the format: a float32 value one float32 ulp off
    a bf16 value is not within "one value of the format" even though it is numerically closer."""
    folder = tmp_path / "port"
    folder.mkdir()
    out = dict(good[1]["bf16"])
    out["gates0"] = np.nextafter(out["gates0"].astype(np.float32), np.float32(np.inf))
    np.savez(folder / "bf16.npz", **out)
    text = io.StringIO()
    assert check_port.check(kit, folder, out=text, stages=["bf16"]) == 1
    assert "values that are not bf16 values (round to the format)" in text.getvalue()


def test_porting_md_names_every_stage_input_output_and_setting(kit):
    """The specification and the kit stay one: PORTING.md names (in backticks) every stage and
    every input, output and setting of each (a per-layer name as name{l}, shaping's per chain as
    <chain>_scalars and <chain>_<piece>_states)."""
    text = (Path(__file__).resolve().parents[1] / "PORTING.md").read_text()
    missing = []
    for name, stage in _manifest(kit).items():
        if f"`{name}`" not in text:
            missing.append(name)
        for kind in ("inputs", "outputs", "settings"):
            for n in stage[kind]:
                chain = re.sub(r"^(clip_normalize|clip|normalize)_", "<chain>_", n)
                forms = {n, re.sub(r"\d+$", "{l}", n), chain, re.sub(r"^<chain>_(clip|normalize)_", "<chain>_<piece>_",
                                                                      chain)}
                if not any(f"`{f}`" in text for f in forms):
                    missing.append(f"{name}.{n}")
    assert not missing, missing


def _margin(got, want, tol) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / (tol["atol"] + tol["rtol"] * np.abs(want))))


def _members(f, layout, scale, kind, wide):
    """The 2P members theta +/- scale delta_k, built in float32 or in float64 then rounded."""
    t = f["theta"]
    d = [noise(layout.size, int(f["seed"]), int(f["expert"]), int(f["step"]), k, kind=kind) for k in range(int(f["P"]))]
    return np.stack([(t.astype(np.float64) + s * scale * dk.astype(np.float64)).astype(np.float32) if wide
                     else t + np.float32(s * scale) * dk for dk in d for s in (1, -1)])


def test_each_open_precision_is_free_within_its_tolerance(kit, layout):
    """The precisions PORTING.md leaves free, each way, pass with a wide margin (the figures the
    spec quotes): members built in float32 or in float64 then rounded; the update in float32 or
    float64; EGGROLL's A B^T in float32 or float64; the router's distances directly or expanded;
    the 16-bit formats' logits summed in any order (at most one value of the format apart)."""
    tol = {name: s["outputs"] for name, s in _manifest(kit).items()}
    margins = {}
    for stage, scale, kind in (("spsa_step", "eps", "rademacher"), ("es", "sigma", "gaussian")):
        f = load(kit, stage)
        for wide in (False, True):
            losses = forward.population_loss(_members(f, layout, float(f[scale]), kind, wide), layout, f["batch"])
            margins[f"{stage} members {'float64' if wide else 'float32'}"] = max(
                _margin(losses[0::2], f["plus"], tol[stage]["plus"]), _margin(losses[1::2], f["minus"], tol[stage]["minus"]))
    f = load(kit, "spsa_step")
    P, lr = int(f["P"]), float(f["lr"])
    d = np.stack([noise(layout.size, int(f["seed"]), int(f["expert"]), int(f["step"]), k) for k in range(P)])
    wide = (f["theta"].astype(np.float64) - lr * (f["scalars"] @ d.astype(np.float64)) / P).astype(np.float32)
    margins["update float64"] = _margin(wide, f["theta_new"], tol["spsa_step"]["theta_new"])
    margins["update float32"] = _margin(porting_port.port_spsa(kit, layout)["theta_new"], f["theta_new"],
                                        tol["spsa_step"]["theta_new"])
    f = load(kit, "eggroll")
    args = (float(f["sigma"]), int(f["rank"]), int(f["seed"]), int(f["expert"]), int(f["step"]), 0)
    for dtype in (np.float32, np.float64):
        margins[f"A B^T {dtype.__name__}"] = _margin(noise_spec.materialise(layout, *args, dtype).astype(np.float32),
                                                     f["perturbation"], tol["eggroll"]["perturbation"])
    f = load(kit, "router")
    e, c = f["embeddings"].astype(np.float32), f["centroids"].astype(np.float32)
    margins["distances direct"] = _margin(((e[:, None] - c[None]) ** 2).sum(-1), f["distances"],
                                          tol["router"]["distances"])
    expanded = np.maximum((e * e).sum(1)[:, None] - 2 * e @ c.T + (c * c).sum(1)[None], 0)
    margins["distances expanded"] = _margin(expanded, f["distances"], tol["router"]["distances"])
    assert max(margins.values()) < 0.1, margins
    for fmt in ("bf16", "fp16"):
        f = load(kit, fmt)
        w = layout.views(precision.round_to(f["theta"], fmt))
        h = f[f"hidden{layout.config.layers - 1}"].astype(np.float32)
        for S in (h @ w["out.w"], h[..., ::-1] @ w["out.w"][::-1]):  # two orders of the fp32 sum
            logits = precision.round_to(S.astype(np.float64) + w["out.b"], fmt)
            assert check_port.compare("logits", logits, f["logits"], 0, 0, 1, fmt)[0]
