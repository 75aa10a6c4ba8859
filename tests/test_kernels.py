"""The CUDA kernels (zosoma/engines/cuda/kernels/*.cu) and the CUDA engine (the modules beside them),
with or without a GPU.

Three layers of checks:
1. Every .cu file compiles for the GPU with `nvcc --ptx` (skipped where nvcc is absent).
2. Emulation: each .cu file is compiled as C++ with g++ and kernels/emulate.h, which runs a launch's
   blocks and threads one after another on the CPU (a file with block barriers: each block's threads
   together, as fibers). the CUDA engine (zosoma.engines.cuda) then runs unchanged
   on an "emulated" runtime (NumPy arrays, NumPy matmul for the GEMMs, the kernels through ctypes), so the
   kernels' arithmetic *and* the engine's launches (argument order, strides, chunking) are checked
   against the CPU code on any machine with a C++ compiler.
3. The same engine tests on the real CUDA runtime (CuPy + a GPU), where there is one.

The `rt` fixture runs each backend test on both runtimes (on the emulated one only without a GPU). The emulated runtime caps the grid at a
few blocks, so the kernels' grid-stride loops are exercised too.
"""

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_close, mixed_members, streamed_in_halves
from world import PHILOX_KAT, TINY_MODEL, TINY_MODEL_L2
from zosoma.engines.cuda import backend
from zosoma.engines.cpu import lowrank as eggroll
from zosoma.engines.cpu import forward
from zosoma.engines.cuda import cuda_forward, cuda_noise, cuda_ops, custom_kernels, tensor_cores
from zosoma.model import reference
from zosoma.config import VOCAB, ModelConfig
from zosoma.errors import ConfigError
from zosoma.model.noise import KINDS, add_noise, noise, noise_length, population_factors
from zosoma.arrays import get_array_module, to_numpy
from zosoma.engines import get_ops
from zosoma.engines.ops import Ops, perturbed
from zosoma.model.population import Population
from zosoma.model.params import Layout, init_params
from zosoma.strategies.onesided import one_sided
from zosoma.mixture.routing import Ensemble, Router, cut_segments, evaluate_routed, run_selected
from zosoma.mixture.sample import sample

ROOT = Path(__file__).resolve().parents[1]
EMULATE_H = custom_kernels.KERNEL_DIR / "emulate.h"

NOISE_KEYS = [  # (seed, expert, step, member); seeds above 2**32 exercise the key's high word
    (0, 0, 0, 0), (1234, 2, 7, 3), (2**40 + 12345, 1, 99, 17), (2**63 + 5, 7, 2**31 + 3, 2**32 - 1),
]
GAUSSIAN_ATOL = 1e-5  # float32 Box-Muller vs the CPU's float64 one
LOSS_RTOL = 1e-5  # mean loss vs the float64 reference
NLL_ATOL = 1e-4  # per-position nats and log-probabilities


# --- 1. the sources compile for the GPU ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("file", custom_kernels.KERNEL_FILES)
def test_kernel_compiles_with_nvcc(file, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    result = subprocess.run([nvcc, "--ptx", "-arch=sm_80", str(custom_kernels.KERNEL_DIR / file), "-o",
                             str(tmp_path / "out.ptx")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "out.ptx").read_text()
    for name in custom_kernels.kernel_signatures((custom_kernels.KERNEL_DIR / file).read_text()):
        assert f".entry {name}(" in ptx  # extern "C": unmangled, as cupy.RawModule looks them up


def test_kernel_signatures_are_parsed():
    sigs = custom_kernels._signatures()
    assert set(sigs) == {"philox_blocks", "perturb", "spsa_update", "lstm_cell_embed",
                         "lstm_cell_proj", "log_softmax_nll", "fused_population_loss", "experts_update",
                         "route_embed", "noisy_cell", "add_activity_noise", "weighted_noise"}
    file, params = sigs["perturb"]
    assert file == "noise.cu"
    assert [(p.name, p.ctype, p.pointer) for p in params[:4]] == [
        ("out", "float", True), ("base", "float", True), ("n", "long long", False),
        ("scale", "float", False)]
    with pytest.raises(ValueError, match="unsupported parameter type"):
        custom_kernels.kernel_signatures('extern "C" __global__ void k(const short* x) {}')


# --- 2. the emulated runtime --------------------------------------------------------------------

_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
           np.dtype(np.int32): ctypes.c_int, np.dtype(np.uint32): ctypes.c_uint,
           np.dtype(np.int64): ctypes.c_longlong, np.dtype(np.uint64): ctypes.c_ulonglong}


_MATMUL = np.matmul


class EmulatedRuntime:
    """custom_kernels.py's runtime on the CPU: NumPy arrays, kernels compiled by g++ with emulate.h and called
    as the driver API does (grid, block, an array of pointers to the arguments)."""

    xp = np
    max_grid = (5, 3)  # few blocks, so the grid-stride loops take several turns
    max_threads = 48  # few threads per block (each a fiber in a block kernel), so thread loops take turns
    max_shared = 227 << 10  # an H100/H200's opt-in shared memory per block

    def __init__(self, libs):
        self.libs = libs
        self._recording = None  # the launch list while a graph is captured

    def launch(self, file, name, grid, block, args, shared_mem=0):
        if self._recording is not None:  # a graph bakes in the arguments: array addresses and scalars
            self._recording.append(lambda: self.launch(file, name, grid, block, args, shared_mem))
            return
        values = []
        for a in args:
            if isinstance(a, np.ndarray):
                values.append(ctypes.c_void_p(a.ctypes.data))
            else:
                values.append(_CTYPES[a.dtype](a))
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        kernel = getattr(self.libs[file], "emu_" + name)
        dims = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block)
        if file in self.libs.cooperative:
            kernel(*dims, ctypes.c_uint(shared_mem), pointers)
        else:
            assert shared_mem == 0, f"{name} takes no shared memory"
            kernel(*dims, pointers)


    def _run(self, op):
        """op() now, or recorded for the graph being captured (then only replays run it)."""
        if self._recording is None:
            op()
        else:
            self._recording.append(op)

    def gemm(self, a, b, out=None):
        if self._recording is None:
            return np.matmul(a, b, out=out)  # looked up now: launches.Launches counts it
        if out is None:
            out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.float32)
        fmt = tensor_cores.active()  # the GEMM format is captured, as cuBLAS's compute type is
        rounded = (lambda x: x) if fmt == "fp32" else (lambda x: tensor_cores.round_operand(x, fmt))
        # inside a replay, not a launch of its own
        self._recording.append(lambda: _MATMUL(rounded(a), rounded(b), out=out))
        return out

    def contiguous(self, x):
        out = np.empty(x.shape, x.dtype)
        self._run(lambda: np.copyto(out, x))
        return out

    def zeros(self, shape, dtype=np.float32):
        out = np.empty(shape, dtype)
        self._run(lambda: out.fill(0))
        return out

    def capture(self, fn):
        """fn's launches, GEMMs, copies and fills recorded, not run (as a CUDA stream capture):
        a graph whose replay() runs the list."""
        self._recording = []
        try:
            outputs = fn()
        finally:
            ops, self._recording = self._recording, None
        return EmulatedGraph(ops, outputs)


