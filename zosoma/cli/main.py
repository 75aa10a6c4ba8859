"""The `zosoma` command line: parse, call the library, render. Nothing else lives here.

One module per command or group of commands (cli/train.py, cli/bench.py, ...); what several
share is in cli/options.py, how training is shown in cli/render.py, stop signals in cli/stop.py.
This module makes the group of them all: `zosoma = zosoma.cli.main:main`.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from zosoma.cli.bench import bench
from zosoma.cli.cluster import cluster
from zosoma.cli.compare import compare
from zosoma.cli.data import data
from zosoma.cli.evaluate import eval_
from zosoma.cli.export import export
from zosoma.cli.info import info
from zosoma.cli.porting_kit import porting_kit
from zosoma.cli.precision_study import precision_study
from zosoma.cli.sample import sample
from zosoma.cli.stop import abort
from zosoma.cli.train import train
from zosoma.cli.variance import variance
from zosoma.version import __version__


class ZosomaGroup(click.Group):
    """Turns the library's ZosomaError (bad input, damaged files) into one line and exit code 1."""

    def invoke(self, ctx):
        import warnings

        from zosoma.errors import ClusterLost, OptionError, ZosomaError
        warnings.showwarning = _warning_line
        signal.signal(signal.SIGTERM, abort)  # as Ctrl-C: cleanups run (training commands save first)
        try:
            return super().invoke(ctx)
        except ClusterLost as e:  # Ray's own shutdown at exit would wait for the lost cluster, then crash
            click.echo(f"Error: {e}", err=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # nothing is left to clean up: every file is written atomically
        except OptionError as e:  # options that cannot go together: a usage error, exit code 2
            raise click.UsageError(str(e)) from None
        except ZosomaError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt as e:  # a second stop signal, or Ctrl-C outside training
            click.echo("aborted", err=True)
            sys.exit(128 + getattr(e, "signum", signal.SIGINT))


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """The library's warnings (a damaged checkpoint passed over, ...) as one line on stderr."""
    click.echo(f"warning: {message}", err=True)


@click.group(cls=ZosomaGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="zosoma")
def cli():
    """Zero-order (forward-only) pretraining of byte-level LSTM language models with SPSA."""


for command in (train, eval_, info, export, data, cluster, sample, variance, bench, compare, porting_kit,
                precision_study):
    cli.add_command(command)


def main():
    cli(prog_name="zosoma")


if __name__ == "__main__":
    main()
