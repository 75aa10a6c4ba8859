"""The porting kit: the vectors a port of zosoma to other hardware must reproduce, stage by stage.

`write_kit(out)` writes (the specification of every stage is PORTING.md at the repository root):

    OUT/manifest.json     format "zosoma-porting-kit" v2; the model's layout; per stage its file,
                          what it checks, its settings, its inputs (each with a line saying what
                          it is) and its outputs, each with its tolerance, why, what it is computed
                          from, and the hint printed when it fails
    OUT/<stage>.npz       each stage's inputs and reference outputs (STAGES below)
    OUT/misreadings.npz   outputs as plausible wrong readings of the specification compute them:
                          the checker names the reading a failing output matches
    OUT/model.onnx        the kit's model as the standard-LSTM ONNX graph (zosoma.formats.onnx)
    OUT/train_model.onnx  the training graph, theta an input (both graphs need the onnx package:
                          without it they are skipped, and the manifest's "skipped" says so)
    OUT/default_run_batches.npz   the default run's batch indices (kit_files)
    OUT/README.md         what the kit is, how to check a port, its files and stages
    OUT/check_port.py     the standalone checker (plain NumPy): python check_port.py OUT PORT/

The manifest's "files" lists these, the files zosoma owns in OUT: `--force` replaces them and
leaves anything else in OUT alone.

Reference values are float64 (or exact integers), so every tolerance measures only what a float32
port may differ by. Every output is computed from the stage's inputs, or from the kit's own
values of other outputs (its "from" list says which), so errors never compound from one check
into the next: the update is checked from the kit's scalars, step t of the low-precision
forward from the kit's state of step t-1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zosoma.atomic import atomic_path, atomic_write
from zosoma.config import VOCAB, ModelConfig
from zosoma.errors import OptionError
from zosoma.version import __version__
from zosoma.porting import (kit_activity, kit_activity_run, kit_approx, kit_data, kit_default_run, kit_files, kit_loop,
                            kit_model, kit_precision, kit_router, kit_run, kit_training)
from zosoma.porting.output_folder import MANIFEST, output_folder
from zosoma.porting.stage import TOL, Stage
from zosoma.training.folder import refuse_run_files

KIT_FORMAT, KIT_VERSION = "zosoma-porting-kit", 2
CHECKER = Path(__file__).with_name("check_port.py")
MISREADINGS = "misreadings.npz"
SAMPLE = 4096  # a misreading of a larger output is stored (and compared) at every stride-th value
# The kit holds some 60 vectors of d values and computes float64 references over them (about 150
# bytes of files per parameter): a model past this is no kit anyone can run, and would exhaust memory.
MAX_PARAMETERS = 1_000_000

# The stages in the order a port is best written in; each one's file is <name>.npz.
STAGES = ("forward", "losses", "noise", "init", "batches", "schedule", "spsa_step", "onesided_step",
          "activity_onesided_step", "momentum", "adam", "es", "eggroll", "train", "train_normalize", "shaping",
          "restart", "router", "routed", "bf16", "fp16", "int8", "approx", "run", "run_onesided", "run_restart",
          "run_activity")


def build_stages(config: ModelConfig, seed: int) -> list[Stage]:
    """Every stage's vectors for the kit's model (zosoma.porting.kit_model.kit_model)."""
    theta, layout = kit_model.kit_model(config, seed)
    rng = np.random.default_rng([seed, 0x9017])
    built = {"forward": kit_model.forward_stage(theta, layout, rng),
             "losses": kit_model.loss_stage(theta, layout, rng),
             "noise": kit_model.noise_stage(),
             "spsa_step": kit_training.spsa_stage(theta, layout, rng),
             "router": kit_router.router_stage(seed)}
    rng = np.random.default_rng([seed, 0x9018])  # the stages added in format 2
    built.update({
        "init": kit_data.init_stage(config, seed),
        "batches": kit_data.batch_stage(seed),
        "schedule": kit_data.schedule_stage(),
        "momentum": kit_training.momentum_stage(theta, rng),
        "adam": kit_training.adam_stage(theta, rng),
        "es": kit_training.es_stage(theta, layout, rng),
        "eggroll": kit_training.eggroll_stage(theta, layout, rng),
        "train": kit_loop.train_stage(theta, layout, seed),
        "train_normalize": kit_loop.train_stage(theta, layout, seed, "normalize"),
        "shaping": kit_loop.shaping_stage(rng),
        "restart": kit_loop.restart_stage(seed),
        "bf16": kit_precision.float_stage("bf16", theta, layout, rng),
        "fp16": kit_precision.float_stage("fp16", theta, layout, rng),
        "int8": kit_precision.int8_stage(theta, layout, rng),
        "routed": kit_run.routed_stage(seed),  # the whole-run stages (kit_run)
        "run": kit_run.run_stage(),
    })
    # its own generator, so that adding it left every other stage's vectors as they were
    built["onesided_step"] = kit_training.onesided_stage(theta, layout, np.random.default_rng([seed, 0x9019]))
    built["approx"] = kit_approx.approx_stage(theta, layout, np.random.default_rng([seed, 0x901A]))
    built["activity_onesided_step"] = kit_activity.activity_onesided_stage(theta, layout,
                                                                           np.random.default_rng([seed, 0x901B]))
    # one-sided SPSA's default run and its restart (kit_default_run): no generator, stored reference figures
    built["run_onesided"] = kit_default_run.onesided_stage()
    built["run_restart"] = kit_default_run.restart_stage()
    built["run_activity"] = kit_activity_run.activity_stage()  # activity perturbation's (kit_activity_run)
    return [built[name] for name in STAGES]


def _settings(stage: Stage) -> dict:
    return {k: {"value": v, "what": what} for k, (v, what) in stage.settings.items()}


def stage_manifest(stage: Stage) -> tuple[dict, dict]:
    """(the stage's manifest entry, its misreadings' arrays keyed "<stage>.<output>.<i>")."""
    tol = {**TOL, **stage.tol}
    arrays, readings = {}, {}
    for output, found in stage.misreadings.items():
        readings[output] = []
        for i, (what, values, *linear) in enumerate(found):
            key = f"{stage.name}.{output}.{i}"
            values = np.asarray(values)
            n = values.shape[-1] if linear else values.size
            stride = -(-n // SAMPLE) if n > SAMPLE else 1
            arrays[key] = values[..., ::stride] if linear else values.ravel()[::stride] if stride > 1 else values
            readings[output].append({"array": key, "reading": what, "stride": stride})
            if linear:  # values is a matrix M: the output would be kit + factor (port's - kit's input) @ M
                readings[output][-1].update(linear_in=linear[0], factor=linear[1])
    entry = {"name": stage.name, "file": f"{stage.name}.npz", "what": stage.what, "settings": _settings(stage),
             "inputs": {k: what for k, (_, what) in stage.inputs.items()},
             "outputs": {k: o.manifest(tol) for k, o in stage.outputs.items()}, "misreadings": readings}
    if stage.optional:
        entry["optional"] = stage.optional
    return entry, arrays


def write_kit(out, config: ModelConfig = ModelConfig(embed=16, hidden=32, layers=2), seed: int = 0,
              force: bool = False) -> Path:
    """Write the kit into folder `out`: a new one, or with force one where the kit's files replace
    those an earlier kit wrote (zosoma.porting.output_folder; other files are left alone). Returns
    the manifest's path."""
    out = Path(out)
    check_options(config, seed)
    refuse_run_files(out, "porting kit")
    graphs, skipped = kit_files.graph_files(), kit_files.onnx_missing()
    files = sorted([f"{name}.npz" for name in STAGES] + graphs + [MISREADINGS, CHECKER.name, MANIFEST,
                                                                 kit_files.BATCHES, kit_files.README])
    with output_folder(out, files, KIT_FORMAT, force, "porting kit") as tmp:
        stages = build_stages(config, seed)
        entries, misread = [], {}
        for stage in stages:
            entry, arrays = stage_manifest(stage)
            entries.append(entry)
            misread.update(arrays)
            _save(tmp / entry["file"], {**stage.arrays(), **{k: np.asarray(v) for k, (v, _) in stage.settings.items()}})
        _save(tmp / MISREADINGS, misread)
        theta, layout = kit_model.kit_model(config, seed)
        graph_entry = kit_files.write_graphs(tmp, theta, layout)
        batches = kit_files.write_batches(tmp, _save)
        atomic_write(tmp / CHECKER.name, CHECKER.read_bytes(), "porting kit")
        manifest = {"format": KIT_FORMAT, "format_version": KIT_VERSION, "zosoma_version": __version__,
                    "spec": "PORTING.md in the zosoma repository", "seed": seed,
                    "model": {"embed": config.embed, "hidden": config.hidden, "layers": config.layers,
                              "vocab": VOCAB, "parameters": layout.size,
                              "layout": [[e.name, list(e.shape), e.offset] for e in layout.entries],
                              "weights": "init(seed, expert 0) x 2 (the init stage's generator)"},
                    "tolerance": "|port - kit| <= atol + rtol * |kit| elementwise; integers within atol (0: "
                                 "exactly); with ulps, at most that many values of the format apart; the kit's "
                                 "NaN and inf matched exactly",
                    "stages": entries, "misreadings": MISREADINGS, "graphs": graph_entry,
                    "default_run_batches": batches, "files": files}
        if skipped:
            manifest["skipped"] = [f"{', '.join(graph_entry)}: {skipped}"]
        atomic_write(tmp / kit_files.README, kit_files.readme(manifest), "porting kit")
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2), "porting kit")
    return out / MANIFEST


def check_options(config: ModelConfig, seed: int) -> None:
    """Refuse (OptionError, one line) a kit seed outside [0, 2^63) or a model too large for a kit."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise OptionError(f"--seed must be an integer in [0, 2^63), got {seed!r}")
    E, H, L = config.embed, config.hidden, config.layers
    d = VOCAB * E + 4 * H * (E + H + 1) + (L - 1) * 4 * H * (2 * H + 1) + H * VOCAB + VOCAB  # n_params, closed form
    if d > MAX_PARAMETERS:
        raise OptionError(f"the kit's model (E={config.embed} H={config.hidden} L={config.layers}) has {d:,} "
                          f"parameters; a kit takes at most {MAX_PARAMETERS:,} (its vectors are some 150 bytes "
                          "per parameter): lower --hidden, --embed or --layers")


def _save(path: Path, arrays: dict) -> None:
    with atomic_path(path, "porting kit") as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
