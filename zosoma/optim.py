"""SPSA gradient estimation and the update rules applied to its estimate.

SPSA (Spall 1992; MeZO, Malladi et al. 2023, for seed-regenerated noise): on one shared minibatch,

    g_k  = (L(theta + eps*delta_k) - L(theta - eps*delta_k)) / (2*eps)      k = 0..P-1
    ghat = (1/P) * sum_k g_k * delta_k

where delta_k = noise(seed, expert, step, member=k). Only the P scalars g_k are needed to rebuild
ghat anywhere: the directions are regenerated from their counters, never stored.

The update rules are small strategies with explicit state (a dict of arrays, so it checkpoints as
is): ZO-SGD, ZO-momentum (heavy ball, as torch.optim.SGD) and ZO-Adam (Kingma & Ba 2015, with
decoupled weight decay as AdamW, Loshchilov & Hutter 2019).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

import numpy as np

from .noise import add_noise


def perturbed(theta: np.ndarray, eps: float, members: range, seed: int, expert: int, step: int,
              kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """The antithetic population for directions `members`: rows 2j and 2j+1 are
    theta + eps*delta_k and theta - eps*delta_k for k = members[j]. Returns (2*len(members), d)."""
    out = np.empty((2 * len(members), theta.size), np.float32) if out is None else out
    for j, k in enumerate(members):
        add_noise(out[2 * j], theta, eps, seed, expert, step, k, kind)
        add_noise(out[2 * j + 1], theta, -eps, seed, expert, step, k, kind)
    return out


def member_chunks(P: int, d: int, budget_bytes: int = 64 << 20) -> Iterator[range]:
    """Split the P directions into chunks whose 2*chunk float32 parameter copies fit the budget:
    perturbed copies exist only for the chunk being evaluated."""
    size = max(1, min(P, budget_bytes // (2 * 4 * d)))
    for start in range(0, P, size):
        yield range(start, min(P, start + size))


def spsa_losses(theta: np.ndarray, loss_fn: Callable[[np.ndarray], np.ndarray], P: int, eps: float,
                seed: int, expert: int, step: int, kind: str,
                timings: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """L(theta + eps*delta_k) and L(theta - eps*delta_k) for k = 0..P-1, evaluating the population
    chunk by chunk with loss_fn((M, d) thetas) -> (M,) losses on the step's shared minibatch.
    `timings`, if given, accumulates seconds spent building perturbations ("noise") and in
    loss_fn ("forward")."""
    plus, minus = np.empty(P), np.empty(P)
    timings = {} if timings is None else timings
    buf = None
    for chunk in member_chunks(P, theta.size):
        if buf is None or buf.shape[0] != 2 * len(chunk):
            buf = np.empty((2 * len(chunk), theta.size), np.float32)
        t0 = time.perf_counter()
        population = perturbed(theta, eps, chunk, seed, expert, step, kind, buf)
        t1 = time.perf_counter()
        losses = loss_fn(population)
        timings["noise"] = timings.get("noise", 0.0) + t1 - t0
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        plus[chunk.start:chunk.stop] = losses[0::2]
        minus[chunk.start:chunk.stop] = losses[1::2]
    return plus, minus


def spsa_gradient(coeffs: np.ndarray, d: int, seed: int, expert: int, step: int, kind: str) -> np.ndarray:
    """ghat = (1/P) * sum_k coeffs[k] * delta_k, regenerating each delta_k in turn. coeffs (P,)."""
    ghat = np.zeros(d, np.float32)
    P = len(coeffs)
    for k, c in enumerate(coeffs):
        add_noise(ghat, ghat, float(c) / P, seed, expert, step, k, kind)
    return ghat


def learning_rate(step: int, peak: float, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over `warmup` steps, then constant or cosine decay to zero at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def init_state(kind: str, d: int) -> dict[str, np.ndarray]:
    if kind in ("sgd", "eggroll"):  # stateless
        return {}
    if kind == "momentum":
        return {"m": np.zeros(d, np.float32)}
    return {"m": np.zeros(d, np.float32), "v": np.zeros(d, np.float32)}


def apply_update(kind: str, theta: np.ndarray, ghat: np.ndarray, state: dict, step: int, lr: float,
                 momentum: float, beta2: float, weight_decay: float, adam_eps: float = 1e-8):
    """One update of theta by the gradient estimate. Returns new (theta, state) arrays and leaves the
    inputs untouched, so an interruption can never leave a half-applied step behind."""
    if kind == "sgd":
        direction, state = ghat, {}
    elif kind == "momentum":
        m = momentum * state["m"] + ghat
        direction, state = m, {"m": m}
    else:
        m = momentum * state["m"] + (1 - momentum) * ghat
        v = beta2 * state["v"] + (1 - beta2) * ghat * ghat
        t = step + 1
        m_hat = m / (1 - momentum ** t)
        v_hat = v / (1 - beta2 ** t)
        direction, state = m_hat / (np.sqrt(v_hat) + adam_eps), {"m": m, "v": v}
    new = theta - np.float32(lr) * direction.astype(np.float32)
    if weight_decay:
        new -= np.float32(lr * weight_decay) * theta
    return new.astype(np.float32), {k: v.astype(np.float32) for k, v in state.items()}
