"""--gemm fp32|tf32|bf16: the CUDA engine's GEMMs on tensor cores, chosen on the command line and
through get_ops; refused where the engine is not CUDA's; every forward of CudaOps in the format
(here on the emulated runtime of tests/test_kernels.py); a run's placement records it."""

import numpy as np
import pytest

from helpers import one_line_error, run_cli
from test_kernels import _bytes, _model, emulated_libs, rt  # noqa: F401  the CUDA engine's runtimes
from zosoma.engines import get_ops
from zosoma.engines.cuda import cuda_forward, cuda_ops, graph_forward
from zosoma.engines.cuda.tensor_cores import gemm_format
from zosoma.errors import ConfigError
from zosoma.model.population import Population
from zosoma.workers.placement import Placement


@pytest.mark.parametrize("args", [["train", "--steps", "1"], ["bench", "forward"], ["bench", "spsa", "--launches"],
                                  ["bench", "route"], ["eval", "no-such-run"]])
def test_the_cli_refuses_tensor_cores_on_the_cpu(args):
    line = one_line_error(run_cli(args + ["--gemm", "tf32"]))
    assert "--gemm tf32" in line and "--device cuda" in line


def test_get_ops_and_the_placement_refuse_what_the_cli_refuses():
    assert get_ops("cpu").gemm == "fp32"
    for kwargs in ({"device": "cpu"}, {"device": "cuda", "precision": "bf16"},
                   {"device": "cuda", "engine": "onnxruntime"}):
        with pytest.raises(ConfigError, match="--gemm bf16 .* needs --device cuda"):
            get_ops(gemm="bf16", **kwargs)
    with pytest.raises(ConfigError, match="gemm must be one of fp32, tf32, bf16"):
        get_ops("cuda", gemm="fp16")
    with pytest.raises(ConfigError, match="--gemm tf32 .* needs --device cuda"):
        Placement(gemm="tf32")
    assert Placement(device="cuda", gemm="tf32").describe() == "--device cuda --gemm tf32"
    assert Placement().replaced({"device": "cuda", "gemm": "bf16"}).gemm == "bf16"


@pytest.mark.parametrize("path", ["kernels", "graph"])
def test_every_step_of_the_engine_runs_its_gemms_in_the_format(rt, path):
    """CudaOps(gemm=...)'s SPSA losses are those of the forward under gemm_format, not fp32's; a
    graph captured in one format is not replayed in another."""
    theta, layout = _model(6, 10, 1, scale=1.0)
    batch = _bytes(2, (2, 7))
    pop = Population(3, 1e-2, 5, 0, 1)
    args = (theta, layout, batch, pop.P, pop.scale, pop.seed, pop.expert, pop.step, pop.kind)
    with cuda_forward.forced_path(path):
        fp32 = cuda_ops.CudaOps().perturbed_losses(theta, layout, batch, pop)
        got = cuda_ops.CudaOps(gemm="tf32").perturbed_losses(theta, layout, batch, pop)
        with gemm_format("tf32"):
            want = cuda_forward.spsa_losses(*args)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert np.abs(np.stack(got) - np.stack(fp32)).max() > 0
    if path == "graph":
        assert sorted(k[-1] for k in graph_forward._graphs[rt]) == ["fp32", "tf32"]
    tokens = batch[:, :-1]
    stream_32 = cuda_ops.CudaOps().nll_stream(theta, layout, tokens, batch[:, 1:])[0]
    stream_tf = cuda_ops.CudaOps(gemm="bf16").nll_stream(theta, layout, tokens, batch[:, 1:])[0]
    assert np.abs(stream_tf - stream_32).max() > 0
