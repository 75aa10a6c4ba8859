"""ONNX export (zosoma.formats.onnx, zosoma.porting.export_run, `zosoma export --format onnx`): the graphs
pass onnx.checker's full check, ONNX Runtime reproduces the NumPy reference's logits within 1e-5
with the state carried across pieces, and the gate order is what makes it so."""

import json

import numpy as np
import pytest

from helpers import (assert_close, error_line, on_a_full_disk, on_a_read_only_disk, one_line_error, run_cli as run,
                     snapshot, users_files, zosoma_cmd)
from world import tiny_args
from zosoma.engines.ops import Ops
from zosoma.config import VOCAB, ModelConfig
from zosoma.formats import onnx as zonnx
from zosoma.model import reference
from zosoma.model.params import Layout, init_params

onnx = pytest.importorskip("onnx", reason="ONNX export needs the onnx extra")
ort = pytest.importorskip("onnxruntime", reason="ONNX Runtime is in the onnx extra")

LOGITS_ATOL = 1e-5  # the bound: float32 runtime against the float64 reference


def _model(embed=12, hidden=16, layers=2, scale=3.0):
    layout = Layout(ModelConfig(embed=embed, hidden=hidden, layers=layers))
    return (init_params(layout.config, 1) * scale).astype(np.float32), layout


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _state(layout, B, seed=0):
    rng = np.random.default_rng(seed)
    shape = (layout.config.layers, B, layout.config.hidden)
    return (0.5 * rng.standard_normal(shape)).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _reference(theta, layout, tokens, h0, c0):
    state = [(h0[i].astype(np.float64), c0[i].astype(np.float64)) for i in range(layout.config.layers)]
    logits, state = reference.forward(theta.astype(np.float64), layout, tokens, state)
    return logits, np.stack([h for h, _ in state]), np.stack([c for _, c in state])


@pytest.mark.parametrize("form", ["lstm", "unrolled"])
@pytest.mark.parametrize("embed, hidden, layers", [(12, 16, 2), (8, 24, 1), (16, 8, 3)])
def test_graph_is_valid_and_matches_the_reference(form, embed, hidden, layers):
    theta, layout = _model(embed, hidden, layers)
    T, B = 9, 3
    model = zonnx.build_model(theta, layout, form, seq_len=T)
    onnx.checker.check_model(model, full_check=True)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (B, T), dtype=np.uint8)
    h0, c0 = _state(layout, B)
    logits, hT, cT = _session(model).run(None, {"tokens": tokens.astype(np.int64), "h0": h0, "c0": c0})
    want = _reference(theta, layout, tokens, h0, c0)
    assert np.abs(want[0]).max() > 1  # a confident model: errors would show
    for name, got, ref in zip(("logits", "hT", "cT"), (logits, hT, cT), want):
        assert_close(got, ref, atol=LOGITS_ATOL, rtol=0, name=f"{form} {name}")


def test_a_long_text_in_pieces_equals_one_pass():
    """Streaming: hT, cT fed back as h0, c0 continue the text exactly (the LSTM operator takes
    any T, so the pieces may differ in length)."""
    theta, layout = _model()
    session = _session(zonnx.build_model(theta, layout))
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 40), dtype=np.int64)
    h, c = (np.zeros((2, 2, 16), np.float32),) * 2
    pieces = []
    for a, b in ((0, 7), (7, 8), (8, 40)):
        logits, h, c = session.run(None, {"tokens": tokens[:, a:b], "h0": h, "c0": c})
        pieces.append(logits)
    zero = np.zeros((2, 2, 16), np.float32)
    assert_close(np.concatenate(pieces, axis=1), _reference(theta, layout, tokens, zero, zero)[0],
                 atol=LOGITS_ATOL, rtol=0, name="streamed logits")


def test_a_wrong_gate_order_fails():
    """zosoma's i, f, g, o handed to the operator unchanged (it expects i, o, f, c): the check above
    must catch it, by far."""
    theta, layout = _model()
    tokens = np.random.default_rng(4).integers(0, VOCAB, (3, 9), dtype=np.uint8)
    h0, c0 = _state(layout, 3)
    wrong = zonnx.build_model(theta, layout, order=(0, 1, 2, 3))
    logits, _, _ = _session(wrong).run(None, {"tokens": tokens.astype(np.int64), "h0": h0, "c0": c0})
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(logits, _reference(theta, layout, tokens, h0, c0)[0], atol=LOGITS_ATOL, rtol=0)


