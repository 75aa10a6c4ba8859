"""The forward's number formats: what a bf16, fp16 or int8 device computes, and its rounding rules.

This module is the specification: how each format rounds or quantises weights, activations and
state, and the format's step (`format_step`). zosoma.engines.emulated runs it on the CPU, in
plain NumPy (precision_reference, the readable version) and compiled (precision_kernels, checked
against it). Training keeps fp32 master weights and the update on the host; only the forward of
each (perturbed) member runs in the format, on a rounded COPY of its weights. Shapes: B batch,
T time, E embedding, H hidden, V = 256.

Float formats (bf16: 8 significant bits, fp32's range; fp16: 11 bits, IEEE binary16 with
subnormals, overflow to +-inf). R(x) rounds to the format, round-to-nearest-even; a wide value is
first rounded to fp32 (the accumulator's register), then to the format, as hardware does.

    weights    every tensor rounded once: embed, w_ih, w_hh, bias, out.w, out.b
    gates      z = R(x @ w_ih + h @ w_hh + bias)      products exact, fp32 accumulation
    cell       i, f, o = R(sigmoid(z)), g = R(tanh(z)), c = R(f c + i g), h = R(o R(tanh(c)))
    logits     R(h @ out.w + out.b); log-softmax and the loss in fp32 on the rounded logits
    state      h and c carried as format values

int8 (an integer LSTM kernel in the style of TFLite's 8x8_16 LSTM, simplified):

    weights    embed, w_ih, w_hh, out.w: symmetric per-tensor int8, s = max|W| / 127,
               q = clip(rint(W / s), -127, 127)
    inputs     layer 0: the int8 embedding row (scale s_embed); above: h of the layer below
    h          int8 with the fixed scale 1/127 (|h| < 1): q_h = clip(rint(127 h), -127, 127)
    gates      acc_x = q_x @ q_ih + q_b (int32; q_b = rint(bias / (s_x s_ih)), the bias at the
               accumulator's scale), acc_h = q_h @ q_hh (int32);
               z = acc_x s_x s_ih + acc_h s_h s_hh, requantised to int16 Q3.12 (step 2^-12,
               saturating at [-8, 8))
    tables     sigmoid and tanh of a Q3.12 input: 257-entry int16 Q0.15 tables of f(-8 + k/16),
               k = 0..256, linearly interpolated on the input's low 8 bits:
               u = q + 32768, k = u >> 8, r = u & 255,
               y = T[k] + floor(((T[k+1] - T[k]) r + 128) / 256)
    cell       c int16 Q4.11 (step 2^-11, saturating at [-16, 16)): c = clip(rint(2048 (f c + i g)));
               tanh(c) through the table on clip(2 q_c) (Q4.11 -> Q3.12, saturating at +-8);
               q_h = clip(rint(127 o tanh(c)), -127, 127)
    logits     (q_h @ q_out + q_bout) s_h s_out, int32 accumulation, bias at the accumulator's
               scale; log-softmax and the loss in fp32

    An integer kernel rescales with 31-bit fixed-point multipliers and rounds each product of the
    cell separately; this emulation rescales exactly and rounds once, within one LSB of it.

"fp32" is the ordinary forward (zosoma.model.reference): nothing is rounded.
"""

from __future__ import annotations

import numpy as np

from zosoma.config import PRECISIONS as FORMATS
from zosoma.errors import ConfigError
from zosoma.model.params import Layout
from zosoma.model.reference import sigmoid

MANTISSA_BITS = {"fp32": 23, "bf16": 7, "fp16": 10}  # stored fraction bits of the float formats
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14

Q_GATE = 4096.0  # Q3.12: gate pre-activations and table inputs
Q_ACT = 32768.0  # Q0.15: table outputs
Q_CELL = 2048.0  # Q4.11: the cell state
Q_H = 127.0  # int8 h and layer inputs above layer 0: scale 1/127
INT16 = (-32768, 32767)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"forward_precision must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


# --- the float formats ---------------------------------------------------------------------------

