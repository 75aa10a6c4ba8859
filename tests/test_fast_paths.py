"""The CPU step's fast paths against their references: members built inside the forward, the fused
update, member-parallel threads, the PyTorch peers of `zosoma bench spsa` and its roofline.

Shapes stay tiny so the file passes in seconds (and with NUMBA_DISABLE_JIT=1)."""

import numpy as np
import pytest

from helpers import assert_close, random_bytes, scaled_model
from zosoma.engines.ops import Ops, perturbed
from zosoma.engines.cpu import forward, noise_kernels, threads
from zosoma.model import noise, reference
from zosoma.model.population import Population

LOSS_RTOL = 1e-5  # float32 forward vs the float64 reference (tests/test_forward.py)


def _add_noise_loop(d, coeffs, pop):
    """Ops.noise_sum as it was written before the fused update: add_noise k by k."""
    out = np.zeros(d, np.float32)
    for k, c in enumerate(coeffs):
        noise.add_noise(out, out, float(c) / len(coeffs), pop.seed, pop.expert, pop.step, k, pop.kind)
    return out


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def n_threads(request, monkeypatch):
    monkeypatch.setattr(threads, "n_threads", lambda: request.param)
    return request.param


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("embed, hidden, layers, B, T", [
    (8, 16, 1, 3, 11),  # the transposed recurrent GEMM (B <= 32)
    (6, 10, 2, 40, 5),  # h @ w_hh (B > 32)
])
def test_members_built_in_the_forward_match_the_reference(kind, embed, hidden, layers, B, T, n_threads):
    theta, layout = scaled_model(embed, hidden, layers, scale=2.0)
    batch = random_bytes(1, (B, T + 1))
    pop = Population(4, 0.05, 2**33 + 3, 2, 7, kind)
    plus, minus = forward.perturbed_sums(theta, layout, batch, pop.scale, pop.seed, pop.expert, pop.step,
                                         kind, range(1, 4))
    members = perturbed(theta, pop, range(1, 4))  # rows: +1, -1, +2, -2, +3, -3
    want = [reference.loss(m.astype(np.float64), layout, batch) for m in members]
    assert_close(plus, want[0::2], rtol=LOSS_RTOL, name="plus")
    assert_close(minus, want[1::2], rtol=LOSS_RTOL, name="minus")
    materialised = forward.population_loss(members, layout, batch)
    assert_close(plus, materialised[0::2], rtol=1e-6, name="plus vs population_loss of the members")
    assert_close(minus, materialised[1::2], rtol=1e-6, name="minus vs population_loss of the members")


def test_antithetic_pair_is_add_noise_with_both_signs():
    theta = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    for kind in ("rademacher", "gaussian"):
        plus, minus, delta = (np.empty_like(theta) for _ in range(3))
        k0, k1 = noise.stream_key(2**40 + 1)
        noise_kernels.antithetic_pair(plus, minus, theta, np.float32(1e-3), noise.kind_code(kind), k0, k1, 5, 6, 7, delta)
        for got, scale in ((plus, 1e-3), (minus, -1e-3)):
            want = noise.add_noise(np.empty_like(theta), theta, scale, 2**40 + 1, 7, 6, 5, kind)
            assert np.array_equal(got, want), kind
        assert np.array_equal(delta, noise.noise(1000, 2**40 + 1, 7, 6, 5, kind))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("d", [1, 127, 129, 3000, 9000])
def test_fused_update_is_bit_identical_to_the_formula(kind, d, n_threads):
    rng = np.random.default_rng(d)
    theta = rng.standard_normal(d).astype(np.float32)
    coeffs = rng.standard_normal(6) * 5
    pop = Population(6, 1e-3, 11, 2, 9, kind)
    ghat = _add_noise_loop(d, coeffs, pop)
    assert np.array_equal(Ops().noise_sum(coeffs, d, pop), ghat)
    for lr, wd in ((0.15, 0.0), (0.03, 0.01)):
        want = theta - np.float32(lr) * ghat
        if wd:
            want -= np.float32(lr * wd) * theta
        assert np.array_equal(Ops().sgd_update(theta, coeffs, pop, lr, wd), want), (lr, wd)


