"""The porting kit's device-side stages: the fp32 forward, the loss and the perturbation noise.

References are float64 (zosoma.model.reference run in float64 on the float32 weights), so each
tolerance measures only what a float32 port may differ by.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB, ModelConfig
from zosoma.model import reference
from zosoma.model.noise import noise, philox4x32_10, stream_key
from zosoma.model.params import Layout, init_params
from zosoma.porting.stage import Out, Stage


def kit_model(config: ModelConfig, seed: int) -> tuple[np.ndarray, Layout]:
    """The kit's weights: the seeded initialisation (expert 0) times 2, so gates reach their
    nonlinear range and predictions are far from uniform (an error then shows)."""
    layout = Layout(config)
    return (init_params(config, seed) * 2).astype(np.float32), layout


def _forward64(p: dict, layout: Layout, tokens, h0, c0) -> dict:
    """Every intermediate of the float64 forward from the views p of one theta."""
    H, L = layout.config.hidden, layout.config.layers
    B, T = tokens.shape
    x = p["embed"][tokens]
    out = {"embedded": x}
    hT, cT = [], []
    for layer in range(L):
        h, c = h0[layer].astype(np.float64), c0[layer].astype(np.float64)
        gates, acts = np.empty((B, T, 4 * H)), np.empty((B, T, 4 * H))
        cells, hidden = np.empty((B, T, H)), np.empty((B, T, H))
        for t in range(T):
            z = x[:, t] @ p[f"lstm{layer}.w_ih"] + h @ p[f"lstm{layer}.w_hh"] + p[f"lstm{layer}.bias"]
            a = np.concatenate([reference.sigmoid(z[:, :2 * H]), np.tanh(z[:, 2 * H:3 * H]),
                                reference.sigmoid(z[:, 3 * H:])], axis=1)
            c = a[:, H:2 * H] * c + a[:, :H] * a[:, 2 * H:3 * H]
            h = a[:, 3 * H:] * np.tanh(c)
            gates[:, t], acts[:, t], cells[:, t], hidden[:, t] = z, a, c, h
        out.update({f"gates{layer}": gates, f"activations{layer}": acts, f"cells{layer}": cells,
                    f"hidden{layer}": hidden})
        hT.append(h)
        cT.append(c)
        x = hidden
    out.update(logits=x @ p["out.w"] + p["out.b"], hT=np.stack(hT), cT=np.stack(cT))
    return out


def _torch_views(theta64, layout: Layout) -> dict:
    """A misreading: the flat matrices read in torch's (out, in) layout and transposed."""
    p = dict(layout.views(theta64))
    for e in layout.entries:
        if len(e.shape) == 2 and e.name != "embed":
            p[e.name] = p[e.name].reshape(e.shape[1], e.shape[0]).T
    return p


def forward_stage(theta, layout: Layout, rng) -> Stage:
    """Every intermediate value of the forward, float64, with a carried-in state."""
    cfg = layout.config
    B, T, H, L = 3, 12, cfg.hidden, cfg.layers
    tokens = rng.integers(0, VOCAB, (B, T), dtype=np.uint8)
    h0 = (0.5 * rng.standard_normal((L, B, H))).astype(np.float32)
    c0 = rng.standard_normal((L, B, H)).astype(np.float32)
    theta64 = theta.astype(np.float64)
    out = _forward64(layout.views(theta64), layout, tokens, h0, c0)
    state = [(h0[layer].astype(np.float64), c0[layer].astype(np.float64)) for layer in range(L)]
    check, _ = reference.forward(theta64, layout, tokens, state)
    assert np.allclose(check, out["logits"], rtol=1e-12, atol=1e-12)  # one forward, two readings
    torch_like = _forward64(_torch_views(theta64, layout), layout, tokens, h0, c0)
    src = ("theta", "tokens", "h0", "c0")
    orientation = "matrices are x @ W: w_ih is (E_in, 4H) row-major, w_hh (H, 4H), out.w (H, V); "
    outputs = {"embedded": Out(out["embedded"], "embedded", ("theta", "tokens"), "(B, T, E): embed[byte], batch first")}
    for layer in range(L):
        outputs[f"gates{layer}"] = Out(out[f"gates{layer}"], "gates", src,
                                       orientation + "(B, T, 4H) batch first, column blocks i, f, g, o")
        outputs[f"activations{layer}"] = Out(out[f"activations{layer}"], "activations", src,
                                             "(B, T, 4H): sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) in that order")
        outputs[f"cells{layer}"] = Out(out[f"cells{layer}"], "cells", src, "c = f c + i g, carried from c0")
        outputs[f"hidden{layer}"] = Out(out[f"hidden{layer}"], "hidden", src, "h = o tanh(c), carried from h0")
    outputs["logits"] = Out(out["logits"], "logits", src, "(B, T, V) = h of the last layer @ out.w + out.b")
    outputs["hT"] = Out(out["hT"], "state", src, "(L, B, H) h after the last step, per layer")
    outputs["cT"] = Out(out["cT"], "state", src, "(L, B, H) c after the last step, per layer")
    misreadings = {"gates0": [("matrices read in torch's (out, in) layout", torch_like["gates0"])],
                   "logits": [("matrices read in torch's (out, in) layout", torch_like["logits"])]}
    inputs = {"theta": (theta, "(d,) float32"), "tokens": (tokens, "(B, T) uint8 input bytes"),
              "h0": (h0, "(L, B, H) float32 carried-in h"), "c0": (c0, "(L, B, H) float32 carried-in c")}
    return Stage("forward", "embedding, gates, activations, cell, hidden and logits of every step and layer, "
                            "state carried in (h0, c0) and out (hT, cT)", inputs, outputs, misreadings=misreadings)


