"""Benchmarks: speed figures printed by `zosoma bench`, never part of a run.

Owns the forward pass's timing and the fp32 peak (bench_forward), the SPSA step against its
PyTorch peers (bench_spsa, torch_peers) and its roofline (roofline), routed inference
(bench_route), EGGROLL's low-rank step (bench_eggroll), the population's exchange (bench_comm)
and the executors (bench_executors). May import every part below zosoma.experiments (the
foundation, model, formats, engines, strategies, mixture, yardsticks, training, workers, runs); nothing in the
library imports it.
"""
