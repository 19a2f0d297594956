"""The architecture's checked rules (docs/design.md section 1, the layers; section 14, the long modules):

- the import direction, as the import-linter contracts of pyproject.toml (`lint-imports`): the engine imports
  neither the server, training nor the CLI; the server imports neither training nor the CLI and only the engine's
  public API (``unmask.engine`` and ``unmask.engine.limits``); training imports neither the server nor the CLI;
  nothing imports the CLI;
- no module in ``engine/`` or ``server/`` above 400 lines unless docs/design.md section 14 names it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
LONG_MODULES_SECTION = 14


def test_import_contracts_hold():
    """`lint-imports` (the contracts in pyproject.toml's ``[tool.importlinter]``) keeps every contract."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import contracts broken (lint-imports):\n{proc.stdout}\n{proc.stderr}"


def modules_named_in_design(section: int = LONG_MODULES_SECTION) -> set[str]:
    """The ``engine/...py`` / ``server/...py`` paths that docs/design.md section ``section`` names (up to the next
    heading of the same or a higher level). Fails (not skips) when the file or the section is missing."""
    design = ROOT / "docs" / "design.md"
    assert design.is_file(), f"{design} is missing: section {section} must name the modules allowed above " \
                             f"{MAX_LINES} lines"
    lines = design.read_text(encoding="utf-8").splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s*(\d+)[.)]?\s", line)
        if m and int(m.group(2)) == section:
            start, level = i, len(m.group(1))
            break
    assert start is not None, f"{design}: no section {section} (a heading such as '## {section}. Modules over " \
                              f"{MAX_LINES} lines')"
    body = []
    for line in lines[start + 1:]:
        m = re.match(r"^(#+)\s", line)
        if m and len(m.group(1)) <= level:
            break
        body.append(line)
    return set(re.findall(r"(?<![\w/])((?:engine|server)/[\w/]+\.py)", "\n".join(body)))


def test_long_modules_are_named_in_the_design():
    allowed = modules_named_in_design()
    too_long = {}
    for folder in ("engine", "server"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            rel = path.relative_to(ROOT).as_posix()
            if n > MAX_LINES and rel not in allowed:
                too_long[rel] = n
    assert not too_long, (f"modules above {MAX_LINES} lines that docs/design.md section {LONG_MODULES_SECTION} does "
                          f"not name (say why there, or split them): {too_long}")
