"""Low-precision forwards: the format rounding against independent converters, the compiled
emulation against its NumPy version, and the engine's promise that theta never passes through the
format (zosoma.model.number_formats; zosoma.engines.emulated: precision_reference, precision_kernels,
precision_ops)."""

import numpy as np
import pytest

from helpers import assert_close, cli_json
from zosoma.config import VOCAB, ModelConfig
from zosoma.engines import get_ops
from zosoma.engines.ops import perturbed
from zosoma.engines.emulated import precision_kernels, precision_reference
from zosoma.model import number_formats, reference
from zosoma.model.noise import noise
from zosoma.model.params import Layout, init_params
from zosoma.model.population import Population

FORMATS = ("bf16", "fp16", "int8")


def _model(embed=12, hidden=16, layers=2, scale=3.0):
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, 0) * scale).astype(np.float32), layout


def _bytes(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.uint8)


def _values():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                        [0.0, -0.0, 1e-8, 5.9e-8, 6.1e-5, 6.0e-5, 65504.0, 65519.0, 65520.0, 1e6, -70000.0,
                         1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -9, 1.0 + 2.0 ** -11]])
    return x.astype(np.float32)


def test_bf16_rounding_matches_torch_and_the_kernel():
    torch = pytest.importorskip("torch", reason="the test extra's PyTorch converts to bfloat16")
    x = _values()
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    assert np.array_equal(number_formats.round_to(x, "bf16"), want)
    got = x.copy()
    precision_kernels.round_array(got, precision_kernels.BF16)
    assert np.array_equal(got, want)


def test_bf16_rounding_keeps_every_nan():
    # NaNs whose payload sits in the low 16 bits: rounding's carry would make them inf or +0
    bits = np.array([0x7F800001, 0x7F80FFFF, 0xFFFFFFFF, 0xFF800001, 0x7FC00000, 0x7F800000], np.uint32)
    x = bits.view(np.float32)
    want = np.array([0x7FC00000, 0x7FC00000, 0xFFFF0000, 0xFFC00000, 0x7FC00000, 0x7F800000], np.uint32)
    assert np.array_equal(number_formats.round_to(x, "bf16").view(np.uint32), want)
    got = x.copy()
    precision_kernels.round_array(got, precision_kernels.BF16)
    assert np.array_equal(got.view(np.uint32), want)


def test_fp16_rounding_keeps_every_nan():
    # as bf16's (PORTING.md): quiet, sign kept, payload cut to fp16's; the carry made a low payload inf
    # in the kernel, and NumPy's float16 cast keeps a signalling NaN signalling
    bits = np.array([0x7F800001, 0xFF800FFF, 0xFFA00000, 0x7FC12345, 0x7F800000], np.uint32)
    x = bits.view(np.float32)
    want = np.array([0x7FC00000, 0xFFC00000, 0xFFE00000, 0x7FC12000, 0x7F800000], np.uint32)
    assert np.array_equal(number_formats.round_to(x, "fp16").view(np.uint32), want)
    got = x.copy()
    precision_kernels.round_array(got, precision_kernels.FP16)
    assert np.array_equal(got.view(np.uint32), want)


def test_fp16_rounding_matches_ieee_and_the_kernel():
    x = _values()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)  # IEEE binary16: subnormals, overflow to inf
    assert np.array_equal(number_formats.round_to(x, "fp16"), want)
    got = x.copy()
    precision_kernels.round_array(got, precision_kernels.FP16)
    assert np.array_equal(got, want)
    assert np.isinf(want[-6]) and want[-7] == 65504.0  # 65520 overflows, 65519 does not


