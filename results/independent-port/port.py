"""Port driver: reads each kit stage's inputs, writes PORT/out/<stage>.npz."""
import json
import os
import sys
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import core  # noqa: E402

KIT = sys.argv[1] if len(sys.argv) > 1 else "/work/port-check/kit"
OUT = sys.argv[2] if len(sys.argv) > 2 else "/work/port-check/port/out"
MAN = json.load(open(os.path.join(KIT, "manifest.json")))
E, H, L = MAN["model"]["embed"], MAN["model"]["hidden"], MAN["model"]["layers"]


def kit(stage):
    return np.load(os.path.join(KIT, stage + ".npz"), allow_pickle=False)


def save(stage, **arrs):
    np.savez(os.path.join(OUT, stage + ".npz"), **{k: np.asarray(v) for k, v in arrs.items()})


STAGES = {}


def stage(fn):
    STAGES[fn.__name__] = fn
    return fn


@stage
def forward():
    z = kit("forward")
    tr = core.forward(z["theta"], z["tokens"], z["h0"], z["c0"], E, H, L)
    save("forward", **tr)


@stage
def losses():
    z = kit("losses")
    nll, l = core.loss(z["theta"], z["batch"], E, H, L)
    save("losses", nll=nll, loss=l)


@stage
def noise():
    z = kit("noise")
    n = int(z["length"])
    ph, ra, ga = [], [], []
    for s, e, st, m in zip(z["seed"], z["expert"], z["step"], z["member"]):
        x = core.philox(int(s), 0, int(m), int(st), int(e))
        ph.append([int(w) for w in x])
        ra.append(core.rademacher(int(s), int(e), int(st), int(m), n))
        ga.append(core.gaussian(int(s), int(e), int(st), int(m), n))
    save("noise", philox=np.array(ph, np.uint32), rademacher=np.array(ra), gaussian=np.array(ga))


@stage
def init():
    z = kit("init")
    th = core.init(int(z["embed"]), int(z["hidden"]), int(z["layers"]), int(z["seed"]), int(z["expert"]))
    save("init", theta=th)


@stage
def batches():
    z = kit("batches")
    T, B = int(z["T"]), int(z["B"])
    draws = np.stack([core.batch_draws(z["offsets"], T, B, int(z["seed"]), int(z["stream"]), int(s))
                      for s in z["steps"]])
    doc, start = core.doc_start(z["offsets"], T, z["draws"])          # from the kit's draws
    bat = core.gather_batch(z["text"], z["offsets"], T, z["doc"], z["start"])  # from the kit's doc/start
    save("batches", draws=draws, doc=doc, start=start, batches=bat)


@stage
def schedule():
    z = kit("schedule")
    lr = float(z["lr"]); cnt = int(z["count"])
    rates = np.array([[core.lr_at(t, lr, str(s), int(w), int(tot), float(f)) for t in range(cnt)]
                      for s, w, tot, f in zip(z["schedule"], z["warmup"], z["total"], z["factor"])])
    save("schedule", rates=rates)


def members_losses(theta, batch, deltas, eps):
    plus, minus = [], []
    for d in deltas:
        step = np.float32(eps) * d.astype(np.float32)
        plus.append(core.loss((theta + step).astype(np.float32), batch, E, H, L)[1])
        minus.append(core.loss((theta - step).astype(np.float32), batch, E, H, L)[1])
    return np.array(plus), np.array(minus)


@stage
def spsa_step():
    z = kit("spsa_step")
    theta = z["theta"]; P = int(z["P"]); eps = float(z["eps"])
    seed, ex, st = int(z["seed"]), int(z["expert"]), int(z["step"])
    deltas = [core.rademacher(seed, ex, st, k, theta.size) for k in range(P)]
    plus, minus = members_losses(theta, z["batch"], deltas, eps)
    scalars = (plus - minus) / (2 * eps)
    new = core.sgd_update(theta, z["scalars"], deltas, float(z["lr"]), float(z["weight_decay"]))
    save("spsa_step", plus=plus, minus=minus, scalars=scalars, theta_new=new)


