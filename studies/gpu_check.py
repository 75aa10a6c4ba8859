"""Device check of zosoma's CUDA backend: validate every kernel against the CPU code, then time it.

For a machine with an NVIDIA GPU and CuPy, Numba and PyTorch (a CUDA build) already installed;
nothing is installed or downloaded. Run from a checkout (no install needed):

    bash studies/gpu_check.sh [TABLE_FILE]          # or: python studies/gpu_check.py --out TABLE_FILE

1. Validation, on fresh random inputs, every output buffer (and every float buffer cuda_ops.py
   allocates) filled with NaN first, so an element a kernel skips shows up: Philox known answers;
   Rademacher noise, populations, estimates and fused updates bit-identical to zosoma.model.noise /
   zosoma.engines.ops at the paper expert's size; Gaussian ones within float32 rounding; the LSTM cell and
   log-softmax/NLL kernels against float64 NumPy; population_loss, spsa_losses, nll_stream,
   log_probs and population_nll against the Numba forward and the NumPy reference;
   eggroll_population_loss against zosoma.engines.cpu.lowrank's CPU forward; the fused small-expert
   kernels (kernels/fused.cu) against Numba and bitwise against the materialised population, N
   separate launches and N separate updates; a captured and a replayed graph step against the
   kernels path; the default path of a model too large for the fused kernel (E=48 H=96: the graph)
   against the kernels path; routing on the device (route.cu) against the host's router: the
   embedding, the experts, the weights (gpu_check_extra). Each line prints its max abs and
   relative error.
2. Timing at the paper expert size (zosoma.config.PRESETS["paper"]: E=508, H=496, L=2): population
   forward tokens/s for M members (M=64, B=8, T=128) against (a) PyTorch's cuDNN nn.LSTM run once per
   member, as a PyTorch user would evaluate SPSA perturbations, and (b) one cuDNN model on all M*B
   sequences at once (shared weights: the speed SPSA could reach if members cost nothing extra);
   EGGROLL's low-rank population forward (r = 1) at M = 64 and 1,024 members, whose "vs zosoma" is
   its per-member speed-up over the dense forward; then the SPSA step (population build + forward +
   fused update) at P = 64, 256, 1024. Everything in fp32: TF32 is off for torch, and CuPy uses
   fp32 GEMMs unless CUPY_TF32 is set.
   Then the same step at the expert sizes SOMA trains best (SOMA_SHAPES: E x H, L = 1; P = 64,
   B = 8, T = 32), where it is bound by kernel launches (docs/gpu.md): each row also counts its
   launches per step, zosoma's raw kernels and its batched GEMMs, on each path of the population
   forward (the per-timestep kernels, those captured as a graph, the fused kernel where it fits);
   then the step of N = 1, 16, 64 such experts on each path (zosoma.benchmarks.bench_launches).
   Then the same population forward with tensor-core GEMMs (TF32, bf16), its tokens/s and its
   error on SPSA's loss differences against fp32 (printed with the validation, as information).
3. Routed top-4 inference (zosoma.benchmarks.bench_route, as `zosoma bench route --device cuda`): tokens/s of
   N = 8 vs N = 256 experts of ~2.0M parameters in all, on the CPU (1 BLAS thread) and on the GPU,
   same ensembles and held-out windows, routing on each device; the rows the GPU's experts computed
   against those needed; the GPU's nats/byte are checked against the CPU's.
4. A short price of zero-order (`zosoma compare price-quick --device cuda`, gpu_check_extra): one-sided
   SPSA and backprop (PyTorch on the same GPU) 300 steps each, GPU-seconds to the first held-out
   levels; its runs are kept beside the table (price-quick/).

The table is printed last and written to --out, with the seconds each part took (the budget: 5
minutes on an H200). A part that raises is a failed check; the others still run. Exit status: 0
every check passed (or --dry-run), 1 a check failed (each named last on stderr), 2 no CUDA device
(nothing checked). --dry-run only imports what the check needs
and reports whether a device is there (CI runs it on machines without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_extra beside it

import gpu_check_extra as extra  # noqa: E402
import numpy as np  # noqa: E402

from zosoma.arrays import to_numpy  # noqa: E402
from zosoma.config import PRESETS, VOCAB, ModelConfig, TrainConfig  # noqa: E402
from zosoma.engines.cpu import forward  # noqa: E402
from zosoma.engines.cpu import lowrank as eggroll  # noqa: E402
from zosoma.engines.cuda import backend  # noqa: E402
from zosoma.engines.cuda import cuda_forward, cuda_noise, cuda_ops, custom_kernels, fused_forward  # noqa: E402
from zosoma.engines.cuda.launches import Launches  # noqa: E402
from zosoma.engines.ops import Ops, perturbed  # noqa: E402
from zosoma.model import reference  # noqa: E402
from zosoma.model.noise import noise  # noqa: E402
from zosoma.model.params import Layout, init_params  # noqa: E402
from zosoma.model.population import Population  # noqa: E402
from zosoma.strategies.onesided import one_sided  # noqa: E402

NO_DEVICE = 2
BUDGET_S = 300  # the whole check on an H200 (issue 47, item 7)
PHILOX_KAT = [  # Random123 kat_vectors, philox4x32_10
    ((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
NOISE_KEYS = [(0, 0, 0, 0), (2**40 + 12345, 1, 99, 17), (2**63 + 5, 7, 3, 1023)]
SOMA_SHAPES = ((16, 20), (8, 12), (32, 64), (20, 40))  # E x H of SOMA's best experts (L = 1)
SOMA_STEP = dict(P=64, B=8, T=32)  # the step they train with


class Checks:
    """Validation rows: name, max abs error, max relative error (to max |reference|), tolerance."""

    def __init__(self):
        self.rows = []

    def compare(self, name, got, want, atol=0.0, rtol=0.0, exact=False, info=False):
        got = np.asarray(to_numpy(got), np.float64)
        want = np.asarray(want, np.float64)
        if got.shape != want.shape:
            self._add(name, float("nan"), float("nan"), f"shape {got.shape} != {want.shape}", False)
            return
        diff = np.abs(got - want)
        max_abs = float(np.nanmax(diff)) if diff.size else 0.0
        scale = float(np.abs(want).max()) if want.size else 0.0
        max_rel = max_abs / scale if scale else max_abs
        finite = bool(np.isfinite(got).all())
        if exact:
            ok, tol = finite and np.array_equal(got, want), "bit-identical"
        else:
            ok, tol = finite and bool((diff <= atol + rtol * np.abs(want)).all()), f"atol {atol:g} rtol {rtol:g}"
        if info:
            ok, tol = finite, "(info)"
        if not finite:
            tol += f"; {int((~np.isfinite(got)).sum())} non-finite"
        self._add(name, max_abs, max_rel, tol, ok)

    def _add(self, name, max_abs, max_rel, tol, ok):
        self.rows.append((name, max_abs, max_rel, tol, ok))
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: max abs {max_abs:.3g}, max rel {max_rel:.3g} ({tol})",
              flush=True)

    @property
    def failed(self):
        return [r for r in self.rows if not r[4]]


@contextlib.contextmanager
def poisoned_allocations(cp):
    """cupy.empty / empty_like return NaN-filled float arrays while active."""
    empty, empty_like = cp.empty, cp.empty_like

    def fill(a):
        if a.dtype.kind == "f":
            a.fill(np.nan)
        return a

    cp.empty = lambda *args, **kwargs: fill(empty(*args, **kwargs))
    cp.empty_like = lambda *args, **kwargs: fill(empty_like(*args, **kwargs))
    try:
        yield
    finally:
        cp.empty, cp.empty_like = empty, empty_like


def validate(cp, checks: Checks, rng):
    paper = Layout(PRESETS["paper"][0])
    d = paper.size
    nan = lambda shape: cp.full(shape, np.nan, np.float32)  # noqa: E731

    print("noise and SPSA kernels (paper expert, d = {:,})".format(d), flush=True)
    out = cp.full((len(PHILOX_KAT), 4), 0xDEADBEEF, np.uint32)
    counters = cp.asarray(np.array([c for c, _ in PHILOX_KAT], np.uint32))
    custom_kernels.launch("philox_blocks", len(PHILOX_KAT), counters, out, len(PHILOX_KAT))
    checks.compare("philox4x32-10 known answers", out, np.array([e for _, e in PHILOX_KAT]), exact=True)
    for key in NOISE_KEYS:
        for kind, start in (("rademacher", 0), ("rademacher", 384), ("gaussian", 0), ("gaussian", 8)):
            n = d - start
            x = nan(n)
            cuda_noise.add_noise(x, cp.zeros(n, np.float32), 1.0, *key, kind, start)
            want = noise(n, *key, kind, start)
            if kind == "rademacher":
                checks.compare(f"add_noise {kind} key={key} start={start}", x, want, exact=True)
            else:
                checks.compare(f"add_noise {kind} key={key} start={start}", x, want, atol=1e-5)
    theta = init_params(PRESETS["paper"][0], 1)
    theta_d = cp.asarray(theta)
    for kind in ("rademacher", "gaussian"):
        members = range(5, 9)
        got = cuda_noise.perturbed(theta_d, 1e-3, members, 2**33 + 7, 1, 4, kind, out=nan((8, d)))
        want = perturbed(theta, Population(9, 1e-3, 2**33 + 7, 1, 4, kind), members)
        if kind == "rademacher":
            checks.compare(f"perturbed {kind} 4 directions", got, want, exact=True)
        else:
            checks.compare(f"perturbed {kind} 4 directions", got, want, atol=1e-8, rtol=1e-6)
        coeffs = rng.standard_normal(64) * 5
        pop = Population(64, 1.0, 11, 1, 3, kind)
        ghat = Ops().noise_sum(coeffs, d, pop)
        got = cuda_noise.spsa_gradient(coeffs, d, 11, 1, 3, kind)
        new = Ops().sgd_update(theta, coeffs, pop, 0.003, 0.01)
        upd = cuda_noise.spsa_update(theta_d, coeffs, 0.003, 11, 1, 3, kind, 0.01, out=nan(d))
        if kind == "rademacher":
            checks.compare(f"spsa_gradient {kind} P=64", got, ghat, exact=True)
            checks.compare(f"spsa_update (fused SGD, wd) {kind} P=64", upd, new, exact=True)
        else:
            checks.compare(f"spsa_gradient {kind} P=64", got, ghat, atol=1e-5, rtol=1e-5)
            checks.compare(f"spsa_update (fused SGD, wd) {kind} P=64", upd, new, atol=1e-7, rtol=1e-6)

    # 64-bit offsets: a population of more than 2**31 floats (10 GB), its last rows checked
    P = 2**31 // (2 * d) + 2
    try:
        big = cuda_noise.perturbed(theta_d, 1e-3, range(P), 9, 0, 0, "rademacher")
    except cp.cuda.memory.OutOfMemoryError:  # a GPU under 10 GB: said, not hidden; anything else fails
        checks._add("perturbed beyond 2**31 elements: not run (out of device memory)", 0.0, 0.0, "not run", True)
    else:
        want = perturbed(theta, Population(P, 1e-3, 9, 0, 0), range(P - 1, P))
        checks.compare(f"perturbed {2 * P} rows x d = {2 * P * d:,} elements, last 2 rows", big[-2:], want,
                       exact=True)
        del big

    print("LSTM kernels (paper widths, random inputs, vs float64 NumPy)", flush=True)
    M, B, H, Tc, t, T = 4, 8, 496, 16, 5, 40
    G = 4 * H
    f32 = lambda *shape: (rng.standard_normal(shape) * 2).astype(np.float32)  # noqa: E731
    gates, table, bias, c0, xproj = f32(M, B, G), f32(M, VOCAB, G), f32(M, G), f32(M, B, H), f32(M, Tc, B, G)
    out_b = f32(M, VOCAB)
    tokens = rng.integers(0, VOCAB, (M, B, T + 1), dtype=np.uint8)
    tok = cp.asarray(tokens)[..., :-1]
    sm, sb = cuda_forward._byte_strides(tok, M)
    c, h, hs = cp.asarray(c0.copy()), nan((M, B, H)), nan((M, Tc, B, H))
    custom_kernels.launch("lstm_cell_embed", M * B * H, cp.asarray(gates), cp.asarray(table), tok, sm, sb, 30,
                          cp.asarray(bias), c, h, hs, M, B, H, Tc, t)
    x = table[np.arange(M)[:, None], tokens[:, :, 30]]
    want_h, want_c = reference.lstm_cell(gates.astype(np.float64) + x + bias[:, None], c0.astype(np.float64))
    checks.compare("lstm_cell_embed h", h, want_h, atol=1e-6, rtol=1e-5)
    checks.compare("lstm_cell_embed c", c, want_c, atol=1e-6, rtol=1e-5)
    checks.compare("lstm_cell_embed hs[:, t]", hs[:, t], want_h, atol=1e-6, rtol=1e-5)
    c, h, hs = cp.asarray(c0.copy()), nan((M, B, H)), nan((M, Tc, B, H))
    custom_kernels.launch("lstm_cell_proj", M * B * H, cp.asarray(gates), cp.asarray(xproj), cp.asarray(bias),
                          c, h, hs, M, B, H, Tc, t)
    want_h, want_c = reference.lstm_cell(gates.astype(np.float64) + xproj[:, t] + bias[:, None], c0.astype(np.float64))
    checks.compare("lstm_cell_proj h", h, want_h, atol=1e-6, rtol=1e-5)
    checks.compare("lstm_cell_proj c", c, want_c, atol=1e-6, rtol=1e-5)
    logits = (f32(M, Tc, B, VOCAB) * 3)
    tgt = cp.asarray(tokens)[..., 1:]
    nll, logp = nan((M, B, T)), nan((M, B, T, VOCAB))
    t0 = 8
    custom_kernels.launch("log_softmax_nll", M * Tc * B, cp.asarray(logits), cp.asarray(out_b), tgt,
                          *cuda_forward._byte_strides(tgt, M), nll, logp, 1, M, B, T, t0, Tc)
    z = logits.astype(np.float64).transpose(0, 2, 1, 3) + out_b[:, None, None]
    checks.compare("log_softmax_nll nll", nll[:, :, t0:t0 + Tc], reference.nll(z, tokens[:, :, 1 + t0:1 + t0 + Tc]),
                   atol=1e-5, rtol=1e-6)
    checks.compare("log_softmax_nll logp", logp[:, :, t0:t0 + Tc], reference.log_softmax(z), atol=1e-5, rtol=1e-6)

    print("forward (vs the Numba forward and the float64 NumPy reference)", flush=True)
    for scale in (1.0, 3.0):  # the initialisation (near-uniform predictions) and saturated gates
        theta_s = (theta * scale).astype(np.float32)
        thetas = perturbed(theta_s, Population(4, 0.05, 3, 0, 0), range(4))  # (8, d)
        batch = rng.integers(0, VOCAB, (8, 129), dtype=np.uint8)
        got = cuda_forward.population_loss(cp.asarray(thetas), paper, batch)
        checks.compare(f"population_loss paper M=8 B=8 T=128 init*{scale:g} vs numba", got,
                       forward.population_loss(thetas, paper, batch), rtol=2e-5)
        want = [reference.loss(thetas[m].astype(np.float64), paper, batch) for m in range(2)]
        checks.compare(f"population_loss paper init*{scale:g} vs float64 reference (2 members)", got[:2], want,
                       rtol=2e-5)
    small = Layout(ModelConfig(embed=24, hidden=40, layers=3))
    thetas = (init_params(small.config, 2) * 3 + 0.3 * rng.standard_normal((16, small.size))).astype(np.float32)
    per_member = rng.integers(0, VOCAB, (16, 3, 300), dtype=np.uint8)  # several time chunks
    want = [reference.loss(thetas[m].astype(np.float64), small, per_member[m]) for m in range(16)]
    checks.compare("population_loss E=24 H=40 L=3, per-member batches, T=299",
                   cuda_forward.population_loss(thetas, small, per_member), want, rtol=1e-5)
    theta_small = thetas[0]
    data = rng.integers(0, VOCAB, (4, 201), dtype=np.uint8)
    first, state = cuda_forward.nll_stream(theta_small, small, data[:, :120], data[:, 1:121])
    second, _ = cuda_forward.nll_stream(theta_small, small, data[:, 120:-1], data[:, 121:], state)
    want, _ = forward.nll_stream(theta_small, small, data[:, :-1], data[:, 1:])
    checks.compare("nll_stream in two segments (state carried) vs numba", np.concatenate([first, second], 1), want,
                   atol=1e-4)
    logp, _ = cuda_forward.log_probs(theta_small, small, data[:, 120:-1], state)
    want, _ = forward.log_probs(theta_small, small, data[:, 120:-1], state)
    checks.compare("log_probs from a carried state vs numba", logp, want, atol=1e-4)
    batch = rng.integers(0, VOCAB, (8, 129), dtype=np.uint8)
    plus, minus = cuda_forward.spsa_losses(theta_d, paper, batch, 8, 1e-3, 5, 0, 1, "rademacher")
    cpu_plus, cpu_minus = Ops().perturbed_losses(theta, paper, batch, Population(8, 1e-3, 5, 0, 1))
    checks.compare("spsa_losses paper P=8 L+ and L- vs numba", np.stack([plus, minus]), np.stack([cpu_plus, cpu_minus]),
                   rtol=2e-5)
    checks.compare("spsa_losses paper P=8 coefficients (L+ - L-)/2eps vs numba", (plus - minus) / 2e-3,
                   (cpu_plus - cpu_minus) / 2e-3, info=True)

    print("routed inference and EGGROLL (vs the CPU code)", flush=True)
    models = [thetas[m] for m in range(3)]  # E=24 H=40 L=3
    shared = rng.integers(0, VOCAB, (4, 151), dtype=np.uint8)
    want = np.stack([forward.nll_stream(t, small, shared[:, :-1], shared[:, 1:])[0] for t in models])
    checks.compare("population_nll 3 models, shared rows vs numba nll_stream",
                   cuda_forward.population_nll(models, small, shared[:, :-1], shared[:, 1:]), want, atol=1e-4)
    own = per_member[:3, :, :200]
    want = np.stack([forward.nll_stream(t, small, b[:, :-1], b[:, 1:])[0] for t, b in zip(models, own)])
    checks.compare("population_nll 3 models, one batch each vs numba nll_stream",
                   cuda_forward.population_nll(cp.asarray(np.stack(models)), small, own[..., :-1], own[..., 1:]), want,
                   atol=1e-4)
    args = (0.3, 2, 2**33 + 1, 1, 7, 3)  # sigma, r, seed, expert, step, n_pairs
    theta64 = theta_small.astype(np.float64)
    checks.compare("eggroll_population_loss E=24 H=40 L=3 r=2 vs float64 CPU",
                   cuda_forward.eggroll_population_loss(theta_small, small, per_member[0], *args),
                   eggroll.eggroll_population_loss(theta64, small, per_member[0], *args), rtol=1e-5)
    theta_s = theta * np.float32(3.0)  # saturated gates, as for population_loss above
    for r in (1, 4):
        batch = rng.integers(0, VOCAB, (8, 129), dtype=np.uint8)
        args = (1e-2, r, 5, 0, 3, 4)
        checks.compare(f"eggroll_population_loss paper init*3 r={r} M=8 vs CPU float32",
                       cuda_forward.eggroll_population_loss(theta_s, paper, batch, *args),
                       eggroll.eggroll_population_loss(theta_s, paper, batch, *args), rtol=2e-5)


def validate_fused(cp, checks: Checks, rng):
    """The fused small-expert kernels (kernels/fused.cu) at SOMA's expert size: against Numba, and
    bitwise against the materialised population, N separate launches and N separate updates."""
    print("fused small-expert kernels (E=16 H=20)", flush=True)
    soma = Layout(ModelConfig(embed=16, hidden=20, layers=1))
    thetas = np.stack([init_params(soma.config, 0, n) for n in range(3)])
    batches = rng.integers(0, VOCAB, (3, 8, 33), dtype=np.uint8)
    pops = [Population(8, 1e-2, 2**33 + n, n, 7 + n, "rademacher") for n in range(3)]
    pops[1] = one_sided(pops[1])  # one expert of one-sided SPSA: its own member table
    plus, minus = fused_forward.spsa_losses(thetas[0], soma, batches[0], pops[0])
    want = Ops().perturbed_losses(thetas[0], soma, batches[0], pops[0])
    checks.compare("fused spsa_losses E=16 H=20 P=8 B=8 T=32 vs numba", np.concatenate([plus, minus]),
                   np.concatenate(want), rtol=1e-5)
    members = cuda_noise.perturbed(thetas[0], 1e-2, range(8), pops[0].seed, 0, pops[0].step, "rademacher")
    checks.compare("fused members vs the perturb kernel's, through the same kernel",
                   np.stack([plus, minus], 1).ravel(), fused_forward.population_loss(members, soma, batches[0]),
                   exact=True)
    together = fused_forward.experts_losses(thetas, soma, batches, pops)
    alone = [fused_forward.spsa_losses(thetas[n], soma, batches[n], pops[n]) for n in range(3)]
    checks.compare("fused 3 experts in one launch vs 3 launches", np.concatenate([np.concatenate(x) for x in together]),
                   np.concatenate([np.concatenate(x) for x in alone]), exact=True)
    coeffs = rng.standard_normal((3, 8))
    pops = [Population(8, 1e-2, 2**33 + n, n, 7 + n, "rademacher") for n in range(3)]
    updated = fused_forward.experts_update(thetas, coeffs, pops, 0.1, 0.01)
    alone = [cuda_noise.spsa_update(thetas[n], coeffs[n], 0.1, p.seed, p.expert, p.step, p.kind, 0.01)
             for n, p in enumerate(pops)]
    checks.compare("experts_update 3 experts vs 3 spsa_update", updated, cp.stack(alone), exact=True)
    for step in (0, 1):  # step 0 captures the graph, step 1 replays it with new counters and a new batch
        args = (thetas[0], soma, batches[step], 8, 1e-2, 5, 0, step, "rademacher")
        with cuda_forward.forced_path("kernels"):
            want = np.concatenate(cuda_forward.spsa_losses(*args))
        with cuda_forward.forced_path("graph"):
            got = np.concatenate(cuda_forward.spsa_losses(*args))
        # the same kernels and GEMMs; the graph's nll is summed on the host, the kernels path's on the device
        checks.compare(f"graph step {step} ({'captured' if step == 0 else 'replayed'}) vs the kernels path", got, want,
                       rtol=1e-12)


def experts_timing() -> str:
    """zosoma.benchmarks.bench_launches on the device: launches and seconds per SOMA step of N =
    1, 16, 64 experts of E=16 H=20, today's path against the fused kernels."""
    from zosoma.benchmarks.bench_launches import count_launches, format_launches

    print("timing: SOMA steps of N experts, kernels vs fused", flush=True)
    return format_launches(count_launches(rt=custom_kernels.runtime(), timed_steps=5), "counted and timed here")


