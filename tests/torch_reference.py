"""PyTorch as the independent referee: zosoma's parameters loaded into torch's own modules."""

import numpy as np
import torch

from zosoma.config import VOCAB
from zosoma.formats.torch_state import torch_state_arrays


class TorchByteLSTM(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, config.embed)
        self.lstm = torch.nn.LSTM(config.embed, config.hidden, config.layers, batch_first=True)
        self.linear = torch.nn.Linear(config.hidden, VOCAB)

    def forward(self, tokens, state=None):
        out, state = self.lstm(self.embedding(tokens), state)
        return self.linear(out), state


def torch_model(theta: np.ndarray, layout, dtype=torch.float64) -> TorchByteLSTM:
    model = TorchByteLSTM(layout.config).to(dtype)  # before loading, so float64 weights stay exact
    state = {k: torch.from_numpy(np.array(v, np.float64)) for k, v in torch_state_arrays(theta, layout).items()}
    model.load_state_dict(state, strict=True)
    return model
