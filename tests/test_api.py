"""The Python API: the README's example runs as written, and ask/tell is the training step."""

import re
from pathlib import Path

import numpy as np
import pytest

import zosoma
from zosoma.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(r"## Python\n.*?```python\n(.*?)```", text, re.S)
    assert block, "README.md has a ## Python section with a ```python example"
    return block.group(1)


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_notes.txt").write_text("Some notes of my own, in plain text.\n" * 200)
    exec(compile(readme_example(), "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    single, routed = map(float, lines[0].split())
    assert 2.5 < routed < 5.5 and 2.5 < single < 5.5  # trained a little: below the uniform 5.545
    assert float(lines[1]) < 5.545
    assert np.allclose([float(x) for x in lines[-1].strip("[]").split()], [1.0, -2.0, 0.5], atol=0.05)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir())[0].startswith("tiny-")


def test_ask_and_tell_take_the_training_step(tmp_path):
    """Optimizer.tell is Trainer.update's arithmetic: on the same scalars it gives the same theta
    as the engine's update with the strategy's shaping."""
    from zosoma.engines.ops import Ops
    from zosoma.strategies import make_strategy
    from zosoma.strategies.base import learning_rate
    from zosoma.strategies.settings import resolve
    opt = zosoma.Optimizer(d=50, perturbations=4, eps=0.01, lr=0.1, optimizer="momentum", seed=3)
    theta = np.linspace(-1, 1, 50).astype(np.float32)
    members = opt.ask(theta, 0)
    assert members.shape == (8, 50) and np.allclose(members[0] + members[1], 2 * theta, atol=1e-6)
    losses = (members ** 2).sum(axis=1)
    new = opt.tell(theta, 0, losses)
    _, cfg = resolve(None, dict(perturbations=4, eps=0.01, lr=0.1, optimizer="momentum", seed=3))
    strategy = make_strategy(cfg)
    coeffs, _ = strategy.coefficients(losses[0::2], losses[1::2])
    coeffs, _, _ = strategy.shaping(coeffs, strategy.shaping.init())
    expected, _ = strategy.update(Ops(), None, theta, strategy.init(Ops(), 50), coeffs, strategy.ask(0, 0),
                                  learning_rate(0, cfg.lr, cfg.steps, cfg.warmup, cfg.schedule))
    np.testing.assert_array_equal(new, expected)
    with pytest.raises(ConfigError, match="tell needs 8 losses"):
        opt.tell(theta, 1, losses[:3])
    with pytest.raises(ConfigError, match="EGGROLL"):
        zosoma.Optimizer(d=3, optimizer="eggroll")


@pytest.mark.parametrize("d", [0, -3, 2.5, True, "4"])
def test_the_optimizer_refuses_a_size_that_is_not_a_count(d):
    with pytest.raises(ConfigError, match=f"d, the number of parameters, must be a positive integer, got {d!r}"):
        zosoma.Optimizer(d=d)


def test_a_step_with_a_non_finite_loss_is_skipped_out_loud():
    opt = zosoma.Optimizer(d=4, perturbations=2, eps=0.01, lr=0.1, optimizer="sgd")
    theta = np.ones(4, np.float32)
    from zosoma.api import SkippedStep
    with pytest.warns(SkippedStep, match=r"step 0 skipped: the losses of members \[2\] are not finite \(nan\)"):
        new = opt.tell(theta, 0, [1.0, 2.0, np.nan, 1.0])
    np.testing.assert_array_equal(new, theta)


def test_sample_takes_bytes_or_text_and_resume_steps_a_count(text, tmp_path, monkeypatch):
    """Run.sample('text') was a TypeError and sample(12) twelve NUL bytes; zosoma.train(resume=RUN,
    steps='300') a TypeError; sample --bytes 1e12 printed nothing for minutes."""
    from helpers import one_line_error, run_cli
    monkeypatch.chdir(tmp_path)
    run = zosoma.train(data=text, embed=8, hidden=16, batch=4, seq_len=16, perturbations=2, steps=2,
                       run_dir=tmp_path / "run")
    assert run.sample("river", n_bytes=5, seed=1) == run.sample(b"river", n_bytes=5, seed=1)
    with pytest.raises(ConfigError, match="prompt must be bytes or text, got 12"):
        run.sample(12)
    with pytest.raises(ConfigError, match="n_bytes must be at most 1,073,741,824 \\(1 GiB\\), got 1,000,000,000,000"):
        run.sample(b"", n_bytes=10**12)
    assert one_line_error(run_cli(["sample", run.path, "--bytes", "1000000000000"]), 2) == \
        "Error: n_bytes must be at most 1,073,741,824 (1 GiB), got 1,000,000,000,000"
    for steps, message in (("three", "steps must be an integer, got 'three'"),
                           (10**12, "steps must be at most 4,294,967,295 (a step is a 32-bit word of the noise "
                                    "counters), got 1,000,000,000,000")):
        with pytest.raises(ConfigError) as refused:
            zosoma.train(resume=run.path, steps=steps)
        assert str(refused.value) == message
        assert one_line_error(run_cli(["train", "--resume", run.path, "--steps", steps]), 2) == f"Error: {message}"
    with pytest.raises(ConfigError, match="steps must be an integer, got '300'"):  # text, where the CLI parses
        zosoma.train(resume=run.path, steps="300")
