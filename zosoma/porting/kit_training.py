"""The porting kit's host-side training stages: initialisation, the batch draw, the schedule, one
step of every strategy, N steps of the training loop, coefficient shaping and the restart rule.

Each reference is computed with zosoma's own pieces (zosoma.model.reference in float64 for the
losses, zosoma.model.noise for the directions, zosoma.corpus, zosoma.strategies,
zosoma.runs.guard and trainer), the update in float64 from the kit's scalars, so a port's
rounding never compounds from one check into the next. PORTING.md ("The training loop") is the
specification these vectors serve.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from zosoma.config import VOCAB, ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, Corpus, load_corpus
from zosoma.errors import ConfigError
from zosoma.engines.cpu import lowrank
from zosoma.model import noise as noise_spec, reference
from zosoma.model.noise import noise, philox4x32_10, stream_key
from zosoma.model.params import Layout, init_params
from zosoma.porting.stage import Out, Stage
from zosoma.runs.guard import DivergenceGuard, healthy_steps, rollback_index, window_for
from zosoma.runs.stepper import RESTART_STREAM, stream
from zosoma.strategies.base import learning_rate
from zosoma.strategies.eggroll import zscore
from zosoma.strategies.es import centered_ranks
from zosoma.strategies.shaping import Chain
from zosoma.strategies.shaping.normalize import CAP as NORMALIZE_CAP, WARMUP as NORMALIZE_WARMUP

SCHEDULED = "lr is this step's rate: the schedule (warm-up, cosine) and any restart factor are already applied"


def _counters(seed, expert, step) -> dict:
    return {"seed": (np.uint64(seed), "uint64 the run's seed: Philox key (seed mod 2^32, seed >> 32)"),
            "expert": (np.uint32(expert), "uint32 the counter's expert word (the stream: expert + 65536 restarts)"),
            "step": (np.uint32(step), "uint32 the step counter (0-based)")}


def _directions(d: int, P: int, seed: int, expert: int, step: int, kind: str) -> np.ndarray:
    """(P, d) float64 the step's dense directions delta_k (float32 values)."""
    return np.stack([noise(d, seed, expert, step, k, kind=kind) for k in range(P)]).astype(np.float64)


def _member(theta, eps: float, delta, sign: int = 1) -> np.ndarray:
    """theta + sign eps delta built as a port builds it, a fresh float32 copy, as float64."""
    return (theta.astype(np.float32) + sign * np.float32(eps) * delta.astype(np.float32)).astype(np.float64)


def _losses(layout: Layout, batch, members) -> np.ndarray:
    """Float64 reference losses of the members (each a (d,) float64 theta) on one batch."""
    return np.array([reference.loss(m, layout, batch) for m in members])


# --- corpus and batches ----------------------------------------------------------------------------

T_LOOP, B_LOOP = 16, 4  # the training loop's windows: T + 1 bytes, B of them


def small_corpus() -> Corpus:
    """Four documents of the shipped corpus, cut short; one shorter than a window (it has no
    windows) and one exactly a window long (it has one)."""
    train = load_corpus(None, split="train")
    lengths = (900, T_LOOP, 1500, T_LOOP + 1)
    return Corpus(tuple(train.names[:4]), tuple(np.array(d[:n]) for d, n in zip(train.docs, lengths)))


def _text_inputs(corpus: Corpus) -> dict:
    offsets = np.cumsum([0] + [len(d) for d in corpus.docs]).astype(np.int64)
    return {"text": (np.concatenate(corpus.docs), "(total,) uint8 the documents back to back"),
            "offsets": (offsets, "(n_docs + 1,) int64 document i is text[offsets[i]:offsets[i+1]]")}


def _draws(sampler: BatchSampler, seed, stream_, step, B) -> np.ndarray:
    """(B,) the global window indices BatchSampler.positions draws (the same generator call)."""
    return np.random.default_rng([seed, stream_, step]).integers(0, sampler.n_windows, size=B)


