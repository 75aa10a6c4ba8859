"""Write each kit stage's outputs to out/<stage>.npz.  usage: port.py KIT OUT [stage ...]"""
import sys, os, json, time
import numpy as np
sys.path.insert(0, os.path.dirname(__file__))
import core as C

KIT, OUT = sys.argv[1], sys.argv[2]
MAN = json.load(open(os.path.join(KIT, "manifest.json")))
E, H, L = MAN["model"]["embed"], MAN["model"]["hidden"], MAN["model"]["layers"]


def load(name):
    z = np.load(os.path.join(KIT, name + ".npz"))
    return {k: z[k] for k in z.files}


def save(name, **kw):
    np.savez(os.path.join(OUT, name + ".npz"), **kw)


def st_forward():
    k = load("forward")
    logits, hT, cT, rec = C.forward(k["theta"], E, H, L, k["tokens"], k["h0"], k["c0"], record=True)
    save("forward", logits=logits, hT=hT, cT=cT, **rec)


def st_losses():
    k = load("losses")
    nll, loss = C.batch_loss(k["theta"], E, H, L, k["batch"])
    save("losses", nll=nll, loss=np.float64(loss))


def st_noise():
    k = load("noise")
    n = int(k["length"]); ph, ra, ga = [], [], []
    for s, e, t, m in zip(k["seed"], k["expert"], k["step"], k["member"]):
        ph.append(C.philox_words(int(s), int(e), int(t), int(m), [0])[0].astype(np.uint32))
        ra.append(C.rademacher(int(s), int(e), int(t), int(m), n))
        ga.append(C.gaussian(int(s), int(e), int(t), int(m), n).astype(np.float64))
    save("noise", philox=np.array(ph), rademacher=np.array(ra), gaussian=np.array(ga))


def st_init():
    k = load("init")
    save("init", theta=C.init(int(k["embed"]), int(k["hidden"]), int(k["layers"]), int(k["seed"]), int(k["expert"])))


def st_batches():
    k = load("batches")
    w = C.Windows(k["text"], k["offsets"], int(k["T"]))
    B = int(k["B"])
    draws = np.array([w.draws(int(k["seed"]), int(k["stream"]), int(s), B) for s in k["steps"]])
    doc, start = w.locate(k["draws"])
    save("batches", draws=draws, doc=doc, start=start, batches=w.gather(k["doc"], k["start"]))


def st_schedule():
    k = load("schedule")
    rates = np.array([[C.lr_at(t, float(k["lr"]), int(tot), int(wu), str(sc), float(f)) for t in range(int(k["count"]))]
                      for sc, wu, tot, f in zip(k["schedule"], k["warmup"], k["total"], k["factor"])])
    save("schedule", rates=rates)


def members(theta, eps, deltas):
    e = np.float32(eps)
    plus = np.stack([theta + e * d for d in deltas]); minus = np.stack([theta - e * d for d in deltas])
    return plus, minus


def st_spsa_step():
    k = load("spsa_step")
    th = k["theta"]; P = int(k["P"]); d = th.size
    deltas = [C.noise(str(k["noise"]), int(k["seed"]), int(k["expert"]), int(k["step"]), m, d) for m in range(P)]
    pl, mi = members(th, float(k["eps"]), deltas)
    _, lp = C.batch_loss(pl, E, H, L, k["batch"]); _, lm = C.batch_loss(mi, E, H, L, k["batch"])
    sc = (lp - lm) / (2 * float(k["eps"]))
    new = C.sgd_update(th, k["scalars"], deltas, float(k["lr"]), float(k["weight_decay"]))
    save("spsa_step", plus=lp, minus=lm, scalars=sc, theta_new=new)


