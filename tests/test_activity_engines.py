"""Activity perturbation on the forward-only engines (zosoma.engines.forward_only's hooks): the
emulated formats' noisy forward against their NumPy reference with the noise and against the fp32
CPU engine, the ONNX Runtime engine's losses and estimate against the CPU engine's, and short runs
of `--optimizer activity-onesided` on each engine against the CPU engine's."""

import json

import numpy as np
import pytest

from helpers import assert_close, run_cli
from zosoma.config import ModelConfig, TrainConfig
from zosoma.engines import get_ops
from zosoma.engines.cpu import noisy_forward
from zosoma.engines.emulated import precision_kernels, precision_reference
from zosoma.engines.ops import Ops
from zosoma.model import node_perturbation as npert
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population
from zosoma.strategies import make_strategy
from zosoma.strategies.onesided import one_sided

FORMATS = ("bf16", "fp16", "int8")
VARIANTS = ("activity", "activity-causal", "activity-local", "activity-local-causal", "activity-onesided")
PRESET = ModelConfig(embed=32, hidden=64, layers=1)  # the tiny preset's model
SMALL = ModelConfig(embed=5, hidden=4, layers=2)
# each format's error against fp32, about 3x the most measured over these tests' models, members
# and variants: a target's nats (bf16 0.0015, fp16 0.00017, int8 0.0074), and a step's estimate
# relative to its largest coordinate (bf16 0.0019, fp16 0.0003, int8 0.0094; cosines above 0.9999)
FORMAT_ATOL = {"bf16": 0.005, "fp16": 0.0006, "int8": 0.02}
ESTIMATE_ATOL = {"bf16": 0.006, "fp16": 0.001, "int8": 0.03}


def _setup(config, B, T, seed=1):
    layout = Layout(config)
    batch = np.random.default_rng(seed).integers(0, 256, (B, T + 1), dtype=np.uint8)
    return layout, init_params(config, seed), batch


def _noise(layout, B, T, J, readout):
    return noisy_forward.draw(layout, B, T, 11, 2, 7, range(J), "rademacher", readout)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config, B, T", [(PRESET, 8, 32), (SMALL, 3, 7)])
