"""Where a run's work goes: the record (Placement: the executor of SOMA's experts or a study's runs,
the workers that carry the summed ablation's experts or one model's population, and the device of
the forwards) and that record made real (executor, study_executor, place).

A training run records its placement in its folder (RunFolder.write_placement), so a plain
`--resume` continues where the run was running; an option given with the resume replaces the
recorded one (and is recorded in turn).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass

from zosoma.engines import check_device, check_gemm, resolved_device
from zosoma.errors import ConfigError, OptionError
from zosoma.workers.executor import Inline, LocalProcesses, Together
from zosoma.workers.population_workers import InProcess, Processes, Sharding
from zosoma.workers.ray_executor import RayExecutor, RayWorkers

EXECUTORS = ("inline", "local", "ray", "together")
RAY_ONLY = ("address", "cpus_per_unit", "gpus_per_unit")


@dataclass(frozen=True)
class Placement:
    executor: str | None = None  # EXECUTORS; None: local processes (inline for a single unit), together on a device
    workers: int | None = None  # local worker processes for independent units (None: the cores)
    population_workers: int | None = None  # W: one model's P pairs spread over W workers
    address: str | None = None  # ray: the cluster to join (None: start Ray on this machine)
    cpus_per_unit: float = 1.0  # ray: CPUs (and BLAS threads) per unit or worker
    gpus_per_unit: float = 0.0  # ray: GPUs per unit or worker
    device: str = "cpu"  # where the forwards run (zosoma.engines.get_ops)
    gemm: str = "fp32"  # the CUDA engine's GEMMs: fp32, or tensor cores (tf32, bf16)

    def __post_init__(self):
        if self.executor is not None and self.executor not in EXECUTORS:
            raise OptionError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        for name in ("workers", "population_workers"):
            _count(name, getattr(self, name))
        for name in ("cpus_per_unit", "gpus_per_unit"):  # kept as floats, as click's FLOAT gave them
            object.__setattr__(self, name, _amount(name, getattr(self, name), zero=name == "gpus_per_unit"))
        if self.address is not None and not isinstance(self.address, str):
            raise OptionError(f"address must be HOST:PORT or auto, got {self.address!r}")
        check_device(self.device)
        check_gemm(self.device, self.gemm)
        default = Placement.__dataclass_fields__
        check_options(self.executor, [n for n in RAY_ONLY if getattr(self, n) != default[n].default], self.workers)

    def replaced(self, given: dict) -> "Placement":
        """This placement with the options in `given` replaced; the Ray options fall away when
        the executor is no longer Ray (a Ray run resumed with --executor local), the local
        processes' count when it is together."""
        fields = {**dataclasses.asdict(self), **given}
        if fields["executor"] != "ray":
            for name in set(RAY_ONLY) - set(given):
                fields[name] = Placement.__dataclass_fields__[name].default
        if fields["executor"] == "together" and "workers" not in given:  # nor local processes
            fields["workers"] = None
        return Placement(**fields)

    def on(self, ops) -> "Placement":
        """This placement as its run trains on the engine `ops`: --device auto recorded as the
        device that engine runs on, so a resume goes back to it."""
        return dataclasses.replace(self, device=resolved_device(self.device, ops))

    def describe(self) -> str:
        """The command-line options that make this placement ('' for the defaults)."""
        default = Placement()
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in dataclasses.asdict(self).items()
                        if v != getattr(default, k))


def check_options(executor: str | None, ray_options, workers, workers_option: str = "--workers") -> None:
    """The Ray options set (`ray_options`, by field name) need the Ray executor; a count of local
    processes (`workers`, given as `workers_option`) goes with neither Ray nor together."""
    if executor == "together" and workers is not None:
        raise ConfigError(f"{workers_option} counts local processes; --executor together runs every unit in this process")
    if executor != "ray":
        if ray_options:
            raise ConfigError(f"--{ray_options[0].replace('_', '-')} is for --executor ray")
    elif workers is not None:
        raise ConfigError(f"{workers_option} counts local processes; on Ray, --cpus-per-unit and the cluster's "
                          "CPUs decide how many units run at once")


def executor(placement: Placement, units: int, workers: int | None = None, on_device: bool = False):
    """The executor of `units` independent units: inline; `workers` local processes (default
    placement.workers, else the machine's cores; inline for one); Ray tasks; or SOMA's experts
    together in this process (the default `on_device`, an accelerator: its launches, not its FLOPs,
    set the pace)."""
    if placement.executor == "ray":
        return RayExecutor(placement.address, placement.cpus_per_unit, placement.gpus_per_unit)
    if placement.executor == "together" or (placement.executor is None and on_device):
        return Together()
    n = max(1, min(units, workers or placement.workers or os.cpu_count() or 1))
    return Inline() if placement.executor == "inline" or n == 1 else LocalProcesses(n)


def study_executor(placement: Placement, units: int, jobs: int | None = None, on_device: bool = False):
    """The executor of a study's `units` runs: `jobs` of them at once, by default as many as the
    machine has cores, or one at a time when they run `on_device` (a GPU: the runs would share its
    memory)."""
    return executor(placement, units, jobs or (1 if on_device else os.cpu_count()))


def place(placement: Placement, experts: int, loss: str = "independent", on_device: bool = False):
    """Where a training run's work goes: (the executor of independent experts, the workers of
    the summed ablation's experts, the sharding of one model's population), each None when
    unused; `on_device`: the run's engine is an accelerator's (its experts go together)."""
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
    units = executor(placement, experts, on_device=on_device) if independent or placement.executor == "ray" else None
    if placement.executor == "ray":  # (connected above: a bad address fails first)
        transport = RayWorkers(units)
    else:
        n = population or experts
        transport = InProcess() if placement.executor == "inline" else Processes(max(1, (os.cpu_count() or 1) // n))
    return (units if independent else None, transport if summed else None,
            Sharding(transport, population) if population else None)


def _count(name: str, value) -> None:
    """None (not given) or a whole number of processes, at least 1; an OptionError names it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise OptionError(f"{name} must be at least 1, got {value}")


def _amount(name: str, value, zero: bool) -> float:
    """A finite number of CPUs or GPUs, above 0 (or 0 itself where `zero`); an OptionError names it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise OptionError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value}")
    return float(value)