class EmulatedGraph:
    def __init__(self, ops, outputs):
        self.ops, self.outputs = ops, outputs

    def replay(self):
        for op in self.ops:
            op()


class EmulatedLibs(dict):
    """file -> its ctypes library; `cooperative`: the files whose kernels use block barriers
    (exported with ZOSOMA_EMU_EXPORT_BLOCK: a block's threads run together as fibers)."""
    cooperative: set


@pytest.fixture(scope="module")
def emulated_libs(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot emulate the kernels")
    out = tmp_path_factory.mktemp("emulated")
    jobs = {}
    for file in custom_kernels.KERNEL_FILES:
        source = custom_kernels.KERNEL_DIR / file
        wrapper = out / f"{file}.cpp"
        names = custom_kernels.kernel_signatures(source.read_text())
        export = "ZOSOMA_EMU_EXPORT_BLOCK" if "__syncthreads" in source.read_text() else "ZOSOMA_EMU_EXPORT"
        exports = "".join(f"{export}({name})\n" for name in names)
        wrapper.write_text(f'#include "{source}"\n{exports}')
        lib = out / f"{file}.so"
        cmd = [gxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Werror",
               "-include", str(EMULATE_H), "-x", "c++", str(wrapper), "-o", str(lib)]
        jobs[file] = (lib, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    libs = EmulatedLibs()
    libs.cooperative = {file for file in jobs if "__syncthreads" in (custom_kernels.KERNEL_DIR / file).read_text()}
    for file, (lib, proc) in jobs.items():
        _, err = proc.communicate()
        assert proc.returncode == 0, f"g++ failed on {file}:\n{err}"
        libs[file] = ctypes.CDLL(str(lib))
    return libs


# The CUDA runtime joins the parametrisation only where CuPy finds a device.
RUNTIMES = ["emulated"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if backend.cuda_device_count() else [])
_cuda_runtime = []

@pytest.fixture(params=RUNTIMES)
def rt(request, monkeypatch):
    """Each backend test runs on the emulated runtime and, where there is a GPU, on CuPy."""
    if request.param == "emulated":
        runtime = EmulatedRuntime(request.getfixturevalue("emulated_libs"))
    else:
        if not _cuda_runtime:
            _cuda_runtime.append(custom_kernels.CupyRuntime())  # one, so each kernel file compiles once
        runtime = _cuda_runtime[0]
    monkeypatch.setattr(custom_kernels, "_runtime", runtime)
    return runtime


def _host(x):
    return to_numpy(x)


def _poisoned(rt, shape):
    """A device float32 array filled with NaN: a kernel that skips an element shows up."""
    return rt.xp.full(shape, np.nan, np.float32)


# --- Philox and noise -----------------------------------------------------------------------------

def test_philox_known_answers(rt):
    counters = np.array([c + k for c, k, _ in PHILOX_KAT], np.uint32)  # (n, 6)
    out = rt.xp.zeros((len(PHILOX_KAT), 4), np.uint32)
    custom_kernels.launch("philox_blocks", len(PHILOX_KAT), custom_kernels.to_device(counters, np.uint32), out,
                          len(PHILOX_KAT))
    assert [tuple(int(w) for w in row) for row in _host(out)] == [e for _, _, e in PHILOX_KAT]


@pytest.mark.parametrize("seed, expert, step, member", NOISE_KEYS)
@pytest.mark.parametrize("n, start", [(1, 0), (1001, 0), (2053, 384)])
def test_rademacher_noise_is_bit_identical(rt, seed, expert, step, member, n, start):
    out = _poisoned(rt, n)
    cuda_noise.add_noise(out, np.zeros(n, np.float32), 1.0, seed, expert, step, member, "rademacher", start)
    np.testing.assert_array_equal(_host(out), noise(n, seed, expert, step, member, "rademacher", start))


@pytest.mark.parametrize("seed, expert, step, member", NOISE_KEYS)
@pytest.mark.parametrize("n, start", [(3, 0), (4099, 0), (1030, 8)])
def test_gaussian_noise_matches_within_float32(rt, seed, expert, step, member, n, start):
    out = _poisoned(rt, n)
    cuda_noise.add_noise(out, np.zeros(n, np.float32), 1.0, seed, expert, step, member, "gaussian", start)
    assert_close(_host(out), noise(n, seed, expert, step, member, "gaussian", start),
                 atol=GAUSSIAN_ATOL, rtol=0, name="gaussian noise")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_add_noise_in_place_matches_cpu(rt, kind):
    base = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    want = add_noise(np.empty_like(base), base, -0.013, 2**33 + 1, 3, 4, 5, kind)
    x = custom_kernels.to_device(base.copy())
    assert cuda_noise.add_noise(x, x, -0.013, 2**33 + 1, 3, 4, 5, kind) is x
    if kind == "rademacher":
        np.testing.assert_array_equal(_host(x), want)
    else:
        assert_close(_host(x), want, atol=GAUSSIAN_ATOL * 0.013, rtol=1e-6, name="in place")


def test_add_noise_rejects_bad_arguments(rt):
    out = rt.xp.zeros(10, np.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        cuda_noise.add_noise(out, out, 1.0, 0, 0, 0, 0, "rademacher", start=4)
    with pytest.raises(ValueError, match="noise kind"):
        cuda_noise.add_noise(out, out, 1.0, 0, 0, 0, 0, "uniform")
    with pytest.raises(ValueError, match="float32"):
        cuda_noise.add_noise(rt.xp.zeros(10, np.float64), out, 1.0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="seed"):
        cuda_noise.add_noise(out, out, 1.0, -1, 0, 0, 0)


# member tables every engine evaluates (zosoma.model.population): the strategies' and a mix of the rest
TABLES = {"antithetic": lambda pop: pop, "onesided": one_sided, "mixed": mixed_members}


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_perturbed_population_matches_cpu(rt, kind, table):
    theta = np.random.default_rng(1).standard_normal(777).astype(np.float32)
    members = range(3, 10)
    pop = TABLES[table](Population(10, 1e-3, 2**35 + 9, 2, 11, kind))
    want = perturbed(theta, pop, members)
    out = _poisoned(rt, want.shape)
    rows = pop.rows(members)
    got = _host(cuda_noise.perturbed(theta, 1e-3, members, 2**35 + 9, 2, 11, kind, out=out,
                                     table=(pop.direction[rows], pop.sign[rows])))
    if kind == "rademacher":
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, atol=2e-3 * GAUSSIAN_ATOL, rtol=1e-6, name="population")
    assert cuda_noise.perturbed(theta, 1e-3, range(0), 0, 0, 0, kind).shape == (0, theta.size)
    with pytest.raises(ValueError, match="consecutive"):
        cuda_noise.perturbed(theta, 1e-3, range(0, 6, 2), 0, 0, 0, kind)


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_spsa_gradient_matches_cpu(rt, kind):
    d, coeffs = 1537, np.random.default_rng(2).standard_normal(9) * 3.0
    want = Ops().noise_sum(coeffs, d, Population(len(coeffs), 1.0, 2**40 + 1, 4, 6, kind))
    got = _host(cuda_noise.spsa_gradient(coeffs, d, 2**40 + 1, 4, 6, kind))
    if kind == "rademacher":  # same float32 terms added in the same order
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, atol=1e-5, rtol=1e-5, name="ghat")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_spsa_update_matches_cpu(rt, kind, weight_decay):
    d, P = 2051, 7
    rng = np.random.default_rng(3)
    theta = rng.standard_normal(d).astype(np.float32)
    coeffs = rng.standard_normal(P) * 10.0
    want = Ops().sgd_update(theta, coeffs, Population(P, 1.0, 5, 1, 8, kind), 0.03, weight_decay)
    out = _poisoned(rt, d)
    got = _host(cuda_noise.spsa_update(theta, coeffs, 0.03, 5, 1, 8, kind, weight_decay, out=out))
    x = custom_kernels.to_device(theta.copy())  # in place (a copy: on the emulated runtime to_device does not copy)
    cuda_noise.spsa_update(x, coeffs, 0.03, 5, 1, 8, kind, weight_decay, out=x)
    if kind == "rademacher":
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(_host(x), want)
    else:
        assert_close(got, want, atol=1e-6, rtol=1e-6, name="update")
        assert_close(_host(x), want, atol=1e-6, rtol=1e-6, name="update in place")


# --- the LSTM kernels on their own ----------------------------------------------------------------


@pytest.mark.parametrize("shared_tokens", [True, False])
def test_lstm_cell_embed_matches_reference(rt, shared_tokens):
    M, B, H, Tc, t, T = 3, 2, 5, 4, 2, 7
    G = 4 * H
    rng = np.random.default_rng(4)
    gates, table = (rng.standard_normal(s).astype(np.float32) * 2 for s in [(M, B, G), (M, VOCAB, G)])
    bias = rng.standard_normal((M, G)).astype(np.float32)
    c0 = rng.standard_normal((M, B, H)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, (1 if shared_tokens else M, B, T + 1), dtype=np.uint8)
    tt = 5  # absolute time of this step in tokens
    d = custom_kernels.to_device
    c, h, hs = d(c0.copy()), _poisoned(rt, (M, B, H)), _poisoned(rt, (M, Tc, B, H))
    tok = d(tokens, np.uint8)[..., :-1]  # a strided view, as population_loss passes
    sm, sb = cuda_forward._byte_strides(tok, M)
    custom_kernels.launch("lstm_cell_embed", M * B * H, d(gates), d(table), tok, sm, sb, tt, d(bias), c, h, hs,
                          M, B, H, Tc, t)
    rows = tokens[np.arange(M) % tokens.shape[0], :, tt]  # (M, B) bytes
    x = table[np.arange(M)[:, None], rows]  # (M, B, G)
    want_h, want_c = reference.lstm_cell(gates.astype(np.float64) + x + bias[:, None], c0.astype(np.float64))
    assert_close(_host(h), want_h, atol=1e-6, rtol=1e-5, name="h")
    assert_close(_host(c), want_c, atol=1e-6, rtol=1e-5, name="c")
    assert_close(_host(hs)[:, t], want_h, atol=1e-6, rtol=1e-5, name="hs[t]")
    assert np.isnan(np.delete(_host(hs), t, axis=1)).all()  # other steps untouched


def test_lstm_cell_proj_matches_reference(rt):
    M, B, H, Tc, t = 2, 3, 6, 3, 1
    G = 4 * H
    rng = np.random.default_rng(5)
    gates, xproj = (rng.standard_normal(s).astype(np.float32) * 2 for s in [(M, B, G), (M, Tc, B, G)])
    bias = rng.standard_normal((M, G)).astype(np.float32)
    c0 = rng.standard_normal((M, B, H)).astype(np.float32)
    d = custom_kernels.to_device
    c, h, hs = d(c0.copy()), _poisoned(rt, (M, B, H)), _poisoned(rt, (M, Tc, B, H))
    custom_kernels.launch("lstm_cell_proj", M * B * H, d(gates), d(xproj), d(bias), c, h, hs, M, B, H, Tc, t)
    want_h, want_c = reference.lstm_cell(gates.astype(np.float64) + xproj[:, t] + bias[:, None],
                                     c0.astype(np.float64))
    assert_close(_host(h), want_h, atol=1e-6, rtol=1e-5, name="h")
    assert_close(_host(c), want_c, atol=1e-6, rtol=1e-5, name="c")
    assert_close(_host(hs)[:, t], want_h, atol=1e-6, rtol=1e-5, name="hs[t]")


def test_log_softmax_nll_matches_reference(rt):
    M, B, T, t0, Tc = 2, 3, 9, 4, 3
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((M, Tc, B, VOCAB)) * 4).astype(np.float32)
    logits[0, 0, 0, 7] = 60.0  # a confident row
    bias = rng.standard_normal((M, VOCAB)).astype(np.float32)
    targets = rng.integers(0, VOCAB, (M, B, T + 1), dtype=np.uint8)
    d = custom_kernels.to_device
    tgt = d(targets, np.uint8)[..., 1:]
    sm, sb = cuda_forward._byte_strides(tgt, M)
    nll, logp = _poisoned(rt, (M, B, T)), _poisoned(rt, (M, B, T, VOCAB))
    custom_kernels.launch("log_softmax_nll", M * Tc * B, d(logits), d(bias), tgt, sm, sb, nll, logp, 1, M, B, T, t0, Tc)
    z = logits.astype(np.float64).transpose(0, 2, 1, 3) + bias[:, None, None]  # (M, B, Tc, V)
    want = reference.nll(z, targets[:, :, 1 + t0:1 + t0 + Tc])
    assert_close(_host(nll)[:, :, t0:t0 + Tc], want, atol=1e-5, rtol=1e-6, name="nll")
    assert_close(_host(logp)[:, :, t0:t0 + Tc], reference.log_softmax(z), atol=1e-5, rtol=1e-6, name="logp")
    assert np.isnan(_host(nll)[:, :, :t0]).all() and np.isnan(_host(nll)[:, :, t0 + Tc:]).all()


