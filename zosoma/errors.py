"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class ZosomaError(Exception):
    """Base class: bad input, missing or damaged files, impossible settings."""


class DataError(ZosomaError):
    """A corpus or text file is missing, unreadable, empty, too small or fails its checksum."""


class CheckpointError(ZosomaError):
    """A checkpoint is missing, truncated, corrupted, or of an unknown format or version."""


class ConfigError(ZosomaError):
    """Settings that cannot work together (for example a model too small for its data)."""


class WriteError(ZosomaError):
    """A file could not be written (full disk, read-only folder, no permission); what was there
    before is left as it was."""


class ClusterLost(ZosomaError):
    """The cluster that units of work ran on stopped answering (zosoma.workers.ray_executor): each unit
    keeps its newest checkpoint, and the run resumes where a cluster answers."""


class OptionError(ConfigError):
    """Options that cannot go together, refused before anything is written (zosoma.runs.run): the
    command line exits 2 for them, as for its own usage errors."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
