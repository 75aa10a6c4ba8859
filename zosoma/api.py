"""zosoma from Python: train, evaluate and sample runs, and zero-order steps on your own loss.

    import zosoma
    run = zosoma.train(steps=300, seed=0)                 # a single model, the tiny preset
    soma = zosoma.train(experts=2, steps=300, seed=0)     # SOMA: clusters, experts, router
    run.results["heldout"]["overall"], soma.evaluate()["heldout"]["overall"]["routed"]
    soma.sample(b"And the LORD said", n_bytes=80)

    opt = zosoma.Optimizer(d=3, lr=0.05, eps=0.01)       # SPSA's ask/tell on any loss
    members = opt.ask(theta, step)                        # (2P, d) perturbed parameters
    theta = opt.tell(theta, step, losses)                 # one loss per member

Every call goes through the library the command line uses (options resolved by
zosoma.strategies.settings.resolve, runs in zosoma.training), so a run trained here is a run folder
that `zosoma eval`, `info`, `train --resume` and TensorBoard read like any other.
"""

from __future__ import annotations

import numbers
import warnings
from pathlib import Path

import numpy as np

from zosoma.corpus import load_corpus
from zosoma.errors import ConfigError
from zosoma.model.protocol import PROTOCOL
from zosoma.training.folder import RunFolder

__all__ = ["Optimizer", "RunHandle", "SkippedStep", "load_corpus", "open_run", "train"]


def train(data=None, heldout=None, experts: int | None = None, preset: str | None = None, run_dir=None,
          loss: str | None = None, top_k: int | None = None, chunk_size: int | None = None, wikitext=None, resume=None,
          **options) -> "RunHandle":
    """Train a run as `zosoma train` does and return it (its evaluation in RunHandle.results), refusing
    what the command line refuses (zosoma.runs.run: a ConfigError in one line, before any folder
    is made). `data` and `heldout`: paths (default: the shipped corpus); `experts` 1 and `preset`
    "tiny" unless given; `options`: any TrainConfig or model field (steps, lr, perturbations,
    shaping, embed, ...); loss, top_k and chunk_size are SOMA's (experts 2 or more). `resume`: a
    run folder to train on where it stopped, with `steps` (extending it) and `wikitext` alone: any
    other keyword is refused by name. The experts of a SOMA run train one after another in this
    process. A run whose guard stopped it, or that failed, raises ConfigError."""
    from zosoma.workers.placement import Placement
    from zosoma.runs.run import Run, Spec, check_resume
    from zosoma.training.shape import DataPaths

    if resume is not None:
        named = dict(data=data, heldout=heldout, run_dir=run_dir, experts=experts, loss=loss, preset=preset,
                     chunk_size=chunk_size, top_k=top_k)
        check_resume([*options, *(k for k, v in named.items() if v is not None)])
        run = Run.open(resume)
        return _trained(run.resume(options.get("steps"), wikitext), run.is_soma)
    spec = Spec.resolve("tiny" if preset is None else preset, options, 1 if experts is None else experts, loss, top_k,
                        chunk_size)
    training = Run.start(spec, DataPaths(data, heldout, wikitext), Placement(executor="inline"), run_dir)
    return _trained(training, spec.is_soma)


def _trained(training, soma: bool) -> "RunHandle":
    """The run once its records end in an evaluation; ConfigError for a run that failed, diverged
    or stopped first."""
    from zosoma.training.records import Diverged, Dropped, Evaluated, Failed

    for r in training:
        if isinstance(r, Failed):
            raise ConfigError(f"{training.path}: expert {r.unit} failed: {r.error}")
        if isinstance(r, Diverged) or (isinstance(r, Dropped) and not soma):
            raise ConfigError(f"{training.path}: diverged at step {r.step} ({r.verdict})")
        if isinstance(r, Evaluated):
            return RunHandle(training.path)
    raise ConfigError(f"{training.path}: training ended without an evaluation")


def open_run(path) -> "RunHandle":
    """A run folder (a single model or a SOMA run) written by zosoma."""
    if not RunFolder(path).holds_run:
        raise ConfigError(f"{path}: not a zosoma run folder")
    return RunHandle(Path(path))


def _paths(x) -> list:
    return [] if x is None else [x] if isinstance(x, (str, Path)) else list(x)


