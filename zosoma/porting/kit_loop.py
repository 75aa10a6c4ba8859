"""The porting kit's training-loop stages: N steps of the loop (plain, and under the default
shaping), coefficient shaping over many steps with its state, and the restart rule.

Each reference is computed with zosoma's own pieces (zosoma.corpus, zosoma.strategies,
zosoma.training.guard), the update in float64 from the kit's scalars, so a port's rounding never
compounds from one check into the next. PORTING.md (stages 5, 7 and 8) is the specification these
vectors serve.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zosoma.config import TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.model.noise import philox4x32_10, stream_key
from zosoma.model.params import Layout
from zosoma.porting.kit_data import B_LOOP, T_LOOP, small_corpus, text_inputs
from zosoma.porting.kit_training import directions, member_losses
from zosoma.porting.stage import Out, Stage
from zosoma.training.guard import DivergenceGuard, healthy_steps, rollback_index, window_for
from zosoma.training.stepper import RESTART_STREAM, stream
from zosoma.strategies.base import learning_rate
from zosoma.strategies.shaping import Chain
from zosoma.strategies.shaping.normalize import CAP as NORMALIZE_CAP, WARMUP as NORMALIZE_WARMUP

# --- N steps of training ----------------------------------------------------------------------------

LOOP = dict(P=4, eps=1e-3, lr=0.1, warmup=5, steps=24, weight_decay=0.01, stream=3, fault_step=9)
# zosoma's default shaping over a run long enough to see all of it: measuring (steps 0-9), held while
# measuring (10-49), frozen (50 on); the fault step is inside the hold
LOOP_NORMALIZE = dict(LOOP, steps=64, stream=4, fault_step=23, normalize_window=50)


def train_stage(theta, layout: Layout, seed: int, shaping: str = "none") -> Stage:
    """LOOP["steps"] steps of ZO-SGD with weight decay from theta, every step's batch, rate,
    losses and scalars, and theta at the end; step fault_step's member 0 returns a NaN loss (as
    a diverged forward would), so that step is skipped. With shaping "normalize" (stage
    train_normalize, LOOP_NORMALIZE), every step's scalars are shaped before the update, and the
    shaped scalars and normalize's state are outputs too."""
    normalize = shaping == "normalize"
    c = dict(LOOP_NORMALIZE if normalize else LOOP, seed=2**33 + 11 + seed)
    pieces = Chain(TrainConfig(optimizer="sgd", shaping=("normalize",), normalize_window=LOOP_NORMALIZE["normalize_window"]))
    state = {"normalize": pieces.init()["normalize"]} if normalize else {}
    shaped_rows, states = [], []
    corpus = small_corpus()
    sampler = BatchSampler(corpus, T_LOOP + 1)
    P, eps, N, wd = c["P"], c["eps"], c["steps"], c["weight_decay"]
    theta64 = theta.astype(np.float64)
    batches, rates, plus, minus, all_deltas = [], [], [], [], []
    for t in range(N):
        batch = sampler.batch(c["seed"], c["stream"], t, B_LOOP)
        deltas = directions(layout.size, P, c["seed"], c["stream"], t, "rademacher")
        losses = member_losses(layout, batch, [theta64 + s * eps * d for d in deltas for s in (1, -1)])
        if t == c["fault_step"]:
            losses[0] = np.nan
        lr_t = learning_rate(t, c["lr"], N, c["warmup"], "cosine")
        g = (losses[0::2] - losses[1::2]) / (2 * eps)
        if normalize:
            g, state, _ = pieces(g, state)
            shaped_rows.append(np.asarray(g, np.float64))
            states.append([float(v) for v in state["normalize"].values()])
        if np.all(np.isfinite(g)):
            theta64 = theta64 - lr_t * (g @ deltas) / P - lr_t * wd * theta64
        batches.append(batch)
        rates.append(lr_t)
        plus.append(losses[0::2])
        minus.append(losses[1::2])
        all_deltas.append(deltas)
    plus, minus = np.array(plus), np.array(minus)
    scalars = (plus - minus) / (2 * eps)
    rates = np.array(rates)
    rows = np.array(shaped_rows) if normalize else scalars  # what each update uses

    def replay(lr_of, counter_of=lambda t: t, decay=lambda t64, lr: lr * wd * t64) -> np.ndarray:
        th = theta.astype(np.float64)
        for t in range(N):
            if np.all(np.isfinite(rows[t])):
                d = all_deltas[t] if counter_of(t) == t else directions(layout.size, P, c["seed"], c["stream"],
                                                                          counter_of(t), "rademacher")
                th = th - lr_of(t) * (rows[t] @ d) / P - decay(th, lr_of(t))
        return th

    lag = lambda t: t if t <= c["fault_step"] else t - 1  # noqa: E731  the counter not advanced by the skip
    inputs = {"theta": (theta, "(d,) float32 theta at step 0"), **text_inputs(corpus),
              "T": (np.int64(T_LOOP), "a window is T + 1 bytes"), "B": (np.int64(B_LOOP), "windows per batch"),
              "P": (np.int64(P), "pairs"), "eps": (np.float64(eps), "the perturbation scale"),
              "lr": (np.float64(c["lr"]), "the PEAK rate: schedule it (warm-up, cosine to steps)"),
              "warmup": (np.int64(c["warmup"]), "warm-up steps"),
              "steps": (np.int64(N), "the run's length (the schedule's total) and the steps taken"),
              "weight_decay": (np.float64(wd), "decoupled"), "seed": (np.uint64(c["seed"]), "the run's seed"),
              "stream": (np.int64(c["stream"]), "the expert word of the counters and the batch stream (expert 3, "
                                                 "no restarts)"),
              "fault_step": (np.int64(c["fault_step"]), "at this step member 0's L+ is NaN (a diverged forward)")}
    step_needs = ("theta", "scalars (kit's, earlier steps)", "lr", "warmup", "steps", "weight_decay", "seed", "stream")
    outputs = {
        "batches": Out(np.stack(batches), "exact", ("text", "offsets", "T", "B", "seed", "stream"),
                       "batch of step t drawn at counter t (the batches stage), skipped steps included"),
        "rates": Out(rates, "rate", ("lr", "warmup", "steps"), "the cosine schedule of the run, step t's rate"),
        "plus": Out(plus, "loss", step_needs + ("batches (kit's)", "eps", "fault_step"),
                    "L+ of step t at YOUR theta of step t (made from the kit's scalars of the steps before); "
                    "member 0 of fault_step is NaN"),
        "minus": Out(minus, "loss", step_needs + ("batches (kit's)", "eps"), "L- of step t at your theta of step t"),
        "scalars": Out(scalars, "scalars", ("plus", "minus", "eps"), "(L+ - L-) / (2 eps) of each step"),
        "theta_final": Out(theta64, "trajectory", step_needs + ("P",),
                           "theta after the steps, each updated from the KIT's scalars of that step with that "
                           "step's scheduled rate and counter; a step with a non-finite scalar is skipped (no "
                           "update) but counts: the counter, the schedule and the batches move on"),
    }
    misreadings = {"theta_final": [
        ("lr not scheduled (the peak rate every step)", replay(lambda t: c["lr"])),
        ("a skipped step does not advance the step counter", replay(lambda t: rates[lag(t)], lag)),
        ("no weight decay", replay(lambda t: rates[t], decay=lambda t64, lr: 0.0)),
        ("weight decay of the new theta (theta - lr ghat)(1 - lr wd)",
         _replay_coupled(theta, rows, all_deltas, rates, wd, P))]}
    settings = {"optimizer": ("sgd", "ZO-SGD"), "noise": ("rademacher", ""),
                "shaping": ("none", "plain scalars: no shaping (zosoma's default, normalize, is stage "
                                    "train_normalize's)"),
                "schedule": ("cosine", ""), "restarts": (0, "none: stream = expert")}
    if not normalize:
        return Stage("train", f"{N} steps of training: batches, schedule, noise counters, a skipped step, weight "
                              "decay; theta at the end", inputs, outputs, settings=settings, misreadings=misreadings)
    W = c["normalize_window"]
    inputs["normalize_window"] = (np.int64(W), "W: normalize's window (zosoma's default, 50)")
    outputs["shaped"] = Out(rows, "host64", ("scalars (kit's)", "normalize_window"),
                            "normalize (stage 7) applied to the KIT's scalars of each step, its state carried from "
                            "step 0 (steps 0, sum 0): steps 0-9 as they are, then held to the mean spread of the steps "
                            "before (each entering at most at twice it), frozen after W steps; a skipped step "
                            "passes through and leaves the state")
    outputs["normalize_states"] = Out(np.array(states), "host64", ("scalars (kit's)", "normalize_window"),
                                      "normalize's state [steps, sum] after each step")
    outputs["theta_final"] = dataclasses.replace(outputs["theta_final"], needs=step_needs + ("P", "shaped (kit's)"),
                                                 hint="theta after the steps, each updated from the KIT's shaped "
                                                      "scalars of that step with its scheduled rate and counter; a "
                                                      "skipped step counts but makes no update")
    misreadings["shaped"] = [("no shaping (the stage's shaping is normalize, zosoma's default)", scalars),
                             ("normalize's rule before the change log's 2026-12-03 entry: the first W steps as they "
                              "are, then the mean of their spreads", _normalize_before_33(scalars, W))]
    settings["shaping"] = ("normalize", "zosoma's default: every step's scalars shaped before the update")
    return Stage("train_normalize", f"{N} steps of training under zosoma's default shaping (normalize, W = {W}): "
                                    "the train stage's loop with every step's scalars normalized before the update",
                 inputs, outputs, settings=settings, misreadings=misreadings)


