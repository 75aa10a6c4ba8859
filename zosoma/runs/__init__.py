"""A run's folder, its training loop and its records.

Owns every file name inside a run folder (folder), what a model takes steps with: its strategy,
engine, layout, batches and stream (stepper), the training loop over it (trainer) with its
divergence guard (guard), the typed records training yields (records),
the event file beside metrics.jsonl (events), where a run's work goes, as a record
(placement), the records of what a run is (shape), and what a JSON record read back must
hold (json_shape). May import the foundation, model,
formats, engines and strategies; the workers (zosoma.workers) and the single-model and SOMA
runs (zosoma.training, with the run handle: run) stand on it.
"""
