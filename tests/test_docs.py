"""The documentation holds: the site builds with --strict (a broken link, anchor or page left out of
the nav fails it), its command reference is the commands' own, and the README stays a short page
whose links all resolve."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def command_names(group, prefix=()):
    """Every command of the click application, as its path: ("train",), ("bench", "forward"), ..."""
    for name, command in group.commands.items():
        yield prefix + (name,)
        if hasattr(command, "commands"):
            yield from command_names(command, prefix + (name,))


@pytest.mark.subprocess
def test_the_site_builds_strictly_with_every_command_in_its_reference(tmp_path):
    # The console script, not `python -m mkdocs`: that would put the checkout first on sys.path,
    # where zosoma.data does not exist (it is mapped from data/ at install time).
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (pip install '.[test]')")
    site = tmp_path / "site"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    from zosoma.cli.main import cli
    page = (site / "cli" / "index.html").read_text()
    headings = set(re.findall(r"<h\d id=\"[^\"]*\">([\w-]+)<", page))
    names = list(command_names(cli))
    assert {"train", "eval", "compare", "porting-kit", "forward"} <= {n[-1] for n in names}
    missing = [" ".join(n) for n in names if n[-1] not in headings or f"zosoma {' '.join(n)} [OPTIONS]" not in page]
    assert not missing, f"the CLI reference lacks {missing}"
    assert "--forward-precision" in page and "--on-divergence" in page  # options come from the commands
    # A figure's link to its source in results/ reaches the file in the built site.
    assert (site / "results" / "cpu" / "results.md").is_file() and 'href="../results/cpu/results.md"' in (
        site / "comparison" / "index.html").read_text()
    assert (site / "PORTING" / "index.html").is_file()


def relative_links(text: str):
    """The targets of a Markdown text's links and images that are not URLs or in-page anchors."""
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_short_and_every_link_in_it_resolves():
    text = README.read_text()
    assert len(text.splitlines()) <= 260, "README.md is the front page: move the detail to docs/"
    links = list(relative_links(text))
    assert "docs/usage.md" in links and "docs/trust.md" in links
    broken = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"
    anchors = [t.split("#")[1] for t in re.findall(r"\]\((#[^)\s]+)\)", text)]
    assert set(anchors) <= heading_anchors(text), f"README.md links to missing headings: {anchors}"
    for target in (t for t in links if ".md#" in t):
        path, anchor = target.split("#")
        assert anchor in heading_anchors((ROOT / path).read_text()), f"README.md: {target} has no such heading"


def test_the_readme_starts_with_the_two_commands():
    """The first two code blocks are the commands the README promises, the training and the tests."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip() == "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/zosoma train --experts 4"
    assert blocks[1].strip() == "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/pytest -q"