def _normalize_before_33(scalars, W: int) -> np.ndarray:
    """Normalize as it was before issue 33 (the independent port's reading): steps 0 .. W-1 unscaled,
    recording their spreads; then every step held to their mean."""
    steps, total, out = 0, 0.0, []
    for g in scalars:
        if not np.all(np.isfinite(g)):
            out.append(g)
            continue
        s = float(np.sqrt(np.mean(g * g)))
        out.append(g if steps < W else g * (total / steps) / s)
        if steps < W:
            steps, total = steps + 1, total + s
    return np.array(out)


def _replay_coupled(theta, scalars, deltas, rates, wd, P) -> np.ndarray:
    th = theta.astype(np.float64)
    for g, d, lr in zip(scalars, deltas, rates):
        if np.all(np.isfinite(g)):
            th = (th - lr * (g @ d) / P) * (1 - lr * wd)
    return th


# --- coefficient shaping -----------------------------------------------------------------------------

SHAPING = dict(clip_at=3.0, normalize_window=14, nan_row=14, outlier_row=20, first_clipped_row=4, rows=30)
# normalize measures rows 0-1, holds rows 2-5 to its reference as it still measures (row 4's outlier
# enters it bounded), then holds every row to the frozen reference
STATE_IN = {"clip": {"steps": 6, "median": 0.8}, "normalize": {"steps": 8, "sum": 7.2}}


