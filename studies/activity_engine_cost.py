"""Process CPU-seconds of one training step of `--optimizer activity-onesided` against
`--optimizer onesided` on every forward engine (the CPU's fp32, the emulated bf16, fp16 and int8,
ONNX Runtime), at the tiny preset's shape (E=32 H=64 L=1, P=32, B=8, T=32): the members' losses
(strategy.losses, the noise draw included) and the update (strategy.update), each the median of 6
steps after 2 of warm-up, on one thread (set OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1).

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python studies/activity_engine_cost.py
"""

import time

import numpy as np

from zosoma.config import ModelConfig, TrainConfig
from zosoma.engines import get_ops
from zosoma.model.params import Layout, init_params
from zosoma.strategies import make_strategy

ENGINES = ("fp32", "bf16", "fp16", "int8", "onnxruntime")


def step_seconds(ops, optimizer: str, layout: Layout, theta, batch) -> tuple[float, float]:
    """(losses, update) median process seconds of one step."""
    strategy = make_strategy(TrainConfig(optimizer=optimizer, perturbations=32, batch=8, seq_len=32, shaping=(),
                                         warmup=0))
    times = []
    for step in range(8):
        pop = strategy.ask(0, step)
        t0 = time.process_time()
        coeffs, _ = strategy.coefficients(*strategy.losses(ops, theta, layout, batch, pop, {}))
        t1 = time.process_time()
        strategy.update(ops, layout, theta, {}, coeffs, pop, 1e-3)
        times.append((t1 - t0, time.process_time() - t1))
    losses, update = np.median(np.array(times[2:]), axis=0)
    return float(losses), float(update)


def main() -> None:
    layout = Layout(ModelConfig(embed=32, hidden=64, layers=1))
    theta = init_params(layout.config, 0)
    batch = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.uint8)
    print("engine       optimizer          losses ms  update ms  step ms (process CPU)")
    for engine in ENGINES:
        ops = get_ops("cpu", "onnxruntime") if engine == "onnxruntime" else get_ops("cpu", "native", engine)
        for optimizer in ("onesided", "activity-onesided"):
            losses, update = step_seconds(ops, optimizer, layout, theta, batch)
            ms = (1e3 * losses, 1e3 * update, 1e3 * (losses + update))
            print(f"{engine:12s} {optimizer:18s} {ms[0]:9.1f} {ms[1]:10.1f} {ms[2]:8.1f}", flush=True)


if __name__ == "__main__":
    main()