def test_kept_gaussian_directions_give_the_same_update():
    theta, layout = scaled_model(6, 8, 1, scale=1.0)
    batch = random_bytes(2, (2, 7))
    coeffs = np.array([1.5, -2.0, 0.25])
    for kind in ("gaussian", "rademacher"):
        pop = Population(3, 1e-2, 4, 0, 1, kind)
        ops = Ops()
        ops.perturbed_losses(theta, layout, batch, pop)
        assert (ops._kept is not None) == (kind == "gaussian")  # only Gaussian directions are kept
        new, ghat = ops.sgd_update(theta, coeffs, pop, 0.1, 0.01), ops.noise_sum(coeffs, theta.size, pop)
        assert np.array_equal(ghat, _add_noise_loop(theta.size, coeffs, pop)), kind
        other = Population(3, 1e-2, 4, 0, 2, kind)  # another step: nothing kept applies
        assert np.array_equal(ops.noise_sum(coeffs, theta.size, other), _add_noise_loop(theta.size, coeffs, other))
        assert np.array_equal(new, Ops().sgd_update(theta, coeffs, pop, 0.1, 0.01)), kind


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    """Whole members run in one thread each: the same numbers whatever the thread count."""
    theta, layout = scaled_model(8, 12, 2)
    thetas = np.stack([scaled_model(8, 12, 2, seed=m)[0] for m in range(3)])
    batch = random_bytes(3, (6, 10))
    pop = Population(3, 1e-2, 5, 0, 0)
    results = []
    for n in (1, 2, 3):
        monkeypatch.setattr(threads, "n_threads", lambda n=n: n)
        results.append((forward.perturbed_sums(theta, layout, batch, pop.scale, pop.seed, 0, 0, pop.kind, range(3)),
                        forward.population_loss(thetas, layout, batch),
                        forward.nll_stream(theta, layout, batch[:, :-1], batch[:, 1:])[0]))
    for other in results[1:]:
        for a, b in zip(np.concatenate(results[0][0]), np.concatenate(other[0])):
            assert a == b
        assert_close(other[1], results[0][1], rtol=1e-12, name="population_loss")  # whole members
        # one member's rows split into blocks: BLAS may round a row differently in a smaller GEMM
        assert_close(other[2], results[0][2], atol=1e-6, rtol=1e-6, name="nll_stream")


def test_one_member_split_into_row_blocks(monkeypatch):
    monkeypatch.setattr(threads, "n_threads", lambda: 3)
    theta, layout = scaled_model(5, 9, 2)
    batch = random_bytes(4, (7, 13))
    assert_close(forward.population_loss(theta[None], layout, batch)[0],
                 reference.loss(theta.astype(np.float64), layout, batch), rtol=LOSS_RTOL, name="row blocks")
    state = [(np.full((7, 9), 0.1, np.float32), np.full((7, 9), -0.2, np.float32)) for _ in range(2)]
    nll, new_state = forward.nll_stream(theta, layout, batch[:, :-1], batch[:, 1:], state)
    logits, ref_state = reference.forward(theta.astype(np.float64), layout, batch[:, :-1],
                                          [(h.astype(np.float64), c.astype(np.float64)) for h, c in state])
    assert_close(nll, reference.nll(logits, batch[:, 1:]), atol=1e-4, rtol=0.0, name="nll")
    assert_close(new_state[1][1], ref_state[1][1], atol=1e-5, rtol=0.0, name="carried c")


def test_a_worker_error_reaches_the_caller():
    def work(item, _):
        if item == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        threads.run_items(work, 6, threads=2)


def test_split_covers_the_range():
    for n, parts in ((10, 3), (2, 5), (0, 2)):
        ranges = threads.split(n, parts)
        assert [i for r in ranges for i in r] == list(range(n))
        assert all(len(r) for r in ranges) or n == 0


# --- the PyTorch peers of `zosoma bench spsa` compute the same model ---------------------------------

@pytest.mark.slow
def test_torch_peers_compute_the_reference_loss():
    pytest.importorskip("torch")
    from zosoma.benchmarks import torch_peers

    theta, layout = scaled_model(6, 10, 2, scale=1.5)
    batch = random_bytes(5, (3, 9))
    want = reference.loss(theta.astype(np.float64), layout, batch)
    for name, make in torch_peers.PEERS.items():
        step = make(layout.config, 2, batch, eps=1e-4, lr=0.0, theta=theta, threads=1)
        assert_close(step(0), want, rtol=1e-5, name=name)  # mean of L(theta +/- eps z), eps^2 away


@pytest.mark.slow
def test_bench_spsa_reports_peers_and_the_split():
    pytest.importorskip("torch")
    from zosoma.benchmarks.bench_spsa import bench_spsa, format_spsa

    r = bench_spsa("tiny", perturbations=2, batch=2, seq_len=4, steps=1, peak_n=64)
    assert set(r["parts"]) == {"forward", "noise", "data", "update"}
    assert r["tokens_per_s"] > 0 and r["gflops_executed"] > 0 and r["peak_gflops"] > 0
    assert len(r["peers"]) == 2
    text = format_spsa(r)
    assert "zosoma SPSA step" in text and "torch MeZO loop" in text and "outside the forward passes" in text


# --- the roofline of `zosoma bench spsa` at any shape (no timing asserted) -------------------------

def test_token_work_is_the_hand_count():
    from zosoma.config import ModelConfig
    from zosoma.benchmarks.roofline import token_work

    # E=3, H=2, L=2: layer 0 2*4*2*(3+2) = 80, layer 1 2*4*2*(2+2) = 64, output 2*2*256 = 1024;
    # exps: 256 (log-softmax) + 5 gate nonlinearities x 2 units x 2 layers = 20
    assert token_work(ModelConfig(embed=3, hidden=2, layers=2)) == {
        "gemm_flops": 1168, "lstm_flops": 144, "output_flops": 1024, "exps": 276, "softmax_exps": 256, "gate_exps": 20}
    # the best expert: 16k FLOPs per token, 10k of them the output layer
    work = token_work(ModelConfig(embed=16, hidden=20, layers=1))
    assert (work["gemm_flops"], work["output_flops"], work["exps"]) == (16_000, 10_240, 356)


