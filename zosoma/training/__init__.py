"""A run's folder, its training loop and its records.

Owns every file name inside a run folder (folder), with the folder's one owner (folder_lock), its
append-only logs (logs), what reading it warns of (notices) and the JSON records beside a run
(json_records, json_shape: what one read back must hold); what a model takes steps with: its
strategy, engine, layout, batches and stream (stepper), the training loop over it (trainer) with
its divergence guard (guard), the typed records training yields (records), the event file beside
metrics.jsonl (events) and the records of what a run is (shape). May import the foundation, model,
formats, engines and strategies; the workers (zosoma.workers) and the single-model and SOMA runs
(zosoma.runs, with the run handle: run) stand on it.
"""
