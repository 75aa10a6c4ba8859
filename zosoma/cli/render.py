"""How the commands show training and evaluation: the records a run yields, rendered."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import click

from zosoma.cli.stop import StopRequest


@dataclass(frozen=True)
class Logging:
    """How training shows progress: bars on a terminal; without one (a log file, nohup, SLURM)
    a plain line every `seconds` seconds or every `steps` steps; nothing with quiet."""
    seconds: float | None = 30.0
    steps: int | None = None
    quiet: bool = False

    @classmethod
    def parse(cls, every: str | None, quiet: bool) -> "Logging":
        """--log-every "30s" (seconds) or "500" (steps); --quiet."""
        if every is None:
            return cls(quiet=quiet)
        text = every.strip().lower()
        try:
            value = float(text[:-1]) if text.endswith("s") else int(text)
        except ValueError:
            raise click.BadParameter(f"{every!r}: give seconds as 30s or a number of steps as 500",
                                     param_hint="--log-every") from None
        if not value > 0 or not math.isfinite(value):
            raise click.BadParameter(f"{every!r} must be positive", param_hint="--log-every")
        return cls(value, None, quiet) if text.endswith("s") else cls(None, value, quiet)


@dataclass
class Lines:
    """Progress as plain lines: step/total, smoothed loss, tokens/s, ETA, restarts, per run (one
    summary line for SOMA's experts)."""
    logging: Logging
    total: int
    start: dict  # expert -> step it started this session at
    at: dict = field(default_factory=dict)  # expert -> its latest step
    loss: dict = field(default_factory=dict)  # expert -> smoothed loss (EMA, 0.98 as the guard's)
    tokens: dict = field(default_factory=dict)  # expert -> (forward tokens at its first record, latest)
    restarts: int = 0
    dropped: int = 0
    t0: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    last_step: int = 0

    def step(self, r) -> None:
        e, now = r.expert, time.monotonic()
        if not self.at:  # rates from the first step on: compiling the kernels is not training
            self.t0 = self.last = now
        if e not in self.at:
            self.start[e] = r.step
        prev = self.loss.get(e)
        if math.isfinite(r.loss):
            self.loss[e] = r.loss if prev is None else 0.98 * prev + 0.02 * r.loss
        self.at[e] = r.step
        self.tokens[e] = (self.tokens.get(e, (r.metrics["tokens"],))[0], r.metrics["tokens"])
        done = min(self.at.get(i, s) for i, s in self.start.items())
        due = (self.logging.steps and done - self.last_step >= self.logging.steps) or (
            self.logging.seconds and now - self.last >= self.logging.seconds)
        if due:
            self.last, self.last_step = now, done
            click.echo(self.line(now))

    def line(self, now: float) -> str:
        n = len(self.start)
        steps = [self.at.get(i, s) for i, s in self.start.items()]
        done = sum(s - self.start[i] for i, s in zip(self.start, steps))
        left = sum(self.total - s for s in steps)
        elapsed = now - self.t0
        eta = left * elapsed / done if done else float("nan")
        losses = list(self.loss.values())
        where = (f"step {steps[0]:,}/{self.total:,}" if n == 1 else
                 f"{n} experts at steps {min(steps):,}-{max(steps):,}/{self.total:,}")
        loss = (f"loss {losses[0]:.3f}" if n == 1 else f"loss {sum(losses) / len(losses):.3f} mean "
                f"({min(losses):.3f}-{max(losses):.3f})") if losses else "loss n/a"
        fate = (f", {self.restarts} restart(s)" if self.restarts else "") + (
            f", {self.dropped} dropped" if self.dropped else "")
        return (f"[{time.strftime('%H:%M:%S')}] {where} ({100 * sum(steps) / (n * self.total):.0f}%), "
                f"{loss} (smoothed), {sum(b - a for a, b in self.tokens.values()) / max(elapsed, 1e-9):,.0f} tok/s, ETA {_duration(eta)}{fate}")


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "n/a"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def training(records, stop: StopRequest, logging: Logging = Logging()) -> None:
    """Progress bars (on a terminal) or lines (logging) for a run's records
    (zosoma.training.records); the exit code and the line to continue with when it stopped or
    failed."""
    from tqdm import tqdm

    from zosoma.training.records import (Clusters, Continued, Diverged, Dropped, Evaluated, Evaluating, Failed, Note,
                                     Restarted, Started, Step, Stopped)

    bars, stopped, evaluated, failed, run_dir, lines = {}, False, False, [], "RUN", None
    gave_up = False  # a single model was dropped: a resume cannot help
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
            if lines is not None:
                lines.step(r)
        elif isinstance(r, Clusters):
            from zosoma.mixture.cluster import format_report
            click.echo(f"clustered {r.n_chunks:,} chunks of {r.chunk_size} bytes:")
            click.echo(format_report(r.report))
        elif isinstance(r, Started):
            m, t, n, run_dir = r.model, r.train, r.experts, r.run_dir
            stop.resume = f"zosoma train --resume {run_dir}"
            who = f"{n} experts x " if n > 1 else ""
            click.echo(f"run {r.run_dir}: {who}{r.n_params:,} parameters (E={m.embed} H={m.hidden} L={m.layers}), "
                       f"--optimizer {t.optimizer} P={t.perturbations} eps={t.eps} lr={t.lr:.6g}, "
                       f"B={t.batch} T={t.seq_len}, {t.steps} steps, seed {t.seed}"
                       + (f", shaping {'+'.join(t.shaping)}" if t.shaping else "")
                       + "".join(f", {name} {value}" for name, value in (
                           ("probes", t.probes), ("queries", t.queries), ("transforms", "+".join(t.transforms)))
                           if value not in ("iid", "constant", ""))
                       + (f", on divergence {t.on_divergence}" if t.on_divergence != "stop" else "")
                       + (f", {r.loss} losses" if n > 1 else "") + f", device {r.device}")
            click.echo(f"data: {r.data}")
            if r.resumed:
                click.echo(f"continuing at step {r.steps[0]:,} of {t.steps:,}" if n == 1 else
                           f"continuing: experts at steps {', '.join(f'{s:,}' for s in r.steps)} of {t.steps:,}")
            # bars on a terminal; lines without one, or when --log-every asks for them
            show_lines = not logging.quiet and (logging != Logging() or not sys.stderr.isatty())
            for i, done in enumerate(r.steps):
                bars[i] = tqdm(total=t.steps, initial=done, unit="step", dynamic_ncols=True, position=i,
                               desc=f"expert {i}" if n > 1 else "train", file=sys.stderr,
                               disable=True if logging.quiet or show_lines else None)
            lines = Lines(logging, t.steps, dict(enumerate(r.steps))) if show_lines else None
        elif isinstance(r, Restarted):
            bars[r.expert].n = r.to
            if lines is not None:
                lines.restarts += 1
            bars[r.expert].write(f"{'expert %d' % r.expert if len(bars) > 1 else 'the model'} restarted at step "
                                 f"{r.step} ({r.verdict}): rolled back to step {r.to}, lr x{r.lr_scale:g}, fresh "
                                 f"batches (the {r.step - r.to} steps it re-runs count against its {t.steps})")
        elif isinstance(r, Continued):
            who = f"expert {r.expert}" if len(bars) > 1 else "the model"
            bars[r.expert].write(f"{who} diverged at step {r.step} ({r.verdict}); --on-divergence continue: it "
                                 "trains on regardless, and its results say so")
        elif isinstance(r, Dropped):
            if lines is not None:
                lines.dropped += 1
            if len(bars) > 1:
                bars[r.expert].write(f"expert {r.expert} dropped at step {r.step} after {r.restarts} restart(s) "
                                     f"({r.verdict}): the others go on, and routing leaves it out")
            else:
                from zosoma.runs.single import after_drop
                failed.append(f"the model was dropped at step {r.step} after {r.restarts} restart(s) ({r.verdict}): "
                              f"{after_drop(run_dir)}")
                gave_up = True
        elif isinstance(r, Stopped):
            stopped = True
        elif isinstance(r, Failed):
            failed.append(f"expert {r.unit} failed: {r.error}")
        elif isinstance(r, Diverged):
            failed.append(f"expert {r.expert} diverged at step {r.step} ({r.verdict}); it stopped there, "
                          "checkpointed: lower --lr and start again, or --resume to go on regardless")
        elif isinstance(r, Note):
            (next(iter(bars.values())).write if bars else click.echo)(f"warning: {r.message}", file=sys.stderr)
        elif isinstance(r, Evaluating):  # training is saved: a stop need not wait for the evaluation
            stop.at_once(f"stopped before the final evaluation; training is finished and saved: zosoma train "
                         f"--resume {run_dir} evaluates it (or zosoma eval {run_dir})")
        elif isinstance(r, Evaluated):
            close(bars)
            click.echo(results(r.results, r.yardsticks))
            evaluated = True
    close(bars)
    for line in failed:
        click.echo(line, err=True)
    if failed:  # the failed experts keep their last checkpoint; the others were checkpointed
        if not gave_up:
            click.echo(f"stopped: fix the cause above, then continue with: zosoma train --resume {run_dir}", err=True)
        sys.exit(1)
    if stopped or (stop() and not evaluated):  # a stop asked for: some unit may not have said so
        click.echo(f"stopped; checkpoints saved. Continue with: zosoma train --resume {run_dir}")
        sys.exit(stop.exit_code)


def close(bars):
    for bar in bars.values():
        bar.close()
    bars.clear()


def results(r, yardsticks: dict | None = None, data: str | None = None) -> str:
    """A run's evaluation (zosoma.runs.single.evaluate_run, zosoma.runs.soma.evaluate_soma) as text,
    with the yardsticks measured on the same texts (zosoma.yardsticks.lookup) under it; `data`
    names the text scored when it is not the held-out slices (eval --data), and then no line says
    that WikiText-103 was not found: it was not asked for."""
    lines, scored = [], f"nats/byte on {data}" if data else "held-out nats/byte"
    if "tokens" in r:
        lines.append(f"compute: {r['tokens']:,} forward tokens, {r['flops']:.3g} forward FLOPs, "
                     f"{r['wall_s']:.0f} s training wall time" + (" (summed over experts)" if "top_k" in r else ""))
    heldout, wiki = r.get("heldout"), r.get("wikitext103")
    if heldout and isinstance(next(iter(heldout.values())), dict):  # SOMA: routed, experts, oracle
        cols = list(next(iter(heldout.values())))
        lines.append(f"{scored} (untrained: 5.545; top-{r['top_k']} routing, segments of "
                     f"{r['segment']} bytes after {r['context']} bytes of context; oracle peeks at the targets):")
        lines.append(f"  {'':<14}" + "".join(f"{c:>10}" for c in cols))
        rows = list(heldout.items()) + ([("WikiText-103", wiki)] if wiki else [])
        lines += [f"  {name:<14}" + "".join(f"{v[c]:>10.4f}" for c in cols) for name, v in rows]
        if r.get("dropped"):  # their columns are the weights training gave up on
            names = ", ".join(f"expert{i}" for i in r["dropped"])
            lines.append(f"dropped in training, so left out of routing: {names}")
    elif heldout:
        lines.append(f"{scored} (untrained: 5.545; {r.get('protocol', '')}):")
        lines += [f"  {name:<14} {v:.4f}" for name, v in heldout.items()]
        if wiki is not None:
            lines.append(f"WikiText-103 test nats/byte: {wiki:.4f}  ({r['wikitext103_path']})")
    if wiki is None and not data:
        lines.append("WikiText-103: not found (zosoma data download wikitext-103, or --wikitext PATH)")
    where = {"heldout": "held-out", "wikitext103": "WikiText-103"}
    lines += [yardstick_line(where[key], y) for key, y in (yardsticks or {}).items()]
    return "\n".join(lines)


def yardstick_line(where: str, y) -> str:
    """One line of a zosoma.yardsticks.Yardsticks' overall figures, for beside a model's."""
    from zosoma.yardsticks import label

    kn = [k for k in y.nats if k.startswith("kneser-ney-")]
    grams = ", ".join(f"{k.rsplit('-', 1)[1]}-gram {y.overall(k):.3f}" for k in kn)
    return (f"yardsticks, {where} (zosoma data yardsticks): Witten-Bell 3-gram {y.overall('witten-bell-3'):.3f}; "
            f"Kneser-Ney {grams}; best compressor {label(y.best_compressor)} {y.overall(y.best_compressor):.3f}")


def yardsticks_table(held, wiki=None) -> str:
    """zosoma data yardsticks: a row per domain, overall and WikiText-103; a column per yardstick."""
    from zosoma.yardsticks import label

    keys = list(held.nats)
    short = {k: label(k).replace("Witten-Bell ", "WB ").replace("Kneser-Ney ", "KN ") for k in keys}
    lines = [f"  {'':<14}" + "".join(f"{short[k]:>11}" for k in keys)]
    rows = [(name, {k: held.nats[k][name] for k in keys}) for name in held.nats[keys[0]]]
    if wiki is not None:
        rows.append(("WikiText-103", {k: wiki.overall(k) for k in keys}))
    lines += [f"  {name:<14}" + "".join(f"{v[k]:>11.3f}" for k in keys) for name, v in rows]
    lines.append("WB: Witten-Bell, KN: interpolated modified Kneser-Ney (Chen & Goodman 1998); a compressor's "
                 "segment costs 8 (len C(context + segment) - len C(context)) bits")
    return "\n".join(lines)
