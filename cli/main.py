"""The `zosoma` command line: parse, call the library, render. Nothing else lives here."""

from __future__ import annotations

import math
import os
import signal
import sys
from datetime import datetime
from pathlib import Path

import click

from zosoma import __version__
from zosoma.config import ENGINES, ON_DIVERGENCE, PRECISIONS, TrainConfig  # light: the heavy modules load inside commands
from zosoma.engines import DEVICES
from zosoma.strategies import STRATEGIES
from zosoma.strategies.shaping import SHAPINGS as SHAPING_NAMES


class ZosomaGroup(click.Group):
    """Turns the library's ZosomaError (bad input, damaged files) into one line and exit code 1."""

    def invoke(self, ctx):
        import warnings

        from zosoma.errors import ZosomaError
        warnings.showwarning = _warning_line
        signal.signal(signal.SIGTERM, _abort)  # as Ctrl-C: cleanups run (training commands save first)
        try:
            return super().invoke(ctx)
        except ZosomaError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt as e:  # a second stop signal, or Ctrl-C outside training
            click.echo("aborted", err=True)
            sys.exit(128 + getattr(e, "signum", signal.SIGINT))


def _abort(signum, frame):
    raise Interrupted(signum)


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """The library's warnings (a damaged checkpoint passed over, ...) as one line on stderr."""
    click.echo(f"warning: {message}", err=True)


@click.group(cls=ZosomaGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="zosoma")
def cli():
    """Zero-order (forward-only) pretraining of byte-level LSTM language models with SPSA."""


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be at least 1, got {value}")
    return value


def _positive_float(ctx, param, value):
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be a positive number, got {value}")
    return value


