"""zosoma precision-study: what the forward's number format costs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from zosoma.cli.options import nonneg, positive
from zosoma.cli.stop import StopRequest
from zosoma.config import PRECISIONS


@click.command("precision-study")
@click.option("--out", type=click.Path(file_okay=False), default="results/precision-full", show_default=True, help="Output folder: runs/, results.md, results.csv, precision.png.")
@click.option("--steps", type=int, default=4000, show_default=True, callback=positive, help="Training steps of every run (the default run length is 4000).")
@click.option("--formats", default=",".join(PRECISIONS), show_default=True, help="Forward number formats, comma-separated.")
@click.option("--multiples", default="0.25,1,4,16", show_default=True, help="Single model: eps as multiples of the format's step, comma-separated (the default eps 1e-3 is always run too).")
@click.option("--soma-multiples", default="0.25,1,4,16", show_default=True, help="SOMA: the same, or 'none' for the default eps only.")
@click.option("--experts", type=int, default=4, show_default=True, callback=positive, help="SOMA's N.")
@click.option("--seed", type=int, default=0, show_default=True, callback=nonneg)
@click.option("--jobs", type=int, callback=positive, help="Runs trained at once, one process each (default: the machine's cores).")
@click.option("--plan", is_flag=True, help="Print the runs and exit.")
@click.option("--report", "report_only", is_flag=True, help="Write the report from the runs finished so far (naming the others) and exit; trains nothing.")
def precision_study(out, steps, formats, multiples, soma_multiples, experts, seed, jobs, plan, report_only):
    """What the forward's number format costs: held-out nats/byte of the default single model and
    of SOMA (tiny preset) trained with fp32, bf16, fp16 and int8 forwards, across eps measured in
    the format's step. Finished runs are never repeated; the same command resumes the others."""
    from zosoma.experiments.precision import Study, jobs as study_jobs, run_study, write_study_report

    def numbers(text, name):
        if text.strip().lower() == "none":
            return ()
        try:
            return tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise click.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=name) from None

    study = Study(steps=steps, formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
                  multiples=numbers(multiples, "--multiples"), experts=experts,
                  soma_multiples=numbers(soma_multiples, "--soma-multiples"), seed=seed)
    todo = study_jobs(study)
    click.echo(f"precision study: {len(todo)} runs of {steps} steps, output {out}")
    for j in todo:
        click.echo(f"  {j.name:<32} eps {j.eps:.3g} (step {j.step_size:.3g})")
    if plan:
        return
    if report_only:
        from zosoma.training.folder import RunFolder

        if not Path(out, "runs").is_dir():
            raise click.ClickException(f"no study in {out}: it has no runs/ folder")
        with RunFolder(out).lock():  # not while a study trains in this folder
            paths = write_study_report(study, Path(out))
        if not paths:
            raise click.ClickException(f"no run of this study has finished in {out}")
        for p in paths.values():
            click.echo(f"wrote {p}")
        return

    def report(job, result, error):
        if error:
            click.echo(f"failed   {job.name}: {error}", err=True)
        else:
            click.echo(f"finished {job.name}: held-out {result['heldout']['overall']:.4f} nats/byte in {job.fmt} "
                       f"({result['heldout_fp32_eval']:.4f} in fp32), {result['wall_s']:.0f} s training")

    from zosoma.workers.placement import Placement, study_executor

    stop = StopRequest(resume="the same command")
    paths = run_study(study, Path(out), study_executor(Placement(), len(todo), jobs), should_stop=stop,
                      on_result=report)
    if stop():
        click.echo("stopped; the same command resumes the unfinished runs", err=True)
        sys.exit(stop.exit_code)
    for p in paths.values():
        click.echo(f"wrote {p}")