SHORT = ["--preset", "tiny", "-P", "2", "--batch", "2", "--seq-len", "4", "--steps", "1", "--no-peers"]


def _bench_json(monkeypatch, args):
    import json

    from helpers import run_cli
    from zosoma.benchmarks import bench_spsa

    monkeypatch.setattr(bench_spsa, "PEAK_N", 64)  # a short measurement
    monkeypatch.setattr(bench_spsa, "_PAUSE_S", 0.0)
    result = run_cli(["bench", "spsa", *SHORT, *args, "--json"])
    assert result.exit_code == 0, result.output
    obj = json.loads(result.output)
    assert obj["schema"] == "zosoma.bench-spsa/1"
    return obj["results"]


@pytest.mark.slow
def test_bench_spsa_at_a_shape_reports_its_roofline(monkeypatch):
    from zosoma.config import ModelConfig
    from zosoma.benchmarks.roofline import token_work

    r = _bench_json(monkeypatch, ["--embed", "4", "--hidden", "6", "--layers", "2"])
    assert r["model"] == {"embed": 4, "hidden": 6, "layers": 2} and r["n_params"] == ModelConfig(4, 6, 2).n_params()
    roof = r["roofline"]
    assert roof["per_token"] == token_work(ModelConfig(4, 6, 2)) and roof["tokens"] == 2 * 2 * 2 * 4
    assert roof["step_s"] == r["step_s"] and roof["threads"] == r["threads"]
    assert sum(roof["parts_s"].values()) == pytest.approx(r["step_s"])
    assert roof["compute_bound_s"] == pytest.approx(roof["parts_s"]["gemm"] + roof["parts_s"]["exps"])
    assert roof["bound"] == max(roof["parts_s"], key=roof["parts_s"].get)
    assert roof["gflops"] == pytest.approx(r["tokens_per_s"] * roof["per_token"]["gemm_flops"] / 1e9)
    assert roof["fraction_of_peak"] == pytest.approx(roof["gflops"] / (roof["threads"] * roof["core_peak_gflops"]))
    assert roof["core_peak_gflops"] > 0 and roof["np_exp_ns"] > 0 and roof["forward_exp_ns"] > 0
    assert roof["blas"] and all(b["internal_api"] and b["filepath"] for b in roof["blas"])
    # the CPU forward's two GEMM paths, timed in the same rounds; the step above is auto's choice
    paths = r["gemm_paths"]
    assert set(paths) == {"blas", "loops"} and [p["chosen"] for p in paths.values()].count(True) == 1
    chosen = next(p for p in paths.values() if p["chosen"])
    assert chosen["roofline"]["step_s"] == chosen["step_s"] and chosen["tokens_per_s"] == pytest.approx(
        roof["tokens"] / chosen["step_s"])


@pytest.mark.slow
def test_bench_spsa_runs_several_shapes_in_one_command(monkeypatch):
    from helpers import run_cli

    results = _bench_json(monkeypatch, ["--shapes", "4x6,3x5"])
    assert [(r["model"]["embed"], r["model"]["hidden"], r["model"]["layers"]) for r in results] == [(4, 6, 1), (3, 5, 1)]
    assert all(r["roofline"]["per_token"]["exps"] == 256 + 5 * r["model"]["hidden"] for r in results)
    text = run_cli(["bench", "spsa", *SHORT, "--shapes", "4x6,3x5", "--layers", "2"]).output
    assert text.count("\nroofline\n  per token") == 2
    table = text[text.index("shapes at P=2 B=2 T=4"):].splitlines()
    assert [line.split()[:3] for line in table[2:4]] == [["E=4", "H=6", "L=2"], ["E=3", "H=5", "L=2"]]
    paths = text[text.index("GEMM paths at each shape"):].splitlines()
    assert [line.split()[:3] for line in paths[2:]] == [["E=4", "H=6", "L=2"], ["E=3", "H=5", "L=2"]]
    assert all(line.split()[5].endswith("x") for line in paths[2:])  # loops/blas, side by side


@pytest.mark.parametrize("args, message", [
    (["--shapes", "16x"], "expected ExH pairs such as 16x20,8x12, got '16x'"),
    (["--shapes", "0x20"], "got '0x20'"),
    (["--shapes", "16x20", "--embed", "8"], "--shapes sets E and H: give it without --embed and --hidden"),
    (["--hidden", "0"], "must be at least 1, got 0"),
])
def test_bench_spsa_refuses_a_bad_shape(args, message):
    from helpers import run_cli

    result = run_cli(["bench", "spsa", *SHORT, *args])
    assert result.exit_code == 2 and message in result.output
