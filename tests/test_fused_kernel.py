"""The small-expert fused forward (kernels/fused.cu, zosoma.engines.cuda.fused_forward): one block
per member, its weights built from the Philox counters in shared memory, the whole forward inside.

Run on the emulated runtime of test_kernels.py (block barriers as fibers: emulate.h) and, where
there is a GPU, on CuPy. Against the float64 NumPy reference and the CPU engine within LOSS_RTOL
(the fused kernel sums in another order than Numba or cuBLAS); bitwise where the arithmetic is the
same: a member built from its counters inside the kernel against the same member materialised by
the perturb kernel, and N experts in one launch against N launches.
"""

import numpy as np
import pytest

from test_kernels import LOSS_RTOL, _bytes, _model, _population, emulated_libs, rt  # noqa: F401 (fixtures)
from helpers import assert_close
from zosoma.arrays import to_numpy
from zosoma.config import ModelConfig
from zosoma.engines.cpu import forward
from zosoma.engines.cuda import cuda_forward, cuda_noise, custom_kernels, fused_forward
from zosoma.engines.ops import Ops
from zosoma.model import reference
from zosoma.model.params import Layout
from zosoma.model.population import Population
from zosoma.strategies.onesided import one_sided


@pytest.mark.parametrize("embed, hidden, layers, B, T", [(8, 16, 1, 3, 5), (12, 8, 2, 2, 13), (6, 10, 3, 1, 7)])
@pytest.mark.parametrize("per_member_batch", [False, True])
def test_fused_population_loss_matches_reference(rt, embed, hidden, layers, B, T, per_member_batch):
    theta, layout = _model(embed, hidden, layers)
    M = 4
    thetas = _population(theta, M)
    batch = _bytes(1, (M, B, T + 1) if per_member_batch else (B, T + 1))
    got = fused_forward.population_loss(thetas, layout, batch)
    assert got.shape == (M,) and got.dtype == np.float64
    want = [reference.loss(thetas[m].astype(np.float64), layout, batch[m] if per_member_batch else batch)
            for m in range(M)]
    assert_close(got, want, rtol=LOSS_RTOL, name="fused population loss")
    assert_close(got, forward.population_loss(thetas, layout, batch), rtol=LOSS_RTOL, name="vs numba")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("onesided", [False, True])
def test_fused_members_are_the_perturbed_population(rt, kind, onesided):
    """The kernel's members, built from the counters in shared memory, are bit for bit the perturb
    kernel's population: their losses equal those of the materialised members run through the
    same kernel with sign 0. And the losses match the CPU engine's step."""
    theta, layout = _model(8, 12, 1, scale=1.0)
    batch = _bytes(4, (3, 9))
    pop = Population(5, 1e-2, 2**40 + 7, 3, 2, kind)
    pop = one_sided(pop) if onesided else pop
    pairs = range(1, 5)
    plus, minus = fused_forward.spsa_losses(theta, layout, batch, pop, pairs)
    members = cuda_noise.perturbed(theta, pop.scale, pairs, pop.seed, pop.expert, pop.step, kind,
                                   table=(pop.direction[pop.rows(pairs)], pop.sign[pop.rows(pairs)]))
    materialised = fused_forward.population_loss(members, layout, batch)
    np.testing.assert_array_equal(plus, materialised[0::2])
    np.testing.assert_array_equal(minus, materialised[1::2])
    want = Ops().perturbed_losses(theta, layout, batch, pop, pairs)
    assert_close(plus, want[0], rtol=LOSS_RTOL, name="plus vs cpu")
    assert_close(minus, want[1], rtol=LOSS_RTOL, name="minus vs cpu")


def test_experts_in_one_launch_equal_separate_launches(rt, monkeypatch):
    """N experts' steps (each its own theta, batch, seed, expert id, step and eps) in ONE launch
    give the bits of N launches of one expert each."""
    theta, layout = _model(8, 12, 1, scale=1.0)
    N, B, T = 3, 2, 6
    thetas = _population(theta, N, seed=5)
    batches = _bytes(6, (N, B, T + 1))
    pops = [Population(2 + n, 1e-2 * (n + 1), 11 * n, n, 5 - n, "rademacher") for n in range(N)]
    pops[1] = one_sided(pops[1])
    launches = []
    real = custom_kernels.launch_blocks
    monkeypatch.setattr(custom_kernels, "launch_blocks", lambda *a: launches.append(a[0]) or real(*a))
    together = fused_forward.experts_losses(thetas, layout, batches, pops)
    assert launches == ["fused_population_loss"]
    for n, pop in enumerate(pops):
        alone = fused_forward.spsa_losses(thetas[n], layout, batches[n], pop)
        for a, b in zip(together[n], alone):
            assert a.shape == (pop.P,)
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="one noise kind"):
        fused_forward.experts_losses(thetas[:2], layout, batches[:2],
                                     [pops[0], Population(2, 1e-2, 0, 0, 0, "gaussian")])