def test_int8_tables_and_quantisation():
    q = np.arange(-32768, 32768, 37)
    z = q / number_formats.Q_GATE
    sig = number_formats.table_lookup(q, number_formats.SIGMOID_TABLE) / number_formats.Q_ACT
    tanh = number_formats.table_lookup(q, number_formats.TANH_TABLE) / number_formats.Q_ACT
    assert np.abs(sig - 1 / (1 + np.exp(-z))).max() < 2e-4  # interpolation error of the 1/16 grid
    assert np.abs(tanh - np.tanh(z)).max() < 1e-3
    assert np.all(np.diff(sig) >= 0) and np.all(np.diff(tanh) >= 0)
    w = np.random.default_rng(0).standard_normal((7, 9)).astype(np.float32)
    s = number_formats.int8_scale(w)
    qw = number_formats.quantize_int8(w, s)
    assert qw.min() >= -127 and qw.max() <= 127 and np.abs(qw).max() == 127
    assert np.abs(qw * s - w).max() <= s / 2 + 1e-7


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_activation_tables_are_the_activations_of_every_format_value(fmt):
    """The compiled forward looks the activations up by the input's bit pattern: the tables must
    hold the rounded activation of every value, and a value must find its own pattern."""
    code = precision_kernels.CODES[fmt]
    values = precision_kernels._format_values(code)
    sig, tanh = precision_kernels.activation_tables(code)
    finite = np.isfinite(values)
    x = values[finite].astype(np.float64)
    with np.errstate(over="ignore"):
        assert np.array_equal(sig[finite], number_formats.round_to(1.0 / (1.0 + np.exp(-x)), fmt))
    assert np.array_equal(tanh[finite], number_formats.round_to(np.tanh(x), fmt))
    patterns = [precision_kernels._pattern(v, u, code) for v, u in zip(values, values.view(np.uint32))]
    same = np.array(patterns) == np.arange(65536)
    assert same[~np.isnan(values)].all() and np.isnan(sig[np.array(patterns)[np.isnan(values)]]).all()


def test_members_on_threads_give_each_member_alone():
    theta, layout = _model(8, 8, 1)
    thetas = np.stack([theta * s for s in (1.0, 0.9, 1.1, 0.8)])
    batch = _bytes(6, (4, 3, 10))
    for fmt in FORMATS:
        together = precision_kernels.population_loss(thetas, layout, batch, fmt)
        alone = [precision_kernels.population_loss(t[None], layout, b, fmt)[0] for t, b in zip(thetas, batch)]
        assert np.array_equal(together, alone)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("embed, hidden, layers, B, T", [(12, 16, 2, 3, 9), (8, 8, 1, 2, 17)])
def test_compiled_emulation_matches_numpy(fmt, embed, hidden, layers, B, T):
    theta, layout = _model(embed, hidden, layers)
    batch = _bytes(1, (B, T + 1))
    thetas = np.stack([theta, theta * 0.7])
    got = precision_kernels.population_loss(thetas, layout, batch, fmt)
    want = [precision_reference.loss(t, layout, batch, fmt) for t in thetas]
    # same arithmetic; only the fp32 log-softmax's exp and summation order differ
    assert_close(got, want, rtol=2e-6, name=f"{fmt} loss")


@pytest.mark.parametrize("fmt", FORMATS)
def test_carried_state_and_per_byte_nats(fmt):
    theta, layout = _model()
    data = _bytes(2, (3, 21))
    tokens, targets = data[:, :-1], data[:, 1:]
    logits, _ = precision_reference.forward(theta, layout, tokens, fmt)
    want = precision_reference.nll(logits, targets)
    first, state = precision_kernels.nll_stream(theta, layout, tokens[:, :8], targets[:, :8], fmt)
    rest, _ = precision_kernels.nll_stream(theta, layout, tokens[:, 8:], targets[:, 8:], fmt, state)
    assert_close(np.concatenate([first, rest], axis=1), want, atol=2e-6, rtol=2e-6, name=f"{fmt} nll")


@pytest.mark.parametrize("fmt, bound", [("bf16", 0.05), ("fp16", 0.005), ("int8", 0.1)])
def test_emulation_stays_near_fp32(fmt, bound):
    """Rounding costs something, not everything: each format's loss near the exact one."""
    theta, layout = _model(scale=1.5)
    batch = _bytes(4, (4, 33))
    exact = reference.loss(theta.astype(np.float64), layout, batch)
    got = precision_reference.loss(theta, layout, batch, fmt)
    assert got != exact and abs(got - exact) < bound * exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_members_are_copies_and_theta_never_passes_through_the_format(fmt):
    theta, layout = _model(8, 8, 1)
    before = theta.copy()
    pop = Population(3, 1e-3, 5, 0, 2)
    ops = get_ops("cpu", precision=fmt)
    plus, minus = ops.perturbed_losses(theta, layout, _bytes(5, (2, 9)), pop)
    assert np.array_equal(theta, before)  # bit for bit: nothing applied in place
    members = perturbed(theta, pop, range(3))
    want = precision_kernels.population_loss(members, layout, _bytes(5, (2, 9)), fmt)
    assert np.array_equal(np.stack([plus, minus], 1).ravel(), want)


