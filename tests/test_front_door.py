"""One front door (zosoma.runs.run): the command line and the Python API refuse the same inputs
with the same one-line message, before any run folder is made, and a run opened either way
answers the same calls."""

import dataclasses
import math
from pathlib import Path

import pytest

import zosoma
from helpers import one_line_error, run_cli
from zosoma.config import ModelConfig, TrainConfig
from zosoma.errors import ConfigError, DataError
from zosoma.model.protocol import PROTOCOL, EvalProtocol
from zosoma.workers.placement import RAY_ONLY, Placement
from zosoma.training.shape import DataPaths, SomaShape
from zosoma.runs.run import SOMA_OPTIONS, Spec

pytestmark = pytest.mark.usefixtures("scratch_cwd")

OLD = "old-run"  # a --resume folder: the clashes are refused before it is read
SOMA_ONLY = "is an option of SOMA (--experts 2 or more)"
RESUME = "--resume takes its configuration from the checkpoint; drop {} (--steps extends the run, --wikitext " \
         "replaces its WikiText-103 file)"

# (command-line options, the same as zosoma.train's arguments, the one-line message, its exit code)
REFUSALS = [
    (["--steps", "5", "--top-k", "3"], dict(steps=5, top_k=3), f"--top-k {SOMA_ONLY}", 2),
    (["--steps", "5", "--loss", "summed"], dict(steps=5, loss="summed"), f"--loss {SOMA_ONLY}", 2),
    (["--steps", "5", "--chunk-size", "256"], dict(steps=5, chunk_size=256), f"--chunk-size {SOMA_ONLY}", 2),
    (["--steps", "5", "--experts", "2", "--top-k", "3"], dict(steps=5, experts=2, top_k=3),
     "top-k 3 exceeds the 2 experts", 2),
    (["--steps", "5", "--experts", "2", "--top-k", "0"], dict(steps=5, experts=2, top_k=0),
     "top_k must be at least 1, got 0", 2),
    (["--steps", "5", "--experts", "0"], dict(steps=5, experts=0), "experts must be at least 1, got 0", 2),
    (["--steps", "5", "--experts", "-1"], dict(steps=5, experts=-1), "experts must be at least 1, got -1", 2),
    (["--steps", "5", "--experts", "two"], dict(steps=5, experts="two"), "experts must be an integer, got 'two'", 2),
    (["--steps", "2.5"], dict(steps=2.5), "steps must be an integer, got 2.5", 2),
    (["--steps", "0"], dict(steps=0), "steps must be at least 1, got 0", 2),
    (["--steps", "1000000000000"], dict(steps=10**12), "steps must be at most 4,294,967,295 (a step is a 32-bit "
     "word of the noise counters), got 1,000,000,000,000", 2),
    (["--steps", "5", "--eps", "1e-320"], dict(steps=5, eps=1e-320), "eps must be at least 1e-45, got 9.99989e-321 "
     "(0 in float32, the parameters' precision: every member would equal theta)", 2),
    (["--steps", "5", "--lr", "1e308"], dict(steps=5, lr=1e308),
     "lr must be at most 3.4e38 (float32's largest, the parameters' precision), got 1e+308", 2),
    (["--steps", "5", "--weight-decay", "1e308"], dict(steps=5, weight_decay=1e308),
     "weight_decay must be at most 3.4e38 (float32's largest, the parameters' precision), got 1e+308", 2),
    (["--steps", "5", "--restart-lr-factor", "5"], dict(steps=5, restart_lr_factor=5.0),
     "restart_lr_factor must lie in (0, 1], got 5.0", 2),
    (["--steps", "5", "--experts", "1000"], dict(steps=5, experts=1000),
     "cannot make 1000 clusters from 7 chunks of 2048 bytes: use at most 7 --experts, or a smaller --chunk-size", 2),
    (["--steps", "5", "--preset", "huge"], dict(steps=5, preset="huge"),
     "preset must be one of tiny, small, paper, got 'huge'", 2),
    (["--resume", OLD, "--lr", "0.1"], dict(resume=OLD, lr=0.1), RESUME.format("--lr"), 2),
    (["--resume", OLD, "--experts", "2", "--top-k", "2"], dict(resume=OLD, experts=2, top_k=2),
     RESUME.format("--experts, --top-k"), 2),
]


