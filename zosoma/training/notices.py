"""What reading a run folder says besides its contents: the warnings of a damaged file passed over
(CheckpointFallback, MetricsDamaged) or of a run read while it trains (StillTraining), and the
refusal of results a run trained past (StaleResults). Each is one line; zosoma.training.folder raises them."""

from zosoma.errors import ConfigError


class CheckpointFallback(UserWarning):
    """A damaged newest checkpoint was passed over for an older one (one line: which, why)."""


class MetricsDamaged(CheckpointFallback):
    """A run's metrics.jsonl does not hold the records its checkpoint counts (one line: why, and
    what was done)."""


class StillTraining(UserWarning):
    """A run is read while a live process trains it: what is read is its newest checkpoint so far
    (one line: who trains it, and the step)."""


class StaleResults(ConfigError):
    """A run's results are not of its newest checkpoint: it trained on after it was evaluated."""
