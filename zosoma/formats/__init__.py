"""File formats: checkpoints, HDF5 helpers, and exports for other frameworks.

Owns the checkpoint file (checkpoint), shared HDF5 helpers (h5util) and the exports (export).
May import the foundation and zosoma.model.
"""
