"""``.ci/missing-apt-packages``, which decides what ``.ci/run`` asks apt for: a package counts as present when it is
installed or provided by an installed package (NodeSource's nodejs provides npm and conflicts with Debian's npm, so
asking apt for npm there fails although npm is on PATH)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "missing-apt-packages"
pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system (no dpkg-query)")


def _installed() -> tuple[set[str], set[str]]:
    """(names of installed packages, names provided by installed packages)."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}|${Package}|${Provides}\n"],
                         capture_output=True, text=True, check=True).stdout
    names, provided = set(), set()
    for line in out.splitlines():
        status, name, provides = line.split("|", 2)
        if status[1:2] == "i":
            names.add(name)
            provided.update(p.split("(")[0].strip() for p in provides.split(",") if p.strip())
    return names, provided


def missing(tmp_path, lines: list[str]) -> list[str]:
    listing = tmp_path / "apt-packages"
    listing.write_text("\n".join(lines) + "\n")
    r = subprocess.run([str(SCRIPT), str(listing)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_installed_and_provided_packages_are_present_others_missing(tmp_path):
    names, provided = _installed()
    virtual = sorted(provided - names)
    if not virtual:
        pytest.skip("no installed package provides a name that is not itself a package")
    lines = ["# a comment", "", sorted(names)[0], virtual[0], "unmask-no-such-package", "  # indented comment"]
    assert missing(tmp_path, lines) == ["unmask-no-such-package"]


def test_a_name_is_matched_whole(tmp_path):
    """An installed package's name cut short (a prefix of it and of the list of names) is not present."""
    names, provided = _installed()
    cut = next(n[:-1] for n in sorted(names) if len(n) > 3 and n[:-1] not in names | provided)
    assert missing(tmp_path, [cut]) == [cut]
