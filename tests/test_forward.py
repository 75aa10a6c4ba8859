"""The Numba forward (zosoma.engines.cpu.forward) against the NumPy reference, run in float64 as ground truth.

Shapes stay tiny so the file also passes quickly with NUMBA_DISABLE_JIT=1. Parameters are scaled up
from the default initialisation so gates saturate and predictions are far from uniform (with the
default init every model predicts about ln 256 and a loss check would prove little).
"""

import numpy as np
import pytest

from helpers import assert_close, random_bytes, scaled_model, streamed_in_halves
from world import TINY_MODEL_L2
from zosoma.engines.cpu import forward, row_kernels
from zosoma.model import reference
from zosoma.config import VOCAB
from zosoma.model.params import Layout, init_params

LOSS_RTOL = 1e-5  # mean loss vs the float64 reference (the accuracy requirement)
NLL_ATOL = 1e-4  # per-position nats and log-probabilities


@pytest.fixture(autouse=True, params=["blas", "loops"])
def gemm_path(request, monkeypatch):
    """Every test on both GEMM paths of the forward (BLAS calls, compiled loops)."""
    monkeypatch.setenv(forward.GEMM_ENV, request.param)
    return request.param


def _ref_loss(theta, layout, batch):
    return reference.loss(theta.astype(np.float64), layout, batch)


def _ref_nll(theta, layout, tokens, targets, state=None):
    logits, state = reference.forward(theta.astype(np.float64), layout, tokens, state)
    return reference.nll(logits, targets), state


def test_model_is_not_trivial():
    theta, layout = scaled_model(16, 16, 1)
    data = random_bytes(0, (2, 31))
    nll, _ = _ref_nll(theta, layout, data[:, :-1], data[:, 1:])
    assert nll.std() > 0.5  # confident, varied predictions: the checks below can fail


@pytest.mark.parametrize("embed, hidden, layers, B, T", [
    (8, 16, 1, 3, 5),
    (12, 8, 2, 2, 37),
    (16, 16, 2, 1, 1),
    (5, 7, 1, 1, 37),
    (24, 12, 3, 4, 9),
])
def test_loss_matches_reference(embed, hidden, layers, B, T):
    theta, layout = scaled_model(embed, hidden, layers)
    batch = random_bytes(1, (B, T + 1))
    loss = forward.population_loss(theta[None], layout, batch)
    assert loss.shape == (1,) and loss.dtype == np.float64
    assert_close(loss[0], _ref_loss(theta, layout, batch), rtol=LOSS_RTOL, name="loss")


def test_loss_matches_reference_at_full_width():
    # E = H = 512 (the benchmark width): the rational tanh, the exp and float32 GEMMs with
    # K = 512..1024 must still hold the loss to 1e-5 relative.
    theta, layout = scaled_model(512, 512, 2, scale=1.5)
    batch = random_bytes(2, (2, 9))
    loss = forward.population_loss(theta[None], layout, batch)
    assert_close(loss[0], _ref_loss(theta, layout, batch), rtol=LOSS_RTOL, name="loss E=H=512")


def test_population_shared_and_per_member_batches():
    M, B, T = 4, 3, 11
    _, layout = scaled_model(10, 12, 2)
    thetas = np.stack([scaled_model(10, 12, 2, seed=m)[0] for m in range(M)])
    shared = random_bytes(3, (B, T + 1))
    per_member = random_bytes(4, (M, B, T + 1))
    loss_shared = forward.population_loss(thetas, layout, shared)
    loss_each = forward.population_loss(thetas, layout, per_member)
    assert loss_shared.shape == loss_each.shape == (M,)
    assert_close(loss_shared, [_ref_loss(thetas[m], layout, shared) for m in range(M)],
                 rtol=LOSS_RTOL, name="shared batch")
    assert_close(loss_each, [_ref_loss(thetas[m], layout, per_member[m]) for m in range(M)],
                 rtol=LOSS_RTOL, name="per-member batches")
    assert len(set(loss_shared.round(6))) == M  # members really differ


def test_population_member_order_does_not_matter():
    # Work buffers are reused across members: nothing may leak from one member to the next.
    _, layout = scaled_model(6, 8, 2)
    thetas = np.stack([scaled_model(6, 8, 2, seed=m)[0] for m in range(3)])
    batch = random_bytes(5, (2, 40))  # T = 39: several output rows, carried c and h
    forward_order = forward.population_loss(thetas, layout, batch)
    reverse_order = forward.population_loss(thetas[::-1].copy(), layout, batch)[::-1]
    assert_close(forward_order, reverse_order, rtol=0.0, name="member order")