def train_like(name, normalize=False):
    k = load(name)
    th = k["theta"].copy(); d = th.size
    T, B, P, eps = int(k["T"]), int(k["B"]), int(k["P"]), float(k["eps"])
    steps, lr, wu, wd = int(k["steps"]), float(k["lr"]), int(k["warmup"]), float(k["weight_decay"])
    seed, stream, fault = int(k["seed"]), int(k["stream"]), int(k["fault_step"])
    w = C.Windows(k["text"], k["offsets"], T)
    out = {x: [] for x in ["batches", "rates", "plus", "minus", "scalars", "shaped", "normalize_states"]}
    nstate = [0, 0.0]
    W = int(k["normalize_window"]) if normalize else None
    for t in range(steps):
        b = w.batch(seed, stream, t, B)
        r = C.lr_at(t, lr, steps, wu)
        deltas = [C.noise("rademacher", seed, stream, t, m, d) for m in range(P)]
        pl, mi = members(th, eps, deltas)
        _, lp = C.batch_loss(pl, E, H, L, b); _, lm = C.batch_loss(mi, E, H, L, b)
        lp = np.array(lp, np.float64); lm = np.array(lm, np.float64)
        if t == fault:
            lp[0] = np.nan
        out["batches"].append(b); out["rates"].append(r); out["plus"].append(lp); out["minus"].append(lm)
        out["scalars"].append((lp - lm) / (2 * eps))
        g = k["scalars"][t]
        if normalize:
            if np.all(np.isfinite(g)):
                sh, nstate = C.normalize_piece(g, nstate, W)
            else:
                sh = g.copy()
            out["shaped"].append(sh); out["normalize_states"].append(list(nstate))
            g = k["shaped"][t]
        if np.all(np.isfinite(g)):
            th = C.sgd_update(th, g, deltas, r, wd)
    res = {x: np.array(v) for x, v in out.items() if v}
    res["theta_final"] = th
    save(name, **res)


def st_shaping():
    k = load("shaping")
    S = k["scalars"]; res = {}
    for chain in (["clip"], ["normalize"], ["clip", "normalize"]):
        states = {"clip": list(k["clip_state"]), "normalize": list(k["normalize_state"])}
        rows, strows = [], {p: [] for p in chain}
        for g in S:
            if np.all(np.isfinite(g)):
                for p in chain:
                    if p == "clip":
                        g, states[p] = C.clip_piece(g, states[p], float(k["clip_at"]))
                    else:
                        g, states[p] = C.normalize_piece(g, states[p], int(k["normalize_window"]))
            rows.append(np.array(g, np.float64))
            for p in chain:
                strows[p].append(list(states[p]))
        nm = "_".join(chain)
        res[nm + "_scalars"] = np.array(rows)
        for p in chain:
            res[f"{nm}_{p}_states"] = np.array(strows[p], np.float64)
    save("shaping", **res)


def st_router():
    k = load("router")
    cfg = json.loads(str(k["config"])); F = cfg["n_features"]
    off = k["offsets"]; ctxs = [k["contexts"][off[i]:off[i + 1]] for i in range(len(off) - 1)]
    counts = np.array([C.ngram_counts(c, cfg["ngram_min"], cfg["ngram_max"], F) for c in ctxs])
    feats = C.features(k["counts"], k["idf"], cfg.get("sublinear_tf", True))
    emb = C.embed_features(k["features"], k["projection"])
    dist = C.distances(k["embeddings"], k["centroids"])
    K, tau = int(k["top_k"]), float(k["temperature"])
    res = dict(counts=counts, features=feats, embeddings=emb, distances=dist)
    for suffix, dropped in (("", ()), ("_dropped", tuple(k["dropped"]))):
        ex, ws = [], []
        for s in range(len(ctxs)):
            zero = not np.any(k["embeddings"][s] != 0)
            e_, w_ = C.route(k["distances"][s], K, tau, dropped, zero, k["centroids"])
            ex.append(e_); ws.append(w_)
        res["experts" + suffix] = np.array(ex); res["weights" + suffix] = np.array(ws)
    te, tw = [], []
    for drow in k["tie_distances"]:
        e_, w_ = C.route(drow.astype(np.float64), K, tau)
        te.append(e_); tw.append(w_)
    res["tie_experts"] = np.array(te); res["tie_weights"] = np.array(tw)
    save("router", **res)


def segments_of(n, seg=256, ctx=512):
    out, s = [], 0
    while True:
        p0 = 1 + seg * s
        if p0 > n - 1:
            break
        p1 = min(p0 + seg, n); c0 = max(p0 - ctx, 0)
        out.append((c0, p0, p1)); s += 1
    return out


