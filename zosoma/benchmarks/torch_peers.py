"""PyTorch yardsticks for the SPSA step: the same step written as a PyTorch user would write it.

Benchmarks, not product: `zosoma bench spsa` times them beside zosoma's step, same model, P, B, T
and noise, in the same run. Both run under torch.no_grad (zero-order: no autograd), with torch's
own threads (as many as BLAS would use), and time a whole step: perturbations, 2P forwards,
the update.

    mezo     MeZO's loop (Malladi et al. 2023, princeton-nlp/MeZO `zo_perturb_parameters`): one
             nn.Embedding + nn.LSTM + nn.Linear model; per direction k, reseed a generator,
             perturb every parameter in place (+eps z), forward, flip (-2 eps z), forward, restore
             (+eps z), each z regenerated from the seed; then the update regenerates each z_k
             once more: theta -= lr * g_k / P * z_k.
    stacked  the population at once: every member's parameters stacked (members, ...), theta +/-
             eps z_k materialised for a chunk of members, a hand-written LSTM over the stack with
             one torch.bmm per timestep and layer (torch.func.vmap cannot batch nn.LSTM), the
             output layer as one bmm, log-softmax and NLL per member; the update from the stored
             z_k. Members go in chunks of at most 256 MB of stacked parameters.

Shapes: M members, P pairs, B batch, T time, E embedding, H hidden, G = 4H, V = 256.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB, ModelConfig

_CHUNK_BYTES = 256 << 20  # stacked parameters per chunk of members (stacked peer)


def _noise(torch, shape, gen, kind: str):
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    return torch.randint(0, 2, shape, generator=gen, dtype=torch.float32).mul_(2).sub_(1)


def _views(model: ModelConfig, theta: np.ndarray | None, seed: int) -> dict:
    """zosoma's tensors (params.Layout names, "x @ W" orientation, one bias per layer) as float32
    torch tensors: theta's, or seeded random ones."""
    import torch

    from zosoma.model.params import Layout, init_params

    layout = Layout(model)
    theta = init_params(model, seed) if theta is None else np.asarray(theta, np.float32)
    return {name: torch.from_numpy(view.copy()) for name, view in layout.views(theta).items()}


