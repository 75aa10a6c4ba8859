"""File formats: checkpoints, HDF5 helpers, and exports for other frameworks.

Owns the checkpoint file (checkpoint), shared HDF5 helpers (h5util), the ONNX graphs (onnx) and
PyTorch's state_dict layout (torch_state). May import the foundation and zosoma.model.
"""
