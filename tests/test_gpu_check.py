"""studies/gpu_check.py's parts for issue 47 (studies/gpu_check_extra.py), run at small sizes on the
runtime at hand (the emulated one of tests/test_kernels.py without a GPU), so that the device check
does not die on the device from a typo: routing on the device, the default path, the short price
table's plan, and the table's seconds per part."""

import importlib.util

import numpy as np
import pytest

from test_kernels import ROOT, emulated_libs, rt  # noqa: F401  the CUDA engine's runtimes


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "studies" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def check():
    return _load("gpu_check")


@pytest.mark.slow
def test_routing_and_the_default_path_pass_on_the_runtime_at_hand(rt, check):
    checks = check.Checks()
    check.extra.validate_routing(checks, contexts=64, clusters=8, every=16)
    check.extra.validate_default_path(checks, np.random.default_rng(0), P=3, B=2, T=5)
    names = [r[0] for r in checks.rows]
    assert len(names) == 7 and not checks.failed, checks.failed
    assert names[0] == "route_embed 68 contexts vs Clustering.embed"
    assert names[-1] == "default path (graph) E=48 H=96 step 1 vs the kernels path"


def test_the_short_price_table_is_a_shipped_comparison(check, tmp_path):
    plan = check.extra.price_quick("cpu", tmp_path / "price-quick", plan=True)
    assert "one-sided SPSA (zosoma train), 300 steps" in plan and "backprop E=32 H=64, 300 steps" in plan
    assert "2 runs, 0 already finished" in plan


def test_the_table_says_what_each_part_took(check):
    checks = check.Checks()
    checks._add("a check", 0.0, 0.0, "exact", True)
    text = check.table("a device", checks, [], "", [("validation", 61.0), ("price", 250.0)])
    assert "validation: 1 of 1 passed" in text
    assert "seconds per part: validation 61, price 250; 311 s in all (budget 300 s: OVER)" in text


def test_main_runs_every_part_and_a_part_that_raises_is_a_failed_check(check, tmp_path, monkeypatch, capsys):
    """gpu_check's main on a stand-in device with each part stubbed: every part runs (the timing
    ones too), one that raises is a FAIL row and exit status 1, and the table is still written."""
    from types import SimpleNamespace

    runtime = SimpleNamespace(getDeviceProperties=lambda i: {"name": b"stand-in"}, runtimeGetVersion=lambda: 13020,
                              deviceSynchronize=lambda: None)
    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=lambda: SimpleNamespace(id=0)),
                         __version__="0", empty=np.empty, empty_like=np.empty_like)
    monkeypatch.setattr(check.backend, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(check.backend, "require_cupy", lambda: cp)
    ran = []

    def stub(name, result=None):
        def part(*args, **kwargs):
            ran.append(name)
            if name == "routing":
                raise ValueError("a miss\nsecond line")
            return result
        return part

    for module, name, result in [(check, "validate", None), (check, "validate_fused", None),
                                 (check.extra, "validate_default_path", None), (check.extra, "validate_routing", None),
                                 (check, "timing", None), (check, "tensor_cores", None),
                                 (check, "experts_timing", "STEPS TABLE"), (check, "routed_timing", "ROUTED TABLE"),
                                 (check.extra, "price_quick", "PRICE TABLE")]:
        monkeypatch.setattr(module, name, stub(name.replace("validate_", ""), result))
    out = tmp_path / "gpu_check.txt"
    assert check.main(["--out", str(out)]) == 1
    assert ran == ["validate", "fused", "default_path", "routing", "timing", "tensor_cores", "experts_timing",
                   "routed_timing", "price_quick"]
    text = out.read_text()
    assert "validation: 0 of 1 passed" in text and "routing: raised ValueError: a miss" in text
    assert "ROUTED TABLE" in text and "STEPS TABLE" in text and "PRICE TABLE" in text
    assert "seconds per part: validation 0, fused 0, default path 0, routing 0, paper timing 0" in text
    assert "1 of 1 checks FAILED: routing: raised ValueError" in capsys.readouterr().err
