"""Virtual environments of the third-party clients the system tests run (guidellm, lm-eval), one each, so that
their dependencies never touch unmask's own venv.

Each lives under ``$UNMASK_HOME/ci-venvs`` (else ``~/.cache/unmask-ci``), named after the client and a hash of
its package list, and is reused while that list is unchanged (a ``.ready`` file marks a finished install): the
first run installs (minutes: guidellm pulls torch), reruns start at once.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

# what each client's venv gets, in install order: each inner list is one pip call. guidellm depends on torch;
# installing the CPU build first keeps pip from pulling a CUDA one
CLIENTS: dict[str, list[list[str]]] = {
    "guidellm": [["torch==2.13.0"], ["guidellm==0.8.1"]],
    "lm-eval": [["lm-eval[api]==0.4.13", "transformers"]],
}


def venv_root() -> Path:
    home = os.environ.get("UNMASK_HOME")
    return Path(home) / "ci-venvs" if home else Path.home() / ".cache" / "unmask-ci"


def client_venv(name: str, log=None) -> Path:
    """The venv of client ``name`` (its ``bin`` directory's parent), created and installed when missing.

    Raises:
        subprocess.CalledProcessError: pip failed (its output went to ``log``, a file object, or was captured).
    """
    steps = CLIENTS[name]
    digest = hashlib.sha256(repr((sys.version_info[:2], steps)).encode()).hexdigest()[:12]
    path = venv_root() / f"{name}-{digest}"
    if (path / ".ready").exists():
        return path
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for pkgs in steps:
        subprocess.run(pip + pkgs, check=True, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT)
    (path / ".ready").write_text("\n".join(" ".join(p) for p in steps) + "\n")
    return path


if __name__ == "__main__":  # python tests/client_venvs.py guidellm lm-eval: prepare them ahead
    for n in sys.argv[1:]:
        print(n, client_venv(n, log=sys.stdout))
