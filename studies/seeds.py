"""A `zosoma train` command at many seeds, in variants: which seeds diverge, what each ends at.

    python studies/seeds.py --out results/defaults-single --seeds 0-9 --jobs 2 \\
        --variant "plain SPSA=" --variant "normalize=--shaping normalize" -- --steps 4000

Each run is `zosoma train ARGS VARIANT --seed S --run-dir OUT/runs/<variant>-seed<S>` (ARGS after
`--`); a finished run (results.json) is read back, an unfinished one continues with `--resume`, so
the same command resumes a study that was stopped. Runs go `--jobs` at a time, each with the
machine's cores shared out as BLAS threads (with --jobs 1 a run is exactly the command a user
types). Writes OUT/results.md (one row per variant: every seed's held-out nats/byte, which seeds
diverged or restarted, mean and sd over the seeds that trained) and OUT/log.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared_data import use_shared_wikitext

ZOSOMA = [str(Path(sys.executable).parent / "zosoma")]


def seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run(out: Path, name: str, args: list[str], seed: int, threads: int, log) -> dict:
    folder = out / "runs" / f"{slug(name)}-seed{seed}"
    results = folder / "results.json"
    if not results.exists():
        cmd = (["train", "--resume", str(folder)] if (folder / "checkpoint.h5").exists() or (folder / "soma.json").exists()
               else ["train", *args, "--seed", str(seed), "--run-dir", str(folder)])
        env = dict(os.environ, **{k: str(threads) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                                "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")})
        t0 = time.time()
        done = subprocess.run(ZOSOMA + cmd, capture_output=True, text=True, env=env)
        last = (done.stderr.strip().splitlines() or [""])[-1]
        log(f"{name} seed {seed}: rc {done.returncode} in {time.time() - t0:.0f} s: zosoma {shlex.join(cmd)}"
            + (f"\n    {last}" if done.returncode else ""))
        if done.returncode and not results.exists():
            return stopped_early(folder, seed, last)
    r = json.loads(results.read_text())
    held = r["heldout"]["overall"]
    training = r.get("training") or [r]  # SOMA: one summary per expert
    return {"seed": seed, "heldout": held["routed"] if isinstance(held, dict) else held,
            "wikitext": (r["wikitext103"]["routed"] if isinstance(r["wikitext103"], dict) else r["wikitext103"]),
            "diverged": [i for i, t in enumerate(training) if t.get("divergence")],
            "restarts": sum(len(t.get("restarts") or ()) for t in training),
            "dropped": [i for i, t in enumerate(training) if t.get("dropped")], "wall_s": r["wall_s"]}


def stopped_early(folder: Path, seed: int, line: str) -> dict:
    """A run that ended without an evaluation: its guard stopped it (diverged), or it failed."""
    from zosoma.training.folder import RunFolder
    run = RunFolder(folder)
    try:
        ckpts = ([run.expert(i).read_checkpoint() for i in range(run.read_soma()["experts"])] if run.is_soma
                 else [run.read_checkpoint()])
    except Exception:
        return {"seed": seed, "error": line}
    diverged = [i for i, c in enumerate(ckpts) if c.extra.get("divergence")]
    if not diverged:
        return {"seed": seed, "error": line}
    return {"seed": seed, "stopped": min(ckpts[i].extra["divergence"]["step"] for i in diverged),
            "diverged": diverged, "restarts": sum(len(c.extra.get("restarts") or ()) for c in ckpts), "dropped": []}


def table(rows: dict[str, list[dict]], seeds_: list[int]) -> str:
    head = ["variant"] + [f"seed {s}" for s in seeds_] + ["trained", "mean", "sd", "WikiText-103 mean", "restarts"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, runs in rows.items():
        cells, good, wiki = [], [], []
        for r in runs:
            if "error" in r:
                cells.append("failed")
                continue
            if "stopped" in r:
                cells.append(f"diverged at step {r['stopped']}" + (f" (expert {r['diverged']})" if r["diverged"] != [0] else ""))
                continue
            mark = " (diverged)" if r["diverged"] and not r["dropped"] else ""
            mark += f" (dropped {r['dropped']})" if r["dropped"] else ""
            mark += f" [{r['restarts']} restart(s)]" if r["restarts"] else ""
            cells.append(f"{r['heldout']:.3f}{mark}")
            if not r["diverged"] or r["dropped"]:  # a SOMA run that dropped an expert still trained
                good.append(r["heldout"])
                if r["wikitext"] is not None:
                    wiki.append(r["wikitext"])
        mean = f"{statistics.mean(good):.3f}" if good else "n/a"
        sd = f"{statistics.stdev(good):.3f}" if len(good) > 1 else "n/a"
        w = f"{statistics.mean(wiki):.3f}" if wiki else "n/a"
        lines.append("| " + " | ".join([name] + cells + [f"{len(good)}/{len(runs)}", mean, sd, w,
                                                           str(sum(r.get("restarts", 0) for r in runs))]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    argv = sys.argv[1:]
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--variant", action="append", required=True, help='"NAME=train options"')
    a = p.parse_args(argv)
    use_shared_wikitext()
    variants = [(v.partition("=")[0], shlex.split(v.partition("=")[2])) for v in a.variant]
    seed_list = seeds(a.seeds)
    a.out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // a.jobs)

    def log(line):
        print(line, flush=True)
        with open(a.out / "log.txt", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    log(f"seeds study: {len(variants)} variants x seeds {a.seeds}, --jobs {a.jobs}, common args: {shlex.join(common)}")
    todo = [(name, common + extra, s) for name, extra in variants for s in seed_list]
    with ThreadPoolExecutor(a.jobs) as pool:
        found = list(pool.map(lambda job: run(a.out, *job, threads, log), todo))
    rows = {name: [r for (n, _, _), r in zip(todo, found) if n == name] for name, _ in variants}
    header = (f"# `zosoma train` at seeds {a.seeds}\n\nCommon options: `{shlex.join(common) or '(none)'}`; "
              f"held-out nats/byte (routed, for SOMA) per seed; mean and sd over the seeds that trained (a SOMA "
              "run that dropped an expert trained; a diverged one did not).\n\n")
    body = "\n".join(f"- **{name}**: `{shlex.join(extra) or '(no extra options)'}`" for name, extra in variants)
    (a.out / "results.md").write_text(header + body + "\n\n" + table(rows, seed_list))
    log(f"wrote {a.out / 'results.md'}")


if __name__ == "__main__":
    main()
