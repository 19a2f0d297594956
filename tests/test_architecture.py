"""The architecture's checked rules (docs/design.md#layout-and-layers): the import direction, as the import-linter
contracts of pyproject.toml (`lint-imports`): the engine imports neither the server, training nor the CLI; the server
imports neither training nor the CLI and only the engine's public API (``unmask.engine`` and
``unmask.engine.limits``); training imports neither the server nor the CLI; nothing imports the CLI; no import
cycle inside training, function-level imports included, and training's module layers. (The size of functions:
tests/test_function_checks.py.)
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


def test_training_has_an_acyclic_contract_that_sees_function_level_imports(tmp_path, monkeypatch):
    """training/ has no import cycle (docs/design.md#layout-and-layers): pyproject.toml holds an ``acyclic_siblings``
    contract over ``unmask.training`` (run by the test above), and grimp, the graph it checks, counts an import
    inside a function as an edge: a module-level import one way and a function-level one back is a cycle."""
    import grimp

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert any(c["type"] == "acyclic_siblings" and "unmask.training" in c["ancestors"] for c in contracts)
    pkg = tmp_path / "cycleprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cycleprobe", cache_dir=None)
    assert graph.find_modules_directly_imported_by("cycleprobe.b") == {"cycleprobe.a"}
    assert graph.nominate_cycle_breakers("cycleprobe")