@pytest.mark.parametrize("args, kwargs, message, code", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_the_cli_and_the_api_refuse_the_same_inputs_in_the_same_words(text, args, kwargs, message, code):
    data = {} if "resume" in kwargs else {"data": text}  # a resume takes its data from the run
    assert one_line_error(run_cli(["train", *(f"--{k}={v}" for k, v in data.items()), *args]), code) == f"Error: {message}"
    assert nothing_made()
    with pytest.raises(ConfigError) as refused:
        zosoma.train(**data, **kwargs)
    assert str(refused.value) == message
    assert nothing_made()


# Bad values of each kind of field: (as typed on the command line, as given to the API)
BAD = {"int": [("-1", -1), ("2.5", 2.5), ("x", "x")], "float": [("-1", -1), ("nan", math.nan), ("x", "x")],
       "str": [("bogus", "bogus")], "str | None": [("bogus", "bogus")], "tuple": [("bogus", ("bogus",))]}


def run_fields() -> list:
    """Every field of a run's description (Spec), its model's and its training's configuration
    within: a field added to any of them is covered here without editing this test."""
    nested = {"ModelConfig": ModelConfig, "TrainConfig": TrainConfig}
    return [g for f in dataclasses.fields(Spec)
            for g in (dataclasses.fields(nested[f.type]) if f.type in nested else [f])]


FIELD_CASES = [(f.name, typed, value) for f in run_fields() for typed, value in BAD[f.type]]


@pytest.mark.parametrize("name, typed, value", FIELD_CASES, ids=[f"{n}={t}" for n, t, _ in FIELD_CASES])
def test_every_run_option_is_refused_by_the_library_in_the_same_words(text, name, typed, value):
    """Each field of the configuration, given a bad value: `zosoma train --NAME VALUE` exits 2 with
    the very line zosoma.train(NAME=VALUE) raises, which names the option; no folder is made."""
    soma = ["--experts", "2"] if name in SOMA_OPTIONS else []
    option = "--" + name.replace("_", "-")
    line = one_line_error(run_cli(["train", "--data", text, *soma, f"{option}={typed}"]), 2)
    with pytest.raises(ConfigError) as refused:
        zosoma.train(data=text, **({"experts": 2} if soma else {}), **{name: value})
    assert line == f"Error: {refused.value}"
    assert name in str(refused.value) or option in str(refused.value), refused.value
    assert nothing_made()


PLACEMENT_BAD = {**BAD, "int | None": BAD["int"]}
ANY_TEXT = {"address"}  # every text is a value: only the API can give it a bad one (a number)


def placement_cases() -> list:
    """(field, its flag, typed, value) for each field of Placement (where a run's work goes)."""
    flags = {"executor": "--executor"}  # the rest are --NAME
    return [(f.name, flags.get(f.name, "--" + f.name.replace("_", "-")), typed, value)
            for f in dataclasses.fields(Placement) if f.name not in ANY_TEXT for typed, value in PLACEMENT_BAD[f.type]]


PLACEMENT_CASES = placement_cases()


@pytest.mark.parametrize("name, flag, typed, value", PLACEMENT_CASES, ids=[f"{c[0]}={c[2]}" for c in PLACEMENT_CASES])
def test_every_placement_option_is_refused_by_the_library_in_the_same_words(text, name, flag, typed, value):
    """`zosoma train --NAME VALUE` exits 2 with the line Placement(NAME=VALUE) raises (the Ray
    options with --executor ray, the workers of SOMA's experts with --experts 2)."""
    ray = {"executor": "ray"} if name in RAY_ONLY else {}
    soma = ["--experts", "2"] if name == "workers" else []
    line = one_line_error(run_cli(["train", "--data", text, *soma, *(f"--{k}={v}" for k, v in ray.items()),
                                   f"{flag}={typed}"]), 2)
    with pytest.raises(ConfigError) as refused:
        Placement(**ray, **{name: value})
    assert line == f"Error: {refused.value}"
    assert name in str(refused.value), refused.value
    assert nothing_made()


@pytest.fixture(scope="module")
def runs(text, tmp_path_factory):
    """A single model's run folder and a SOMA run's of two experts, a step each."""
    root = tmp_path_factory.mktemp("runs")
    small = dict(data=text, heldout=text, embed=8, hidden=16, batch=4, seq_len=16, perturbations=2, steps=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("ZOSOMA_WIKITEXT103", raising=False)  # scored on the small text alone
        return {"single": zosoma.train(run_dir=root / "single", **small).path,
                "soma": zosoma.train(run_dir=root / "soma", experts=2, chunk_size=256, **small).path}


def use_options() -> list:
    """(command, the API's method, option name, flag) for every option of `zosoma eval` and
    `zosoma sample` that says how to score or sample (not where from, to or on what device and GEMM format)."""
    from zosoma.cli.evaluate import eval_
    from zosoma.cli.sample import sample
    where = {"checkpoint", "run", "data", "wikitext", "prompt", "previous", "device", "gemm", "as_json", "help"}
    return [(command.name, method, p.name, p.opts[0]) for command, method in ((eval_, "evaluate"), (sample, "sample"))
            for p in command.params if p.name not in where]


USE_CASES = [(kind, *option, typed, value) for kind in ("single", "soma") for option in use_options()
             for typed, value in (("-1", -1), ("x", "x"))]


@pytest.mark.parametrize("kind, command, method, name, flag, typed, value", USE_CASES,
                         ids=[f"{c[0]}-{c[1]}{c[4]}={c[5]}" for c in USE_CASES])
def test_eval_and_sample_options_are_refused_by_the_run_in_the_same_words(runs, kind, command, method, name, flag,
                                                                          typed, value):
    """Each option of eval and sample, given a bad value (or given to the kind of run that does
    not read it): the command exits 2 with the very line that zosoma.RunHandle's method raises."""
    line = one_line_error(run_cli([command, runs[kind], f"{flag}={typed}"]), 2)
    with pytest.raises(ConfigError) as refused:
        getattr(zosoma.open_run(runs[kind]), method)(**{name: value})
    assert line == f"Error: {refused.value}"
    assert name in str(refused.value) or flag in str(refused.value), refused.value


def test_the_api_resume_refuses_any_key_but_steps_and_wikitext_by_name(runs):
    for given in (dict(lr=0.1), dict(experts=1), dict(preset="tiny"), dict(data="a.txt"), dict(bogus=None)):
        (name, _), = given.items()
        with pytest.raises(ConfigError) as refused:
            zosoma.train(resume=runs["single"], steps=2, **given)
        assert str(refused.value) == RESUME.format("--" + name.replace("_", "-"))


@pytest.mark.parametrize("typed, value", BAD["int"], ids=[t for t, _ in BAD["int"]])
def test_a_resume_refuses_bad_steps_in_the_same_words(runs, typed, value):
    line = one_line_error(run_cli(["train", "--resume", runs["single"], f"--steps={typed}"]), 2)
    with pytest.raises(ConfigError) as refused:
        zosoma.train(resume=runs["single"], steps=value)
    assert line == f"Error: {refused.value}"
    assert "steps" in line


@pytest.mark.parametrize("option", ["run_dir", "resume"])
def test_a_file_where_the_run_folder_goes_is_refused_in_the_same_words(text, option):
    Path("a-file").write_text("mine")
    data = {} if option == "resume" else {"data": text}
    line = one_line_error(run_cli(["train", *(f"--{k}={v}" for k, v in data.items()), "--steps", "1",
                                   f"--{option.replace('_', '-')}", "a-file"]), 1)
    with pytest.raises(ConfigError) as refused:
        zosoma.train(**data, steps=1, **{option: "a-file"})
    assert line == f"Error: {refused.value}" == "Error: a-file exists and is not a folder"
    assert Path("a-file").read_text() == "mine"


def test_a_start_that_fails_after_naming_its_folder_takes_it_back(text):
    """The data is read once the run's folder is named: a missing file leaves no folder behind."""
    missing = str(Path(text).parent / "missing.txt")
    line = one_line_error(run_cli(["train", "--data", missing, "--steps", "5"]), 1)
    assert nothing_made()
    with pytest.raises(DataError) as failed:
        zosoma.train(data=missing, steps=5)
    assert line == f"Error: {failed.value}"
    assert nothing_made()


def nothing_made() -> bool:
    """No run folder in runs/ (the default) was left behind."""
    return not Path("runs").exists() or list(Path("runs").iterdir()) == []


def test_the_records_read_and_write_what_run_folders_hold():
    assert EvalProtocol.from_json(PROTOCOL.to_json()) == PROTOCOL == EvalProtocol(256, 512, 2)
    with pytest.raises(ConfigError, match="segment must be at least 1, got 0"):
        EvalProtocol(segment=0)
    data = {"train": ["/a.txt"], "heldout": [], "wikitext": None, "fingerprint": "ab"}
    assert DataPaths.from_json(data).to_json() == data
    soma = {"experts": 2, "loss": "independent", "chunk_size": 128, "top_k": 2, "data": data,
            "cluster_sizes": [3, 1], "assignments": [0, 0, 1, 0]}
    assert SomaShape.from_json(soma).to_json() == soma
    assert SomaShape.from_json({**soma, "steps": 9}).to_json() == {**soma, "steps": 9}
    with pytest.raises(ConfigError, match="not a SOMA run's description"):
        SomaShape.from_json({k: v for k, v in soma.items() if k != "loss"})


def test_the_api_resumes_a_run_as_train_resume_does(text, tmp_path):
    """zosoma.train(resume=RUN, steps=N) goes on from the checkpoint, bit for bit the run that was
    never stopped (a constant schedule: an extended cosine is laid out again)."""
    from zosoma.training.folder import RunFolder
    small = dict(data=text, heldout=text, embed=8, hidden=16, batch=4, seq_len=16, perturbations=2, lr=0.05,
                 schedule="constant", checkpoint_every=1)
    whole = zosoma.train(steps=4, run_dir=tmp_path / "whole", **small)
    zosoma.train(steps=2, run_dir=tmp_path / "part", **small)
    resumed = zosoma.train(resume=tmp_path / "part", steps=4)
    assert resumed.checkpoint_steps == whole.checkpoint_steps == [4]
    theta = [RunFolder(r.path).read_checkpoint().theta for r in (resumed, whole)]
    assert theta[0].tobytes() == theta[1].tobytes()
    assert resumed.results["heldout"] == whole.results["heldout"]


def test_a_start_on_data_alone_and_a_resume_say_what_they_do(text, tmp_path):
    """--data without --heldout never said there is no held-out evaluation; a resume never said
    where it continues."""
    args = ["train", "--data", text, "--embed", "8", "--hidden", "16", "--batch", "4", "--seq-len", "16", "-P", "2",
            "--checkpoint-every", "1", "--quiet"]
    started = run_cli(args + ["--steps", "3", "--run-dir", tmp_path / "run"])
    assert started.exit_code == 0 and "warning: --data without --heldout: there is no held-out evaluation" \
        in started.output
    resumed = run_cli(["train", "--resume", tmp_path / "run", "--steps", "5", "--quiet"])
    assert resumed.exit_code == 0 and "continuing at step 3 of 5\n" in resumed.output
    held = run_cli(args + ["--heldout", text, "--steps", "1", "--run-dir", tmp_path / "held"])
    assert held.exit_code == 0 and "no held-out evaluation" not in held.output