def shaping_stage(rng) -> Stage:
    S, P = SHAPING["rows"], 4
    scalars = rng.normal(0.0, 1.0, (S, P)) * np.exp(rng.normal(0.0, 0.3, (S, 1)))
    scalars[SHAPING["outlier_row"], 1] *= 40.0
    scalars[SHAPING["first_clipped_row"], 0] = 12.0  # clip's steps reach 10 here: the bound must bind
    scalars[SHAPING["nan_row"], 2] = np.nan
    outputs, inputs = {}, {"scalars": (scalars, "(S, P) float64 each step's scalars (row 14 has a NaN: a skipped step; rows 4, "
                                      "the first clipped, and 20 an outlier)"),
                           "clip_at": (np.float64(SHAPING["clip_at"]), "the bound in running medians"),
                           "normalize_window": (np.int64(SHAPING["normalize_window"]), "W"),
                           "clip_state": (np.array([STATE_IN["clip"]["steps"], STATE_IN["clip"]["median"]]),
                                          "clip's state before row 0: [steps, median]"),
                           "normalize_state": (np.array([STATE_IN["normalize"]["steps"], STATE_IN["normalize"]["sum"]]),
                                               "normalize's state before row 0: [steps, sum of (bounded) spreads]")}
    for chain in (("clip",), ("normalize",), ("clip", "normalize")):
        name = "_".join(chain)
        shaped, states = _shape(chain, scalars, SHAPING["clip_at"], SHAPING["normalize_window"])
        needs = ("scalars",) + tuple(x for p in chain for x in ({"clip": "clip_at", "normalize": "normalize_window"}[p],
                                                                 f"{p}_state"))
        outputs[f"{name}_scalars"] = Out(shaped, "host64", needs,
                                         f"the pieces {' then '.join(chain)} applied row by row, each state carried "
                                         "from row to row; a row with a non-finite scalar passes through untouched")
        for piece in chain:
            outputs[f"{name}_{piece}_states"] = Out(
                states[piece], "host64", needs,
                "each row's state after it: clip [steps, median EMA], normalize [steps, sum of spreads]; a "
                "skipped row leaves it as it was")
    misreadings = {"clip_scalars": [("bound from this step's median (not the steps' before)",
                                     _clip_variant(scalars, "current")),
                                    ("the bound applied from steps > 10, one step late (steps >= 10)",
                                     _clip_variant(scalars, "late"))],
                   "clip_clip_states": [("median EMA updated from the unclipped scalars",
                                         _clip_variant(scalars, "unclipped"))],
                   "normalize_scalars": [("the reference spread includes this step",
                                          _normalize_variant(scalars))]}
    return Stage("shaping", "coefficient shaping: clip, normalize and both in order, over many steps with their "
                            "state in and out", inputs, outputs, misreadings=misreadings)


