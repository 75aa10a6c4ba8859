"""The package's version: one place, read by setup.cfg, checkpoints, porting kits and the CLI."""

__version__ = "0.1.0"