def loss_stage(theta, layout: Layout, rng) -> Stage:
    batch = rng.integers(0, VOCAB, (4, 25), dtype=np.uint8)
    logits, _ = reference.forward(theta.astype(np.float64), layout, batch[:, :-1])
    nll = reference.nll(logits, batch[:, 1:])
    inputs = {"theta": (theta, "(d,) float32"), "batch": (batch, "(B, T+1) uint8: inputs [:, :-1], targets [:, 1:]")}
    outputs = {"nll": Out(nll, "nll", ("theta", "batch"), "(B, T) logsumexp(logits) - logits[target], zero state"),
               "loss": Out(np.float64(nll.mean()), "loss", ("theta", "batch"), "the mean over B T bytes")}
    return Stage("losses", "per-byte nats (log-softmax NLL) and the mean loss of a batch, from zero state",
                 inputs, outputs)


NOISE_COUNTERS = [(0, 0, 0, 0), (1234, 2, 7, 3), (2**33 + 5, 1, 100, 31), (2**63 + 17, 7, 123456, 1023)]
NOISE_LENGTH = 300  # more than two Rademacher blocks of 128, and not a multiple of either block


def noise_stage() -> Stage:
    """C counters, each of seed (uint64), expert, step, member; outputs philox (C, 4) uint32
    (block 0 of each counter), rademacher and gaussian (C, NOISE_LENGTH)."""
    seed, expert, step, member = (np.array(c, dtype) for c, dtype in
                                  zip(zip(*NOISE_COUNTERS), (np.uint64, np.uint32, np.uint32, np.uint32)))
    words = np.array([philox4x32_10(0, m, s, e, *stream_key(int(sd))) for sd, e, s, m in NOISE_COUNTERS], np.uint32)
    rad = np.stack([noise(NOISE_LENGTH, *c, kind="rademacher") for c in NOISE_COUNTERS])
    gauss = np.stack([_gaussian64(NOISE_LENGTH, *c) for c in NOISE_COUNTERS])
    counters = ("seed", "expert", "step", "member")
    layout_hint = ("counter = (block, member, step, expert), key = (seed mod 2^32, seed >> 32); block 0's four "
                   "words x0..x3")
    swapped = {
        "counter (block, step, member, expert)": lambda sd, e, s, m: philox4x32_10(0, s, m, e, *stream_key(sd)),
        "counter (block, expert, step, member)": lambda sd, e, s, m: philox4x32_10(0, e, s, m, *stream_key(sd)),
        "counter (member, step, expert, block)": lambda sd, e, s, m: philox4x32_10(m, s, e, 0, *stream_key(sd)),
        "key words swapped (seed >> 32, seed mod 2^32)":
            lambda sd, e, s, m: philox4x32_10(0, m, s, e, *stream_key(sd)[::-1]),
    }
    misreadings = {"philox": [(what, np.array([fn(sd, e, s, m) for sd, e, s, m in NOISE_COUNTERS], np.uint32))
                              for what, fn in swapped.items()]}
    inputs = {"seed": (seed, "(C,) uint64"), "expert": (expert, "(C,) uint32 the stream word"),
              "step": (step, "(C,) uint32"), "member": (member, "(C,) uint32"),
              "length": (np.int64(NOISE_LENGTH), "values per counter")}
    outputs = {
        "philox": Out(words, "bits", counters, layout_hint),
        "rademacher": Out(rad.astype(np.int8), "bits", counters + ("length",),
                          "128 values per block: delta_i = 1 - 2 ((x[j >> 5] >> (j & 31)) & 1), j = i & 127"),
        "gaussian": Out(gauss, "gaussian", counters + ("length",),
                        "4 values per block: Box-Muller on (x0, x1) and (x2, x3), u = (x + 0.5) 2^-32, "
                        "r cos for even i, r sin for odd"),
    }
    return Stage("noise", "Philox4x32-10 words and the Rademacher and Gaussian perturbations of given counters",
                 inputs, outputs, misreadings=misreadings)


def _gaussian64(n, seed, expert, step, member) -> np.ndarray:
    """The Gaussian perturbation in float64, unrounded (zosoma.model.noise's Box-Muller)."""
    k0, k1 = stream_key(seed)
    out = np.empty(n)
    for b in range((n + 3) // 4):
        x = philox4x32_10(b, member, step, expert, k0, k1)
        for p in range(2):
            u1, u2 = (int(x[2 * p]) + 0.5) * 2.0 ** -32, (int(x[2 * p + 1]) + 0.5) * 2.0 ** -32
            r = np.sqrt(-2.0 * np.log(u1))
            for j, v in ((4 * b + 2 * p, r * np.cos(2 * np.pi * u2)), (4 * b + 2 * p + 1, r * np.sin(2 * np.pi * u2))):
                if j < n:
                    out[j] = v
    return out