def _nonneg_float(ctx, param, value):
    if value is not None and not (value >= 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


def _nonneg(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter(f"must not be negative, got {value}")
    return value


_TC = TrainConfig()  # defaults shown in --help


def device_option(f):
    return click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
                        help="Where the forward passes run; auto uses a GPU when CuPy finds one.")(f)


def previous_option(f):
    return click.option("--previous", is_flag=True, help="If a run's newest checkpoint is damaged, use the newest intact one (said in a warning line) instead of stopping.")(f)


def _ops(device: str):
    """The engine for --device (zosoma.engines.get_ops); says which one --device auto chose."""
    from zosoma.engines import device_note, get_ops
    ops = get_ops(device)
    note = device_note(device, ops)
    if note:
        click.echo(note, err=True)
    return ops


def executor_options(f):
    """--executor and the Ray options, shared by train and compare."""
    for option in reversed([
        click.option("--executor", "executor_kind", type=click.Choice(["inline", "local", "ray"]), help="Where units of work run: inline in this process, local worker processes (the default), or Ray tasks and actors on this machine or a cluster (needs the ray extra)."),
        click.option("--address", help="--executor ray: the cluster to join (HOST:PORT of its head, or auto for the one `ray start` made here); default: start Ray on this machine."),
        click.option("--cpus-per-unit", type=float, default=1.0, show_default=True, callback=_positive_float, help="--executor ray: CPUs (and as many BLAS threads) per expert, run or population worker."),
        click.option("--gpus-per-unit", type=float, default=0.0, show_default=True, callback=_nonneg_float, help="--executor ray: GPUs per expert, run or population worker (1 with --device cuda)."),
    ]):
        f = option(f)
    return f


def _check_executor_options(ctx, kind: str | None, workers_option: str, workers) -> None:
    """The Ray options need --executor ray; a local process count does not go with it."""
    if kind != "ray":
        for name in ("address", "cpus_per_unit", "gpus_per_unit"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"--{name.replace('_', '-')} is for --executor ray")
    elif workers is not None:
        raise click.UsageError(f"{workers_option} counts local processes; on Ray, --cpus-per-unit and the "
                               "cluster's CPUs decide how many units run at once")


def _given(ctx, name: str) -> bool:
    """Whether option `name` was given on the command line (not left at its default)."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def new_run_dir(prefix: str) -> Path:
    """runs/<prefix><time>, made now and so unique: two runs started in the same second get
    runs/...-<time> and runs/...-<time>-2."""
    stem = Path("runs") / f"{prefix}{datetime.now():%Y%m%d-%H%M%S}"
    Path("runs").mkdir(exist_ok=True)
    for n in range(1, 1000):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise click.ClickException(f"cannot find a free run folder name beside {stem}")


MODEL_OPTIONS = ("embed", "hidden", "layers")
TRAIN_OPTIONS = ("steps", "batch", "seq_len", "perturbations", "eps", "noise", "optimizer", "rank", "lr",
                 "schedule", "warmup", "momentum", "beta2", "weight_decay", "seed", "checkpoint_every", "engine",
                 "forward_precision", "on_divergence", "shaping", "clip_at", "normalize_window", "restart_lr_factor",
                 "max_restarts")


@cli.command()
@click.option("--data", "data", multiple=True, type=click.Path(), help="Training text: a directory of .txt/.gz files, a file, or repeat the option. Default: the shipped 8-domain corpus.")
@click.option("--heldout", multiple=True, type=click.Path(), help="Held-out text for the final evaluation (default: the shipped held-out slices when --data is not given).")
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder) for the final evaluation; found automatically when downloaded.")
@click.option("--preset", type=click.Choice(["tiny", "small", "paper"]), default="tiny", show_default=True, help="Model size and training defaults; explicit options override it.")
@click.option("--experts", type=int, default=1, show_default=True, callback=_positive, help="N: SOMA experts, one per data cluster (1 = a single monolithic model).")
@click.option("--loss", type=click.Choice(["independent", "summed"]), default="independent", show_default=True, help="Experts' SPSA scalars: their own losses (SOMA) or the summed loss (ablation).")
@click.option("--workers", type=int, callback=_positive, help="Expert worker processes (default: the machine's cores).")
@executor_options
@click.option("--population-workers", type=int, callback=_positive, help="W: spread one model's P perturbation pairs over W workers (local processes, or Ray actors with --executor ray); per step only the losses and the P update scalars travel.")
@click.option("--chunk-size", type=int, default=2048, show_default=True, callback=_positive, help="Bytes per document chunk for clustering.")
@click.option("--top-k", type=int, default=2, show_default=True, callback=_positive, help="Experts mixed per segment in the final routed evaluation.")
@click.option("--embed", type=int, callback=_positive, help="E: embedding width.")
@click.option("--hidden", type=int, callback=_positive, help="H: LSTM hidden width.")
@click.option("--layers", type=int, callback=_positive, help="L: LSTM layers.")
@click.option("--steps", type=int, callback=_positive, help=f"Optimizer steps.  [default: {_TC.steps}]")
@click.option("--batch", type=int, callback=_positive, help=f"B: sequences per minibatch.  [default: {_TC.batch}]")
@click.option("--seq-len", type=int, callback=_positive, help=f"T: predicted bytes per sequence.  [default: {_TC.seq_len}]")
@click.option("--perturbations", "-P", type=int, callback=_positive, help=f"P: SPSA directions per step.  [default: {_TC.perturbations}]")
@click.option("--eps", type=float, callback=_positive_float, help=f"Perturbation scale (SPSA eps, EGGROLL sigma).  [default: {_TC.eps}]")
@click.option("--noise", type=click.Choice(["rademacher", "gaussian"]), help=f"Perturbation distribution.  [default: {_TC.noise}]")
@click.option("--optimizer", type=click.Choice(list(STRATEGIES)), help=f"Strategy: SPSA with update rule sgd, momentum or adam; eggroll (low-rank ES); es (OpenAI-ES).  [default: {_TC.optimizer}]")
@click.option("--rank", type=int, callback=_positive, help=f"EGGROLL's perturbation rank r.  [default: {_TC.rank}]")
@click.option("--lr", type=float, callback=_positive_float, help=f"Peak learning rate.  [default: {_TC.lr}]")
@click.option("--schedule", type=click.Choice(["constant", "cosine"]), help=f"Learning-rate schedule after warm-up.  [default: {_TC.schedule}]")
@click.option("--warmup", type=int, callback=_nonneg, help=f"Linear warm-up steps.  [default: {_TC.warmup}]")
@click.option("--momentum", type=float, help=f"Momentum / Adam beta1.  [default: {_TC.momentum}]")
@click.option("--beta2", type=float, help=f"Adam beta2.  [default: {_TC.beta2}]")
@click.option("--weight-decay", type=float, callback=_nonneg_float, help=f"Decoupled weight decay.  [default: {_TC.weight_decay}]")
@click.option("--seed", type=int, callback=_nonneg, help=f"Seed for initialisation, clustering, batches and noise.  [default: {_TC.seed}]")
@click.option("--checkpoint-every", type=int, callback=_positive, help=f"Steps between checkpoints.  [default: {_TC.checkpoint_every}]")
@click.option("--on-divergence", type=click.Choice(ON_DIVERGENCE), help=f"When the loss runs away (non-finite, or far above its best for a long window): stop with a checkpoint; go on; or restart that model from a checkpoint before it began, at a lower rate on fresh batches, and after --max-restarts drop it (SOMA routes around it). The verdicts are in the results either way.  [default: {_TC.on_divergence}]")
@click.option("--restart-lr-factor", type=float, callback=_positive_float, help=f"--on-divergence restart: the rate's factor at each restart.  [default: {_TC.restart_lr_factor}]")
@click.option("--max-restarts", type=int, callback=_nonneg, help=f"--on-divergence restart: restarts before a model is dropped.  [default: {_TC.max_restarts}]")
@click.option("--shaping", type=click.Choice(list(SHAPING_NAMES)), multiple=True, help="SPSA: shape each step's P scalars before the update, in the order given (repeat the option): clip bounds each at --clip-at running medians of |g|; normalize rescales every step to the mean spread of the first --normalize-window steps.  [default: none]")
@click.option("--clip-at", type=float, callback=_positive_float, help=f"--shaping clip: the bound in running medians of |g|.  [default: {_TC.clip_at}]")
@click.option("--normalize-window", type=int, callback=_positive, help=f"--shaping normalize: steps whose mean spread is the reference.  [default: {_TC.normalize_window}]")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run folder (default: runs/<preset>-<time>).")
@click.option("--resume", type=click.Path(file_okay=False), help="Continue the run in this folder exactly where it stopped; its configuration comes from its checkpoints.")
@click.option("--engine", type=click.Choice(ENGINES), help=f"Where the forwards run: native (Numba; CuPy with --device cuda) or onnxruntime (an inference-only runtime fed perturbed weights; the update stays on the host).  [default: {_TC.engine}]")
@click.option("--forward-precision", type=click.Choice(PRECISIONS), help=f"Number format of every forward, emulated on the CPU; master weights and the update stay fp32.  [default: {_TC.forward_precision}]")
@device_option
@click.pass_context
def train(ctx, data, heldout, wikitext, preset, experts, loss, workers, executor_kind, address, cpus_per_unit,
          gpus_per_unit, population_workers, chunk_size, top_k, resume, run_dir, device, **options):
    """Train byte-level LSTMs with SPSA (forward passes only), then evaluate.

    With --experts N > 1 (SOMA): cluster the corpus into N clusters, train one expert per cluster
    in parallel worker processes, and evaluate the top-k routed ensemble. Writes checkpoints,
    metrics.jsonl and results.json under the run folder. Ctrl-C finishes the current step, saves
    checkpoints and exits; `--resume RUN_DIR` continues as if never stopped.

    Presets (preset values are the defaults that explicit options override): tiny E=32 H=64 L=1;
    small E=128 H=256 L=2; paper E=508 H=496 L=2 (4.22M parameters per expert, 8.44M for N=2).
    """
    from zosoma.config import PRESETS, ModelConfig
    from zosoma.engines import get_ops, run_ops
    from zosoma.runs.folder import RunFolder
    from zosoma.runs.placement import place
    from zosoma.strategies.base import COMMON, unused_option
    from zosoma.runs.single import resume_run, start_run
    from zosoma.runs.soma import resume_soma, start_soma

    if top_k > experts and experts > 1:
        raise click.BadParameter(f"top-k {top_k} exceeds the {experts} experts", param_hint="--top-k")
    _check_executor_options(ctx, executor_kind, "--workers", workers)
    given_placement = {name: value for name, value in (
        ("executor", executor_kind), ("workers", workers), ("population_workers", population_workers),
        ("address", address), ("cpus_per_unit", cpus_per_unit), ("gpus_per_unit", gpus_per_unit),
        ("device", device)) if _given(ctx, "executor_kind" if name == "executor" else name)}
    if "device" in given_placement:
        given_placement["device"] = _ops(device).name  # auto, resolved
    stop, made = StopRequest(), None
    if resume:
        folder = RunFolder(resume)
        clashing = [k for k, v in options.items() if v not in (None, ()) and k != "steps"]
        clashing += [n for n in ("data", "heldout", "run_dir", "experts", "loss", "preset", "chunk_size", "top_k")
                     if _given(ctx, n)]
        if clashing:
            raise click.UsageError("--resume takes its configuration from the checkpoint; drop "
                                   + ", ".join("--" + n.replace("_", "-") for n in clashing)
                                   + " (--steps extends the run, --wikitext replaces its WikiText-103 file)")
        recorded = folder.read_placement()
        placement = recorded.replaced(given_placement)
        if recorded != type(recorded)():  # say where it goes on: the options are not on this command line
            click.echo(f"placement: {placement.describe() or 'the defaults'} (where the run was, with the "
                       "options given here)", err=True)
        resume_args = dict(should_stop=stop, placement=placement, steps=options["steps"], wikitext=wikitext)
        if folder.is_soma:
            soma = folder.read_soma()
            executor, summed, _ = place(placement, soma["experts"], soma["loss"])
            records = resume_soma(folder.path, executor, device=placement.device, workers=summed, **resume_args)
        else:
            _, _, sharding = place(placement, 1)
            records = resume_run(folder.path, ops=get_ops(placement.device), sharding=sharding, **resume_args)
    else:
        from zosoma.runs.placement import Placement

        placement = Placement(**given_placement)
        base_model, base_train = PRESETS[preset]
        model = ModelConfig(**{k: options[k] if options[k] is not None else getattr(base_model, k)
                               for k in MODEL_OPTIONS})
        given = {k: options[k] for k in TRAIN_OPTIONS if options[k] not in (None, ())}
        strategy = STRATEGIES[given.get("optimizer", _TC.optimizer)]
        for k in given:
            if k not in COMMON | strategy.options:
                raise click.UsageError(unused_option(strategy, k))
        cfg = TrainConfig(**{**TrainConfig().__dict__, **base_train, **strategy.defaults, **given})
        run_ops(get_ops(placement.device), cfg.engine, cfg.forward_precision)  # an engine not installed: one line, now
        if experts == 1:
            ignored = [n for n in ("loss", "top_k", "chunk_size", "workers") if _given(ctx, n)]
            if ignored:
                raise click.UsageError(f"--{ignored[0].replace('_', '-')} is an option of SOMA (--experts 2 or more)")
        train_paths, heldout_paths = list(data) or None, list(heldout) or None
        if population_workers:
            from zosoma.runs.population_workers import check_shardable
            check_shardable(cfg, population_workers)  # W > P, or a strategy that cannot be split: one line
        executor, summed, sharding = place(placement, experts, loss)
        made = None if run_dir else new_run_dir(f"{preset}-{'soma%d-' % experts if experts > 1 else ''}")
        run_dir = Path(run_dir or made)
        if experts > 1:
            records = start_soma(run_dir, model, cfg, experts, loss, executor, chunk_size, train_paths,
                                 heldout_paths, wikitext, top_k, should_stop=stop, device=placement.device,
                                 workers=summed, placement=placement)
        else:
            records = start_run(run_dir, model, cfg, train_paths, heldout_paths, wikitext, should_stop=stop,
                                ops=get_ops(placement.device), sharding=sharding, placement=placement)
    try:
        _render_training(records, stop)
    except BaseException:
        if not resume and made is not None:
            RunFolder(made).remove_if_empty()  # the folder this command named and made, nothing written in it
        raise


class StopRequest:
    """First Ctrl-C (SIGINT) or SIGTERM (SLURM preemption, `docker stop`, systemd): finish the
    step, checkpoint, exit 128 + the signal's number. A second signal aborts at once (with that
    code too). The handlers stay for the life of the command's process; calling the object says
    whether a stop was asked for."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handler)

    def __call__(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame):
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        click.echo(f"\n{what}: stopping after this step (a second signal aborts without saving)", err=True)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A second stop signal: abort now (ZosomaGroup exits with 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _render_training(records, stop: StopRequest):
    from tqdm import tqdm

    from zosoma.runs.records import (Clusters, Diverged, Dropped, Evaluated, Failed, Note, Restarted, Started, Step,
                                     Stopped)

    bars, stopped, evaluated, failed, run_dir = {}, False, False, [], "RUN"
    for r in records:
        if isinstance(r, Step):
            bar = bars[r.expert]
            bar.update(r.step - bar.n)  # absolute: a retried unit repeats steps
            bar.set_postfix_str(f"loss {r.loss:.3f} nats/byte, {r.tokens_per_s:,.0f} tok/s"
                                + (" SKIPPED non-finite" if r.skipped else ""))
            if r.skipped:
                bar.write(f"expert {r.expert} step {r.step}: non-finite loss, update skipped")
            for note in r.notes:
                bar.write(f"warning: {note}", file=sys.stderr)
        elif isinstance(r, Clusters):
            from zosoma.mixture.cluster import format_report
            click.echo(f"clustered {r.n_chunks:,} chunks of {r.chunk_size} bytes:")
            click.echo(format_report(r.report))
        elif isinstance(r, Started):
            m, t, n, run_dir = r.model, r.train, r.experts, r.run_dir
            who = f"{n} experts x " if n > 1 else ""
            click.echo(f"run {r.run_dir}: {who}{r.n_params:,} parameters (E={m.embed} H={m.hidden} L={m.layers}), "
                       f"--optimizer {t.optimizer} P={t.perturbations} eps={t.eps} lr={t.lr}, "
                       f"B={t.batch} T={t.seq_len}, {t.steps} steps, seed {t.seed}"
                       + (f", shaping {'+'.join(t.shaping)}" if t.shaping else "")
                       + (f", on divergence {t.on_divergence}" if t.on_divergence != "stop" else "")
                       + (f", {r.loss} losses" if n > 1 else "") + f", device {r.device}")
            click.echo(f"data: {r.data}")
            for i, done in enumerate(r.steps):
                bars[i] = tqdm(total=t.steps, initial=done, unit="step", dynamic_ncols=True, position=i,
                               desc=f"expert {i}" if n > 1 else "train", disable=None, file=sys.stderr)
        elif isinstance(r, Restarted):
            bars[r.expert].n = r.to
            bars[r.expert].write(f"{'expert %d' % r.expert if len(bars) > 1 else 'the model'} restarted at step "
                                 f"{r.step} ({r.verdict}): rolled back to step {r.to}, lr x{r.lr_scale:g}, fresh batches")
        elif isinstance(r, Dropped):
            if len(bars) > 1:
                bars[r.expert].write(f"expert {r.expert} dropped at step {r.step} after {r.restarts} restart(s) "
                                     f"({r.verdict}): the others go on, and routing leaves it out")
            else:
                failed.append(f"the model diverged again at step {r.step} after {r.restarts} restart(s) ({r.verdict}); "
                              "training gave up on it")
        elif isinstance(r, Stopped):
            stopped = True
        elif isinstance(r, Failed):
            failed.append(f"expert {r.unit} failed: {r.error}")
        elif isinstance(r, Diverged):
            failed.append(f"expert {r.expert} diverged at step {r.step} ({r.verdict}); it stopped there, "
                          "checkpointed: lower --lr and start again, or --resume to go on regardless")
        elif isinstance(r, Note):
            (next(iter(bars.values())).write if bars else click.echo)(f"warning: {r.message}", file=sys.stderr)
        elif isinstance(r, Evaluated):
            _close(bars)
            click.echo(_format_results(r.results))
            evaluated = True
    _close(bars)
    for line in failed:
        click.echo(line, err=True)
    if failed:  # the failed experts keep their last checkpoint; the others were checkpointed
        click.echo(f"stopped: fix the cause above, then continue with: zosoma train --resume {run_dir}", err=True)
        sys.exit(1)
    if stopped or (stop() and not evaluated):  # a stop asked for: some unit may not have said so
        click.echo(f"stopped; checkpoints saved. Continue with: zosoma train --resume {run_dir}")
        sys.exit(stop.exit_code)


def _close(bars):
    for bar in bars.values():
        bar.close()
    bars.clear()


def _format_results(r) -> str:
    lines = []
    if "tokens" in r:
        lines.append(f"compute: {r['tokens']:,} forward tokens, {r['flops']:.3g} forward FLOPs, "
                     f"{r['wall_s']:.0f} s training wall time" + (" (summed over experts)" if "top_k" in r else ""))
    heldout, wiki = r.get("heldout"), r.get("wikitext103")
    if heldout and isinstance(next(iter(heldout.values())), dict):  # SOMA: routed, experts, oracle
        cols = list(next(iter(heldout.values())))
        lines.append(f"held-out nats/byte (untrained: 5.545; top-{r['top_k']} routing, segments of "
                     f"{r['segment']} bytes after {r['context']} bytes of context; oracle peeks at the targets):")
        lines.append(f"  {'':<14}" + "".join(f"{c:>10}" for c in cols))
        rows = list(heldout.items()) + ([("WikiText-103", wiki)] if wiki else [])
        lines += [f"  {name:<14}" + "".join(f"{v[c]:>10.4f}" for c in cols) for name, v in rows]
    elif heldout:
        lines.append(f"held-out nats/byte (untrained: 5.545; {r.get('protocol', '')}):")
        lines += [f"  {name:<14} {v:.4f}" for name, v in heldout.items()]
        if wiki is not None:
            lines.append(f"WikiText-103 test nats/byte: {wiki:.4f}  ({r['wikitext103_path']})")
    if wiki is None:
        lines.append("WikiText-103: not found (zosoma data download wikitext-103, or --wikitext PATH)")
    return "\n".join(lines)


@cli.command("eval")
@click.argument("checkpoint", type=click.Path())
@click.option("--data", multiple=True, type=click.Path(), help="Files or folders to evaluate (default: the shipped held-out slices).")
@click.option("--wikitext", type=click.Path(), help="WikiText-103 wiki.test.raw (file or folder); found automatically when downloaded.")
@click.option("--streams", type=int, callback=_positive, help="Single model: score each whole file statefully in this many side-by-side parts (1 = one pass) instead of the segment protocol every table uses.")
@click.option("--top-k", type=int, default=2, show_default=True, callback=_positive, help="SOMA run: experts mixed per segment.")
@click.option("--temperature", type=float, default=0.1, show_default=True, help="SOMA run: routing temperature T in softmax(-d^2 / T).")
@click.option("--segment", type=int, default=256, show_default=True, callback=_positive, help="Bytes predicted per segment (and per routing decision).")
@click.option("--context", type=int, default=512, show_default=True, callback=_positive, help="Bytes before each segment used for warm-up (and routing).")
@previous_option
@device_option
def eval_(checkpoint, data, wikitext, streams, top_k, temperature, segment, context, previous, device):
    """Nats/byte on held-out text and WikiText-103 of a checkpoint, a run folder, or a SOMA run
    folder (routed ensemble, each expert alone, and oracle routing)."""
    from zosoma.corpus import load_corpus
    from zosoma.runs.folder import RunFolder

    ops = _ops(device)
    corpus = load_corpus(list(data) if data else None, split="heldout")
    if RunFolder(checkpoint).is_soma:
        from zosoma.runs.soma import evaluate_soma, load_ensemble
        ensemble = load_ensemble(checkpoint, top_k, temperature, fallback=previous)
        r = evaluate_soma(ensemble, corpus, wikitext, ops, segment=segment, context=context)
        click.echo(_format_results(r))
        return
    from zosoma.formats.checkpoint import load_checkpoint
    from zosoma.model.params import Layout
    from zosoma.runs.single import evaluate_run

    path = Path(checkpoint)
    ckpt = RunFolder(path).read_checkpoint(fallback=previous) if path.is_dir() else load_checkpoint(path)
    r = evaluate_run(ckpt.theta, Layout(ckpt.model), corpus, wikitext, ops=ops, segment=segment, context=context,
                     streams=streams)
    click.echo(f"{checkpoint}: step {ckpt.step}, {ckpt.model.n_params():,} parameters")
    click.echo(_format_results(r))


@cli.command()
@click.argument("checkpoint", type=click.Path())
@previous_option
def info(checkpoint, previous):
    """Summarise a checkpoint (file, or run folder): format, config, step, tensors, last metrics.
    For a SOMA run folder: its experts, loss mode and cluster sizes, and each expert's step."""
    from zosoma.formats.checkpoint import summary
    from zosoma.runs.folder import RunFolder, checkpoint_path
    from zosoma.runs.soma import soma_summary
    if RunFolder(checkpoint).is_soma:
        click.echo(soma_summary(checkpoint, fallback=previous))
    else:
        click.echo(summary(checkpoint_path(checkpoint, fallback=previous)))


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["torch", "onnx"]), default="torch", show_default=True)
@click.option("--out", "out", type=click.Path(), required=True, help="Output file (model.pt, model.onnx), or a folder for a SOMA run as ONNX; an existing one is not overwritten without --force.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists. A SOMA run's folder: only the files an earlier export wrote there (its manifest.json lists them) are replaced; anything else in it is left alone, and a file of the user's with a name the export uses stops it before anything changes.")
@click.option("--unrolled", is_flag=True, help="ONNX: the cell as MatMul/Add/Sigmoid/Tanh/Mul, unrolled over --seq-len steps, for runtimes without an LSTM operator.")
@click.option("--seq-len", type=int, callback=_positive, help="ONNX --unrolled: the time steps of the graph.  [default: 64]")
@previous_option
def export(checkpoint, fmt, out, force, unrolled, seq_len, previous):
    """Write a checkpoint's weights as a PyTorch state_dict for nn.Embedding + nn.LSTM + nn.Linear
    (modules named embedding, lstm, linear; batch_first=True), or as ONNX (--format onnx): the
    standard LSTM operator with h0/c0 in and hT/cT out, for a single model, one SOMA expert
    (RUN/expertI), or a whole SOMA run (a folder: one graph per expert, router.npz, manifest.json;
    see PORTING.md)."""
    from zosoma.formats.checkpoint import load_checkpoint
    from zosoma.formats.torch_state import export_torch
    from zosoma.model.params import Layout
    from zosoma.runs.folder import RunFolder, checkpoint_path

    if Path(out).exists() and not force:
        raise click.ClickException(f"{out} exists; pass --force to overwrite it")
    if fmt != "onnx" and (unrolled or seq_len):
        raise click.UsageError("--unrolled and --seq-len are options of --format onnx")
    if seq_len and not unrolled:
        raise click.UsageError("--seq-len sets the steps of an --unrolled graph (the LSTM operator takes any length)")
    if fmt == "onnx":
        from zosoma.porting.export_run import export_run
        for line in export_run(checkpoint, out, "unrolled" if unrolled else "lstm", (seq_len or 64) if unrolled else None,
                               force=force, fallback=previous):
            click.echo(line)
        return
    if RunFolder(checkpoint).is_soma:
        n = RunFolder(checkpoint).read_soma()["experts"]
        raise click.ClickException(f"{checkpoint} is a SOMA run: export one expert, "
                                   f"{Path(checkpoint) / 'expert0'} .. expert{n - 1}")
    ckpt = load_checkpoint(checkpoint_path(checkpoint, fallback=previous))
    export_torch(ckpt.theta, Layout(ckpt.model), out)
    m = ckpt.model
    click.echo(f"wrote {out}: torch state_dict for Embedding(256, {m.embed}), "
               f"LSTM({m.embed}, {m.hidden}, num_layers={m.layers}, batch_first=True), Linear({m.hidden}, 256)")


