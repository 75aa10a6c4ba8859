"""The variance experiment: independent (SOMA) versus summed losses for N experts' SPSA estimates.

SOMA's theorem (the SOMA paper, arXiv:2609.37899): on a fixed separable objective with N
equal-size blocks, independent losses reduce the relative gradient variance to about 1/N of the
shared-loss estimator's. This module measures it twice: on a quadratic, where the exact ratio is
known in closed form, and on real byte-level LSTM experts at fixed weights.

Derivation (the `theory` column). Block i has d parameters and gradient g_i; its direction
delta_i has i.i.d. coordinates with E[delta] = 0, E[delta^2] = 1, E[delta^4] = m4 (Rademacher m4 = 1,
Gaussian m4 = 3); blocks' directions are independent. Central differences give the directional
derivative g_i . delta_i exactly on a quadratic (the quadratic term cancels) and up to O(eps^2)
otherwise. With one direction (P = 1):

    independent:  ghat_i = (g_i . delta_i) delta_i
                  E||ghat_i - g_i||^2 = E[(g_i . delta_i)^2 ||delta_i||^2] - ||g_i||^2
                                      = (d - 1 + m4) ||g_i||^2 - ||g_i||^2   = (d + m4 - 2) ||g_i||^2
    shared:       ghat_i = (sum_j g_j . delta_j) delta_i
                         = [independent estimate] + sum_{j != i} (g_j . delta_j) delta_i
                  the added terms have mean zero and are uncorrelated with the rest and with each
                  other (independent delta_j), each contributing E(g_j . delta_j)^2 E||delta_i||^2
                  = ||g_j||^2 d, so
                  E||ghat_i - g_i||^2 = (d + m4 - 2) ||g_i||^2 + d * sum_{j != i} ||g_j||^2

Dividing by ||g_i||^2, block i's relative variances and their ratio are

    independent / shared = (d + m4 - 2) / ((d + m4 - 2) + d * sum_{j != i} ||g_j||^2 / ||g_i||^2)

and for N equal blocks (equal gradient norms) = (d - 1) / (N d - 1) for Rademacher directions,
(d + 1) / (N d + 1) for Gaussian ones: slightly below 1/N, and -> 1/N as d grows. Averaging P
directions divides both variances by P, so the ratio does not depend on P. With N = 1 the two
estimators are the same estimator and the ratio is exactly 1.

Why real LSTMs need not give 1/N: the shared estimator's extra variance for expert i is
proportional to sum_{j != i} ||g_j||^2 / ||g_i||^2, the other experts' gradient norms relative to
its own. Experts with different weights and data have different gradient norms, so expert i's
ratio is above 1/N when its gradient is larger than the others' (their noise is small beside its
signal) and below 1/N when it is smaller. Averaged over the experts, the shared variance grows:
mean_i sum_{j != i} ||g_j||^2 / ||g_i||^2 >= N - 1 (AM-GM over the pairs i, j), so the averaged
ratio is at most the equal-norm value. The `theory` column for LSTMs therefore uses the measured
norms (estimated without bias as the mean squared directional derivative, E[(g . delta)^2] =
||g||^2); the finite-difference error O(eps^2) and float32 rounding are the only departures from
it besides Monte-Carlo noise.

Aggregation: every row averages the relative variances over the N blocks/experts and reports
ratio = mean_i(independent) / mean_i(shared), with the theory aggregated the same way.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from zosoma.config import ModelConfig
from zosoma.model.noise import KINDS, noise
from zosoma.engines.ops import Ops
from zosoma.model.population import Population
from zosoma.model.params import Layout, init_params

FOURTH_MOMENT = {"rademacher": 1.0, "gaussian": 3.0}  # m4 = E[delta^4] of one coordinate
LSTM_MODEL = ModelConfig(embed=16, hidden=32, layers=1)  # d = 18,816


def theory(norms_sq: np.ndarray, d: int, P: int = 1, kind: str = "rademacher"):
    """Exact expected relative variances of each block's P-direction SPSA estimate.

    norms_sq (N,) squared gradient norms ||g_i||^2 of the N blocks (each of d parameters).
    Returns (independent (N,), shared (N,)) relative variances E||ghat_i - g_i||^2 / ||g_i||^2."""
    norms_sq = np.asarray(norms_sq, np.float64)
    own = (d + FOURTH_MOMENT[kind] - 2.0) / P
    others = norms_sq.sum() - norms_sq  # (N,) sum_{j != i} ||g_j||^2
    return np.full(norms_sq.shape, own), own + d * others / (norms_sq * P)


def _row(experiment: str, N: int, rel_ind: np.ndarray, rel_sh: np.ndarray, th_ind: np.ndarray,
         th_sh: np.ndarray, **extra) -> dict:
    ind, sh = float(np.mean(rel_ind)), float(np.mean(rel_sh))
    return dict(experiment=experiment, N=N, rel_var_independent=ind, rel_var_shared=sh,
                ratio=ind / sh, inverse_N=1.0 / N, theory=float(np.mean(th_ind) / np.mean(th_sh)),
                theory_independent=float(np.mean(th_ind)), theory_shared=float(np.mean(th_sh)),
                **extra)


def _check(Ns: Sequence[int], P: int, kind: str) -> tuple[int, ...]:
    Ns = tuple(int(n) for n in Ns)
    if not Ns or min(Ns) < 1:
        raise ValueError(f"numbers of experts must be at least 1, got {Ns}")
    if P < 1:
        raise ValueError(f"P must be at least 1, got {P}")
    if kind not in KINDS:
        raise ValueError(f"noise kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return Ns


# --- 1. the quadratic ----------------------------------------------------------------------------

def quadratic_blocks(n_blocks: int, d: int, seed: int):
    """Seeded separable quadratic f(theta) = sum_i 0.5 theta_i^T diag(a_i) theta_i + b_i . theta_i
    and its evaluation point x. Block i depends only on (seed, i), so adding blocks keeps the old
    ones. Each block's b_i and x_i are scaled together so that every gradient g_i = a_i x_i + b_i
    has ||g_i||^2 = d: N equal blocks, the theorem's hypothesis. Returns a, b, x, g, each (N, d)."""
    a, b, x = (np.empty((n_blocks, d)) for _ in range(3))
    for i in range(n_blocks):
        rng = np.random.default_rng([seed, i, 0x0A7])  # stream 0x0A7: the quadratic
        a[i] = rng.uniform(0.5, 2.0, d)
        b[i], x[i] = rng.standard_normal(d), rng.standard_normal(d)
        scale = math.sqrt(d) / np.linalg.norm(a[i] * x[i] + b[i])
        b[i] *= scale
        x[i] *= scale
    return a, b, x, a * x + b