def mezo_step(model: ModelConfig, P: int, batch: np.ndarray, eps: float = 1e-3, lr: float = 1e-3,
              kind: str = "rademacher", threads: int | None = None, seed: int = 0, theta=None):
    """A callable step(step_index) that runs one MeZO-style step (see the module docstring) on
    `batch` (B, T+1) uint8 and returns the mean loss of its 2P members. The model starts from
    zosoma's parameters theta (d,) (default: init_params(model, seed))."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    w = _views(model, theta, seed)
    embed = torch.nn.Embedding(VOCAB, model.embed)
    lstm = torch.nn.LSTM(model.embed, model.hidden, model.layers, batch_first=True)
    out = torch.nn.Linear(model.hidden, VOCAB)
    with torch.no_grad():
        embed.weight.copy_(w["embed"])
        for layer in range(model.layers):
            getattr(lstm, f"weight_ih_l{layer}").copy_(w[f"lstm{layer}.w_ih"].T)
            getattr(lstm, f"weight_hh_l{layer}").copy_(w[f"lstm{layer}.w_hh"].T)
            getattr(lstm, f"bias_ih_l{layer}").copy_(w[f"lstm{layer}.bias"])
            getattr(lstm, f"bias_hh_l{layer}").zero_()
        out.weight.copy_(w["out.w"].T)
        out.bias.copy_(w["out.b"])
    params = [p for m in (embed, lstm, out) for p in m.parameters()]
    data = torch.from_numpy(batch.astype(np.int64))
    inputs, targets = data[:, :-1], data[:, 1:].reshape(-1)
    gen = torch.Generator()

    def loss():
        hidden, _ = lstm(embed(inputs))
        return float(torch.nn.functional.cross_entropy(out(hidden).reshape(-1, VOCAB), targets))

    def perturb(k_seed: int, scale: float):
        gen.manual_seed(k_seed)
        for p in params:
            p.add_(_noise(torch, p.shape, gen, kind), alpha=scale)

    def step(step_index: int = 0):
        if threads:
            torch.set_num_threads(threads)
        with torch.no_grad():
            coeffs, total = [], 0.0
            for k in range(P):
                k_seed = seed * 1_000_003 + step_index * 10_007 + k
                perturb(k_seed, eps)
                plus = loss()
                perturb(k_seed, -2 * eps)
                minus = loss()
                perturb(k_seed, eps)
                coeffs.append((plus - minus) / (2 * eps))
                total += plus + minus
            for k, g in enumerate(coeffs):
                perturb(seed * 1_000_003 + step_index * 10_007 + k, -lr * g / P)
        return total / (2 * P)

    return step


def stacked_losses(w: dict, inputs, targets, layers: int):
    """Mean nll (M,) of M stacked members. w: params.Layout name -> (M, *shape) torch tensors;
    inputs, targets (B, T) int64 tensors. One torch.bmm per timestep and layer."""
    import torch

    M = w["embed"].shape[0]
    B, T = inputs.shape
    H = w["lstm0.w_hh"].shape[1]
    G = 4 * H
    x = w["embed"][:, inputs.reshape(-1)]  # (M, B*T, E)
    for layer in range(layers):
        xproj = (torch.bmm(x, w[f"lstm{layer}.w_ih"]) + w[f"lstm{layer}.bias"][:, None]).view(M, B, T, G)
        h = torch.zeros(M, B, H)
        c = torch.zeros(M, B, H)
        hs = torch.empty(M, B, T, H)
        for t in range(T):
            gates = xproj[:, :, t] + torch.bmm(h, w[f"lstm{layer}.w_hh"])  # (M, B, G)
            i, f, g, o = gates.split(H, dim=2)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            hs[:, :, t] = h
        x = hs.view(M, B * T, H)
    logp = torch.log_softmax(torch.bmm(x, w["out.w"]) + w["out.b"][:, None], dim=2)  # (M, B*T, V)
    return -logp.gather(2, targets.reshape(1, -1, 1).expand(M, -1, 1))[..., 0].mean(dim=1)


def stacked_step(model: ModelConfig, P: int, batch: np.ndarray, eps: float = 1e-3, lr: float = 1e-3,
                 kind: str = "rademacher", threads: int | None = None, seed: int = 0, theta=None):
    """A callable step(step_index) that runs one step of the stacked-population forward (see the
    module docstring) on `batch` (B, T+1) uint8 and returns the mean loss of its 2P members,
    starting from theta (d,) (default: init_params(model, seed))."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    theta = _views(model, theta, seed)
    gen = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(batch.astype(np.int64))
    inputs, targets = data[:, :-1], data[:, 1:]
    pairs_per_chunk = max(1, _CHUNK_BYTES // (2 * 4 * model.n_params()))

    def step(step_index: int = 0):
        if threads:
            torch.set_num_threads(threads)
        with torch.no_grad():
            ghat = {name: torch.zeros_like(v) for name, v in theta.items()}
            total = 0.0
            for p0 in range(0, P, pairs_per_chunk):
                n = min(pairs_per_chunk, P - p0)
                z = {name: _noise(torch, (n,) + tuple(v.shape), gen, kind) for name, v in theta.items()}
                sign = torch.tensor([1.0, -1.0]).repeat(n)  # members + and - of each pair, interleaved
                w = {name: v + eps * sign.view(-1, *[1] * v.dim()) * z[name].repeat_interleave(2, dim=0)
                     for name, v in theta.items()}
                losses = stacked_losses(w, inputs, targets, model.layers)  # (2n,)
                g = (losses[0::2] - losses[1::2]) / (2 * eps)
                total += float(losses.sum())
                for name in theta:
                    ghat[name] += torch.tensordot(g, z[name], dims=1) / P
            for name in theta:
                theta[name] -= lr * ghat[name]
        return total / (2 * P)

    return step


PEERS = {"torch MeZO loop (nn.LSTM, in-place perturb/restore)": mezo_step,
         "torch stacked population (bmm per step)": stacked_step}


def available() -> dict:
    """PEERS when torch is installed, else {}."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {}
    return PEERS
