"""A misspelt ``UNMASK_*`` variable is named at start-up instead of being ignored without a word (new-user report:
``UNMASK_PROT=8005`` served on 8000)."""
import argparse
import os
import subprocess
import sys

from unmask.cli import serve


def _unknown(environ):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        return serve.register(sub, "serve").get_default("unknown_env")
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_unknown_variables_are_listed_with_the_closest_option():
    got = dict(_unknown({"UNMASK_PROT": "8005", "UNMASK_COMPLETELY_UNRELATED_THING": "1", "PATH": "/bin"}))
    assert got == {"UNMASK_PROT": "UNMASK_PORT", "UNMASK_COMPLETELY_UNRELATED_THING": None}


def test_options_and_the_other_known_variables_are_not_listed():
    environ = {"UNMASK_PORT": "1", "UNMASK_MAX_BATCH_SIZE": "2", "UNMASK_MODEL": "m", "UNMASK_API_KEY_FILE": "f"}
    environ.update({v: "x" for v in serve.OTHER_VARIABLES})
    assert _unknown(environ) == []


def test_serve_logs_the_unknown_variable_before_anything_else_fails(tmp_path):
    env = dict(os.environ, UNMASK_PROT="8005", UNMASK_PORT="0")  # any free port: :8000 may be taken
    r = subprocess.run([sys.executable, "-m", "unmask.cli.main", "serve", str(tmp_path / "missing")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "$UNMASK_PROT is not an unmask serve option: ignored (did you mean $UNMASK_PORT?)" in r.stderr