def test_launch_checks_arguments(rt):
    out = rt.xp.zeros((1, 4), np.uint32)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        custom_kernels.launch("philox_blocks", 1, out, out)
    with pytest.raises(TypeError, match="counters must be a uint32"):
        custom_kernels.launch("philox_blocks", 1, rt.xp.zeros(6, np.float32), out, 1)


# --- the CUDA engine end to end --------------------------------------------------------------

def _model(embed, hidden, layers, seed=0, scale=3.0):
    """Parameters scaled up so gates saturate and predictions are far from uniform."""
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, seed) * scale).astype(np.float32), layout


def _bytes(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.uint8)


def _population(theta, M, seed=0):
    """M distinct members around theta."""
    noise_ = np.random.default_rng(seed).standard_normal((M, theta.size)).astype(np.float32)
    return theta[None] + 0.3 * noise_


@pytest.mark.parametrize("embed, hidden, layers, B, T, rows_per_chunk", [
    (8, 16, 1, 3, 5, 1024),
    (12, 8, 2, 2, 13, 4),  # time chunks of 2 steps, the last one short
    (6, 10, 3, 1, 7, 3),
])
@pytest.mark.parametrize("per_member_batch", [False, True])
def test_population_loss_matches_reference(rt, monkeypatch, embed, hidden, layers, B, T,
                                           rows_per_chunk, per_member_batch):
    monkeypatch.setattr(cuda_forward, "ROWS_PER_CHUNK", rows_per_chunk)
    theta, layout = _model(embed, hidden, layers)
    M = 4
    thetas = _population(theta, M)
    batch = _bytes(1, (M, B, T + 1) if per_member_batch else (B, T + 1))
    got = cuda_forward.population_loss(thetas, layout, batch)
    assert got.shape == (M,) and got.dtype == np.float64
    want = [reference.loss(thetas[m].astype(np.float64), layout, batch[m] if per_member_batch else batch)
            for m in range(M)]
    assert_close(got, want, rtol=LOSS_RTOL, name="population loss")
    assert_close(got, forward.population_loss(thetas, layout, batch), rtol=LOSS_RTOL, name="vs numba")


