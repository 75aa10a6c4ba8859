"""Training through an inference-only runtime (zosoma.engines.onnxruntime.onnxrt_ops) and the engine names a run
carries (engines.get_ops, TrainConfig.engine / forward_precision): the same seed takes the same
steps as the Numba engine within float tolerance, a resume keeps the run's engine, and an engine
that is not installed is one line."""

import sys

import numpy as np
import pytest

from helpers import assert_close, cli_json, one_line_error, run_cli as run
from world import TINY_MODEL_L2, tiny_args
from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler, load_corpus
from zosoma.engines import get_ops
from zosoma.errors import ConfigError
from zosoma.formats.checkpoint import load_checkpoint
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population
from zosoma.training.records import Step
from zosoma.runs.run import engine as run_engine
from zosoma.training.trainer import Trainer, new_state, train
from zosoma.workers.placement import Placement

pytest.importorskip("onnxruntime", reason="the ONNX Runtime engine is the onnx extra")


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, split="train")


def _train(corpus, tmp_path, model, cfg):
    trainer = Trainer(tmp_path, model, cfg, BatchSampler(corpus, cfg.seq_len + 1), new_state(model, cfg),
                      ops=run_engine(Placement(), cfg))  # the engine cfg names, as a run resolves it
    losses = [r.loss for r in train(trainer) if isinstance(r, Step)]
    return trainer, np.array(losses)


@pytest.mark.parametrize("optimizer", ["sgd", "eggroll"])
def test_first_steps_agree_with_the_numba_engine(corpus, tmp_path, optimizer):
    """The default tiny preset, same seed: ONNX Runtime (fed perturbed weights, reading back only
    losses) and the Numba engine take the same first steps within float32 rounding."""
    model = ModelConfig(embed=32, hidden=64, layers=1)
    extra = {"optimizer": "eggroll", "eps": 0.01, "lr": 1.0} if optimizer == "eggroll" else {"optimizer": "sgd"}
    runs = {}
    for engine in ("native", "onnxruntime"):
        cfg = TrainConfig(steps=4, engine=engine, checkpoint_every=100, **extra)
        runs[engine] = _train(corpus, tmp_path / engine, model, cfg)
    (native, native_losses), (ort, ort_losses) = runs["native"], runs["onnxruntime"]
    assert ort.ops.name == "onnxruntime" and native.ops.name == "cpu"
    assert_close(ort_losses, native_losses, rtol=1e-6, name="losses")
    assert_close(ort.theta, native.theta, atol=1e-5, rtol=0, name="theta after 4 steps")


def test_a_short_run_ends_where_the_numba_engines_does(corpus, tmp_path):
    """150 steps of a small model (the default-length comparison, 4,000 steps of the tiny preset, is
    in results/onnxruntime-train.txt): final losses and held-out nats within 0.01."""
    model = ModelConfig(embed=16, hidden=32, layers=1)
    ends = {}
    for engine in ("native", "onnxruntime"):
        cfg = TrainConfig(optimizer="sgd", steps=150, perturbations=8, batch=4, seq_len=16, lr=0.3, engine=engine, checkpoint_every=150)
        trainer, losses = _train(corpus, tmp_path / engine, model, cfg)
        ends[engine] = (losses[-20:].mean(), trainer)
    assert ends["native"][0] < 4.5  # it trained
    assert abs(ends["native"][0] - ends["onnxruntime"][0]) < 0.01
    held = load_corpus(None, split="heldout").docs[0][:20000]
    from zosoma.model.evaluate import evaluate_bytes
    scores = [evaluate_bytes(t.theta, t.layout, held, t.ops).nats_per_byte for _, t in ends.values()]
    assert abs(scores[0] - scores[1]) < 0.01


