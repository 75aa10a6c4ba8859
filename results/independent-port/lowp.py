"""Stage 10: bf16 / fp16 / int8 forwards, written from PORTING.md only."""
import numpy as np
import core

# ------------------------------------------------------------------ float formats
def to_f32(x):
    return np.asarray(x).astype(np.float32)  # nearest-even (float64 -> float32 first)


def R_bf16(x):
    x32 = to_f32(x)
    u = x32.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    r = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    # NaN stays NaN (not exercised for finite inputs)
    return np.where(np.isnan(x32), np.float32(np.nan), r).astype(np.float32)


def R_fp16(x):
    with np.errstate(over="ignore"):
        return to_f32(x).astype(np.float16).astype(np.float32)


ROUND = {"bf16": R_bf16, "fp16": R_fp16}


def sig64(x):
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


class FloatFmt:
    def __init__(self, fmt, theta, E, H, L):
        self.R = ROUND[fmt]
        self.E, self.H, self.L = E, H, L
        self.w = self.R(theta)
        self.P = core.unpack(self.w, E, H, L)

    def gates(self, l, x, h):
        P = self.P
        Sx = x.astype(np.float32) @ P[f"lstm{l}.w_ih"]          # fp32 accumulation
        Sh = h.astype(np.float32) @ P[f"lstm{l}.w_hh"]
        return self.R(Sx.astype(np.float64) + Sh.astype(np.float64) + P[f"lstm{l}.bias"].astype(np.float64))

    def acts(self, z):
        H = np.shape(z)[-1] // 4
        z = np.asarray(z, np.float64)
        i = sig64(z[..., :H]); f = sig64(z[..., H:2 * H]); g = np.tanh(z[..., 2 * H:3 * H]); o = sig64(z[..., 3 * H:])
        return self.R(np.concatenate([i, f, g, o], axis=-1))

    def cell(self, a, c):
        H = np.shape(a)[-1] // 4
        a = np.asarray(a, np.float64); c = np.asarray(c, np.float64)
        i, f, g = a[..., :H], a[..., H:2 * H], a[..., 2 * H:3 * H]
        return self.R(f * c + i * g)

    def hidden(self, a, c):
        H = np.shape(a)[-1] // 4
        o = np.asarray(a, np.float64)[..., 3 * H:]
        tc = self.R(np.tanh(np.asarray(c, np.float64))).astype(np.float64)
        return self.R(o * tc)

    def logits(self, h):
        S = h.astype(np.float32) @ self.P["out.w"]
        return self.R(S.astype(np.float64) + self.P["out.b"].astype(np.float64))

    def embed(self, tokens):
        return self.P["embed"][np.asarray(tokens).astype(np.int64)]

    def free(self, tokens, h0, c0):
        B, T = tokens.shape
        x = self.embed(tokens)
        for l in range(self.L):
            h = self.R(h0[l]); c = self.R(c0[l])
            hs = []
            for t in range(T):
                a = self.acts(self.gates(l, x[:, t], h))
                c = self.cell(a, c)
                h = self.hidden(a, c)
                hs.append(h)
            x = np.stack(hs, axis=1)
        return self.logits(x)


# ------------------------------------------------------------------ int8
def rint(x):
    return np.rint(np.asarray(x, np.float64))


def table(fn):
    k = np.arange(257)
    return np.clip(rint(32768 * fn(-8 + k / 16)), -32768, 32767).astype(np.int64)


T_SIG = table(sig64)
T_TANH = table(np.tanh)


def lookup(q, T):
    u = np.asarray(q, np.int64) + 32768
    k = u >> 8; r = u & 255
    k1 = np.minimum(k + 1, 256)
    return T[k] + (((T[k1] - T[k]) * r + 128) >> 8)