@stage
def train():
    z = kit("train")
    theta = z["theta"].copy(); P = int(z["P"]); eps = float(z["eps"])
    T, B = int(z["T"]), int(z["B"]); steps = int(z["steps"]); warm = int(z["warmup"])
    seed, stream = int(z["seed"]), int(z["stream"]); wd = float(z["weight_decay"])
    kscal = z["scalars"]; fault = int(z["fault_step"])
    bats, rates, PL, MI = [], [], [], []
    for t in range(steps):
        bat = core.batch_of(z["text"], z["offsets"], T, B, seed, stream, t)
        lr_t = core.lr_at(t, float(z["lr"]), "cosine", warm, steps)
        deltas = [core.rademacher(seed, stream, t, k, theta.size) for k in range(P)]
        plus, minus = members_losses(theta, bat, deltas, eps)
        if t == fault:
            plus[0] = np.nan
        bats.append(bat); rates.append(lr_t); PL.append(plus); MI.append(minus)
        g = kscal[t]
        if np.all(np.isfinite(g)):
            theta = core.sgd_update(theta, g, deltas, lr_t, wd)
    PL = np.array(PL); MI = np.array(MI)
    save("train", batches=np.array(bats), rates=np.array(rates), plus=PL, minus=MI,
         scalars=(PL - MI) / (2 * eps), theta_final=theta)


@stage
def momentum():
    z = kit("momentum")
    theta = z["theta"]; P = int(z["P"]); d = theta.size
    seed, ex, st = int(z["seed"]), int(z["expert"]), int(z["step"])
    deltas = [core.rademacher(seed, ex, st, k, d) for k in range(P)]
    ghat = core.sgd_direction(z["scalars"], deltas)
    beta = float(z["momentum"]); lr = float(z["lr"]); wd = float(z["weight_decay"])
    m_new = (np.float32(beta) * z["m"] + z["ghat"].astype(np.float32)).astype(np.float32)
    mk = z["m_new"].astype(np.float32)
    th = theta - np.float32(lr) * mk - np.float32(lr * wd) * theta
    save("momentum", ghat=ghat, m_new=m_new, theta_new=th.astype(np.float32))


@stage
def adam():
    z = kit("adam")
    theta = z["theta"]; P = int(z["P"]); d = theta.size
    seed, ex, st = int(z["seed"]), int(z["expert"]), int(z["step"])
    deltas = [core.rademacher(seed, ex, st, k, d) for k in range(P)]
    ghat = core.sgd_direction(z["scalars"], deltas)
    b1, b2, ea = float(z["beta1"]), float(z["beta2"]), float(z["eps_adam"])
    lr = float(z["lr"]); wd = float(z["weight_decay"])
    gk = z["ghat"].astype(np.float64)
    m_new = (b1 * z["m"].astype(np.float64) + (1 - b1) * gk).astype(np.float32)
    v_new = (b2 * z["v"].astype(np.float64) + (1 - b2) * gk * gk).astype(np.float32)
    tp = st + 1
    mk = z["m_new"].astype(np.float64); vk = z["v_new"].astype(np.float64)
    th64 = theta.astype(np.float64)
    upd = (mk / (1 - b1 ** tp)) / (np.sqrt(vk / (1 - b2 ** tp)) + ea)
    th = th64 - lr * upd - lr * wd * th64
    save("adam", ghat=ghat, m_new=m_new, v_new=v_new, theta_new=th.astype(np.float32))


def centred_ranks(f):
    n = len(f)
    order = np.argsort(f, kind="stable")
    ranks = np.empty(n); ranks[order] = np.arange(n)
    return ranks / (n - 1) - 0.5


@stage
def es():
    z = kit("es")
    theta = z["theta"]; P = int(z["P"]); d = theta.size; sigma = float(z["sigma"])
    seed, ex, st = int(z["seed"]), int(z["expert"]), int(z["step"])
    noises = [core.gaussian(seed, ex, st, k, d) for k in range(P)]
    plus, minus = members_losses(theta, z["batch"], noises, sigma)
    f = -np.stack([plus, minus], axis=1).reshape(-1)  # +0, -0, +1, -1, ...
    ranks = centred_ranks(f)
    kr = z["ranks"]
    coef = -(kr[0::2] - kr[1::2]) / (2 * sigma)
    new = core.sgd_update(theta, z["coefficients"], noises, float(z["lr"]), float(z["weight_decay"]))
    save("es", plus=plus, minus=minus, ranks=ranks, coefficients=coef, theta_new=new)


def eggroll_E(seed, ex, st, k, sigma, r):
    lay, d = core.layout(E, H, L)
    n = sum((s[0] + s[1]) * r if len(s) == 2 else s[0] for _, s, _ in lay)
    zk = core.gaussian(seed, ex, st, k, n).astype(np.float64)
    out = np.empty(d, np.float64); pos = 0
    for name, shape, off in lay:
        if len(shape) == 2:
            m, nn = shape
            A = zk[pos:pos + m * r].reshape(m, r); pos += m * r
            Bm = zk[pos:pos + nn * r].reshape(nn, r); pos += nn * r
            out[off:off + m * nn] = ((sigma / np.sqrt(r)) * (A @ Bm.T)).reshape(-1)
        else:
            s = shape[0]
            out[off:off + s] = sigma * zk[pos:pos + s]; pos += s
    assert pos == n
    return out


