"""PyTorch as the independent referee of the NumPy reference (after llm.c's test_gpt2).

torch's own nn.Embedding + nn.LSTM + nn.Linear, loaded from zosoma's theta, must give the same logits,
loss and carried state; and SPSA's central differences of the reference loss must agree with torch
autograd's directional derivatives, one direction at a time and on average over many.

Shapes: B batch, T time, E embedding, H hidden, L layers, V = 256, P perturbations, d = len(theta).
Run with -s to see the achieved errors.
"""

import numpy as np
import pytest

from helpers import assert_close
from world import TINY_MODEL, TINY_MODEL_L2
from zosoma.model import reference
from zosoma.config import VOCAB, ModelConfig
from zosoma.model.noise import add_noise, noise
from zosoma.model.params import Layout, init_params

torch = pytest.importorskip("torch", reason="PyTorch, the referee, is in the test extra")
from torch_reference import torch_model  # noqa: E402


def make_theta(config, seed=0):
    """float32 theta (d,) with non-zero biases everywhere: init_params leaves out.b at zero, so it is
    perturbed (and the LSTM biases too). Values are float32, as zosoma's theta always is; the
    float64 tests upcast them exactly."""
    layout = Layout(config)
    theta = init_params(config, seed)
    rng = np.random.default_rng([seed, 77])
    layout.view(theta, "out.b")[:] = rng.normal(0.0, 0.5, VOCAB)
    for layer in range(config.layers):
        bias = layout.view(theta, f"lstm{layer}.bias")
        bias += rng.normal(0.0, 0.3, bias.shape).astype(np.float32)
    return theta, layout


def make_batch(B, T, seed=0):
    """(B, T+1) uint8 bytes: inputs [:, :-1], targets [:, 1:]."""
    return np.random.default_rng([seed, 99]).integers(0, 256, (B, T + 1), dtype=np.uint8)


def torch_loss(model, batch, state=None):
    """Mean cross-entropy (nats/byte) of torch's model on a (B, T+1) batch; also logits (B, T, V)
    and the final (h, c), each (L, B, H)."""
    tokens = torch.from_numpy(batch.astype(np.int64))
    logits, state = model(tokens[:, :-1], state)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    return loss, logits, state


def torch_flat_grad(theta, layout, batch):
    """torch autograd's gradient of the mean CE, mapped back into zosoma's flat layout (d,) float64:
    weights transposed back to "x @ W"; zosoma's single bias b = b_ih + b_hh, so dL/db equals
    dL/db_ih (and dL/db_hh, the same number), not their sum."""
    model = torch_model(theta, layout, torch.float64)
    loss, _, _ = torch_loss(model, batch)
    loss.backward()
    grad = np.zeros(layout.size, np.float64)
    g = layout.views(grad)
    g["embed"][...] = model.embedding.weight.grad.numpy()
    for layer in range(layout.config.layers):
        g[f"lstm{layer}.w_ih"][...] = getattr(model.lstm, f"weight_ih_l{layer}").grad.numpy().T
        g[f"lstm{layer}.w_hh"][...] = getattr(model.lstm, f"weight_hh_l{layer}").grad.numpy().T
        b_ih = getattr(model.lstm, f"bias_ih_l{layer}").grad.numpy()
        b_hh = getattr(model.lstm, f"bias_hh_l{layer}").grad.numpy()
        assert_close(b_hh, b_ih, atol=1e-15, rtol=1e-12, name="dL/db_hh vs dL/db_ih")
        g[f"lstm{layer}.bias"][...] = b_ih
    g["out.w"][...] = model.linear.weight.grad.numpy().T
    g["out.b"][...] = model.linear.bias.grad.numpy()
    return grad, loss.item()


def central_difference(theta, layout, batch, direction, eps):
    """SPSA's scalar g = (L(theta + eps d) - L(theta - eps d)) / (2 eps), with the reference loss."""
    plus = reference.loss(theta + eps * direction, layout, batch)
    minus = reference.loss(theta - eps * direction, layout, batch)
    return (plus - minus) / (2 * eps)


def directions(d, seed, kind, members):
    """(P, d) float64: members' perturbations of expert 0 at step 0, as SPSA draws them."""
    return np.stack([noise(d, seed, 0, 0, k, kind) for k in members]).astype(np.float64)


# --- 1. forward and loss --------------------------------------------------------------------------

SHAPES = [(8, 16, 1), (16, 8, 2), (32, 32, 2), (5, 7, 3)]


