"""Routed inference on the device in row tiles (zosoma.engines.cuda.grouped): each selected
expert's rows padded to a tile, not to the largest expert, and all experts of one size in one
population forward whose launches do not grow with N; the nats those of the CPU path. Runs on the
emulated runtime of tests/test_kernels.py (and on CuPy where there is a GPU)."""

from types import SimpleNamespace

import numpy as np
import pytest

from helpers import assert_close
from test_kernels import LOSS_RTOL, NLL_ATOL, emulated_libs, rt  # noqa: F401  the CUDA engine's runtimes
from zosoma.config import ModelConfig
from zosoma.engines.cuda import cuda_ops
from zosoma.engines.cuda.grouped import MIN_TILE, PAD_LIMIT, choose_tile, tile_plan, tiles_needed
from zosoma.engines.cuda.launches import RowCounter
from zosoma.mixture.routing import Ensemble, Segments, mix_nll, run_selected, segment_sums, top_k
from zosoma.model.params import Layout, init_params


def _loads(N: int, rows: int, seed: int = 0) -> np.ndarray:
    """Rows per expert of an unbalanced routing: Zipf-like popularity, some experts unused."""
    p = 1.0 / np.arange(1, N + 1) ** 1.1
    return np.random.default_rng(seed).multinomial(rows, p / p.sum())


def test_a_tile_pads_each_expert_a_little_not_to_the_largest():
    counts = [int(c) for c in _loads(256, 4096) if c]  # the benchmark's shape: 4,096 rows, N = 256
    assert max(counts) > 200 and min(counts) < 8  # as unbalanced as the first device run's (1 .. 251)
    tile = choose_tile(counts)
    computed = tiles_needed(counts, tile) * tile
    assert tile == MIN_TILE and computed <= 1.3 * sum(counts)  # padding every expert to the largest: 30x
    plan = tile_plan(counts, tile)
    assert plan.size == tiles_needed(counts, tile) and np.all(np.diff(plan) >= 0)
    np.testing.assert_array_equal(np.bincount(plan), -(-np.array(counts) // tile))
    # a few large experts (N = 8: batches of 256 rows) run as one tile per batch, as before
    assert choose_tile([256] * 16) == 256 and choose_tile([5]) == MIN_TILE
    assert choose_tile([256, 256, 100]) == 128  # 256 would compute 768 rows for 612, past PAD_LIMIT
    for counts in ([256, 256, 100], [3, 17, 40, 9], [64] * 5):
        tile = choose_tile(counts)
        assert tiles_needed(counts, tile) * tile <= PAD_LIMIT * sum(counts) or tile == MIN_TILE


def test_top_k_is_the_stable_sort_without_sorting_everything():
    """Router.select's top-k: the K largest of each row, largest first, ties by lower index, the
    same indices as a stable argsort (dropped experts score -inf; integer scores tie often)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        S, N = int(rng.integers(1, 40)), int(rng.integers(1, 300))
        K = int(rng.integers(1, N + 1))
        scores = rng.integers(-5, 5, (S, N)).astype(np.float64) if trial % 2 else rng.standard_normal((S, N))
        if trial % 3 == 0:
            scores[:, rng.integers(0, N, max(1, N // 4))] = -np.inf
        got = top_k(scores, K)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.argsort(-scores, axis=1, kind="stable")[:, :K])


@pytest.mark.parametrize("N, balanced", [(8, True), (48, False)])
def test_routed_rows_in_tiles_match_the_cpu_in_launches_independent_of_n(rt, N, balanced):
    """run_selected on the device engine against the CPU's, per position and as the mixture's
    nats/byte, for 8 experts of balanced loads and 48 of unbalanced (N = 256-like) ones; rows
    computed within 1.3x of those needed, and one launch list whatever N: the layer-0 table, then
    per time step one batched GEMM and one cell kernel, then the logits and the log-softmax."""
    layout = Layout(ModelConfig(embed=4, hidden=8, layers=1))
    experts = tuple(((init_params(layout.config, 7, i) * 3).astype(np.float32), layout) for i in range(N))
    ensemble = Ensemble(experts, SimpleNamespace(n_experts=N))
    rng = np.random.default_rng(N)
    S, K, context, scored = 256, 4, 6, 4
    segs = Segments.from_windows(rng.integers(0, 256, (S, context + scored), dtype=np.uint8), context)
    p = np.ones(N) if balanced else 1.0 / np.arange(1, N + 1) ** 1.1
    chosen = np.stack([rng.choice(N, K, replace=False, p=p / p.sum()) for _ in range(S)])  # (S, K)
    weights = rng.dirichlet(np.ones(K), S).astype(np.float32)
    want = run_selected(ensemble, segs, chosen, batch=256)
    ops = cuda_ops.CudaOps()
    with RowCounter() as count:
        got = run_selected(ensemble.on(ops), segs, chosen, batch=256, ops=ops)
    mask = segs.mask()[:, None]
    assert_close(np.where(mask, got, 0), np.where(mask, want, 0), atol=NLL_ATOL, name="routed nll")
    nats = [segment_sums(mix_nll(x, weights), segs.mask()).sum() / segs.n_bytes for x in (got, want)]
    assert_close(nats[0], nats[1], rtol=LOSS_RTOL, name="routed nats/byte")
    assert S * K <= count.rows <= 1.3 * S * K, count.rows
    T = segs.tokens.shape[1]
    assert (count.kernels, count.gemms) == (T + 1, T + 2)  # the same for N = 8 and N = 48


@pytest.mark.slow
def test_bench_route_on_the_device_prints_rows_computed_and_launches_per_step(rt, monkeypatch):
    """`zosoma bench route --device cuda` on the runtime at hand: per N, the rows its forward
    computed against the rows needed (segments x top-k) and the experts' launches per time step;
    the CPU computes exactly the rows needed; both devices give the same nats/byte."""
    from zosoma.benchmarks import bench_route as bench
    from zosoma.engines import get_ops

    engines = {"cpu": get_ops("cpu"), "cuda": cuda_ops.CudaOps()}
    monkeypatch.setattr(bench, "get_ops", lambda device, gemm="fp32": engines[device])
    monkeypatch.setattr(bench, "_PAUSE_S", 0.0)
    records = bench.bench_route(n_small=16, n_large=4, total_params=300_000, n_segments=32, repeats=1,
                                threads=None, devices=("cpu", "cuda"))
    per_n = {(r["n_experts"], r["device"]): r for r in records if r["name"] != "ratio"}
    for N in (4, 16):
        cpu, dev = per_n[N, "cpu"], per_n[N, "cuda"]
        assert cpu["rows_needed"] == dev["rows_needed"] == 32 * 4 and cpu["rows_computed"] == 128
        assert 128 <= dev["rows_computed"] <= PAD_LIMIT * 128 + MIN_TILE * N
        assert cpu["launches_per_step"] is None and 2 <= dev["launches_per_step"] < 3
        assert_close(dev["nats_per_byte"], cpu["nats_per_byte"], rtol=LOSS_RTOL, name=f"N={N} nats/byte")
    text = bench.format_route(records)
    assert "rows" in text and "launch/t" in text and f"x of {128:,}" in text
