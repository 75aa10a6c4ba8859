"""Training runs: a single model (single) or SOMA's experts over clusters of the corpus (soma).

Each starts, resumes and evaluates a run in its folder (zosoma.runs.folder), trains with the loop
of zosoma.runs.trainer and places its work on zosoma.workers. May import everything below it: the
foundation, model, formats, engines, strategies, mixture, yardsticks, runs and workers.
"""
