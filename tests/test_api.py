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