def test_population_loss_in_member_chunks(rt):
    theta, layout = _model(8, 8, 2)
    thetas = _population(theta, 5, seed=3)
    batch = _bytes(2, (2, 6))
    whole = cuda_forward.population_loss(thetas, layout, batch)
    one_by_one = cuda_forward.population_loss(thetas, layout, batch, workspace_bytes=1)  # chunks of 1 member
    if rt.xp is np:  # the same products member by member: the same bits
        np.testing.assert_array_equal(whole, one_by_one)
    else:  # cuBLAS picks its batched kernel by the batch count (1 ulp apart on the H200, 2026-12-04)
        assert_close(one_by_one, whole, rtol=cuda_forward.CHUNK_RTOL, name="member chunks")
    with pytest.raises(ValueError, match="theta must have shape"):
        cuda_forward.population_loss(theta, layout, batch)
    with pytest.raises(ValueError, match="batch must be"):
        cuda_forward.population_loss(thetas, layout, _bytes(0, (3, 2, 6)))
    with pytest.raises(ValueError, match="uint8"):
        cuda_forward.population_loss(thetas, layout, batch.astype(np.int64))


def test_spsa_losses_match_cpu(rt):
    theta, layout = _model(8, 12, 1, scale=1.0)
    batch = _bytes(4, (3, 9))
    for kind in ("rademacher", "gaussian"):
        for table, build in TABLES.items():
            pop = build(Population(5, 1e-2, 7, 1, 2, kind))
            want = Ops().perturbed_losses(theta, layout, batch, pop)
            rows = pop.rows(range(1, 5))
            got = cuda_forward.spsa_losses(theta, layout, batch, 5, 1e-2, 7, 1, 2, kind, workspace_bytes=1,
                                           pairs=range(1, 5), table=(pop.direction[rows], pop.sign[rows]))
            for g, w in zip(got, want):
                assert_close(g, w[1:], rtol=LOSS_RTOL, name=f"spsa losses {kind} {table}")
            got = cuda_ops.CudaOps().perturbed_losses(theta, layout, batch, pop, range(1, 5))
            for g, w in zip(got, want):
                assert_close(g, w[1:], rtol=LOSS_RTOL, name=f"CudaOps losses {kind} {table}")


