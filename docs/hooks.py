"""MkDocs hooks: the pages link the repository's own files as a reader on GitHub follows them
(../results/cpu/results.md, ../PORTING.md); the site carries those files at the same paths from
its root, so the links resolve there too and --strict fails on one that does not."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("PORTING.md",)  # rendered as pages of the site
SOURCES = "results"  # copied as they are: what a figure's link points at


class Source(File):
    """A repository file served as it is (results' own .md files are sources, not pages)."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files, config):
    def add(cls, path: Path):
        files.append(cls(path.relative_to(ROOT).as_posix(), str(ROOT), config.site_dir, config.use_directory_urls))
    for name in PAGES:
        add(File, ROOT / name)
    for path in sorted((ROOT / SOURCES).rglob("*")):
        if path.is_file() and "runs" not in path.relative_to(ROOT).parts:  # results/*/runs: training runs, not sources
            add(Source, path)
    return files


def on_page_markdown(markdown, page, config, files):
    """A link as the repository lays files out, made the site's: from a page of docs/, ../X is the
    repository's X, which the site holds at its root; from PORTING.md, docs/X is the page X."""
    prefix = "../" if page.file.src_dir == config.docs_dir else "docs/"
    return markdown.replace("](" + prefix, "](")
