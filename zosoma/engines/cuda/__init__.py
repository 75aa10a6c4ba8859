"""The CUDA engine (CudaOps, cuda_ops): CuPy and raw kernels (kernels/*.cu) on an NVIDIA GPU.

Split as thinc splits CupyOps: custom_kernels (the kernels' signatures, the runtime, every
launch), cuda_noise (noise and SPSA), cuda_forward (the population forward), cuda_ops (the Ops).

backend is the only module in zosoma that imports CuPy; it tells "CuPy does not import" apart
from "CUDA finds no device".
"""