def seg_nats(theta, e, h, l, doc, segs, dtype=np.float32, chunk=512):
    """Per-segment arrays of nats (float) of positions p0..p1-1, model from zero state over bytes c0..p1-2."""
    res = [None] * len(segs)
    # group segments by (input length, scored count) to batch them
    groups = {}
    for i, (c0, p0, p1) in enumerate(segs):
        groups.setdefault((p1 - 1 - c0, p1 - p0), []).append(i)
    for (nin, nsc), idx in groups.items():
        for a in range(0, len(idx), chunk):
            ii = idx[a:a + chunk]
            inp = np.stack([doc[segs[i][0]:segs[i][2] - 1] for i in ii])          # (b, nin)
            tgt = np.stack([doc[segs[i][0] + 1:segs[i][2]] for i in ii])
            logits, _, _, _ = C.forward(theta, e, h, l, inp, dtype=dtype)
            nll = C.nll_from_logits(logits[:, -nsc:], tgt[:, -nsc:])
            for j, i in enumerate(ii):
                res[i] = nll[j]
    return res


def st_routed():
    k = load("routed")
    e, h, l = int(k["embed"]), int(k["hidden"]), int(k["layers"])
    cfg = json.loads(str(k["config"])); F = cfg["n_features"]
    K, tau, seg, ctx = int(k["top_k"]), float(k["temperature"]), int(k["segment"]), int(k["context"])
    off = k["offsets"]; text = k["text"]
    SE, SW, SN = [], [], []
    total_nats, total_bytes = 0.0, 0
    for di in range(len(off) - 1):
        doc = text[off[di]:off[di + 1]]
        segs = segments_of(len(doc), seg, ctx)
        per_exp = [seg_nats(k["experts"][x], e, h, l, doc, segs) for x in range(len(k["experts"]))]
        for si, (c0, p0, p1) in enumerate(segs):
            cnt = C.ngram_counts(doc[c0:p0], cfg["ngram_min"], cfg["ngram_max"], F)
            ft = C.features(cnt[None], k["idf"], cfg.get("sublinear_tf", True))
            em = C.embed_features(ft, k["projection"])[0]
            zero = not np.any(em != 0)
            dist = C.distances(em, k["centroids"])
            ex, w = C.route(dist, K, tau, (), zero, k["centroids"])
            nk = np.stack([per_exp[x][si].astype(np.float64) for x in ex])      # (K, n)
            mix = -np.log(np.sum(w[:, None] * np.exp(-nk), 0))
            SE.append(ex); SW.append(w); SN.append(mix.sum())
            total_nats += mix.sum(); total_bytes += p1 - p0
    save("routed", segment_experts=np.array(SE), segment_weights=np.array(SW), segment_nats=np.array(SN),
         routed=np.float64(total_nats / total_bytes))


STAGES = dict(forward=st_forward, losses=st_losses, noise=st_noise, init=st_init, batches=st_batches,
              schedule=st_schedule, spsa_step=st_spsa_step, train=lambda: train_like("train"),
              train_normalize=lambda: train_like("train_normalize", True), shaping=st_shaping,
              router=st_router, routed=st_routed)



def st_momentum():
    k = load("momentum"); th = k["theta"]; d = th.size; P = int(k["P"])
    deltas = [C.noise("rademacher", int(k["seed"]), int(k["expert"]), int(k["step"]), m, d) for m in range(P)]
    gh = C.ghat(k["scalars"], deltas)
    beta, lr, wd = float(k["momentum"]), float(k["lr"]), float(k["weight_decay"])
    m_new = (np.float32(beta) * k["m"] + k["ghat"].astype(np.float32)).astype(np.float32)
    mk = k["m_new"].astype(np.float32)
    th_new = (th - np.float32(lr) * mk - np.float32(lr * wd) * th).astype(np.float32)
    save("momentum", ghat=gh, m_new=m_new, theta_new=th_new)