def zscore_coeffs(plus, minus):
    f = -np.stack([plus, minus], axis=1).reshape(-1)
    sd = f.std()
    if f.max() == f.min() or sd <= 1e-12 * max(1.0, np.abs(f).max()):
        zz = np.zeros_like(f)
    else:
        zz = (f - f.mean()) / sd
    return zz[0::2] - zz[1::2]


@stage
def eggroll():
    z = kit("eggroll")
    theta = z["theta"]; P = int(z["P"]); sigma = float(z["sigma"]); r = int(z["rank"])
    seed, ex, st = int(z["seed"]), int(z["expert"]), int(z["step"])
    Es = [eggroll_E(seed, ex, st, k, sigma, r) for k in range(P)]
    th64 = theta.astype(np.float64)
    plus = np.array([core.loss((th64 + e).astype(np.float32), z["batch"], E, H, L)[1] for e in Es])
    minus = np.array([core.loss((th64 - e).astype(np.float32), z["batch"], E, H, L)[1] for e in Es])
    coef = zscore_coeffs(plus, minus)
    kc = z["coefficients"]; lr = float(z["lr"])
    acc = sum(kc[k] * Es[k] for k in range(P))
    new = (th64 + lr * (2 * P) ** -0.5 * acc).astype(np.float32)
    save("eggroll", perturbation=Es[0], plus=plus, minus=minus, coefficients=coef, theta_new=new)


def clip_piece(g, state, c):
    s, m = state
    if s >= 10:
        g = np.clip(g, -c * m, c * m)
    med = float(np.median(np.abs(g)))
    m = med if s == 0 else 0.98 * m + 0.02 * med
    return g, [s + 1, m]


def normalize_piece(g, state, W):
    s, S = state
    spread = float(np.sqrt(np.mean(g ** 2)))
    if s < W:
        return g, [s + 1, S + spread]
    if spread == 0:
        return np.zeros_like(g), [s, S]
    return g * (S / s) / spread, [s, S]


@stage
def shaping():
    z = kit("shaping")
    rows = z["scalars"].astype(np.float64); c = float(z["clip_at"]); W = int(z["normalize_window"])
    out = {}
    for chain in (("clip",), ("normalize",), ("clip", "normalize")):
        st = {"clip": list(map(float, z["clip_state"])), "normalize": list(map(float, z["normalize_state"]))}
        cname = "_".join(chain)
        res = []; states = {p: [] for p in chain}
        for row in rows:
            g = row.copy()
            if np.all(np.isfinite(g)):
                for p in chain:
                    if p == "clip":
                        g, st[p] = clip_piece(g, st[p], c)
                    else:
                        g, st[p] = normalize_piece(g, st[p], W)
            res.append(g)
            for p in chain:
                states[p].append(list(st[p]))
        out[cname + "_scalars"] = np.array(res)
        for p in chain:
            out[f"{cname}_{p}_states"] = np.array(states[p])
    save("shaping", **out)


