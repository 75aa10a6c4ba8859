"""Stage 10: bf16 / fp16 / int8 forwards (PORTING.md)."""
import numpy as np
import core as C


def R(x, fmt):
    """Round to the format (returns float32 array holding format values)."""
    x = np.asarray(x)
    f = x.astype(np.float32)          # wide -> fp32 first (nearest even)
    u = f.view(np.uint32).copy()
    nan = np.isnan(f)
    if fmt == "bf16":
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        r = np.where(nan, (u | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), r).astype(np.uint32)
        return r.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        r = f.astype(np.float16).astype(np.float32).view(np.uint32)
    r = np.where(nan, (u | np.uint32(0x00400000)) & np.uint32(0xFFFFE000), r).astype(np.uint32)
    return r.view(np.float32)


def sig64(x):
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def fmt_gates(x, h, wih, whh, b, fmt):
    sx = np.matmul(x.astype(np.float32), wih).astype(np.float64)
    sh = np.matmul(h.astype(np.float32), whh).astype(np.float64)
    return R(sx + sh + b.astype(np.float64), fmt)


def fmt_acts(z, H, fmt):
    z = np.asarray(z, np.float64)
    return np.concatenate([R(sig64(z[..., :H]), fmt), R(sig64(z[..., H:2 * H]), fmt),
                           R(np.tanh(z[..., 2 * H:3 * H]), fmt), R(sig64(z[..., 3 * H:]), fmt)], -1)


def fmt_cell(a, c, H, fmt):
    a = np.asarray(a, np.float64); c = np.asarray(c, np.float64)
    i, f, g = a[..., :H], a[..., H:2 * H], a[..., 2 * H:3 * H]
    return R(f * c + i * g, fmt)


def fmt_hidden(o, c, fmt):
    o = np.asarray(o, np.float64); c = np.asarray(c, np.float64)
    return R(o * R(np.tanh(c), fmt).astype(np.float64), fmt)


def fmt_forward_loss(theta, E, H, L, batch, fmt):
    p = C.unpack(R(theta, fmt), E, H, L)
    batch = np.asarray(batch).astype(np.int64)
    tok, tgt = batch[:, :-1], batch[:, 1:]
    Bn, T = tok.shape
    x = p["embed"][tok]
    for l in range(L):
        h = np.zeros((Bn, H), np.float32); c = np.zeros((Bn, H), np.float32)
        hs = np.empty((Bn, T, H), np.float32)
        for t in range(T):
            z = fmt_gates(x[:, t], h, p[f"lstm{l}.w_ih"], p[f"lstm{l}.w_hh"], p[f"lstm{l}.bias"], fmt)
            a = fmt_acts(z, H, fmt)
            c = fmt_cell(a, c, H, fmt)
            h = fmt_hidden(a[..., 3 * H:], c, fmt)
            hs[:, t] = h
        x = hs
    S = np.matmul(x, p["out.w"]).astype(np.float64)
    logits = R(S + p["out.b"].astype(np.float64), fmt)
    nll = C.nll_from_logits(logits.astype(np.float32), tgt)
    return nll.astype(np.float64).mean()