def st_adam():
    k = load("adam"); th = k["theta"]; d = th.size; P = int(k["P"])
    deltas = [C.noise("rademacher", int(k["seed"]), int(k["expert"]), int(k["step"]), m, d) for m in range(P)]
    gh = C.ghat(k["scalars"], deltas)
    b1, b2, ea, lr, wd = float(k["beta1"]), float(k["beta2"]), float(k["eps_adam"]), float(k["lr"]), float(k["weight_decay"])
    g = k["ghat"].astype(np.float64)
    m_new = (b1 * k["m"].astype(np.float64) + (1 - b1) * g).astype(np.float32)
    v_new = (b2 * k["v"].astype(np.float64) + (1 - b2) * g * g).astype(np.float32)
    tp = int(k["step"]) + 1
    mk, vk = k["m_new"].astype(np.float64), k["v_new"].astype(np.float64)
    t64 = th.astype(np.float64)
    th_new = (t64 - lr * (mk / (1 - b1 ** tp)) / (np.sqrt(vk / (1 - b2 ** tp)) + ea) - lr * wd * t64).astype(np.float32)
    save("adam", ghat=gh, m_new=m_new, v_new=v_new, theta_new=th_new)


def centred_ranks(losses):
    f = -np.asarray(losses, np.float64)
    order = np.argsort(f, kind="stable")
    rank = np.empty(len(f)); rank[order] = np.arange(len(f))
    return rank / (len(f) - 1) - 0.5


def st_es():
    k = load("es"); th = k["theta"]; d = th.size; P = int(k["P"]); sig = float(k["sigma"])
    epsk = [C.noise("gaussian", int(k["seed"]), int(k["expert"]), int(k["step"]), m, d) for m in range(P)]
    pl, mi = members(th, sig, epsk)
    _, lp = C.batch_loss(pl, E, H, L, k["batch"]); _, lm = C.batch_loss(mi, E, H, L, k["batch"])
    inter = np.empty(2 * P); inter[0::2] = lp; inter[1::2] = lm
    ranks = centred_ranks(inter)
    kr = k["ranks"]
    coef = -(kr[0::2] - kr[1::2]) / (2 * sig)
    new = C.sgd_update(th, k["coefficients"], epsk, float(k["lr"]), float(k["weight_decay"]))
    save("es", plus=lp, minus=lm, ranks=ranks, coefficients=coef, tie_ranks=centred_ranks(k["tie_losses"]), theta_new=new)


def eggroll_E(seed, stream, step, member, sigma, r, e=None, h=None, l=None):
    e, h, l = e or E, h or H, l or L
    lay, d = C.layout(e, h, l)
    n = sum((s[0] + s[1]) * r if len(s) == 2 else s[0] for _, s, _ in lay)
    z = C.gaussian(seed, stream, step, member, n).astype(np.float64)
    out = np.zeros(d, np.float64); pos = 0
    for name, s, off in lay:
        if len(s) == 2:
            m_, n_ = s
            A = z[pos:pos + m_ * r].reshape(m_, r); pos += m_ * r
            Bm = z[pos:pos + n_ * r].reshape(n_, r); pos += n_ * r
            out[off:off + m_ * n_] = ((sigma / np.sqrt(r)) * (A @ Bm.T)).reshape(-1)
        else:
            out[off:off + s[0]] = sigma * z[pos:pos + s[0]]; pos += s[0]
    return out


def st_eggroll():
    k = load("eggroll"); th = k["theta"]; P = int(k["P"]); sig = float(k["sigma"]); r = int(k["rank"])
    Es = [eggroll_E(int(k["seed"]), int(k["expert"]), int(k["step"]), m, sig, r) for m in range(P)]
    pl = np.stack([(th + e.astype(np.float32)) for e in Es]); mi = np.stack([(th - e.astype(np.float32)) for e in Es])
    _, lp = C.batch_loss(pl, E, H, L, k["batch"]); _, lm = C.batch_loss(mi, E, H, L, k["batch"])
    f = np.empty(2 * P); f[0::2] = -lp; f[1::2] = -lm
    sd = f.std()
    if f.max() == f.min() or sd <= 1e-12 * max(1.0, np.abs(f).max()):
        zz = np.zeros_like(f)
    else:
        zz = (f - f.mean()) / sd
    coef = zz[0::2] - zz[1::2]
    upd = sum(c * e for c, e in zip(k["coefficients"], Es))
    new = (th.astype(np.float64) + float(k["lr"]) * (2 * P) ** -0.5 * upd).astype(np.float32)
    save("eggroll", perturbation=Es[0], plus=lp, minus=lm, coefficients=coef, theta_new=new)


