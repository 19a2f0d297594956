"""Library progress bars (transformers' GGUF de-quantisation, loading, writing shards) stay out of log files: the
CLI turns them off when stderr is not a terminal, before tqdm and huggingface_hub are imported."""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, sys
from unmask.cli.main import library_bars_off_terminal
assert "tqdm" not in sys.modules and "transformers" not in sys.modules  # the switches must come first
library_bars_off_terminal(sys.stderr, os.environ)
import tqdm.auto
for _ in tqdm.auto.tqdm(range(3), desc="library-bar"):  # as transformers' GGUF loader calls it: no disable=
    pass
from transformers.utils import logging
print(logging.is_progress_bar_enabled())
"""


def _probe(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**env, **extra_env})


def test_bars_off_when_stderr_is_a_file():
    r = _probe({})
    assert r.returncode == 0, r.stderr
    assert "library-bar" not in r.stderr and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_a_users_setting_wins():
    # tqdm reads TQDM_DISABLE as bool(str): only the empty string means "on"
    r = _probe({"TQDM_DISABLE": "", "HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert r.returncode == 0, r.stderr
    assert "library-bar" in r.stderr and r.stdout.strip() == "True", (r.stdout, r.stderr)


def test_bars_stay_on_a_terminal():
    class Terminal:
        def isatty(self):
            return True

    env: dict[str, str] = {}
    from unmask.cli.main import library_bars_off_terminal

    library_bars_off_terminal(Terminal(), env)
    assert env == {}
