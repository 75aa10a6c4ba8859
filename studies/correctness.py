"""The correctness figures the README quotes, printed by one command (PyTorch is the referee: it
reuses the tests' shape grid and PyTorch model, and needs the test extra):

    python studies/correctness.py [--out results/correctness.txt]

1. zosoma's NumPy reference forward vs torch.nn.LSTM + nn.Linear loaded with the same weights: max
   relative loss error over the shape grid of tests/test_torch_reference.py, float64 and float32.
2. SPSA central differences vs autograd's directional derivatives (d = 10,112, eps = 1e-4 in
   float64, 3e-3 in float32): max |g_k - grad.delta_k| / |grad| over 16 directions of each kind.
3. The mean SPSA estimate over P = 2,048 Rademacher directions (d = 3,744): its cosine with the
   autograd gradient against 1/sqrt(1 + (d-1)/P), and ghat.g/|g|^2 (1 when unbiased).
The tests assert bounds a few times these figures.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from test_torch_reference import (DIRECTIONAL_CONFIG, SHAPES, central_difference, directions,  # noqa: E402
                                  make_batch, make_theta, torch_flat_grad, torch_loss)
from torch_reference import torch_model  # noqa: E402
from zosoma.config import ModelConfig  # noqa: E402
from zosoma.model import reference  # noqa: E402


def loss_errors() -> dict:
    worst = {"float64": 0.0, "float32": 0.0}
    for E, H, L in SHAPES:
        for B in (1, 3):
            for T in (1, 17):
                theta32, layout = make_theta(ModelConfig(embed=E, hidden=H, layers=L), seed=E + H + L)
                batch = make_batch(B, T, seed=B * 100 + T)
                for name, theta, dtype in (("float64", theta32.astype(np.float64), torch.float64),
                                           ("float32", theta32, torch.float32)):
                    with torch.no_grad():
                        t_loss = torch_loss(torch_model(theta, layout, dtype), batch)[0].item()
                    rel = abs(reference.loss(theta, layout, batch) - t_loss) / abs(t_loss)
                    worst[name] = max(worst[name], rel)
    return worst


def directional_errors() -> dict:
    theta32, layout = make_theta(DIRECTIONAL_CONFIG, seed=1)
    batch = make_batch(3, 12, seed=1)
    grad, _ = torch_flat_grad(theta32.astype(np.float64), layout, batch)
    scale = np.linalg.norm(grad)
    out = {}
    for kind in ("rademacher", "gaussian"):
        for name, theta, eps in (("float64", theta32.astype(np.float64), 1e-4),
                                 ("float32", theta32, np.float32(3e-3))):
            errors = []
            for delta in directions(layout.size, 7, kind, range(16)):
                delta = delta.astype(theta.dtype)
                errors.append(abs(central_difference(theta, layout, batch, delta, eps) - grad @ delta) / scale)
            out[f"{kind} {name}"] = max(errors)
    return out


def estimate_cosine() -> dict:
    theta32, layout = make_theta(ModelConfig(embed=4, hidden=8, layers=1), seed=2)
    theta = theta32.astype(np.float64)
    d, P = layout.size, 2048
    batch = make_batch(2, 8, seed=2)
    grad, _ = torch_flat_grad(theta, layout, batch)
    deltas = directions(d, 2024, "rademacher", range(P))
    g = np.array([central_difference(theta, layout, batch, delta, 1e-4) for delta in deltas])
    ghat = g @ deltas / P
    norm = np.linalg.norm(grad)
    return {"d": d, "P": P, "cosine": float(ghat @ grad / (np.linalg.norm(ghat) * norm)),
            "predicted": float(1 / np.sqrt(1 + (d - 1) / P)), "projection": float(ghat @ grad / norm**2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the figures to this file")
    args = parser.parse_args(argv)
    start = time.time()
    loss, directional, cosine = loss_errors(), directional_errors(), estimate_cosine()
    lines = [f"zosoma correctness figures, {time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
             f"NumPy {np.__version__}, torch {torch.__version__}, {platform.machine()}",
             f"1. reference loss vs torch nn.LSTM, max relative error over {len(SHAPES) * 4} shapes: "
             f"float64 {loss['float64']:.1e}, float32 {loss['float32']:.1e}",
             "2. SPSA central difference vs autograd directional derivative, max |g - grad.delta| / |grad| "
             "over 16 directions:"]
    lines += [f"     {k:<22} {v:.1e}" for k, v in directional.items()]
    lines.append(f"3. mean SPSA estimate, d={cosine['d']:,} P={cosine['P']:,} Rademacher: cosine with the "
                 f"gradient {cosine['cosine']:.3f} (predicted 1/sqrt(1+(d-1)/P) = {cosine['predicted']:.3f}), "
                 f"ghat.g/|g|^2 = {cosine['projection']:.3f}")
    lines.append(f"({time.time() - start:.0f} s)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
