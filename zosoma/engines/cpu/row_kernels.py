"""The per-row kernels every CPU forward shares: the LSTM cell on a block of gate rows
(`lstm_cell_rows`) and log-softmax + NLL on a block of logit rows (`output_rows`), in float32 with
vectorisable approximations of tanh, sigmoid and exp (no libm calls), and the Numba options all the
CPU kernels compile with (JIT_OPTIONS).

zosoma.engines.cpu.forward (the dense members), zosoma.engines.cpu.lowrank (EGGROLL's members),
zosoma.engines.cpu.noisy_forward and the emulated number formats run their GEMMs and call these on
the rows. Everything here stays valid Python, so the suite can run with NUMBA_DISABLE_JIT=1.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

# fastmath without nnan/ninf: reductions and FMAs may reassociate, but a diverged model still
# yields inf/nan losses that the trainer can see. error_model="numpy" drops the division checks
# that would otherwise stop the gate loop from vectorising.
JIT_OPTIONS = dict(cache=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})

# Rational tanh approximation on [-7.905, 7.905] (Eigen's generic_fast_tanh_float): odd degree-13
# numerator over even degree-6 denominator, max abs error 3.9e-7 in float32. Constants are
# float32 so the arithmetic stays float32 (a float64 literal would promote the whole loop).
_F = np.float32
_TANH_CLAMP = _F(7.90531110763549805)
_A1, _A3, _A5, _A7 = (_F(4.89352455891786e-03), _F(6.37261928875436e-04),
                      _F(1.48572235717979e-05), _F(5.12229709037114e-08))
_A9, _A11, _A13 = _F(-8.60467152213735e-11), _F(2.00018790482477e-13), _F(-2.76076847742355e-16)
_B0, _B2, _B4, _B6 = (_F(4.89352518554385e-03), _F(2.26843463243900e-03),
                      _F(1.18534705686654e-04), _F(1.19825839466702e-06))
_HALF = _F(0.5)
_ONE = _F(1.0)

# exp(d) for d <= 0 (a row shifted by its max) as 2**-k * p(r), d = -k*ln2 + r, |r| <= ln2/2, p the
# degree-7 Taylor polynomial; 2**-k (k <= 126) is the float32 whose exponent field is 127 - k,
# built with an integer shift and a bit cast, so the loop vectorises. Max relative error 3e-7.
_EXP_FLOOR = _F(-87.0)  # exp(-87) = 1.6e-38, just above the smallest normal float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)  # ln 2 in two parts (Cody-Waite): k * _LN2_HI is exact for k < 2**15
_LN2_LO = _F(-2.12194440e-4)
_C2, _C3, _C4, _C5, _C6, _C7 = (_F(1 / math.factorial(k)) for k in range(2, 8))
_ZERO = _F(0.0)


@njit(inline="always", **JIT_OPTIONS)
def _tanh(x):
    x = min(max(x, -_TANH_CLAMP), _TANH_CLAMP)
    x2 = x * x
    p = ((((((_A13 * x2 + _A11) * x2 + _A9) * x2 + _A7) * x2 + _A5) * x2 + _A3) * x2 + _A1) * x
    q = ((_B6 * x2 + _B4) * x2 + _B2) * x2 + _B0
    return p / q


@njit(inline="always", **JIT_OPTIONS)
def _sigmoid(x):
    return _HALF + _HALF * _tanh(_HALF * x)


def _pow2_neg(k):
    """2**-k for an integral float32 k in [0, 126], exactly (plain Python; compiled: a bit cast).
    A NaN k (from a NaN logit) gives NaN, as the product it enters would be anyway."""
    if k != k:
        return _F(np.nan)
    return np.array([(127 - int(k)) << 23], np.int32).view(np.float32)[0]


@intrinsic
def _int32_bits_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@overload(_pow2_neg, jit_options=dict(inline="always"))
def _pow2_neg_compiled(k):
    def impl(k):
        return _int32_bits_as_float32(np.int32((np.int32(127) - np.int32(k)) << np.int32(23)))
    return impl


@njit(inline="always", **JIT_OPTIONS)
def _exp_nonpos(d):
    """exp(d) for d <= 0, float32, vectorisable."""
    d = max(d, _EXP_FLOOR)
    k = np.floor(_HALF - d * _LOG2E)  # round(-d / ln2), in [0, 126]
    r = (d + k * _LN2_HI) + k * _LN2_LO
    p = ((((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2) * r + _ONE) * r + _ONE
    return p * _pow2_neg(k)


@njit(**JIT_OPTIONS)
def lstm_cell_rows(gates, xsrc, rows, bias, c, h_out):
    """One LSTM step for B rows, in place. gates (B, 4H) = h_prev @ w_hh; the input projection of
    row b is xsrc[rows[b]] (4H,); bias (4H,); c (B, H) updated; h_out (B, H) written."""
    B, H = c.shape
    for b in range(B):
        gb = gates[b]
        xb = xsrc[rows[b]]
        cb = c[b]
        hb = h_out[b]
        for j in range(H):
            i = _sigmoid(gb[j] + xb[j] + bias[j])
            f = _sigmoid(gb[H + j] + xb[H + j] + bias[H + j])
            g = _tanh(gb[2 * H + j] + xb[2 * H + j] + bias[2 * H + j])
            o = _sigmoid(gb[3 * H + j] + xb[3 * H + j] + bias[3 * H + j])
            cn = f * cb[j] + i * g
            cb[j] = cn
            hb[j] = o * _tanh(cn)


@njit(inline="always", **JIT_OPTIONS)
def _larger(a, b):
    """max(a, b) as a select: it vectorises, and costs less than max() in the folds (a NaN among
    the logits still reaches the loss through the exps)."""
    return a if a > b else b


@njit(**JIT_OPTIONS)
def _row_max(z, fold):
    """max of z (V,), V a power of two, by halving folds: elementwise maxima vectorise where a
    running-max loop does not (LLVM needs no-NaN semantics for that). fold (V/2,) scratch."""
    n = z.shape[0] // 2
    for k in range(n):
        fold[k] = _larger(z[k], z[k + n])
    while n > 16:
        n //= 2
        for k in range(n):
            fold[k] = _larger(fold[k], fold[k + n])
    m = fold[0]
    for k in range(1, n):
        m = _larger(fold[k], m)
    return m


@njit(**JIT_OPTIONS)
def output_rows(logits, bias, targets, nll, to_logp, fold):
    """Log-softmax + NLL per row. logits (R, V) = h @ out.w, bias not yet added; bias (V,);
    targets (R,) bytes; fold (V/2,) scratch. Writes nll (R,) float32 and returns its float64 sum;
    with to_logp, overwrites logits with the log-probabilities."""
    R, V = logits.shape
    total = 0.0
    for r in range(R):
        z = logits[r]
        for v in range(V):
            z[v] += bias[v]
        m = _row_max(z, fold)
        s = _ZERO
        for v in range(V):
            s += _exp_nonpos(z[v] - m)
        lse = m + _F(math.log(s))
        nll[r] = lse - z[targets[r]]
        total += nll[r]
        if to_logp:
            for v in range(V):
                z[v] -= lse
    return total
