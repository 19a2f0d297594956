"""docs/design.md is cited by heading anchor, never by section number (docs/design.md#layout-and-layers, the intro):

- every ``design.md#anchor`` cited anywhere in the repository (code, tests, benchmarks, docs, README; a list such as
  ``docs/design.md#decoding and #decisions`` counts each name) and every ``(#anchor)`` link inside docs/design.md
  names a heading of docs/design.md (GitHub's anchor: lower case, punctuation dropped, spaces as hyphens);
- no numbered citation of the design is left (the old form, a section number after the file's name, or a bare
  section number inside docs/design.md), so renumbering can never again silently change what the code cites.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SUFFIXES = {".py", ".md", ".toml", ".txt", ".yml", ".yaml", ".cfg", ".sh", ".js", ".html", ".jinja", ".json", ".mjs"}
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".pytest_cache",
             ".ruff_cache", ".import_linter_cache"}

SEP = r"(?:,\s*|\s+and\s+|\s+or\s+)"
CITE = re.compile(rf"design\.md#([\w-]+)((?:{SEP}#[\w-]+)*)")
INTERNAL = re.compile(r"\]\(#([\w-]+)\)")
NUM = r"\d+(?!\.\d)(?!\d)"
# the retired form: the file's name (or "design"), then "section(s) N"; or "section N of docs/design.md / the design"
NUMBERED = re.compile(rf"(?:design\.md`?(?:\]\([^)\s]*\))?|\bdesign)\s+sections?\s+{NUM}"
                      rf"|\bsections?\s+{NUM}\s+of\s+(?:docs/design\.md|the\s+design\b)")
BARE = re.compile(rf"(?<![\w.])sections?\s+{NUM}")
OTHER_DOCUMENTS = ("RFC", "arXiv", "et al.")  # "section N" of a paper or an RFC, not of this file


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def design_anchors() -> set[str]:
    assert DESIGN.is_file(), f"{DESIGN} is missing"
    anchors, seen, fence = set(), {}, False
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fence:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
        anchors.update(re.findall(r"<a\s+(?:id|name)=\"([\w-]+)\"", line))
    return anchors


def text_files():
    this = Path(__file__).resolve()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in SUFFIXES and path.resolve() != this:
                try:
                    yield path, path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_design_has_named_top_level_sections():
    headings = re.findall(r"^## (.+)$", DESIGN.read_text(encoding="utf-8"), re.M)
    assert headings, "docs/design.md has no '## ' sections"
    numbered = [h for h in headings if re.match(r"\d", h)]
    assert not numbered, f"docs/design.md headings start with a number (cite names, not numbers): {numbered}"


def test_every_cited_design_anchor_exists():
    anchors = design_anchors()
    missing = []
    for path, text in text_files():
        rel = path.relative_to(ROOT).as_posix()
        for m in CITE.finditer(text):
            names = [m.group(1)] + re.findall(r"#([\w-]+)", m.group(2))
            missing += [f"{rel}:{line_of(text, m.start())}: #{n}" for n in names if n not in anchors]
        if path == DESIGN:
            missing += [f"{rel}:{line_of(text, m.start())}: #{m.group(1)}" for m in INTERNAL.finditer(text)
                        if m.group(1) not in anchors]
    assert not missing, ("citations of docs/design.md anchors that no heading there makes (rename the citation "
                         "with the heading):\n" + "\n".join(missing))


def test_no_numbered_design_citation_is_left():
    found = []
    for path, text in text_files():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line_of(text, m.start())}: {m.group(0)!r}" for m in NUMBERED.finditer(text)]
        if path == DESIGN:
            for m in BARE.finditer(text):
                before = text[max(0, m.start() - 60):m.start()]
                if not any(k in before for k in OTHER_DOCUMENTS):
                    found.append(f"{rel}:{line_of(text, m.start())}: {m.group(0)!r}")
    assert not found, ("docs/design.md cited by section number (cite the heading's anchor instead, "
                       "docs/design.md#decoding):\n" + "\n".join(found))