def test_in_place_perturbation_in_fp16_would_lose_the_weights():
    """The failure the engine avoids: MeZO's perturb, evaluate, restore, done in fp16 storage."""
    theta, _ = _model(8, 8, 1, scale=1.0)
    w = number_formats.round_to(theta, "fp16")
    delta = noise(w.size, 0, 0, 0, 0)
    eps = np.float32(1e-3)
    restored = number_formats.round_to(number_formats.round_to(w + eps * delta, "fp16") - eps * delta, "fp16")
    assert (restored != w).mean() > 0.01


def test_format_step():
    theta = np.array([0.1, -0.1, 0.3, 1e-9], np.float32)
    layout = None  # float formats need no layout
    spacing = number_formats.spacing(theta, layout, "bf16")
    assert spacing[0] == spacing[1] == 2.0 ** (-4 - 7) and spacing[2] == 2.0 ** (-2 - 7)
    assert number_formats.spacing(theta, layout, "fp16")[3] == 2.0 ** (-14 - 10)  # subnormal grid
    t, lay = _model(8, 8, 1, scale=1.0)
    steps = number_formats.spacing(t, lay, "int8")
    assert steps[lay["lstm0.w_hh"].offset] == pytest.approx(np.abs(lay.view(t, "lstm0.w_hh")).max() / 127)
    assert number_formats.format_step(t, lay, "int8") == np.median(steps)


def test_study_plan_and_report(tmp_path):
    """The study's runs (eps in the format's steps, SOMA first) and its report from records."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the plots extra)")
    from zosoma.experiments.precision import Study, jobs, write_report

    todo = jobs(Study(steps=10, formats=("fp32", "int8"), multiples=(1.0, 4.0), soma_multiples=()))
    assert [j.name for j in todo] == ["soma4-fp32-default-eps", "soma4-int8-default-eps",
                                      "single-fp32-default-eps", "single-fp32-eps1step", "single-fp32-eps4step",
                                      "single-int8-default-eps", "single-int8-eps1step", "single-int8-eps4step"]
    int8 = [j for j in todo if j.fmt == "int8" and j.experts == 1]
    assert int8[2].eps == pytest.approx(4 * int8[2].step_size) and int8[0].eps == 1e-3
    assert int8[0].train_config().forward_precision == "int8"
    results = [{**j.__dict__, "name": j.name, "eps_over_step": j.eps / j.step_size,
                "heldout": {"overall": 3.0 + i / 10}, "heldout_fp32_eval": 3.0, "train_loss_last100": 3.1,
                "skipped_steps": 0, "wall_s": 1.0} for i, j in enumerate(todo)]
    results[3]["heldout"]["overall"] = float("inf")  # a diverged run reads n/a
    results[3]["divergence"] = {"step": 420, "verdict": "rising: smoothed loss 9.000"}
    assert todo[3].train_config().on_divergence == "continue"  # trained to the end, verdict recorded
    paths = write_report(results, tmp_path)
    md = paths["md"].read_text()
    assert "| step 420: rising: smoothed loss 9.000 |" in md
    assert "| int8 | 0.00098 | 3.600 (3.000) | 3.700 (3.000) | 3.500 (3.000) [eps/step 1] |" in md
    assert "n/a" in md and paths["png"].stat().st_size > 1000
    assert len(paths["csv"].read_text().splitlines()) == len(todo) + 1


def test_guard_verdict_of_a_single_model_and_of_a_soma_run():
    """Each SOMA expert has its own guard: the run's record names every expert whose guard fired."""
    from zosoma.experiments.precision import guard_verdict

    single = {"divergence": {"step": 420, "verdict": "rising: smoothed loss 9.000"}}
    assert guard_verdict(single) == single["divergence"] and guard_verdict({"divergence": None}) is None
    rising = {"step": 1302, "verdict": "rising: smoothed loss 99.9"}
    soma = {"training": [{"divergence": None}, {"divergence": {"step": 1410, "verdict": "non-finite"}},
                         {"divergence": None}, {"divergence": rising}]}
    assert guard_verdict(soma) == {"step": 1302, "verdict": "experts 1, 3 of 4; expert 3: rising: smoothed loss 99.9"}
    assert guard_verdict({"training": [{"divergence": None}] * 4}) is None