def _timed(fn, sync, repeats=3):
    """Median seconds of fn() after one warm-up, synchronising the device around each call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def timing(cp, rows: list, M=64, B=8, T=128, perturbations=(64, 256, 1024), eggroll_members=(64, 1024)):
    config = PRESETS["paper"][0]
    layout = Layout(config)
    sync = cp.cuda.runtime.deviceSynchronize
    rng = np.random.default_rng(1)
    batch = rng.integers(0, VOCAB, (B, T + 1), dtype=np.uint8)
    theta = cp.asarray(init_params(config, 0))
    thetas = cuda_noise.perturbed(theta, 1e-3, range(M // 2), 0, 0, 0, "rademacher")
    tokens = M * B * T
    print(f"timing: population forward M={M} B={B} T={T}", flush=True)
    s = _timed(lambda: cuda_forward.population_loss(thetas, layout, batch), sync)
    rows.append((f"zosoma population_loss, M={M} members", tokens / s, s, None))
    base = tokens / s
    try:
        import torch
    except ImportError as e:
        rows.append((f"torch unavailable ({e})", None, None, None))
        torch = None
    if torch is not None and torch.cuda.is_available():
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        dev = torch.device("cuda")
        torch.manual_seed(0)
        embed = torch.nn.Embedding(VOCAB, config.embed).to(dev)
        lstm = torch.nn.LSTM(config.embed, config.hidden, config.layers, batch_first=True).to(dev)
        linear = torch.nn.Linear(config.hidden, VOCAB).to(dev)
        data = torch.from_numpy(batch.astype(np.int64)).to(dev)

        def loss(x):
            hidden, _ = lstm(embed(x[:, :-1]))
            return torch.nn.functional.cross_entropy(linear(hidden).reshape(-1, VOCAB), x[:, 1:].reshape(-1))

        def per_member():  # M separate forwards, each its own small cuDNN call (weights not swapped)
            with torch.no_grad():
                return torch.stack([loss(data) for _ in range(M)]).cpu()

        everything = data.repeat(M, 1)  # (M*B, T+1): one model, all sequences

        def all_at_once():
            with torch.no_grad():
                return loss(everything).cpu()

        s = _timed(per_member, torch.cuda.synchronize)
        rows.append((f"torch cuDNN nn.LSTM once per member, M={M} x B={B}", tokens / s, s, tokens / s / base))
        s = _timed(all_at_once, torch.cuda.synchronize)
        rows.append((f"torch cuDNN nn.LSTM, one model on M*B={M * B} sequences", tokens / s, s, tokens / s / base))
        del embed, lstm, linear
        torch.cuda.empty_cache()
    elif torch is not None:
        rows.append(("torch has no CUDA device", None, None, None))
    thetas = None  # frees the population's device memory

    for members in eggroll_members:
        print(f"timing: EGGROLL population forward M={members} r=1", flush=True)
        s = _timed(lambda: cuda_forward.eggroll_population_loss(theta, layout, batch, 1e-3, 1, 0, 0, 0, members // 2),
                   sync)
        tokens_e = members * B * T
        rows.append((f"zosoma eggroll_population_loss r=1, M={members} ({s / members * 1e3:.2f} ms/member)",
                     tokens_e / s, s, tokens_e / s / base))

    for P in perturbations:
        rows.append(device_step(cp, config, P, B, T, sync))
    rows.append(device_step(cp, config, 64, B, T, sync, optimizer="eggroll"))
    rows.append((f"SOMA's expert sizes, L=1, P={SOMA_STEP['P']} B={SOMA_STEP['B']} T={SOMA_STEP['T']}:", None, None, None))
    for E, H in SOMA_SHAPES:
        config = ModelConfig(embed=E, hidden=H, layers=1)
        for path in cuda_forward.PATHS:
            if path != "fused" or fused_forward.fits(Layout(config), SOMA_STEP["B"]):
                rows.append(device_step(cp, config, **SOMA_STEP, sync=sync, steps=10, name=f"E={E} H={H}",
                                        path=path))


ENGINE_MODULES = (cuda_ops, cuda_forward, cuda_noise)  # each calls zosoma.arrays.to_numpy by its own name


class Transfers:
    """Counts host <-> device copies while active: cupy.asarray of a host array (to the device) and
    zosoma's to_numpy of a device array (to the host), with their bytes."""

    def __init__(self, cp):
        self.cp, self.up, self.down, self.up_bytes, self.down_bytes = cp, 0, 0, 0, 0

    def __enter__(self):
        self._asarray, self._to_numpy = self.cp.asarray, cuda_ops.to_numpy

        def asarray(x, *args, **kwargs):
            if isinstance(x, np.ndarray):
                self.up, self.up_bytes = self.up + 1, self.up_bytes + x.nbytes
            return self._asarray(x, *args, **kwargs)

        def down(x):
            out = self._to_numpy(x)
            if isinstance(x, self.cp.ndarray):
                self.down, self.down_bytes = self.down + 1, self.down_bytes + out.nbytes
            return out

        self.cp.asarray = asarray
        for module in ENGINE_MODULES:
            module.to_numpy = down
        return self

    def __exit__(self, *exc):
        self.cp.asarray = self._asarray
        for module in ENGINE_MODULES:
            module.to_numpy = self._to_numpy