@cli.group()
def data():
    """The shipped corpus and evaluation data."""


@data.command("show")
def data_show():
    """Describe the shipped corpus (after verifying its checksums)."""
    from zosoma.corpus import default_corpus_dir, describe, load_corpus
    from zosoma.model.evaluate import ngram_baselines
    corpora = {split: load_corpus(None, split=split) for split in ("train", "heldout")}
    for split, c in corpora.items():
        click.echo(f"{split}: {describe(c)}")
        for name, doc in zip(c.names, c.docs):
            click.echo(f"  {name:<14} {doc.size:>10,} bytes")
    base = ngram_baselines(corpora["train"], corpora["heldout"])
    click.echo(f"held-out nats/byte of byte n-gram models counted on train (add-one): unigram "
               f"{base['unigram']:.3f}, bigram {base['bigram']:.3f}; uniform 5.545")
    click.echo(f"location: {default_corpus_dir()} (licences in LICENSES/)")


@data.command("download")
@click.argument("name", type=click.Choice(["wikitext-103"]))
@click.option("--dest", type=click.Path(file_okay=False), help="Destination folder (default: ~/.cache/zosoma/wikitext-103).")
@click.option("--url", help="Archive URL or local path (default: the official wikitext-103-raw-v1.zip).")
@click.option("--train", "with_train", is_flag=True, help="Also extract wiki.train.raw (about 540 MB).")
def data_download(name, dest, url, with_train):
    """Download an evaluation data set and verify its sha256."""
    from zosoma.download import WIKITEXT103_URL, download_wikitext103
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, disable=None, file=sys.stderr) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)
        paths = download_wikitext103(dest, url=url or WIKITEXT103_URL, progress=progress, train=with_train)
    for p in paths.values():
        click.echo(f"ok {p}")


