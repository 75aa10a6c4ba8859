"""How far a fused LSTM operator in bf16 or fp16 lands from the kit's op-by-op references: the
tolerances docs/porters.md ("Low precision on a device") gives for the recipe.

    python studies/fused_lstm.py KIT [--out FILE]

A fused operator rounds only what it returns (h, c) to the format: its gates, activations and
products stay in fp32 inside. Run one step at a time from the kit's state of the step before
(teacher forcing through h0/c0, seq_len 1), its h and c are compared with the kit's `hidden{l}`
and `cells{l}` in the format's step at 1 (bf16 2^-7, fp16 2^-10: h and c are values of order 1); run free over the sequence (its state kept in the format
between steps, or in fp32 inside one call), its loss on the stage's `batch` with the kit's `loss`.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from zosoma.config import ModelConfig
from zosoma.model.number_formats import round_to
from zosoma.model.params import Layout


ULP_AT_1 = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}  # the format's step between 1 and 2


def _sig(x):
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def fused_step(p, layer, x, h, c, H):
    """One LSTM step as a fused operator computes it: fp32 inside, (h, c) out in fp32."""
    z = (x @ p[f"lstm{layer}.w_ih"] + h @ p[f"lstm{layer}.w_hh"] + p[f"lstm{layer}.bias"]).astype(np.float32)
    i, f, g, o = _sig(z[:, :H]), _sig(z[:, H:2 * H]), np.tanh(z[:, 2 * H:3 * H]), _sig(z[:, 3 * H:])
    c = f * c + i * g
    return o * np.tanh(c), c


def loss_of(p, layout, batch, fmt, state_in_format: bool) -> float:
    R = lambda x: round_to(x, fmt)  # noqa: E731
    H, L = layout.config.hidden, layout.config.layers
    x = p["embed"][batch[:, :-1]]
    for layer in range(L):
        h = c = np.zeros((batch.shape[0], H), np.float32)
        out = []
        for t in range(x.shape[1]):
            h, c = fused_step(p, layer, x[:, t], h, c, H)
            if state_in_format:
                h, c = R(h), R(c)
            out.append(R(h))  # what the operator returns, in the format
        x = np.stack(out, axis=1)
    logits = R((x @ p["out.w"] + p["out.b"]).astype(np.float32))
    z = logits.astype(np.float32)
    m = z.max(axis=-1, keepdims=True)
    nll = (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0] - np.take_along_axis(
        z, batch[:, 1:, None].astype(np.intp), axis=-1)[..., 0]
    return float(nll.mean(dtype=np.float64))


def study(kit: Path) -> list[str]:
    model = json.loads((kit / "manifest.json").read_text())["model"]
    layout = Layout(ModelConfig(model["embed"], model["hidden"], model["layers"]))
    H, L = layout.config.hidden, layout.config.layers
    lines = ["format  per step (teacher-forced): |hidden|, |cells| apart in steps at 1 (max; share over 1)  "
             "free-running loss - kit's (state in the format; fp32 inside)"]
    for fmt in ("bf16", "fp16"):
        with np.load(kit / f"{fmt}.npz") as f:
            k = {n: f[n] for n in f.files}
        p = dict(layout.views(k["weights"].astype(np.float32)))
        hid, cel = [], []
        for layer in range(L):
            for t in range(k["tokens"].shape[1]):
                x = p["embed"][k["tokens"][:, t]] if layer == 0 else k[f"hidden{layer - 1}"][:, t].astype(np.float32)
                h = k["state_h"][layer] if t == 0 else k[f"hidden{layer}"][:, t - 1]
                c = k["state_c"][layer] if t == 0 else k[f"cells{layer}"][:, t - 1]
                h1, c1 = fused_step(p, layer, x, h.astype(np.float32), c.astype(np.float32), H)
                hid.append(np.abs(round_to(h1, fmt) - k[f"hidden{layer}"][:, t]) / ULP_AT_1[fmt])
                cel.append(np.abs(round_to(c1, fmt) - k[f"cells{layer}"][:, t]) / ULP_AT_1[fmt])
        hid, cel = np.concatenate(hid).ravel(), np.concatenate(cel).ravel()
        gaps = [loss_of(p, layout, k["batch"], fmt, s) - float(k["loss"]) for s in (True, False)]
        lines.append(f"{fmt:6s}  hidden {hid.max():.2f} ({(hid > 1).mean():.2%} over 1), cells {cel.max():.2f} "
                     f"({(cel > 1).mean():.2%})  {gaps[0]:+.2e}; {gaps[1]:+.2e}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kit", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = "\n".join(["# python studies/fused_lstm.py KIT (zosoma porting-kit KIT, the default options)"]
                     + study(args.kit)) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
