"""Where the work runs: executors of idempotent units and the workers of one model's population.

Where a run's work goes (placement: the record, and the executors and workers it makes), the
executors that run units of work inline, in local processes (executor) or as Ray tasks
(ray_executor, with its watchdog reaper), and one model's population spread over workers that
exchange only scalars (population_workers). May import the foundation, model, formats, engines,
strategies and training (a run's folder and loop).
"""
