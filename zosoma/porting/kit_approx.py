"""The porting kit's `approx` stage: a device whose sigmoid and tanh are approximate (PLAN, or ONNX's
HardSigmoid; zosoma.porting.approx_activations) cannot meet the `forward` and `losses` stages, whose
tolerances are for the exact functions. It is held to the same tolerances against its mode's own
reference instead: the two functions at every segment's start, then a free-running forward and
loss with them. PORTING.md (stage 10, "Approximate activations") is the specification.

The references are float64 evaluations of the float32 inputs. PLAN jumps by 0.0039 where a segment
starts at 2.375 (tanh: 1.1875), so the kit's chain keeps every activation's input at least
NEAR from a jump: a float32 port then never lands on the other side of one.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.errors import ConfigError
from zosoma.model import reference
from zosoma.model.params import Layout
from zosoma.porting import approx_activations as approx
from zosoma.porting.stage import Out, Stage

B, T, LOSS_BATCH = 3, 12, (4, 25)
NEAR = 1e-4  # the chain's activations' inputs stay this far from PLAN's jumps: 100 x a float32 forward's error
JUMPS = (2.375, 2.375 / 2)  # |x| where PLAN's sigmoid and tanh jump


def _edges() -> np.ndarray:
    """Every segment's start, just below and above it, both signs, 0, saturation and +-inf."""
    starts = sorted({s for m in approx.MODES for s in approx.BREAKPOINTS[m]} | {s / 2 for s in approx.BREAKPOINTS["plan"]}
                    | {1.25})  # tanh's (half the sigmoid's) and hard tanh's saturation
    x = [0.0, 0.3, 7.0, np.inf] + [v for s in starts for v in (s, np.nextafter(np.float32(s), np.float32(0)),
                                                               np.nextafter(np.float32(s), np.float32(9)))]
    x = np.array(x, np.float32)
    return np.concatenate([x, -x[1:]])


def _chain_margin(out: dict, layers: int) -> float:
    """The smallest distance of an activation's input to a PLAN jump in a forward's values."""
    gaps = []
    for layer in range(layers):
        z = np.abs(out[f"gates{layer}"].astype(np.float64))
        H = z.shape[-1] // 4
        sig = np.concatenate([z[..., :2 * H], z[..., 3 * H:]], axis=-1)
        gaps += [np.abs(sig - JUMPS[0]).min(), np.abs(z[..., 2 * H:3 * H] - JUMPS[1]).min(),
                 np.abs(np.abs(out[f"cells{layer}"]) - JUMPS[1]).min()]
    return float(min(gaps))


def _draw(layout: Layout, rng):
    """(tokens, h0, c0, batch) whose PLAN chains stay NEAR from a jump (the first of a few draws)."""
    cfg = layout.config
    for _ in range(20):
        tokens = rng.integers(0, VOCAB, (B, T), dtype=np.uint8)
        h0 = (0.5 * rng.standard_normal((cfg.layers, B, cfg.hidden))).astype(np.float32)
        c0 = rng.standard_normal((cfg.layers, B, cfg.hidden)).astype(np.float32)
        batch = rng.integers(0, VOCAB, LOSS_BATCH, dtype=np.uint8)
        yield tokens, h0, c0, batch


def approx_stage(theta, layout: Layout, rng) -> Stage:
    cfg = layout.config
    t64 = theta.astype(np.float64)
    for tokens, h0, c0, batch in _draw(layout, rng):
        chains = {m: (approx.forward(t64, layout, tokens, m, h0[None], c0[None]),
                      approx.forward(t64, layout, batch[:, :-1], m)) for m in approx.MODES}
        if min(_chain_margin(c, cfg.layers) for c in chains["plan"]) > NEAR:
            break
    else:
        raise ConfigError("approx stage: every draw's chain passes near a PLAN jump; choose another seed")
    x = _edges()
    exact_loss = reference.loss(theta.astype(np.float64), layout, batch)
    inputs = {"theta": (theta, "(d,) float32 the kit's weights"), "tokens": (tokens, "(B, T) uint8"),
              "h0": (h0, "(L, B, H) float32 carried-in h"), "c0": (c0, "(L, B, H) float32 carried-in c"),
              "batch": (batch, "(B, T+1) uint8 for the free-running loss, from zero state"),
              "edge_x": (x, "(n,) float32 every segment's start, the float32 values either side, 0, +-inf")}
    outputs, misreadings, tol = {}, {}, {}
    for mode in approx.MODES:
        x64 = x.astype(np.float64)
        chain, free = chains[mode]
        loss = float(approx.nll(free["logits"][0], batch[:, 1:]).mean())
        outputs.update({
            f"{mode}_sigmoid": Out(approx.sigmoid(x64, mode), "approx_fn", ("edge_x",),
                                   f"the {mode} sigmoid (PORTING.md stage 10); a segment applies FROM its start "
                                   "(|x| >= start), the sign by symmetry: 1 - y(|x|) for x < 0"),
            f"{mode}_tanh": Out(approx.tanh(x64, mode), "approx_fn", ("edge_x",),
                                f"2 sigmoid(2x) - 1 with the {mode} sigmoid (no tanh of its own)"),
            f"{mode}_logits": Out(chain["logits"][0], "logits", ("theta", "tokens", "h0", "c0"),
                                  f"stage 1's forward, free-running, with the {mode} sigmoid and tanh in every gate "
                                  "and in tanh(c)"),
            f"{mode}_loss": Out(np.float64(loss), "loss", ("theta", "batch"),
                                f"stage 2's loss of the {mode} forward from zero state (the exact functions give "
                                f"{exact_loss:.4f} here: such a device fails `losses`, by design)"),
        })
    strict = np.where(np.isin(np.abs(x), np.float32(JUMPS[0])), approx.sigmoid(np.nextafter(x, np.float32(0)).astype(
        np.float64), "plan"), approx.sigmoid(x.astype(np.float64), "plan"))
    misreadings["plan_sigmoid"] = [("a segment applies only past its start (|x| > start, not >=)", strict)]
    tol["approx_fn"] = (1e-6, 1e-6, "a line evaluated in float32 (a few ulps of values up to 1)")
    return Stage("approx", "approximate activations (PLAN, ONNX's HardSigmoid): the functions at every segment's "
                           "start, a free-running forward and loss with them", inputs, outputs,
                 settings={"modes": (",".join(approx.MODES), "each mode's outputs are prefixed with its name")},
                 misreadings=misreadings, tol=tol,
                 optional="for a device whose sigmoid and tanh are approximate; it runs this stage in place of "
                          "forward and losses")