def batch_stage(seed: int) -> Stage:
    corpus = small_corpus()
    sampler = BatchSampler(corpus, T_LOOP + 1)
    seed_b, stream_, steps = 2**40 + seed, 5, np.array([0, 1, 7, 4321], np.int64)
    draws = np.stack([_draws(sampler, seed_b, stream_, int(s), B_LOOP) for s in steps])
    doc, start = (np.stack(a) for a in zip(*(sampler.positions(seed_b, stream_, int(s), B_LOOP) for s in steps)))
    ends = np.cumsum(np.maximum(corpus.lengths - T_LOOP, 0))
    assert np.array_equal(draws, ends[doc] - np.maximum(corpus.lengths - T_LOOP, 0)[doc] + start)
    batches = np.stack([sampler.batch(seed_b, stream_, int(s), B_LOOP) for s in steps])
    text = np.concatenate(corpus.docs)
    flat = np.stack([np.random.default_rng([seed_b, stream_, int(s)]).integers(0, text.size - T_LOOP, size=B_LOOP)
                     for s in steps])
    swapped = np.stack([np.random.default_rng([seed_b, int(s), stream_]).integers(0, sampler.n_windows, size=B_LOOP)
                        for s in steps])
    inputs = {**_text_inputs(corpus), "T": (np.int64(T_LOOP), "int64 a window is T + 1 bytes"),
              "B": (np.int64(B_LOOP), "int64 windows per batch"),
              "seed": (np.uint64(seed_b), "the run's seed"), "stream": (np.int64(stream_), "expert + 65536 restarts"),
              "steps": (steps, "(S,) int64 step counters")}
    hint = ("default_rng([seed, stream, step]).integers(0, n_windows, size=B), n_windows = sum over documents of "
            "max(0, len - T); a document shorter than T + 1 bytes has none")
    outputs = {
        "draws": Out(draws, "exact", ("seed", "stream", "steps", "offsets", "T", "B"), hint),
        "doc": Out(doc.astype(np.int64), "exact", ("draws (kit's)", "offsets", "T"),
                   "documents in order, each with max(0, len - T) windows: doc = the one holding window g"),
        "start": Out(start.astype(np.int64), "exact", ("draws (kit's)", "offsets", "T"),
                     "start = g minus the windows of the documents before it"),
        "batches": Out(batches, "exact", ("doc (kit's)", "start (kit's)", "text"),
                       "batch[b] = document doc[b] bytes start .. start + T (T + 1 bytes); never across documents"),
    }
    misreadings = {"draws": [("windows counted over the concatenated text (crossing documents)", flat),
                             ("generator seeded [seed, step, stream] (the order is seed, stream, step)", swapped)]}
    return Stage("batches", "the batch draw: generator call, window indices, documents, start offsets, bytes",
                 inputs, outputs, misreadings=misreadings)


# --- schedule and initialisation ---------------------------------------------------------------------

SCHEDULES = (("cosine", 20, 100, 1.0), ("constant", 20, 100, 1.0), ("cosine", 0, 100, 0.25), ("cosine", 150, 100, 1.0))


def schedule_stage() -> Stage:
    peak, n = 0.15, 100
    kinds = np.array([s for s, *_ in SCHEDULES])
    warmups, totals, scales = (np.array([c[i] for c in SCHEDULES]) for i in (1, 2, 3))
    lr = np.array([[learning_rate(t, peak, int(total), int(w), k) * f for t in range(n)]
                   for k, w, total, f in SCHEDULES])

    def variant(fn):
        return np.array([[fn(t, int(w), int(total), k) * f for t in range(n)] for k, w, total, f in SCHEDULES])

    def zero_at_last(t, w, total, k):  # cosine reaching 0 at the last step, total - 1
        if t < w:
            return peak * (t + 1) / w
        return peak if k == "constant" else peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - w) / max(1, total - 1 - w))))

    def from_zero(t, w, total, k):  # warm-up starting at 0 (t / warmup)
        return learning_rate(t, peak, total, w, k) if t >= w else peak * t / w

    inputs = {"lr": (np.float64(peak), "float64 the peak rate"), "schedule": (kinds, "(n,) 'cosine' or 'constant'"),
              "warmup": (warmups.astype(np.int64), "(n,) warm-up steps (zosoma's default is 20)"),
              "total": (totals.astype(np.int64), "(n,) the run's length in steps"),
              "factor": (scales, "(n,) the restart factor: restart_lr_factor ** restarts"),
              "count": (np.int64(n), "evaluate steps 0 .. count - 1")}
    outputs = {"rates": Out(lr, "rate", tuple(inputs),
                            "warm-up lr (t+1)/warmup for t < warmup; cosine progress (t - warmup) / max(1, total - "
                            "warmup), clamped at 1: 0 is reached at t = total (never taken), not at the last step")}
    return Stage("schedule", "the learning-rate schedule: warm-up, cosine or constant, its end point, the restart "
                             "factor", inputs, outputs,
                 misreadings={"rates": [("cosine reaching 0 at the last step (total - 1)", variant(zero_at_last)),
                                        ("warm-up t / warmup (starting at 0)", variant(from_zero))]})


