"""One run object under every door (zosoma.runs.run.Run): `zosoma train`, zosoma.train and a
study's runs are checked by the same check_run, so a comparison refuses a run `zosoma train` would
refuse, in the same words, before anything trains (--plan too)."""

import pytest

import zosoma
from helpers import one_line_error, run_cli
from zosoma.errors import ConfigError

pytestmark = pytest.mark.usefixtures("scratch_cwd")

CONFIG = """title = "one bad run"
seeds = [0]
train = {{batch = 2, seq_len = 16}}

[[method]]
name = "SPSA P=2"
model = {{embed = 32, hidden = 64, layers = 1}}
train = {{perturbations = 2, lr = 0.05}}
steps = 2

[[method]]
name = "bad"
model = {{embed = 32, hidden = 64, layers = 1}}
train = {{{train}}}
steps = 2
"""

# (the bad method's TrainConfig fields, as TOML and as options) refused by a strategy's check of the model
BAD = [('optimizer = "eggroll", rank = 40', dict(optimizer="eggroll", rank=40)),
       ('optimizer = "sgd", perturbations = 1, probes = "blocks"',
        dict(optimizer="sgd", perturbations=1, probes="blocks"))]


@pytest.mark.parametrize("toml, options", BAD)
def test_a_comparison_refuses_a_run_as_train_does(tmp_path, toml, options):
    args = [f"--{k}={v}" for k, v in options.items()]
    said = one_line_error(run_cli(["train", *args, "--steps", "2", "--batch", "2", "--seq-len", "16",
                                   "--run-dir", tmp_path / "train"]))
    assert not (tmp_path / "train").exists()
    with pytest.raises(ConfigError) as api:
        zosoma.train(steps=2, batch=2, seq_len=16, run_dir=tmp_path / "api", **options)
    assert said == f"Error: {api.value}"
    config = tmp_path / "bad.toml"
    config.write_text(CONFIG.format(train=toml))
    for plan in (["--plan"], []):
        result = run_cli(["compare", config, "--out", tmp_path / "cmp", "--executor", "inline", *plan])
        assert one_line_error(result) == said
        assert not (tmp_path / "cmp" / "runs").exists()  # refused before anything trained


@pytest.mark.slow
def test_a_study_run_trains_the_bits_train_does(tmp_path):
    """Run.create then advance (a study's run, a step target at a time) and Run.start (`zosoma
    train`) are one run: the same spec gives the same parameters at the same step."""
    import numpy as np

    from zosoma.training.folder import RunFolder
    from zosoma.workers.placement import Placement
    from zosoma.training.shape import DataPaths
    from zosoma.runs.run import Run, Spec

    spec = Spec.resolve("tiny", dict(steps=4, batch=2, seq_len=16, perturbations=2, embed=8, hidden=16,
                                     checkpoint_every=2))
    list(Run.start(spec, DataPaths(), Placement(executor="inline"), tmp_path / "train"))
    study = Run.create(spec, tmp_path / "study")
    assert study.advance(2, lambda: False) and study.advance(4, lambda: False) and study.checkpoint_steps == [4]
    trained, studied = (RunFolder(tmp_path / d).read_checkpoint() for d in ("train", "study"))
    assert trained.step == studied.step == 4
    np.testing.assert_array_equal(trained.theta, studied.theta)


def test_device_auto_is_resolved_by_the_run_for_every_door(tmp_path):
    """--device auto is resolved where the engine is, in Run.start: the run folder records the
    device its engine runs on (here the CPU), whoever started it, and the command line prints
    which engine auto chose from the run's own engine."""
    from zosoma.training.folder import RunFolder
    from zosoma.workers.placement import Placement
    from zosoma.training.shape import DataPaths
    from zosoma.runs.run import Run, Spec

    spec = Spec.resolve("tiny", dict(steps=1, batch=2, seq_len=16, perturbations=2, embed=8, hidden=16))
    records = Run.start(spec, DataPaths(), Placement(executor="inline", device="auto"), tmp_path / "api")
    assert records.engine.device == "cpu"
    list(records)
    result = run_cli(["train", "--device", "auto", "--steps", "1", "--batch", "2", "--seq-len", "16", "-P", "2",
                      "--embed", "8", "--hidden", "16", "--run-dir", tmp_path / "cli", "--quiet"])
    assert result.exit_code == 0 and "--device auto: running on cpu (" in result.output
    for d in ("api", "cli"):
        assert RunFolder(tmp_path / d).read_placement(Placement).device == "cpu", d
