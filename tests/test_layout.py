"""The package's seams hold: imports point down the layout and no module imports another in a loop,
one place picks the device and no other asks which one it got, no two modules share a name, every
folder is installed, one module knows a run folder's files."""

import ast
import configparser
import fnmatch
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zosoma"
FOUNDATION = {"errors", "config", "corpus", "download", "atomic", "arrays", "version"}
# what each part may import (README "Layout"; each folder's __init__ says the same)
ALLOWED = {
    "foundation": {"foundation"},
    "model": {"foundation", "model"},
    "formats": {"foundation", "model", "formats"},
    "engines": {"foundation", "model", "formats", "engines"},
    "strategies": {"foundation", "model", "strategies"},
    "mixture": {"foundation", "model", "formats", "engines", "mixture"},
    "yardsticks": {"foundation", "model", "mixture", "yardsticks"},  # n-grams and compressors beside models
    # a run's folder, loop and records; the workers and executors on them; single and SOMA runs on both
    "training": {"foundation", "model", "formats", "engines", "strategies", "training"},
    "workers": {"foundation", "model", "formats", "engines", "strategies", "training", "workers"},
    "runs": {"foundation", "model", "formats", "engines", "strategies", "mixture", "yardsticks", "training",
             "workers", "runs"},
    "experiments": {"foundation", "model", "formats", "engines", "strategies", "mixture", "yardsticks", "training",
                    "workers", "runs", "experiments"},
    # the benchmarks sit beside the experiments: the same parts below, neither imports the other
    "benchmarks": {"foundation", "model", "formats", "engines", "strategies", "mixture", "yardsticks", "training",
                   "workers", "runs", "benchmarks"},
    "porting": {"foundation", "model", "formats", "engines", "strategies", "mixture", "training", "workers", "runs",
                "porting"},
    "api": {"foundation", "model", "formats", "engines", "strategies", "mixture", "yardsticks", "training", "workers",
            "runs", "experiments", "api"},
    "cli": {"foundation", "model", "formats", "engines", "strategies", "mixture", "yardsticks", "training", "workers",
            "runs", "experiments", "benchmarks", "porting", "api", "cli"},
}
DEVICE_NAMES = {"cpu", "cuda", "gpu"}  # and "auto" beside a device (Ray has an address "auto")


def part(module: str) -> str:
    """zosoma.model.reference -> "model"; zosoma.config -> "foundation"."""
    name = module.split(".")[1] if module.count(".") else ""
    if name == "__init__":  # zosoma/__init__.py: the package's face, the Python API loaded on first use
        return "api"
    return "foundation" if name in FOUNDATION or name == "" else name


def engine_folder(module: str) -> str | None:
    """zosoma.engines.cuda.cuda_ops -> "cuda"; zosoma.engines.ops (shared by every engine) -> None."""
    parts = module.split(".")
    inside = len(parts) > 2 and parts[1] == "engines" and (PACKAGE / "engines" / parts[2]).is_dir()
    return parts[2] if inside else None


def module_name(path: Path) -> str:
    return "zosoma." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def zosoma_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zosoma"):
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("zosoma"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layout(path):
    here = part(module_name(path))
    bad = [m for m in zosoma_imports(path) if part(m) not in ALLOWED[here]]
    assert not bad, f"{path.relative_to(ROOT)} ({here}) imports {bad}"
    # an engine's folder holds the engine: it uses engines' shared modules, the CPU engine's kernels
    # (every engine is an Ops) and its own files, never another engine's
    folder = engine_folder(module_name(path))
    others = [m for m in zosoma_imports(path) if folder and engine_folder(m) not in (None, "cpu", folder)]
    assert not others, f"{path.relative_to(ROOT)} (engines/{folder}) imports {others}"


def modules() -> dict[str, Path]:
    """Every module by its import name; a package by its own name (zosoma.training is training/__init__.py)."""
    return {module_name(p).removesuffix(".__init__"): p for p in sources()}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports, at the top or inside a function alike (`from zosoma.training.folder
    import RunFolder` is an arrow to zosoma.training.folder; `from zosoma.engines import get_ops` to the
    package zosoma.engines)."""
    known = modules()

    def target(name: str) -> str:
        while name not in known:
            name = name.rsplit(".", 1)[0]
        return name

    return {m: {target(i) for i in zosoma_imports(p)} - {m} for m, p in known.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The sets of nodes that reach each other through the arrows (Tarjan's strongly connected
    components of more than one node)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """No modules of zosoma import each other in a loop, even through imports inside functions: each
    stands above all that it imports, so none runs back up to one above it."""
    assert not circles(import_graph())


def test_the_layers_are_an_order():
    """The parts' allowances are a layering: no two parts may import each other, directly or round
    a loop, so the part check above also keeps every import pointing down."""
    assert not circles({here: below - {here} for here, below in ALLOWED.items()})


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    graph = import_graph()
    assert "zosoma.training.folder" in graph["zosoma.runs.soma"]  # imports inside functions count too:
    assert "zosoma.workers.placement" in graph["zosoma.runs.run"]


def root_imports(path: Path) -> list[str]:
    """Imports of the package root itself: `import zosoma`, `from zosoma import x`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "zosoma" and not node.level:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Import) and any(a.name == "zosoma" for a in node.names):
            found.append(ast.unparse(node))
    return found


