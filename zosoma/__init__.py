"""zosoma: zero-order (forward-only) pretraining of byte-level LSTM language models."""

__version__ = "0.1.0"
