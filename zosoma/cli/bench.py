"""zosoma bench: the benchmarks that print throughput figures."""

from __future__ import annotations

import click

from zosoma.cli.options import device_ops, device_option, emit_json, gemm_option, json_option, positive
from zosoma.config import ENGINES, PRECISIONS


@click.group()
def bench():
    """Benchmarks that print throughput figures (not tests)."""


def show(kind: str, result, text) -> None:
    """A benchmark's result as text, or with --json as one object (docs/json.md)."""
    if click.get_current_context().params.get("as_json"):
        emit_json(f"bench-{kind}", {"results": result})
    else:
        click.echo(text(result))


def shape_options(embed: int, hidden: int, layers: int, batch: int, seq_len: int):
    """--embed, --hidden, --layers, --batch and --seq-len, with these defaults."""
    def decorate(f):
        for name, default in reversed([("embed", embed), ("hidden", hidden), ("layers", layers), ("batch", batch),
                                       ("seq-len", seq_len)]):
            f = click.option(f"--{name}", type=int, default=default, show_default=True, callback=positive)(f)
        return f
    return decorate


@bench.command("forward")
@shape_options(embed=512, hidden=512, layers=2, batch=64, seq_len=256)
@click.option("--repeats", type=int, default=5, show_default=True, callback=positive)
@click.option("--no-numpy", is_flag=True, help="Skip the slow NumPy reference.")
@click.option("--engine", type=click.Choice(ENGINES), default="native", show_default=True, help="onnxruntime: also time ONNX Runtime's forward (zosoma's training graph) beside Numba's.")
@click.option("--forward-precision", "precisions", multiple=True, type=click.Choice([p for p in PRECISIONS if p != "fp32"]), help="Also time the forward emulated in this format (repeat the option for several).")
@device_option
@gemm_option
@json_option
def bench_forward_cmd(embed, hidden, layers, batch, seq_len, repeats, no_numpy, engine, precisions, device, gemm,
                      as_json):
    """Tokens/s of the NumPy reference, the Numba path and torch nn.LSTM (if installed) at one
    configuration, and the fraction of the matmul peak measured in the same run. With --device
    cuda: the CuPy forward and torch's cuDNN nn.LSTM on the GPU, beside the GPU's fp32 peak."""
    from zosoma.benchmarks.bench_forward import bench_forward, format_records
    from zosoma.engines import get_ops
    others = (get_ops("cpu", engine),) if engine != "native" else ()
    others += tuple(get_ops("cpu", precision=p) for p in dict.fromkeys(precisions))
    records = bench_forward(embed=embed, hidden=hidden, layers=layers, batch=batch, seq_len=seq_len,
                            repeats=repeats, include_numpy=not no_numpy, ops=device_ops(device, gemm), others=others)
    show("forward", records, format_records)


def parse_shapes(ctx, param, value):
    """--shapes "16x20,8x12" -> [(16, 20), (8, 12)]: E x H of each model."""
    if value is None:
        return None
    shapes = []
    for item in value.split(","):
        e, x, h = item.strip().partition("x")
        if not (x and e.isdigit() and h.isdigit() and int(e) > 0 and int(h) > 0):
            raise click.BadParameter(f"expected ExH pairs such as 16x20,8x12, got {item.strip()!r}")
        shapes.append((int(e), int(h)))
    return shapes