def test_nll_stream_carries_state_and_log_probs_match(rt):
    theta, layout = _model(10, 12, 2)
    data = _bytes(5, (2, 25))
    tokens, targets = data[:, :-1], data[:, 1:]
    whole, state_whole, first, state, second, state_halves = streamed_in_halves(cuda_forward.nll_stream, theta,
                                                                                 layout, tokens, targets)
    assert whole.dtype == np.float32 and whole.shape == (2, 24)
    assert_close(np.concatenate([first, second], axis=1), whole, atol=NLL_ATOL, name="halves")
    want, _ = forward.nll_stream(theta, layout, tokens, targets)
    assert_close(whole, want, atol=NLL_ATOL, name="vs numba")
    for (h, c), (h2, c2) in zip(state_whole, state_halves):
        assert_close(h, h2, atol=1e-5, name="h")
        assert_close(c, c2, atol=1e-5, name="c")
    logp, state_lp = cuda_forward.log_probs(theta, layout, tokens[:, :10], state)
    want_logp, want_state = forward.log_probs(theta, layout, tokens[:, :10], state)
    assert logp.shape == (2, 10, VOCAB)
    assert_close(logp, want_logp, atol=NLL_ATOL, name="log_probs")
    assert_close(state_lp[1][0], want_state[1][0], atol=1e-5, name="log_probs state")
    with pytest.raises(ValueError, match="must match"):
        cuda_forward.nll_stream(theta, layout, tokens, targets[:, :5])


def test_population_nll_runs_many_models_at_once(rt):
    theta, layout = _model(6, 10, 2)
    thetas = _population(theta, 3, seed=4)
    shared, own = _bytes(6, (2, 12)), _bytes(7, (3, 2, 12))
    got = cuda_forward.population_nll(list(thetas), layout, shared[:, :-1], shared[:, 1:])
    assert got.shape == (3, 2, 11) and got.dtype == np.float32
    for m in range(3):
        assert_close(got[m], forward.nll_stream(thetas[m], layout, shared[:, :-1], shared[:, 1:])[0],
                     atol=NLL_ATOL, name="shared rows")
    got = cuda_forward.population_nll(thetas, layout, own[..., :-1], own[..., 1:], workspace_bytes=1)  # 1 by 1
    for m in range(3):
        assert_close(got[m], forward.nll_stream(thetas[m], layout, own[m, :, :-1], own[m, :, 1:])[0],
                     atol=NLL_ATOL, name="one batch per model")
    with pytest.raises(ValueError, match="tokens must be"):
        cuda_forward.population_nll(thetas, layout, own[:2, :, :-1], own[:2, :, 1:])
    with pytest.raises(ValueError, match="must match"):
        cuda_forward.population_nll(thetas, layout, shared[:, :-1], shared[:, 2:])


@pytest.mark.parametrize("embed, hidden, layers, r, B, T, rows_per_chunk", [
    (8, 12, 2, 1, 3, 10, 1024),
    (6, 8, 3, 3, 2, 9, 4),  # time chunks of 2 steps, the last one short
])
def test_eggroll_population_loss_matches_cpu(rt, monkeypatch, embed, hidden, layers, r, B, T, rows_per_chunk):
    monkeypatch.setattr(cuda_forward, "ROWS_PER_CHUNK", rows_per_chunk)
    theta, layout = _model(embed, hidden, layers, scale=2.0)
    batch = _bytes(7, (B, T + 1))
    args = (0.3, r, 2**33 + 7, 2, 5, 3)  # sigma, r, seed, expert, step, n_pairs
    want = eggroll.eggroll_population_loss(theta.astype(np.float64), layout, batch, *args)
    got = cuda_forward.eggroll_population_loss(theta, layout, batch, *args)
    assert got.shape == (6,) and got.dtype == np.float64
    assert_close(got, want, rtol=LOSS_RTOL, name="eggroll population loss vs CPU (float64)")
    assert np.ptp(want) > 1e-3  # the perturbations change the losses
    one_pair_at_a_time = cuda_forward.eggroll_population_loss(theta, layout, batch, *args, workspace_bytes=1)
    assert_close(one_pair_at_a_time, got, rtol=1e-6, name="pair chunks")


