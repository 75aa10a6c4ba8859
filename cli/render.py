"""How the commands show training and evaluation: the records a run yields, rendered."""

from __future__ import annotations

import sys

import click

from zosoma.cli.stop import StopRequest


def training(records, stop: StopRequest) -> None:
    """Progress bars and lines for a run's records (zosoma.runs.records); the exit code and the
    line to continue with when it stopped or failed."""
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
            close(bars)
            click.echo(results(r.results))
            evaluated = True
    close(bars)
    for line in failed:
        click.echo(line, err=True)
    if failed:  # the failed experts keep their last checkpoint; the others were checkpointed
        click.echo(f"stopped: fix the cause above, then continue with: zosoma train --resume {run_dir}", err=True)
        sys.exit(1)
    if stopped or (stop() and not evaluated):  # a stop asked for: some unit may not have said so
        click.echo(f"stopped; checkpoints saved. Continue with: zosoma train --resume {run_dir}")
        sys.exit(stop.exit_code)


def close(bars):
    for bar in bars.values():
        bar.close()
    bars.clear()


def results(r) -> str:
    """A run's evaluation (zosoma.runs.single.evaluate_run, zosoma.runs.soma.evaluate_soma) as text."""
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