@cli.command()
@click.option("--data", multiple=True, type=click.Path(), help="Text to cluster (default: the shipped training corpus).")
@click.option("--experts", "-N", type=int, default=4, show_default=True, callback=_positive, help="N: number of clusters.")
@click.option("--chunk-size", type=int, default=2048, show_default=True, callback=_positive, help="Bytes per chunk (document).")
@click.option("--unbalanced", is_flag=True, help="Plain k-means instead of balanced cluster sizes.")
@click.option("--seed", type=int, default=0, show_default=True, callback=_nonneg)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the clustering (router) to this HDF5 file.")
def cluster(data, experts, chunk_size, unbalanced, seed, out):
    """Cluster the corpus as `train --experts N` does and print each cluster's size and mix of
    sources (domains for the shipped corpus) and the purity against them."""
    from zosoma.mixture.cluster import ClusterConfig, cluster_report, fit_clusters, format_report, purity, save_clustering
    from zosoma.corpus import chunk, load_corpus

    if out and Path(out).exists():
        raise click.ClickException(f"{out} exists; choose another --out")
    chunks = chunk(load_corpus(list(data) or None, split="train"), chunk_size)
    clustering, labels = fit_clusters(chunks, ClusterConfig(n_clusters=experts, balanced=not unbalanced, seed=seed))
    click.echo(f"{len(chunks):,} chunks of {chunk_size} bytes into {experts} clusters:")
    click.echo(format_report(cluster_report(labels, chunks.names, experts)))
    click.echo(f"purity against source names: {purity(labels, chunks.names):.3f}")
    if out:
        save_clustering(out, clustering)
        click.echo(f"wrote {out}")