def _shape(chain, scalars, clip_at, window) -> tuple:
    cfg = TrainConfig(optimizer="sgd", shaping=chain, clip_at=clip_at, normalize_window=window)
    pieces = Chain(cfg)
    state = {k: dict(v) for k, v in STATE_IN.items() if k in chain}
    shaped, states = [], {p: [] for p in chain}
    for row in scalars:
        g, state, _ = pieces(row, state)
        shaped.append(np.asarray(g, np.float64))
        for p in chain:
            states[p].append([float(v) for v in state[p].values()])
    return np.array(shaped), {p: np.array(v) for p, v in states.items()}


def _clip_variant(scalars, how: str) -> np.ndarray:
    """Clip alone under a misreading: returns the scalars ("current", "late") or the states ("unclipped")."""
    steps, m = STATE_IN["clip"]["steps"], STATE_IN["clip"]["median"]
    out, states = [], []
    for g in scalars:
        if not np.all(np.isfinite(g)):
            out.append(g)
            states.append([steps, m])
            continue
        raw = g
        if steps >= 10 + (how == "late"):
            ref = (0.98 * m + 0.02 * float(np.median(np.abs(g)))) if how == "current" else m
            g = np.clip(g, -SHAPING["clip_at"] * ref, SHAPING["clip_at"] * ref)
        med = float(np.median(np.abs(raw if how == "unclipped" else g)))
        m = med if steps == 0 else 0.98 * m + 0.02 * med
        steps += 1
        out.append(g)
        states.append([steps, m])
    return np.array(states) if how == "unclipped" else np.array(out)


def _normalize_variant(scalars) -> np.ndarray:
    """Normalize alone, misread: a step held while the reference still measures is held to a
    reference that already has the step's own (bounded) spread in it."""
    steps, total = STATE_IN["normalize"]["steps"], STATE_IN["normalize"]["sum"]
    window, out = SHAPING["normalize_window"], []
    for g in scalars:
        if not np.all(np.isfinite(g)):
            out.append(g)
            continue
        s = float(np.sqrt(np.mean(g * g)))
        held = steps >= min(NORMALIZE_WARMUP, window)
        if steps < window:
            entry = min(s, NORMALIZE_CAP * total / steps) if steps >= NORMALIZE_WARMUP else s
            steps, total = steps + 1, total + entry
        out.append(g * (total / steps) / s if held else g)
    return np.array(out)


