"""Runs: the run handle (run: Run.start, Run.open, Spec) over a single model (single) or SOMA's
experts over clusters of the corpus (soma).

Each starts, resumes and evaluates a run in its folder (zosoma.training.folder), trains with the loop
of zosoma.training.trainer and places its work on zosoma.workers. May import everything below it: the
foundation, model, formats, engines, strategies, mixture, yardsticks, training and workers.
"""
