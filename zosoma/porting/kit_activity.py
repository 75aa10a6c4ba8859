"""The porting kit's stage `activity_onesided_step`: one step of one-sided activity perturbation
(`--optimizer activity-onesided`, zosoma.strategies.activity.ActivityOneSided) from given weights.

Its reference is written here in plain NumPy, float64 from the float32 weights, and does not call
the strategy, its model (zosoma.model.node_perturbation) or its engine: only the noise generator
(stage 3) is shared. tests/test_porting_activity.py checks that the strategy's own step agrees
with it. PORTING.md ("Activity perturbation") is the specification these vectors serve:

    z_j       = the noise of (seed, stream, step, member j), j = 0..2P-1, read (B, T, S), S = L 4H
    nats_j    = every target's nats with the gates' pre-activations plus eps z_j (the logits clean)
    d_j       = (nats_j - mean_i nats_i) / eps                          (2P, B, T)
    w_j[b, t] = sum_(t' >= t) d_j[b, t'] / (2P B T)                     causal credit along time
    zeta      = sum_j w_j z_j                                          (B, T, S)
    ghat      = outer products of zeta with a clean forward's inputs ([x_t; h_(t-1); 1] per layer,
                the embedding through layer 0's w_ih^T); the readout's exact delta rule
    theta_new = theta - lr ghat
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.model.noise import noise
from zosoma.model.params import Layout
from zosoma.porting.kit_training import SCHEDULED, _counters
from zosoma.porting.stage import Out, Stage

# stage-specific tolerances (atol, rtol, why): a float32 port against the float64 reference; zosoma's own
# float32 step stays under 1/5 of each (tests/test_porting_activity.py)
ACTIVITY_TOL = {
    "activity_scalars": (1e-3, 1e-6, "(nats_j - mean_i nats_i) / eps from the kit's nats: their float32 rounding "
                                     "(2.4e-7 at 6 nats), on nats_j and on the mean, over eps = 1e-3"),
    "activity_credit": (1e-9, 1e-5, "a float32 suffix sum of T terms d / (2P B T): a few ulps of the sum"),
    "activity_zeta": (1e-8, 1e-5, "a float32 sum of 2P terms +/- w_j, in any order: a few ulps of the largest "
                                  "|w| (about 1e-2)"),
    "activity_ghat": (1e-6, 1e-5, "float32 sums over the B T positions of the clean forward's inputs (within "
                                  "1e-5) times zeta (about 4e-2), and the readout's float32 softmax"),
}


def member_noise(layout: Layout, B: int, T: int, P: int, seed, expert, step) -> np.ndarray:
    """(2P, B, T, S) float64: z_j, member j's Rademacher stream read row b, position t, then the
    S = L 4H gates of that position (layer 0's i, f, g, o blocks first)."""
    S = layout.config.layers * 4 * layout.config.hidden
    return np.stack([noise(B * T * S, seed, expert, step, j, kind="rademacher").reshape(B, T, S)
                     for j in range(2 * P)]).astype(np.float64)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward(theta, layout: Layout, tokens, gate_noise=None):
    """The float64 forward of (B, T) tokens from zero state. gate_noise (B, T, S) is added to the
    gates' pre-activations. Returns (logits (B, T, V), per layer (its inputs x (B, T, n_in), the
    states h_(t-1) it saw, its outputs h_t, each (B, T, H))): what the outer products need."""
    p = {name: np.asarray(v, np.float64) for name, v in layout.views(np.asarray(theta, np.float32)).items()}
    B, T = tokens.shape
    H, G = layout.config.hidden, 4 * layout.config.hidden
    x, seen = p["embed"][tokens], []
    for layer in range(layout.config.layers):
        w_ih, w_hh, bias = (p[f"lstm{layer}.{n}"] for n in ("w_ih", "w_hh", "bias"))
        h, c = np.zeros((B, H)), np.zeros((B, H))
        before, out = np.empty((B, T, H)), np.empty((B, T, H))
        for t in range(T):
            a = x[:, t] @ w_ih + h @ w_hh + bias
            if gate_noise is not None:
                a = a + gate_noise[:, t, layer * G:(layer + 1) * G]
            i, f, g, o = _sigmoid(a[:, :H]), _sigmoid(a[:, H:2 * H]), np.tanh(a[:, 2 * H:3 * H]), _sigmoid(a[:, 3 * H:])
            before[:, t] = h
            c = f * c + i * g
            h = o * np.tanh(c)
            out[:, t] = h
        seen.append((x, before, out))
        x = out
    return x @ p["out.w"] + p["out.b"], seen


def _log_softmax(logits):
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def target_nats(logits, targets) -> np.ndarray:
    """(B, T): -log softmax(logits)[target] of every target."""
    return -np.take_along_axis(_log_softmax(logits), targets[..., None].astype(np.intp), axis=-1)[..., 0]


def member_nats(theta, layout: Layout, batch, eps: float, Z) -> np.ndarray:
    """(2P, B, T): member j's nats of every target, its gates plus eps z_j (Z (2P, B, T, S))."""
    return np.stack([target_nats(forward(theta, layout, batch[:, :-1], eps * z)[0], batch[:, 1:]) for z in Z])


def credit(d) -> np.ndarray:
    """(2P, B, T) w_j[b, t] = sum_(t' >= t) d_j[b, t'] / (2P B T): a gate at t moves only the
    targets from t on; the batch loss is the mean over its B T targets, the estimate over 2P members."""
    J, B, T = d.shape
    own = d / (J * B * T)
    w = np.empty_like(own)
    w[..., T - 1] = own[..., T - 1]
    for t in range(T - 2, -1, -1):
        w[..., t] = own[..., t] + w[..., t + 1]
    return w


def outer_products(theta, layout: Layout, batch, zeta, how: str = "") -> np.ndarray:
    """ghat (d,) float64: every LSTM weight's sum over (b, t) of its input times zeta's gate
    (w_ih: x_t, w_hh: h_(t-1), bias: 1), the embedding row of byte v the sum of layer 0's
    zeta @ w_ih^T over the positions of v, and the readout's exact gradient of the batch's mean
    nats, sum over (b, t) of h_t (and 1) times (softmax - onehot) / (B T), from the same clean
    forward. `how` names a misreading (the kit's misreadings): "h_t" for w_hh's input, "no 1/(BT)"."""
    tokens, targets = batch[:, :-1], batch[:, 1:]
    B, T = tokens.shape
    G = 4 * layout.config.hidden
    logits, seen = forward(theta, layout, tokens)
    ghat = np.zeros(layout.size)
    g = layout.views(ghat)
    for layer, (x, before, out) in enumerate(seen):
        z = zeta[:, :, layer * G:(layer + 1) * G]
        g[f"lstm{layer}.w_ih"][...] = np.einsum("bti,btg->ig", x, z)
        g[f"lstm{layer}.w_hh"][...] = np.einsum("bth,btg->hg", out if how == "h_t" else before, z)
        g[f"lstm{layer}.bias"][...] = z.sum(axis=(0, 1))
    w_ih0 = layout.views(np.asarray(theta, np.float32))["lstm0.w_ih"].astype(np.float64)
    for b in range(B):
        for t in range(T):
            g["embed"][tokens[b, t]] += w_ih0 @ zeta[b, t, :G]
    delta = np.exp(_log_softmax(logits))
    delta[np.arange(B)[:, None], np.arange(T)[None, :], targets] -= 1.0
    delta /= 1 if how == "no 1/(BT)" else B * T
    g["out.w"][...] = np.einsum("bth,btv->hv", seen[-1][2], delta)
    g["out.b"][...] = delta.sum(axis=(0, 1))
    return ghat


def activity_onesided_stage(theta, layout: Layout, rng) -> Stage:
    """One step of one-sided activity perturbation (the readout by its local rule, causal credit):
    the members' noise, every target's nats under each member, the scalars, the credit, the
    combined noise, the outer-product estimate and the updated theta, each from the kit's values of
    the one before."""
    P, eps, lr, seed, expert, step = 4, 1e-3, 2.0, 2**33 + 13, 3, 9
    batch = rng.integers(0, VOCAB, (2, 17), dtype=np.uint8)
    B, T = batch.shape[0], batch.shape[1] - 1
    L, G = layout.config.layers, 4 * layout.config.hidden
    Z = member_noise(layout, B, T, P, seed, expert, step)
    nats = member_nats(theta, layout, batch, eps, Z)
    d = (nats - nats.mean(axis=0)) / eps
    w = credit(d)
    zeta = np.einsum("jbt,jbts->bts", w, Z)
    ghat = outer_products(theta, layout, batch, zeta)
    theta_new = theta.astype(np.float64) - lr * ghat
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8"),
              "P": (np.int64(P), "pairs: 2P members, each its own noise"),
              "eps": (np.float64(eps), "the perturbation scale"), "lr": (np.float64(lr), SCHEDULED),
              **_counters(seed, expert, step)}
    counters = ("P", "seed", "expert", "step", "batch (its B, T)")
    outputs = {
        "gate_noise": Out(Z.astype(np.int8), "bits", counters,
                     "(2P, B, T, S) z_j = the Rademacher noise of member j at (seed, expert, step), B T S values "
                     "read row b, then position t, then the S = L 4H gates (layer 0's i, f, g, o first); no logits"),
        "nats": Out(nats, "nll", ("theta", "batch", "eps", "P", "seed", "expert", "step"),
                    "(2P, B, T) every target's nats under member j: each layer's gate pre-activations "
                    "x_t W_ih + h_(t-1) W_hh + b + eps z_j[b, t, layer's 4H] before the cell, the logits clean; "
                    "one forward from zero state, theta unperturbed"),
        "loss": Out(np.float64(nats.mean()), "loss", ("theta", "batch", "eps", "P", "seed", "expert", "step"),
                    "the step's loss: the mean of nats over members, rows and targets"),
        "scalars": Out(d, "activity_scalars", ("nats (kit's)", "eps"),
                       "d_j = (nats_j - mean_i nats_i) / eps per target, the mean over the 2P members (the member "
                       "itself included)"),
        "credit": Out(w, "activity_credit", ("scalars (kit's)",),
                      "w_j[b, t] = sum over t' >= t of d_j[b, t'] / (2P B T): the gates at t move only the targets "
                      "from t on"),
        "zeta": Out(zeta, "activity_zeta", ("credit (kit's)", "seed", "expert", "step"),
                    "zeta[b, t] = sum_j w_j[b, t] z_j[b, t] (B, T, S)"),
        "ghat": Out(ghat, "activity_ghat", ("theta", "batch", "zeta (kit's)"),
                    "a clean forward at theta; per layer W_ih += x_t^T zeta_t, W_hh += h_(t-1)^T zeta_t, b += "
                    "zeta_t, embed[byte] += W_ih(layer 0) zeta_t; out.w += h_t^T (softmax - onehot) / (B T), "
                    "out.b += (softmax - onehot) / (B T)"),
        "theta_new": Out(theta_new, "update", ("theta", "ghat (kit's)", "lr"),
                         "theta - lr ghat from the KIT's ghat, lr as given (already scheduled), no weight decay"),
    }
    S = L * G
    wide = np.stack([noise(B * T * (S + VOCAB), seed, expert, step, j, kind="rademacher").reshape(B, T, S + VOCAB)
                     for j in range(2 * P)])
    pairs = np.repeat(Z[:P], 2, axis=0) * np.tile([1.0, -1.0], P)[:, None, None, None]
    others = (2 * P * nats.mean(axis=0) - nats) / (2 * P - 1)
    misreadings = {
        "gate_noise": [("read (T, B, S): positions first, then rows",
                   np.stack([noise(B * T * S, seed, expert, step, j, kind="rademacher").reshape(T, B, S)
                             .transpose(1, 0, 2) for j in range(2 * P)]).astype(np.int8)),
                  ("rows of L 4H + V values (the logits' noise read and dropped)", wide[..., :S].astype(np.int8))],
        "nats": [("antithetic pairs +/- eps z_k (activity-local-causal's members), not 2P noises of their own",
                  member_nats(theta, layout, batch, eps, pairs)),
                 ("noise on the logits too (activity-onesided's readout takes none)",
                  np.stack([target_nats(forward(theta, layout, batch[:, :-1], eps * z[..., :S])[0]
                                        + eps * z[..., S:], batch[:, 1:]) for z in wide]))],
        "scalars": [("the mean of the OTHER members (the member itself left out)", (nats - others) / eps),
                    ("the sign turned: (mean - nats_j) / eps", -d),
                    ("divided by 2 eps", d / 2)],
        "credit": [("each target's own difference only (no sum over later targets)", d / d.size),
                   ("summed over t' <= t (credit backwards in time)", np.cumsum(d, axis=-1) / d.size),
                   ("the row's mean difference at every position (not causal)",
                    np.broadcast_to(d.mean(axis=-1, keepdims=True) / (2 * P * B), d.shape))],
        "zeta": [("averaged over the members, not summed", zeta / (2 * P))],
        "ghat": [("h_t for W_hh's input, not h_(t-1)", outer_products(theta, layout, batch, zeta, "h_t")),
                 ("the readout's delta without 1/(B T)", outer_products(theta, layout, batch, zeta, "no 1/(BT)"))],
        "theta_new": [("theta + lr ghat (ascent)", theta.astype(np.float64) + lr * ghat)],
    }
    return Stage("activity_onesided_step",
                 "one step of one-sided activity perturbation (--optimizer activity-onesided): the members' gate "
                 "noise, every target's nats, the scalars, the causal credit, the combined noise, the "
                 "outer-product estimate, the updated theta", inputs, outputs,
                 settings={"noise": ("rademacher", "the members' kind"),
                           "readout": ("local", "the logits take no noise: the readout by its exact delta rule"),
                           "causal": (True, "the gates at t weighted by the targets from t on"),
                           "weight_decay": (0.0, "none in this stage"), "lr_scheduled": (True, SCHEDULED)},
                 misreadings=misreadings, tol=ACTIVITY_TOL)