def test_no_module_reaches_up_to_the_package_root():
    """zosoma/__init__.py sits above every module (it re-exports the API and the version), so no
    module inside the package, the command line included, imports it: the version is zosoma.version."""
    offenders = {str(p.relative_to(ROOT)): found for p in sources()
                 if p != PACKAGE / "__init__.py" and (found := root_imports(p))}
    assert not offenders, offenders


def test_the_version_is_foundation():
    assert part("zosoma.version") == "foundation"
    assert root_imports(PACKAGE / "version.py") == [] and not list(zosoma_imports(PACKAGE / "version.py"))


def test_the_benchmarks_have_their_own_folder():
    """Speed figures live in zosoma/benchmarks/, and nothing in the library (but the CLI) uses them."""
    assert not list((PACKAGE / "experiments").glob("bench_*.py"))
    users = [str(p.relative_to(ROOT)) for p in sources() if part(module_name(p)) not in ("benchmarks", "cli")
             and any(part(m) == "benchmarks" for m in zosoma_imports(p))]
    assert not users, users


def test_the_device_is_chosen_in_one_place():
    """Only zosoma.engines.get_ops makes the CUDA engine."""
    makers = [str(p.relative_to(ROOT)) for p in sources() if re.search(r"(?<!class )\bCudaOps\(", p.read_text())]
    assert makers == ["zosoma/engines/__init__.py"]


def _strings(node):
    """The string constants a comparison operand stands for ("cpu", or ("cpu", "auto"))."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _strings(e)


def _device_name(value: str) -> bool:
    return value in DEVICE_NAMES or value.startswith("cpu-")  # "cpu-bf16": an engine's label


def _engine_name(node) -> bool:
    """ops.name, self.ops.name, trainer.ops.name: the label of an engine."""
    return isinstance(node, ast.Attribute) and node.attr == "name" and "ops" in ast.unparse(node.value).lower()


def _auto_device(operands) -> bool:
    """A device compared with "auto" (--device auto)."""
    return any(v == "auto" for o in operands for v in _strings(o)) and any("device" in ast.unparse(o) for o in operands)


def device_branches(source: str) -> list[str]:
    """Every place that asks which device or engine it has by name: comparisons (==, !=, in, is)
    with a device name or with an engine's .name, startswith/endswith on one, dicts keyed by one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_device_name(v) for o in operands for v in _strings(o)) or any(map(_engine_name, operands)) \
                    or _auto_device(operands):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith") \
                and (any(_device_name(v) for a in node.args for v in _strings(a)) or _engine_name(node.func.value)):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Dict) and any(_device_name(v) for k in node.keys if k for v in _strings(k)):
            found.append(ast.unparse(node)[:60])
        elif isinstance(node, ast.MatchValue) and any(_device_name(v) for v in _strings(node.value)):
            found.append(ast.unparse(node))
    return found


def test_no_device_branches_outside_the_engines():
    """Code outside zosoma/engines/ never asks which device or engine it got by name: it asks the
    engine (ops.on_device, ops.precision); only get_ops turns names into engines."""
    engines = PACKAGE / "engines"
    offenders = {str(p.relative_to(ROOT)): found for p in sources()
                 if engines not in p.parents and (found := device_branches(p.read_text()))}
    assert not offenders, offenders