@cli.command()
@click.argument("run", type=click.Path())
@click.option("--prompt", default="", help="Text to continue (its bytes as given, UTF-8 or not).")
@click.option("--bytes", "n_bytes", type=int, default=400, show_default=True, callback=_nonneg, help="Bytes to generate.")
@click.option("--temperature", type=float, default=0.8, show_default=True, callback=_nonneg_float, help="Sampling temperature applied to the mixture (0: greedy, the most likely byte).")
@click.option("--seed", type=int, default=0, show_default=True, callback=_nonneg)
@click.option("--top-k", type=int, default=2, show_default=True, callback=_positive, help="SOMA run: experts mixed.")
@click.option("--reroute-every", type=int, default=64, show_default=True, callback=_positive, help="SOMA run: generated bytes between routing decisions.")
@previous_option
@device_option
@click.pass_context
def sample(ctx, run, prompt, n_bytes, temperature, seed, top_k, reroute_every, previous, device):
    """Generate text from a run: a SOMA run's routed mixture, re-routing as the context grows, or
    a single model (its run folder or a checkpoint file)."""
    from zosoma.runs.folder import RunFolder
    from zosoma.runs.soma import load_ensemble
    from zosoma.runs.single import load_model
    from zosoma.mixture.sample import sample as generate

    ops = _ops(device)
    if RunFolder(run).is_soma:
        ensemble = load_ensemble(Path(run), top_k, fallback=previous)
    else:
        for name in ("top_k", "reroute_every"):
            if _given(ctx, name):
                raise click.UsageError(f"--{name.replace('_', '-')} is an option of SOMA runs; {run} is a single model")
        ensemble = load_model(run, fallback=previous)
    text = os.fsencode(prompt)  # the prompt's own bytes, UTF-8 or not (surrogateescape)
    out = generate(ensemble, text, n_bytes=n_bytes, temperature=temperature, seed=seed,
                   reroute_every=reroute_every, ops=ops)
    click.echo(text + out)  # bytes: written as they are, whatever the encoding


