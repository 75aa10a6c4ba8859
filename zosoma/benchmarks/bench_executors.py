"""Where training runs, timed (`zosoma bench executors`): SOMA's N experts inline, in local worker
processes, together in this process (each step of all of them in one population: zosoma.training.together)
and as Ray tasks; one model's population in this process and on W = 1 and W = 2 workers (local
processes and Ray actors).

Every variant trains the same steps from copies of one step-0 run folder (the shipped corpus, the
preset's model), so all give the same parameters (checked: each run's final theta is compared with
the inline one's) and only the time differs. Times are wall seconds of training alone: clustering,
evaluation and connecting to Ray (reported on its own line) are left out; starting the workers
(processes, Ray tasks and actors) is in.

    cpu s           CPU seconds of this process and the worker processes it waited for (a
                    machine shared with other work times wall seconds unreliably; these less so)
    start           seconds until the first step's record reached the driver (workers starting)
    ms/step         (last record's time - first record's time) / (steps - 1): the steady step
    ms/expert-step  ms/step / N for SOMA, whose N experts each take a step in that time
    vs inline       the inline (or this-process) ms/step over this one's: above 1 is faster
The Ray line also gives its overhead per expert-step against the local processes.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from zosoma.corpus import BatchSampler
from zosoma.errors import ConfigError
from zosoma.workers.executor import Inline, LocalProcesses, Together
from zosoma.workers.placement import Placement
from zosoma.training.folder import RunFolder
from zosoma.workers.population_workers import Processes, Sharding, make_trainer
from zosoma.training.records import Failed, Step
from zosoma.runs.run import engine
from zosoma.runs.single import data_record, load_data
from zosoma.runs.soma import ExpertUnit, create_soma, open_soma
from zosoma.training.trainer import new_state, train
from zosoma.strategies import make_strategy
from zosoma.strategies.settings import resolve
from zosoma.model.params import Layout, init_params


def _timed(records) -> dict:
    """Drain records; wall seconds, seconds to the first Step, steady seconds per step, and the
    steps' mean split (seconds of forward incl. noise, update, exchange) after the first step."""
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    arrivals: dict[int, list[float]] = {}
    split = {"forward": [], "update": [], "exchange": []}
    for r in records:
        if isinstance(r, Failed):
            raise ConfigError(f"unit {r.unit} failed: {r.error}")
        if isinstance(r, Step):
            arrivals.setdefault(r.expert, []).append(time.perf_counter() - t0)
            if r.step > 1:  # the first waits for workers to start
                m = r.metrics
                split["forward"].append(m.get("forward_s", 0.0) + m.get("noise_s", 0.0))
                split["update"].append(m.get("update_s", 0.0))
                split["exchange"].append(m.get("exchange_s", 0.0))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    first = min(a[0] for a in arrivals.values())
    last = max(a[-1] for a in arrivals.values())
    steps = max(len(a) for a in arrivals.values())
    return {"wall_s": wall, "cpu_s": cpu, "start_s": first, "step_s": (last - first) / max(1, steps - 1),
            **{f"{k}_s": float(np.mean(v)) if v else 0.0 for k, v in split.items()}}


def _cpu_seconds() -> float:
    """User and system seconds of this process and of its children that ended (waited for)."""
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))


def bench_executors(preset: str = "tiny", experts: int = 2, steps: int = 200, ray: bool = True,
                    address: str | None = None, seed: int = 0, model: dict | None = None,
                    population: bool = True) -> dict:
    """{"soma": rows, "population": rows, "ray_connect_s": seconds or None, "config": ...}; each row
    {"name", "wall_s", "cpu_s", "start_s", "step_s", "same": final theta equal to the inline
    run's}. `model`: ModelConfig fields over the preset's (embed=16, hidden=20); population=False
    leaves the one-model rows out."""
    model, cfg = resolve(preset, {"steps": steps, "checkpoint_every": steps, "seed": seed, **(model or {})})
    ops = engine(Placement(), cfg)  # the run's engine, as `zosoma train` resolves it: every row on the CPU
    out: dict = {"config": {"preset": preset, "experts": experts, "steps": steps, "P": cfg.perturbations,
                            "B": cfg.batch, "T": cfg.seq_len, "d": model.n_params(), "E": model.embed,
                            "H": model.hidden, "L": model.layers, "optimizer": cfg.optimizer},
                 "ray_connect_s": None, "population": []}
    ray_executor = None
    if ray:
        from zosoma.workers.ray_executor import RayExecutor, RayWorkers
        t0 = time.perf_counter()
        ray_executor = RayExecutor(address, cpus=1)
        out["ray_connect_s"] = time.perf_counter() - t0
    _warm_up(model, cfg, ops)
    with tempfile.TemporaryDirectory(prefix="zosoma-bench-") as tmp:
        tmp = Path(tmp)
        create_soma(tmp / "soma", model, cfg, experts)
        run = open_soma(tmp / "soma")
        workers = min(experts, os.cpu_count() or 1)  # as `zosoma train` places them by default
        executors = [("inline", Inline()), (f"local processes ({workers})", LocalProcesses(workers)),
                     ("together (this process)", Together())]
        if ray_executor is not None:
            executors.append((f"Ray tasks ({experts} x 1 CPU)", ray_executor))
        out["soma"] = []
        for i, (name, executor) in enumerate(executors):
            folder = tmp / f"soma{i}"
            shutil.copytree(tmp / "soma", folder)
            units = [ExpertUnit(str(folder), run.soma, run.corpora[e], e, ops) for e in range(experts)]
            row = {"name": name, **_timed(executor.run(units))}
            thetas = [RunFolder(folder).expert(e).read_checkpoint().theta for e in range(experts)]
            row["same"] = i == 0 or all(np.array_equal(a, b) for a, b in zip(thetas, out["soma"][0]["thetas"]))
            row["thetas"] = thetas
            out["soma"].append(row)
        if not population:
            return out
        corpus, _ = load_data(None, None)
        sampler = BatchSampler(corpus, cfg.seq_len + 1)
        data = data_record(corpus)
        shardings = [("this process", None), ("local processes, W=1", Sharding(Processes(1), 1)),
                     ("local processes, W=2", Sharding(Processes(1), 2))]
        if ray_executor is not None:
            shardings.append(("Ray actors, W=2", Sharding(RayWorkers(ray_executor), 2)))
        out["population"] = []
        for i, (name, sharding) in enumerate(shardings):
            trainer = make_trainer(tmp / f"single{i}", model, cfg, sampler, new_state(model, cfg), ops,
                                   {"data": data}, sharding=sharding)
            trainer.checkpoint()
            row = {"name": name, **_timed(train(trainer))}
            theta = trainer.theta
            row["same"] = i == 0 or np.array_equal(theta, out["population"][0]["theta"])
            row["theta"] = theta
            row["comm_bytes"] = trainer.comm_bytes
            out["population"].append(row)
    return out


