"""The repository stands on its own: no file points outside it, and the links of its documents
resolve to files in it.

Checked over every file git knows (tracked, plus untracked ones that are not ignored: a new
document is checked before its first commit).  The outside pointers are the design notes and
the paper the project was started from, which live next to the repository, not in it: what a
user or contributor needs from them is in docs/ (ARCHITECTURE, PROTOCOL, MEMORY, RMU, PARITY,
TRUST, COMPATIBILITY).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces, so that this file does not contain what it looks for.
_SHARED = "sha" + "red"
OUTSIDE = re.compile("|".join([
    re.escape("../" + _SHARED),             # the sibling directory of the checkout
    re.escape(_SHARED + "/docs"),
    re.escape(_SHARED + "/seeds"),
    re.escape("../" + "seeds/"),
    re.escape("/work/" + _SHARED),
    "000_" + "7a6b9ee40f0e8c2f",            # the paper's file name
]))
# Design notes that exist only outside the repository; a bare mention of one (its file name and
# a section number) sends a reader to a file they do not have.  docs/PARITY.md (like every file
# in docs/) is the repository's own.
OUTSIDE_DOCS = ("DESIGN" + ".md", "MECHANICS" + ".md", "ANCHORS" + ".md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]


def text_of(p: Path) -> str | None:
    data = p.read_bytes()
    if b"\0" in data[:8192]:
        return None                          # binary (images)
    return data.decode("utf-8", errors="replace")


def hits(pattern) -> list[str]:
    found = []
    for p in repo_files():
        text = text_of(p)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern(line):
                found.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return found


def test_repo_files_are_listed():
    names = {p.relative_to(ROOT).as_posix() for p in repo_files()}
    assert {"README.md", "docs/ARCHITECTURE.md", "docs/PROTOCOL.md", "docs/PARITY.md",
            "docs/CLUSTERS.md", "docs/TRUST.md", "docs/MEMORY.md", "docs/RMU.md",
            "docs/COMPATIBILITY.md"} <= names


def test_no_file_points_outside_the_repository():
    assert hits(OUTSIDE.search) == []


def test_no_file_cites_design_notes_that_are_not_in_the_repository():
    assert hits(lambda line: any(d in line for d in OUTSIDE_DOCS)) == []


# Documents allowed to name them (none: every document cites docs/).
CITING: set[str] = set()


def test_the_documents_do_not_cite_design_notes_that_are_not_in_the_repository():
    docs = {ROOT / "README.md", *ROOT.glob("docs/*.md")} - {ROOT / c for c in CITING}
    bad = [h for h in hits(lambda line: any(d in line for d in OUTSIDE_DOCS))
           if (ROOT / h.split(":", 1)[0]) in docs]
    assert bad == []


def markdown_links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)     # code is not a link
    return LINK.findall(text)


@pytest.mark.parametrize("md", [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_to_files_in_the_repository(md):
    broken = []
    for target in markdown_links(md):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                                      # URLs, mail, anchors in the page
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or ROOT.resolve() not in (path, *path.parents):
            broken.append(target)
    assert broken == [], f"{md.relative_to(ROOT)}: links to nothing in the repository"