# --- the restart rule ----------------------------------------------------------------------------------

def _scenarios(rng) -> list[dict]:
    """Guard histories: a rising loss (restart), a run of non-finite steps (restart, second time), the
    same with no checkpoint before the window (several inside it: the course's oldest), one past max_restarts (drop), and
    the non-finite run with a checkpoint at the step just before the window (it is the one)."""
    def decay(n):
        return 3.0 + 2.5 * np.exp(-np.arange(n) / 40.0) + rng.normal(0.0, 0.03, n)

    a = decay(300)
    a[165:175] += 10.0  # a bump: unhealthy for a while (the checkpoint at 200 with it), shorter than the window
    a[222:] += 3.0  # then for good
    b = decay(240)
    skipped_b = np.zeros(240, bool)
    skipped_b[160:180] = True
    b[160:180] = np.nan
    return [dict(losses=a, skipped=np.zeros(300, bool), run_steps=400, restarts=0, expert=1,
                 checkpoints=[50, 100, 150, 200, 250]),
            dict(losses=b, skipped=skipped_b, run_steps=400, restarts=1, expert=2, checkpoints=[100, 125, 150, 175]),
            dict(losses=b, skipped=skipped_b, run_steps=400, restarts=1, expert=2, checkpoints=[165, 170, 175]),
            dict(losses=a, skipped=np.zeros(300, bool), run_steps=400, restarts=3, expert=0,
                 checkpoints=[100, 150, 200, 250]),
            dict(losses=b, skipped=skipped_b, run_steps=400, restarts=0, expert=3, checkpoints=[150, 160])]


RESTART = dict(max_restarts=3, factor=0.5, lr=0.1, warmup=20, schedule="cosine", after=3)


def _rollback_variant(scen, out) -> np.ndarray:
    """rollback_to with the window's start misread one step early."""
    rows = []
    for s, start, to, healthy in zip(scen, out["window_start"], out["rollback_to"], out["healthy"]):
        if to < 0:
            rows.append(to)
            continue
        rows.append(s["checkpoints"][rollback_index(s["checkpoints"], start - 1, lambda c: bool(healthy[c]))])
    return np.array(rows)