def test_eggroll_factors_are_the_cpu_slices(rt):
    theta, layout = _model(5, 6, 2)
    r, pairs = 2, 3
    n = noise_length(layout, r)
    z = _poisoned(rt, (pairs, n))
    cuda_noise.perturb(z, rt.xp.zeros(n, np.float32), 1.0, 0, 11, 1, 4, *cuda_noise.plain_rows(range(pairs)),
                       KINDS["gaussian"])
    low = cuda_forward._LowRank(custom_kernels.to_device(theta), layout, z, 0.5, r)
    want = population_factors(layout, r, 11, 1, 4, pairs, np.float64)
    for e in layout.entries:
        if len(e.shape) == 2:
            a, b = want[e.name]
            assert_close(_host(low.a[e.name]), a, atol=GAUSSIAN_ATOL, name=f"A of {e.name}")
            bs = _host(low.bs[e.name]).reshape(pairs, 2, r, -1)
            c = 0.5 / np.sqrt(r)
            assert_close(bs[:, 0], c * b.transpose(0, 2, 1), atol=GAUSSIAN_ATOL, name=f"+B^T of {e.name}")
            assert_close(bs[:, 1], -c * b.transpose(0, 2, 1), atol=GAUSSIAN_ATOL, name=f"-B^T of {e.name}")
        else:
            v = _host(low.vector(e.name)).reshape(pairs, 2, -1)
            base = layout.view(theta, e.name)
            assert_close(v[:, 0], base + 0.5 * want[e.name], atol=GAUSSIAN_ATOL, name=f"+{e.name}")
            assert_close(v[:, 1], base - 0.5 * want[e.name], atol=GAUSSIAN_ATOL, name=f"-{e.name}")
    with pytest.raises(ValueError, match="n_pairs"):
        cuda_forward.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)), 0.1, 1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        cuda_forward.eggroll_population_loss(theta, layout, _bytes(0, (2, 5)), 0.1, 0, 0, 0, 0, 1)


