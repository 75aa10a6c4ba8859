"""Experiments and benchmarks: the paper's comparison and ablation, the variance study, speed.

Owns the equal-compute comparison and its report (compare, report, configs/*.toml), the
independent-vs-shared variance experiment (variance) and the benchmarks that print figures
(bench_*). May import every other part of zosoma.
"""