@pytest.mark.parametrize("readout", ["perturb", "local"])
def test_the_formats_noisy_forward_is_its_reference_and_near_fp32(fmt, config, B, T, readout):
    """The compiled noisy forward over M B rows (antithetic and one-sided members) against
    precision_reference.forward with each row's noise (the same arithmetic: the fp32 log-softmax's
    exp and the GEMMs' order differ) and against the fp32 CPU engine's within the format's error."""
    layout, theta, batch = _setup(config, B, T)
    Z = _noise(layout, B, T, 4, readout)
    pairs = Population(2, 0.05, 0, 0, 0)
    for pop in (pairs, one_sided(pairs)):
        got = precision_kernels.noisy_nats(theta, layout, batch, fmt, 0.05, Z, pop.direction, pop.sign)
        scaled = np.asarray(pop.sign, np.float32)[:, None, None, None] * np.float32(0.05)
        rows = np.tile(batch, (4, 1))
        logits, _ = precision_reference.forward(theta, layout, rows[:, :-1], fmt,
                                                noise=(Z[pop.direction] * scaled).reshape(4 * B, T, -1))
        want = precision_reference.nll(logits, rows[:, 1:]).reshape(4, B, T)
        assert_close(got, want, atol=2e-6, rtol=2e-6, name=f"{fmt} nats against the reference")
        fp32 = noisy_forward.member_losses(theta, layout, batch, 0.05, Z, pop.direction, pop.sign)
        assert_close(got, fp32, atol=FORMAT_ATOL[fmt], rtol=0, name=f"{fmt} nats against fp32")
        assert not np.array_equal(got, fp32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_noise_the_noisy_forward_is_the_formats_own_forward(fmt):
    """eps = 0: every member's nats are the engine's clean forward's, bit for bit, and the clean
    inputs the estimate reads are that forward's (their softmax gives its nats)."""
    layout, theta, batch = _setup(SMALL, 3, 9)
    Z = _noise(layout, 3, 9, 3, "perturb")
    own, _ = precision_kernels.nll_stream(theta, layout, batch[:, :-1], batch[:, 1:], fmt)
    got = precision_kernels.noisy_nats(theta, layout, batch, fmt, 0.0, Z, [0, 2, 1, 1], [1, -1, 1, -1])
    assert np.array_equal(got, np.broadcast_to(own, got.shape))
    ops = get_ops("cpu", "native", fmt)
    x0, hs, probs = ops.clean_inputs(theta, layout, batch, probs=True)
    assert [h.shape for h in hs] == [(3, 9, 4)] * 2 and x0.shape == (3, 9, 5)
    picked = np.take_along_axis(probs, batch[:, 1:, None].astype(np.intp), axis=-1)[..., 0]
    assert_close(-np.log(picked), own, atol=2e-6, rtol=2e-6, name="the clean forward's nats")


@pytest.mark.parametrize("engine", ["bf16", "fp16", "int8", "onnxruntime"])
@pytest.mark.parametrize("config", [PRESET, SMALL])
@pytest.mark.parametrize("name", VARIANTS)
def test_every_variants_step_on_a_forward_only_engine(engine, config, name):
    """One step of each variant: ONNX Runtime's losses within 1e-5 of the CPU engine's and its
    estimate within 1e-5 of the largest coordinate; an emulated format's losses and estimate (from
    the same scalars, with its own clean forward) within its error (FORMAT_ATOL, ESTIMATE_ATOL)."""
    if engine == "onnxruntime":
        pytest.importorskip("onnxruntime", reason="the ONNX Runtime engine is the onnx extra")
        ops = get_ops("cpu", "onnxruntime")
    else:
        ops = get_ops("cpu", "native", engine)
    B, T = (8, 32) if config is PRESET else (3, 7)
    layout, theta, batch = _setup(config, B, T)
    cfg = TrainConfig(optimizer=name, perturbations=4, batch=B, seq_len=T, eps=1e-2, shaping=(), warmup=0)
    strategy, cpu = make_strategy(cfg), Ops()
    pop = strategy.ask(1, 9)
    want = strategy.losses(cpu, theta, layout, batch, pop, {})
    got = strategy.losses(ops, theta, layout, batch, pop, {})
    coeffs, _ = strategy.coefficients(*want)
    ghat_cpu = cpu.activity_estimate(theta, layout, batch, coeffs, pop, strategy.readout, strategy.causal)
    ghat = ops.activity_estimate(theta, layout, batch, coeffs, pop, strategy.readout, strategy.causal)
    if engine == "onnxruntime":
        for g, w in zip(got, want):
            assert_close(g, w, rtol=1e-5, name=f"{name} losses")
        assert_close(ghat, ghat_cpu, atol=1e-5 * np.abs(ghat_cpu).max(), rtol=0, name=f"{name} ghat")
    else:
        for g, w in zip(got, want):
            assert_close(g, w, atol=FORMAT_ATOL[engine], rtol=0, name=f"{name} {engine} losses")
        assert_close(ghat, ghat_cpu, atol=ESTIMATE_ATOL[engine] * np.abs(ghat_cpu).max(), rtol=0,
                     name=f"{name} {engine} ghat")


def test_the_estimate_reads_the_formats_clean_forward():
    """The outer products of a forward-only engine are node_perturbation.outer_products of its own
    clean inputs (the format's h_t, not fp32's), theta's w_ih for the embedding's rows."""
    layout, theta, batch = _setup(SMALL, 3, 7)
    zeta = np.random.default_rng(2).standard_normal((3, 7, npert.width(layout, "local"))).astype(np.float32)
    ops = get_ops("cpu", "native", "int8")
    inputs = precision_reference.clean_inputs(theta, layout, batch, "int8", probs=True)
    inputs = (inputs[0].astype(np.float32), [h.astype(np.float32) for h in inputs[1]], inputs[2].astype(np.float32))
    want = npert.outer_products(theta, layout, batch, zeta, inputs)
    assert np.array_equal(ops.outer_products(theta, layout, batch, zeta), want)
    assert not np.allclose(want, npert.estimate(theta, layout, batch, zeta), atol=1e-4)


def _losses(run_dir):
    return np.array([json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.slow
def test_activity_onesided_trains_on_every_engine(tmp_path):
    """30 steps of `--optimizer activity-onesided` (E=8 H=16, P=4, B=4, T=16, its rate 1.0) on the
    CPU engine, on each emulated format from the command line and on ONNX Runtime from the Python
    API: every run learns (the last 5 steps' mean 0.3 nats below the first 5's). ONNX Runtime's
    per-step losses stay within 3e-4 of the CPU engine's (measured 9.4e-5). A format's rounding moves
    the weights apart step by step, and at this rate the curves part once the loss falls fast: the
    first 15 steps within 0.03 (bf16; measured 0.010), 0.015 (fp16; 0.0049), 0.08 (int8; 0.028),
    all 30 within 0.6 (bf16; 0.38), 0.05 (fp16; 0.018), 0.6 (int8; 0.19)."""
    import zosoma

    text = tmp_path / "t.txt"
    text.write_bytes(b"zero-order training needs nothing but forward passes. " * 400)
    args = ["train", "--optimizer", "activity-onesided", "--data", text, "--heldout", text, "--embed", "8",
            "--hidden", "16", "--steps", "30", "-P", "4", "--batch", "4", "--seq-len", "16", "--seed", "0"]
    result = run_cli([*args, "--run-dir", tmp_path / "cpu"])
    assert result.exit_code == 0, result.output
    cpu = _losses(tmp_path / "cpu")
    assert cpu[-5:].mean() < cpu[:5].mean() - 0.3
    for fmt, (first, every) in {"bf16": (0.03, 0.6), "fp16": (0.015, 0.05), "int8": (0.08, 0.6)}.items():
        result = run_cli([*args, "--forward-precision", fmt, "--run-dir", tmp_path / fmt])
        assert result.exit_code == 0, result.output
        losses = _losses(tmp_path / fmt)
        assert losses[-5:].mean() < losses[:5].mean() - 0.3, (fmt, losses)
        assert_close(losses[:15], cpu[:15], atol=first, rtol=0, name=f"{fmt}'s first 15 losses")
        assert_close(losses, cpu, atol=every, rtol=0, name=f"{fmt}'s losses")
    pytest.importorskip("onnxruntime", reason="the ONNX Runtime engine is the onnx extra")
    run = zosoma.train(data=text, heldout=text, optimizer="activity-onesided", engine="onnxruntime", embed=8,
                       hidden=16, steps=30, perturbations=4, batch=4, seq_len=16, seed=0,
                       run_dir=tmp_path / "onnxruntime")
    assert_close(_losses(run.path), cpu, atol=3e-4, rtol=0, name="onnxruntime's losses")
