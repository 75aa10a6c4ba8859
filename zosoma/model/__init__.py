"""The model, as a specification: what a byte-level LSTM is, its perturbations, and the references.

Owns the flat parameter layout (params), the plain NumPy forward that is the ground truth
(reference), the counter-based perturbation noise with its reference generator and EGGROLL's
low-rank factors (noise), a step's population named by its counters (population), the forward's
number formats and their rounding rules (number_formats), single-model evaluation in
nats/byte (evaluate) and the evaluation protocol every table uses (protocol). Where the forwards run fast is zosoma.engines; nothing here knows about
engines, strategies or run folders. Imports only zosoma's foundation (config, errors, corpus,
arrays).
"""