@cli.command()
@click.option("--trials", type=int, default=20000, show_default=True, callback=_positive, help="Monte-Carlo trials on the quadratic.")
@click.option("--block", type=int, default=64, show_default=True, callback=_positive, help="d: parameters per block of the quadratic.")
@click.option("--reps", type=int, default=256, show_default=True, callback=_positive, help="SPSA repetitions per LSTM expert.")
@click.option("--no-lstm", is_flag=True, help="Only the quadratic.")
@click.option("--seed", type=int, default=0, show_default=True, callback=_nonneg)
@device_option
def variance(trials, block, reps, no_lstm, seed, device):
    """Relative variance of the independent-loss vs shared-loss SPSA estimators for N = 1..16
    blocks of a separable quadratic, and for real LSTM experts at fixed weights, beside 1/N."""
    from zosoma.experiments.variance import format_table, lstm_variance, quadratic_variance

    records = quadratic_variance(d=block, trials=trials, seed=seed)
    if not no_lstm:
        records += lstm_variance(reps=reps, seed=seed, ops=_ops(device))
    click.echo(format_table(records))


@cli.group()
def bench():
    """Benchmarks that print throughput figures (not tests)."""


@bench.command("forward")
@click.option("--embed", type=int, default=512, show_default=True, callback=_positive)
@click.option("--hidden", type=int, default=512, show_default=True, callback=_positive)
@click.option("--layers", type=int, default=2, show_default=True, callback=_positive)
@click.option("--batch", type=int, default=64, show_default=True, callback=_positive)
@click.option("--seq-len", type=int, default=256, show_default=True, callback=_positive)
@click.option("--repeats", type=int, default=5, show_default=True, callback=_positive)
@click.option("--no-numpy", is_flag=True, help="Skip the slow NumPy reference.")
@click.option("--engine", type=click.Choice(ENGINES), default="native", show_default=True, help="onnxruntime: also time ONNX Runtime's forward (zosoma's training graph) beside Numba's.")
@click.option("--forward-precision", "precisions", multiple=True, type=click.Choice([p for p in PRECISIONS if p != "fp32"]), help="Also time the forward emulated in this format (repeat the option for several).")
@device_option
def bench_forward_cmd(embed, hidden, layers, batch, seq_len, repeats, no_numpy, engine, precisions, device):
    """Tokens/s of the NumPy reference, the Numba path and torch nn.LSTM (if installed) at one
    configuration, and the fraction of the matmul peak measured in the same run. With --device
    cuda: the CuPy forward and torch's cuDNN nn.LSTM on the GPU, beside the GPU's fp32 peak."""
    from zosoma.experiments.bench_forward import bench_forward, format_records
    from zosoma.engines import get_ops
    others = (get_ops("cpu", engine),) if engine != "native" else ()
    others += tuple(get_ops("cpu", precision=p) for p in dict.fromkeys(precisions))
    records = bench_forward(embed=embed, hidden=hidden, layers=layers, batch=batch, seq_len=seq_len,
                            repeats=repeats, include_numpy=not no_numpy, ops=_ops(device), others=others)
    click.echo(format_records(records))


