"""Where a run's work goes, made real: a Placement (zosoma.runs.placement) turned into the executor of
SOMA's experts (or a study's runs), the workers that carry the summed ablation's experts and the
sharding of one model's population.
"""

from __future__ import annotations

import os

from zosoma.errors import ConfigError
from zosoma.runs.placement import Placement
from zosoma.workers.executor import Inline, LocalProcesses, Together
from zosoma.workers.population_workers import InProcess, Processes, Sharding
from zosoma.workers.ray_executor import RayExecutor, RayWorkers


def executor(placement: Placement, units: int, workers: int | None = None):
    """The executor of `units` independent units: inline; `workers` local processes (default
    placement.workers, else the machine's cores; inline for one); Ray tasks; or SOMA's experts
    together in this process (the default on a device: its launches, not its FLOPs, set the pace)."""
    if placement.executor == "ray":
        return RayExecutor(placement.address, placement.cpus_per_unit, placement.gpus_per_unit)
    if placement.executor == "together" or (placement.executor is None and on_device(placement)):
        return Together()
    n = max(1, min(units, workers or placement.workers or os.cpu_count() or 1))
    return Inline() if placement.executor == "inline" or n == 1 else LocalProcesses(n)


def on_device(placement: Placement) -> bool:
    """Whether the placement's forwards run on an accelerator."""
    from zosoma.engines import get_ops
    return placement.device != "cpu" and get_ops(placement.device).on_device


def study_executor(placement: Placement, units: int, jobs: int | None = None):
    """The executor of a study's `units` runs: `jobs` of them at once, by default as many as the
    machine has cores, or one at a time on a GPU (the runs would share its memory)."""
    from zosoma.engines import get_ops
    on_device = get_ops(placement.device).on_device
    return executor(placement, units, jobs or (1 if on_device else os.cpu_count()))


def place(placement: Placement, experts: int, loss: str = "independent"):
    """Where a training run's work goes: (the executor of independent experts, the workers of
    the summed ablation's experts, the sharding of one model's population), each None when
    unused."""
    population = placement.population_workers
    if population is not None and experts > 1:
        raise ConfigError("--population-workers spreads one model's population; SOMA's experts already run "
                          "apart (--executor), and the summed ablation puts each expert on a worker of its own")
    independent = experts > 1 and loss == "independent"
    summed = experts > 1 and loss == "summed" and placement.executor in ("local", "ray")  # default: in this process
    if not (independent or summed or population):
        if placement.executor == "ray":
            raise ConfigError("--executor ray spreads SOMA's experts or one model's population "
                              "(--population-workers W); a single model alone trains in this process")
        return None, None, None
    units = executor(placement, experts) if independent or placement.executor == "ray" else None
    if placement.executor == "ray":  # (connected above: a bad address fails first)
        transport = RayWorkers(units)
    else:
        n = population or experts
        transport = InProcess() if placement.executor == "inline" else Processes(max(1, (os.cpu_count() or 1) // n))
    return (units if independent else None, transport if summed else None,
            Sharding(transport, population) if population else None)
