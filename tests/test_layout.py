"""The package's seams hold: imports point down the layout, one place picks the device, one module
knows a run folder's files."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zosoma"
FOUNDATION = {"errors", "config", "corpus", "download", "atomic", "arrays"}
# what each part may import (README "Layout"; each folder's __init__ says the same)
ALLOWED = {
    "foundation": {"foundation"},
    "model": {"foundation", "model"},
    "formats": {"foundation", "model", "formats"},
    "engines": {"foundation", "model", "formats", "engines"},
    "strategies": {"foundation", "model", "strategies"},
    "soma": {"foundation", "model", "formats", "engines", "soma"},
    "runs": {"foundation", "model", "formats", "engines", "strategies", "soma", "runs"},
    "experiments": {"foundation", "model", "formats", "engines", "strategies", "soma", "runs", "experiments"},
    "porting": {"foundation", "model", "formats", "engines", "strategies", "soma", "runs", "porting"},
}


def part(module: str) -> str:
    """zosoma.model.forward -> "model"; zosoma.config -> "foundation"."""
    name = module.split(".")[1] if module.count(".") else ""
    return "foundation" if name in FOUNDATION or name == "" else name


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def zosoma_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zosoma"):
            if node.module == "zosoma":
                yield from (f"zosoma.{a.name}" for a in node.names if a.name != "__version__")
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("zosoma"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layout(path):
    here = part("zosoma." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    bad = [m for m in zosoma_imports(path) if part(m) not in ALLOWED[here]]
    assert not bad, f"{path.relative_to(ROOT)} ({here}) imports {bad}"


def test_the_device_is_chosen_in_one_place():
    """Only zosoma.engines.get_ops makes the CUDA engine; nothing else compares device names."""
    makers = [str(p.relative_to(ROOT)) for p in sources() if "CudaOps()" in p.read_text()]
    assert makers == ["zosoma/engines/__init__.py"]
    for p in sources() + [ROOT / "cli" / "main.py"]:
        assert not re.search(r"""==\s*["']cuda["']""", p.read_text()), p


def test_run_folder_files_are_named_in_one_module():
    names = re.compile(r"""["'](checkpoint(\.prev|\.next)?\.h5|soma\.json|router\.h5|metrics\.jsonl|"""
                       r"""results?\.json|curve\.jsonl|settings\.json)["']""")
    found = [str(p.relative_to(ROOT)) for p in sources() + sorted((ROOT / "cli").glob("*.py"))
             if names.search(p.read_text())]
    assert found == ["zosoma/runs/folder.py"]