def test_precision_study_plan():
    from click.testing import CliRunner

    from zosoma.cli.main import cli

    result = CliRunner().invoke(cli, ["precision-study", "--plan", "--steps", "10", "--formats", "bf16,int8",
                                      "--multiples", "1", "--soma-multiples", "none"])
    assert result.exit_code == 0 and "6 runs of 10 steps" in result.output, result.output
    bad = CliRunner().invoke(cli, ["precision-study", "--plan", "--multiples", "x"])
    assert bad.exit_code == 2 and "comma-separated numbers" in bad.output


@pytest.mark.slow
def test_bench_forward_times_the_emulated_formats_beside_fp32():
    bench = cli_json(["bench", "forward", "--embed", "8", "--hidden", "8", "--layers", "1", "--batch", "2",
                      "--seq-len", "8", "--repeats", "1", "--no-numpy", "--forward-precision", "bf16",
                      "--forward-precision", "int8"], "bench-forward")
    timed = {r["name"] for r in bench["results"] if (r["tokens_per_s"] or 0) > 0}
    assert {"cpu population_loss M=1", "cpu-bf16 population_loss M=1", "cpu-int8 population_loss M=1"} <= timed


def test_bench_forward_of_an_emulated_engine_is_a_cpu_benchmark(monkeypatch):
    """An emulated engine runs on the CPU: timed beside the NumPy reference against the CPU's peak,
    not labelled as a GPU's."""
    from zosoma.benchmarks import bench_forward as bench

    monkeypatch.setattr(bench, "_PEAK_N", 64)
    monkeypatch.setattr(bench, "_PEAK_N_CUDA", 64)
    monkeypatch.setattr(bench, "_PAUSE_S", 0.0)
    records = bench.bench_forward(embed=8, hidden=8, layers=1, batch=2, seq_len=5, repeats=1,
                                  ops=get_ops("cpu", precision="bf16"))
    main = next(r for r in records if r["name"] == "cpu-bf16 population_loss M=1")
    assert "cuBLAS" not in main["threads"] and main["threads"].startswith("blas=")
    assert "numpy reference forward+loss" in [r["name"] for r in records]
    assert "cuda" not in records[0]["threads"]  # the peak: the CPU's


@pytest.mark.slow
def test_bench_spsa_times_an_emulated_step_beside_fp32():
    from helpers import run_cli

    result = run_cli(["bench", "spsa", "--preset", "tiny", "-P", "2", "--batch", "2", "--seq-len", "4", "--steps", "1",
                      "--forward-precision", "fp16"])
    assert result.exit_code == 0, result.output
    assert "device cpu-fp16" in result.output and "not run on the cpu-fp16 engine" in result.output
    assert "fp16 step" in result.output and "the fp32 step" in result.output


def test_a_run_left_by_another_study_is_refused_not_reused(tmp_path):
    import dataclasses

    from zosoma.errors import ConfigError
    from zosoma.experiments.precision import Study, jobs
    from zosoma.experiments.study import run_job
    from zosoma.training.folder import RunFolder

    job = jobs(Study(steps=10, formats=("fp32",), multiples=(), soma_multiples=()))[-1]
    assert job.name == "single-fp32-default-eps"
    scores = {"eps_over_step": 1.0, "heldout": {"overall": 5.0}, "heldout_fp32_eval": 5.0,  # what the report reads
              "train_loss_last100": 5.1, "skipped_steps": 0, "divergence": None, "wall_s": 1.0}
    RunFolder(tmp_path).write_result({**dataclasses.asdict(job), **scores, "steps": 5})  # a shorter study's run
    with pytest.raises(ConfigError, match=r"\(single model, fp32 forwards, eps 0.001\) was made with another "
                                          r"configuration \(steps was 5, now 10\): give this precision study another --out"):
        run_job(job, tmp_path)
    RunFolder(tmp_path).write_result({**dataclasses.asdict(job), **scores, "name": job.name})
    assert run_job(job, tmp_path)["steps"] == 10  # the same job: its record, not retrained


