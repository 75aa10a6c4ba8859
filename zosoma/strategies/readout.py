"""The readout by its local rule: the output layer's exact gradient, zero-order for the rest.

The output layer's gradient needs no backward pass. With h_t the last LSTM layer's output at
(b, t), p_bt = softmax(W^T h_t + b) and y_bt the target's one-hot, the mean loss over the batch's
B T predicted bytes has

    dL/dW = (1/BT) sum_{b,t} h_t (p_bt - y_bt)^T        (H, V)
    dL/db = (1/BT) sum_{b,t} (p_bt - y_bt)               (V,)

both read off one forward at theta (a delta rule, as an echo-state network's readout is trained:
Jaeger 2001; the same outer products a forward-gradient device accumulates, Ren et al. 2023).
The embedding and the LSTM (everything before out.w in the layout) are trained by one-sided
SPSA (zosoma.strategies.onesided) over that prefix only: member j is theta + eps delta_j on
[0, n0) and theta on the readout, so the directions measure n0 parameters, not d (at E=16 H=20,
7,056 of 12,432). The readout then steps by readout_lr times the schedule's factor (the same
warm-up, decay and restarts as the zero-order rate) along its exact gradient.

A step costs one-sided SPSA's 2P forwards plus readout_flops: one forward at theta and the
gradient's outer products. A device needs what a forward has (h_t, the softmax) and an (H, V)
accumulator for the outer products; no activations are stored across time.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB, ModelConfig, TrainConfig
from zosoma.errors import ConfigError
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.model.reference import lstm_cell, zero_state
from zosoma.strategies.onesided import OneSided


def readout_gradient(theta: np.ndarray, layout: Layout, batch: np.ndarray):
    """(dL/d out.w (H, V), dL/d out.b (V,), L) float64 of the mean nats/byte L of a (B, T+1)
    byte batch at theta (d,), from one forward (the reference LSTM, in float64)."""
    p = layout.views(np.asarray(theta, np.float64))
    tokens, targets = batch[:, :-1], batch[:, 1:].astype(np.intp)
    B, T = tokens.shape
    x = p["embed"][tokens]  # (B, T, E)
    for layer, (h, c) in enumerate(zero_state(layout, B, np.float64)):
        w_ih, w_hh, bias = (p[f"lstm{layer}.{n}"] for n in ("w_ih", "w_hh", "bias"))
        hs = np.empty((B, T, h.shape[1]))
        for t in range(T):
            h, c = lstm_cell(x[:, t] @ w_ih + h @ w_hh + bias, c)
            hs[:, t] = h
        x = hs
    h = x.reshape(B * T, -1)  # (BT, H)
    logits = h @ p["out.w"] + p["out.b"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)  # (BT, V)
    rows, y = np.arange(B * T), targets.reshape(-1)
    loss = float(-np.log(probs[rows, y]).mean())
    probs[rows, y] -= 1.0  # p - onehot
    probs /= B * T
    return h.T @ probs, probs.sum(axis=0), loss


def readout_flops(model: ModelConfig, cfg: TrainConfig) -> float:
    """Extra FLOPs of a step: a forward at theta over the B T bytes, then per byte the softmax
    minus one-hot (4 V: exp, sum, divide, subtract), the outer product's multiply-adds (2 H V) and
    the bias's sum (V)."""
    per_byte = model.flops_per_token() + 2 * model.hidden * VOCAB + 5 * VOCAB
    return float(cfg.batch * cfg.seq_len * per_byte)


class Readout(OneSided):
    """One-sided SPSA on the embedding and LSTM; the output layer by its exact local gradient."""

    name = "readout"
    options = frozenset({"noise", "weight_decay", "shaping", "clip_at", "normalize_window", "readout_lr"})
    extra_flops = staticmethod(readout_flops)
    unshardable = "computes the readout's gradient where it updates"
    # readout_lr 10: the validation winner of 10, 30 and 100 on one E=16 H=20 expert at
    # cut-price-2's budget (docs/cut-price.md; 3 at the grid's edge is measured by cut-price-2-edges)
    defaults = {**OneSided.defaults, "readout_lr": 10.0}

    _grad = None  # (pop, (d - n0,) float64): the step's readout gradient, kept from losses for update

    def check(self, layout: Layout) -> None:
        if layout is None:
            raise ConfigError("--optimizer readout trains an LSTM's output layer by its own gradient: it needs "
                              "a model (zosoma train), not a flat vector")

    @property
    def host_members(self) -> bool:
        return True

    def builder(self, theta, layout, pop, state, timings=None):
        """Rows 2j, 2j+1: theta + eps delta_{2k}, theta + eps delta_{2k+1} on [0, n0), theta after."""
        from zosoma.model.noise import add_noise  # Numba: imported where used

        n0 = layout["out.w"].offset
        body = np.ascontiguousarray(theta[:n0], np.float32)

        def build(chunk, out):  # the numbers the engines' one-sided members have on [0, n0)
            for j, k in enumerate(chunk):
                for s in (0, 1):
                    add_noise(out[2 * j + s, :n0], body, pop.scale, pop.seed, pop.expert, pop.step, 2 * k + s, pop.kind)
                    out[2 * j + s, n0:] = theta[n0:]
            return out
        return build

    def losses(self, ops, theta, layout, batch, pop, state, pairs=None, timings=None):
        w, b, _ = readout_gradient(ops.to_numpy(theta), layout, np.asarray(batch))
        self._grad = (pop, np.concatenate([w.ravel(), b]))
        return super().losses(ops, theta, layout, batch, pop, state, pairs, timings)

    def update(self, ops, layout: Layout, theta, state: dict, coeffs, pop: Population, lr: float):
        if self._grad is None or self._grad[0] != pop:
            raise ConfigError("--optimizer readout updates only the step whose losses it computed")
        n0 = layout["out.w"].offset
        head = ops.to_numpy(ops.noise_sum(coeffs, n0, pop))  # the one-sided estimate on [0, n0)
        direction = np.concatenate([head, np.zeros(theta.size - n0, np.float32)])
        new = ops.to_numpy(self.descend(ops, theta, ops.asarray(direction), lr)).copy()
        rate = self.cfg.readout_lr * lr / self.cfg.lr  # the schedule's and the restarts' factor
        new[n0:] -= (rate * self._grad[1]).astype(np.float32)
        return ops.asarray(new), state
