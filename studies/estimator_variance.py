"""Each estimator's cosine to the true gradient and relative error at a fixed theta, equal forwards
(zosoma.experiments.estimators; docs/cut-price.md). theta: one E=16 H=20 expert trained for
--train-steps steps of one-sided SPSA (seed 0, the cut-price study's shape: P=64, B=8, T=32, rate
0.599) on the shipped corpus; the batch: the shipped corpus's step-0 batch of stream 99 (not one
it trained on). Every registered strategy but momentum and adam (update rules over SPSA's
estimate, the same estimate at a fresh state) runs at P=64 and eps 1e-3 (ES: its own sigma).

    python studies/estimator_variance.py [--draws 300] [--train-steps 600] [--out results/cut-price-2/variance.txt]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from zosoma import load_corpus, train
from zosoma.config import ModelConfig
from zosoma.corpus import BatchSampler
from zosoma.engines.ops import Ops
from zosoma.errors import ConfigError
from zosoma.experiments import estimators
from zosoma.model.params import Layout
from zosoma.strategies import STRATEGIES

MODEL = ModelConfig(embed=16, hidden=20, layers=1)
SKIP = {"momentum", "adam"}
OWN = {"es": {"eps": 0.02}}  # ES's sigma (its default), not SPSA's eps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("-P", type=int, default=64)
    ap.add_argument("--out", default="results/cut-price-2/variance.txt")
    args = ap.parse_args()
    layout = Layout(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        run = train(preset="tiny", run_dir=Path(tmp) / "theta", optimizer="onesided", embed=16, hidden=20, layers=1,
                    perturbations=64, lr=0.599, steps=args.train_steps, seed=0)
        theta = run.handle.folder.read_checkpoint().theta
        heldout = run.results["heldout"]["overall"]
    batch = BatchSampler(load_corpus(), 33).batch(0, 99, 0, 8)
    g = estimators.true_gradient(theta, layout, batch)
    gain = estimators.row_gain(estimators.row_gradients(theta, layout, batch))
    records, ops = [], Ops()
    for name in STRATEGIES:
        if name in SKIP:
            continue
        t0 = time.process_time()
        try:
            ghat = estimators.estimates(name, theta, layout, batch, args.draws, ops, perturbations=args.P,
                                        **OWN.get(name, {}))
        except ConfigError as e:
            print(f"{name}: skipped ({e})")
            continue
        rec = dict(name=name, P=args.P, **estimators.measure(ghat, g), blocks=estimators.block_cosines(ghat, g, layout),
                   cpu_s_per_draw=(time.process_time() - t0) / args.draws)
        records.append(rec)
        print(estimators.format_table([rec]).splitlines()[1], flush=True)
    table = estimators.format_table(records)
    text = (f"# python studies/estimator_variance.py --draws {args.draws} --train-steps {args.train_steps} -P {args.P}\n"
            f"# theta: E=16 H=20 one-sided SPSA, {args.train_steps} steps, seed 0 (held-out {heldout:.4f}); batch "
            f"B=8 T=32 (stream 99, step 0); |g| = {np.linalg.norm(g):.4g}, d = {theta.size}\n"
            f"# equal forwards: 2P = {2 * args.P} forwards of B T bytes per draw for every estimator\n"
            f"{table}\n\n"
            f"per-row directions' error factor B |g|^2 / mean_b |g_b|^2 = {gain:.3f} (1: no gain, B = 8: the most)\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(dict(records=records, row_gain=gain, heldout=heldout), indent=1))
    print(text)


if __name__ == "__main__":
    main()