@pytest.mark.slow
def test_a_soma_run_stopped_between_its_experts_is_stopped_not_failed(tmp_path):
    from zosoma.experiments.precision import Study, jobs
    from zosoma.experiments.study import run_job
    from zosoma.training.folder import RunFolder

    job = jobs(Study(steps=2, formats=("fp32",), multiples=(), soma_multiples=()))[0]
    assert job.experts == 4
    folder = RunFolder(tmp_path)

    def expert0_done():  # false through expert 0's steps, true before expert 1 starts (Inline asks then)
        return folder.expert(0).has_checkpoint and folder.expert(0).read_checkpoint().step == 2

    assert run_job(job, tmp_path, expert0_done) is None
    assert folder.read_result() is None and folder.expert(0).read_checkpoint().step == 2
    assert folder.expert(1).read_checkpoint().step == 0  # checkpointed, ready to resume


def test_the_report_of_a_study_under_way_names_its_unfinished_runs(tmp_path):
    """`precision-study --report` writes the report from the finished runs and trains nothing."""
    import dataclasses

    from click.testing import CliRunner

    from zosoma.cli.main import cli
    from zosoma.experiments.precision import Study, jobs
    from zosoma.training.folder import RunFolder

    options = ["--out", str(tmp_path), "--steps", "10", "--formats", "fp32", "--multiples", "4",
               "--soma-multiples", "none"]
    missing = CliRunner().invoke(cli, ["precision-study", "--report", *options])
    assert missing.exit_code == 1 and "no study in" in missing.output and not any(tmp_path.iterdir())
    todo = jobs(Study(steps=10, formats=("fp32",), multiples=(4.0,), soma_multiples=()))
    job = todo[1]  # single-fp32-default-eps: finished; the others are not
    folder = RunFolder(tmp_path / "runs" / job.name)
    folder.make()
    folder.write_result(
        {**dataclasses.asdict(job), "eps_over_step": 1.0, "heldout": {"overall": 2.9}, "heldout_fp32_eval": 2.9,
         "train_loss_last100": 3.0, "skipped_steps": 0, "divergence": None, "wall_s": 1.0})
    result = CliRunner().invoke(cli, ["precision-study", "--report", *options])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "results.md").read_text()
    assert "| single-fp32-default-eps | fp32 | 1 |" in md
    assert "**Not finished yet** (2 runs;" in md and "soma4-fp32-default-eps, single-fp32-eps4step" in md
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [job.name]  # nothing trained


def test_a_comparisons_folder_is_refused_before_anything_trains(tmp_path):
    """The study runner binds the output folder to its kind of study, as the comparison's does."""
    from zosoma.errors import ConfigError
    from zosoma.experiments.precision import Study, run_study
    from zosoma.training.folder import RunFolder

    RunFolder(tmp_path).bind("comparison", {"segment": 256})
    with pytest.raises(ConfigError, match='study was "comparison", now "precision study"'):
        run_study(Study(steps=2, formats=("fp32",), multiples=(), soma_multiples=()), tmp_path)
    assert not (tmp_path / "runs").exists()  # no run was started


@pytest.mark.parametrize("damage, problem", [
    ({"divergence": {"step": 420}}, "no divergence.verdict"),
    ({"skipped_steps": None}, "skipped_steps is null"),
    ({"train_loss_last100": "5.1"}, 'train_loss_last100 is "5.1"'),
])
def test_a_precision_record_is_checked_whole(damage, problem):
    """Every field the study's report reads is checked when its record is read back (issue 45)."""
    import dataclasses

    from zosoma.experiments.precision import Study, jobs
    from zosoma.training.json_shape import record_problem

    job = jobs(Study(steps=10, formats=("fp32",), multiples=(), soma_multiples=()))[-1]
    good = {**dataclasses.asdict(job), "eps_over_step": 1.0, "heldout": {"overall": 5.0}, "heldout_fp32_eval": 5.0,
            "train_loss_last100": None, "skipped_steps": 0, "divergence": {"step": 420, "verdict": "rising"},
            "wall_s": 1.0}
    assert record_problem(good, job.record_shape) is None
    assert record_problem({**good, **damage}, job.record_shape) == problem
