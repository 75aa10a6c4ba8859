"""zosoma: zero-order (forward-only) pretraining of byte-level LSTM language models.

The Python API (zosoma.api) is here too: zosoma.train, zosoma.open_run, zosoma.load_corpus,
zosoma.Optimizer and zosoma.RunHandle (what train and open_run return), loaded when first used;
the version (zosoma.version) is re-exported. No module inside the package imports this one: it sits above them all.
"""

from zosoma.version import __version__  # re-exported: zosoma.__version__

_API = ("Optimizer", "RunHandle", "load_corpus", "open_run", "train")


def __getattr__(name):
    if name in _API:
        from zosoma import api
        return getattr(api, name)
    raise AttributeError(f"module 'zosoma' has no attribute {name!r}")