def round_to(x, fmt: str) -> np.ndarray:
    """x rounded to `fmt` (round-to-nearest-even, via fp32), as float32 values."""
    x = np.asarray(x, np.float32)
    if fmt == "fp16":
        with np.errstate(over="ignore", invalid="ignore"):  # beyond 65504: +-inf, as the format does
            r = x.astype(np.float16).astype(np.float32)
        u = np.ascontiguousarray(x).view(np.uint32)  # a NaN: quiet, its sign kept, its payload cut, as
        nan = ((u | np.uint32(0x400000)) & np.uint32(0xFFFFE000)).view(np.float32)  # bf16's (NumPy keeps
        return np.where(np.isnan(x), nan, r).reshape(x.shape)  # a signalling NaN signalling)
    if fmt == "bf16":
        u = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000  # a NaN stays one: quiet, its payload cut (the carry would
        u = np.where(nan, u | 0x400000, u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # make some inf or 0)
        return u.astype(np.uint32).view(np.float32).reshape(x.shape)
    if fmt == "fp32":
        return x
    raise ConfigError(f"{fmt} is not a float format")


# --- int8 ----------------------------------------------------------------------------------------

def _table(fn) -> np.ndarray:
    z = -8.0 + np.arange(257) / 16.0
    return np.clip(np.rint(fn(z) * Q_ACT), *INT16).astype(np.int64)


SIGMOID_TABLE = _table(sigmoid)  # (257,) int16 values, Q0.15
TANH_TABLE = _table(np.tanh)


def table_lookup(q, table: np.ndarray) -> np.ndarray:
    """The table activation of Q3.12 integers q (int64 array in [-32768, 32767]): Q0.15 integers."""
    u = np.asarray(q, np.int64) + 32768
    k, r = u >> 8, u & 255
    lo = table[k]
    return lo + (((table[k + 1] - lo) * r + 128) >> 8)


def int8_scale(w: np.ndarray) -> float:
    """The symmetric per-tensor scale max|W| / 127 (1 for an all-zero tensor)."""
    m = float(np.abs(w).max())
    return m / 127.0 if m > 0 else 1.0


def quantize_int8(w: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.rint(np.asarray(w, np.float64) / scale), -127, 127)


def quantize_bias(b: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.rint(np.asarray(b, np.float64) / scale), -2.0 ** 31, 2.0 ** 31 - 1)


# --- one model's weights in a format ---------------------------------------------------------------

def prepare(theta: np.ndarray, layout: Layout, fmt: str) -> dict:
    """The weights the device holds. Float formats: rounded float32 tensors ("embed", "w_ih0", ...,
    "out_w", "out_b"). int8: integer-valued float64 tensors "q_*" and the scales "s_*"."""
    p = layout.views(np.asarray(theta, np.float32))
    L = layout.config.layers
    if fmt != "int8":
        out = {"embed": round_to(p["embed"], fmt), "out_w": round_to(p["out.w"], fmt),
               "out_b": round_to(p["out.b"], fmt)}
        for layer in range(L):
            for name in ("w_ih", "w_hh", "bias"):
                out[f"{name}{layer}"] = round_to(p[f"lstm{layer}.{name}"], fmt)
        return out
    out = {}
    for key, name in [("embed", "embed"), ("out_w", "out.w")] + [
            (f"{n}{layer}", f"lstm{layer}.{n}") for layer in range(L) for n in ("w_ih", "w_hh")]:
        s = int8_scale(p[name])
        out[f"s_{key}"], out[f"q_{key}"] = s, quantize_int8(p[name], s)
    for layer in range(L):
        s_x = out["s_embed"] if layer == 0 else 1.0 / Q_H
        out[f"q_bias{layer}"] = quantize_bias(p[f"lstm{layer}.bias"], s_x * out[f"s_w_ih{layer}"])
    out["q_out_b"] = quantize_bias(p["out.b"], out["s_out_w"] / Q_H)
    return out


def to_grid(state, fmt: str):
    """A carried state (one (h, c) pair of (B, H) per layer) as the values the format holds."""
    if fmt == "int8":
        return [(np.clip(np.rint(np.asarray(h, np.float64) * Q_H), -127, 127) / Q_H,
                 np.clip(np.rint(np.asarray(c, np.float64) * Q_CELL), *INT16) / Q_CELL) for h, c in state]
    return [(round_to(h, fmt), round_to(c, fmt)) for h, c in state]


# --- the format's step ---------------------------------------------------------------------------

def spacing(theta: np.ndarray, layout: Layout, fmt: str) -> np.ndarray:
    """(d,) the distance from each parameter to its neighbouring value in the format: the ulp at
    the value for float formats (2^(floor(log2 |w|) - mantissa bits), the smallest normal's for
    zero), the tensor's scale for int8 (biases: the scale of the accumulator they are added to)."""
    theta = np.asarray(theta, np.float32)
    if fmt in MANTISSA_BITS:
        a = np.abs(theta.astype(np.float64))
        tiny = FP16_MIN_NORMAL if fmt == "fp16" else 2.0 ** -126
        e = np.floor(np.log2(np.maximum(a, tiny)))
        return 2.0 ** (e - MANTISSA_BITS[fmt])
    check_format(fmt)
    w = prepare(theta, layout, fmt)
    out = np.empty(layout.size)
    for e in layout.entries:
        if e.name.startswith("lstm"):  # lstm{l}.w_ih, .w_hh, .bias
            layer, kind = e.name[4:].split(".")
            s_x = w["s_embed"] if layer == "0" else 1.0 / Q_H
            s = w[f"s_w_ih{layer}"] * s_x if kind == "bias" else w[f"s_{kind}{layer}"]
        else:  # embed, out.w, out.b
            s = {"embed": w["s_embed"], "out.w": w["s_out_w"], "out.b": w["s_out_w"] / Q_H}[e.name]
        out[e.offset:e.offset + e.size] = s
    return out


def format_step(theta: np.ndarray, layout: Layout, fmt: str) -> float:
    """The format's step at these parameters: the median over parameters of `spacing`, the scale
    the study measures eps against (eps below it moves few parameters to another value)."""
    return float(np.median(spacing(theta, layout, fmt)))