def test_training_graph_takes_theta_and_returns_losses():
    theta, layout = _model()
    model = zonnx.build_training_model(layout)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["theta", "tokens", "targets", "h0", "c0"]
    assert not model.graph.initializer or all(i.name not in ("embed", "W0") for i in model.graph.initializer)
    data = np.random.default_rng(5).integers(0, VOCAB, (3, 10), dtype=np.uint8)
    h0, c0 = _state(layout, 3)
    nll, loss, _, _ = _session(model).run(None, {"theta": theta, "tokens": data[:, :-1].astype(np.int64),
                                                 "targets": data[:, 1:].astype(np.int64), "h0": h0, "c0": c0})
    want = reference.nll(_reference(theta, layout, data[:, :-1], h0, c0)[0], data[:, 1:])
    assert_close(nll, want, atol=1e-4, rtol=0, name="nll")
    assert_close(loss, want.mean(), rtol=1e-6, name="loss")


# --- the command line ------------------------------------------------------------------------------

TINY = tiny_args(2, 2, steps=2, checkpoint_every=2)




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-model run and a SOMA N=2 run on a small text."""
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"{", b"}", b"int", b"\n"]
    for name, pick in (("a", slice(0, 4)), ("b", slice(4, 8))):
        (root / f"{name}.txt").write_bytes(b" ".join(words[pick][i] for i in rng.integers(0, 4, 3000)))
    data = ["--data", str(root / "a.txt"), "--data", str(root / "b.txt"), "--heldout", str(root / "a.txt")]
    for name, extra in (("single", []), ("soma", ["--experts", "2", "--chunk-size", "512", "--workers", "1"])):
        result = run(["train", *data, "--run-dir", str(root / name), *TINY, *extra])
        assert result.exit_code == 0, result.output
    return root


@pytest.mark.slow
def test_export_a_single_model_and_an_expert(runs, tmp_path):
    for src in (runs / "single", runs / "soma" / "expert1"):
        out = tmp_path / f"{src.name}.onnx"
        result = run(["export", str(src), "--format", "onnx", "--out", str(out)])
        assert result.exit_code == 0 and "wrote" in result.output, result.output
        onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    result = run(["export", str(runs / "single"), "--format", "onnx", "--unrolled", "--seq-len", "5",
                  "--out", str(tmp_path / "u.onnx")])
    assert result.exit_code == 0, result.output
    (inp,) = [i for i in onnx.load(str(tmp_path / "u.onnx")).graph.input if i.name == "tokens"]
    assert inp.type.tensor_type.shape.dim[1].dim_value == 5
    assert {n.op_type for n in onnx.load(str(tmp_path / "u.onnx")).graph.node}.isdisjoint({"LSTM", "Loop", "Scan"})


def test_export_a_soma_run(runs, tmp_path):
    out = tmp_path / "soma-onnx"
    result = run(["export", str(runs / "soma"), "--format", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "zosoma-onnx-soma" and len(manifest["experts"]) == 2
    with np.load(out / "router.npz") as router:
        cfg = json.loads(str(router["config"]))
        assert router["centroids"].shape == (2, cfg["svd_dim"])
        assert router["projection"].shape == (cfg["n_features"], cfg["svd_dim"])
    for e in manifest["experts"]:
        onnx.checker.check_model(onnx.load(str(out / e["file"])), full_check=True)
    again = run(["export", str(runs / "soma"), "--format", "onnx", "--out", str(out)])
    assert "exists" in one_line_error(again)
    assert run(["export", str(runs / "soma"), "--format", "onnx", "--out", str(out), "--force"]).exit_code == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["soma-onnx"]  # no temporary left behind


def test_export_bad_input_is_one_line(runs, tmp_path):
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes((runs / "single" / "checkpoint.h5").read_bytes()[:3000])
    assert "damaged" in one_line_error(run(["export", str(damaged), "--format", "onnx",
                                            "--out", str(tmp_path / "x.onnx")]))
    assert not (tmp_path / "x.onnx").exists()
    assert "'pdf' is not one of" in one_line_error(run(["export", str(runs / "single"), "--format", "pdf",
                                                        "--out", str(tmp_path / "x")]))
    assert "--seq-len" in one_line_error(run(["export", str(runs / "single"), "--format", "onnx", "--seq-len", "4",
                                              "--out", str(tmp_path / "x.onnx")]))
    assert "options of --format onnx" in one_line_error(run(["export", str(runs / "single"), "--unrolled",
                                                             "--out", str(tmp_path / "x.pt")]))


def test_export_force_replaces_the_export_and_nothing_else(runs, tmp_path):
    out = tmp_path / "soma-onnx"
    users = users_files(out)
    export = ["export", str(runs / "soma"), "--format", "onnx", "--out", str(out), "--force"]
    assert run(export).exit_code == 0
    assert users.items() <= snapshot(out).items()  # every one of the user's files, byte for byte
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files == ["expert0.onnx", "expert1.onnx", "manifest.json", "router.npz"]
    lstm = (out / "expert0.onnx").read_bytes()
    assert run(export + ["--unrolled", "--seq-len", "4"]).exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["form"] == "unrolled"
    assert (out / "expert0.onnx").read_bytes() != lstm
    assert users.items() <= snapshot(out).items() and set(snapshot(out)) == set(users) | set(files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["soma-onnx"]  # nothing temporary left
    clash = tmp_path / "clash"
    users_files(clash)
    (clash / "router.npz").write_bytes(b"the user's")
    before = snapshot(clash)
    export[export.index("--out") + 1] = str(clash)
    assert "router.npz was not written by zosoma; nothing was changed" in one_line_error(run(export))
    assert snapshot(clash) == before


RUN_FILES = [("single", "single/checkpoint.h5"), ("single", "single/checkpoint.prev.h5"),
             ("single", "single/metrics.jsonl"), ("single", "single/results.json"),
             ("single", "single/events.out.tfevents.*"), ("soma/expert0", "soma/expert1/checkpoint.h5"),
             ("single", "soma/router.h5"), ("single", "soma/soma.json"), ("single", "study/settings.json")]


@pytest.mark.parametrize("fmt", ["torch", "onnx"])
@pytest.mark.parametrize("source, target", RUN_FILES + [("soma", "soma"), ("soma", "soma/expert0")],
                         ids=[t for _, t in RUN_FILES] + ["soma run folder", "expert folder"])
def test_force_never_writes_over_a_runs_own_files(runs, tmp_path, fmt, source, target):
    import shutil
    from zosoma.training.folder import RunFolder
    for name in ("single", "soma"):  # copies: the module's runs stay whole even where the guard fails
        shutil.copytree(runs / name, tmp_path / name)
    RunFolder(tmp_path / "study").bind("comparison", {"steps": 2})  # a folder of runs' settings.json
    out = sorted(tmp_path.glob(target))[0]  # a run may hold several event files
    before = snapshot(tmp_path)
    line = one_line_error(run(["export", tmp_path / source, "--format", fmt, "--out", out, "--force"]))
    assert line.endswith("nothing was changed") and str(out) in line, line
    assert snapshot(tmp_path) == before  # every file of both runs, byte for byte, and nothing new


@pytest.fixture(scope="module")
def dropped(tmp_path_factory):
    """SOMA N=2 runs trained with restarts: "one" whose expert 1 diverged until it was dropped,
    "all" whose both experts were; and their text."""
    import dataclasses
    import warnings

    from test_robust import MODEL, RESTART, text_corpus
    from zosoma.errors import ConfigError
    from zosoma.workers.executor import Inline
    from zosoma.training.folder import RunFolder
    from zosoma.runs.soma import DroppedExperts, create_soma, resume_soma

    root = tmp_path_factory.mktemp("dropped")
    text = text_corpus(root)
    cfg = dataclasses.replace(RESTART, max_restarts=1)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.delenv("ZOSOMA_WIKITEXT103", raising=False)  # held-out text only: quick
        warnings.simplefilter("ignore", DroppedExperts)  # "routing top-1 instead of top-2": tested elsewhere
        for name, bad in (("one", [1]), ("all", [0, 1])):
            create_soma(root / name, MODEL, cfg, 2, chunk_size=256, train_paths=[str(text)], heldout_paths=[str(text)])
            for i in bad:  # a rate that diverges whatever the restarts
                folder = RunFolder(root / name).expert(i)
                ckpt = folder.read_checkpoint()
                ckpt.train = dataclasses.replace(ckpt.train, lr=400.0)
                folder.write_checkpoint(ckpt)
            if name == "one":
                list(resume_soma(root / name, Inline(), ops=Ops()))
            else:
                with pytest.raises(ConfigError, match="every expert was dropped"):
                    list(resume_soma(root / name, Inline(), ops=Ops()))
    return root, text


@pytest.mark.slow
def test_a_soma_export_routes_around_a_dropped_expert_as_eval_does(dropped, tmp_path, monkeypatch):
    from zosoma.engines import get_ops
    from zosoma.config import ClusterConfig
    from zosoma.mixture.cluster import Clustering
    from zosoma.mixture.routing import Ensemble, Router, evaluate_routed_corpus
    from zosoma.corpus import load_corpus
    from zosoma.training.folder import RunFolder

    monkeypatch.delenv("ZOSOMA_WIKITEXT103", raising=False)
    root, text = dropped
    out = tmp_path / "export"
    result = run(["export", root / "one", "--format", "onnx", "--out", out])
    assert result.exit_code == 0 and "top-1, experts [1] dropped" in result.output, result.output
    evaluated = run(["eval", root / "one", "--data", text, "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    routed = json.loads(evaluated.stdout)["heldout"]["overall"]["routed"]
    # route as the export says: router.npz and the manifest, nothing of the run but the experts' weights
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and [e["dropped"] for e in manifest["experts"]] == [False, True]
    with np.load(out / "router.npz") as f:
        clustering = Clustering(ClusterConfig.from_json(str(f["config"])), f["idf"], f["projection"], f["centroids"])
        top_k, temperature, gone = int(f["top_k"]), float(f["temperature"]), f["dropped"].tolist()
    assert (top_k, temperature, gone) == (1, 0.1, [1])  # eval's: top-2 falls to the one expert left
    assert (manifest["top_k"], manifest["temperature"], manifest["dropped"]) == (top_k, temperature, gone)
    experts = [RunFolder(root / "one").expert(i).read_checkpoint() for i in range(2)]
    heldout = load_corpus([str(text)], split="heldout")
    ops = get_ops("cpu")

    def nats(router):
        ensemble = Ensemble(tuple((c.theta, Layout(c.model)) for c in experts), router)
        return evaluate_routed_corpus(ensemble, heldout, ops)["overall"]["routed"].nats_per_byte

    assert nats(Router(clustering, top_k, temperature, gone)) == pytest.approx(routed, rel=1e-12)
    assert nats(Router(clustering, 2, temperature)) > routed + 0.3  # the routing a version 1 export described


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "onnx"])
def test_a_run_whose_every_expert_was_dropped_is_not_exported(dropped, tmp_path, fmt):
    root, _ = dropped
    out = tmp_path / "export"
    line = one_line_error(run(["export", root / "all", "--format", fmt, "--out", out]))
    assert "every expert was dropped" in line and not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_dropped_expert_is_named_by_the_torch_export(dropped, tmp_path):
    root, _ = dropped
    line = one_line_error(run(["export", root / "one", "--out", tmp_path / "m.pt"]))
    assert "export one expert" in line and line.endswith("(expert1 dropped: routing leaves it out)")
    for fmt, name in (("torch", "m.pt"), ("onnx", "m.onnx")):  # alone, it is exported, and said to be dropped
        result = run(["export", root / "one" / "expert1", "--format", fmt, "--out", tmp_path / name])
        assert result.exit_code == 0 and "was dropped at step" in result.stderr, result.output


def test_torch_export_to_a_missing_folder_is_one_line(runs, tmp_path):
    out = tmp_path / "no" / "such" / "model.pt"
    line = one_line_error(run(["export", str(runs / "single"), "--out", str(out)]))
    assert line == f"Error: cannot write export {out}: No such file or directory"
    assert not (tmp_path / "no").exists()


@pytest.mark.slow
@pytest.mark.subprocess
def test_torch_export_to_a_read_only_folder_is_one_line(runs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    assert run(["export", str(runs / "single"), "--out", str(seed / "old.pt")]).exit_code == 0
    for name, extra in (("new.pt", []), ("old.pt", ["--force"])):
        root = tmp_path / name
        out = root / "disk" / name
        proc, disk = on_a_read_only_disk(root, zosoma_cmd() + ["export", runs / "single", "--out", out, *extra], seed)
        line = error_line(proc)
        assert line.startswith(f"Error: cannot write export {out}: ")
        assert line.endswith(("Read-only file system", "Permission denied"))
        assert snapshot(disk) == snapshot(seed)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("what", ["torch", "soma onnx"])
def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing(runs, tmp_path, what):
    out = tmp_path / "disk" / "out"
    args = ["--out", out] if what == "torch" else ["--format", "onnx", "--out", out]
    proc, disk = on_a_full_disk(tmp_path, zosoma_cmd() + ["export", runs / ("single" if what == "torch" else "soma"),
                                                          *args], 16 << 10, 16_000)
    line = error_line(proc)
    assert line.startswith(f"Error: cannot write export {out}: " if what == "torch" else
                           f"Error: cannot write ONNX export {out}: ")
    assert line.endswith(("No space left on device", "File too large"))
    assert list(disk.iterdir()) == []  # no temporary file or folder, no half an export