class RunHandle:
    """What zosoma.train and zosoma.open_run return: a run folder's results, and what can be done
    with its model, for a Python user; it opens the run (zosoma.runs.run.Run) to do it."""

    def __init__(self, path):
        self.path, self.folder = Path(path), RunFolder(path)

    @property
    def handle(self):
        """The run (zosoma.runs.run.Run): a single model or a SOMA run, one interface."""
        from zosoma.runs.run import Run
        return Run.open(self.path)

    def __repr__(self) -> str:
        return f"RunHandle({str(self.path)!r})"

    @property
    def is_soma(self) -> bool:
        return self.handle.is_soma

    @property
    def results(self) -> dict | None:
        """The final evaluation, as results.json holds it (None before the run finished); a
        results.json the run has trained past since (an extension stopped part way) raises
        StaleResults instead of answering with old figures: evaluate() scores the checkpoint."""
        return self.folder.current_results()

    @property
    def trained_by(self) -> str | None:
        """'pid N on HOST' of the live process training this run now, or None. While it trains,
        model(), evaluate() and sample() use its newest checkpoint so far (checkpoint_steps), and
        say so in a StillTraining warning."""
        return self.folder.trained_by()

    @property
    def checkpoint_steps(self) -> list[int]:
        """The step of each model's newest checkpoint: one for a single model, one per expert."""
        return [c.step for c in self.folder.newest_checkpoints() or ()]

    def model(self, top_k: int = PROTOCOL.top_k):
        """The run's model as a routed ensemble (zosoma.mixture.routing.Ensemble; one expert for
        a single model)."""
        return self.handle.ensemble(top_k)

    def evaluate(self, data=None, wikitext=None, top_k: int | None = None, temperature: float | None = None,
                 segment: int | None = None, context: int | None = None, streams: int | None = None) -> dict:
        """Nats/byte on `data` (paths; default the shipped held-out slices) and WikiText-103, by
        the protocol of every table unless segment and context are given (`zosoma eval`'s result
        and options: top_k and the routing temperature for SOMA runs, streams for single models,
        refused for the other kind in its words, zosoma.runs.run_options)."""
        from zosoma.download import check_wikitext103
        from zosoma.runs.run_options import eval_options
        handle = self.handle
        checked = eval_options(handle, streams, top_k, temperature, segment, context)
        corpus = load_corpus(_paths(data) or None, split="heldout")
        wikitext = check_wikitext103(wikitext)  # a file not the official one: a NotOfficial warning, as train gives
        return handle.evaluate(corpus, wikitext, **checked)

    def sample(self, prompt: bytes = b"", n_bytes: int = 200, temperature: float = 0.8, seed: int = 0,
               top_k: int | None = None, reroute_every: int | None = None) -> bytes:
        """Bytes generated after `prompt` (bytes, or text read as UTF-8; temperature 0: greedy);
        top_k and reroute_every are SOMA runs' (`zosoma sample`'s options, checked as it checks them)."""
        from zosoma.mixture.sample import prompt_bytes, sample
        from zosoma.runs.run_options import sample_options
        handle = self.handle
        top_k, reroute_every = sample_options(handle, n_bytes, temperature, seed, top_k, reroute_every)
        return sample(handle.ensemble(top_k), prompt_bytes(prompt), n_bytes=n_bytes, temperature=temperature,
                      seed=seed, reroute_every=reroute_every)


class SkippedStep(UserWarning):
    """Optimizer.tell skipped a step: a member's loss was not finite (one line: which)."""


class Optimizer:
    """A zosoma strategy's ask/tell on your own loss over a flat float32 vector of d parameters:
    the same estimator, shaping and update rule as training (by default one-sided SPSA, the
    default run's estimator before activity perturbation, which needs a model's pre-activations,
    as EGGROLL's perturbations need an LSTM's matrices; optimizer sgd, the paper's, momentum, adam
    or es). Options: TrainConfig fields (perturbations, eps, lr, schedule, warmup,
    steps (the schedule's length), shaping, seed, ...), resolved as a run's."""

    def __init__(self, d: int, **options):
        from zosoma.engines.ops import Ops
        from zosoma.strategies import make_strategy
        from zosoma.strategies.settings import VECTOR_OPTIMIZER, resolve

        if options.get("optimizer") == "eggroll":
            raise ConfigError("EGGROLL perturbs an LSTM's matrices at low rank: use sgd, momentum, adam or es here")
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise ConfigError(f"d, the number of parameters, must be a positive integer, got {d!r}")
        _, self.cfg = resolve(None, {"optimizer": VECTOR_OPTIMIZER, **options})
        self.d, self.ops = int(d), Ops()
        self.strategy = make_strategy(self.cfg)
        self.strategy.check(None)  # no model's layout here: --probes blocks is refused
        self.state = self.strategy.init(self.ops, self.d)
        self.shaping = self.strategy.shaping.init()

    def ask(self, theta, step: int) -> np.ndarray:
        """(2P, d) float32: rows 2k and 2k+1 are theta + eps delta_k and theta - eps delta_k, the
        step's members (regenerated from (seed, step, k), never stored; one-sided SPSA's along
        delta_2k and delta_2k+1); a probe design's members are the strategy's own (Strategy.members)."""
        from zosoma.engines.ops import perturbed
        pop = self.strategy.ask(0, step)
        if not self.strategy.host_members:
            return perturbed(self._theta(theta), pop, range(pop.P))
        return self.strategy.members(self._theta(theta), None, pop, self.state)

    def tell(self, theta, step: int, losses) -> np.ndarray:
        """The parameters after the step, from one loss per member of ask(theta, step); a step with
        a loss that is not finite is skipped, as training skips it (theta and the state unchanged),
        with a SkippedStep warning naming the members."""
        losses = np.asarray(losses, np.float64).reshape(-1)
        P = self.strategy.pairs(step)
        if losses.size != 2 * P:
            raise ConfigError(f"tell needs {2 * P} losses (one per member), got {losses.size}")
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            warnings.warn(f"step {step} skipped: the losses of members {bad.tolist()} are not finite "
                          f"({losses[bad[0]]}); theta is unchanged", SkippedStep, stacklevel=2)
        coeffs, _ = self.strategy.coefficients(losses[0::2], losses[1::2])
        told = self.strategy.tell(self.ops, None, self._theta(theta), self.state, self.shaping, coeffs,
                                  self.strategy.ask(0, step))  # the training loop's step (Strategy.tell)
        self.state, self.shaping = told.optimizer, told.shaping
        return told.theta

    def _theta(self, theta) -> np.ndarray:
        theta = np.ascontiguousarray(theta, np.float32).reshape(-1)
        if theta.size != self.d:
            raise ConfigError(f"theta has {theta.size} values, the optimizer {self.d}")
        return theta
