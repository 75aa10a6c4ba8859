"""The price of zero-order on a GPU (`zosoma compare price --device cuda`): backprop trains with
PyTorch on the same device as zosoma, every run's seconds are the device's (wall, one run at a
time), and the table says GPU-seconds; without a GPU the command is one line."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import run_cli
from zosoma.engines.cuda import backend
from zosoma.errors import ConfigError
from zosoma.experiments import backprop
from zosoma.experiments.compare import _CpuClock, _DeviceClock
from zosoma.experiments.price import price_section

torch = pytest.importorskip("torch", reason="PyTorch is the backprop extra (and in the test extra)")


def _results(clock=None):
    def run(method, kind, seconds):
        r = {"method": method, "kind": kind, "seed": 0,
             "curve": [{"step": 0, "cpu_s": 0.0, "heldout": 5.0}, {"step": 1, "cpu_s": seconds, "heldout": 2.0}]}
        return r if clock is None else dict(r, clock=clock)
    return [run("zo", "spsa", 300.0), run("bp", "backprop", 4.0)]


def test_a_device_comparison_is_priced_in_gpu_seconds():
    cpu, gpu = price_section(_results(), [3.5]), price_section(_results("gpu"), [3.5])
    assert "training CPU-seconds" in cpu and "torch.set_num_threads(1)" in cpu and "GPU" not in cpu
    assert "training GPU-seconds" in gpu and "on the same GPU (cuDNN)" in gpu and "CPU-seconds" not in gpu
    assert cpu.split("\n\n")[1] == gpu.split("\n\n")[1]  # the same table: 150 s (x75), 2 s (x1)
    assert "150 s (x75)" in gpu


def test_the_device_clock_counts_wall_seconds_the_cpu_clock_cpu_seconds():
    class Waits:  # a run whose step waits on the device: wall time passes, little CPU time
        def advance(self, target, stopping):
            time.sleep(0.2)
            return True

    cpu, device = _CpuClock([{"cpu_s": 1.0}]), _DeviceClock([{"cpu_s": 1.0}])
    assert cpu.advance(Waits(), 1, lambda: False) and device.advance(Waits(), 1, lambda: False)
    assert cpu.seconds < 1.1 and 1.19 < device.seconds < 2.0  # each adds to what its curve recorded


def test_backprop_trains_on_the_device_of_its_engine():
    assert backprop.torch_device(SimpleNamespace(on_device=False, device="cpu")).type == "cpu"
    on_gpu = SimpleNamespace(on_device=True, device="cuda")
    if torch.cuda.is_available():
        assert backprop.torch_device(on_gpu).type == "cuda"
        return
    with pytest.raises(ConfigError, match=r"^--device cuda: this PyTorch \(.+\) finds no CUDA device"):
        backprop.torch_device(on_gpu)


def test_a_model_on_another_device_reads_its_batches_there_and_gives_theta_back():
    from zosoma.config import ModelConfig
    from zosoma.model.params import Layout, init_params

    layout = Layout(ModelConfig(embed=4, hidden=6, layers=1))
    theta = init_params(layout.config, 0)
    device = "cuda" if torch.cuda.is_available() else "meta"  # meta: a device that is not the CPU
    batch = np.random.default_rng(0).integers(0, 256, (2, 7), dtype=np.uint8)
    model = backprop.torch_model(theta, layout)
    want = backprop.mean_loss(model, batch).detach().item()
    if device == "meta":  # the batch follows the model's parameters to their device
        assert backprop.mean_loss(model.to(device), batch).device.type == "meta"
        return
    moved = model.to(device)
    assert abs(backprop.mean_loss(moved, batch).detach().item() - want) < 1e-5
    np.testing.assert_array_equal(backprop.theta_of(moved, layout), theta)


def test_compare_price_on_cuda_without_a_gpu_is_one_line():
    if backend.cuda_device_count():
        pytest.skip("a CUDA device is present")
    result = run_cli(["compare", "price", "--device", "cuda"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert result.output.startswith("Error: --device cuda: no CUDA device (")


def test_the_price_plot_says_which_seconds(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from zosoma.experiments.report import plot_price

    said = []
    set_xlabel = Axes.set_xlabel
    monkeypatch.setattr(Axes, "set_xlabel", lambda ax, text, *a, **k: (said.append(text), set_xlabel(ax, text, *a, **k)))
    for clock in (None, "gpu"):
        plot_price(_results(clock), tmp_path / f"{clock}.png")
    assert said[0].startswith("training CPU-seconds") and said[1].startswith("training GPU-seconds")
