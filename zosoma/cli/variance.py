"""zosoma variance: the independent- against the shared-loss SPSA estimator."""

from __future__ import annotations

import click

from zosoma.cli.options import device_ops, device_option, nonneg, positive


@click.command()
@click.option("--trials", type=int, default=20000, show_default=True, callback=positive, help="Monte-Carlo trials on the quadratic.")
@click.option("--block", type=int, default=64, show_default=True, callback=positive, help="d: parameters per block of the quadratic.")
@click.option("--reps", type=int, default=256, show_default=True, callback=positive, help="SPSA repetitions per LSTM expert.")
@click.option("--no-lstm", is_flag=True, help="Only the quadratic.")
@click.option("--seed", type=int, default=0, show_default=True, callback=nonneg)
@device_option
def variance(trials, block, reps, no_lstm, seed, device):
    """Relative variance of the independent-loss vs shared-loss SPSA estimators for N = 1..16
    blocks of a separable quadratic, and for real LSTM experts at fixed weights, beside 1/N."""
    from zosoma.experiments.variance import format_table, lstm_variance, quadratic_variance

    records = quadratic_variance(d=block, trials=trials, seed=seed)
    if not no_lstm:
        records += lstm_variance(reps=reps, seed=seed, ops=device_ops(device))
    click.echo(format_table(records))
