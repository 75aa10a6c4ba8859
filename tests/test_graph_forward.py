"""The kernels path's forward captured once as a graph and replayed (zosoma.engines.cuda.graph_forward).

On the emulated runtime a capture records the launch list (kernels, GEMMs, copies, fills) without
running it and a replay runs it, as a CUDA graph does; so a replayed step must give the bits of
the uncaptured kernels path: any argument the graph baked in that should have changed (a step
counter, an input's address) shows up as a difference on the second step. On a GPU the graph's
nll is summed on the host and the kernels path's on the device: equal within GRAPH_RTOL.
"""

import numpy as np
import pytest

from helpers import assert_close
from test_kernels import _bytes, _model, emulated_libs, rt  # noqa: F401 (fixtures)
from zosoma.engines.cuda import cuda_forward, graph_forward
from zosoma.engines.cuda.launches import Launches
from zosoma.model.population import Population
from zosoma.strategies.onesided import one_sided

GRAPH_RTOL = 1e-12  # float64 sums of the same float32 nll in two orders


def assert_same(rt, got, want):
    """Bit for bit on the emulated runtime; within GRAPH_RTOL on a GPU."""
    for g, w in zip(got, want):
        if rt.xp is np:
            np.testing.assert_array_equal(g, w)
        else:
            assert_close(g, w, rtol=GRAPH_RTOL, name="graph vs kernels")


@pytest.mark.parametrize("layers, onesided", [(1, False), (2, True)])
def test_a_replayed_step_gives_the_bits_of_an_uncaptured_one(rt, layers, onesided):
    theta, layout = _model(8, 12, layers, scale=1.0)
    for step in range(3):  # step 0 captures, 1 and 2 replay with new counters and batches
        batch = _bytes(10 + step, (3, 9))
        args = (theta, layout, batch, 5, 1e-2, 7, 1, step, "rademacher")
        pop = Population(*args[3:5], *args[6:])
        pop = one_sided(pop) if onesided else pop
        with cuda_forward.forced_path("kernels"):
            want = cuda_forward.spsa_losses(*args, table=(pop.direction, pop.sign))
        with cuda_forward.forced_path("graph"), Launches(rt.xp) as n:
            got = cuda_forward.spsa_losses(*args, table=(pop.direction, pop.sign))
        assert_same(rt, got, want)
        if step:  # a replayed step: perturb, then the graph
            assert (n.kernels, n.gemms, n.graphs) == (1, 0, 1)
    assert list(graph_forward._graphs[rt]) == [(layout.config, 10, 3, 8, "fp32")]


def test_chunks_of_pairs_share_a_graph_per_shape(rt):
    """Pairs in chunks (a small workspace): the full chunks replay one graph, the last, shorter
    chunk another; the losses are the kernels path's bits."""
    theta, layout = _model(6, 10, 1, scale=1.0)
    batch = _bytes(3, (2, 7))
    per_direction = 2 * (4 * layout.size + cuda_forward.member_bytes(layout, 2, 6))
    args = (theta, layout, batch, 5, 1e-2, 3, 0, 4, "gaussian", 2 * per_direction)  # chunks of 2 pairs
    with cuda_forward.forced_path("kernels"):
        want = cuda_forward.spsa_losses(*args)
    with cuda_forward.forced_path("graph"):
        cuda_forward.spsa_losses(*args)  # captures
        with Launches(rt.xp) as n:
            got = cuda_forward.spsa_losses(*args)
    assert_same(rt, got, want)
    assert (n.kernels, n.gemms, n.graphs) == (3, 0, 3) and sorted(k[1] for k in graph_forward._graphs[rt]) == [2, 4]


def test_the_emulated_graph_bakes_in_its_arguments(rt):
    """What makes the test above meaningful: a captured launch replays with the arguments it was
    captured with (here the perturb kernel's step counter), as a CUDA graph does."""
    from zosoma.engines.cuda import cuda_noise

    if rt.xp is not np:
        pytest.skip("a check of the emulated runtime's capture")
    theta = np.zeros(64, np.float32)
    out = np.full((2, 64), np.nan, np.float32)
    graph = rt.capture(lambda: cuda_noise.perturbed(theta, 1.0, range(1), 0, 0, 0, "rademacher", out=out))
    assert np.isnan(out).all()  # captured, not run
    graph.replay()
    step0 = out.copy()
    cuda_noise.perturbed(theta, 1.0, range(1), 0, 0, 1, "rademacher", out=out)
    assert not np.array_equal(out, step0)
    graph.replay()
    np.testing.assert_array_equal(out, step0)


@pytest.mark.parametrize("layers, B, T", [(1, 3, 8), (2, 2, 700)])  # T=700 at B=2: two chunks of 512 steps
def test_kernels_launches_counts_the_kernels_path(rt, layers, B, T):
    """The count step_path decides by is what the kernels path launches (the perturb kernel aside)."""
    theta, layout = _model(4, 6, layers, scale=1.0)
    with cuda_forward.forced_path("kernels"), Launches(rt.xp) as n:
        cuda_forward.spsa_losses(theta, layout, _bytes(1, (B, T + 1)), 1, 1e-2, 0, 0, 0, "rademacher")
    assert n.kernels + n.gemms == 1 + cuda_forward.kernels_launches(layout, B, T)


def test_the_default_path_by_shape():
    """Decided by launches: SOMA's experts fit the fused kernel; a member too large for shared
    memory whose kernels path launches less than DEVICE_FLOPS x HOST_S_PER_LAUNCH of work each
    takes the graph; the paper's expert at P = 64 carries enough per launch to stay on the kernels."""
    from zosoma.config import PRESETS, ModelConfig
    from zosoma.engines.cuda import custom_kernels
    from zosoma.engines.cuda.launches import RecordingRuntime
    from zosoma.model.params import Layout

    def path(E, H, L, B=8, T=32, P=64):
        return cuda_forward.step_path(Layout(ModelConfig(embed=E, hidden=H, layers=L)), B, T, 2 * P)

    with custom_kernels.using(RecordingRuntime()):  # an H200's 227 KB of shared memory per block
        assert [path(E, H, 1) for E, H in ((16, 20), (8, 12), (20, 40), (32, 64))] == ["fused"] * 4
        assert [path(48, 96, 1), path(128, 256, 2, T=128)] == ["graph", "graph"]
        paper = PRESETS["paper"][0]
        assert path(paper.embed, paper.hidden, paper.layers, T=128) == "kernels"
        assert path(paper.embed, paper.hidden, paper.layers, T=128, P=4) == "graph"  # few members: launch-bound
        with cuda_forward.forced_path("kernels"):
            assert path(48, 96, 1) == "kernels"


def test_a_step_too_large_for_shared_memory_replays_a_graph_by_default(rt, monkeypatch):
    """Where fused does not fit (here: no shared memory at all) a small model's step is perturb +
    one graph replay, with the kernels path's bits."""
    monkeypatch.setattr(rt, "max_shared", 0)
    theta, layout = _model(8, 12, 1, scale=1.0)
    args = (theta, layout, _bytes(5, (3, 9)), 4, 1e-2, 7, 1, 2, "rademacher")
    assert cuda_forward.step_path(layout, 3, 8, 8) == "graph"
    with cuda_forward.forced_path("kernels"):
        want = cuda_forward.spsa_losses(*args)
    cuda_forward.spsa_losses(*args)  # captures
    with Launches(rt.xp) as n:
        got = cuda_forward.spsa_losses(*args)
    assert_same(rt, got, want)
    assert (n.kernels, n.gemms, n.graphs) == (1, 0, 1)