def device_step(cp, config, P, B, T, sync, optimizer="sgd", steps=3, name=None, path=None):
    """The trainer's own step on the CUDA engine (zosoma.training.trainer, theta resident on the
    device): seconds split into data, forward (the perturbed population, its noise built by the
    perturb kernel inside), update (the fused regenerate-and-apply kernel, synchronised), and the
    host <-> device copies and kernel launches of one step, counted. The noise alone is timed
    separately. `name` (default: the optimizer) begins the row's label; `path` forces the
    population forward's path (cuda_forward.PATHS; default: the engine's choice)."""
    import tempfile

    from zosoma.corpus import BatchSampler, Corpus
    from zosoma.training.trainer import Trainer, new_state

    name = (name or optimizer) + (f" {path}" if path else "")
    print(f"timing: {name} training step on the device, P={P}", flush=True)
    text = np.random.default_rng(3).integers(0, VOCAB, 1 << 20, dtype=np.uint8)
    extra = {"eps": 0.01, "lr": 1.0} if optimizer == "eggroll" else {"lr": 1e-4}
    cfg = TrainConfig(steps=1000, batch=B, seq_len=T, perturbations=P, optimizer=optimizer,
                      checkpoint_every=10**6, **extra)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(tmp, config, cfg, BatchSampler(Corpus(("random",), (text,)), T + 1),
                          new_state(config, cfg), ops=cuda_ops.CudaOps())
        split = []
        for i in range(steps + 1):  # the first step is a warm-up
            forced = cuda_forward.forced_path(path) if path else contextlib.nullcontext()
            with forced, Transfers(cp) as copies, Launches(cp) as launches:
                plus, minus = trainer.losses()
                t0 = time.perf_counter()
                trainer.update(*trainer.coefficients(plus, minus))
                sync()
                update = time.perf_counter() - t0
            if i:
                split.append((trainer.timings["data"], trainer.timings["forward"], update, copies, launches))
    data, fwd, upd = (float(np.median([s[k] for s in split])) for k in range(3))
    c, n = split[-1][3:]
    noise = 0.0
    if optimizer == "sgd":
        theta = trainer.state.theta
        noise = _timed(lambda: cuda_noise.perturbed(theta, 1e-3, range(min(P, 64)), 0, 0, 1, "rademacher"), sync)
        noise *= P / min(P, 64)
    total = data + fwd + upd
    tokens = 2 * P * B * T
    what = "fused SGD" if optimizer == "sgd" else "low-rank"
    return (f"{name} step P={P}: data {data * 1e3:.1f} ms, forward {fwd * 1e3:.1f} ms (noise ~{noise * 1e3:.1f}), "
            f"{what} update {upd * 1e3:.1f} ms; copies/step {c.up} up {c.up_bytes:,} B, {c.down} down {c.down_bytes:,} B; "
            f"launches/step {n.kernels} kernels + {n.gemms} GEMMs" + (f" + {n.graphs} graph" if n.graphs else ""),
            tokens / total, total, None)


