"""zosoma: zero-order (forward-only) pretraining of byte-level LSTM language models.

The Python API (zosoma.api) is here too: zosoma.train, zosoma.open_run, zosoma.load_corpus,
zosoma.Optimizer and zosoma.Run, loaded when first used (the command line imports this module
for its version alone).
"""

__version__ = "0.1.0"

_API = ("Optimizer", "Run", "load_corpus", "open_run", "train")


def __getattr__(name):
    if name in _API:
        from zosoma import api
        return getattr(api, name)
    raise AttributeError(f"module 'zosoma' has no attribute {name!r}")
