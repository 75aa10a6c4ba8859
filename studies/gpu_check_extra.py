"""The device check's parts for issue 47 (studies/gpu_check.py runs them): routing on the device
against the host's router, the default path of an SPSA step by shape, and a short price of
zero-order (`zosoma compare price-quick --device cuda`).

Each function takes the runtime's array module where it needs one, so that tests/test_gpu_check.py
runs them on the emulated runtime of tests/test_kernels.py at small sizes (a typo dies on the CPU,
not on the device).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np  # noqa: E402

from zosoma.config import VOCAB, ClusterConfig, ModelConfig  # noqa: E402
from zosoma.engines.cuda import cuda_forward, device_routing  # noqa: E402
from zosoma.model.params import Layout, init_params  # noqa: E402

ROUTE_CONTEXTS = 1024  # bench route's: 1,024 held-out contexts of 128 bytes
GRAPH_SHAPE = ModelConfig(embed=48, hidden=96, layers=1)  # too large for the fused kernel at B=8, launch-bound


def validate_routing(checks, contexts: int = ROUTE_CONTEXTS, clusters: int = 16, every: int = 8):
    """Ops.route on the device (zosoma.engines.cuda.device_routing) against Router.select on the
    host: a clustering of every `every`-th training chunk (fast settings), `contexts` held-out
    contexts of 128 bytes plus the edge cases (empty, 1 and 2 bytes, mixed lengths): the embedding
    within float32 rounding, the experts identical, the weights within ROUTE_RTOL."""
    from zosoma.corpus import BatchSampler, chunk, load_corpus
    from zosoma.mixture.cluster import fit_clusters
    from zosoma.mixture.routing import Router

    print(f"routing on the device ({contexts} contexts, N={clusters})", flush=True)
    train = chunk(load_corpus(None, "train"), 2048)
    part = type(train)(train.names[::every], train.docs[::every])
    clustering, _ = fit_clusters(part, ClusterConfig(n_clusters=clusters, restarts=1, iterations=5, seed=0))
    windows = BatchSampler(load_corpus(None, "heldout"), 128).batch(0, 0, 0, contexts)
    texts = [windows[s] for s in range(contexts)] + [windows[0, :0], windows[1, :1], windows[2, :2], windows[3, :77]]
    emb = device_routing.embed(clustering, texts)
    checks.compare(f"route_embed {len(texts)} contexts vs Clustering.embed", emb, clustering.embed(texts),
                   atol=1e-7, rtol=1e-6)
    for top_k, dropped in ((4, ()), (2, (0, 5))):
        router = Router(clustering, top_k, dropped=dropped)
        experts, weights = device_routing.select(router, texts)
        want_e, want_w = router.select(texts)
        checks.compare(f"device routing top-{top_k} dropped={list(dropped)}: experts vs the host's", experts, want_e,
                       exact=True)
        checks.compare(f"device routing top-{top_k} dropped={list(dropped)}: weights vs the host's", weights, want_w,
                       rtol=device_routing.ROUTE_RTOL)


def validate_default_path(checks, rng, P: int = 64, B: int = 8, T: int = 32, shape: ModelConfig = GRAPH_SHAPE):
    """The SPSA step's default path where a member does not fit shared memory but the kernels path
    is launch-bound (cuda_forward.step_path: the graph), captured and replayed, against the kernels
    path."""
    layout = Layout(shape)
    path = cuda_forward.step_path(layout, B, T, 2 * P)
    print(f"default path of E={shape.embed} H={shape.hidden} P={P} B={B} T={T}: {path}", flush=True)
    theta = init_params(shape, 0)
    for step in (0, 1):  # step 0 captures, step 1 replays with new counters and a new batch
        batch = rng.integers(0, VOCAB, (B, T + 1), dtype=np.uint8)
        args = (theta, layout, batch, P, 1e-2, 5, 0, step, "rademacher")
        with cuda_forward.forced_path("kernels"):
            want = np.concatenate(cuda_forward.spsa_losses(*args))
        got = np.concatenate(cuda_forward.spsa_losses(*args))
        checks.compare(f"default path ({path}) E={shape.embed} H={shape.hidden} step {step} vs the kernels path", got,
                       want, rtol=1e-12)


def price_quick(device: str, out: Path, plan: bool = False) -> str:
    """`zosoma compare price-quick --device DEVICE --executor inline --out OUT` in this process
    (zosoma/experiments/configs/price-quick.toml: one-sided SPSA and backprop, 300 steps each); its
    price table, read from OUT/results.md (with plan: the plan only). Raises on any failure."""
    from click.testing import CliRunner

    from zosoma.cli.main import cli

    print(f"timing: a short price of zero-order on {device} (compare price-quick)", flush=True)
    args = ["compare", "price-quick", "--device", device, "--executor", "inline", "--out", str(out)]
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, args + (["--plan"] if plan else []), catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"zosoma {' '.join(args)} failed ({result.exit_code}):\n{result.output}")
    if plan:
        return result.output
    report = (out / "results.md").read_text()
    start = report.find("## The price of zero-order")
    if start < 0:
        raise RuntimeError(f"no price table in {out / 'results.md'}")
    end = report.find("\n## ", start + 1)
    table = report[start:end if end > 0 else None].strip()
    return f"{table}\n\n(compare price-quick on {device}: {time.perf_counter() - t0:.0f} s in all, {out})"
