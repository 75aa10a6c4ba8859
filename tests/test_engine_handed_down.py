"""The engine is handed down, never re-derived (docs/architecture.md): a run given a tagged engine
runs every forward on it, in a sharded run's workers and driver, in SOMA's experts and in the final
evaluation; a run resolves it in one place (zosoma.runs.run.engine), from its placement and its
configuration, a resume too; across a process boundary an engine travels as its record and is
rebuilt by get_ops (zosoma.engines.SendsEngine)."""

import pickle

import pytest

from world import TINY_MODEL as MODEL
from zosoma.config import TrainConfig
from zosoma.corpus import load_corpus
from zosoma.engines import get_ops
from zosoma.engines.emulated.precision_ops import PrecisionOps
from zosoma.engines.ops import Ops
from zosoma.training.records import Evaluated, Started
from zosoma.runs.single import start_run
from zosoma.runs.soma import ExpertUnit, start_soma
from zosoma.workers.executor import Inline
from zosoma.workers.population_workers import InProcess, ShardSpec, Sharding

CFG = TrainConfig(optimizer="sgd", steps=4, batch=2, seq_len=16, perturbations=4, lr=0.5, checkpoint_every=2)

# every Ops method that runs a model's forward
FORWARDS = ("population_loss", "perturbed_losses", "experts_perturbed_losses", "activity_losses",
            "nll_stream", "log_probs", "models_nll")

pytestmark = pytest.mark.usefixtures("scratch_cwd")


class Tagged(Ops):
    """The CPU engine under a name of its own: whatever runs on another engine shows up."""
    name = "tagged"


class TaggedBf16(PrecisionOps):
    """The bf16 engine under a name of its own."""

    def __init__(self):
        super().__init__("bf16")
        self.name = "tagged-bf16"


def tagged_engines(device="cpu", engine="native", precision="fp32", gemm="fp32"):
    """get_ops as zosoma.runs.run sees it here: the tagged engine, or for a forward precision the
    tagged bf16 one."""
    return Tagged() if (engine, precision) == ("native", "fp32") else TaggedBf16()


@pytest.fixture
def forwards(monkeypatch):
    """[(forward, the engine's class name)] of every forward any engine runs during the test."""
    seen = []
    for cls in (Ops, PrecisionOps):  # the bf16 engine's own forwards too
        for name in FORWARDS:
            if name in vars(cls):
                def spy(self, *args, _base=vars(cls)[name], _name=name, **kwargs):
                    seen.append((_name, type(self).__name__))
                    return _base(self, *args, **kwargs)
                monkeypatch.setattr(cls, name, spy)
    return seen


def check_all_tagged(records, forwards, engine=Tagged):
    started = next(r for r in records if isinstance(r, Started))
    assert started.device == engine().name  # the driver's engine is the run's, not a fallback
    assert any(isinstance(r, Evaluated) for r in records)
    assert {"perturbed_losses", "models_nll"} <= {f for f, _ in forwards}  # training and evaluation ran
    assert {e for _, e in forwards} == {engine.__name__}, sorted(set(forwards))


def test_a_sharded_run_runs_every_forward_on_its_engine(tmp_path, two_domains, forwards):
    paths = [str(two_domains / "prose.txt")]
    records = list(start_run(tmp_path / "w2", MODEL, CFG, paths, paths, ops=Tagged(),
                             sharding=Sharding(InProcess(), 2)))
    check_all_tagged(records, forwards)


@pytest.mark.parametrize("loss, workers", [("independent", None), ("summed", InProcess())])
def test_a_soma_run_runs_every_forward_on_its_engine(tmp_path, two_domains, forwards, loss, workers):
    paths = [str(two_domains / "prose.txt"), str(two_domains / "digits.txt")]
    records = list(start_soma(tmp_path / "soma", MODEL, CFG, 2, loss, Inline(), chunk_size=256, train_paths=paths,
                              heldout_paths=paths, ops=Tagged(), workers=workers))
    check_all_tagged(records, forwards)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_engine_crosses_a_process_boundary_as_its_record(two_domains, precision):
    """Sent to another process (pickled), a population worker's spec and an expert unit carry their
    engine as its record, rebuilt there by get_ops; in this process they hold the engine itself."""
    ops = get_ops("cpu", "native", precision)
    corpus = load_corpus([str(two_domains / "prose.txt")])
    for unit in (ShardSpec("run", corpus, 0, ops, range(2)), ExpertUnit("run", None, corpus, 1, Tagged())):
        sent = pickle.loads(pickle.dumps(unit))
        assert sent.ops is get_ops(unit.ops.device, unit.ops.engine, unit.ops.precision)
        assert (sent.run_dir, sent.expert, sent.corpus.docs[0].tobytes()) == (
            unit.run_dir, unit.expert, unit.corpus.docs[0].tobytes())


@pytest.mark.slow
def test_a_run_resolves_its_engine_in_one_place(tmp_path, two_domains, forwards, monkeypatch):
    """zosoma.runs.run.engine is where every door (Run.start, a resume, a study's job) turns the
    placement and the run's configuration into an engine: given tagged engines there, every forward
    of a SOMA run, its resume and a study's job goes through them; a run whose configuration names
    a forward precision trains on that engine, started and resumed (from its checkpoints'
    configuration, not the device's engine), single or SOMA, and a study's job trains on it too
    while it is scored on the device's fp32 engine."""
    from zosoma.experiments.study import JobRun
    from zosoma.runs import run
    from zosoma.training.folder import RunFolder
    from zosoma.training.shape import DataPaths
    from zosoma.workers.placement import Placement

    monkeypatch.setattr(run, "get_ops", tagged_engines)
    paths = [str(two_domains / "prose.txt"), str(two_domains / "digits.txt")]
    options = dict(optimizer="sgd", steps=4, batch=2, seq_len=16, perturbations=4, lr=0.5, checkpoint_every=2,
                   embed=8, hidden=16)
    bf16 = dict(options, forward_precision="bf16")
    for name, given, experts, engine in (("soma", options, 2, Tagged), ("soma-bf16", bf16, 2, TaggedBf16),
                                         ("single-bf16", bf16, 1, TaggedBf16)):
        spec = run.Spec.resolve("tiny", given, experts=experts, chunk_size=256 if experts > 1 else None)
        check_all_tagged(list(run.Run.start(spec, DataPaths(paths, paths), Placement(executor="inline"),
                                            tmp_path / name)), forwards, engine)
        forwards.clear()
        check_all_tagged(list(run.Run.open(tmp_path / name).resume(steps=6)), forwards, engine)
        forwards.clear()
    job = JobRun(RunFolder(tmp_path / "job"), run.Spec.resolve("tiny", bf16))  # a study's run
    assert job.advance(2, lambda: False) and job.step == 2
    assert job.run.ops.name == "tagged-bf16" and job.ops.name == "tagged"  # trained in bf16, scored in fp32
    assert {e for _, e in forwards} == {"TaggedBf16"}, sorted(set(forwards))
