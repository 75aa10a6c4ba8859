"""zosoma compare: the equal-compute comparison a TOML file describes."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from zosoma.cli.options import check_executor_options, device_ops, device_option, executor_options, positive
from zosoma.cli.stop import StopRequest


@click.command()
@click.argument("config")
@click.option("--out", type=click.Path(file_okay=False), help="Output folder (default: results/<config name>).")
@click.option("--jobs", type=int, callback=positive, help="Runs trained at once, one process each (default: the machine's cores).")
@executor_options
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder); found automatically when downloaded.")
@click.option("--plan", is_flag=True, help="Print the runs, their steps and FLOPs, and exit.")
@device_option
@click.pass_context
def compare(ctx, config, out, jobs, executor_kind, address, cpus_per_unit, gpus_per_unit, wikitext, plan, device):
    """Equal-compute comparison: SOMA vs monolithic SPSA and EGGROLL (and the independent vs summed
    ablation) as CONFIG describes, over its seeds; writes results.md, results.csv and plots.

    CONFIG: a TOML file, or a shipped one by name (cpu). Finished runs are never repeated; after
    Ctrl-C or a crash, the same command resumes the others from their checkpoints. An --out that
    another configuration made (another lr, budget, evaluation setting, ...) is refused."""
    from zosoma.experiments.compare import Stopped, check_folder, jobs as all_jobs, run_comparison, tuning_jobs
    from zosoma.experiments.compare_config import find_config, load_comparison
    from zosoma.workers.placement import Placement

    check_executor_options(ctx, executor_kind, "--jobs", jobs)
    path = find_config(config)
    cmp = load_comparison(path)
    out = Path(out or Path("results") / path.stem)
    finished = check_folder(cmp, out)  # a folder another configuration left is refused, --plan or not
    ops = device_ops(device)  # --plan too: a plan for a device this machine lacks is no plan
    device = ops.name
    placement = Placement(executor_kind, address=address, cpus_per_unit=cpus_per_unit, gpus_per_unit=gpus_per_unit,
                          device=device)  # its options checked before the plan, as train checks them
    budget = f"budget {cmp.flops:.3g} forward FLOPs per run" if cmp.flops else "each method's own steps"
    click.echo(f"{cmp.title}\n{budget}; seeds {list(cmp.seeds)}; output {out}")
    w = max([24] + [len(m.name) for m in cmp.methods + cmp.ablation])
    click.echo(f"  {'method':<{w}}{'params':>10}{'P':>6}{'steps':>7}{'FLOPs/run':>11}")
    for m in cmp.methods + cmp.ablation:
        params = m.experts * m.model.n_params()
        P = "-" if m.kind == "backprop" else m.train.perturbations  # backprop: one forward and backward
        click.echo(f"  {m.name:<{w}}{params:>10,}{P:>6}{m.train.steps:>7}"
                   f"{m.flops_per_step() * m.train.steps:>11.3g}")
    sweep, todo = tuning_jobs(cmp), all_jobs(cmp)
    if sweep:
        t = cmp.tuning
        which = "every method" if t.methods is None else ", ".join(t.methods)
        sigma = any(j.method.kind in ("eggroll", "es") for j in sweep)
        click.echo(f"tuning first: {which} at lr x{', x'.join(f'{f:g}' for f in t.lr_factors)}"
                   + (f" (EGGROLL and ES also sigma x{', x'.join(f'{f:g}' for f in t.sigma_factors)})" if sigma else "")
                   + f", seed {t.seed}, scored on validation: {len(sweep)} runs; then each method's winner")
    click.echo(f"{len(sweep) + len(todo)} runs, {finished} already finished")
    if plan:
        return

    from zosoma.experiments.report import PLOTS_NEED, lost

    def report(job, result, error):
        name = Path(job.name).name
        if error:
            click.echo(f"failed   {name}: {error}", err=True)
        elif "validation" in result:  # a tuning run
            click.echo(f"tuned    {name}: validation {result['validation']:.4f} nats/byte"
                       + (" (diverged)" if lost(result) else "") + f", {result['wall_s']:.0f} s training")
        else:
            wiki = result["wikitext103"]
            click.echo(f"finished {name}: held-out {result['heldout']['overall']:.4f} nats/byte, WikiText-103 "
                       + (f"{wiki:.4f}" if wiki is not None else "n/a") + f", {result['wall_s']:.0f} s training"
                       + (" (diverged)" if lost(result) else ""))

    from zosoma.workers.placement import study_executor

    stop = StopRequest(resume=f"zosoma compare {config} --out {out}")
    try:
        executor = study_executor(placement, len(todo), jobs, ops.on_device)
        paths = run_comparison(cmp, out, executor, wikitext, device, should_stop=stop, on_result=report)
    except Stopped as e:
        click.echo(str(e), err=True)
        sys.exit(stop.exit_code)
    for name, p in paths.items():
        click.echo(f"wrote {p}" if p else f"skipped {name}: {PLOTS_NEED}")
