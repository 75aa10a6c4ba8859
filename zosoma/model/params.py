"""The flat parameter vector and its named views.

Every model is one contiguous float32 vector theta (d values): SPSA perturbs and updates it as a
whole, and the kernels read named views of it. Matrices are stored in the "x @ W" orientation the
kernels consume (torch stores the transpose; see zosoma.formats.torch_state):

    embed           (V, E)       byte -> embedding row
    lstm{l}.w_ih    (E_in, 4H)   gates = x @ w_ih + h @ w_hh + bias, column blocks i, f, g, o
    lstm{l}.w_hh    (H, 4H)
    lstm{l}.bias    (4H,)        one bias (torch's b_ih + b_hh)
    out.w           (H, V)       logits = h @ out.w + out.b
    out.b           (V,)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zosoma.config import VOCAB, ModelConfig


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class Layout:
    """Names, shapes and offsets of the tensors inside theta for one ModelConfig."""

    def __init__(self, config: ModelConfig):
        self.config = config
        E, H, V = config.embed, config.hidden, VOCAB
        shapes = [("embed", (V, E))]
        for layer in range(config.layers):
            e_in = E if layer == 0 else H
            shapes += [(f"lstm{layer}.w_ih", (e_in, 4 * H)),
                       (f"lstm{layer}.w_hh", (H, 4 * H)),
                       (f"lstm{layer}.bias", (4 * H,))]
        shapes += [("out.w", (H, V)), ("out.b", (V,))]
        entries, offset = [], 0
        for name, shape in shapes:
            entries.append(Entry(name, shape, offset))
            offset += math.prod(shape)
        self.entries = tuple(entries)
        self.size = offset  # d
        self._by_name = {e.name: e for e in entries}

    def __getitem__(self, name: str) -> Entry:
        return self._by_name[name]

    def view(self, theta: np.ndarray, name: str) -> np.ndarray:
        """A reshaped view (no copy) of one tensor inside theta (d,) or (M, d)."""
        e = self._by_name[name]
        return theta[..., e.offset:e.offset + e.size].reshape(theta.shape[:-1] + e.shape)

    def views(self, theta: np.ndarray) -> dict[str, np.ndarray]:
        return {e.name: self.view(theta, e.name) for e in self.entries}


def init_params(config: ModelConfig, seed: int, expert: int = 0) -> np.ndarray:
    """Seeded float32 initialisation following torch's defaults: embedding N(0, 1); LSTM weights and
    biases U(-1/sqrt(H), 1/sqrt(H)); output layer U(-1/sqrt(H), 1/sqrt(H)) with a zero bias, so the
    untrained model predicts close to uniform (ln 256 = 5.55 nats/byte)."""
    layout = Layout(config)
    rng = np.random.default_rng([seed, expert, 0x1D1])  # stream 0x1D1: initialisation
    theta = np.empty(layout.size, np.float32)
    bound = 1.0 / math.sqrt(config.hidden)
    for e in layout.entries:
        if e.name == "embed":
            values = rng.standard_normal(e.size)
        elif e.name == "out.b":
            values = np.zeros(e.size)
        else:
            values = rng.uniform(-bound, bound, e.size)
        theta[e.offset:e.offset + e.size] = values
    return theta