class Int8:
    def __init__(self, theta, E, H, L):
        self.E, self.H, self.L = E, H, L
        lay, d = core.layout(E, H, L)
        P = core.unpack(theta, E, H, L)
        self.s = {}; self.q = {}
        for name, shape, off in lay:
            if len(shape) == 2:
                W = P[name].astype(np.float64)
                m = np.abs(W).max()
                s = m / 127 if m > 0 else 1.0
                self.s[name] = s
                self.q[name] = np.clip(rint(W / s), -127, 127).astype(np.int64)
        for l in range(L):
            sx = self.s["embed"] if l == 0 else float(np.float64(1) / 127)
            S = sx * self.s[f"lstm{l}.w_ih"]
            self.s[f"lstm{l}.bias"] = S
            self.q[f"lstm{l}.bias"] = np.clip(rint(P[f"lstm{l}.bias"].astype(np.float64) / S), -2 ** 31, 2 ** 31 - 1).astype(np.int64)
        So = self.s["out.w"] / 127
        self.s["out.b"] = So
        self.q["out.b"] = np.clip(rint(P["out.b"].astype(np.float64) / So), -2 ** 31, 2 ** 31 - 1).astype(np.int64)
        self.scales = np.array([self.s[n] for n, _, _ in lay])
        self.quantized = np.concatenate([self.q[n].reshape(-1) for n, _, _ in lay])

    @staticmethod
    def qstate_h(h0):
        return np.clip(rint(127 * np.asarray(h0, np.float64)), -127, 127).astype(np.int64)

    @staticmethod
    def qstate_c(c0):
        return np.clip(rint(2048 * np.asarray(c0, np.float64)), -32768, 32767).astype(np.int64)

    def gates(self, l, qx, qh):
        acc_x = np.asarray(qx, np.int64) @ self.q[f"lstm{l}.w_ih"] + self.q[f"lstm{l}.bias"]
        acc_h = np.asarray(qh, np.int64) @ self.q[f"lstm{l}.w_hh"]
        z = acc_x.astype(np.float64) * self.s[f"lstm{l}.bias"] + acc_h.astype(np.float64) * (self.s[f"lstm{l}.w_hh"] / 127)
        return np.clip(rint(4096 * z), -32768, 32767).astype(np.int64)

    def acts(self, qz):
        H = np.shape(qz)[-1] // 4
        qz = np.asarray(qz, np.int64)
        return np.concatenate([lookup(qz[..., :H], T_SIG), lookup(qz[..., H:2 * H], T_SIG),
                               lookup(qz[..., 2 * H:3 * H], T_TANH), lookup(qz[..., 3 * H:], T_SIG)], axis=-1)

    def cell(self, a, qc):
        H = np.shape(a)[-1] // 4
        a = np.asarray(a, np.int64); qc = np.asarray(qc, np.int64)
        i, f, g = a[..., :H], a[..., H:2 * H], a[..., 2 * H:3 * H]
        v = 16 * f * qc + i * g
        return np.clip(rint(v.astype(np.float64) / 2 ** 19), -32768, 32767).astype(np.int64)

    def hidden(self, a, qc):
        H = np.shape(a)[-1] // 4
        o = np.asarray(a, np.int64)[..., 3 * H:]
        t = lookup(np.clip(2 * np.asarray(qc, np.int64), -32768, 32767), T_TANH)
        return np.clip(rint((127 * o * t).astype(np.float64) / 2 ** 30), -127, 127).astype(np.int64)

    def logits(self, qh):
        acc = np.asarray(qh, np.int64) @ self.q["out.w"] + self.q["out.b"]
        return (acc.astype(np.float64) * self.s["out.b"]).astype(np.float32)

    def embed(self, tokens):
        return self.q["embed"][np.asarray(tokens).astype(np.int64)]

    def free(self, tokens, h0, c0):
        B, T = tokens.shape
        x = self.embed(tokens)
        for l in range(self.L):
            h = self.qstate_h(h0[l]); c = self.qstate_c(c0[l])
            hs = []
            for t in range(T):
                a = self.acts(self.gates(l, x[:, t], h))
                c = self.cell(a, c)
                h = self.hidden(a, c)
                hs.append(h)
            x = np.stack(hs, axis=1)
        return self.logits(x)
