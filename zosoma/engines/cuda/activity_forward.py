"""The CUDA engine's activity (node) perturbation: the noisy forward of 2K members x B rows that
share one theta, and the estimate's outer products, on the device (kernels/activity.cu, the cell
and softmax kernels of kernels/lstm.cu, cuBLAS through the runtime's gemm).

Mirrors the CPU engine one for one and is checked against it (tests/test_activity_cuda.py):

    draw(layout, B, T, seed, ...)          zosoma.engines.cpu.noisy_forward.draw (the same Philox
                                           counters: Rademacher bit for bit, Gaussian within float32)
    member_nats(theta, layout, batch, ...) zosoma.engines.cpu.noisy_forward.member_losses
    weighted_noise(w_gates, w_logits, Z)   zosoma.engines.cpu.noisy_forward.weighted_noise
    estimate(theta, layout, batch, zeta)   zosoma.model.node_perturbation.estimate

Shapes: M members, B batch, R = M B rows (row m B + b: member m's copy of batch row b), T time,
E embed, H hidden, G = 4H, L layers, V = 256, S the noisy pre-activations of one position. The
members share theta, so the forward is ONE model over R rows: per layer one GEMM of the input
projection (layer 0: the table embed @ w_ih, gathered by byte), per step one recurrent GEMM and
one kernel that adds the noise and runs the cell; the readout one GEMM, one noise kernel (perturbed
logits) and one softmax kernel per chunk of time steps. The update's clean forward rides along as B
rows more (a member with sign 0). The estimate's outer products sum_t z_t u_t^T are GEMMs over the
B T positions of the clean forward's inputs (the embedding's scatter by byte a one-hot GEMM).
"""

from __future__ import annotations

import numpy as np

from zosoma.config import VOCAB
from zosoma.engines.cuda import custom_kernels
from zosoma.engines.cuda.cuda_noise import perturb
from zosoma.engines.cuda.custom_kernels import runtime, to_device
from zosoma.model.node_perturbation import width
from zosoma.model.noise import kind_code
from zosoma.model.params import Layout

LOGIT_FLOATS = 16 << 20  # the most logits one readout chunk holds (64 MB): R rows x Tc steps x V


def draw(layout: Layout, B: int, T: int, seed: int, expert: int, step: int, directions, kind: str,
         readout: str = "perturb"):
    """(len(directions), B, T, S) device float32: each direction's noise, its counters' stream read
    row by row, position by position (node_perturbation.member_noise), made by the perturb kernel."""
    xp = runtime().xp
    n = B * T * width(layout, readout)
    directions = np.asarray(list(directions), np.int32)
    out = xp.empty((len(directions), n), np.float32)
    if len(directions):
        perturb(out, xp.zeros(n, np.float32), 1.0, 0, seed, expert, step, directions,
                np.ones(len(directions), np.float32), kind_code(kind))
    return out.reshape(len(directions), B, T, -1)


class _Noise:
    """Member m's noise sign[m] * scale * Z[index[m]] as the kernels read it (None: no noise)."""

    def __init__(self, Z, index, sign, scale: float, B: int):
        self.Z, self.scale, self.B = Z, np.float32(scale), B
        self.index, self.sign = to_device(index, np.int32), to_device(sign, np.float32)

    def cell(self, gates, table, xproj, rows, embed: int, bias, c, h, hs, t: int, lo: int) -> None:
        """Step t of one layer: gates (1, R, G) += each row's noise on S columns lo:lo + G, then the
        cell (table: layer 0's input projection by byte, rows (R, T + 1) the bytes; else xproj)."""
        J, B, T, S = self.Z.shape
        R, H = gates.shape[1], gates.shape[2] // 4
        custom_kernels.launch("noisy_cell", R * H, gates, table, xproj, rows, rows.shape[1], embed, bias, c, h, hs,
                              R, H, t, self.Z, self.index, self.sign, self.scale, B, T, S, lo)

    def add(self, rows, t: int, steps: int, lo: int, hi: int) -> None:
        """rows (steps, R, hi - lo) += each row's noise at time steps t .. t + steps - 1, S columns lo:hi."""
        J, B, T, S = self.Z.shape
        R = rows.size // (steps * (hi - lo))
        custom_kernels.launch("add_activity_noise", rows.size, rows, self.Z, self.index, self.sign, self.scale,
                              R, B, T, S, t, steps, lo, hi - lo)


