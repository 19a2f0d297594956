"""``unmask eval`` works from an installed wheel, not only from a source checkout: its harness
(``unmask.cli.evaluation``) and the held-out prompt sets ship in the package (pyproject's package-dir, packages and
package-data), and an install outside a checkout writes its run folders under the current directory.

The default lane lays the package out as setuptools would (from pyproject's own mapping, without building) and runs
the command from there in an isolated interpreter; the ``system`` lane builds and installs the real wheel."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run inside the install (-I: no editable finder, no checkout on sys.path; the dependencies appended after it)
CHECK = """
import sys; sys.path[:0] = [{site!r}]; sys.path.append({deps!r})
import unmask.cli.evaluation.quality as q
assert q.__file__.startswith({site!r}), q.__file__
assert q.DATA == __import__("pathlib").Path(q.__file__).parent / "data", q.DATA
rows, grid, _ = q.load_eval_sets(q.DATA)
assert len(rows) >= 200 and len(grid) == 60, (len(rows), len(grid))
assert str(q.RUNS_DIR).startswith({cwd!r}), q.RUNS_DIR
import argparse
a = q.add_arguments(argparse.ArgumentParser()).parse_args(["--quick"])
assert str(q.output_dir(a, now=0)).endswith("benchmarks/results/eval/runs/19700101-000000-quick")
from unmask.cli.main import main
try:
    main(["eval", "--help"])
except SystemExit as exc:
    assert exc.code == 0
try:
    main(["eval", "--max-tokens", "0"])
except SystemExit as exc:
    assert exc.code == 2
print("ok")
"""


def _deps() -> str:
    import fastapi

    return str(Path(fastapi.__file__).resolve().parents[1])


def _run_check(site: Path, cwd: Path, python: str = sys.executable) -> None:
    code = CHECK.format(site=str(site), deps=_deps(), cwd=str(cwd))
    r = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, cwd=str(cwd), timeout=120)
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def _layout(site: Path) -> None:
    """Copy the packages the way pyproject.toml maps them (package-dir, packages, package-data; Python files of
    every listed package, data files by the package-data patterns)."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs, data = cfg["package-dir"], cfg.get("package-data", {})
    for pkg in cfg["packages"]:
        parent = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        src = ROOT / dirs[parent] / Path(*pkg[len(parent):].lstrip(".").split(".") if pkg != parent else ())
        dst = site / Path(*pkg.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy(f, dst / f.name)
        for pattern in data.get(pkg, []):
            for f in src.glob(pattern):
                shutil.copy(f, dst / f.name)


def test_eval_runs_from_the_package_layout(tmp_path):
    site, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    _layout(site)
    assert (site / "unmask" / "cli" / "evaluation" / "data" / "eval_prompts.jsonl").is_file()
    _run_check(site, cwd)


def test_the_checkout_keeps_its_folders():
    """From the source checkout (the editable install): the committed prompt sets and the run folders of the
    repository, as before the harness moved into the package."""
    from unmask.cli.evaluation import quality

    assert quality.DATA == ROOT / "benchmarks" / "data"
    assert quality.RUNS_DIR == ROOT / "benchmarks" / "results" / "eval" / "runs"


@pytest.mark.system
def test_eval_runs_from_the_built_wheel(tmp_path):
    import setuptools

    wheel_dir, site, cwd = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    isolation = [] if int(setuptools.__version__.split(".")[0]) < 77 else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation, "-q",
                    "-w", str(wheel_dir)], check=True, timeout=300, cwd=str(tmp_path))
    wheel = next(wheel_dir.glob("unmask-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    _run_check(site, cwd)