def guard(losses, skipped, run_steps):
    window = max(20, min(200, run_steps // 8))
    n = 0; rs = 0; sm = None; best = np.inf; above = 0
    healthy = [True]  # healthy[0]: before any step
    verdict = None
    for loss, sk in zip(losses, skipped):
        n += 1
        if sk or not np.isfinite(loss):
            rs += 1
            if rs >= 20:
                verdict = "non-finite"
        else:
            rs = 0
            sm = loss if sm is None else 0.98 * sm + 0.02 * loss
            best = min(best, sm)
            if n > 50:
                above = above + 1 if sm > 1.25 * best else 0
                if above >= window:
                    verdict = "rising"
        healthy.append((sm is None or sm <= 1.25 * best) and rs == 0)
        if verdict:
            break
    ws = n - max(above, rs) + 1
    return dict(window=window, verdict_step=n, verdict=verdict, smoothed=sm, best=best,
                window_start=ws, healthy=healthy)


@stage
def restart():
    z = kit("restart")
    nh, S = z["losses"].shape
    T, B = int(z["T"]), int(z["B"]); seed = int(z["seed"]); after = int(z["after"])
    fac = float(z["restart_lr_factor"]); maxr = int(z["max_restarts"]); rst = int(z["restart_stream"])
    res = {k: [] for k in ("window", "verdict_step", "verdict", "smoothed", "best", "window_start",
                           "healthy", "action", "rollback_to", "lr_scale", "stream",
                           "batches_after", "rates_after", "philox_after")}
    for h in range(nh):
        ln = int(z["length"][h]); rsteps = int(z["run_steps"][h])
        g = guard(z["losses"][h, :ln], z["skipped"][h, :ln], rsteps)
        hl = np.zeros(S + 1, bool); hl[:len(g["healthy"])] = g["healthy"]
        for k in ("window", "verdict_step", "verdict", "smoothed", "best", "window_start"):
            res[k].append(g[k])
        res["healthy"].append(hl)
        restarts = int(z["restarts"][h]); ex = int(z["expert"][h])
        # rollback from the KIT's window_start / healthy / action
        kws = int(z["window_start"][h]); khl = z["healthy"][h]
        drop = restarts >= maxr
        res["action"].append("drop" if drop else "restart")
        cps = [int(c) for c in z["checkpoints"][h] if c >= 0]
        if drop:
            rb = -1
        else:
            good = [c for c in cps if c < kws and khl[c]]
            rb = good[-1] if good else cps[0]
        res["rollback_to"].append(rb)
        kact = str(z["action"][h])
        nr = restarts + (0 if kact == "drop" else 1)
        res["lr_scale"].append(fac ** nr)
        res["stream"].append(ex + rst * nr)
        krb = int(z["rollback_to"][h]); kstream = int(z["stream"][h]); kscale = float(z["lr_scale"][h])
        if kact == "drop":
            res["batches_after"].append(np.zeros((after, B, T + 1), np.uint8))
            res["rates_after"].append(np.zeros(after))
            res["philox_after"].append(np.zeros(4, np.uint32))
        else:
            res["batches_after"].append(np.stack([core.batch_of(z["text"], z["offsets"], T, B, seed, kstream, krb + j)
                                                  for j in range(after)]))
            res["rates_after"].append(np.array([core.lr_at(krb + j, float(z["lr"]), "cosine", int(z["warmup"]), rsteps, kscale)
                                                for j in range(after)]))
            res["philox_after"].append(np.array([int(w) for w in core.philox(seed, 0, 0, krb, kstream)], np.uint32))
    out = {k: np.array(v) for k, v in res.items()}
    out["verdict"] = out["verdict"].astype(str); out["action"] = out["action"].astype(str)
    save("restart", **out)


def fnv1a(bs):
    h = 2166136261
    for b in bs:
        h = ((h ^ int(b)) * 16777619) & 0xFFFFFFFF
    return h


def route(d, K, allowed, zero, tau):
    idx = np.array([i for i in range(len(d)) if allowed[i]])
    order = idx[np.argsort(d[idx], kind="stable")][:K]
    if zero:
        w = np.full(K, 1.0 / K)
    else:
        a = -d[order].astype(np.float64) / tau
        a = a - a.max(); w = np.exp(a); w = w / w.sum()
    return order, w


@stage
def router():
    z = kit("router")
    cfg = json.loads(str(z["config"]))
    F = int(cfg["n_features"]); bits = F.bit_length() - 1; assert 1 << bits == F
    nmin, nmax = int(cfg["ngram_min"]), int(cfg["ngram_max"])
    ctx = z["contexts"]; off = z["offsets"]; S = len(off) - 1
    counts = np.zeros((S, F), np.int64)
    for si in range(S):
        c = ctx[off[si]:off[si + 1]].tolist()
        for n in range(nmin, nmax + 1):
            for a in range(0, len(c) - n + 1):
                h = fnv1a(c[a:a + n])
                counts[si, ((h >> bits) ^ h) % F] += 1
    idf = z["idf"].astype(np.float64)
    kc = z["counts"]
    if cfg.get("sublinear_tf", True):
        tf = np.where(kc >= 1, 1 + np.log(np.maximum(kc, 1)), 0.0)
    else:
        tf = kc.astype(np.float64)
    x = tf * idf
    nx = np.linalg.norm(x, axis=1, keepdims=True)
    feats = np.where(nx > 0, x / np.where(nx > 0, nx, 1), 0.0)
    e = z["features"].astype(np.float64) @ z["projection"].astype(np.float64)
    ne = np.linalg.norm(e, axis=1, keepdims=True)
    emb = np.where(ne > 0, e / np.where(ne > 0, ne, 1), 0.0)
    ke = z["embeddings"].astype(np.float64); C = z["centroids"].astype(np.float64)
    dist = np.maximum(((ke[:, None, :] - C[None]) ** 2).sum(-1), 0).astype(np.float32)
    kd = z["distances"].astype(np.float64)
    K = int(z["top_k"]); tau = float(z["temperature"]); N = C.shape[0]
    dropped = set(int(i) for i in z["dropped"])
    out = {"experts": [], "weights": [], "experts_dropped": [], "weights_dropped": []}
    c2 = (C ** 2).sum(-1)
    for si in range(S):
        zero = not np.any(emb[si])  # own embedding (zero e: no n-gram in the context)
        dd = c2 if zero else kd[si]
        for suffix, allowed in (("", [True] * N), ("_dropped", [i not in dropped for i in range(N)])):
            o, w = route(dd, K, allowed, zero, tau)
            out["experts" + suffix].append(o); out["weights" + suffix].append(w)
    save("router", counts=counts, features=feats, embeddings=emb, distances=dist,
         **{k: np.array(v) for k, v in out.items()})


import lowp  # noqa: E402


def lowp_stage(fmt):
    z = kit(fmt)
    theta = z["theta"]
    M = lowp.Int8(theta, E, H, L) if fmt == "int8" else lowp.FloatFmt(fmt, theta, E, H, L)
    if fmt == "int8":
        sh, sc = M.qstate_h(z["h0"]), M.qstate_c(z["c0"])
    else:
        sh, sc = M.R(z["h0"]), M.R(z["c0"])
    out = {"state_h": sh, "state_c": sc}
    tokens = z["tokens"]; B, T = tokens.shape
    xemb = M.embed(tokens)
    for l in range(L):
        kh = z[f"hidden{l}"]; kc = z[f"cells{l}"]; kg = z[f"gates{l}"]; ka = z[f"activations{l}"]
        X = xemb if l == 0 else z[f"hidden{l-1}"]
        G, A, C, Hh = [], [], [], []
        for t in range(T):
            hprev = sh[l] if t == 0 else kh[:, t - 1]
            cprev = sc[l] if t == 0 else kc[:, t - 1]
            G.append(M.gates(l, X[:, t], hprev))
            A.append(M.acts(kg[:, t]))
            C.append(M.cell(ka[:, t], cprev))
            Hh.append(M.hidden(ka[:, t], kc[:, t]))
        out[f"gates{l}"] = np.stack(G, 1); out[f"activations{l}"] = np.stack(A, 1)
        out[f"cells{l}"] = np.stack(C, 1); out[f"hidden{l}"] = np.stack(Hh, 1)
    out["logits"] = M.logits(z[f"hidden{L-1}"])
    out["nll"] = core.nll_from_logits(z["logits"].astype(np.float32), z["targets"])
    bat = z["batch"]; zs = np.zeros((L, bat.shape[0], H), np.float32)
    lg = M.free(bat[:, :-1], zs, zs)
    out["loss"] = float(np.mean(core.nll_from_logits(lg, bat[:, 1:]).astype(np.float64)))
    eg = z["edge_gates"]
    ea = M.acts(eg)
    out["edge_activations"] = ea
    out["edge_cells"] = M.cell(z["edge_activations"], z["edge_c"][:, None])[:, 0]
    out["edge_hidden"] = M.hidden(z["edge_activations"], z["edge_cells"][:, None])[:, 0]
    if fmt == "int8":
        out["scales"] = M.scales; out["quantized"] = M.quantized
        out["sigmoid_table"] = lowp.T_SIG; out["tanh_table"] = lowp.T_TANH
        et = z["edge_tensor"].astype(np.float64)
        mx = np.abs(et).max()
        out["edge_scale"] = mx / 127 if mx > 0 else 1.0
        out["edge_q"] = np.clip(lowp.rint(et / float(z["edge_scale"])), -127, 127).astype(np.int64)
        out["edge_qz"] = np.clip(lowp.rint(4096 * z["edge_z"].astype(np.float64)), -32768, 32767).astype(np.int64)
    else:
        out["weights"] = M.w
        out["edge_rounded"] = M.R(z["edge_values"])
        out["edge_wide_rounded"] = M.R(z["edge_wide"])
    save(fmt, **out)


@stage
def bf16():
    lowp_stage("bf16")


@stage
def fp16():
    lowp_stage("fp16")


@stage
def int8():
    lowp_stage("int8")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    only = sys.argv[3:] or list(STAGES)
    for name in only:
        STAGES[name]()
        print("wrote", name)
