"""Activity (node) perturbation, the reference: noise on the pre-activations, the estimate by outer products.

Written for reading, not speed; the CPU engine's forward (zosoma.engines.cpu.noisy_forward) is
checked against it. It follows the dtype of theta and of the noise, so tests can run it in float64.
Shapes: M members, B batch, T time, E embedding, H hidden, G = 4H gates, L layers, V = 256, and
S = L*G + V the pre-activations of one position: every layer's gates (blocks i, f, g, o) and the
logits.

Node perturbation (Fiete and Seung 2006; "activity perturbation" in Ren, Kornblith, Liao and
Hinton 2023, "Scaling forward gradient with local losses") perturbs what a layer computes instead of
its weights. Member k of a step adds sigma * z_k to the pre-activations a_(b,t) of every row b at
every time step t, z_k = noise(seed, expert, step, member=k) read as (B, T, S): each row and each
position its own noise. The weights are the same for every member, so a population is one forward
over 2P*B rows. Each row's own loss L_b (mean nats over its T bytes) gives, per antithetic pair,

    c_(k,b) = (L_b(a + sigma z_k) - L_b(a - sigma z_k)) / (2 sigma)  ~  grad_a L_b . z_(k,b)

and E[c_(k,b) z_(k,b,t)] = dL_b/da_(b,t) to first order in sigma (E z z^T = I). A pre-activation
a = u @ W is linear in its weights, with u its input at theta ([x_t; h_(t-1); 1] for a layer's
w_ih, w_hh, bias; h_t for the readout), so the weights' gradient is an outer product of the two:

    zeta_(b,t)   = 1/(P B) sum_k c_(k,b) z_(k,b,t)            (B, T, S): the step's combined noise
                   (causal: each target's own differences, `credit`)
    ghat[W]      = sum_(b,t) u_(b,t)^T zeta_(b,t)             for each layer's w_ih, w_hh, bias, out.w, out.b
    ghat[embed]  = sum over the positions of byte v of zeta_(b,t)[layer 0] @ w_ih^T     (row v)

an unbiased estimate, at first order, of the gradient of the batch's mean loss through the whole
sequence (backpropagation through time included: z at time t moves every later loss). The inputs u
are the clean forward's, so the update is one more forward at theta that accumulates the outer
products (`estimate`); the noise is regenerated from its counters or kept from the members' forward.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.model import noise
from zosoma.model.params import Layout
from zosoma.model.reference import log_softmax, lstm_cell, nll


def width(layout: Layout, readout: str = "perturb") -> int:
    """S: the pre-activations of one position that take noise: L*4H gates and the V logits, or the
    gates alone when the readout learns by its local rule (`readout` "local")."""
    return layout.config.layers * 4 * layout.config.hidden + (VOCAB if readout == "perturb" else 0)


def member_noise(layout: Layout, B: int, T: int, seed: int, expert: int, step: int, member: int,
                 kind: str = "rademacher", readout: str = "perturb") -> np.ndarray:
    """(B, T, S) float32: z of `member`, its counters' stream read row by row, position by position."""
    S = width(layout, readout)
    return noise.noise(B * T * S, seed, expert, step, member, kind).reshape(B, T, S)


def noisy_nll(theta, layout: Layout, tokens, Z) -> np.ndarray:
    """(M, B, T) nats of each target under M members: member m's pre-activations at (b, t) plus
    Z[m, b, t] (M, B, T, S), already scaled; S = L*4H: the logits take none. tokens (B, T + 1) uint8: inputs [:, :-1], targets [:, 1:]."""
    p = layout.views(theta)
    M, B, T, S = Z.shape
    L, H = layout.config.layers, layout.config.hidden
    G = 4 * H
    Z = Z.reshape(M * B, T, S)  # row m*B + b is member m's copy of row b
    x = np.tile(p["embed"][tokens[:, :-1]], (M, 1, 1))  # (M*B, T, E)
    for layer in range(L):
        w_ih, w_hh, bias = (p[f"lstm{layer}.{n}"] for n in ("w_ih", "w_hh", "bias"))
        h = np.zeros((M * B, H), theta.dtype)
        c = np.zeros((M * B, H), theta.dtype)
        hs = np.empty((M * B, T, H), theta.dtype)
        for t in range(T):
            h, c = lstm_cell(x[:, t] @ w_ih + h @ w_hh + bias + Z[:, t, layer * G:(layer + 1) * G], c)
            hs[:, t] = h
        x = hs
    logits = x @ p["out.w"] + p["out.b"]
    if S > L * G:
        logits = logits + Z[:, :, L * G:]
    return nll(logits, np.tile(tokens[:, 1:], (M, 1))).reshape(M, B, T)