def test_torch_model_holds_theta_exactly():
    """The referee must see theta itself: float64 values that float32 cannot hold survive.
    (Loading a float64 state_dict into float32 modules and then calling .to(float64) would round
    every parameter to float32 first; build the modules in the target dtype, then load.)"""
    config = ModelConfig(embed=4, hidden=8, layers=2)
    theta, layout = make_theta(config)
    theta = theta.astype(np.float64) + 1e-9 * np.random.default_rng(3).standard_normal(layout.size)
    model = torch_model(theta, layout, torch.float64)
    p = layout.views(theta)
    got = {"embed": model.embedding.weight, "out.w": model.linear.weight.T,
           "out.b": model.linear.bias}
    for layer in range(config.layers):
        got[f"lstm{layer}.w_ih"] = getattr(model.lstm, f"weight_ih_l{layer}").T
        got[f"lstm{layer}.w_hh"] = getattr(model.lstm, f"weight_hh_l{layer}").T
        got[f"lstm{layer}.bias"] = (getattr(model.lstm, f"bias_ih_l{layer}")
                                    + getattr(model.lstm, f"bias_hh_l{layer}"))
    for name, tensor in got.items():
        assert tensor.dtype == torch.float64
        assert_close(tensor.detach().numpy(), p[name], atol=0, rtol=0, name=name)


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("E, H, L", SHAPES)
def test_forward_and_loss_match_torch(E, H, L, B, T):
    config = ModelConfig(embed=E, hidden=H, layers=L)
    theta32, layout = make_theta(config, seed=E + H + L)
    batch = make_batch(B, T, seed=B * 100 + T)

    # float64 on both sides
    theta64 = theta32.astype(np.float64)
    logits, _ = reference.forward(theta64, layout, batch[:, :-1])
    ref_loss = reference.loss(theta64, layout, batch)
    with torch.no_grad():
        t_loss, t_logits, _ = torch_loss(torch_model(theta64, layout, torch.float64), batch)
    assert logits.shape == (B, T, VOCAB) and logits.dtype == np.float64
    assert_close(logits, t_logits.numpy(), atol=1e-12, rtol=1e-12, name="float64 logits")
    rel64 = abs(ref_loss - t_loss.item()) / abs(t_loss.item())
    print(f"E={E} H={H} L={L} B={B} T={T}: float64 loss {ref_loss:.12f}, rel err vs torch {rel64:.2e}")
    assert rel64 < 1e-10

    # float32 on both sides (README: 1.2e-7 at worst over these shapes; studies/correctness.py)
    logits32, _ = reference.forward(theta32, layout, batch[:, :-1])
    ref_loss32 = reference.loss(theta32, layout, batch)
    with torch.no_grad():
        t_loss32, t_logits32, _ = torch_loss(torch_model(theta32, layout, torch.float32), batch)
    assert logits32.dtype == np.float32
    assert_close(logits32, t_logits32.numpy(), atol=1e-4, rtol=1e-5, name="float32 logits")
    rel32 = abs(ref_loss32 - t_loss32.item()) / abs(t_loss32.item())
    print(f"    float32 loss rel err vs torch float32 {rel32:.2e}")
    assert rel32 < 1e-6


@pytest.mark.parametrize("E, H, L", [(16, 8, 2), (5, 7, 3)])
def test_carried_state_matches_one_pass_and_torch(E, H, L):
    """T=10 then T=7 with the state carried over equals one T=17 pass, in zosoma and in torch."""
    config = ModelConfig(embed=E, hidden=H, layers=L)
    theta32, layout = make_theta(config, seed=5)
    theta = theta32.astype(np.float64)
    batch = make_batch(3, 17, seed=5)  # (B, 18)
    tokens = batch[:, :-1]

    whole, state = reference.forward(theta, layout, tokens)
    first, carried = reference.forward(theta, layout, tokens[:, :10])
    second, carried = reference.forward(theta, layout, tokens[:, 10:], carried)
    assert_close(np.concatenate([first, second], axis=1), whole, atol=1e-12, rtol=1e-12,
                 name="zosoma carried logits")
    for layer, ((h, c), (h2, c2)) in enumerate(zip(state, carried)):
        assert_close(h2, h, atol=1e-13, rtol=0, name=f"zosoma h{layer}")
        assert_close(c2, c, atol=1e-13, rtol=0, name=f"zosoma c{layer}")

    model = torch_model(theta, layout, torch.float64)
    t_tokens = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        t_whole, (t_h, t_c) = model(t_tokens)
        t_first, t_state = model(t_tokens[:, :10])
        t_second, (t_h2, t_c2) = model(t_tokens[:, 10:], t_state)
    t_carried = torch.cat([t_first, t_second], dim=1).numpy()
    assert_close(t_carried, t_whole.numpy(), atol=1e-12, rtol=1e-12, name="torch carried logits")
    assert_close(np.concatenate([first, second], axis=1), t_carried, atol=1e-12, rtol=1e-12,
                 name="zosoma vs torch carried logits")
    for layer, (h, c) in enumerate(carried):  # torch: (L, B, H)
        assert_close(h, t_h2[layer].numpy(), atol=1e-13, rtol=0, name=f"h{layer} vs torch")
        assert_close(c, t_c2[layer].numpy(), atol=1e-13, rtol=0, name=f"c{layer} vs torch")

    # the loss of the second segment, continuing from the carried state (targets batch[:, 11:])
    _, state10 = reference.forward(theta, layout, tokens[:, :10])
    seg_loss = reference.loss(theta, layout, batch[:, 10:], state10)
    with torch.no_grad():
        t_seg_loss, _, _ = torch_loss(model, batch[:, 10:], t_state)
    assert abs(seg_loss - t_seg_loss.item()) <= 1e-12 * abs(t_seg_loss.item())