def init_stage(config: ModelConfig, seed: int) -> Stage:
    expert = 2
    theta = init_params(config, seed, expert)
    layout = Layout(config)
    fan_in = np.empty(layout.size, np.float32)
    rng = np.random.default_rng([seed, expert, 0x1D1])
    for e in layout.entries:  # a misreading: bounds 1/sqrt(fan-in) instead of 1/sqrt(H)
        bound = 1.0 / math.sqrt(e.shape[0]) if len(e.shape) == 2 else 1.0 / math.sqrt(config.hidden)
        values = (rng.standard_normal(e.size) if e.name == "embed" else np.zeros(e.size) if e.name == "out.b"
                  else rng.uniform(-bound, bound, e.size))
        fan_in[e.offset:e.offset + e.size] = values
    inputs = {"embed": (np.int64(config.embed), "E"), "hidden": (np.int64(config.hidden), "H"),
              "layers": (np.int64(config.layers), "L"), "seed": (np.uint64(seed), "the run's seed"),
              "expert": (np.int64(expert), "the expert (0 for a single model); not the restart stream")}
    outputs = {"theta": Out(theta, "exact", tuple(inputs),
                            "default_rng([seed, expert, 0x1D1]); tensors in layout order: embed standard_normal(V*E), "
                            "the LSTM's and out.w uniform(-1/sqrt(H), 1/sqrt(H), size), out.b zeros (no draw); "
                            "each drawn in float64, rounded to float32")}
    return Stage("init", "the seeded initialisation: generator, draw order, distributions", inputs, outputs,
                 misreadings={"theta": [("bounds 1/sqrt(fan-in) instead of 1/sqrt(H)", fan_in),
                                        ("seeded without the expert ([seed, 0x1D1])",
                                         _init_without_expert(config, seed))]})


def _init_without_expert(config: ModelConfig, seed: int) -> np.ndarray:
    layout = Layout(config)
    rng = np.random.default_rng([seed, 0x1D1])
    out = np.empty(layout.size, np.float32)
    bound = 1.0 / math.sqrt(config.hidden)
    for e in layout.entries:
        out[e.offset:e.offset + e.size] = (rng.standard_normal(e.size) if e.name == "embed" else np.zeros(e.size)
                                           if e.name == "out.b" else rng.uniform(-bound, bound, e.size))
    return out


# --- one step of each strategy --------------------------------------------------------------------------

