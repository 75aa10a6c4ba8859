"""The CUDA engine's noise and SPSA (kernels/noise.cu): perturbed populations, estimates and
fused ZO-SGD updates, every direction regenerated on the device.

Noise (kernels/noise.cu) is a pure function of (seed, expert, step, member, index), the Philox
counter layout of zosoma.model.noise, so the GPU regenerates exactly the CPU's directions: Rademacher
noise, perturbed populations, estimates and ZO-SGD updates are bit-identical to the CPU's;
Gaussian ones agree within float32 rounding.
"""

from __future__ import annotations

import numpy as np

from zosoma.arrays import to_numpy
from zosoma.engines.cuda import custom_kernels
from zosoma.engines.cuda.custom_kernels import check_out, runtime, to_device
from zosoma.model.noise import kind_code, stream_key

_U32 = 0xFFFFFFFF


def add_noise(out, base, scale: float, seed: int, expert: int, step: int, member: int,
              kind: str = "rademacher", start: int = 0):
    """out = base + scale * delta, delta = noise(seed, expert, step, member)[start:start+n], as
    zosoma.model.noise.add_noise. out: device float32 (n,), may be base (in place); base (n,). `start` must
    be a multiple of 128 (Rademacher) or 4 (Gaussian). Returns out."""
    stream_key(seed)  # a bad seed is reported before anything else
    code = kind_code(kind)
    align = 128 if kind == "rademacher" else 4
    if start % align:
        raise ValueError(f"start must be a multiple of {align} for {kind} noise")
    n = out.shape[0] if getattr(out, "ndim", 0) == 1 else None
    check_out(out, (n,))
    base = to_device(base)
    if base.shape != (n,):
        raise ValueError(f"base has shape {base.shape}, out has {(n,)}")
    member = np.array([member & _U32], np.uint32).view(np.int32)  # the kernel reads the counter's 32 bits
    perturb(out, base, scale, start, seed, expert, step, member, [1], code)
    return out


def perturb(out, base, scale: float, start: int, seed: int, expert: int, step: int, direction, sign,
            code: int) -> None:
    """The perturb kernel over a member table's rows: out row j = base + sign[j] * scale *
    delta_{direction[j]}. direction (rows,) int32 and sign (rows,) float32, host or device
    (zosoma.model.population.Population's); base (n,) device; start a multiple of 4."""
    k0, k1 = stream_key(seed)
    n = base.shape[0]
    direction, sign = to_device(direction, np.int32), to_device(sign, np.float32)
    if direction.shape != sign.shape or direction.ndim != 1:
        raise ValueError(f"a member table needs one direction and one sign per row, got {direction.shape} and "
                         f"{sign.shape}")
    rows = direction.shape[0]
    custom_kernels.launch("perturb", -(-n // 4), out, base, n, scale, start // 4, k0, k1, expert & _U32, step & _U32,
                          direction, sign, rows, code, rows=-(-rows // 2))


def antithetic(pairs: range) -> tuple[np.ndarray, np.ndarray]:
    """The member table (direction, sign) of antithetic `pairs`: members k+ and k- of each."""
    return (np.repeat(np.arange(pairs.start, pairs.stop, dtype=np.int32), 2),
            np.tile(np.array([1, -1], np.float32), len(pairs)))


def plain_rows(directions: range) -> tuple[np.ndarray, np.ndarray]:
    """The member table (direction, sign) of one row per direction, sign +1 (raw noise, factors)."""
    return np.arange(directions.start, directions.stop, dtype=np.int32), np.ones(len(directions), np.float32)


def _member_range(members) -> tuple[int, int]:
    """(first, count) of consecutive pairs, e.g. a range with step 1."""
    members = [int(k) for k in members]
    first = members[0] if members else 0
    if members != list(range(first, first + len(members))):
        raise ValueError("members must be consecutive (a range with step 1)")
    return first, len(members)


def perturbed(theta, eps: float, members: range, seed: int, expert: int, step: int, kind: str,
              out=None, table=None):
    """The population of pairs `members`, as zosoma.engines.ops.perturbed: rows 2j and 2j+1 are
    the pair's two members, theta + sign * eps * delta_direction as `table` says ((direction,
    sign) of the 2 len(members) members; None: antithetic pairs, theta + eps*delta_k and theta -
    eps*delta_k for k = members[j]). theta (d,); returns a device (2*len(members), d) float32
    array (out, when given)."""
    theta = to_device(theta)
    d = theta.size
    member0, count = _member_range(members)
    out = runtime().xp.empty((2 * count, d), np.float32) if out is None else check_out(out, (2 * count, d))
    if count:
        direction, sign = antithetic(range(member0, member0 + count)) if table is None else table
        perturb(out, theta, eps, 0, seed, expert, step, direction, sign, kind_code(kind))
    return out


def _coefficients(coeffs):
    """coeffs[k] / P as float32, computed in float64 as zosoma.engines.ops.Ops.noise_sum does."""
    c = np.asarray(to_numpy(coeffs), np.float64).ravel()
    return to_device((c / len(c)).astype(np.float32)), len(c)


def spsa_gradient(coeffs, d: int, seed: int, expert: int, step: int, kind: str):
    """ghat = (1/P) sum_k coeffs[k] * delta_k, as zosoma.engines.ops.Ops.noise_sum, with every direction
    regenerated on the fly (none is stored). coeffs (P,). Returns a device (d,) float32 array."""
    coef, P = _coefficients(coeffs)
    k0, k1 = stream_key(seed)
    out = runtime().xp.empty(d, np.float32)
    custom_kernels.launch("spsa_update", -(-d // 4), out, out, coef, P, d, k0, k1, expert & _U32, step & _U32,
                          kind_code(kind), 0, 0.0, 0.0)
    return out


def spsa_update(theta, coeffs, lr: float, seed: int, expert: int, step: int, kind: str,
                weight_decay: float = 0.0, out=None):
    """One fused ZO-SGD step: theta - lr * ghat (- lr * weight_decay * theta), ghat as
    spsa_gradient, without materialising ghat or any direction: the same numbers as
    Ops.sgd_update of the CPU engine. theta (d,); coeffs (P,). Returns a
    device (d,) float32 array: out, which may be theta itself (in place), or a new one."""
    theta = to_device(theta)
    d = theta.size
    out = runtime().xp.empty_like(theta) if out is None else check_out(out, (d,))
    coef, P = _coefficients(coeffs)
    k0, k1 = stream_key(seed)
    lr_wd = np.float32(lr * weight_decay) if weight_decay else 0.0
    custom_kernels.launch("spsa_update", -(-d // 4), out, theta, coef, P, d, k0, k1, expert & _U32, step & _U32,
                          kind_code(kind), 1, np.float32(lr), lr_wd)
    return out
