"""The docs' rules: README.md stays short, no line of README.md or docs/ runs past 120 characters,
every relative link names a file that exists (and a heading of it, with an anchor), and every
repository path written in backticks names a file that exists (or one a make target generates,
which git ignores)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WIDTH = 120
REPO_DIRS = ("kvgen/", "tests/", "bench/", "deploy/", "clients/", "protos/", "docs/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
SPAN = re.compile(r"(`+)(.+?)\1")  # an inline code span


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text outside its fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(```+|~~~+)", line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = m.group(1)[:3] if fence is None else None
        elif fence is None:
            out.append((n, line))
    return out


def test_there_are_docs():
    assert {"api.md", "architecture.md", "settings.md", "deployment.md", "performance.md", "testing.md"} <= \
        {d.name for d in DOCS if d.parent.name == "docs"}
    assert [d for d in DOCS if d.parent.name == "design"]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 150, f"README.md has {n} lines: move the detail into docs/"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_no_line_is_too_long(doc):
    long = [f"{_name(doc)}:{n}: {len(line)} characters"
            for n, line in enumerate(doc.read_text().splitlines(), 1) if len(line) > WIDTH]
    assert not long, "\n".join(long)


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but hyphens and
    underscores dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for _, line in prose(doc.read_text()) if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_relative_links_point_at_files(doc):
    """A relative link names a file that exists, and an anchor one of its headings."""
    broken = []
    for n, line in prose(doc.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # a URL (https:, mailto:)
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists() or anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{_name(doc)}:{n}: {target}")
    assert not broken, "\n".join(broken)


def _ignored(paths: list[str]) -> set[str]:
    """Those of paths that git ignores (what make targets generate: stubs, builds, caches)."""
    if not paths:
        return set()
    p = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                       capture_output=True, text=True)
    return set(p.stdout.split())


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_repository_paths_exist(doc):
    missing = []
    for n, line in prose(doc.read_text()):
        for _, span in SPAN.findall(line):
            path = span.strip()
            if path.startswith(REPO_DIRS) and " " not in path and not (ROOT / path).exists():
                missing.append((n, path))
    ignored = _ignored([p for _, p in missing])
    missing = [f"{_name(doc)}:{n}: `{p}`" for n, p in missing if p not in ignored]
    assert not missing, "\n".join(missing)
