"""Porting zosoma's training to other hardware: exports, conformance vectors, a standalone checker.

Owns the ONNX export of runs (export_run: a single model, one SOMA expert, or a whole SOMA run with its
router), the porting kit (kit: one .npz of reference vectors per stage, with a manifest of
tolerances, dependencies and hints; stage: what one stage holds; kit_model, kit_data,
kit_training, kit_loop, kit_router, kit_precision, kit_approx, kit_activity, kit_run, kit_default_run,
kit_activity_run: the device-side, host-side data, one-step, training-loop, routing, low-precision,
approximate-activation, activity-perturbation-step and whole-run stages; kit_files: the graphs, batch indices and README beside them; approx_activations: PLAN and
HardSigmoid activations, their forward and an engine that trains with them) and the
checker copied into every kit (check_port: plain NumPy, imports nothing of zosoma). PORTING.md at the repository root is the specification they serve. May import everything
below the experiments: the foundation, model, formats, engines, strategies, mixture, training, workers and runs.
"""
