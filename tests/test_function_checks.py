"""The function-level checks (docs/design.md#function-level-checks): ruff with exactly C901 (cyclomatic complexity,
at most 15) and PLR0915 (statements, at most 60) over engine/, server/, training/, cli/, clients/ and benchmarks/,
as pyproject.toml's ``[tool.ruff]`` configures them. A new offender fails; so does a listed one that no longer
offends (remove its name from ``[tool.ruff.lint.per-file-ignores]`` when the function is split)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "server", "training", "cli", "clients", "benchmarks")
SELECTION = {"C901", "PLR0915"}
MAX_COMPLEXITY, MAX_STATEMENTS = 15, 60


def ruff(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in proc.stderr, "ruff is missing: pip install -e '.[test]'"
    return proc


def config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]


def listed_offenders() -> dict[str, set[str]]:
    """``{path: {function name}}`` from the reason comments of ``[tool.ruff.lint.per-file-ignores]``
    (``"path" = [codes]  # Class.name, name: why``)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[tool.ruff.lint.per-file-ignores]", 1)[1].split("\n[", 1)[0]
    out = {}
    for line in table.splitlines():
        m = re.match(r'^"([^"]+)"\s*=\s*\[[^\]]*\]\s*#\s*([^:]+):', line)
        if m:
            out[m.group(1)] = {name.strip().rsplit(".", 1)[-1] for name in m.group(2).split(",")}
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"pyproject.toml: an ignore without '# function, ...: reason': {line!r}")
    return out


def test_the_selection_is_exactly_the_function_checks():
    cfg = config()
    lint = cfg["lint"]
    assert set(lint["select"]) == SELECTION and not lint.get("extend-select"), lint["select"]
    assert lint["mccabe"]["max-complexity"] <= MAX_COMPLEXITY
    assert lint["pylint"]["max-statements"] <= MAX_STATEMENTS
    for folder in FOLDERS:
        assert f"{folder}/**/*.py" in cfg["include"], f"[tool.ruff] include misses {folder}/"
    for path, codes in lint["per-file-ignores"].items():
        assert (ROOT / path).is_file(), f"per-file-ignores names a missing file: {path}"
        assert set(codes) <= SELECTION, f"{path}: ignores {codes}, only {sorted(SELECTION)} may be listed"


def test_no_function_over_the_limits_unless_listed():
    proc = ruff()
    assert proc.returncode == 0, f"ruff check (pyproject.toml's function-level checks) failed:\n{proc.stdout}\n{proc.stderr}"


def test_every_listed_offender_still_offends_and_no_other():
    proc = ruff("--config", "lint.per-file-ignores = {}", "--output-format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    found: dict[str, set[str]] = {}
    for v in json.loads(proc.stdout or "[]"):
        assert v["code"] in SELECTION, v
        path = Path(v["filename"]).resolve().relative_to(ROOT).as_posix()
        line = (ROOT / path).read_text(encoding="utf-8").splitlines()[v["location"]["row"] - 1]
        m = re.search(r"def\s+(\w+)", line)
        found.setdefault(path, set()).add(m.group(1) if m else f"line {v['location']['row']}")
    listed = listed_offenders()
    new = {p: sorted(f - listed.get(p, set())) for p, f in found.items() if f - listed.get(p, set())}
    fixed = {p: sorted(f - found.get(p, set())) for p, f in listed.items() if f - found.get(p, set())}
    assert not new, f"functions over the limits (split them; listing one needs a reason): {new}"
    assert not fixed, (f"listed in pyproject.toml's [tool.ruff.lint.per-file-ignores] but within the limits now "
                       f"(remove them there): {fixed}")
