"""Routed inference on the device: the selected experts' rows in tiles, one grouped forward.

Top-k routing sends each segment to K experts, and N = 256 small experts get very unequal loads
(1 to 251 rows of 4,096 in the benchmark). Padding every expert to the largest one (one
population member per expert) computed 46,184 rows for 4,096 needed on the first device run.
Here each expert's rows are sorted into tiles of `tile` rows, the last tile of an expert padded
with zero rows, and every tile is one member of ONE population forward (cuda_forward): per time
step one batched GEMM whose tile t reads the weights of its expert, plan[t], and one cell kernel,
whatever N is. Rows computed = tiles * tile.

The tile is chosen per call (choose_tile): the largest power of two from MIN_TILE up whose padded
rows stay within PAD_LIMIT of the rows needed, so a few large experts with many rows each run as
few large tiles (N = 8: one tile per batch of an expert, as before) and many small ones as small
tiles. Padding rows are zeros after the real rows of a tile and every row is independent in the
LSTM, so they change nothing the caller reads.
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.cuda.cuda_forward import population_nll
from zosoma.engines.cuda.custom_kernels import runtime, to_device
from zosoma.model.params import Layout

MIN_TILE = 8  # rows: a tile smaller than this makes the batched GEMMs too thin to be worth a tile each
PAD_LIMIT = 1.25  # rows computed / rows needed that a larger tile may cost


def tiles_needed(rows: list[int], tile: int) -> int:
    """Tiles of `tile` rows that hold jobs of rows[i] rows each, every job in its own tiles."""
    return sum(-(-r // tile) for r in rows)


def choose_tile(rows: list[int]) -> int:
    """The largest power-of-two tile >= MIN_TILE whose padding stays within PAD_LIMIT of the rows
    needed (MIN_TILE when none does), at most the largest job rounded up to a power of two."""
    need, tile = sum(rows), MIN_TILE
    while tile < max(rows) and tiles_needed(rows, 2 * tile) * 2 * tile <= PAD_LIMIT * need:
        tile *= 2
    return tile


def tile_plan(rows: list[int], tile: int) -> np.ndarray:
    """(tiles,) int64: the job whose rows each tile holds, jobs in order, ceil(rows[i] / tile) each."""
    return np.repeat(np.arange(len(rows)), [-(-r // tile) for r in rows]).astype(np.int64)


def grouped_nll(thetas: list, layout: Layout, rows: list[tuple], tile: int | None = None) -> list[np.ndarray]:
    """Nats (B_i, T_i) float32 of job i, model thetas[i] (d,) of `layout`, on its rows (tokens,
    targets) (B_i, T_i) uint8 from zero state, all jobs in one population forward of row tiles
    (tile: rows per tile, default choose_tile). Returns NumPy arrays in job order."""
    xp = runtime().xp
    counts = [tok.shape[0] for tok, _ in rows]
    tile = tile or choose_tile(counts)
    plan = tile_plan(counts, tile)
    T = max(tok.shape[1] for tok, _ in rows)
    tokens = np.zeros((plan.size, tile, T), np.uint8)  # (tiles, tile, T); padding rows stay 0
    targets = np.zeros_like(tokens)
    first = np.searchsorted(plan, np.arange(len(rows)))  # each job's first tile
    for i, (tok, tgt) in enumerate(rows):
        b, t = tok.shape
        span = slice(first[i], first[i] + -(-b // tile))
        tokens[span].reshape(-1, T)[:b, :t] = tok
        targets[span].reshape(-1, T)[:b, :t] = tgt
    members = xp.stack([to_device(theta) for theta in thetas])[xp.asarray(plan)]  # (tiles, d): gathered once
    nll = population_nll(members, layout, tokens, targets).reshape(-1, T)  # (tiles * tile, T)
    out = []
    for i, (tok, _) in enumerate(rows):
        b, t = tok.shape
        out.append(nll[first[i] * tile:first[i] * tile + b, :t])
    return out
