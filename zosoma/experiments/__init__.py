"""Experiments: the paper's comparison and ablation, the variance study.

Owns the one runner of studies (study: jobs, their run folders, resume, a folder bound to its
settings), the equal-compute comparison and its report (compare, report, configs/*.toml) and the
precision study (precision) that supply it their jobs and scoring, the independent-vs-shared
variance experiment (variance). May import every other part of zosoma but the API and the
benchmarks (zosoma.benchmarks, beside it).
"""