def member_losses(theta, layout: Layout, batch, scale: float, Z, direction, sign) -> np.ndarray:
    """(M, B, T) float64: the nats of every row's every target under member m, its pre-activations
    plus sign[m] * scale * Z[direction[m]] (Z (J, B, T, S); direction (M,), sign (M,): a member
    table, as a Population's), on the step's (B, T + 1) batch."""
    Z = np.asarray(Z)
    signs = np.asarray(sign, Z.dtype)[:, None, None, None] * np.asarray(scale, Z.dtype)
    return noisy_nll(theta, layout, batch, Z[np.asarray(direction)] * signs).astype(np.float64)


def position_losses(theta, layout: Layout, batch, scale: float, Z) -> tuple[np.ndarray, np.ndarray]:
    """(plus, minus), each (K, B, T) float64: the nats of every row's every target with its
    pre-activations plus and minus scale * Z[k] (K, B, T, S): member_losses of K antithetic pairs."""
    K = np.shape(Z)[0]
    nats = member_losses(theta, layout, batch, scale, Z, np.repeat(np.arange(K), 2), np.tile([1, -1], K))
    return nats[0::2], nats[1::2]


def row_losses(theta, layout: Layout, batch, scale: float, Z) -> tuple[np.ndarray, np.ndarray]:
    """(plus, minus), each (K, B) float64: every row's mean nats/byte (position_losses' mean)."""
    plus, minus = position_losses(theta, layout, batch, scale, Z)
    return plus.mean(axis=-1), minus.mean(axis=-1)


def coefficients(plus, minus, scale: float) -> np.ndarray:
    """c (K, B): each pair's and row's central difference, (L+ - L-) / (2 scale)."""
    return (np.asarray(plus, np.float64) - np.asarray(minus, np.float64)) / (2 * scale)


