"""The CUDA engine (CudaOps, cuda_ops): CuPy and raw kernels (kernels/*.cu) on an NVIDIA GPU.

backend is the only module in zosoma that imports CuPy; it tells "CuPy does not import" apart
from "CUDA finds no device".
"""
