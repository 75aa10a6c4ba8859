"""The porting kit's one-step stages: one step of every strategy (SPSA, one-sided SPSA, momentum,
Adam, OpenAI-ES, EGGROLL) from given weights, with the helpers the host-side stages share
(kit_data: initialisation, batches, the schedule; kit_loop: N steps of the training loop,
coefficient shaping, the restart rule).

Each reference is computed with zosoma's own pieces (zosoma.model.reference in float64 for the
losses, zosoma.model.noise for the directions, zosoma.strategies), the update in float64 from the
kit's scalars, so a port's rounding never compounds from one check into the next. PORTING.md
(stages 5 and 6) is the specification these vectors serve.
"""

from __future__ import annotations

import math

import numpy as np

from zosoma.config import VOCAB
from zosoma.errors import ConfigError
from zosoma.engines.cpu import lowrank
from zosoma.model import noise as noise_spec, reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout
from zosoma.porting.stage import Out, Stage
from zosoma.strategies.eggroll import zscore
from zosoma.strategies.es import centered_ranks

SCHEDULED = "lr is this step's rate: the schedule (warm-up, cosine) and any restart factor are already applied"


def _counters(seed, expert, step) -> dict:
    return {"seed": (np.uint64(seed), "uint64 the run's seed: Philox key (seed mod 2^32, seed >> 32)"),
            "expert": (np.uint32(expert), "uint32 the counter's expert word (the stream: expert + 65536 restarts)"),
            "step": (np.uint32(step), "uint32 the step counter (0-based)")}


def directions(d: int, P: int, seed: int, expert: int, step: int, kind: str) -> np.ndarray:
    """(P, d) float64 the step's dense directions delta_k (float32 values)."""
    return np.stack([noise(d, seed, expert, step, k, kind=kind) for k in range(P)]).astype(np.float64)


def _member(theta, eps: float, delta, sign: int = 1) -> np.ndarray:
    """theta + sign eps delta built as a port builds it, a fresh float32 copy, as float64."""
    return (theta.astype(np.float32) + sign * np.float32(eps) * delta.astype(np.float32)).astype(np.float64)


def member_losses(layout: Layout, batch, members) -> np.ndarray:
    """Float64 reference losses of the members (each a (d,) float64 theta) on one batch."""
    return np.array([reference.loss(m, layout, batch) for m in members])


# --- one step of each strategy --------------------------------------------------------------------------

def spsa_stage(theta, layout: Layout, rng) -> Stage:
    """One ZO-SGD step with Rademacher noise: losses of theta +/- eps delta_k (float64 reference),
    scalars g_k = (L+ - L-) / (2 eps), theta_new = theta - lr (1/P) sum_k g_k delta_k."""
    P, eps, lr, seed, expert, step = 4, 1e-3, 0.15, 2**33 + 5, 1, 7
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    deltas = directions(layout.size, P, seed, expert, step, "rademacher")
    losses = member_losses(layout, batch, [_member(theta, eps, d, s) for d in deltas for s in (1, -1)])
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
    deltas = directions(layout.size, 2 * P, seed, expert, step, "rademacher")
    losses = member_losses(layout, batch, [_member(theta, eps, d) for d in deltas])
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
    pairs = member_losses(layout, batch, [_member(theta, eps, d, s) for d in deltas[:P] for s in (1, -1)])
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
    prev = (before @ directions(theta.size, P, seed, expert, step - 1, "rademacher") / P).astype(np.float32)
    return theta, scalars, prev


def momentum_stage(theta, rng) -> Stage:
    P, lr, beta, wd, seed, expert, step = 4, 0.05, 0.9, 0.01, 2**35 + 3, 2, 11
    theta, scalars, prev = _moment_inputs(theta, P, seed, expert, step, rng)
    m = (3.0 * prev).astype(np.float32)
    deltas = directions(theta.size, P, seed, expert, step, "rademacher")
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
    ghat = scalars @ directions(theta.size, P, seed, expert, step, "rademacher") / P
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
        eps_k = directions(layout.size, P, seed, expert, step, "gaussian")
        losses = member_losses(layout, batch, [t64 + s * sigma * e for e in eps_k for s in (1, -1)])
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
    losses = member_losses(layout, batch, [t64 + s * e for e in E for s in (1, -1)])
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
