"""The model: what a byte-level LSTM is, its perturbations, and the plain references.

Owns the flat parameter layout (params), the NumPy forward that is the ground truth (reference),
the counter-based perturbation noise (noise), the fast CPU forwards checked against the reference
(forward: dense members; lowrank: EGGROLL's shared-GEMM population and update) and single-model
evaluation in nats/byte (evaluate). Imports only zosoma's foundation (config, errors, corpus);
nothing here knows about engines, strategies or run folders.
"""
