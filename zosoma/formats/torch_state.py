"""Parameters in PyTorch's layout: nn.Embedding + nn.LSTM(batch_first=True) + nn.Linear.

torch stores weights as (out, in), the transpose of zosoma's "x @ W" layout, and keeps two LSTM
biases (b_ih, b_hh) where zosoma keeps their sum: b_ih carries the bias and b_hh is zero.
"""

from __future__ import annotations

import io

import numpy as np

from zosoma.atomic import atomic_write
from zosoma.errors import ZosomaError
from zosoma.model.params import Layout


def torch_state_arrays(theta: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """state_dict entries (as NumPy arrays) for modules named `embedding`, `lstm`, `linear`."""
    p = layout.views(theta)
    state = {"embedding.weight": p["embed"]}
    for layer in range(layout.config.layers):
        state[f"lstm.weight_ih_l{layer}"] = p[f"lstm{layer}.w_ih"].T
        state[f"lstm.weight_hh_l{layer}"] = p[f"lstm{layer}.w_hh"].T
        state[f"lstm.bias_ih_l{layer}"] = p[f"lstm{layer}.bias"]
        state[f"lstm.bias_hh_l{layer}"] = np.zeros_like(p[f"lstm{layer}.bias"])
    state["linear.weight"] = p["out.w"].T
    state["linear.bias"] = p["out.b"]
    return {k: np.ascontiguousarray(v) for k, v in state.items()}


def export_torch(theta: np.ndarray, layout: Layout, path) -> None:
    """Write a torch state_dict (torch.save) loadable into nn.Embedding(256, E),
    nn.LSTM(E, H, L, batch_first=True) and nn.Linear(H, 256) registered as embedding, lstm, linear."""
    try:
        import torch
    except ImportError:
        raise ZosomaError("exporting to torch needs PyTorch: pip install torch") from None
    state = {k: torch.from_numpy(v.copy()) for k, v in torch_state_arrays(theta, layout).items()}
    buffer = io.BytesIO()  # torch.save's own file errors are RuntimeErrors: zosoma.atomic writes the bytes
    torch.save(state, buffer)
    atomic_write(path, buffer.getbuffer(), "export")  # an existing file is replaced whole or not at all


def theta_from_torch_state(state: dict[str, np.ndarray], layout: Layout, dtype=np.float32) -> np.ndarray:
    """The inverse of torch_state_arrays: theta (d,) from state_dict entries (NumPy arrays) of
    modules named `embedding`, `lstm`, `linear`; torch's two LSTM biases become their sum."""
    theta = np.empty(layout.size, dtype)
    p = layout.views(theta)
    p["embed"][...] = state["embedding.weight"]
    for layer in range(layout.config.layers):
        p[f"lstm{layer}.w_ih"][...] = state[f"lstm.weight_ih_l{layer}"].T
        p[f"lstm{layer}.w_hh"][...] = state[f"lstm.weight_hh_l{layer}"].T
        p[f"lstm{layer}.bias"][...] = state[f"lstm.bias_ih_l{layer}"] + state[f"lstm.bias_hh_l{layer}"]
    p["out.w"][...] = state["linear.weight"].T
    p["out.b"][...] = state["linear.bias"]
    return theta