def test_streaming_nll_with_carried_state():
    layout = Layout(TINY_MODEL_L2)
    theta = init_params(layout.config, 3) * 2
    data = np.random.default_rng(0).integers(0, 256, (3, 30), dtype=np.uint8)
    ort, native = get_ops("cpu", "onnxruntime"), get_ops("cpu")
    got, state = ort.nll_stream(theta, layout, data[:, :12], data[:, 1:13])
    got2, _ = ort.nll_stream(theta, layout, data[:, 12:-1], data[:, 13:], state)
    want, _ = native.nll_stream(theta, layout, data[:, :-1], data[:, 1:])
    assert_close(np.concatenate([got, got2], 1), want, atol=2e-5, rtol=0, name="nll")
    pop = Population(3, 1e-3, 0, 1, 2, "gaussian")
    plus, minus = ort.perturbed_losses(theta, layout, data, pop)
    want = native.perturbed_losses(theta, layout, data, pop)
    assert_close(np.stack([plus, minus]), np.stack(want), rtol=1e-6, name="population")


def test_engine_names():
    assert get_ops("cpu", "native", "fp32") is not None and get_ops("cpu").name == "cpu"
    assert get_ops("cpu", precision="int8").name == "cpu-int8"
    native, placement = get_ops("cpu"), Placement()
    assert run_engine(placement) is native and run_engine(placement, TrainConfig(optimizer="sgd")) is native
    assert run_engine(placement, TrainConfig(optimizer="sgd", engine="onnxruntime")) is get_ops("cpu", "onnxruntime")
    for bad in (dict(engine="tensorrt"), dict(precision="fp8"), dict(engine="onnxruntime", precision="int8"),
                dict(device="cuda", precision="bf16")):
        with pytest.raises(ConfigError):
            get_ops(**{"device": "cpu", **bad})
    with pytest.raises(ConfigError, match="forward_precision must be one of"):
        TrainConfig(optimizer="sgd", forward_precision="fp8")


# --- the command line ------------------------------------------------------------------------------

TINY = tiny_args(2, 2, checkpoint_every=2)




@pytest.mark.slow
def test_train_records_its_engine_and_a_resume_keeps_it(text, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--data", str(text), "--heldout", str(text), "--run-dir", str(run_dir), *TINY]
    result = run(args + ["--steps", "2", "--engine", "onnxruntime"])
    assert result.exit_code == 0 and "device onnxruntime" in result.output, result.output
    ckpt = load_checkpoint(run_dir / "checkpoint.h5")
    assert ckpt.train.engine == "onnxruntime"
    assert "--engine" in one_line_error(run(["train", "--resume", str(run_dir), "--engine", "native"]))
    result = run(args[:-len(TINY)] + ["--steps", "2", "--forward-precision", "bf16", *TINY,
                                      "--run-dir", str(tmp_path / "bf16")])
    assert result.exit_code == 0 and "device cpu-bf16" in result.output, result.output
    assert load_checkpoint(tmp_path / "bf16" / "checkpoint.h5").train.forward_precision == "bf16"


def test_an_engine_that_is_not_installed_is_one_line(text, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now fails
    get_ops.cache_clear()
    try:
        result = run(["train", "--data", str(text), "--engine", "onnxruntime", "--run-dir", str(tmp_path / "r"),
                      "--steps", "2", *TINY])
        assert "pip install 'zosoma[onnx]'" in one_line_error(result)
        assert not (tmp_path / "r").exists()
        bench = run(["bench", "forward", "--engine", "onnxruntime", "--embed", "8", "--hidden", "8",
                     "--layers", "1", "--batch", "2", "--seq-len", "4", "--no-numpy"])
        assert "pip install 'zosoma[onnx]'" in one_line_error(bench)
    finally:
        get_ops.cache_clear()
    assert "engine onnxruntime runs fp32" in one_line_error(
        run(["train", "--data", str(text), "--engine", "onnxruntime", "--forward-precision", "int8",
             "--run-dir", str(tmp_path / "r2"), *TINY]))


@pytest.mark.slow
def test_bench_forward_reports_onnxruntime_beside_numba():
    bench = cli_json(["bench", "forward", "--engine", "onnxruntime", "--embed", "8", "--hidden", "8", "--layers", "1",
                      "--batch", "2", "--seq-len", "8", "--repeats", "1", "--no-numpy"], "bench-forward")
    timed = {r["name"] for r in bench["results"] if (r["tokens_per_s"] or 0) > 0}
    assert {"onnxruntime population_loss M=1", "cpu population_loss M=1"} <= timed