def test_long_sequence_spans_several_chunks(monkeypatch):
    monkeypatch.setattr(forward, "_ROWS_PER_CHUNK", 8)  # B = 2: chunks of 4 steps, last one short
    theta, layout = scaled_model(6, 10, 2)
    batch = random_bytes(6, (2, 15))
    loss = forward.population_loss(theta[None], layout, batch)
    assert_close(loss[0], _ref_loss(theta, layout, batch), rtol=LOSS_RTOL, name="chunked loss")


def test_nll_stream_carries_state():
    theta, layout = scaled_model(9, 11, 2)
    data = random_bytes(7, (3, 26))
    tokens, targets = data[:, :-1], data[:, 1:]
    whole, state_whole, first, state, second, state_halves = streamed_in_halves(forward.nll_stream, theta, layout,
                                                                                 tokens, targets)
    ref, ref_state = _ref_nll(theta, layout, tokens, targets)
    ref_second, _ = _ref_nll(theta, layout, tokens[:, 10:], targets[:, 10:],
                             [(h.astype(np.float64), c.astype(np.float64)) for h, c in state])
    assert whole.shape == (3, 25) and whole.dtype == np.float32
    assert_close(whole, ref, atol=NLL_ATOL, rtol=0.0, name="one pass")
    assert_close(np.concatenate([first, second], axis=1), whole, atol=1e-5, rtol=0.0,
                 name="two halves vs one pass")
    assert_close(second, ref_second, atol=NLL_ATOL, rtol=0.0, name="second half, carried state")
    for layer in range(2):
        for k in range(2):
            assert_close(state_halves[layer][k], state_whole[layer][k], atol=1e-5, rtol=0.0)
            assert_close(state_whole[layer][k], ref_state[layer][k], atol=1e-5, rtol=0.0,
                         name=f"final state layer {layer}")
    assert_close(whole.mean(dtype=np.float64), _ref_loss(theta, layout, data), rtol=LOSS_RTOL)


def test_nll_stream_leaves_the_given_state_alone():
    theta, layout = scaled_model(4, 6, 1)
    state = [(np.full((2, 6), 0.25, np.float32), np.full((2, 6), -0.5, np.float32))]
    tokens = random_bytes(8, (2, 5))
    forward.nll_stream(theta, layout, tokens, tokens, state)
    assert (state[0][0] == 0.25).all() and (state[0][1] == -0.5).all()


def test_log_probs_normalised_and_match_reference():
    theta, layout = scaled_model(7, 9, 2)
    tokens = random_bytes(9, (2, 13))
    state = [(np.full((2, 9), 0.1 * (layer + 1), np.float32), np.full((2, 9), -0.3, np.float32))
             for layer in range(2)]
    logp, new_state = forward.log_probs(theta, layout, tokens, state)
    logits, ref_state = reference.forward(theta.astype(np.float64), layout, tokens,
                                          [(h.astype(np.float64), c.astype(np.float64))
                                           for h, c in state])
    assert logp.shape == (2, 13, VOCAB) and logp.dtype == np.float32
    assert_close(np.exp(logp.astype(np.float64)).sum(-1), np.ones((2, 13)), atol=1e-5, rtol=0.0,
                 name="probabilities sum to 1")
    assert_close(logp, reference.log_softmax(logits), atol=NLL_ATOL, rtol=0.0, name="log-probs")
    assert_close(new_state[1][0], ref_state[1][0], atol=1e-5, rtol=0.0, name="final h")
    nll, _ = forward.nll_stream(theta, layout, tokens[:, :-1], tokens[:, 1:], state)
    picked = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None].astype(np.intp), -1)[..., 0]
    assert_close(nll, picked, atol=1e-5, rtol=0.0, name="nll_stream vs log_probs")