def test_fused_member_table_is_checked(rt):
    theta, layout = _model(8, 12, 1)
    members = fused_forward.population_members(Population(2, 1e-2, 0, 0, 0), range(2), expert=1)
    with pytest.raises(ValueError, match="names experts outside"):
        fused_forward.member_losses(theta[None], layout, _bytes(0, (1, 2, 5)), members,
                                    np.zeros((1, 4), np.uint32), np.ones(1, np.float32), "rademacher")
    with pytest.raises(ValueError, match="batches"):
        fused_forward.population_loss(theta[None], layout, _bytes(0, (2, 1)))
    with pytest.raises(ValueError, match="thetas must be"):
        fused_forward.population_loss(theta, layout, _bytes(0, (2, 5)))


def test_which_models_fit_shared_memory(rt):
    """docs/gpu.md's limit: at B = 8, SOMA's expert sizes fit a 227 KB block, the paper's does not."""
    def kb(E, H, B=8, L=1):
        return fused_forward.shared_bytes(Layout(ModelConfig(embed=E, hidden=H, layers=L)), B) / 1024
    assert 60 < kb(16, 20) < 64 and kb(32, 64) < 227 < kb(32, 64, B=16)
    assert fused_forward.fits(Layout(ModelConfig(embed=16, hidden=20, layers=1)), 8)
    assert not fused_forward.fits(Layout(ModelConfig(embed=508, hidden=496, layers=2)), 8)


def test_the_engine_step_takes_the_fused_path_where_it_fits(rt, monkeypatch):
    """cuda_forward.spsa_losses (the CUDA engine's SPSA step) runs a small model's population as one
    fused launch, and the per-timestep kernels otherwise or when forced; both agree."""
    theta, layout = _model(8, 12, 1, scale=1.0)
    batch = _bytes(4, (3, 9))
    names = []
    real = custom_kernels.launch, custom_kernels.launch_blocks
    monkeypatch.setattr(custom_kernels, "launch", lambda *a, **k: names.append(a[0]) or real[0](*a, **k))
    monkeypatch.setattr(custom_kernels, "launch_blocks", lambda *a: names.append(a[0]) or real[1](*a))
    fused = cuda_forward.spsa_losses(theta, layout, batch, 4, 1e-2, 7, 1, 2, "rademacher")
    assert names == ["fused_population_loss"]
    names.clear()
    with cuda_forward.forced_path("kernels"):
        kernels = cuda_forward.spsa_losses(theta, layout, batch, 4, 1e-2, 7, 1, 2, "rademacher")
    assert "fused_population_loss" not in names and names.count("lstm_cell_embed") == 8
    for a, b in zip(fused, kernels):
        assert_close(a, b, rtol=LOSS_RTOL, name="fused vs kernels")
    with pytest.raises(ValueError, match="path must be one of"):
        with cuda_forward.forced_path("graph?"):
            pass


def test_experts_update_in_one_launch_equals_separate_updates(rt):
    """N experts' fused ZO-SGD updates (each its own counters, coefficients, rate and weight decay)
    in one launch give the bits of N spsa_update launches, in place too."""
    theta, layout = _model(8, 12, 1, scale=1.0)
    N = 3
    thetas = _population(theta, N, seed=7)
    pops = [Population(4, 1e-2, 11 * n, n, 5 - n, "gaussian") for n in range(N)]
    coeffs = np.random.default_rng(8).standard_normal((N, 4))
    lr, wd = [0.1, 0.2, 0.3], [0.0, 0.01, 0.02]
    together = fused_forward.experts_update(custom_kernels.to_device(thetas), coeffs, pops, lr, wd)
    for n, pop in enumerate(pops):
        alone = cuda_noise.spsa_update(thetas[n], coeffs[n], lr[n], pop.seed, pop.expert, pop.step, pop.kind, wd[n])
        np.testing.assert_array_equal(to_numpy(together[n]), to_numpy(alone))
    x = custom_kernels.to_device(thetas.copy())
    assert fused_forward.experts_update(x, coeffs, pops, lr, wd, out=x) is x
    np.testing.assert_array_equal(to_numpy(x), to_numpy(together))
    with pytest.raises(ValueError, match="coeffs"):
        fused_forward.experts_update(x, coeffs[:2], pops, lr)


