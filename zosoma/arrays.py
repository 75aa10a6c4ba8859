"""Which array module an array belongs to, without importing CuPy.

Code that runs on NumPy or CuPy arrays alike (EGGROLL's factor slicing in zosoma.model.noise and
its update in zosoma.engines.cpu.lowrank, an ensemble's weights) derives its module from its
inputs, as CuPy's get_array_module does. Neither function imports CuPy: if it was never imported,
no argument can be a CuPy array.
"""

from __future__ import annotations

import sys

import numpy as np


def get_array_module(*arrays):
    """numpy, or cupy when any argument is a CuPy array."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return np
    return cupy.get_array_module(*arrays)


def to_numpy(x) -> np.ndarray:
    """A NumPy array of x: a CuPy array is copied from the device, anything else is np.asarray'd."""
    if get_array_module(x) is not np:
        return x.get()
    return np.asarray(x)