def float_stage(k, E, H, L, fmt):
    res = {}
    W = R(k["theta"], fmt); res["weights"] = W
    p = C.unpack(W, E, H, L)
    res["state_h"] = R(k["h0"], fmt); res["state_c"] = R(k["c0"], fmt)
    tokens = k["tokens"].astype(np.int64)
    Bn, T = tokens.shape
    for l in range(L):
        x = p["embed"][tokens] if l == 0 else k[f"hidden{l-1}"].astype(np.float32)
        hprev = np.concatenate([res["state_h"][l][:, None, :], k[f"hidden{l}"][:, :-1].astype(np.float32)], 1)
        cprev = np.concatenate([res["state_c"][l][:, None, :].astype(np.float64), k[f"cells{l}"][:, :-1]], 1)
        res[f"gates{l}"] = fmt_gates(x, hprev, p[f"lstm{l}.w_ih"], p[f"lstm{l}.w_hh"], p[f"lstm{l}.bias"], fmt)
        res[f"activations{l}"] = fmt_acts(k[f"gates{l}"], H, fmt)
        res[f"cells{l}"] = fmt_cell(k[f"activations{l}"], cprev, H, fmt)
        res[f"hidden{l}"] = fmt_hidden(k[f"activations{l}"][..., 3 * H:], k[f"cells{l}"], fmt)
    S = np.matmul(k[f"hidden{L-1}"].astype(np.float32), p["out.w"]).astype(np.float64)
    res["logits"] = R(S + p["out.b"].astype(np.float64), fmt)
    res["nll"] = C.nll_from_logits(k["logits"].astype(np.float32), k["targets"]).astype(np.float64)
    res["loss"] = np.float64(fmt_forward_loss(k["theta"], E, H, L, k["batch"], fmt))
    res["edge_rounded"] = R(k["edge_values"], fmt)
    res["edge_wide_rounded"] = R(k["edge_wide"], fmt)
    res["edge_activations"] = fmt_acts(k["edge_gates"], 1, fmt)
    ea = k["edge_activations"]
    res["edge_cells"] = fmt_cell(ea, k["edge_c"][:, None], 1, fmt)[:, 0]
    res["edge_hidden"] = fmt_hidden(ea[:, 3], k["edge_cells"], fmt)
    return res


# ---------------- int8 ----------------
def table(fn):
    k = np.arange(257)
    return np.clip(np.rint(32768 * fn(-8 + k / 16)), -32768, 32767).astype(np.int64)


T_SIG, T_TANH = table(sig64), table(np.tanh)


def lookup(q, T):
    u = np.asarray(q, np.int64) + 32768
    k = u >> 8; r = u & 255
    return T[k] + (((T[k + 1] - T[k]) * r + 128) >> 8)


def quantize(theta, E, H, L):
    lay, d = C.layout(E, H, L)
    th = np.asarray(theta, np.float64)
    s = {}; q = np.zeros(d, np.int64); scales = []
    for name, shape, off in lay:
        n = int(np.prod(shape)); W = th[off:off + n]
        if name.endswith("bias") or name == "out.b":
            continue
        mx = np.abs(W).max(); s[name] = mx / 127 if mx > 0 else 1.0
        q[off:off + n] = np.clip(np.rint(W / s[name]), -127, 127)
    for name, shape, off in lay:
        n = int(np.prod(shape)); W = th[off:off + n]
        if name.endswith("bias"):
            l = int(name[4:name.index(".")])
            sx = s["embed"] if l == 0 else 1 / 127
            s[name] = sx * s[f"lstm{l}.w_ih"]
            q[off:off + n] = np.clip(np.rint(W / s[name]), -2 ** 31, 2 ** 31 - 1)
        elif name == "out.b":
            s[name] = s["out.w"] / 127
            q[off:off + n] = np.clip(np.rint(W / s[name]), -2 ** 31, 2 ** 31 - 1)
        scales.append(s[name])
    return q, s, np.array(scales)


def i8_gates(qx, qh, qp, s, l):
    accx = qx @ qp[f"lstm{l}.w_ih"] + qp[f"lstm{l}.bias"]
    acch = qh @ qp[f"lstm{l}.w_hh"]
    z = accx.astype(np.float64) * s[f"lstm{l}.bias"] + acch.astype(np.float64) * (s[f"lstm{l}.w_hh"] / 127)
    return np.clip(np.rint(4096 * z), -32768, 32767).astype(np.int64)


def i8_acts(qz, H):
    qz = np.asarray(qz, np.int64)
    return np.concatenate([lookup(qz[..., :H], T_SIG), lookup(qz[..., H:2 * H], T_SIG),
                           lookup(qz[..., 2 * H:3 * H], T_TANH), lookup(qz[..., 3 * H:], T_SIG)], -1)


