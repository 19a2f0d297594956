"""``unmask --version`` prints the installed distribution's version and exits 0."""
import subprocess
import sys
from importlib.metadata import version

import pytest

from unmask.cli.main import main


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"unmask {version('unmask')}"


def test_version_console_script():
    out = subprocess.run([sys.executable, "-m", "unmask.cli.main", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"unmask {version('unmask')}"