def _quadratic(a, b, t):
    """f_i(t) = 0.5 t^T diag(a) t + b . t over the last axis."""
    return (0.5 * a * t * t + b * t).sum(-1)


def _directions(n_blocks: int, d: int, P: int, steps: range, seed: int, kind: str) -> np.ndarray:
    """(len(steps), n_blocks, P, d) float64: delta = noise(seed, expert=i, step=trial, member=k)."""
    out = np.empty((len(steps), n_blocks, P, d))
    for r, step in enumerate(steps):
        for i in range(n_blocks):
            for k in range(P):
                out[r, i, k] = noise(d, seed, i, step, k, kind)
    return out


def quadratic_variance(Ns: Sequence[int] = (1, 2, 4, 8, 16), d: int = 64, P: int = 1,
                       trials: int = 20_000, eps: float = 1e-3, seed: int = 0,
                       kind: str = "rademacher") -> list[dict]:
    """Monte-Carlo relative variance of each block's SPSA estimate on the quadratic, independent
    versus shared loss, for each number of blocks N. Both modes use the same directions (trial r
    is step r), and the scalars are real central differences of f_i; one record per N.

    Block i, its directions and its scalars are the same for every N, so the directions are drawn
    once for max(Ns) blocks and sliced. Monte-Carlo standard error of the ratio: about
    sqrt(2 / (P * trials)), 1% at the defaults (the shared loss's squared scalar is close to a
    chi-square(1) per direction; the independent side averages over the N blocks). eps does not
    matter: central differences of a quadratic are exact."""
    Ns = _check(Ns, P, kind)
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    n = max(Ns)
    a, b, x, g = quadratic_blocks(n, d, seed)
    sq_err = {N: np.zeros((2, N)) for N in Ns}  # (independent, shared) summed ||ghat_i - g_i||^2
    chunk = max(1, (1 << 20) // (n * P * d))  # trials per chunk: 8 MiB of directions
    for start in range(0, trials, chunk):
        D = _directions(n, d, P, range(start, min(trials, start + chunk)), seed, kind)  # (R, n, P, d)
        for N in Ns:
            DN = D[:, :N]
            a_, b_, x_ = a[None, :N, None], b[None, :N, None], x[None, :N, None]  # (1, N, 1, d)
            c = (_quadratic(a_, b_, x_ + eps * DN) - _quadratic(a_, b_, x_ - eps * DN)) / (2 * eps)
            # c (R, N, P): block i's scalars; the shared loss's scalar sums them over the blocks j
            shared = np.broadcast_to(c.sum(axis=1, keepdims=True), c.shape)
            for m, coeffs in enumerate((c, shared)):
                ghat = np.einsum("rnp,rnpd->rnd", coeffs, DN) / P  # (R, N, d)
                sq_err[N][m] += ((ghat - g[None, :N]) ** 2).sum(axis=(0, 2))
    records = []
    for N in Ns:
        rel = sq_err[N] / trials / d  # ||g_i||^2 = d
        th_ind, th_sh = theory(np.full(N, float(d)), d, P, kind)
        records.append(_row("quadratic", N, rel[0], rel[1], th_ind, th_sh, d=d, P=P, trials=trials,
                            kind=kind, seed=seed))
    return records


# --- 2. real LSTM experts at fixed weights -------------------------------------------------------

def _spread(estimates) -> float:
    """Unbiased trace of the covariance, 1/(R-1) * sum_r ||ghat_r - mean||^2, of R estimates."""
    total, total_sq, R = None, 0.0, 0
    for ghat in estimates:
        ghat = ghat.astype(np.float64)
        total = ghat.copy() if total is None else total + ghat
        total_sq += float(ghat @ ghat)
        R += 1
    return (total_sq - float(total @ total) / R) / (R - 1)


def expert_batches(n: int, B: int, T: int, seed: int, sampler=None) -> list[np.ndarray]:
    """Expert i's fixed minibatch: the (B, T+1) windows training draws at step 0 (stream = expert),
    from `sampler` (a zosoma.corpus.BatchSampler) or the shipped corpus."""
    if sampler is None:
        from zosoma.corpus import BatchSampler, load_corpus

        sampler = BatchSampler(load_corpus(), T + 1)
    return [sampler.batch(seed, i, 0, B) for i in range(n)]


def lstm_variance(Ns: Sequence[int] = (1, 2, 4), model: ModelConfig = LSTM_MODEL,
                  batches: Sequence[np.ndarray] | None = None, sampler=None, B: int = 8, T: int = 32,
                  reps: int = 256, P: int = 16, eps: float = 1e-3, seed: int = 0,
                  kind: str = "rademacher", thetas: Sequence[np.ndarray] | None = None,
                  ops=None) -> list[dict]:
    """Relative variance of N real LSTM experts' SPSA estimates, independent versus summed loss.

    Expert i has weights thetas[i] (default init_params(model, seed, i)) and a fixed minibatch
    batches[i] ((B, T+1) uint8; default `expert_batches`). Repetition r is SPSA step r: P
    directions noise(seed, expert=i, step=r, member=k), scalars g_{i,r,k} from one population
    forward. The independent estimate of expert i uses its own scalars, the shared one
    sum_{j < N} g_{j,r,k}; both are rebuilt by zosoma.engines.ops.Ops.noise_sum. For each mode the
    relative variance is the unbiased spread of the R estimates around their own mean over
    ||g_i||^2, estimated as mean_{r,k} g_{i,r,k}^2 (unbiased, and far less noisy than ||mean||^2,
    which holds (d-1)/(R P) ||g||^2 of noise when R P is not >> d). One record per N, with
    per-expert values in "per_expert".

    Expert i's scalars do not depend on N, so the 2 P R forwards per expert are run once for
    max(Ns) experts. Measured ratio_i ~ ||g_i||^2 / mean(summed scalar^2) and theory ~ ||g_i||^2 /
    sum_j ||g_j||^2 (both estimated from the same scalars) differ by the sample correlations of
    the experts' scalars, zero in expectation and of order 1 / sqrt(R P). With `sampler` or
    `batches`, T is the batches' own. The populations run on the engine `ops` (default the CPU)."""

    Ns = _check(Ns, P, kind)
    if reps < 2:
        raise ValueError(f"reps must be at least 2 to measure a spread, got {reps}")
    n = max(Ns)
    layout = Layout(model)
    d = layout.size
    thetas = [init_params(model, seed, i) for i in range(n)] if thetas is None else list(thetas)
    batches = expert_batches(n, B, T, seed, sampler) if batches is None else list(batches)
    if len(thetas) < n or len(batches) < n:
        raise ValueError(f"{n} experts need {n} weight vectors and {n} batches, "
                         f"got {len(thetas)} and {len(batches)}")
    ops = ops or Ops()
    c = np.empty((n, reps, P))  # scalars g_{i,r,k}
    for i in range(n):
        theta = ops.asarray(thetas[i])
        for r in range(reps):
            plus, minus = ops.perturbed_losses(theta, layout, batches[i], Population(P, eps, seed, i, r, kind))
            c[i, r] = (plus - minus) / (2 * eps)
    norms_sq = (c ** 2).mean(axis=(1, 2))  # (n,) E[(g . delta)^2] = ||g_i||^2

    def spread(i: int, coeffs: np.ndarray) -> float:  # coeffs (reps, P): expert i's scalars
        return _spread(Ops().noise_sum(coeffs[r], d, Population(P, eps, seed, i, r, kind)) for r in range(reps))

    independent = np.array([spread(i, c[i]) for i in range(n)]) / norms_sq
    records = []
    for N in Ns:
        summed = c[:N].sum(axis=0)  # (reps, P) the shared loss's scalars
        shared = np.array([spread(i, summed) for i in range(N)]) / norms_sq[:N]
        th_ind, th_sh = theory(norms_sq[:N], d, P, kind)
        per_expert = dict(grad_norm_sq=norms_sq[:N].tolist(), rel_var_independent=independent[:N].tolist(),
                          rel_var_shared=shared.tolist(), ratio=(independent[:N] / shared).tolist(),
                          theory=(th_ind / th_sh).tolist())
        records.append(_row("lstm", N, independent[:N], shared, th_ind, th_sh, d=d, P=P, reps=reps,
                            B=B, T=int(batches[0].shape[1]) - 1, eps=eps, kind=kind, seed=seed,
                            model=dict(embed=model.embed, hidden=model.hidden, layers=model.layers),
                            per_expert=per_expert))
    return records


# --- 3. display ----------------------------------------------------------------------------------

def _title(rec: dict) -> str:
    if rec["experiment"] == "quadratic":
        return (f"quadratic: N blocks of d={rec['d']}, P={rec['P']}, {rec['trials']:,} trials, "
                f"{rec['kind']}")
    m = rec["model"]
    return (f"LSTM experts: E={m['embed']} H={m['hidden']} L={m['layers']} (d={rec['d']:,}), "
            f"B={rec['B']} T={rec['T']}, P={rec['P']}, {rec['reps']} reps, {rec['kind']}")


def format_table(records: Sequence[dict]) -> str:
    """Plain-text tables, one per experiment: N, relative variances (independent, shared), their
    ratio, 1/N and the exact theory."""
    header = (f"{'N':>4}  {'rel.var indep':>13}  {'rel.var shared':>14}  {'ratio':>7}  {'1/N':>7}  "
              f"{'theory':>7}")
    lines, current = [], None
    for rec in records:
        if (rec["experiment"], _title(rec)) != current:
            current = (rec["experiment"], _title(rec))
            lines += ([""] if lines else []) + [current[1], header]
        lines.append(f"{rec['N']:>4}  {rec['rel_var_independent']:>13.5g}  {rec['rel_var_shared']:>14.5g}  "
                     f"{rec['ratio']:>7.4f}  {rec['inverse_N']:>7.4f}  {rec['theory']:>7.4f}")
    return "\n".join(lines)