def i8_cell(a, qc, H):
    a = np.asarray(a, np.int64)
    i, f, g = a[..., :H], a[..., H:2 * H], a[..., 2 * H:3 * H]
    v = (16 * f * np.asarray(qc, np.int64) + i * g).astype(np.float64)
    return np.clip(np.rint(v / 2 ** 19), -32768, 32767).astype(np.int64)


def i8_hidden(o, qc):
    t = lookup(np.clip(2 * np.asarray(qc, np.int64), -32768, 32767), T_TANH)
    return np.clip(np.rint(127.0 * np.asarray(o, np.int64) * t / 2 ** 30), -127, 127).astype(np.int64)


def i8_logits(qh, qp, s):
    return ((np.asarray(qh, np.int64) @ qp["out.w"] + qp["out.b"]).astype(np.float64) * s["out.b"]).astype(np.float32)


def i8_forward_loss(theta, E, H, L, batch):
    q, s, _ = quantize(theta, E, H, L); qp = C.unpack(q, E, H, L)
    batch = np.asarray(batch).astype(np.int64); tok, tgt = batch[:, :-1], batch[:, 1:]
    Bn, T = tok.shape
    x = qp["embed"][tok]
    for l in range(L):
        h = np.zeros((Bn, H), np.int64); c = np.zeros((Bn, H), np.int64)
        hs = np.empty((Bn, T, H), np.int64)
        for t in range(T):
            a = i8_acts(i8_gates(x[:, t], h, qp, s, l), H)
            c = i8_cell(a, c, H); h = i8_hidden(a[..., 3 * H:], c); hs[:, t] = h
        x = hs
    nll = C.nll_from_logits(i8_logits(x, qp, s), tgt)
    return nll.astype(np.float64).mean()


def int8_stage(k, E, H, L):
    res = {}
    q, s, scales = quantize(k["theta"], E, H, L); qp = C.unpack(q, E, H, L)
    res["scales"] = scales; res["quantized"] = q
    res["sigmoid_table"] = T_SIG; res["tanh_table"] = T_TANH
    res["state_h"] = np.clip(np.rint(127 * k["h0"].astype(np.float64)), -127, 127).astype(np.int64)
    res["state_c"] = np.clip(np.rint(2048 * k["c0"].astype(np.float64)), -32768, 32767).astype(np.int64)
    tokens = k["tokens"].astype(np.int64)
    for l in range(L):
        x = qp["embed"][tokens] if l == 0 else k[f"hidden{l-1}"]
        hprev = np.concatenate([res["state_h"][l][:, None, :], k[f"hidden{l}"][:, :-1]], 1)
        cprev = np.concatenate([res["state_c"][l][:, None, :], k[f"cells{l}"][:, :-1]], 1)
        res[f"gates{l}"] = i8_gates(x, hprev, qp, s, l)
        res[f"activations{l}"] = i8_acts(k[f"gates{l}"], H)
        res[f"cells{l}"] = i8_cell(k[f"activations{l}"], cprev, H)
        res[f"hidden{l}"] = i8_hidden(k[f"activations{l}"][..., 3 * H:], k[f"cells{l}"])
    res["logits"] = i8_logits(k[f"hidden{L-1}"], qp, s)
    res["nll"] = C.nll_from_logits(k["logits"].astype(np.float32), k["targets"]).astype(np.float64)
    res["loss"] = np.float64(i8_forward_loss(k["theta"], E, H, L, k["batch"]))
    et = k["edge_tensor"].astype(np.float64); mx = np.abs(et).max()
    res["edge_scale"] = np.float64(mx / 127 if mx > 0 else 1.0)
    res["edge_q"] = np.clip(np.rint(et / float(k["edge_scale"])), -127, 127).astype(np.int64)
    res["edge_qz"] = np.clip(np.rint(4096 * k["edge_z"]), -32768, 32767).astype(np.int64)
    res["edge_activations"] = i8_acts(k["edge_gates"], 1)
    ea = k["edge_activations"]
    res["edge_cells"] = i8_cell(ea, k["edge_c"][:, None], 1)[:, 0]
    res["edge_hidden"] = i8_hidden(ea[:, 3], k["edge_cells"])
    return res
