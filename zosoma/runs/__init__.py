"""Where a run lives: run folders, the training loop, executors and progress records.

Owns every file name inside a run folder (folder), the one atomic writer, the training loop over
a strategy and an engine (trainer), single-model and SOMA runs (single, soma), the executors that
run idempotent units of work (executor; on Ray: ray_executor), one model's population over
workers that exchange only scalars (population_workers) and the typed records training yields
(records), and the one handle that starts and opens a run of either kind and applies every rule
about what a run may be (run; the records of what a run is: shape). May import everything below it: the foundation, model, formats, engines, strategies
and mixture.
"""