@bench.command("spsa")
@click.option("--preset", type=click.Choice(["tiny", "small", "paper"]), default="paper", show_default=True)
@click.option("--embed", type=int, callback=positive, help="E. Default: the preset's (tiny 32; small 128; paper 508).")
@click.option("--hidden", type=int, callback=positive, help="H. Default: the preset's (tiny 64; small 256; paper 496).")
@click.option("--layers", type=int, callback=positive, help="L. Default: the preset's (tiny 1; small, paper 2).")
@click.option("--shapes", callback=parse_shapes, metavar="ExH,...", help="Several models, one after another, e.g. 16x20,8x12,32x64,20x40 (L: --layers or the preset's), and a table of them last.")
@click.option("--perturbations", "-P", type=int, callback=positive, help="Default: the preset's (tiny, small 32; paper 64).")
@click.option("--batch", type=int, callback=positive, help="Default: the preset's (8).")
@click.option("--seq-len", type=int, callback=positive, help="Default: the preset's (tiny 32; small, paper 128).")
@click.option("--steps", type=int, default=2, show_default=True, callback=positive, help="Timed steps (after one warm-up step).")
@click.option("--noise", type=click.Choice(["rademacher", "gaussian"]), default="rademacher", show_default=True)
@click.option("--peers/--no-peers", default=True, show_default=True, help="Time the PyTorch peers (when torch is installed).")
@click.option("--forward-precision", "precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True, help="Time the step with its forwards emulated in this format (CPU), beside the fp32 step in the same run.")
@click.option("--launches", is_flag=True, help="Instead of timing the step: kernel launches per SPSA step of N = 1, 16 and 64 experts on each CUDA path (today's per-timestep kernels, the fused kernel), at SOMA's expert E=16 H=20 L=1, P=64, B=8, T=32 unless given; counted (and timed) on the GPU with --device cuda, else recorded without running anything.")
@device_option
@gemm_option
@json_option
def bench_spsa_cmd(preset, embed, hidden, layers, shapes, perturbations, batch, seq_len, steps, noise, peers, precision,
                   launches, device, gemm, as_json):
    """SPSA step throughput split into data, forward passes, noise and the update, beside the same
    step written in PyTorch (a MeZO-style loop, a stacked population with bmm) and the fp32
    matmul peak, all in one run: tokens/s, nominal and executed GFLOP/s, share of the peak; on
    the CPU in fp32, the step's roofline: FLOPs and exps per token against one core's GEMM peak
    and exp cost measured in the same run, and what bounds the step. With --shapes, --json's
    results are a list, one object per shape."""
    from zosoma.benchmarks.roofline import format_shapes
    if shapes and (embed or hidden):
        raise click.UsageError("--shapes sets E and H: give it without --embed and --hidden")
    if launches and (shapes or precision != "fp32"):
        raise click.UsageError("--launches counts one model's fp32 step: give it without --shapes and --forward-precision")
    ops = device_ops(device, gemm)
    if launches:
        _bench_launches(embed, hidden, layers, perturbations, batch, seq_len, steps, ops)
        return
    run = dict(preset=preset, perturbations=perturbations, batch=batch, seq_len=seq_len, steps=steps, noise=noise,
               layers=layers, ops=ops, peers=peers, precision=precision, device=device)
    if shapes is None:
        show("spsa", _bench_spsa_shape(embed=embed, hidden=hidden, **run), _format_spsa_shape)
        return
    results = []
    for e, h in shapes:
        results.append(_bench_spsa_shape(embed=e, hidden=h, **run))
        if not as_json:
            click.echo(_format_spsa_shape(results[-1]) + "\n")
    show("spsa", results, format_shapes)


def _bench_launches(embed, hidden, layers, P, B, T, steps, ops) -> None:
    """--launches: bench_launches on the device (timed) or on the recording runtime."""
    from zosoma.benchmarks.bench_launches import SOMA_EXPERT, SOMA_STEP, count_launches, format_launches
    from zosoma.config import ModelConfig
    model = ModelConfig(embed=embed or SOMA_EXPERT.embed, hidden=hidden or SOMA_EXPERT.hidden,
                        layers=layers or SOMA_EXPERT.layers)
    on_device = ops.on_device
    if on_device:
        from zosoma.engines.cuda import custom_kernels
    rows = count_launches(model, P or SOMA_STEP["P"], B or SOMA_STEP["B"], T or SOMA_STEP["T"],
                          rt=custom_kernels.runtime() if on_device else None, timed_steps=steps if on_device else 0)
    show("spsa-launches", rows, lambda r: format_launches(r, f"E={model.embed} H={model.hidden} L={model.layers}, " + (
        "counted and timed on the GPU" if on_device else "recorded on the CPU: launches counted, none run")))


def _bench_spsa_shape(precision: str, device: str, ops, peers: bool, **shape) -> dict:
    """bench_spsa at one shape; with an emulated precision, that step beside the fp32 one."""
    from zosoma.engines import get_ops
    from zosoma.benchmarks.bench_spsa import bench_spsa
    if precision == "fp32":
        return bench_spsa(**shape, ops=ops, peers=peers)
    emulated_ops = get_ops(device, precision=precision)  # before any timing: a GPU device is a one-line error
    fp32 = bench_spsa(**shape, ops=ops, peers=False)
    return {**bench_spsa(**shape, ops=emulated_ops, peers=peers), "fp32_step_s": fp32["step_s"], "precision": precision}


def _format_spsa_shape(r: dict) -> str:
    from zosoma.benchmarks.bench_spsa import format_spsa
    text = format_spsa(r)
    if "fp32_step_s" in r:
        text += (f"\n{r['precision']} step {r['step_s']:.4f} s, the fp32 step {r['fp32_step_s']:.4f} s in the same run: "
                 f"{r['step_s'] / r['fp32_step_s']:.2f}x")
    return text


@bench.command("route")
@click.option("--small", "n_small", type=int, default=256, show_default=True, callback=positive, help="Experts in the many-small configuration.")
@click.option("--large", "n_large", type=int, default=8, show_default=True, callback=positive, help="Experts in the few-large configuration.")
@click.option("--top-k", type=int, default=4, show_default=True, callback=positive)
@click.option("--total-params", type=int, default=2_000_000, show_default=True, callback=positive, help="Total parameters of each ensemble.")
@click.option("--segments", type=int, default=1024, show_default=True, callback=positive, help="Held-out segments routed per run.")
@click.option("--repeats", type=int, default=3, show_default=True, callback=positive)
@device_option
@gemm_option
@json_option
def bench_route_cmd(n_small, n_large, top_k, total_params, segments, repeats, device, gemm, as_json):
    """Tokens/s of top-k routed inference (routing included) for N=8 vs N=256 experts of similar
    total size, random weights (the paper: 257k vs 2.36M tokens/s, 9.19x). With --device cuda the
    experts also run on the GPU, beside the CPU in the same run."""
    from zosoma.benchmarks.bench_route import bench_route, format_route
    devices = tuple(dict.fromkeys(("cpu", device_ops(device, gemm).name)))  # the CPU, and the GPU when asked for
    show("route", bench_route(n_small=n_small, n_large=n_large, top_k=top_k, total_params=total_params,
                              n_segments=segments, repeats=repeats, devices=devices, gemm=gemm), format_route)


@bench.command("eggroll")
@shape_options(embed=52, hidden=100, layers=1, batch=8, seq_len=32)
@click.option("--pairs", type=int, default=64, show_default=True, callback=positive, help="Antithetic pairs: 2x members.")
@click.option("--rank", type=int, default=1, show_default=True, callback=positive)
@click.option("--repeats", type=int, default=3, show_default=True, callback=positive)
@device_option
@json_option
def bench_eggroll_cmd(embed, hidden, layers, batch, seq_len, pairs, rank, repeats, device, as_json):
    """Forward seconds per population member: EGGROLL's shared-GEMM low-rank population vs
    full-rank SPSA's dense perturbed copies, same model and batch (defaults: the CPU comparison's
    monolithic model)."""
    from zosoma.benchmarks.bench_eggroll import bench_eggroll, format_eggroll
    show("eggroll", [bench_eggroll(embed=embed, hidden=hidden, layers=layers, batch=batch, seq_len=seq_len,
                                   pairs=pairs, rank=rank, repeats=repeats, ops=device_ops(device))], format_eggroll)

@bench.command("comm")
@click.option("--workers", "-W", type=int, default=8, show_default=True, callback=positive, help="W: workers sharing one model (at most P).")
@json_option
def bench_comm_cmd(workers, as_json):
    """Bytes exchanged per training step for each preset: SOMA's experts (none while training),
    one model's population sharded over W workers (the step's scalars) and data-parallel backprop's
    gradient all-reduce (about 2 x 4d per worker), side by side."""
    from zosoma.benchmarks.bench_comm import bench_comm, format_comm
    show("comm", bench_comm(workers), format_comm)


@bench.command("executors")
@click.option("--preset", type=click.Choice(["tiny", "small", "paper"]), default="tiny", show_default=True)
@click.option("--experts", type=int, default=2, show_default=True, callback=positive, help="SOMA's N.")
@click.option("--steps", type=int, default=200, show_default=True, callback=positive)
@click.option("--embed", type=int, callback=positive, help="E over the preset's.")
@click.option("--hidden", type=int, callback=positive, help="H over the preset's.")
@click.option("--no-ray", is_flag=True, help="Leave Ray out.")
@click.option("--no-population", is_flag=True, help="Leave out one model's population over workers (SOMA's rows only).")
@click.option("--address", help="A Ray cluster to join (default: start Ray on this machine).")
@json_option
def bench_executors_cmd(preset, experts, steps, embed, hidden, no_ray, no_population, address, as_json):
    """Training time by where it runs: SOMA's experts inline, in local processes, together in this
    process and as Ray tasks; one model's population here and over W = 1 and 2 workers (local
    processes, Ray actors). Wall and CPU seconds."""
    from zosoma.benchmarks.bench_executors import bench_executors, format_executors
    model = {k: v for k, v in (("embed", embed), ("hidden", hidden)) if v is not None}
    show("executors", bench_executors(preset, experts, steps, not no_ray, address, model=model,
                                      population=not no_population), format_executors)