@pytest.mark.parametrize("spelling", [
    'device == "cuda"', 'device != "cpu"', '"cpu" == device', 'device in ("cpu", "auto")', 'device == "auto"',
    'ops.name != "cpu"', 'trainer.ops.name == other', 'self.ops.name in names', 'ops.name.startswith("cpu")',
    'device.startswith("cuda")', 'x = {"cpu": 1, "cuda": 8}[device]', 'name == "cpu-bf16"',
    'match device:\n    case "cuda":\n        pass'])
def test_the_device_branch_check_sees_every_spelling(spelling):
    assert device_branches(spelling)


def test_the_device_branch_check_passes_plain_code():
    assert not device_branches('ops = get_ops("cpu")\nif ops.on_device:\n    pass\n'
                               'method.name in methods\nr.get("device", "cpu")\nfmt == "fp32"\n'
                               'address not in ("auto", "local")')


def test_no_two_modules_share_a_name():
    """A file name says what the module is: no two modules, and no module and folder, share one
    (the command line's modules are named after their commands: zosoma/cli/train.py is `zosoma train`)."""
    commands = PACKAGE / "cli"
    names = [p.stem for p in sources() if p.name != "__init__.py" and p.parent != commands]
    names += [p.parent.name for p in sources() if p.name == "__init__.py" and p.parent != PACKAGE]
    assert not [name for name, n in Counter(names).items() if n > 1]


def test_every_folder_and_data_file_is_installed():
    """setup.cfg lists every package folder and a package_data pattern for every other file, so an
    install (not only a checkout) holds the whole library."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    folders = {module_name(p.parent / "x")[:-2] for p in sources() if p.name == "__init__.py"} - {"zosoma."}
    missing = sorted(f for f in folders if f not in listed)
    assert not missing, f"setup.cfg [options] packages lacks {missing}"
    data = {k: [g.strip() for g in v.split(",")] for k, v in cfg["options.package_data"].items()}
    unlisted = []
    for p in PACKAGE.rglob("*"):
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts:
            owner = next(q for q in p.parents if (q / "__init__.py").exists())
            package, rel = module_name(owner / "x")[:-2], str(p.relative_to(owner))
            if not any(fnmatch.fnmatch(rel, g) for g in data.get(package, [])):
                unlisted.append(str(p.relative_to(ROOT)))
    assert not unlisted, f"setup.cfg [options.package_data] lacks {unlisted}"


def test_run_folder_files_are_named_in_one_module():
    names = re.compile(r"""["'](checkpoint(\.prev|\.next)?\.h5|soma\.json|router\.h5|metrics\.jsonl|"""
                       r"""results?\.json|curve\.jsonl|settings\.json)["']""")
    found = [str(p.relative_to(ROOT)) for p in sources() if names.search(p.read_text())]
    assert found == ["zosoma/training/folder.py"]


def drawing() -> str:
    """The parts of zosoma by floor, top down, each with the parts it imports, as
    docs/architecture.md draws them: a part stands one floor above the highest it imports."""
    arrows: dict[str, set[str]] = {}
    for path in sources():
        here = part(module_name(path))
        arrows.setdefault(here, set()).update(part(m) for m in zosoma_imports(path))
    arrows = {p: below - {p} for p, below in arrows.items()}
    floors: dict[str, int] = {}

    def floor(p: str) -> int:
        if p not in floors:
            floors[p] = 1 + max((floor(q) for q in arrows.get(p, ())), default=0)
        return floors[p]

    def order(parts):
        return sorted(parts, key=lambda p: (-floor(p), p))

    rows = [textwrap.fill(", ".join(order(arrows[p])) or "-", 100, initial_indent=f"{floor(p):>5}  {p:<12} ",
                          subsequent_indent=" " * 20) for p in order(arrows)]
    return "\n".join(["floor  part         imports (straight, highest first)", *rows]) + "\n"


def test_the_architecture_drawing_is_the_import_graph():
    """docs/architecture.md draws the parts by floor from the code's own imports; a new arrow
    between parts is drawn there too (the message prints the drawing as the code has it now)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"<!-- the import graph \(tests/test_layout.py: drawing\) -->\n```\n(.*?)```", text, re.S)
    assert found and found.group(1) == drawing(), f"docs/architecture.md should draw, under its Layout:\n{drawing()}"