def _warm_up(model, cfg, ops) -> None:
    """One step's forwards and update in this process, so that the first row timed does not pay
    for loading the compiled kernels (a worker process pays it again: its start)."""
    strategy, layout = make_strategy(cfg), Layout(model)
    theta = init_params(model, cfg.seed, 0)
    state, pop = strategy.init(ops, theta.size), strategy.ask(0, 0)
    plus, minus = strategy.losses(ops, theta, layout, np.zeros((cfg.batch, cfg.seq_len + 1), np.uint8), pop, state)
    strategy.apply(ops, layout, theta, state, strategy.coefficients(plus, minus)[0], pop)


def format_executors(out: dict) -> str:
    c = out["config"]
    lines = [f"{c['preset']} preset, E={c['E']} H={c['H']} L={c['L']} (d={c['d']:,}), --optimizer {c['optimizer']} "
             f"P={c['P']}, B={c['B']}, T={c['T']}, {c['steps']} steps; seconds of training only"]
    if out["ray_connect_s"] is not None:
        lines.append(f"connecting to Ray (not counted below): {out['ray_connect_s']:.1f} s")
    inline = out["soma"][0]
    lines += ["", f"SOMA, N={c['experts']} experts (expert-steps per step: {c['experts']})",
              f"  {'executor':<30}{'wall s':>8}{'cpu s':>8}{'start s':>9}{'ms/step':>9}{'ms/expert-step':>16}"
              f"{'vs inline':>11}{'same theta':>12}"]
    for r in out["soma"]:
        per = 1e3 * r["step_s"] / c["experts"]
        lines.append(f"  {r['name']:<30}{r['wall_s']:>8.1f}{r['cpu_s']:>8.1f}{r['start_s']:>9.2f}{1e3 * r['step_s']:>9.1f}"
                     f"{per:>16.2f}"
                     f"{inline['step_s'] / r['step_s']:>10.2f}x{str(r['same']):>12}")
    ray_row = next((r for r in out["soma"] if r["name"].startswith("Ray")), None)
    if ray_row is not None:
        local = out["soma"][1]
        extra_ms = 1e3 * (ray_row["step_s"] - local["step_s"]) / c["experts"]
        lines.append(f"  Ray against local processes: {extra_ms:+.2f} ms per expert-step, "
                     f"{ray_row['start_s'] - local['start_s']:+.2f} s to start")
    if not out["population"]:
        return "\n".join(lines)
    base = out["population"][0]
    lines += ["", f"one model, P={c['P']} pairs over W workers",
              f"  {'where':<22}{'wall s':>7}{'start s':>8}{'ms/step':>8}{'forward':>8}{'update':>7}{'exchange':>9}"
              f"{'bytes/step':>11}{'vs here':>8}{'same theta':>11}"]
    for r in out["population"]:
        lines.append(f"  {r['name']:<22}{r['wall_s']:>7.1f}{r['start_s']:>8.2f}{1e3 * r['step_s']:>8.1f}"
                     f"{1e3 * r['forward_s']:>8.1f}{1e3 * r['update_s']:>7.1f}{1e3 * r['exchange_s']:>9.1f}"
                     f"{r['comm_bytes']:>11,}{base['step_s'] / r['step_s']:>7.2f}x{str(r['same']):>11}")
    lines.append("  forward (noise included), update and exchange: mean ms per step from the steps' records; on "
                 "workers, the slowest worker's forward, its update of the step before, and the rest of the "
                 "round trip")
    return "\n".join(lines)