def st_restart():
    k = load("restart")
    nh = len(k["length"]); S = k["losses"].shape[1]
    res = {x: [] for x in ["window", "verdict_step", "verdict", "smoothed", "best", "window_start", "healthy", "action",
                           "rollback_to", "lr_scale", "stream", "batches_after", "rates_after", "philox_after"]}
    w_ = C.Windows(k["text"], k["offsets"], int(k["T"])); B = int(k["B"]); seed = int(k["seed"])
    fac, RS = float(k["restart_lr_factor"]), int(k["restart_stream"])
    for hi in range(nh):
        steps = int(k["run_steps"][hi]); window = max(20, min(200, steps // 8))
        n = 0; rsk = 0; sm = None; best = np.inf; above = 0
        healthy = np.zeros(S + 1, bool); healthy[0] = True; verdict = None
        for i in range(int(k["length"][hi])):
            n += 1; lo = k["losses"][hi, i]
            if k["skipped"][hi, i] or not np.isfinite(lo):
                rsk += 1
                if rsk >= 20: verdict = "non-finite"
            else:
                rsk = 0
                sm = lo if sm is None else 0.98 * sm + 0.02 * lo
                best = min(best, sm)
                if n > 50:
                    above = above + 1 if sm > 1.25 * best else 0
                    if above >= window: verdict = "rising"
            healthy[n] = (sm is None or sm <= 1.25 * best) and rsk == 0
            if verdict: break
        ws = n - max(above, rsk) + 1
        rest = int(k["restarts"][hi]); ex = int(k["expert"][hi])
        drop = rest >= int(k["max_restarts"])
        cps = [int(c) for c in k["checkpoints"][hi] if c >= 0]
        if drop:
            rb, scale, stream = -1, fac ** rest, ex + RS * rest
        else:
            ok = [c for c in cps if c < ws and healthy[c]]
            rb = max(ok) if ok else cps[0]
            scale, stream = fac ** (rest + 1), ex + RS * (rest + 1)
        for x, v in [("window", window), ("verdict_step", n), ("verdict", verdict), ("smoothed", sm), ("best", best),
                     ("window_start", ws), ("healthy", healthy), ("action", "drop" if drop else "restart"),
                     ("rollback_to", rb), ("lr_scale", scale), ("stream", stream)]:
            res[x].append(v)
        A = int(k["after"])
        if drop:
            res["batches_after"].append(np.zeros((A, B, int(k["T"]) + 1), np.uint8)); res["rates_after"].append(np.zeros(A))
            res["philox_after"].append(np.zeros(4, np.uint32))
        else:
            res["batches_after"].append(np.stack([w_.batch(seed, stream, rb + j, B) for j in range(A)]))
            res["rates_after"].append([C.lr_at(rb + j, float(k["lr"]), steps, int(k["warmup"]), str(k["schedule"])) * scale for j in range(A)])
            res["philox_after"].append(C.philox_words(seed, stream, rb, 0, [0])[0].astype(np.uint32))
    save("restart", **{x: np.array(v) for x, v in res.items()})


STAGES.update(momentum=st_momentum, adam=st_adam, es=st_es, eggroll=st_eggroll, restart=st_restart)




import lowprec as LP
STAGES.update(bf16=lambda: save("bf16", **LP.float_stage(load("bf16"), E, H, L, "bf16")),
              fp16=lambda: save("fp16", **LP.float_stage(load("fp16"), E, H, L, "fp16")),
              int8=lambda: save("int8", **LP.int8_stage(load("int8"), E, H, L)))


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    names = sys.argv[3:] or list(STAGES)
    for n in names:
        t0 = time.time(); STAGES[n](); print(n, f"{time.time() - t0:.1f}s", flush=True)