@pytest.fixture(scope="module")
def routed_setup():
    """A 4-expert ensemble of two sizes (experts of one size run together on the device) routed
    over three synthetic byte domains, and text that switches between them."""
    from zosoma.config import ClusterConfig
    from zosoma.mixture.cluster import fit_clusters
    from zosoma.corpus import Corpus

    rng = np.random.default_rng(0)
    alphabets = (b"abcdefghij ", b"0123456789 ", b"!?.,;:-+*/ ")
    docs = tuple(np.frombuffer(a, np.uint8)[rng.integers(0, len(a), 200)] for a in alphabets for _ in range(8))
    config = ClusterConfig(n_clusters=4, n_features=2**10, svd_dim=8, svd_oversample=4, seed=3)
    clustering, _ = fit_clusters(Corpus(tuple(str(i // 8) for i in range(len(docs))), docs), config)
    layouts = (Layout(TINY_MODEL), Layout(ModelConfig(embed=6, hidden=8, layers=2)))
    experts = tuple(((init_params(layouts[i % 2].config, 5, i) * 3).astype(np.float32), layouts[i % 2])
                    for i in range(4))
    return Ensemble(experts, Router(clustering, 2)), np.concatenate(docs[::5])


def test_routed_inference_on_the_device_matches_the_cpu(rt, routed_setup):
    """--device cuda for SOMA runs: routed evaluation (every expert on every segment), the top-k
    path (batches of all experts of one size in one forward) and sampling agree with the CPU."""
    ensemble, text = routed_setup
    data = text[:900]
    ops = cuda_ops.CudaOps()
    cpu = evaluate_routed(ensemble, data, segment=100, context=60, batch=4)
    dev = evaluate_routed(ensemble, data, segment=100, context=60, batch=4, ops=ops)
    assert list(dev) == list(cpu)
    for key in cpu:
        assert dev[key].n_bytes == cpu[key].n_bytes
        assert_close(dev[key].nats, cpu[key].nats, rtol=LOSS_RTOL, name=f"evaluate_routed {key}")
    segs = cut_segments(data, 100, 60)
    chosen, _ = ensemble.router.select(segs.contexts)
    want = run_selected(ensemble, segs, chosen, batch=3)
    got = run_selected(ensemble.on(ops), segs, chosen, batch=3, ops=ops)
    mask = segs.mask()[:, None]  # the scored columns (past a row's stop is padding)
    assert_close(np.where(mask, got, 0), np.where(mask, want, 0), atol=NLL_ATOL, name="run_selected")
    args = dict(n_bytes=40, seed=1, reroute_every=8, context=32)
    assert sample(ensemble, b"abc 0123", ops=ops, **args) == sample(ensemble, b"abc 0123", **args)


def test_bench_forward_on_the_device(rt, monkeypatch):
    """bench forward --device cuda: the cuda_forward.py forward timed beside torch and the GEMM peak."""
    from zosoma.benchmarks import bench_forward as bench

    if rt.xp is np:  # emulated: NumPy stands in for CuPy, and a small peak GEMM for the GPU's
        monkeypatch.setattr(bench, "_PEAK_N_CUDA", 64)
    monkeypatch.setattr(bench, "_PAUSE_S", 0.0)
    records = bench.bench_forward(embed=8, hidden=8, layers=2, batch=2, seq_len=5, repeats=1, ops=cuda_ops.CudaOps())
    names = [r["name"] for r in records]
    assert names[1] == "cuda population_loss M=1" and names[2] == "torch cuDNN nn.LSTM no_grad"
    assert records[1]["tokens_per_s"] > 0 and "numpy reference" not in " ".join(names)
    assert "cuda population_loss" in bench.format_records(records)


def test_bench_eggroll_and_lstm_variance_on_the_device(rt):
    """bench eggroll --device cuda times the device populations; variance --device cuda measures
    the same scalars as the CPU (Rademacher directions are bit-identical on the device)."""
    from zosoma.benchmarks.bench_eggroll import bench_eggroll, format_eggroll
    from zosoma.config import ModelConfig
    from zosoma.experiments.variance import lstm_variance

    rec = bench_eggroll(embed=6, hidden=8, layers=1, batch=2, seq_len=4, pairs=2, repeats=1, ops=cuda_ops.CudaOps())
    assert rec["device"] == "cuda" and rec["eggroll_s_per_member"] > 0 and "device cuda" in format_eggroll([rec])
    kw = dict(Ns=(1, 2), model=ModelConfig(embed=4, hidden=6, layers=1), B=2, T=5, reps=3, P=2)
    for cpu, dev in zip(lstm_variance(**kw), lstm_variance(ops=cuda_ops.CudaOps(), **kw)):
        assert dev["N"] == cpu["N"]
        assert_close(np.array(dev["ratio"]), np.array(cpu["ratio"]), rtol=1e-3, name="variance ratio")


@pytest.mark.parametrize("args", [["sample", "no-such-run"], ["bench", "forward"], ["bench", "route"],
                                  ["bench", "eggroll"], ["variance"], ["compare", "cpu"]])
def test_cli_device_cuda_without_a_gpu_is_one_line_error(args):
    if backend.cuda_device_count():
        pytest.skip("a CUDA device is present")
    from click.testing import CliRunner
    from zosoma.cli.main import cli

    result = CliRunner().invoke(cli, args + ["--device", "cuda"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert result.output.startswith("Error: --device cuda: no CUDA device (")


# --- backend.py -----------------------------------------------------------------------------------

@pytest.fixture
def fresh_probe():
    def clear():
        backend._import_cupy.cache_clear()
        backend._probe_devices.cache_clear()
        get_ops.cache_clear()
    clear()
    yield
    clear()


def test_get_ops_is_where_the_device_is_chosen(fresh_probe):
    assert get_ops("cpu").name == "cpu"
    with pytest.raises(ConfigError, match="device must be one of cpu, cuda, auto"):
        get_ops("gpu")
    if backend.cuda_device_count():
        assert get_ops("auto").name == get_ops("cuda").name == "cuda"
        return
    assert get_ops("auto").name == "cpu"
    with pytest.raises(ConfigError, match=r"^--device cuda: no CUDA device \(.+\)$"):
        get_ops("cuda")
    with pytest.raises(ConfigError, match="no CUDA device"):
        custom_kernels.CupyRuntime()


def test_each_engine_says_what_it_is(rt, fresh_probe):
    """Code outside zosoma.engines asks an engine what it is (on_device, precision), never its name;
    the note --device auto prints comes from the engine too. A run's engine (zosoma.runs.run.engine)
    is its device's unless its configuration names another, which runs on the CPU only."""
    from zosoma.config import TrainConfig
    from zosoma.engines import device_note
    from zosoma.runs.run import engine
    from zosoma.workers.placement import Placement

    cpu, bf16, device = get_ops("cpu"), get_ops("cpu", precision="bf16"), cuda_ops.CudaOps()
    assert (cpu.on_device, cpu.precision) == (False, "fp32")
    assert (bf16.on_device, bf16.precision, bf16.name) == (False, "bf16", "cpu-bf16")
    assert (device.on_device, device.precision) == (True, "fp32")
    assert (cpu.device, bf16.device, device.device) == ("cpu", "cpu", "cuda")  # the device, whatever the label
    onnx, int8 = TrainConfig(optimizer="sgd", engine="onnxruntime"), TrainConfig(optimizer="sgd", forward_precision="int8")
    assert engine(Placement(), onnx).name == "onnxruntime"  # the CPU's engine gives way to the run's own
    assert engine(Placement(device="cuda")).on_device  # get_ops builds the (emulated) CUDA engine
    with pytest.raises(ConfigError, match="^--engine native --forward-precision int8 runs on the CPU, not on cuda$"):
        engine(Placement(device="cuda"), int8)
    assert device_note("cpu", cpu) is None and device_note("cuda", device) is None
    assert device_note("auto", device) == "--device auto: running on cuda"
    if not backend.cuda_device_count():
        assert device_note("auto", get_ops("auto")).startswith("--device auto: running on cpu (")


def test_missing_cupy_is_reported_with_the_install_hint(fresh_probe, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail as if not installed
    assert backend.cupy_or_none() is None and backend.cuda_device_count() == 0
    with pytest.raises(ConfigError, match=r"CuPy not installed: pip install zosoma\[gpu\]"):
        get_ops("cuda")


def test_cupy_without_a_device_is_told_apart(fresh_probe, monkeypatch):
    class Runtime:
        @staticmethod
        def getDeviceCount():
            raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = type(sys)("cupy")
    fake.cuda = type(sys)("cupy.cuda")
    fake.cuda.runtime = Runtime
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert backend.cupy_or_none() is fake
    assert get_ops("auto").name == "cpu"
    with pytest.raises(ConfigError, match="CuPy found no device: cudaErrorNoDevice"):
        get_ops("cuda")


def test_array_module_and_to_numpy():
    x = np.arange(3)
    assert get_array_module(x) is np
    assert to_numpy([1, 2]).tolist() == [1, 2]
    assert to_numpy(x) is x


def test_only_the_backend_imports_cupy():
    offenders = []
    for path in sorted((ROOT / "zosoma").rglob("*.py")):
        if path.name == "backend.py":
            continue
        for line in path.read_text().splitlines():
            if re.match(r"\s*(import|from)\s+cupy\b", line):
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders, offenders


# --- the device check script ----------------------------------------------------------------------

@pytest.mark.subprocess
def test_gpu_check_dry_run():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, str(ROOT / "studies" / "gpu_check.py"), "--dry-run"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    if backend.cuda_device_count() == 0:
        assert "no CUDA device" in result.stdout


def test_gpu_check_times_the_step_at_soma_sizes_and_counts_its_launches(rt):
    """The device check's step at SOMA's expert sizes (studies/gpu_check.py, SOMA_SHAPES) runs the
    trainer's step on the device runtime and counts its launches as docs/gpu.md does. The kernels
    path: per step one perturb, one cell kernel per timestep, one log-softmax, one fused update
    (T + 3 kernels); one recurrent GEMM per timestep, the layer-0 table and the logits (T + 2
    GEMMs). The fused path (the engine's choice at this size): the fused forward and the update.
    The graph path: the perturb kernel, the graph, the update."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "studies" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert (16, 20) in check.SOMA_SHAPES and check.SOMA_STEP == dict(P=64, B=8, T=32)
    sync = (lambda: None) if rt.xp is np else rt.xp.cuda.runtime.deviceSynchronize
    T = 5
    model = ModelConfig(embed=16, hidden=20, layers=1)
    name, tokens_per_s, seconds, _ = check.device_step(rt.xp, model, P=2, B=2, T=T, sync=sync, steps=1,
                                                       name="E=16 H=20", path="kernels")
    assert name.startswith("E=16 H=20 kernels step P=2") and tokens_per_s > 0 and seconds > 0
    assert f"launches/step {T + 3} kernels + {T + 2} GEMMs" in name, name
    name, *_ = check.device_step(rt.xp, model, P=2, B=2, T=T, sync=sync, steps=1, name="E=16 H=20")
    assert name.endswith("launches/step 2 kernels + 0 GEMMs"), name
    name, *_ = check.device_step(rt.xp, model, P=2, B=2, T=T, sync=sync, steps=1, name="E=16 H=20", path="graph")
    assert name.endswith("launches/step 2 kernels + 0 GEMMs + 1 graph"), name  # perturb, the graph, the update


def test_trainer_and_evaluation_on_the_device_match_the_cpu(rt, tmp_path):
    """--device cuda: the Trainer's population losses (SPSA and EGGROLL) and streaming evaluation
    run on the device (here the runtime of the `rt` fixture) and agree with the CPU path."""
    from zosoma.config import TrainConfig
    from zosoma.corpus import BatchSampler, Corpus
    from zosoma.model.evaluate import evaluate_bytes
    from zosoma.training.trainer import Trainer, new_state

    model = TINY_MODEL_L2
    cfg = TrainConfig(optimizer="sgd", steps=2, batch=3, seq_len=12, perturbations=3)
    text = np.frombuffer(b"a forward-only trainer checks its device path " * 20, np.uint8)
    sampler = BatchSampler(Corpus(("t",), (text,)), cfg.seq_len + 1)
    cpu = Trainer(tmp_path / "cpu", model, cfg, sampler, new_state(model, cfg), ops=Ops())
    dev = Trainer(tmp_path / "dev", model, cfg, sampler, new_state(model, cfg), ops=cuda_ops.CudaOps())
    for a, b in zip(cpu.losses(), dev.losses()):
        assert_close(b, a, rtol=1e-5, name="device vs cpu losses")
    egg = TrainConfig(steps=2, batch=3, seq_len=12, perturbations=3, optimizer="eggroll", rank=2)
    cpu_e = Trainer(tmp_path / "cpu_e", model, egg, sampler, new_state(model, egg), ops=Ops())
    dev_e = Trainer(tmp_path / "dev_e", model, egg, sampler, new_state(model, egg), ops=cuda_ops.CudaOps())
    for a, b in zip(cpu_e.losses(), dev_e.losses()):
        assert_close(b, a, rtol=1e-5, name="EGGROLL device vs cpu losses")
    theta = cpu.state.theta
    assert_close(evaluate_bytes(theta, Layout(model), text, cuda_ops.CudaOps(), streams=3, segment=50).nats,
                 evaluate_bytes(theta, Layout(model), text, Ops(), streams=3, segment=50).nats, rtol=1e-5,
                 name="eval")


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "eggroll", "es", "onesided"])
def test_a_device_resident_run_matches_the_cpu_run(rt, tmp_path, monkeypatch, optimizer):
    """--device cuda keeps theta and the optimizer state on the device: a few training steps of the
    same seed end within float tolerance of the CPU run (sgd: the fused update kernel), and theta
    reaches the host only when a checkpoint is written."""
    from zosoma.config import TrainConfig
    from zosoma.corpus import BatchSampler, Corpus
    from zosoma.training.folder import RunFolder
    from zosoma.training.trainer import Trainer, new_state, train

    model = ModelConfig(embed=8, hidden=12, layers=2)
    extra = {"eggroll": dict(eps=0.01, lr=0.5, rank=2), "es": dict(eps=0.02, lr=0.002),
             "momentum": dict(lr=0.05, momentum=0.8), "adam": dict(lr=0.01, weight_decay=0.01)}
    cfg = TrainConfig(steps=4, batch=3, seq_len=10, perturbations=4, optimizer=optimizer, checkpoint_every=4,
                      **extra.get(optimizer, dict(lr=0.2, weight_decay=0.01)))
    text = np.frombuffer(b"the device keeps the weights where the work is " * 20, np.uint8)
    sampler = BatchSampler(Corpus(("t",), (text,)), cfg.seq_len + 1)
    ops = cuda_ops.CudaOps()
    to_host = []
    monkeypatch.setattr(type(ops), "to_numpy", lambda self, x: to_host.append(np.shape(x)) or to_numpy(x))
    cpu = Trainer(tmp_path / "cpu", model, cfg, sampler, new_state(model, cfg), ops=Ops())
    dev = Trainer(tmp_path / "dev", model, cfg, sampler, new_state(model, cfg), ops=ops)
    for _ in train(cpu):
        pass
    records = list(train(dev))
    d = Layout(model).size
    # the only weights that reached the host: the checkpoint at step 4 (theta and the state)
    assert to_host.count((d,)) == 1 + len(dev.state.optimizer), to_host
    assert len(records) == 5
    a, b = RunFolder(tmp_path / "cpu").read_checkpoint(), RunFolder(tmp_path / "dev").read_checkpoint()
    assert_close(b.theta, a.theta, rtol=1e-4, atol=1e-5, name=f"{optimizer} device vs cpu theta")
    for k in a.optimizer:  # sums of estimates: the scalars (L+ - L-) / 2eps magnify float32 rounding
        scale = float(np.abs(a.optimizer[k]).max())
        assert_close(b.optimizer[k], a.optimizer[k], atol=5e-3 * scale, name=f"{optimizer} state {k}")
