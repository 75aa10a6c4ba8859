"""Tensor-core GEMMs (TF32, bf16) in the CUDA engine's population forward: the operands' rounding,
the engine under gemm_format on the emulated runtime against the CPU study's forward of the same
arithmetic, and the study of SPSA's loss differences (zosoma.experiments.gemm_precision)."""

import numpy as np
import pytest

from helpers import assert_close
from test_kernels import emulated_libs, rt  # noqa: F401  the CUDA engine's runtimes
from zosoma.config import ModelConfig
from zosoma.engines.cuda import cuda_ops
from zosoma.engines.cuda.tensor_cores import gemm_format, round_operand
from zosoma.errors import ConfigError
from zosoma.experiments import gemm_precision
from zosoma.model import reference
from zosoma.model.params import Layout, init_params


def test_operands_round_to_nearest_even_in_the_format():
    one = np.float32(1.0)
    for fmt, bits in (("tf32", 10), ("bf16", 7)):
        ulp = np.float32(2.0 ** -bits)
        big = np.finfo(np.float32).max  # rounds up past the largest finite value: inf
        x = np.array([one + ulp / 4, one + ulp / 2, one + 3 * ulp / 2, one + 0.75 * ulp, -(one + ulp / 4), big,
                      np.inf], np.float32)
        want = np.array([one, one, one + 2 * ulp, one + ulp, -one, np.inf, np.inf], np.float32)  # ties to even
        np.testing.assert_array_equal(round_operand(x, fmt), want)
        assert np.isnan(round_operand(np.array([np.nan], np.float32), fmt)).all()
        frac = round_operand(np.random.default_rng(0).standard_normal(1000).astype(np.float32), fmt).view(np.uint32)
        assert not (frac & np.uint32((1 << (23 - bits)) - 1)).any()  # no bits below the format's
    x = np.random.default_rng(1).standard_normal(10).astype(np.float32)
    np.testing.assert_array_equal(round_operand(x, "fp32"), x)
    with pytest.raises(ConfigError, match="gemm must be one of fp32, tf32, bf16"):
        round_operand(x, "fp16")


def test_the_study_forward_is_the_reference_with_fp32_gemms():
    layout = Layout(ModelConfig(embed=6, hidden=8, layers=2))
    theta = (init_params(layout.config, 3) * 3).astype(np.float32)
    batch = np.random.default_rng(2).integers(0, 256, (3, 12), dtype=np.uint8)
    want = reference.loss(theta.astype(np.float64), layout, batch)
    assert_close(gemm_precision.gemm_loss(theta, layout, batch, "fp32"), want, rtol=1e-6, name="fp32 GEMMs")
    for fmt in ("tf32", "bf16"):  # rounded operands move the loss, by about the format's precision
        err = abs(gemm_precision.gemm_loss(theta, layout, batch, fmt) - want) / want
        assert 0 < err < {"tf32": 1e-3, "bf16": 1e-2}[fmt], (fmt, err)


@pytest.mark.parametrize("fmt", ["tf32", "bf16"])
def test_the_engine_with_tensor_core_gemms_computes_what_the_study_does(rt, fmt):
    layout = Layout(ModelConfig(embed=6, hidden=8, layers=2))
    theta = (init_params(layout.config, 3) * 3).astype(np.float32)
    thetas = theta[None] + 0.05 * np.random.default_rng(4).standard_normal((3, theta.size)).astype(np.float32)
    batch = np.random.default_rng(5).integers(0, 256, (3, 12), dtype=np.uint8)
    got = cuda_ops.CudaOps(gemm=fmt).population_loss(thetas, layout, batch)
    want = [gemm_precision.gemm_loss(t, layout, batch, fmt) for t in thetas]
    assert_close(got, want, rtol=1e-6, name=f"{fmt} population_loss")
    fp32 = cuda_ops.CudaOps().population_loss(thetas, layout, batch)
    assert np.abs(got - fp32).max() > 1e-7  # the option changes the GEMMs, and only while asked
    if rt.xp is np:  # the emulated runtime's matmul rounds inside the context only
        x = np.float32([[1 + 2 ** -12]])
        with gemm_format(fmt):
            assert np.matmul(x, np.float32([[1.0]]))[0, 0] == 1.0
        assert np.matmul(x, np.float32([[1.0]]))[0, 0] == x[0, 0]
    with pytest.raises(ConfigError, match="gemm must be one of"):
        cuda_ops.CudaOps(gemm="int8")


def test_the_study_measures_the_error_of_loss_differences_in_format_steps():
    records = gemm_precision.study({"E=8 H=12": ModelConfig(embed=8, hidden=12, layers=1)}, formats=("bf16",),
                                   steps=(1, 64), P=4, B=2, T=8)
    assert [(r["format"], r["k"]) for r in records] == [("bf16", 1), ("bf16", 64), ("bf16", None)]
    one, many, default = records
    assert many["eps"] == pytest.approx(64 * one["eps"]) and default["eps"] == 1e-3
    assert one["error_fp32"] < 1e-3 and many["error_fp32"] < 1e-3  # fp32 GEMMs: the reference's differences
    assert many["error"] < one["error"]  # the signal grows with eps, the rounding error does not
    text = gemm_precision.format_study(records, P=4, B=2, T=8)
    assert "bf16" in text and "(64 st)" in text and "(default)" in text


@pytest.mark.slow
def test_gpu_check_measures_the_tensor_core_forward(rt):
    """studies/gpu_check.py's tensor-core part, at a small population on the runtime at hand: a
    timing row per format, and the loss error and CPU-emulation rows beside the validation."""
    import importlib.util

    from test_kernels import ROOT

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "studies" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    checks, rows = check.Checks(), []
    sync = (lambda: None) if rt.xp is np else rt.xp.cuda.runtime.deviceSynchronize
    check.tensor_cores(rt.xp, checks, rows, sync, M=2, B=1, T=3, P=1)
    assert [r[0] for r in rows] == [f"zosoma population_loss, M=2, {f} tensor-core GEMMs" for f in ("tf32", "bf16")]
    assert all(r[1] > 0 for r in rows)
    names = [c[0] for c in checks.rows]
    assert names[0] == "paper P=1 L+ - L- with tf32 GEMMs vs fp32, eps 16 tf32 steps" and len(names) == 4
    assert not checks.failed
    if rt.xp is np:  # the emulated runtime rounds as the CPU study does
        assert checks.rows[1][2] < 2e-5 and checks.rows[3][2] < 2e-5  # fp32 sums in another order (the paper shape's rtol, as gpu_check)
