"""Where a run's work goes, as a record: the executor of SOMA's experts (or a study's runs), the
workers that carry the summed ablation's experts or one model's population, and the device of the
forwards. zosoma.workers.placing turns it into executors and workers.

A training run records its placement in its folder (RunFolder.write_placement), so a plain
`--resume` continues where the run was running; an option given with the resume replaces the
recorded one (and is recorded in turn).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zosoma.errors import ConfigError

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

    def __post_init__(self):
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
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
