"""The estimators' mechanism: each strategy's estimate against the true gradient at a fixed theta.

At one theta and one (B, T+1) batch, every registered strategy (zosoma.strategies.STRATEGIES, by
name: the paper's SPSA, one-sided, readout, rowwise and any other) takes `draws` steps' worth
of estimates, each from its own counters (step r is draw r), all at the same P (so the same 2P
forwards of B T bytes; a strategy's extra arithmetic is its Strategy.extra_flops). The estimate
is read generically from the strategy's own step: with no shaping, a constant rate of 1 and no
weight decay, a step moves theta by exactly minus its estimate (readout_lr 1 makes the readout's
step its gradient), so any strategy is measured by what it would do, not by a copy of its maths.

The true gradient of the batch's mean loss is PyTorch autograd's in float64 (the referee of
zosoma.experiments.backprop). Per strategy:

    cosine     mean over draws of cos(ghat_r, g) (its standard error over draws)
    mean_cos   cos(mean_r ghat_r, g): near 1 for an unbiased estimator as draws grow
    rel_error  mean over draws of |ghat_r - g|^2 / |g|^2
    fitted     the same after the best scale a ghat_r (a = ghat.g / |ghat|^2): what a tuned rate
               or a normalising shaping can reach, 1 - cosine^2 per draw

and, for the per-row question, the rows' gradients g_b (each row's own mean loss): the factor
B |g|^2 / mean_b |g_b|^2 by which a direction per (member, row) divides the error of one
direction per member (zosoma.strategies.rowwise).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zosoma.config import TrainConfig
from zosoma.model.params import Layout

PLAIN = dict(shaping=(), lr=1.0, schedule="constant", warmup=0, weight_decay=0.0)  # a step = minus the estimate


def true_gradient(theta: np.ndarray, layout: Layout, batch: np.ndarray) -> np.ndarray:
    """(d,) float64: autograd's gradient of the mean nats/byte of `batch` (B, T+1) at theta."""
    from zosoma.experiments.backprop import flat_grad, mean_loss, torch_model
    import torch

    model = torch_model(theta, layout, torch.float64)
    mean_loss(model, batch).backward()
    return flat_grad(model, layout)


def row_gradients(theta: np.ndarray, layout: Layout, batch: np.ndarray) -> np.ndarray:
    """(B, d) float64: each row's own gradient (of its mean over T bytes)."""
    return np.stack([true_gradient(theta, layout, batch[b:b + 1]) for b in range(batch.shape[0])])


def estimates(name: str, theta: np.ndarray, layout: Layout, batch: np.ndarray, draws: int, ops,
              **options) -> np.ndarray:
    """(draws, d) float64: strategy `name`'s estimates at theta on `batch`, draw r from step r's
    counters (expert 0). options: TrainConfig fields (perturbations, eps, noise, ...)."""
    from zosoma.strategies import make_strategy

    cfg = dataclasses.replace(TrainConfig(optimizer=name), batch=batch.shape[0], seq_len=batch.shape[1] - 1,
                              steps=draws, **{**PLAIN, **options})
    strategy = make_strategy(cfg)
    strategy.check(layout)
    state, shaping = strategy.init(ops, theta.size), strategy.shaping.init()
    out = np.empty((draws, theta.size))
    base = ops.asarray(theta)
    for r in range(draws):
        pop = strategy.ask(0, r)
        coeffs, _ = strategy.coefficients(*strategy.losses(ops, base, layout, batch, pop, state))
        told = strategy.tell(ops, layout, base, state, shaping, coeffs, pop)
        out[r] = np.asarray(ops.to_numpy(base), np.float64) - ops.to_numpy(told.theta)
    return out


def measure(ghat: np.ndarray, g: np.ndarray) -> dict:
    """The record of estimates ghat (R, d) against the true gradient g (d,) (see the module)."""
    norms = np.linalg.norm(ghat, axis=1)
    cos = ghat @ g / (norms * np.linalg.norm(g))
    mean = ghat.mean(axis=0)
    return dict(draws=len(ghat), cosine=float(cos.mean()), cosine_se=float(cos.std(ddof=1) / np.sqrt(len(cos))),
                mean_cos=float(mean @ g / (np.linalg.norm(mean) * np.linalg.norm(g))),
                rel_error=float((((ghat - g) ** 2).sum(axis=1)).mean() / (g @ g)),
                fitted=float((1 - cos ** 2).mean()))


def row_gain(rows: np.ndarray) -> float:
    """B |g|^2 / mean_b |g_b|^2 of the rows' gradients (B, d), g their mean."""
    g = rows.mean(axis=0)
    return float(rows.shape[0] * (g @ g) / (rows ** 2).sum(axis=1).mean())


def format_table(records: list[dict]) -> str:
    lines = [f"{'estimator':<12} {'P':>4} {'draws':>6} {'cosine':>16} {'cos(mean)':>10} {'rel. error':>11} "
             f"{'fitted':>8} {'block cosines':>30}"]
    for r in records:
        blocks = " ".join(f"{k}={v:.3f}" for k, v in r.get("blocks", {}).items())
        lines.append(f"{r['name']:<12} {r['P']:>4} {r['draws']:>6} {r['cosine']:>9.4f} ± {r['cosine_se']:.4f} "
                     f"{r['mean_cos']:>10.4f} {r['rel_error']:>11.2f} {r['fitted']:>8.4f} {blocks:>30}")
    return "\n".join(lines)


def block_cosines(ghat: np.ndarray, g: np.ndarray, layout: Layout) -> dict:
    """Mean cosine per block: the embedding and LSTM (before out.w) and the readout (out.w, out.b)."""
    n0 = layout["out.w"].offset
    out = {}
    for label, part in (("body", slice(0, n0)), ("readout", slice(n0, None))):
        a, b = ghat[:, part], g[part]
        out[label] = float((a @ b / (np.linalg.norm(a, axis=1) * np.linalg.norm(b) + 1e-300)).mean())
    return out