# --- 2. SPSA directional derivatives vs autograd ---------------------------------------------------

DIRECTIONAL_CONFIG = TINY_MODEL_L2  # d = 10,112


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_directional_derivatives_match_autograd_float64(kind):
    """The error of a central difference is truncation, ~eps^2 times third derivatives, so it is
    measured against |grad| (a typical directional derivative; README figure: studies/correctness.py)."""
    theta32, layout = make_theta(DIRECTIONAL_CONFIG, seed=1)
    theta = theta32.astype(np.float64)
    batch = make_batch(3, 12, seed=1)
    grad, t_loss = torch_flat_grad(theta, layout, batch)
    assert abs(reference.loss(theta, layout, batch) - t_loss) < 1e-12 * t_loss
    scale = np.linalg.norm(grad)
    errors = []
    for k, delta in enumerate(directions(layout.size, 7, kind, range(8))):
        exact = grad @ delta
        g = central_difference(theta, layout, batch, delta, eps=1e-4)
        errors.append(abs(g - exact) / scale)
        assert abs(g - exact) <= 1e-6 * scale, f"member {k}: SPSA {g:.10g} vs autograd {exact:.10g}"
    print(f"float64 {kind}: max |SPSA - autograd| / |grad| {max(errors):.2e}")


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_directional_derivatives_match_autograd_float32(kind):
    """float32 theta and loss. The error is truncation (~eps^2: 3e-3 |grad| at eps = 1e-2, 3e-4 at
    3e-3) plus float32 rounding of the loss over 2 eps, so it is measured against the size of a
    typical directional derivative, E[(delta.grad)^2]^(1/2) = |grad| for both kinds: one Gaussian
    direction here has |delta.grad| = 0.007 |grad|, where a per-direction relative error means
    nothing in float32."""
    theta32, layout = make_theta(DIRECTIONAL_CONFIG, seed=1)
    batch = make_batch(3, 12, seed=1)
    grad, _ = torch_flat_grad(theta32.astype(np.float64), layout, batch)  # at the same point
    scale = np.linalg.norm(grad)
    errors = []
    for k, delta in enumerate(directions(layout.size, 7, kind, range(16))):
        exact = grad @ delta
        g = central_difference(theta32, layout, batch, delta.astype(np.float32), np.float32(3e-3))
        errors.append(abs(g - exact) / scale)
        assert abs(g - exact) <= 2e-3 * scale, f"member {k}: SPSA {g:.7g} vs autograd {exact:.7g}"
    print(f"float32 {kind}: max |SPSA - autograd| / |grad| {max(errors):.2e}")


# --- 3. the SPSA gradient estimate over many perturbations -------------------------------------------

