"""Every relative link of README.md and docs/*.md resolves: the file exists and, for a ``#anchor`` into a
markdown file, a heading of that file has that anchor (GitHub's rule). Text only, no imports of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCED = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and code spans (which may hold brackets that are no links)."""
    return _CODE_SPAN.sub("", _FENCED.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lower case, punctuation dropped, spaces to ``-``."""
    out: set[str] = set()
    for title in _HEADING.findall(_FENCED.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in out:  # repeated headings get -1, -2, ...
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def dead_links(doc: Path) -> list[str]:
    """Every relative link of ``doc`` that resolves to no file (or to no heading of a markdown file)."""
    dead = []
    for target in _LINK.findall(_prose(doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = doc if not file_part else (doc.parent / file_part).resolve()
        if not dest.exists():
            dead.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
            dead.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return dead


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    dead = dead_links(doc)
    assert not dead, f"dead links in {doc.relative_to(REPO)}:\n" + "\n".join(dead)


def test_the_checker_finds_a_dead_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading (v6)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#a-heading-v6) [web](https://example.com/x) `[code](nowhere.md)`\n"
        "[gone](missing.md) [bad anchor](there.md#nope)\n```\n[in code](nowhere.md)\n```\n"
    )
    assert [d.split(":")[0] for d in dead_links(doc)] == ["missing.md", "there.md#nope"]