def credit(coeffs, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The weights (K, B, T) float64 of each pair's noise at each position in zeta: for the gates,
    for the logits. coeffs (K, B) rows' differences: 1/(K B) c_(k,b) everywhere. causal, coeffs
    (K, B, T) every target's differences d_(k,b,t) of its nats (not their mean): the gates' noise
    at t weighted by the targets it can move only, 1/(K B T) sum_(t' >= t) d_(k,b,t') (an LSTM's a_t
    reaches no earlier output), the logits' by its own target's, 1/(K B T) d_(k,b,t). The dropped
    products have mean zero exactly (E[d_t' z_t] = dnll_t'/da_t = 0 for t' < t), so the estimate
    keeps its expectation and loses their variance: the reward-to-go of policy gradients
    (Williams 1992), along time."""
    coeffs = np.asarray(coeffs, np.float64)
    if not causal:
        K, B = coeffs.shape
        return coeffs[..., None] / (K * B), coeffs[..., None] / (K * B)
    K, B, T = coeffs.shape
    own = coeffs / (K * B * T)  # the batch loss is the mean over its B T targets
    return np.flip(np.cumsum(np.flip(own, -1), -1), -1), own


def combined(coeffs, Z, causal: bool = False, gates: int = 0) -> np.ndarray:
    """zeta (B, T, S) float32 = sum_k w_(k,b,t) Z[k, b, t] (Z (K, B, T, S)) with the weights of
    `credit`: coeffs (K, B), or (K, B, T) when causal; the first `gates` of S take the gates'."""
    w_gates, w_logits = (np.broadcast_to(w, Z.shape[:3]) for w in credit(coeffs, causal))
    zeta = np.empty(Z.shape[1:], np.float32)
    zeta[..., :gates] = np.einsum("kbt,kbts->bts", w_gates, Z[..., :gates])
    zeta[..., gates:] = np.einsum("kbt,kbts->bts", w_logits, Z[..., gates:])
    return zeta


def clean_forward(theta, layout: Layout, batch, probs: bool = False):
    """The inputs of the outer products, from a clean forward at theta on the (B, T + 1) batch, in
    theta's dtype: x0 (B, T, E) layer 0's input (the embedded bytes), hs (L of (B, T, H)) every
    layer's outputs h_t, and with `probs` the softmax (B, T, V) of the logits (the local readout's
    delta rule; else None). An engine whose forward runs elsewhere returns the same from its own
    forward (zosoma.engines.forward_only)."""
    p = layout.views(theta)
    tokens = batch[:, :-1]
    B, T = tokens.shape
    x0 = x = p["embed"][tokens]
    hs = []
    for layer in range(layout.config.layers):
        w_ih, w_hh, bias = (p[f"lstm{layer}.{n}"] for n in ("w_ih", "w_hh", "bias"))
        h, c = np.zeros((B, layout.config.hidden), theta.dtype), np.zeros((B, layout.config.hidden), theta.dtype)
        out = np.empty((B, T, layout.config.hidden), theta.dtype)
        for t in range(T):
            h, c = lstm_cell(x[:, t] @ w_ih + h @ w_hh + bias, c)
            out[:, t] = h
        hs.append(out)
        x = out
    return x0, hs, np.exp(log_softmax(x @ p["out.w"] + p["out.b"])) if probs else None


def outer_products(theta, layout: Layout, batch, zeta, inputs) -> np.ndarray:
    """ghat (d,) in theta's dtype: the outer products of zeta (B, T, S) with a clean forward's
    inputs (x0, hs, probs) = clean_forward's (module docstring): each layer's w_ih from its input,
    w_hh from h_(t-1) (zero at t = 0), the embedding's rows through layer 0's w_ih^T (theta's). With
    no logits in zeta (S = L*4H) the readout's part is its exact gradient, the delta rule
    (probs - onehot) / (B T): local to the output layer, no backward pass."""
    p = layout.views(theta)
    ghat = np.zeros(layout.size, theta.dtype)
    g = layout.views(ghat)
    tokens = batch[:, :-1]
    B, T = tokens.shape
    L, G = layout.config.layers, 4 * layout.config.hidden
    x, hs, probs = inputs
    for layer in range(L):
        z = zeta[:, :, layer * G:(layer + 1) * G]  # (B, T, G)
        before = np.concatenate([np.zeros_like(hs[layer][:, :1]), hs[layer][:, :-1]], axis=1)  # h_(t-1)
        g[f"lstm{layer}.w_ih"][...] = np.einsum("bti,btg->ig", x, z)
        g[f"lstm{layer}.w_hh"][...] = np.einsum("bth,btg->hg", before, z)
        g[f"lstm{layer}.bias"][...] = z.sum(axis=(0, 1))
        if layer == 0:  # the embedding row is layer 0's input: d a / d embed[v] = w_ih at byte v
            np.add.at(g["embed"], tokens, z @ p["lstm0.w_ih"].T)
        x = hs[layer]
    z = zeta[:, :, L * G:]
    if z.shape[-1] == 0:  # the readout by its local rule
        z = probs.copy()
        np.put_along_axis(z, batch[:, 1:, None].astype(np.intp), np.take_along_axis(
            z, batch[:, 1:, None].astype(np.intp), axis=-1) - 1, axis=-1)
        z = z / (B * T)
    g["out.w"][...] = np.einsum("bth,btv->hv", x, z)
    g["out.b"][...] = z.sum(axis=(0, 1))
    return ghat


def estimate(theta, layout: Layout, batch, zeta) -> np.ndarray:
    """ghat (d,) in theta's dtype: the outer products of zeta (B, T, S) with the inputs of a clean
    forward at theta on the (B, T + 1) batch (module docstring; the readout's delta rule when zeta
    has no logits): outer_products of clean_forward."""
    local = zeta.shape[-1] == width(layout, "local")
    return outer_products(theta, layout, batch, zeta, clean_forward(theta, layout, batch, local))


def update_flops(layout: Layout, K: int, readout: str = "perturb") -> int:
    """Multiply-adds x 2 per predicted byte of `estimate` after the members' forwards: combining K
    pairs' noise (K S), the clean forward (ModelConfig.flops_per_token) and the outer products
    (every weight once: the gates' inputs, the embedding's w_ih^T, the readout's)."""
    cfg = layout.config
    E, H, L, G = cfg.embed, cfg.hidden, cfg.layers, 4 * cfg.hidden
    outer = sum(G * ((E if layer == 0 else H) + H + 1) for layer in range(L)) + G * E + VOCAB * (H + 1)
    return 2 * K * width(layout, readout) + cfg.flops_per_token() + 2 * outer
