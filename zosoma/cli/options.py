"""What several commands share, declared once: the numeric checks, --device, --previous, the
executor options, and asking the context which options were given."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import click

from zosoma.engines import DEVICES
from zosoma.workers.placement import EXECUTORS


def positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be at least 1, got {value}")
    return value


def nonneg(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter(f"must not be negative, got {value}")
    return value


class Checked(click.ParamType):
    """A number as typed (else the text itself), checked by the library (zosoma.runs.run.Spec,
    TrainConfig, Placement, zosoma.runs.run_options): the command line and the Python API
    refuse the same values in the same words."""

    def __init__(self, name: str = "integer"):
        self.name = name  # shown in --help: INTEGER or NUMBER

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):  # a default
            return value
        for kind in (int, float):
            try:
                return kind(value)
            except (TypeError, ValueError):
                pass
        return value


class Named(click.ParamType):
    """One of `names`, shown in --help and completed as click.Choice does, but passed through as
    typed: the library refuses any other name in its own words (as the Python API does)."""
    name = "name"

    def __init__(self, names):
        self.names = tuple(names)

    def get_metavar(self, param, ctx=None) -> str:
        return f"[{'|'.join(self.names)}]"

    def convert(self, value, param, ctx):
        return value

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem
        return [CompletionItem(n) for n in self.names if n.startswith(incomplete)]


def device_option(f):
    return click.option("--device", type=Named(DEVICES), default="cpu", show_default=True,
                        help="Where the forward passes run; auto uses a GPU when CuPy finds one.")(f)


def gemm_option(f):
    return click.option("--gemm", type=Named(["fp32", "tf32", "bf16"]), default="fp32", show_default=True,
                        help="--device cuda: the number format of the forwards' GEMMs; tf32 and bf16 run them on tensor cores (fp32 in memory, the operands rounded inside cuBLAS). fp32 stays the default: at the default eps TF32 moves SPSA's loss differences by 1.6-6.6% and bf16 by 11-82% (results/gemm-precision.txt). The fused kernel of small models has no GEMMs. Refused on the CPU.")(f)


def previous_option(f):
    return click.option("--previous", is_flag=True, help="If a run's newest checkpoint is damaged, use the newest intact one (said in a warning line) instead of stopping.")(f)


def executor_options(f):
    """--executor and the Ray options, shared by train and compare."""
    for option in reversed([
        click.option("--executor", "executor_kind", type=Named(EXECUTORS), help="Where units of work run: inline in this process, local worker processes (the default on the CPU), Ray tasks and actors on this machine or a cluster (needs the ray extra), or together: SOMA's experts stepped together in this process, each step of all of them in one population (the default on a GPU)."),

        click.option("--address", help="--executor ray: the cluster to join (HOST:PORT of its head, or auto for the one `ray start` made here; a head with token authentication needs its token here, in RAY_AUTH_TOKEN or ~/.ray/auth_token); default: start Ray on this machine."),
        click.option("--cpus-per-unit", type=Checked("number"), default=1.0, show_default=True, help="--executor ray: CPUs (and as many BLAS threads) per expert, run or population worker."),
        click.option("--gpus-per-unit", type=Checked("number"), default=0.0, show_default=True, help="--executor ray: GPUs per expert, run or population worker (1 with --device cuda)."),
    ]):
        f = option(f)
    return f


def given(ctx, name: str) -> bool:
    """Whether option `name` was given on the command line (not left at its default)."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def check_executor_options(ctx, kind: str | None, workers_option: str, workers) -> None:
    """The Ray options given here need --executor ray; a local process count does not go with it
    (zosoma.workers.placement.check_options)."""
    from zosoma.workers.placement import RAY_ONLY, check_options

    with usage_errors():
        check_options(kind, [name for name in RAY_ONLY if given(ctx, name)], workers, workers_option)


@contextlib.contextmanager
def usage_errors():
    """The library's verdict on the options themselves (ConfigError) as a usage error: exit code 2."""
    from zosoma.errors import ConfigError

    try:
        yield
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


def device_ops(device: str, gemm: str = "fp32"):
    """The engine for --device and --gemm (zosoma.engines.get_ops); says which one --device auto chose."""
    from zosoma.engines import device_note, get_ops
    ops = get_ops(device, gemm=gemm)
    note = device_note(device, ops)
    if note:
        click.echo(note, err=True)
    return ops


def warn_about_results(path) -> str | None:
    """A run folder's results.json that is stale (the run trained on after it was evaluated) or
    damaged, said in one warning line, which is returned; None when it is current or absent."""
    from pathlib import Path

    from zosoma.errors import ConfigError
    from zosoma.training.folder import RunFolder
    if not Path(path).is_dir():
        return None
    try:
        RunFolder(path).current_results()
    except ConfigError as e:
        click.echo(f"warning: {e}", err=True)
        return str(e)
    return None


def json_option(f):
    """--json: one JSON object on stdout instead of text (its schema: docs/json.md)."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON object instead of text (schema in docs/json.md).")(f)


def emit_json(kind: str, obj) -> None:
    """One JSON object, {"schema": "zosoma.KIND/1", ...}; non-finite numbers as null (strict JSON)."""
    def plain(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):  # a config: its fields
            x = dataclasses.asdict(x)
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # NumPy scalars
            x = x.item()
        if isinstance(x, float) and not math.isfinite(x):
            return None
        return x
    click.echo(json.dumps({"schema": f"zosoma.{kind}/1", **plain(obj)}, indent=2, sort_keys=True))