def _forward(theta, layout: Layout, batch, noise: _Noise | None, M: int, readout: bool = True):
    """The forward of M members over R = M B rows of the (B, T + 1) device batch, one theta, noise
    added to every layer's gates before its cell and (S > L G) to the logits before the softmax.
    Returns every layer's outputs (T, R, H) device float32 and, with the readout, nll (R, T)
    (else None)."""
    rt = runtime()
    xp = rt.xp
    cfg = layout.config
    H, G, L, V = cfg.hidden, 4 * cfg.hidden, cfg.layers, VOCAB
    B, T = batch.shape[0], batch.shape[1] - 1
    R = M * B
    rows = batch if M == 1 else xp.ascontiguousarray(xp.tile(batch, (M, 1)))  # (R, T + 1): row m B + b
    tokens, targets = rows[None, :, :-1], rows[None, :, 1:]
    w = {e.name: rt.contiguous(layout.view(theta, e.name))[None] for e in layout.entries}  # (1, ...) each
    S = noise.Z.shape[3] if noise is not None else L * G
    gates = xp.empty((1, R, G), np.float32)
    table = rt.gemm(w["embed"], w["lstm0.w_ih"])  # (1, V, G): the input projection of every byte
    outputs, below = [], None
    for layer in range(L):
        hs = xp.empty((1, T, R, H), np.float32)
        bias = w[f"lstm{layer}.bias"]
        if layer > 0:
            xproj = rt.gemm(below.reshape(1, T * R, H), w[f"lstm{layer}.w_ih"])  # (1, T R, G)
        h, c = rt.zeros((1, R, H)), rt.zeros((1, R, H))
        for t in range(T):
            rt.gemm(h, w[f"lstm{layer}.w_hh"], out=gates)
            if noise is not None:  # the noise and the cell in one launch
                noise.cell(gates, table, xproj if layer else table, rows, int(layer == 0), bias, c, h, hs, t,
                           layer * G)
            elif layer == 0:
                custom_kernels.launch("lstm_cell_embed", R * H, gates, table, tokens, 0, T + 1, t, bias, c, h, hs,
                                      1, R, H, T, t)
            else:
                custom_kernels.launch("lstm_cell_proj", R * H, gates, xproj, bias, c, h, hs, 1, R, H, T, t)
        below = hs
        outputs.append(hs[0])
    if not readout:
        return outputs, None
    nll = xp.empty((1, R, T), np.float32)
    Tc = max(1, min(T, LOGIT_FLOATS // (R * V)))
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        logits = rt.gemm(below[:, t0:t0 + n].reshape(1, n * R, H), w["out.w"])  # (1, n R, V): rows (t, r)
        if S > L * G:
            noise.add(logits, t0, n, L * G, S)
        custom_kernels.launch("log_softmax_nll", n * R, logits, w["out.b"], targets, 0, T + 1, nll, nll, 0, 1, R, T,
                              t0, n)
    return outputs, nll[0]


def member_nats(theta, layout: Layout, batch, scale: float, Z, index, sign, clean: bool = False):
    """(M, B, T) device float32: the nats of every row's every target under member m, its
    pre-activations plus sign[m] * scale * Z[index[m]] (noisy_forward.member_losses). Z (J, B, T, S)
    device float32 (draw); index (M,) and sign (M,) the member table; batch (B, T + 1) uint8.
    clean: one more member without noise (sign 0) rides in the same forward, and (nats, its every
    layer's outputs (T, B, H)) come back: the update's clean forward (`estimate`'s outputs)."""
    theta = to_device(theta)
    batch = runtime().xp.ascontiguousarray(runtime().xp.asarray(batch, np.uint8))
    B, T = batch.shape[0], batch.shape[1] - 1
    M = len(index)
    if clean:
        index, sign = np.append(np.asarray(index, np.int32), 0), np.append(np.asarray(sign, np.float32), 0)
    outputs, nll = _forward(theta, layout, batch, _Noise(Z, index, sign, scale, B), len(index))
    nats = nll[:M * B].reshape(M, B, T)
    if not clean:
        return nats
    return nats, [runtime().contiguous(hs[:, M * B:]) for hs in outputs]


def weighted_noise(w_gates, w_logits, Z, gates: int):
    """zeta (B, T, S) device float32 = sum_k w[k, b, t] Z[k, b, t] (float64 sums), the gates'
    weights on the first `gates` of S, the logits' on the rest (noisy_forward.weighted_noise);
    w_gates, w_logits (K, B, T) float64 or broadcast to it (host or device)."""
    xp = runtime().xp
    K, B, T, S = Z.shape
    w_gates, w_logits = (to_device(xp.broadcast_to(xp.asarray(w), (K, B, T)), np.float64) for w in (w_gates, w_logits))
    zeta = xp.empty((B, T, S), np.float32)
    custom_kernels.launch("weighted_noise", B * T * S, zeta, w_gates, w_logits, Z, K, B * T, S, gates)
    return zeta


def estimate(theta, layout: Layout, batch, zeta, outputs=None):
    """ghat (d,) device float32: the outer products of zeta (B, T, S) device float32 with the inputs
    of a clean forward at theta on the (B, T + 1) batch (node_perturbation.estimate): per layer
    w_ih += u_t^T z_t, w_hh += h_(t-1)^T z_t, bias += z_t; the embedding's rows by byte through
    layer 0's w_ih^T; the readout from the logits' noise, or with none in zeta (S = L G) its exact
    delta rule (softmax - onehot) / (B T) of the same clean forward. outputs: that forward's every
    layer's outputs (T, B, H), when the members' forward ran it (member_nats' clean); None: run here."""
    rt = runtime()
    xp = rt.xp
    theta = to_device(theta)
    batch = xp.ascontiguousarray(xp.asarray(batch, np.uint8))
    cfg = layout.config
    H, G, L, V = cfg.hidden, 4 * cfg.hidden, cfg.layers, VOCAB
    B, T = batch.shape[0], batch.shape[1] - 1
    N = T * B  # positions, time-major: row t B + b, as the forward's outputs
    if outputs is None:
        outputs, _ = _forward(theta, layout, batch, None, 1, readout=False)
    zt = rt.contiguous(zeta.transpose(1, 0, 2)).reshape(N, -1)  # (N, S)
    ghat = xp.zeros(layout.size, np.float32)
    tokens = rt.contiguous(batch[:, :-1].T).reshape(N).astype(np.int64)  # index arrays: an integer dtype
    onehot = xp.zeros((N, V), np.float32)  # each position's input byte: the embedding's scatter as a GEMM
    onehot[xp.arange(N), tokens] = 1.0
    x = layout.view(theta, "embed")[tokens]  # (N, E): layer 0's input
    for layer in range(L):
        z = rt.contiguous(zt[:, layer * G:(layer + 1) * G])  # (N, G)
        hs = outputs[layer].reshape(N, H)
        layout.view(ghat, f"lstm{layer}.w_ih")[...] = rt.gemm(x.T, z)
        layout.view(ghat, f"lstm{layer}.w_hh")[...] = rt.gemm(hs[:N - B].T, z[B:])  # h_(t-1) = 0 at t = 0
        layout.view(ghat, f"lstm{layer}.bias")[...] = z.sum(axis=0)
        if layer == 0:  # d a / d embed[v] = w_ih at byte v
            w_ih = layout.view(theta, "lstm0.w_ih")
            layout.view(ghat, "embed")[...] = rt.gemm(onehot.T, rt.gemm(z, rt.contiguous(w_ih.T)))
        x = hs
    if zt.shape[1] > L * G:
        z = rt.contiguous(zt[:, L * G:])
    else:  # the readout by its local rule, from the clean forward's log-probabilities
        logits = rt.gemm(x[None], layout.view(theta, "out.w")[None])  # (1, N, V): rows (t, b)
        nll, logp = xp.empty((1, B, T), np.float32), xp.empty((1, B, T, V), np.float32)
        custom_kernels.launch("log_softmax_nll", N, logits, layout.view(theta, "out.b"), batch[None, :, 1:], 0, T + 1,
                              nll, logp, 1, 1, B, T, 0, T)
        z = xp.exp(rt.contiguous(logp[0].transpose(1, 0, 2)).reshape(N, V))
        z[xp.arange(N), rt.contiguous(batch[:, 1:].T).reshape(N).astype(np.int64)] -= 1.0
        z *= np.float32(1.0 / (B * T))
    layout.view(ghat, "out.w")[...] = rt.gemm(x.T, z)
    layout.view(ghat, "out.b")[...] = z.sum(axis=0)
    return ghat
