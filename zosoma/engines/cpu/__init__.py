"""The CPU engine's compiled kernels (Numba around BLAS), which zosoma.engines.ops.Ops calls.

forward: the dense population forward, streaming evaluation and log-probabilities; lowrank:
EGGROLL's shared-GEMM population forward and its update; noise_kernels: SPSA's members and
update built straight from the counters; threads: member-parallel threads with one-thread BLAS.
Each is checked against zosoma.model's references (reference, noise).
"""
