"""File formats: checkpoints, clusterings, HDF5 helpers, and exports for other frameworks.

Owns the checkpoint file (checkpoint), the clustering file (clustering: a SOMA run's router.h5),
shared HDF5 helpers (h5util), the ONNX graphs (onnx) and PyTorch's state_dict layout
(torch_state). May import the foundation and zosoma.model.
"""
