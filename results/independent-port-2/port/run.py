"""Kit stage `run`: the default run shortened to 300 steps on the shipped corpus, then held-out eval."""
import sys, os, json, gzip, hashlib, time
import numpy as np
sys.path.insert(0, os.path.dirname(__file__))
import core as C
from port import seg_nats, segments_of

KIT, OUT, CORPUS = sys.argv[1], sys.argv[2], sys.argv[3]
z = np.load(os.path.join(KIT, "run.npz")); k = {n: z[n] for n in z.files}
E, H, L = int(k["embed"]), int(k["hidden"]), int(k["layers"])
steps, B, T, P = int(k["steps"]), int(k["batch"]), int(k["seq_len"]), int(k["perturbations"])
eps, lr, wu, wd, W, seed = float(k["eps"]), float(k["lr"]), int(k["warmup"]), float(k["weight_decay"]), int(k["normalize_window"]), int(k["seed"])
stream = int(k["expert"])

man = json.load(open(os.path.join(CORPUS, "MANIFEST.json")))
docs = {"train": [], "heldout": []}; shas = {"train": [], "heldout": []}
for ent in man:
    raw = gzip.open(os.path.join(CORPUS, ent["file"])).read()
    assert len(raw) == ent["bytes"], ent["file"]
    h = hashlib.sha256(raw).hexdigest(); assert h == ent["sha256_uncompressed"], ent["file"]
    docs[ent["split"]].append(np.frombuffer(raw, np.uint8)); shas[ent["split"]].append(h)
assert list(k["sha256"]) == shas["train"] + shas["heldout"], "sha256 order differs from kit"
train = [d[:len(d) - min(65536, len(d) // 8)] for d in docs["train"]]
offs = np.concatenate([[0], np.cumsum([len(d) for d in train])])
win = C.Windows(np.concatenate(train), offs, T)

# check the generator against the published indices
mism = 0
for t in range(steps):
    dd, ss = win.locate(win.draws(seed, stream, t, B))
    mism += int((dd != k["batch_doc"][t]).any() or (ss != k["batch_start"][t]).any())
print("batch index mismatches vs kit:", mism, flush=True)

theta = C.init(E, H, L, seed, 0); d = theta.size
nstate = [0, 0.0]
losses = []
# guard (stage 8), tracked only: the reference run took no restart
window = max(20, min(200, steps // 8)); n = 0; run_sk = 0; smoothed = None; best = np.inf; above = 0
t0 = time.time()
for t in range(steps):
    b = win.gather(k["batch_doc"][t], k["batch_start"][t])
    r = C.lr_at(t, lr, steps, wu)
    deltas = [C.noise("rademacher", seed, stream, t, m, d) for m in range(P)]
    e32 = np.float32(eps)
    pm = np.concatenate([np.stack([theta + e32 * x for x in deltas]), np.stack([theta - e32 * x for x in deltas])])
    _, ls = C.batch_loss(pm, E, H, L, b, dtype=np.float32)
    lp, lm = ls[:P], ls[P:]
    g = (lp - lm) / (2 * eps)
    loss_t = float(np.mean((lp + lm) / 2)); losses.append(loss_t)
    n += 1
    if not np.all(np.isfinite(g)) or not np.isfinite(loss_t):
        run_sk += 1
        if run_sk >= 20: print("VERDICT non-finite at", n)
        continue
    run_sk = 0
    smoothed = loss_t if smoothed is None else 0.98 * smoothed + 0.02 * loss_t
    best = min(best, smoothed)
    if n > 50:
        above = above + 1 if smoothed > 1.25 * best else 0
        if above >= window: print("VERDICT rising at", n)
    g, nstate = C.normalize_piece(g, nstate, W)
    theta = C.sgd_update(theta, g, deltas, r, wd)
    if t % 25 == 0:
        print(t, f"loss {loss_t:.5f} kit {k['losses'][t]:.5f} diff {loss_t - k['losses'][t]:+.2e}  {time.time() - t0:.0f}s", flush=True)
losses = np.array(losses)
print("max |loss diff|", np.abs(losses - k["losses"]).max(), flush=True)
np.save(os.path.join(OUT, "run_theta.npy"), theta)

tot, cnt = 0.0, 0
for doc in docs["heldout"]:
    segs = segments_of(len(doc))
    nats = seg_nats(theta, E, H, L, doc, segs, dtype=np.float32, chunk=128)
    tot += sum(float(x.astype(np.float64).sum()) for x in nats); cnt += sum(len(x) for x in nats)
    assert sum(len(x) for x in nats) == len(doc) - 1
heldout = tot / cnt
print("heldout", heldout, "kit", float(k["heldout"]), "diff", heldout - float(k["heldout"]), f"{time.time() - t0:.0f}s", flush=True)
np.savez(os.path.join(OUT, "run.npz"), losses=losses, heldout=np.float64(heldout))
