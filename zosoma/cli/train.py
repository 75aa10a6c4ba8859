"""zosoma train: a single model or a SOMA run, new or resumed, trained and evaluated."""

from __future__ import annotations

import click

from zosoma.cli import render
from zosoma.cli.options import (Checked, Named, check_executor_options, device_option, executor_options,
                                gemm_option, given, usage_errors)
from zosoma.cli.stop import StopRequest
from zosoma.config import ENGINES, ON_DIVERGENCE, PRECISIONS
from zosoma.errors import ClusterLost
from zosoma.model.protocol import PROTOCOL
from zosoma.strategies import STRATEGIES
from zosoma.strategies.probes import PROBES
from zosoma.strategies.queries import QUERIES
from zosoma.strategies.settings import resolve
from zosoma.strategies.shaping import SHAPINGS as SHAPING_NAMES
from zosoma.strategies.transforms import TRANSFORMS

_TC = resolve("tiny")[1]  # defaults shown in --help: the default run's


@click.command()
@click.option("--data", "data", multiple=True, type=click.Path(), help="Training text: a directory of .txt/.gz files, a file, or repeat the option. Default: the shipped 8-domain corpus.")
@click.option("--heldout", multiple=True, type=click.Path(), help="Held-out text for the final evaluation (default: the shipped held-out slices when --data is not given).")
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder) for the final evaluation; found automatically when downloaded.")
@click.option("--preset", metavar="[tiny|small|paper]", default="tiny", show_default=True, help="Model size and training defaults; explicit options override it.")
@click.option("--experts", type=Checked(), default=1, show_default=True, help="N: SOMA experts, one per data cluster (1 = a single monolithic model).")
@click.option("--loss", type=Named(["independent", "summed"]), default="independent", show_default=True, help="Experts' SPSA scalars: their own losses (SOMA) or the summed loss (ablation).")
@click.option("--workers", type=Checked(), help="Expert worker processes (default: the machine's cores).")
@executor_options
@click.option("--population-workers", type=Checked(), help="W: spread one model's P perturbation pairs over W workers (local processes, or Ray actors with --executor ray); per step only the losses and the step's scalars travel.")
@click.option("--chunk-size", type=Checked(), default=2048, show_default=True, help="Bytes per document chunk for clustering.")
@click.option("--top-k", type=Checked(), default=PROTOCOL.top_k, show_default=True, help="Experts mixed per segment in the final routed evaluation.")
@click.option("--embed", type=Checked(), help="E: embedding width.")
@click.option("--hidden", type=Checked(), help="H: LSTM hidden width.")
@click.option("--layers", type=Checked(), help="L: LSTM layers.")
@click.option("--steps", type=Checked(), help=f"Optimizer steps (4000; the default estimator's 3100 and onesided's 3540, at equal wall).  [default: {_TC.steps}]")
@click.option("--batch", type=Checked(), help=f"B: sequences per minibatch.  [default: {_TC.batch}]")
@click.option("--seq-len", type=Checked(), help=f"T: predicted bytes per sequence.  [default: {_TC.seq_len}]")
@click.option("--perturbations", "-P", type=Checked(), help=f"P: SPSA directions per step.  [default: {_TC.perturbations}]")
@click.option("--eps", type=Checked("number"), help=f"Perturbation scale (SPSA eps, EGGROLL sigma).  [default: {_TC.eps}]")
@click.option("--noise", type=Named(["rademacher", "gaussian"]), help=f"Perturbation distribution.  [default: {_TC.noise}]")
@click.option("--optimizer", type=Named(list(STRATEGIES)), help=f"Strategy: activity-onesided (activity perturbation: noise on the gates' pre-activations, each target's own loss difference, the readout by its exact local rule; by default at 6.667 times the preset's rate and 3,100 steps); activity, activity-causal, activity-local, activity-local-causal (its variants); onesided (SPSA with forward differences: 2P directions per step; by default at 1.4142 times the preset's rate and 3,540 steps); readout (one-sided SPSA on the embedding and LSTM, the output layer by its exact local gradient: --readout-lr); rowwise (one-sided SPSA with a direction per member and batch row, each row's own loss difference); SPSA with update rule sgd (the paper's estimator), momentum or adam; eggroll (low-rank ES); es (OpenAI-ES).  [default: {_TC.optimizer}]")
@click.option("--rank", type=Checked(), help=f"EGGROLL's perturbation rank r.  [default: {_TC.rank}]")
@click.option("--lr", type=Checked("number"), help=f"Peak learning rate (the preset's; 1.4142 times it for onesided, es its own).  [default: {_TC.lr}]")
@click.option("--schedule", type=Named(["constant", "cosine"]), help=f"Learning-rate schedule after warm-up.  [default: {_TC.schedule}]")
@click.option("--warmup", type=Checked(), help=f"Linear warm-up steps.  [default: {_TC.warmup}]")
@click.option("--momentum", type=Checked("number"), help=f"Momentum / Adam beta1.  [default: {_TC.momentum}]")
@click.option("--beta2", type=Checked("number"), help=f"Adam beta2.  [default: {_TC.beta2}]")
@click.option("--weight-decay", type=Checked("number"), help=f"Decoupled weight decay.  [default: {_TC.weight_decay}]")
@click.option("--seed", type=Checked(), help=f"Seed for initialisation, clustering, batches and noise.  [default: {_TC.seed}]")
@click.option("--checkpoint-every", type=Checked(), help=f"Steps between checkpoints.  [default: {_TC.checkpoint_every}]")
@click.option("--on-divergence", type=Named(ON_DIVERGENCE), help=f"When the loss runs away (non-finite, or far above its best for a long window): stop with a checkpoint; go on; or restart that model from a checkpoint before it began, at a lower rate on fresh batches, and after --max-restarts drop it (SOMA routes around it). The verdicts are in the results either way.  [default: {_TC.on_divergence}]")
@click.option("--restart-lr-factor", type=Checked("number"), help=f"--on-divergence restart: the rate's factor at each restart.  [default: {_TC.restart_lr_factor}]")
@click.option("--max-restarts", type=Checked(), help=f"--on-divergence restart: restarts before a model is dropped.  [default: {_TC.max_restarts}]")
@click.option("--shaping", type=Named(["none", *SHAPING_NAMES]), multiple=True, help=f"SPSA: shape the step's scalars before the update, in the order given (repeat the option): clip bounds each at --clip-at running medians of |g|; normalize rescales every step after the 10th to the mean spread of the steps before (each at most twice it; frozen after --normalize-window steps); none is plain SPSA (the paper's).  [default: {'+'.join(_TC.shaping) or 'none'}]")
@click.option("--clip-at", type=Checked("number"), help=f"--shaping clip: the bound in running medians of |g|.  [default: {_TC.clip_at}]")
@click.option("--normalize-window", type=Checked(), help=f"--shaping normalize: steps whose mean spread (each at most twice the mean before it) is the reference.  [default: {_TC.normalize_window}]")
@click.option("--probes", type=Named(list(PROBES)), help=f"SPSA, ES: the step's P directions: iid from the counters (the paper's); orthogonal (orthogonalised, norm sqrt(d)); guided (mixed with the last update, Guided ES); blocks (each pair perturbs one block of the model: block-coordinate SPSA). See docs/cut-price.md.  [default: {_TC.probes}]")
@click.option("--queries", type=Named(list(QUERIES)), help=f"The pairs per step over the run: constant P, or doubling (P/2, P, 2P, each a third of the forward budget).  [default: {_TC.queries}]")
@click.option("--transforms", type=Named(list(TRANSFORMS)), multiple=True, help="SPSA, ES: update transforms chained onto the estimate before the step, in the order given (repeat the option): --optimizer es --transforms adam is ES with Adam.  [default: none]")
@click.option("--readout-lr", type=Checked("number"), help=f"--optimizer readout: the output layer's rate along its exact local gradient (times the schedule's factor).  [default: {STRATEGIES['readout'].defaults['readout_lr']}]")
@click.option("--run-dir", type=click.Path(), help="Run folder (default: runs/<preset>-<time>).")
@click.option("--resume", type=click.Path(), help="Continue the run in this folder exactly where it stopped; its configuration comes from its checkpoints.")
@click.option("--engine", type=Named(ENGINES), help=f"Where the forwards run: native (Numba; CuPy with --device cuda) or onnxruntime (an inference-only runtime fed perturbed weights; the update stays on the host).  [default: {_TC.engine}]")
@click.option("--forward-precision", type=Named(PRECISIONS), help=f"Number format of every forward, emulated on the CPU; master weights and the update stay fp32.  [default: {_TC.forward_precision}]")
@device_option
@gemm_option
@click.option("--log-every", help="Progress as plain lines (the default without a terminal: a log file, nohup, SLURM), every this many seconds (30s) or steps (500).  [default: 30s]")
@click.option("--quiet", is_flag=True, help="No progress bars or lines: the run's line, warnings and results only.")
@click.pass_context
def train(ctx, data, heldout, wikitext, preset, experts, loss, workers, executor_kind, address, cpus_per_unit,
          gpus_per_unit, population_workers, chunk_size, top_k, resume, run_dir, device, gemm, log_every, quiet,
          **options):
    """Train byte-level LSTMs with SPSA (forward passes only), then evaluate.

    With --experts N > 1 (SOMA): cluster the corpus into N clusters, train one expert per cluster
    in parallel worker processes, and evaluate the top-k routed ensemble. Writes checkpoints,
    metrics.jsonl and results.json under the run folder. Ctrl-C finishes the current step, saves
    checkpoints and exits; `--resume RUN_DIR` continues as if never stopped.

    Presets (preset values are the defaults that explicit options override): tiny E=32 H=64 L=1;
    small E=128 H=256 L=2; paper E=508 H=496 L=2 (4.22M parameters per expert, 8.44M for N=2).
    """
    from zosoma.engines import device_note
    from zosoma.workers.placement import Placement
    from zosoma.runs.run import Run, Spec, check_resume
    from zosoma.training.shape import DataPaths

    logging = render.Logging.parse(log_every, quiet)
    check_executor_options(ctx, executor_kind, "--workers", workers)
    given_placement = {name: value for name, value in (
        ("executor", executor_kind), ("workers", workers), ("population_workers", population_workers),
        ("address", address), ("cpus_per_unit", cpus_per_unit), ("gpus_per_unit", gpus_per_unit),
        ("device", device), ("gemm", gemm)) if given(ctx, "executor_kind" if name == "executor" else name)}
    stop = StopRequest()
    if resume:
        check_resume([k for k, v in options.items() if v not in (None, ())]
                     + [n for n in ("data", "heldout", "run_dir", "experts", "loss", "preset", "chunk_size", "top_k")
                        if given(ctx, n)])
        run = Run.open(resume)
        recorded = run.folder.read_placement(Placement)
        placement = recorded.replaced(given_placement)
        if recorded != type(recorded)():  # say where it goes on: the options are not on this command line
            click.echo(f"placement: {placement.describe() or 'the defaults'} (where the run was, with the "
                       "options given here)", err=True)
        records = run.resume(options["steps"], wikitext, placement, should_stop=stop)
    else:
        with usage_errors():  # options that cannot work together, or not on this machine: exit code 2
            spec = Spec.resolve(preset, {k: v for k, v in options.items() if v not in (None, ())}, experts,
                                *(value if given(ctx, name) else None for name, value in
                                  (("loss", loss), ("top_k", top_k), ("chunk_size", chunk_size))))
        records = Run.start(spec, DataPaths(data, heldout, wikitext), Placement(**given_placement), run_dir,
                            should_stop=stop)
    note = device_note(device, records.engine) if given(ctx, "device") else None  # which engine auto chose
    if note:
        click.echo(note, err=True)
    try:
        render.training(records, stop, logging)
    except ClusterLost as e:  # the checkpoints are kept: say how to go on
        raise ClusterLost(f"{e}. Continue with: zosoma train --resume {records.path}") from None