def test_launches_per_step_are_counted_without_running_them(rt):
    """The recording runtime (launches recorded, none run) counts what the emulated runtime runs;
    the fused path takes 2 launches a step whatever N, and so does SOMA's training stepping its
    experts together; the graph path 3 per expert (perturb, the graph, the update), the kernels
    path 2T + 5 per expert."""
    from zosoma.benchmarks.bench_launches import count_launches, format_launches

    shape = dict(model=ModelConfig(embed=8, hidden=12, layers=1), P=2, B=2, T=5, experts=(1, 3))
    recorded = count_launches(**shape)
    ran = count_launches(**shape, rt=rt, timed_steps=1)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "step_s"} for r in rows]  # noqa: E731
    assert strip(recorded) == strip(ran)
    launches = {(r["path"], r["experts"]): (r["kernels"], r["gemms"]) for r in recorded}
    assert launches == {("kernels", 1): (5 + 3, 5 + 2), ("kernels", 3): (3 * 8, 3 * 7),
                        ("graph", 1): (2, 0), ("graph", 3): (3 * 2, 0),  # + one graph per expert
                        ("fused", 1): (2, 0), ("fused", 3): (2, 0),
                        ("together", 1): (2, 0), ("together", 3): (2, 0)}  # SOMA's training: the fused path's
    assert [r["launches"] for r in recorded if r["path"] == "graph"] == [3, 9]
    text = format_launches(ran, "emulated")
    assert "fused       3        2      0      0         2        0.67" in text, text


def test_bench_spsa_launches_cli():
    """`zosoma bench spsa --launches` counts without a device (the recording runtime)."""
    from click.testing import CliRunner

    from zosoma.cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "spsa", "--launches", "-P", "2", "--seq-len", "4", "--batch", "2"])
    assert result.exit_code == 0, result.output
    assert "recorded on the CPU" in result.output
    assert [line.split()[:7] for line in result.output.splitlines() if line.startswith("  fused ")] == [
        ["fused", str(N), "2", "0", "0", "2", f"{2 / N:.2f}"] for N in (1, 16, 64)]
    result = CliRunner().invoke(cli, ["bench", "spsa", "--launches", "--shapes", "16x20"])
    assert result.exit_code == 2 and "give it without --shapes" in result.output


@pytest.mark.slow
def test_gpu_check_validates_the_fused_kernels(rt):
    """studies/gpu_check.py's checks of the fused kernels pass on the runtime at hand."""
    import importlib.util

    from test_kernels import ROOT

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "studies" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    checks = check.Checks()
    check.validate_fused(rt.xp, checks, np.random.default_rng(0))
    assert len(checks.rows) == 6 and not checks.failed, checks.failed


@pytest.mark.subprocess
def test_emulated_barriers_wait_for_every_thread_and_report_a_divergent_one(tmp_path):
    """emulate.h's block kernels: a value written before __syncthreads is seen by every thread
    after it, and a barrier that some threads skip aborts with a message (as it would hang or
    misbehave on a GPU)."""
    import shutil
    import subprocess
    import sys

    from test_kernels import EMULATE_H

    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    (tmp_path / "k.cpp").write_text('''
extern "C" __global__ void rotate(float* x, int skip) {
    __shared__ float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    if (threadIdx.x >= (unsigned)skip) __syncthreads();
    x[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
ZOSOMA_EMU_EXPORT_BLOCK(rotate)
''')
    lib = tmp_path / "k.so"
    subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", "-include", str(EMULATE_H), "-x", "c++",
                    str(tmp_path / "k.cpp"), "-o", str(lib)], check=True)
    script = f'''
import ctypes, sys
import numpy as np
lib = ctypes.CDLL({str(lib)!r})
x = np.arange(8, dtype=np.float32)
skip = ctypes.c_int(int(sys.argv[1]))
ptr = ctypes.c_void_p(x.ctypes.data)
args = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(skip))
lib.emu_rotate((ctypes.c_uint * 3)(1, 1, 1), (ctypes.c_uint * 3)(8, 1, 1), ctypes.c_uint(0), args)
print(x.astype(int).tolist())
'''
    ok = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "[1, 2, 3, 4, 5, 6, 7, 0]", ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-c", script, "3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "5 of 8 threads wait at __syncthreads, the others returned" in bad.stderr


def test_the_engine_evaluates_n_experts_in_one_launch(rt, monkeypatch):
    """CudaOps.experts_perturbed_losses: N experts' steps in one fused launch, the bits of N
    calls of CudaOps.perturbed_losses, and the CPU engine's losses within float32 rounding."""
    from zosoma.engines.cuda.cuda_ops import CudaOps

    theta, layout = _model(8, 12, 1, scale=1.0)
    N = 3
    thetas = _population(theta, N, seed=9)
    batches = _bytes(7, (N, 2, 7))
    pops = [Population(3, 1e-2, 5, n, 4 + n, "gaussian") for n in range(N)]
    pops[2] = one_sided(pops[2])
    names = []
    real = custom_kernels.launch_blocks
    monkeypatch.setattr(custom_kernels, "launch_blocks", lambda *a: names.append(a[0]) or real(*a))
    together = CudaOps().experts_perturbed_losses(thetas, layout, batches, pops)
    assert names == ["fused_population_loss"]
    cpu = Ops().experts_perturbed_losses(thetas, layout, batches, pops)
    for n, pop in enumerate(pops):
        alone = CudaOps().perturbed_losses(thetas[n], layout, batches[n], pop)
        for a, b, c in zip(together[n], alone, cpu[n]):
            np.testing.assert_array_equal(a, b)
            assert_close(a, c, rtol=LOSS_RTOL, name="vs the cpu engine")