@bench.command("spsa")
@click.option("--preset", type=click.Choice(["tiny", "small", "paper"]), default="paper", show_default=True)
@click.option("--perturbations", "-P", type=int, callback=_positive, help="Default: the preset's (tiny, small 32; paper 64).")
@click.option("--batch", type=int, callback=_positive, help="Default: the preset's (8).")
@click.option("--seq-len", type=int, callback=_positive, help="Default: the preset's (tiny 32; small, paper 128).")
@click.option("--steps", type=int, default=2, show_default=True, callback=_positive, help="Timed steps (after one warm-up step).")
@click.option("--noise", type=click.Choice(["rademacher", "gaussian"]), default="rademacher", show_default=True)
@click.option("--peers/--no-peers", default=True, show_default=True, help="Time the PyTorch peers (when torch is installed).")
@click.option("--forward-precision", "precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True, help="Time the step with its forwards emulated in this format (CPU), beside the fp32 step in the same run.")
@device_option
def bench_spsa_cmd(preset, perturbations, batch, seq_len, steps, noise, peers, precision, device):
    """SPSA step throughput split into data, forward passes, noise and the update, beside the same
    step written in PyTorch (a MeZO-style loop, a stacked population with bmm) and the fp32
    matmul peak, all in one run: tokens/s, nominal and executed GFLOP/s, share of the peak."""
    from zosoma.engines import get_ops
    from zosoma.experiments.bench_spsa import bench_spsa, format_spsa
    shape = dict(preset=preset, perturbations=perturbations, batch=batch, seq_len=seq_len, steps=steps, noise=noise)
    if precision == "fp32":
        click.echo(format_spsa(bench_spsa(**shape, ops=_ops(device), peers=peers)))
        return
    emulated_ops = get_ops(device, precision=precision)  # before any timing: a GPU device is a one-line error
    fp32 = bench_spsa(**shape, ops=_ops(device), peers=False)
    emulated = bench_spsa(**shape, ops=emulated_ops, peers=peers)
    click.echo(format_spsa(emulated))
    click.echo(f"{precision} step {emulated['step_s']:.4f} s, the fp32 step {fp32['step_s']:.4f} s in the same run: "
               f"{emulated['step_s'] / fp32['step_s']:.2f}x")


@bench.command("route")
@click.option("--small", "n_small", type=int, default=256, show_default=True, callback=_positive, help="Experts in the many-small configuration.")
@click.option("--large", "n_large", type=int, default=8, show_default=True, callback=_positive, help="Experts in the few-large configuration.")
@click.option("--top-k", type=int, default=4, show_default=True, callback=_positive)
@click.option("--total-params", type=int, default=2_000_000, show_default=True, callback=_positive, help="Total parameters of each ensemble.")
@click.option("--segments", type=int, default=1024, show_default=True, callback=_positive, help="Held-out segments routed per run.")
@click.option("--repeats", type=int, default=3, show_default=True, callback=_positive)
@device_option
def bench_route_cmd(n_small, n_large, top_k, total_params, segments, repeats, device):
    """Tokens/s of top-k routed inference (routing included) for N=8 vs N=256 experts of similar
    total size, random weights (the paper: 257k vs 2.36M tokens/s, 9.19x). With --device cuda the
    experts also run on the GPU, beside the CPU in the same run."""
    from zosoma.experiments.bench_route import bench_route, format_route
    devices = tuple(dict.fromkeys(("cpu", _ops(device).name)))  # the CPU, and the GPU when asked for
    click.echo(format_route(bench_route(n_small=n_small, n_large=n_large, top_k=top_k, total_params=total_params,
                                        n_segments=segments, repeats=repeats, devices=devices)))


@bench.command("eggroll")
@click.option("--embed", type=int, default=52, show_default=True, callback=_positive)
@click.option("--hidden", type=int, default=100, show_default=True, callback=_positive)
@click.option("--layers", type=int, default=1, show_default=True, callback=_positive)
@click.option("--batch", type=int, default=8, show_default=True, callback=_positive)
@click.option("--seq-len", type=int, default=32, show_default=True, callback=_positive)
@click.option("--pairs", type=int, default=64, show_default=True, callback=_positive, help="Antithetic pairs: 2x members.")
@click.option("--rank", type=int, default=1, show_default=True, callback=_positive)
@click.option("--repeats", type=int, default=3, show_default=True, callback=_positive)
@device_option
def bench_eggroll_cmd(embed, hidden, layers, batch, seq_len, pairs, rank, repeats, device):
    """Forward seconds per population member: EGGROLL's shared-GEMM low-rank population vs
    full-rank SPSA's dense perturbed copies, same model and batch (defaults: the CPU comparison's
    monolithic model)."""
    from zosoma.experiments.bench_eggroll import bench_eggroll, format_eggroll
    click.echo(format_eggroll([bench_eggroll(embed=embed, hidden=hidden, layers=layers, batch=batch, seq_len=seq_len,
                                             pairs=pairs, rank=rank, repeats=repeats, ops=_ops(device))]))

@bench.command("comm")
@click.option("--workers", "-W", type=int, default=8, show_default=True, callback=_positive, help="W: workers sharing one model (at most P).")
def bench_comm_cmd(workers):
    """Bytes exchanged per training step for each preset: SOMA's experts (none while training),
    one model's population sharded over W workers (its P scalars) and data-parallel backprop's
    gradient all-reduce (about 2 x 4d per worker), side by side."""
    from zosoma.experiments.bench_comm import bench_comm, format_comm
    click.echo(format_comm(bench_comm(workers)))


@bench.command("executors")
@click.option("--preset", type=click.Choice(["tiny", "small", "paper"]), default="tiny", show_default=True)
@click.option("--experts", type=int, default=2, show_default=True, callback=_positive, help="SOMA's N.")
@click.option("--steps", type=int, default=200, show_default=True, callback=_positive)
@click.option("--no-ray", is_flag=True, help="Leave Ray out.")
@click.option("--address", help="A Ray cluster to join (default: start Ray on this machine).")
def bench_executors_cmd(preset, experts, steps, no_ray, address):
    """Training time by where it runs: SOMA's experts inline, in local processes and as Ray tasks;
    one model's population here and over W = 1 and 2 workers (local processes, Ray actors)."""
    from zosoma.experiments.bench_executors import bench_executors, format_executors
    click.echo(format_executors(bench_executors(preset, experts, steps, not no_ray, address)))


@cli.command()
@click.argument("config")
@click.option("--out", type=click.Path(file_okay=False), help="Output folder (default: results/<config name>).")
@click.option("--jobs", type=int, callback=_positive, help="Runs trained at once, one process each (default: the machine's cores).")
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
    import os

    from zosoma.experiments.compare import (Stopped, check_folder, find_config, jobs as all_jobs, load_comparison,
                                            run_comparison, tuning_jobs)

    _check_executor_options(ctx, executor_kind, "--jobs", jobs)
    path = find_config(config)
    cmp = load_comparison(path)
    out = Path(out or Path("results") / path.stem)
    finished = check_folder(cmp, out)  # a folder another configuration left is refused, --plan or not
    if not plan:
        ops = _ops(device)
        device = ops.name
    click.echo(f"{cmp.title}\nbudget {cmp.flops:.3g} forward FLOPs per run; seeds {list(cmp.seeds)}; output {out}")
    click.echo(f"  {'method':<24}{'params':>10}{'P':>6}{'steps':>7}{'FLOPs/run':>11}")
    for m in cmp.methods + cmp.ablation:
        params = m.experts * m.model.n_params()
        click.echo(f"  {m.name:<24}{params:>10,}{m.train.perturbations:>6}{m.train.steps:>7}"
                   f"{m.flops_per_step() * m.train.steps:>11.3g}")
    sweep, todo = tuning_jobs(cmp, out), all_jobs(cmp, out)
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

    def report(job, result, error):
        name = Path(job.run_dir).name
        if error:
            click.echo(f"failed   {name}: {error}", err=True)
        elif "validation" in result:  # a tuning run
            click.echo(f"tuned    {name}: validation {result['validation']:.4f} nats/byte"
                       + (" (diverged)" if result.get("divergence") else "") + f", {result['wall_s']:.0f} s training")
        else:
            wiki = result["wikitext103"]
            click.echo(f"finished {name}: held-out {result['heldout']['overall']:.4f} nats/byte, WikiText-103 "
                       + (f"{wiki:.4f}" if wiki is not None else "n/a") + f", {result['wall_s']:.0f} s training"
                       + (" (diverged)" if result.get("divergence") else ""))

    stop = StopRequest()
    try:
        from zosoma.runs.placement import Placement, executor as units_executor

        placement = Placement(executor_kind, address=address, cpus_per_unit=cpus_per_unit, gpus_per_unit=gpus_per_unit)
        executor = units_executor(placement, len(todo), jobs or (1 if ops.on_device else os.cpu_count()))
        paths = run_comparison(cmp, out, executor, wikitext, device, should_stop=stop,
                               on_result=report)
    except Stopped as e:
        click.echo(str(e), err=True)
        sys.exit(stop.exit_code)
    for p in paths.values():
        click.echo(f"wrote {p}")


@cli.command("porting-kit")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--embed", type=int, default=16, show_default=True, callback=_positive, help="E of the kit's model.")
@click.option("--hidden", type=int, default=32, show_default=True, callback=_positive, help="H of the kit's model.")
@click.option("--layers", type=int, default=2, show_default=True, callback=_positive, help="L of the kit's model.")
@click.option("--seed", type=int, default=0, show_default=True, callback=_nonneg)
@click.option("--force", is_flag=True, help="Write into OUT if it exists: only the files an earlier kit wrote there (OUT/manifest.json lists them) are replaced; anything else in OUT is left alone, and a file of the user's with a name the kit uses stops it before anything changes.")
def porting_kit(out, embed, hidden, layers, seed, force):
    """Write the conformance vectors a port must reproduce, one .npz per stage (forward, losses,
    noise, one SPSA step, router) with manifest.json of tolerances, the kit's model as ONNX, and
    the standalone checker: python OUT/check_port.py OUT PORT_OUTPUTS/. PORTING.md is the
    specification."""
    from zosoma.config import ModelConfig
    from zosoma.porting.kit import write_kit

    manifest = write_kit(Path(out), ModelConfig(embed=embed, hidden=hidden, layers=layers), seed, force)
    click.echo(f"wrote {manifest.parent}/: manifest.json, forward/losses/noise/spsa_step/router.npz, model.onnx, "
               f"check_port.py\ncheck a port: python {manifest.parent / 'check_port.py'} {manifest.parent} PORT_OUTPUTS/")


@cli.command("precision-study")
@click.option("--out", type=click.Path(file_okay=False), default="results/precision-full", show_default=True, help="Output folder: runs/, results.md, results.csv, precision.png.")
@click.option("--steps", type=int, default=4000, show_default=True, callback=_positive, help="Training steps of every run (the default run length is 4000).")
@click.option("--formats", default=",".join(PRECISIONS), show_default=True, help="Forward number formats, comma-separated.")
@click.option("--multiples", default="0.25,1,4,16", show_default=True, help="Single model: eps as multiples of the format's step, comma-separated (the default eps 1e-3 is always run too).")
@click.option("--soma-multiples", default="0.25,1,4,16", show_default=True, help="SOMA: the same, or 'none' for the default eps only.")
@click.option("--experts", type=int, default=4, show_default=True, callback=_positive, help="SOMA's N.")
@click.option("--seed", type=int, default=0, show_default=True, callback=_nonneg)
@click.option("--jobs", type=int, callback=_positive, help="Runs trained at once, one process each (default: the machine's cores).")
@click.option("--plan", is_flag=True, help="Print the runs and exit.")
@click.option("--report", "report_only", is_flag=True, help="Write the report from the runs finished so far (naming the others) and exit; trains nothing.")
def precision_study(out, steps, formats, multiples, soma_multiples, experts, seed, jobs, plan, report_only):
    """What the forward's number format costs: held-out nats/byte of the default single model and
    of SOMA (tiny preset) trained with fp32, bf16, fp16 and int8 forwards, across eps measured in
    the format's step. Finished runs are never repeated; the same command resumes the others."""
    import os

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
        from zosoma.runs.folder import RunFolder

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

    stop = StopRequest()
    from zosoma.runs.placement import Placement, executor as units_executor

    paths = run_study(study, Path(out), units_executor(Placement(), len(todo), jobs), should_stop=stop,
                      on_result=report)
    if stop():
        click.echo("stopped; the same command resumes the unfinished runs", err=True)
        sys.exit(stop.exit_code)
    for p in paths.values():
        click.echo(f"wrote {p}")


def main():
    cli(prog_name="zosoma")


if __name__ == "__main__":
    main()
