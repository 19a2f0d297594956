"""The architecture's checked rules (docs/design.md#layout-and-layers): the import direction, as the import-linter
contracts of pyproject.toml (`lint-imports`): the engine imports neither the server, training nor the CLI; the server
imports neither training nor the CLI and only the engine's public API (``unmask.engine`` and
``unmask.engine.limits``); training imports neither the server nor the CLI; nothing imports the CLI. (The size of
functions: tests/test_function_checks.py.)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    """`lint-imports` (the contracts in pyproject.toml's ``[tool.importlinter]``) keeps every contract."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import contracts broken (lint-imports):\n{proc.stdout}\n{proc.stderr}"