def test_spsa_estimate_is_unbiased_with_the_predicted_cosine():
    """ghat = (1/P) sum_k g_k delta_k with Rademacher delta_k and, for small eps, g_k = delta_k . g.

    Theory (u = g/|g|, s_k = delta_k . u, so E s_k^2 = 1 and |delta_k|^2 = d exactly):
      E[ghat] = (1/P) sum_k E[delta_k delta_k^T] g = g                       (unbiased)
      E|ghat|^2 = (1/P^2) sum_{k,l} E[(delta_k.g)(delta_l.g) delta_k.delta_l]
               = (1/P^2) [P(P-1) |g|^2 + P d |g|^2]  = |g|^2 (1 + (d-1)/P)
      so cos(ghat, g) ~ 1/sqrt(1 + (d-1)/P).
    Fluctuations: A = ghat.g/|g|^2 = (1/P) sum_k s_k^2 has Var A = 2(1 - sum u_i^4)/P <= 2/P
    (Rademacher: E s^4 = 3 - 2 sum u_i^4). Writing ghat/|g| = A u + w and r = d/P, |w|^2 = r A + c
    with Var c ~ 2r/P (the k != l cross terms); the delta method on A/sqrt(A^2 + |w|^2) gives
    std(cos) ~ sqrt(r/(2P)) / (1 + r). A Monte-Carlo of the ideal estimator (d = 3744, P = 2048,
    200 replicates) gave mean 0.5944 vs 0.5947 predicted and std 0.0072 vs 0.0075 from the formula.
    """
    config = ModelConfig(embed=4, hidden=8, layers=1)  # d = 3,744
    theta32, layout = make_theta(config, seed=2)
    theta = theta32.astype(np.float64)
    d, P, eps = layout.size, 2048, 1e-4
    batch = make_batch(2, 8, seed=2)
    grad, _ = torch_flat_grad(theta, layout, batch)

    deltas = directions(d, 2024, "rademacher", range(P))  # (P, d)
    g = np.array([central_difference(theta, layout, batch, delta, eps) for delta in deltas])  # (P,)
    ghat = g @ deltas / P  # (d,)

    # the finite differences are the exact directional derivatives (to O(eps^2)) ...
    assert_close(g, deltas @ grad, atol=1e-7 * np.linalg.norm(grad), rtol=1e-5, name="g_k")
    # ... so the statistics below are the estimator's, not the model's
    norm = np.linalg.norm(grad)
    cosine = ghat @ grad / (np.linalg.norm(ghat) * norm)
    r = (d - 1) / P
    predicted = 1 / np.sqrt(1 + r)
    sigma = np.sqrt(r / (2 * P)) / (1 + r)
    projection = ghat @ grad / norm**2  # A: 1 if unbiased
    sigma_a = np.sqrt(2 * (1 - np.sum((grad / norm) ** 4)) / P)
    print(f"d={d} P={P}: cosine measured {cosine:.4f}, predicted {predicted:.4f} (std {sigma:.4f}); "
          f"ghat.g/|g|^2 = {projection:.4f} (1 +/- {sigma_a:.4f})")
    assert abs(cosine - predicted) < 4 * sigma
    assert abs(projection - 1) < 4 * sigma_a


# --- 4. antithetic pairs use one regenerated delta ---------------------------------------------------

@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_antithetic_pair_shares_one_regenerated_delta(kind):
    """theta + eps delta and theta - eps delta use the same member's delta; MeZO-style in-place
    perturb / evaluate / regenerate / restore gives the same g_k and returns to theta."""
    theta, layout = make_theta(TINY_MODEL, seed=4)
    batch = make_batch(2, 10, seed=4)
    eps, args = 1e-3, (31, 2, 17, 5)  # seed, expert, step, member
    delta = noise(layout.size, *args, kind)
    np.testing.assert_array_equal(delta, noise(layout.size, *args, kind))  # regenerates identically

    plus = add_noise(np.empty_like(theta), theta, eps, *args, kind)
    minus = add_noise(np.empty_like(theta), theta, -eps, *args, kind)
    np.testing.assert_array_equal(plus, theta + np.float32(eps) * delta)
    np.testing.assert_array_equal(minus, theta + np.float32(-eps) * delta)
    if kind == "rademacher":  # the sign of each step is the same delta, mirrored
        np.testing.assert_array_equal(np.sign(plus - theta), delta)
        np.testing.assert_array_equal(np.sign(theta - minus), delta)

    work = theta.copy()
    add_noise(work, work, eps, *args, kind)
    loss_plus = reference.loss(work, layout, batch)
    add_noise(work, work, -2 * eps, *args, kind)
    loss_minus = reference.loss(work, layout, batch)
    add_noise(work, work, eps, *args, kind)
    assert loss_plus == reference.loss(plus, layout, batch)
    bound = 4 * np.spacing(np.maximum(np.abs(theta), np.float32(2 * eps * np.abs(delta).max())))
    assert np.all(np.abs(work - theta) <= bound), "restoring theta drifted beyond float32 rounding"
    g_inplace = (loss_plus - loss_minus) / (2 * eps)
    g_explicit = central_difference(theta, layout, batch, delta, np.float32(eps))
    assert abs(g_inplace - g_explicit) <= 1e-2 * abs(g_explicit) + 1e-3