def restart_stage(seed: int) -> Stage:
    rng = np.random.default_rng([seed, 0x5E5])
    scen = _scenarios(rng)
    S = max(len(s["losses"]) for s in scen)
    corpus = small_corpus()
    sampler = BatchSampler(corpus, T_LOOP + 1)
    run_seed = 2**34 + 77 + seed
    out = {k: [] for k in ("window", "verdict_step", "verdict", "smoothed", "best", "window_start", "healthy",
                           "action", "rollback_to", "lr_scale", "stream", "batches_after", "rates_after",
                           "philox_after")}
    for s in scen:
        metrics = [{"step": k + 1, "loss": float(v), "skipped": bool(sk)} for k, (v, sk) in
                   enumerate(zip(s["losses"], s["skipped"]))]
        window = window_for(s["run_steps"])
        guard, verdict_at, verdict = DivergenceGuard(window), 0, ""
        for rec in metrics:
            said = guard.observe(rec["loss"], rec["skipped"])
            if said:
                verdict_at, verdict = rec["step"], said.split(":")[0]
                break
        ok = healthy_steps(metrics[:verdict_at] if verdict_at else metrics)  # the history at the verdict
        healthy = np.array([k in ok for k in range(S + 1)])
        start = guard.window_start()
        dropped = s["restarts"] >= RESTART["max_restarts"]
        restarts = s["restarts"] if dropped else s["restarts"] + 1
        to = -1 if dropped else s["checkpoints"][rollback_index(s["checkpoints"], start, ok.__contains__)]
        scale = RESTART["factor"] ** restarts
        stream_ = stream(s["expert"], restarts)
        out["window"].append(window)
        out["verdict_step"].append(verdict_at)
        out["verdict"].append(verdict)
        out["smoothed"].append(guard.smoothed)
        out["best"].append(guard.best)
        out["window_start"].append(start)
        out["healthy"].append(healthy)
        out["action"].append("drop" if dropped else "restart")
        out["rollback_to"].append(to)
        out["lr_scale"].append(scale)
        out["stream"].append(stream_)
        steps_after = [max(to, 0) + j for j in range(RESTART["after"])]
        out["batches_after"].append(np.zeros((RESTART["after"], B_LOOP, T_LOOP + 1), np.uint8) if dropped else
                                    np.stack([sampler.batch(run_seed, stream_, t, B_LOOP) for t in steps_after]))
        out["rates_after"].append(np.zeros(RESTART["after"]) if dropped else np.array(
            [learning_rate(t, RESTART["lr"], s["run_steps"], RESTART["warmup"], RESTART["schedule"]) * scale
             for t in steps_after]))
        out["philox_after"].append(np.zeros(4, np.uint32) if dropped else np.array(
            philox4x32_10(0, 0, to, stream_, *stream_key(run_seed)), np.uint32))
    assert out["action"] == ["restart", "restart", "restart", "drop", "restart"] and out["verdict"][0] == "rising"
    assert out["verdict"][1] == "non-finite" and out["rollback_to"][0] == 150 and out["rollback_to"][2] == 165
    assert out["window_start"][4] == 161 and out["rollback_to"][4] == 160
    pad = lambda rows, fill: np.array([list(r) + [fill] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa: E731
    inputs = {"losses": (pad([s["losses"] for s in scen], np.nan), "(n, S) each step's loss (the guard's input: "
                                                                    "the mean of the 2P members), padded with NaN"),
              "skipped": (pad([s["skipped"] for s in scen], False), "(n, S) bool the step was skipped"),
              "length": (np.array([len(s["losses"]) for s in scen]), "(n,) steps in each history"),
              "run_steps": (np.array([s["run_steps"] for s in scen]), "(n,) the run's length (the window)"),
              "restarts": (np.array([s["restarts"] for s in scen]), "(n,) restarts before this one"),
              "expert": (np.array([s["expert"] for s in scen]), "(n,) the expert"),
              "checkpoints": (pad([s["checkpoints"] for s in scen], -1),
                              "(n, k) steps of the current course's checkpoints on disk, sorted, padded with -1"),
              "max_restarts": (np.int64(RESTART["max_restarts"]), "restarts allowed; the next verdict drops"),
              "restart_lr_factor": (np.float64(RESTART["factor"]), "the rate's factor per restart"),
              "restart_stream": (np.int64(RESTART_STREAM), "65536: a restart's stream is expert + 65536 restarts"),
              **text_inputs(corpus), "T": (np.int64(T_LOOP), "a window is T + 1 bytes"),
              "B": (np.int64(B_LOOP), "windows per batch"),
              "seed": (np.uint64(run_seed), "the run's seed"), "lr": (np.float64(RESTART["lr"]), "the peak rate"),
              "warmup": (np.int64(RESTART["warmup"]), "warm-up steps"),
              "schedule": (np.str_(RESTART["schedule"]), "the schedule (stage 4)"), "after": (np.int64(RESTART["after"]),
                                                                     "steps checked after the rollback")}
    guard = ("losses", "skipped", "length", "run_steps")
    outputs = {
        "window": Out(np.array(out["window"]), "exact", ("run_steps",), "max(20, min(200, run_steps // 8))"),
        "verdict_step": Out(np.array(out["verdict_step"]), "exact", guard,
                            "the first step (1-based) at which the guard speaks: 20 skipped in a row, or the "
                            "smoothed loss over 1.25 x its best for `window` steps in a row after the first 50"),
        "verdict": Out(np.array(out["verdict"]), "exact", guard, "'rising' or 'non-finite'"),
        "smoothed": Out(np.array(out["smoothed"]), "host64", guard, "EMA 0.98 of the finite losses, at the verdict"),
        "best": Out(np.array(out["best"]), "host64", guard, "the lowest smoothed loss so far, at the verdict"),
        "window_start": Out(np.array(out["window_start"]), "exact", guard,
                            "steps observed - max(steps above, skipped in a row) + 1"),
        "healthy": Out(np.stack(out["healthy"]), "exact", guard,
                       "healthy[s], indexed like a checkpoint's step: after the first s records the smoothed loss was "
                       "within 1.25 of its best and no skipped run was open; healthy[0] is True"),
        "action": Out(np.array(out["action"]), "exact", ("restarts", "max_restarts"),
                      "'drop' when restarts (before this one) >= max_restarts, else 'restart'"),
        "rollback_to": Out(np.array(out["rollback_to"]), "exact", ("checkpoints", "window_start (kit's)",
                                                                   "healthy (kit's)", "action (kit's)"),
                           "the newest checkpoint before window_start at a healthy step, else the course's oldest; "
                           "-1 when dropped"),
        "lr_scale": Out(np.array(out["lr_scale"]), "host64", ("restarts", "restart_lr_factor", "action (kit's)"),
                        "restart_lr_factor ** (restarts + 1) (unchanged when dropped)"),
        "stream": Out(np.array(out["stream"], np.int64), "exact", ("expert", "restarts", "restart_stream",
                                                                   "action (kit's)"),
                      "expert + 65536 (restarts + 1): the counters' expert word and the batches' stream"),
        "batches_after": Out(np.stack(out["batches_after"]), "exact", ("rollback_to (kit's)", "stream (kit's)", "text",
                                                                       "offsets", "T", "B", "seed"),
                             "batches of steps rollback_to, +1, +2 from the new stream (zeros when dropped)"),
        "rates_after": Out(np.stack(out["rates_after"]), "rate", ("rollback_to (kit's)", "lr_scale (kit's)", "lr",
                                                                  "warmup", "run_steps", "schedule"),
                           "the schedule at the step counter (rolled back), times lr_scale"),
        "philox_after": Out(np.stack(out["philox_after"]), "bits", ("rollback_to (kit's)", "stream (kit's)", "seed"),
                            "Philox block 0 of member 0 at (step rollback_to, expert word = the new stream)"),
    }
    stream_misread = [(np.array(philox4x32_10(0, 0, to, s["expert"] + s["restarts"] + 1, *stream_key(run_seed)),
                                np.uint32) if a == "restart" else np.zeros(4, np.uint32))
                      for s, to, a in zip(scen, out["rollback_to"], out["action"])]
    healthy = np.stack(out["healthy"])  # misread: healthy[s] as the state after 0-based step s (s + 1 records)
    zero_based = np.concatenate([np.ones((len(scen), 1), bool), healthy[:, 2:], np.zeros((len(scen), 1), bool)],
                                axis=1)
    misreadings = {"philox_after": [("the stream offset by restarts, not 65536 x restarts", np.stack(stream_misread))],
                   "healthy": [("healthy[s] as after the 0-based step s, not after the first s records (a "
                                "checkpoint's step)", zero_based)],
                   "rollback_to": [("a checkpoint eligible only when its step < window_start - 1 (it may be the step "
                                    "just before the window)", _rollback_variant(scen, out)),
                                   ("with no eligible checkpoint, the course's newest (it is the course's oldest)",
                                    np.array([s["checkpoints"][-1] if to >= 0 and to == s["checkpoints"][0] and
                                              s["checkpoints"][0] >= start else to for s, to, start in
                                              zip(scen, out["rollback_to"], out["window_start"])]))],
                   "lr_scale": [("the factor applied once, not once per restart",
                                 np.array([RESTART["factor"] if a == "restart" else RESTART["factor"] ** s["restarts"]
                                           for s, a in zip(scen, out["action"])]))]}
    return Stage("restart", "the restart rule: the guard's verdict, the rollback choice, the rate factor, the "
                            "stream offset, drop after max_restarts; the first steps after the rollback",
                 inputs, outputs, misreadings=misreadings)