def test_matches_torch():
    # An independent referee: torch's nn.LSTM built from zosoma's parameters (x @ W orientation,
    # gate blocks i, f, g, o; torch keeps two biases, here b_ih = bias, b_hh = 0).
    torch = pytest.importorskip("torch")
    theta, layout = scaled_model(10, 14, 2)
    p = layout.views(theta)
    E, H = 10, 14
    lstm = torch.nn.LSTM(E, H, 2, batch_first=True)
    with torch.no_grad():
        for layer in range(2):
            getattr(lstm, f"weight_ih_l{layer}").copy_(torch.from_numpy(p[f"lstm{layer}.w_ih"].T))
            getattr(lstm, f"weight_hh_l{layer}").copy_(torch.from_numpy(p[f"lstm{layer}.w_hh"].T))
            getattr(lstm, f"bias_ih_l{layer}").copy_(torch.from_numpy(p[f"lstm{layer}.bias"]))
            getattr(lstm, f"bias_hh_l{layer}").zero_()
        batch = random_bytes(10, (3, 21))
        x = torch.from_numpy(p["embed"])[torch.from_numpy(batch[:, :-1].astype(np.int64))]
        y, _ = lstm(x)
        logits = y @ torch.from_numpy(p["out.w"]) + torch.from_numpy(p["out.b"])
        targets = torch.from_numpy(batch[:, 1:].astype(np.int64)).reshape(-1)
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets)
    loss = forward.population_loss(theta[None], layout, batch)
    assert_close(loss[0], float(ref), rtol=1e-5, name="loss vs torch")


@pytest.mark.parametrize("column", [0, 77, 255])
def test_diverged_model_gives_non_finite_loss(column):
    theta, layout = scaled_model(4, 6, 1)
    bad = theta.copy()
    bad[layout["out.w"].offset + column] = np.nan  # one logit NaN, wherever the row max meets it
    thetas = np.stack([theta, bad])
    loss = forward.population_loss(thetas, layout, random_bytes(11, (2, 6)))
    assert np.isfinite(loss[0]) and not np.isfinite(loss[1])


def test_fast_math_helpers():
    x = np.linspace(-12, 12, 2001, dtype=np.float32)
    tanh = np.array([row_kernels._tanh(v) for v in x], np.float64)
    sig = np.array([row_kernels._sigmoid(v) for v in x], np.float64)
    x64 = x.astype(np.float64)
    assert_close(tanh, np.tanh(x64), atol=5e-7, rtol=0.0, name="tanh")
    assert_close(sig, 1 / (1 + np.exp(-x64)), atol=3e-7, rtol=0.0, name="sigmoid")
    d = np.linspace(-86, 0, 2001, dtype=np.float32)
    exp = np.array([row_kernels._exp_nonpos(v) for v in d], np.float64)
    assert_close(exp, np.exp(d.astype(np.float64)), rtol=5e-7, name="exp")


def test_rejects_bad_shapes():
    theta, layout = scaled_model(4, 6, 1)
    with pytest.raises(ValueError, match="theta"):
        forward.population_loss(theta, layout, random_bytes(0, (2, 5)))
    with pytest.raises(ValueError, match="batch"):
        forward.population_loss(np.stack([theta] * 3), layout, random_bytes(0, (2, 2, 5)))
    with pytest.raises(ValueError, match="uint8"):
        forward.population_loss(theta[None], layout, np.zeros((2, 5), np.int64))
    with pytest.raises(ValueError, match="targets"):
        forward.nll_stream(theta, layout, random_bytes(0, (2, 5)), random_bytes(0, (2, 4)))


@pytest.mark.parametrize("scored_from", [1, 37, 64])
def test_context_columns_skip_the_output_layer_and_change_nothing_after(scored_from):
    """Routed inference scores a segment after its context: with scored_from the context only
    carries the state (nll 0 there), and every scored column is bit for bit the full forward's,
    across chunk boundaries (T > the rows per chunk / B)."""
    layout = Layout(TINY_MODEL_L2)
    theta = init_params(layout.config, 5) * 2
    data = np.random.default_rng(3).integers(0, 256, (20, 97), dtype=np.uint8)
    full, full_state = forward.nll_stream(theta, layout, data[:, :-1], data[:, 1:])
    part, state = forward.nll_stream(theta, layout, data[:, :-1], data[:, 1:], scored_from=scored_from)
    assert np.array_equal(part[:, scored_from:], full[:, scored_from:])
    assert not part[:, :scored_from].any()
    for (h, c), (h2, c2) in zip(state, full_state):
        assert np.array_equal(h, h2) and np.array_equal(c, c2)
