"""Activity perturbation against weight perturbation: each estimate's cosine to the true gradient.

At one theta (E=16 H=20 by default: seed 0's initialisation, or a checkpoint's) and one (B, T+1)
batch of the shipped corpus, every strategy named takes `--draws` estimates at the same P (so the
same 2P forwards of B T bytes), each from its own counters (draw r is step r), read from the
strategy's own update: no shaping, a rate of 1, no weight decay, so a step moves theta by minus its
estimate. The true gradient is PyTorch autograd's, float64 (zosoma.experiments.backprop).

Per strategy and block (all; embed; lstm: w_ih, w_hh, bias; readout: out.w, out.b):
    cos        mean over draws of cos(ghat_r, g), with its standard error
    mean_cos   cos(mean_r ghat_r, g): -> 1 as draws grow for an unbiased estimator
    rel_err    mean over draws of |ghat_r - g|^2 / |g|^2

    python studies/activity_cosine.py [--checkpoint PATH] [--draws 100] [-P 32] [--eps 1e-3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.engines import get_ops
from zosoma.experiments.backprop import flat_grad, import_torch, mean_loss, torch_model
from zosoma.formats.checkpoint import load_checkpoint
from zosoma.model.params import Layout, init_params
from zosoma.strategies import make_strategy

BLOCKS = {"all": None, "embed": ("embed",), "lstm": ("w_ih", "w_hh", "bias"), "readout": ("out.w", "out.b")}


def block_mask(layout: Layout, names) -> np.ndarray:
    mask = np.zeros(layout.size, bool)
    for e in layout.entries:
        if names is None or any(e.name.endswith(n) for n in names):
            mask[e.offset:e.offset + e.size] = True
    return mask


def true_gradient(theta, layout: Layout, batch) -> np.ndarray:
    import_torch()
    model = torch_model(theta.astype(np.float64), layout)
    mean_loss(model, batch).backward()
    return flat_grad(model, layout)


def estimates(name: str, cfg: TrainConfig, theta, layout: Layout, batch, draws: int, ops) -> np.ndarray:
    """(draws, d) float64: strategy `name`'s estimates at theta, draw r from step r's counters."""
    cfg = dataclasses.replace(cfg, optimizer=name)
    strategy = make_strategy(cfg)
    state = strategy.init(ops, layout.size)
    out = np.empty((draws, layout.size))
    for r in range(draws):
        pop = strategy.ask(0, r)
        plus, minus = strategy.losses(ops, theta, layout, batch, pop, state)
        coeffs, _ = strategy.coefficients(plus, minus)
        new, _ = strategy.update(ops, layout, theta, state, coeffs, pop, 1.0)
        out[r] = theta.astype(np.float64) - np.asarray(new, np.float64)
    return out


def cosines(G: np.ndarray, g: np.ndarray) -> np.ndarray:
    return G @ g / (np.linalg.norm(G, axis=1) * np.linalg.norm(g))


def measure(G: np.ndarray, g: np.ndarray, layout: Layout) -> dict:
    row = {}
    for block, names in BLOCKS.items():
        m = block_mask(layout, names)
        cos = cosines(G[:, m], g[m])
        mean = G[:, m].mean(axis=0)
        row[block] = {"cos": float(cos.mean()), "cos_se": float(cos.std(ddof=1) / np.sqrt(len(cos))),
                      "mean_cos": float(mean @ g[m] / (np.linalg.norm(mean) * np.linalg.norm(g[m]))),
                      "rel_err": float((((G[:, m] - g[m]) ** 2).sum(axis=1) / (g[m] ** 2).sum()).mean())}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="theta from this checkpoint (default: seed 0's init at E=16 H=20)")
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("-P", type=int, default=32, help="pairs: 2P forwards per estimate")
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--strategies", default="sgd,onesided,activity")
    ap.add_argument("--out", help="write the records as JSON lines here")
    args = ap.parse_args()
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint)
        model, theta, where = ckpt.model, ckpt.theta, f"{args.checkpoint} (step {ckpt.step})"
    else:
        model = ModelConfig(embed=16, hidden=20, layers=1)
        theta, where = init_params(model, 0), "seed 0's initialisation"
    layout = Layout(model)
    cfg = TrainConfig(optimizer="sgd", perturbations=args.P, eps=args.eps, shaping=(), schedule="constant", warmup=0)
    batch = BatchSampler(load_corpus(), cfg.seq_len + 1).batch(1234, 0, 0, cfg.batch)
    g = true_gradient(theta, layout, batch)
    ops = get_ops("cpu")
    print(f"theta: {where}; E={model.embed} H={model.hidden} L={model.layers}, d={layout.size:,}; "
          f"B={cfg.batch} T={cfg.seq_len}, P={args.P} (2P forwards), eps={args.eps}, {args.draws} draws; |g|={np.linalg.norm(g):.4g}")
    print(f"{'strategy':<10} {'block':<8} {'cos':>8} {'+-se':>7} {'mean_cos':>9} {'rel_err':>9}  CPU-s/draw")
    records = []
    for name in args.strategies.split(","):
        t0 = time.process_time()
        G = estimates(name, cfg, theta, layout, batch, args.draws, ops)
        cpu = (time.process_time() - t0) / args.draws
        for block, m in measure(G, g, layout).items():
            print(f"{name:<10} {block:<8} {m['cos']:8.4f} {m['cos_se']:7.4f} {m['mean_cos']:9.4f} {m['rel_err']:9.1f}  {cpu:.3f}")
            records.append({"strategy": name, "block": block, "P": args.P, "eps": args.eps, "draws": args.draws,
                            "theta": where, **m, "cpu_s_per_draw": cpu})
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
