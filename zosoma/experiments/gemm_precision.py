"""What tensor-core GEMMs (TF32, bf16) do to SPSA's loss differences, known before a device runs them.

SPSA reads each direction through one number, L(theta + eps delta) - L(theta - eps delta). A
forward whose GEMMs round their operands (zosoma.engines.cuda.tensor_cores: TF32 keeps 10
fraction bits, bf16 7; exact products, fp32 sums) adds an error to each loss; what matters is its
size against that difference. By the precision study's method (zosoma.experiments.precision,
docs/precision.md), eps is counted in steps of the format (the median ulp of theta's values in
it, as zosoma.model.number_formats.format_step): for k steps, P Rademacher directions
(zosoma.engines.ops.perturbed, the training's own), the differences in the float64 reference
forward (zosoma.model.reference) against those of the forward with the format's GEMMs (every
other operation in fp32) and, as the control, with fp32 GEMMs:

    error    rms(d_fmt - d_ref) / rms(d_ref)    over the P directions
    signs    the fraction of directions whose difference keeps its sign

`gemm_loss` is the same arithmetic the CUDA engine runs under gemm_format on the emulated runtime
(tests/test_tensor_cores.py checks the two agree); shapes: B batch, T time, E embed, H hidden,
V = 256, P directions.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import ModelConfig
from zosoma.engines.cuda.tensor_cores import FRACTION_BITS, check_gemm_format, round_operand
from zosoma.engines.ops import perturbed
from zosoma.model import reference
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population

STEPS = (1, 4, 16, 64)  # eps in steps of the format
DEFAULT_EPS = 1e-3  # the training default, for comparison


def gemm_step(theta: np.ndarray, fmt: str) -> float:
    """The format's step at theta: the median over parameters of the ulp of |w| in `fmt`."""
    a = np.abs(np.asarray(theta, np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
    return float(np.median(2.0 ** (e - FRACTION_BITS[check_gemm_format(fmt)])))


def gemm_loss(theta, layout: Layout, batch, fmt: str) -> float:
    """Mean nats/byte of a (B, T+1) byte batch with every GEMM of the forward in `fmt` (operands
    rounded, fp32 products and sums) and the rest in fp32, as the CUDA engine computes it: layer
    0's input through the table embed @ w_ih, then per step h @ w_hh, the logits hs @ out.w."""
    def mm(a, w):  # w: already rounded (rounding is idempotent: rounded once, not at every step)
        return np.matmul(round_operand(a, fmt), w)

    p = layout.views(round_operand(np.asarray(theta, np.float32), fmt))  # the GEMMs' weights, as read
    bias_of = layout.views(np.asarray(theta, np.float32))  # biases are added in fp32, not multiplied
    tokens, targets = batch[:, :-1], batch[:, 1:]
    B, T = tokens.shape
    H = layout.config.hidden
    x = None
    for layer in range(layout.config.layers):
        w_ih, w_hh, bias = p[f"lstm{layer}.w_ih"], p[f"lstm{layer}.w_hh"], bias_of[f"lstm{layer}.bias"]
        xproj = mm(p["embed"], w_ih)[tokens] if layer == 0 else mm(x, w_ih)  # (B, T, 4H)
        h, c = (np.zeros((B, H), np.float32) for _ in range(2))
        hs = np.empty((B, T, H), np.float32)
        for t in range(T):
            h, c = reference.lstm_cell(mm(h, w_hh) + xproj[:, t] + bias, c)
            hs[:, t] = h
        x = hs
    logits = mm(x, p["out.w"]) + bias_of["out.b"]
    return float(reference.nll(logits, targets).mean(dtype=np.float64))


def loss_differences(model: ModelConfig, fmt: str, eps: float, P: int = 8, B: int = 8, T: int = 64,
                     seed: int = 0) -> dict:
    """d = L(theta + eps delta_k) - L(theta - eps delta_k), k < P, at the initialisation of `model`
    (scaled x3: saturated gates, a harder case than init) on one batch of random bytes, in the
    float64 reference, with fp32 GEMMs and with `fmt` GEMMs. Returns {"eps", "error_fp32",
    "error", "signs", "rms_d"}."""
    layout = Layout(model)
    theta = (init_params(model, seed) * 3).astype(np.float32)
    batch = np.random.default_rng(seed).integers(0, 256, (B, T + 1), dtype=np.uint8)
    members = perturbed(theta, Population(P, eps, seed, 0, 0), range(P))  # (2P, d): +, - of each direction
    ref = np.array([reference.loss(m.astype(np.float64), layout, batch) for m in members])
    d_ref = ref[0::2] - ref[1::2]
    out = {"eps": eps, "rms_d": float(np.sqrt(np.mean(d_ref ** 2)))}
    for key, f in (("error_fp32", "fp32"), ("error", fmt)):
        losses = np.array([gemm_loss(m, layout, batch, f) for m in members])
        d = losses[0::2] - losses[1::2]
        out[key] = float(np.sqrt(np.mean((d - d_ref) ** 2)) / out["rms_d"])
        if key == "error":
            out["signs"] = float(np.mean(np.sign(d) == np.sign(d_ref)))
    return out


def study(models: dict, formats=("tf32", "bf16"), steps=STEPS, P: int = 8, B: int = 8, T: int = 64) -> list[dict]:
    """loss_differences for every model (name -> ModelConfig), format, and eps of `steps` format
    steps and DEFAULT_EPS: one record each, with "model", "format", "step" and "k" (None at the
    default eps)."""
    records = []
    for name, model in models.items():
        theta = (init_params(model, 0) * 3).astype(np.float32)
        for fmt in formats:
            step = gemm_step(theta, fmt)
            for k in (*steps, None):
                eps = DEFAULT_EPS if k is None else k * step
                r = loss_differences(model, fmt, eps, P, B, T)
                records.append({"model": name, "format": fmt, "step": step, "k": k, **r})
    return records


def format_study(records: list[dict], P: int, B: int, T: int) -> str:
    lines = [f"SPSA's loss differences with tensor-core GEMMs: P={P} Rademacher directions, B={B} T={T}, "
             "theta = 3 x init (seed 0), random bytes; error = rms(d - d_ref) / rms(d_ref) against the float64 "
             "reference, signs = directions whose d keeps its sign",
             f"  {'model':<22} {'GEMMs':<5} {'eps':>16} {'rms d_ref':>10} {'fp32 error':>11} {'error':>9} {'signs':>6}"]
    for r in records:
        eps = f"{r['eps']:.2e} (default)" if r["k"] is None else f"{r['eps']:.2e} ({r['k']} st)"
        lines.append(f"  {r['model']:<22} {r['format']:<5} {eps:>16} {r['rms_d']:>10.3g} {r['error_fp32']:>11.2g} "
                     f"{r['error']:>9.2g} {r['signs']:>6.2f}")
    return "\n".join(lines)