def spsa_stage(theta, layout: Layout, rng) -> Stage:
    """One ZO-SGD step with Rademacher noise: losses of theta +/- eps delta_k (float64 reference),
    scalars g_k = (L+ - L-) / (2 eps), theta_new = theta - lr (1/P) sum_k g_k delta_k."""
    P, eps, lr, seed, expert, step = 4, 1e-3, 0.15, 2**33 + 5, 1, 7
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    deltas = _directions(layout.size, P, seed, expert, step, "rademacher")
    losses = _losses(layout, batch, [_member(theta, eps, d, s) for d in deltas for s in (1, -1)])
    plus, minus = losses[0::2], losses[1::2]
    scalars = (plus - minus) / (2 * eps)
    theta_new = theta.astype(np.float64) - lr * (scalars @ deltas) / P
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8"),
              "P": (np.int64(P), "pairs"), "eps": (np.float64(eps), "the perturbation scale"),
              "lr": (np.float64(lr), SCHEDULED), **_counters(seed, expert, step)}
    loss_hint = ("members theta +/- eps delta_k, delta_k = Rademacher noise of member k at (seed, expert, step), "
                 "built as fresh float32 copies; loss from zero state")
    outputs = {
        "plus": Out(plus, "loss", ("theta", "batch", "eps", "seed", "expert", "step"), loss_hint),
        "minus": Out(minus, "loss", ("theta", "batch", "eps", "seed", "expert", "step"), loss_hint),
        "scalars": Out(scalars, "scalars", ("plus", "minus", "eps"), "(L+_k - L-_k) / (2 eps)"),
        "theta_new": Out(theta_new, "update", ("theta", "scalars (kit's)", "lr", "P", "seed", "expert", "step"),
                         "theta - lr (1/P) sum_k g_k delta_k from the KIT's scalars (not yours), lr as given "
                         "(already scheduled), no weight decay"),
    }
    misreadings = {"theta_new": [("updated from the port's own scalars: theta_new uses the KIT's", deltas.astype(np.int8),
                                  "scalars", -lr / P),
                                 ("lr scheduled again (warm-up 20: lr (7+1)/20)",
                                  theta.astype(np.float64) - lr * 8 / 20 * (scalars @ deltas) / P),
                                 ("no 1/P", theta.astype(np.float64) - lr * (scalars @ deltas))],
                   "scalars": [("divided by eps instead of 2 eps", (plus - minus) / eps)]}
    return Stage("spsa_step", "one SPSA step: losses of theta +/- eps delta_k, the P scalars, the updated theta",
                 inputs, outputs, settings={"noise": ("rademacher", "the directions' kind"),
                                            "weight_decay": (0.0, "none in this stage"),
                                            "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings)


ONESIDED_SCALARS = (4e-2, 1e-5, "(L_j - Lbar) / eps: the losses' atol 2e-5 on L_j and on their mean, over eps = 1e-3")


def onesided_stage(theta, layout: Layout, rng) -> Stage:
    """One step of one-sided SPSA (zosoma's default estimator): losses of theta + eps delta_j for
    the 2P directions j (float64 reference), their mean, the scalars g_j = (L_j - mean) / eps and
    theta_new = theta - lr (1/(2P)) sum_j g_j delta_j."""
    P, eps, lr, seed, expert, step = 4, 1e-3, 0.21213, 2**33 + 11, 2, 5
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    deltas = _directions(layout.size, 2 * P, seed, expert, step, "rademacher")
    losses = _losses(layout, batch, [_member(theta, eps, d) for d in deltas])
    scalars = (losses - losses.mean()) / eps
    theta_new = theta.astype(np.float64) - lr * (scalars @ deltas) / (2 * P)
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8"),
              "P": (np.int64(P), "pairs: 2P members, each along a direction of its own"),
              "eps": (np.float64(eps), "the perturbation scale"), "lr": (np.float64(lr), SCHEDULED),
              **_counters(seed, expert, step)}
    counters = ("theta", "batch", "eps", "seed", "expert", "step")
    outputs = {
        "losses": Out(losses, "loss", counters,
                      "(2P,) in direction order: member j is theta + eps delta_j, delta_j the Rademacher noise "
                      "of member j = 0..2P-1 at (seed, expert, step), a fresh float32 copy; no minus sign"),
        "loss": Out(np.float64(losses.mean()), "loss", counters, "the step's loss: the mean of the 2P losses"),
        "scalars": Out(scalars, "onesided_scalars", ("losses (kit's)", "eps"), "g_j = (L_j - mean_i L_i) / eps"),
        "theta_new": Out(theta_new, "update", ("theta", "scalars (kit's)", "lr", "P", "seed", "expert", "step"),
                         "theta - lr (1/(2P)) sum_j g_j delta_j over the 2P directions, from the KIT's scalars, "
                         "lr as given (already scheduled), no weight decay"),
    }
    pairs = _losses(layout, batch, [_member(theta, eps, d, s) for d in deltas[:P] for s in (1, -1)])
    misreadings = {"losses": [("antithetic pairs theta +/- eps delta_k (stage 5's members), not 2P directions", pairs)],
                   "scalars": [("divided by 2 eps (stage 5's scalars)", scalars / 2)],
                   "theta_new": [("updated from the port's own scalars: theta_new uses the KIT's",
                                  deltas.astype(np.int8), "scalars", -lr / (2 * P)),
                                 ("1/P instead of 1/(2P)", theta.astype(np.float64) - lr * (scalars @ deltas) / P)]}
    return Stage("onesided_step", "one step of one-sided SPSA (the default estimator): the 2P members' losses, their "
                                  "mean, the 2P scalars, the updated theta", inputs, outputs,
                 settings={"noise": ("rademacher", "the directions' kind"),
                           "weight_decay": (0.0, "none in this stage"), "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings, tol={"onesided_scalars": ONESIDED_SCALARS})


MOMENT_D = 5003  # the update rules are elementwise: any vector will do (not a multiple of a noise block)


def _moment_inputs(theta, P, seed, expert, step, rng) -> tuple:
    """(theta (d,) float32, scalars (P,), the previous step's ghat (d,) float32): a realistic
    optimizer state on the first MOMENT_D parameters of the kit's model (or all of a smaller one)."""
    theta = theta[:MOMENT_D].copy()
    scalars = rng.normal(0.0, 2.0, P)
    before = rng.normal(0.0, 2.0, P)
    prev = (before @ _directions(theta.size, P, seed, expert, step - 1, "rademacher") / P).astype(np.float32)
    return theta, scalars, prev


def momentum_stage(theta, rng) -> Stage:
    P, lr, beta, wd, seed, expert, step = 4, 0.05, 0.9, 0.01, 2**35 + 3, 2, 11
    theta, scalars, prev = _moment_inputs(theta, P, seed, expert, step, rng)
    m = (3.0 * prev).astype(np.float32)
    deltas = _directions(theta.size, P, seed, expert, step, "rademacher")
    ghat = scalars @ deltas / P
    m_new = beta * m.astype(np.float64) + ghat
    t64 = theta.astype(np.float64)
    theta_new = t64 - lr * m_new - lr * wd * t64
    inputs = {"theta": (theta, "(d,) float32 any parameter vector (the update is elementwise)"),
              "scalars": (scalars, "(P,) float64 the step's scalars g_k"),
              "m": (m, "(d,) float32 the momentum before the step"), "P": (np.int64(P), "pairs"),
              "lr": (np.float64(lr), SCHEDULED), "momentum": (np.float64(beta), "beta"),
              "weight_decay": (np.float64(wd), "decoupled"), **_counters(seed, expert, step)}
    outputs = {
        "ghat": Out(ghat, "direction", ("scalars", "P", "seed", "expert", "step", "theta (its length d)"),
                    "(1/P) sum_k g_k delta_k"),
        "m_new": Out(m_new, "direction", ("m", "ghat (kit's)", "momentum"), "m <- beta m + ghat (no dampening)"),
        "theta_new": Out(theta_new, "update", ("theta", "m_new (kit's)", "lr", "weight_decay"),
                         "theta - lr m_new - lr wd theta (decay of the OLD theta)"),
    }
    misreadings = {"m_new": [("dampened: beta m + (1 - beta) ghat", beta * m + (1 - beta) * ghat)],
                   "theta_new": [("no weight decay", t64 - lr * m_new)]}
    return Stage("momentum", "one ZO-momentum step (heavy ball) from given scalars and momentum", inputs, outputs,
                 settings={"noise": ("rademacher", "the directions' kind"), "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings)


def adam_stage(theta, rng) -> Stage:
    P, lr, b1, b2, wd, seed, expert, step, eps_adam = 4, 0.01, 0.9, 0.999, 0.01, 2**35 + 4, 2, 7, 1e-8
    theta, scalars, prev = _moment_inputs(theta, P, seed, expert, step, rng)
    m = (0.5 * prev).astype(np.float32)
    v = (0.002 * prev.astype(np.float64) ** 2 + 0.004).astype(np.float32)
    ghat = scalars @ _directions(theta.size, P, seed, expert, step, "rademacher") / P
    m_new = b1 * m + (1 - b1) * ghat
    v_new = b2 * v + (1 - b2) * ghat * ghat
    t64 = theta.astype(np.float64)

    def apply(t, m_, v_):
        return t64 - lr * (m_ / (1 - b1 ** t)) / (np.sqrt(v_ / (1 - b2 ** t)) + eps_adam) - lr * wd * t64

    theta_new = apply(step + 1, m_new, v_new)
    inputs = {"theta": (theta, "(d,) float32 any parameter vector (the update is elementwise)"),
              "scalars": (scalars, "(P,) float64 the step's scalars g_k"),
              "m": (m, "(d,) float32 first moment before the step"), "v": (v, "(d,) float32 second moment"),
              "P": (np.int64(P), "pairs"), "lr": (np.float64(lr), SCHEDULED), "beta1": (np.float64(b1), "first-moment decay"),
              "beta2": (np.float64(b2), "second-moment decay"), "eps_adam": (np.float64(eps_adam), "added to sqrt(v_hat)"),
              "weight_decay": (np.float64(wd), "decoupled (AdamW)"), **_counters(seed, expert, step)}
    outputs = {
        "ghat": Out(ghat, "direction", ("scalars", "P", "seed", "expert", "step", "theta (its length d)"),
                    "(1/P) sum_k g_k delta_k"),
        "m_new": Out(m_new, "direction", ("m", "ghat (kit's)", "beta1"), "beta1 m + (1 - beta1) ghat"),
        "v_new": Out(v_new, "direction", ("v", "ghat (kit's)", "beta2"), "beta2 v + (1 - beta2) ghat^2"),
        "theta_new": Out(theta_new, "adam", ("theta", "m_new (kit's)", "v_new (kit's)", "step", "lr", "weight_decay"),
                         "bias correction with t = step + 1 (the step counter, skipped steps included); "
                         "theta - lr m_hat / (sqrt(v_hat) + 1e-8) - lr wd theta"),
    }
    misreadings = {"theta_new": [("bias correction with t = step (not step + 1)", apply(step, m_new, v_new)),
                                 ("no bias correction", t64 - lr * m_new / (np.sqrt(v_new) + eps_adam) - lr * wd * t64)]}
    return Stage("adam", "one ZO-Adam step from given scalars and moments", inputs, outputs,
                 settings={"noise": ("rademacher", "the directions' kind"), "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings)


LOSS_GAP = 1e-3  # ranks are compared exactly: the kit's members' losses are at least this far apart


def es_stage(theta, layout: Layout, rng) -> Stage:
    P, sigma, lr, wd, seed, expert = 4, 0.02, 0.005, 0.01, 2**34 + 9, 1
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    t64 = theta.astype(np.float64)
    for step in range(7, 40):  # the first step whose members' losses have no near-ties (ranks are exact)
        eps_k = _directions(layout.size, P, seed, expert, step, "gaussian")
        losses = _losses(layout, batch, [t64 + s * sigma * e for e in eps_k for s in (1, -1)])
        if np.diff(np.sort(losses)).min() > LOSS_GAP:
            break
    else:
        raise ConfigError("es stage: the members' losses sit on near-ties; choose another seed")
    plus, minus = losses[0::2], losses[1::2]
    ranks = centered_ranks(-losses)
    coeffs = -(ranks[0::2] - ranks[1::2]) / (2 * sigma)
    tie_losses = np.array([3.25, 3.5, 3.25, 3.0, 3.5, 3.25, 3.0, 3.75])  # exact ties: twos and a three
    theta_new = t64 - lr * (coeffs @ eps_k) / P - lr * wd * t64
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8"), "P": (np.int64(P), "pairs"),
              "sigma": (np.float64(sigma), "the perturbation scale"), "lr": (np.float64(lr), SCHEDULED),
              "weight_decay": (np.float64(wd), "decoupled"), **_counters(seed, expert, step),
              "tie_losses": (tie_losses, "(2P,) float64 given member losses with exact ties, in member order")}
    hint = "members theta +/- sigma eps_k, eps_k the dense GAUSSIAN noise of member k"
    outputs = {
        "plus": Out(plus, "loss", ("theta", "batch", "sigma", "seed", "expert", "step"), hint),
        "minus": Out(minus, "loss", ("theta", "batch", "sigma", "seed", "expert", "step"), hint),
        "ranks": Out(ranks, "host64", ("plus", "minus"),
                     "centred ranks of the fitness -loss over the 2P members in the order +0, -0, +1, -1, ...: "
                     "rank / (2P - 1) - 0.5, the lowest fitness -0.5"),
        "coefficients": Out(coeffs, "host64", ("ranks (kit's)", "sigma"), "c_k = -(r_{k+} - r_{k-}) / (2 sigma)"),
        "tie_ranks": Out(centered_ranks(-tie_losses), "host64", ("tie_losses",),
                         "centred ranks of the fitness -loss; equal fitness: the LOWER index ranks lower (a stable "
                         "ascending sort), never averaged"),
        "theta_new": Out(theta_new, "update", ("theta", "coefficients (kit's)", "lr", "weight_decay", "P", "seed",
                                               "expert", "step"),
                         "theta - lr (1/P) sum_k c_k eps_k - lr wd theta (the SGD update with the ES coefficients)"),
    }
    misreadings = {"ranks": [("ranks of the losses, not of the fitness -loss", centered_ranks(losses)),
                             ("members ordered all plus, then all minus", _unpaired_ranks(plus, minus))],
                   "tie_ranks": [("ties to the higher index", centered_ranks(-tie_losses[::-1])[::-1]),
                                 ("tied ranks averaged", _averaged_ranks(-tie_losses))]}
    return Stage("es", "one OpenAI-ES step: Gaussian members, centred ranks, coefficients, the update", inputs,
                 outputs, settings={"noise": ("gaussian", "ES perturbs with dense Gaussian noise"),
                                    "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings)


def _averaged_ranks(f) -> np.ndarray:
    ranks = np.array([np.mean(np.flatnonzero(np.sort(f) == v)) for v in f])
    return ranks / (f.size - 1) - 0.5


def _unpaired_ranks(plus, minus) -> np.ndarray:
    r = centered_ranks(-np.concatenate([plus, minus]))
    return np.stack([r[:plus.size], r[plus.size:]], axis=1).ravel()


def eggroll_stage(theta, layout: Layout, rng) -> Stage:
    P, sigma, r, lr, seed, expert, step = 4, 0.05, 2, 0.5, 2**36 + 1, 3, 5
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    t64 = theta.astype(np.float64)
    E = np.stack([noise_spec.materialise(layout, sigma, r, seed, expert, step, k) for k in range(P)])
    losses = _losses(layout, batch, [t64 + s * e for e in E for s in (1, -1)])
    plus, minus = losses[0::2], losses[1::2]
    fz = zscore(-losses)
    coeffs = fz[0::2] - fz[1::2]
    theta_new = lowrank.eggroll_step(t64, layout, coeffs, lr, sigma, r, seed, expert, step)
    spread = float(np.std(losses))
    tol = {"fitness": (4 * 2e-5 / spread, 1e-6, f"z-scores divide the losses' error (atol 2e-5) by their spread "
                                                 f"{spread:.3g}: 4 x 2e-5 / spread")}
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8"), "P": (np.int64(P), "pairs"),
              "sigma": (np.float64(sigma), "the perturbation scale"), "rank": (np.int64(r), "r"),
              "lr": (np.float64(lr), SCHEDULED), **_counters(seed, expert, step)}
    hint = ("E_k = (sigma/sqrt(r)) A_k B_k^T per matrix, sigma e_k per vector, sliced from member k's Gaussian "
            "stream in layout order: A (m, r) then B (n, r), row-major; every 2-D tensor (embed too) is a matrix")
    outputs = {
        "perturbation": Out(E[0], "perturbation", ("sigma", "rank", "seed", "expert", "step"), hint),
        "plus": Out(plus, "loss", ("theta", "batch", "sigma", "rank", "seed", "expert", "step"), "losses of theta + E_k"),
        "minus": Out(minus, "loss", ("theta", "batch", "sigma", "rank", "seed", "expert", "step"),
                     "losses of theta - E_k"),
        "coefficients": Out(coeffs, "fitness", ("plus", "minus"),
                            "z-scores of the fitness -loss over the 2P members (+0, -0, +1, ...; population std, "
                            "ddof 0); c_k = z_{k+} - z_{k-}"),
        "theta_new": Out(theta_new, "update", ("theta", "coefficients (kit's)", "lr", "sigma", "rank", "P", "seed",
                                               "expert", "step"),
                         "theta + lr (2P)^-1/2 sum_k c_k E_k (no 1/sigma: E_k carries sigma)"),
    }
    ddof1 = -losses
    ddof1 = (ddof1 - ddof1.mean()) / ddof1.std(ddof=1)
    misreadings = {"perturbation": [("B sliced before A", _variant_perturbation(layout, sigma, r, seed, expert, step,
                                                                                 "b_first")),
                                    ("A read as (r, m) (column-major)", _variant_perturbation(
                                        layout, sigma, r, seed, expert, step, "a_columns")),
                                    ("scale sigma instead of sigma / sqrt(r)", E[0] * math.sqrt(r) * _matrix_mask(
                                        layout) + E[0] * (1 - _matrix_mask(layout)))],
                   "coefficients": [("sample std (ddof 1) instead of the population's", ddof1[0::2] - ddof1[1::2])]}
    return Stage("eggroll", "one EGGROLL step: the low-rank perturbation, the members' losses, z-scored "
                            "coefficients, the update", inputs, outputs,
                 settings={"noise": ("gaussian", "one Gaussian stream per pair, sliced into factors"),
                           "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings, tol=tol)


def _matrix_mask(layout: Layout) -> np.ndarray:
    mask = np.zeros(layout.size)
    for e in layout.entries:
        if len(e.shape) == 2:
            mask[e.offset:e.offset + e.size] = 1.0
    return mask


def _variant_perturbation(layout: Layout, sigma, r, seed, expert, step, how: str) -> np.ndarray:
    """E_0 under a misreading of the slicing."""
    z = noise(noise_spec.noise_length(layout, r), seed, expert, step, 0, kind="gaussian").astype(np.float64)
    out, pos = np.empty(layout.size), 0
    for e in layout.entries:
        if len(e.shape) == 2:
            m, n = e.shape
            a, b = z[pos:pos + m * r], z[pos + m * r:pos + (m + n) * r]
            if how == "b_first":
                b, a = z[pos:pos + n * r], z[pos + n * r:pos + (m + n) * r]
            A = a.reshape(r, m).T if how == "a_columns" else a.reshape(m, r)
            out[e.offset:e.offset + e.size] = (sigma / math.sqrt(r) * A @ b.reshape(n, r).T).ravel()
            pos += (m + n) * r
        else:
            out[e.offset:e.offset + e.size] = sigma * z[pos:pos + e.size]
            pos += e.size
    return out


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
    pieces = Chain(TrainConfig(optimizer="sgd", shaping=("normalize",),
                               normalize_window=LOOP_NORMALIZE["normalize_window"]))
    state = {"normalize": pieces.init()["normalize"]} if normalize else {}
    shaped_rows, states = [], []
    corpus = small_corpus()
    sampler = BatchSampler(corpus, T_LOOP + 1)
    P, eps, N, wd = c["P"], c["eps"], c["steps"], c["weight_decay"]
    theta64 = theta.astype(np.float64)
    batches, rates, plus, minus, all_deltas = [], [], [], [], []
    for t in range(N):
        batch = sampler.batch(c["seed"], c["stream"], t, B_LOOP)
        deltas = _directions(layout.size, P, c["seed"], c["stream"], t, "rademacher")
        losses = _losses(layout, batch, [theta64 + s * eps * d for d in deltas for s in (1, -1)])
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
                d = all_deltas[t] if counter_of(t) == t else _directions(layout.size, P, c["seed"], c["stream"],
                                                                          counter_of(t), "rademacher")
                th = th - lr_of(t) * (rows[t] @ d) / P - decay(th, lr_of(t))
        return th

    lag = lambda t: t if t <= c["fault_step"] else t - 1  # noqa: E731  the counter not advanced by the skip
    inputs = {"theta": (theta, "(d,) float32 theta at step 0"), **_text_inputs(corpus),
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
              **_text_inputs(corpus), "T": (np.int64(T_LOOP), "a window is T + 1 bytes"),
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