def tensor_cores(cp, checks: Checks, rows: list, sync, M=64, B=8, T=128, P=8):
    """The paper expert's population forward with tensor-core GEMMs (TF32, bf16: cuBLAS's compute
    type, zosoma.engines.cuda.tensor_cores) against fp32: tokens/s, and its error on SPSA's loss
    differences L+ - L- at eps = 16 steps of the format (P directions, theta = 3 x init), printed
    beside the fp32 forward's; and its losses against the CPU's emulation of the same GEMMs
    (zosoma.experiments.gemm_precision, which predicts that error without a device)."""
    from zosoma.engines.cuda.tensor_cores import gemm_format
    from zosoma.experiments.gemm_precision import gemm_loss, gemm_step

    layout = Layout(PRESETS["paper"][0])
    batch = np.random.default_rng(5).integers(0, VOCAB, (B, T + 1), dtype=np.uint8)
    theta = init_params(layout.config, 0)
    thetas = cuda_noise.perturbed(cp.asarray(theta), 1e-3, range(M // 2), 0, 0, 0, "rademacher")
    base = _timed(lambda: cuda_forward.population_loss(thetas, layout, batch), sync)
    theta3 = (theta * 3).astype(np.float32)
    for fmt in ("tf32", "bf16"):
        print(f"timing: population forward M={M} with {fmt} tensor-core GEMMs", flush=True)
        with gemm_format(fmt):
            s = _timed(lambda: cuda_forward.population_loss(thetas, layout, batch), sync)
        rows.append((f"zosoma population_loss, M={M}, {fmt} tensor-core GEMMs", M * B * T / s, s, base / s))
        eps = 16 * gemm_step(theta3, fmt)
        args = (cp.asarray(theta3), layout, batch, P, eps, 5, 0, 1, "rademacher")
        fp32 = cuda_forward.spsa_losses(*args)
        with gemm_format(fmt):
            plus, minus = cuda_forward.spsa_losses(*args)
        checks.compare(f"paper P={P} L+ - L- with {fmt} GEMMs vs fp32, eps 16 {fmt} steps", plus - minus,
                       fp32[0] - fp32[1], info=True)
        members = perturbed(theta3, Population(P, eps, 5, 0, 1), range(1))  # direction 0: +, -
        checks.compare(f"population_loss paper with {fmt} GEMMs vs its CPU emulation (2 members)",
                       [plus[0], minus[0]], [gemm_loss(m, layout, batch, fmt) for m in members], info=True)


def routed_timing(checks: Checks) -> str:
    """bench_route on the CPU and the GPU (same ensembles and windows): its table, and a check that
    the GPU's nats/byte match the CPU's."""
    from zosoma.benchmarks.bench_route import bench_route, format_route

    print("timing: routed top-4 inference, N=8 vs N=256, cpu and cuda", flush=True)
    records = bench_route(repeats=2, devices=("cpu", "cuda"))
    nats = {(r["n_experts"], r["device"]): r["nats_per_byte"] for r in records if r["name"] != "ratio"}
    for N in sorted({N for N, _ in nats}):
        checks.compare(f"routed top-4 N={N} nats/byte, cuda vs cpu", nats[N, "cuda"], nats[N, "cpu"], rtol=1e-5)
    return format_route(records)


def table(device_line: str, checks: Checks, rows: list, routed: str = "", took: list = ()) -> str:
    lines = [f"zosoma gpu_check  {time.strftime('%Y-%m-%d %H:%M')}  {device_line}", "",
             f"validation: {len(checks.rows) - len(checks.failed)} of {len(checks.rows)} passed",
             f"  {'check':<66} {'max abs':>9} {'max rel':>9}  result"]
    for name, max_abs, max_rel, tol, ok in checks.rows:
        lines.append(f"  {name:<66} {max_abs:>9.2g} {max_rel:>9.2g}  {'PASS' if ok else 'FAIL'} ({tol})")
    if rows:
        m = PRESETS["paper"][0]
        lines += ["", f"timing, paper expert (E={m.embed} H={m.hidden} L={m.layers}, {m.n_params():,} parameters), "
                      f"fp32, median after a warm-up",
                  f"  {'path':<66} {'tokens/s':>12} {'s/call':>9} {'vs zosoma':>9}"]
        for name, tps, s, ratio in rows:
            tps_s = f"{tps:>12,.0f}" if tps else f"{'-':>12}"
            s_s = f"{s:>9.4f}" if s else f"{'-':>9}"
            r_s = f"{ratio:>9.3f}" if ratio else f"{'':>9}"
            lines.append(f"  {name:<66} {tps_s} {s_s} {r_s}")
    if routed:
        lines += ["", routed]
    if took:
        total = sum(s for _, s in took)
        lines += ["", f"seconds per part: {', '.join(f'{name} {s:.0f}' for name, s in took)}; {total:.0f} s in all "
                      f"(budget {BUDGET_S} s{': OVER' if total > BUDGET_S else ''})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="import, look for a device, check nothing")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.txt"),
                        help="file the table is written to (default: $OUT/gpu_check.txt)")
    parser.add_argument("--skip-timing", action="store_true", help="validation only")
    args = parser.parse_args(argv)
    custom_kernels._signatures()  # the kernel sources parse
    why = backend.cuda_unavailable_reason()
    if why is not None:
        print(f"gpu_check: no CUDA device ({why}); nothing checked")
        return 0 if args.dry_run else NO_DEVICE
    cp = backend.require_cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    device_line = (f"{name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
                   f"Python {platform.python_version()}, CUPY_TF32={os.environ.get('CUPY_TF32', 'unset')}")
    print(f"gpu_check: {device_line}", flush=True)
    if args.dry_run:
        return 0
    checks, rows, took, texts = Checks(), [], [], {}

    def part(name, fn):
        """fn() timed; an exception is a failed check (the table is still written), not the end."""
        start = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  any failure of a part: said in the table, exit status 1
            checks._add(f"{name}: raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120],
                        float("nan"), float("nan"), "raised", False)
            import traceback
            traceback.print_exc()
        finally:
            took.append((name, time.perf_counter() - start))
            print(f"{name} took {took[-1][1]:.0f} s", flush=True)

    rng = np.random.default_rng(2024)
    with poisoned_allocations(cp):
        part("validation", lambda: validate(cp, checks, rng))
        part("fused", lambda: validate_fused(cp, checks, np.random.default_rng(2025)))
        part("default path", lambda: extra.validate_default_path(checks, np.random.default_rng(2026)))
        part("routing", lambda: extra.validate_routing(checks))
    if not args.skip_timing:
        sync = cp.cuda.runtime.deviceSynchronize
        part("paper timing", lambda: timing(cp, rows))
        part("tensor cores", lambda: tensor_cores(cp, checks, rows, sync))
        texts["steps"] = part("SOMA steps", experts_timing)
        texts["routed"] = part("routed", lambda: routed_timing(checks))
        texts["price"] = part("price", lambda: extra.price_quick("cuda", Path(args.out).parent / "price-quick"))
    extras = "".join(f"\n{texts[k]}\n" for k in ("steps", "price") if texts.get(k))
    text = table(device_line, checks, rows, texts.get("routed") or "", took) + extras
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print("\n" + text + f"(written to {args.out})")
    if checks.failed:
        print(f"gpu_check: {len(checks.failed)} of {len(checks.rows)} checks FAILED: "
              + "; ".join(r[0] for r in checks.failed), file=sys.stderr)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
