"""The torch install rule (scripts/torch_build.py; docs/deploy.md, "Which torch build"): the pip arguments setup.sh
and the images get for no NVIDIA GPU, a driver >= 580, older drivers (CUDA 12.6, or a one-line refusal), a user's
TORCH_INDEX_URL, and a wheel of the chosen build in a local folder. nvidia-smi is faked (a script on PATH, or its
output passed in); pip runs only as ``--dry-run --no-index`` against a folder of fake wheels, so nothing is
downloaded and PyTorch's index is never asked."""
from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "torch_build.py"
_spec = importlib.util.spec_from_file_location("torch_build", SCRIPT)
tb = importlib.util.module_from_spec(_spec)
sys.modules["torch_build"] = tb  # dataclasses resolve the module by name
_spec.loader.exec_module(tb)

CPU = ["--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"]
CU126 = ["--index-url", "https://download.pytorch.org/whl/cu126", "torch==2.13.0+cu126"]
CU130 = (["torch===2.13.0"] if (platform.system(), platform.machine()) == ("Linux", "x86_64")
         else ["--index-url", "https://download.pytorch.org/whl/cu130", "torch==2.13.0+cu130"])


def decide(smi: str | None, *argv: str, env: dict | None = None):
    """The rule for nvidia-smi output ``smi`` (None: no nvidia-smi), no local wheel."""
    return tb.decide(tb.parser().parse_args(list(argv)), env or {}, smi=smi, seen="nvidia-smi",
                     local=lambda *a: None)


def run(tmp_path: Path, *argv: str, smi: str | None = None, smi_rc: int = 0, **env: str):
    """The script as setup.sh runs it, nvidia-smi a fake on PATH (printing ``smi``) or absent; pip sees no config
    (so not this machine's local wheel folder)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho called >> {tmp_path}/smi-calls\nprintf '%s\\n' '{smi}'\nexit {smi_rc}\n")
        fake.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_INDEX_URL"))}
    full_env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", PIP_CONFIG_FILE=os.devnull,
                    **env)
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=full_env,
                       timeout=120)
    return r.returncode, r.stdout.split("\n")[:-1], r.stderr.strip().splitlines()


def fake_wheel(folder: Path, version: str) -> Path:
    """A minimal valid ``torch-<version>`` wheel (metadata only): enough for pip's dry-run resolution."""
    folder.mkdir(exist_ok=True)
    path = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version.split('+')[0]}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_no_nvidia_gpu_gets_the_cpu_build(tmp_path):
    rc, args, err = run(tmp_path)  # no nvidia-smi on PATH
    assert (rc, args) == (0, CPU)
    assert len(err) == 1 and err[0].startswith("torch: torch==2.13.0+cpu") and "no NVIDIA GPU" in err[0], err


def test_a_failing_nvidia_smi_is_no_gpu(tmp_path):
    rc, args, err = run(tmp_path, smi="NVIDIA-SMI has failed because it couldn't communicate with the driver",
                        smi_rc=9)
    assert (rc, args) == (0, CPU) and "nvidia-smi failed" in err[0], err


def test_driver_580_gets_the_cuda_13_build(tmp_path):
    rc, args, err = run(tmp_path, smi="580.95.05, 9.0")
    assert (rc, args) == (0, CU130), err
    assert len(err) == 1 and "580.95.05" in err[0] and "CUDA 13.0" in err[0], err


def test_an_older_driver_gets_cuda_12_6_from_pytorchs_index(tmp_path):
    rc, args, err = run(tmp_path, smi="550.54.15, 8.0")
    assert (rc, args) == (0, CU126), err
    assert len(err) == 1 and "550.54.15" in err[0] and "minor version compatibility" in err[0], err


@pytest.mark.parametrize("smi, expected, note", [
    ("590.48.01, 8.6", CU130, None),
    ("580.65.06, 12.0", CU130, None),                       # Blackwell: only the CUDA 13.0 build has it
    ("580.95.05, 7.0", CU126, "compute capability 7.5"),   # Volta: dropped by the CUDA 13.0 build
    ("575.57.08, 8.9", CU126, None),
    ("570.124.06, 9.0", CU126, None),
    ("560.35.05, 8.0", CU126, None),                        # CUDA 12.6 Update 3's own driver: full support
    ("550.54.15, 8.0", CU126, "minor version compatibility"),
    ("535.104.05", CU126, "minor version compatibility"),   # an old nvidia-smi without compute_cap
    ("525.60.13, 8.0\n525.60.13, 7.5", CU126, "minor version compatibility"),  # two GPUs
])
def test_the_rule(smi, expected, note):
    c = decide(smi)
    assert c.pip_args() == expected
    assert (note is None and not c.notes) or (note in c.line()), c.line()
    assert "\n" not in c.line()


@pytest.mark.parametrize("smi, why", [
    ("525.60.11, 8.0", "older than any CUDA build"),
    ("470.82.01, 7.0", "older than any CUDA build"),
    ("570.124.06, 12.0", "Blackwell"),   # an RTX 50xx / B200 on a 570 driver: cu126 lacks its kernels
])
def test_a_driver_too_old_is_refused_in_one_line(tmp_path, smi, why):
    with pytest.raises(tb.Refused, match=why):
        decide(smi)
    rc, args, err = run(tmp_path, smi=smi)
    assert (rc, args) == (2, []) and len(err) == 1 and err[0].startswith("torch: refused:") and why in err[0], err
    assert "TORCH_INDEX_URL" in err[0] or ">= 580" in err[0]


@pytest.mark.parametrize("url, expected", [
    ("https://download.pytorch.org/whl/cu126", ["torch==2.13.0+cu126"]),
    ("https://download.pytorch.org/whl/cu132/", ["torch==2.13.0+cu132"]),
    ("https://download.pytorch.org/whl/cpu", ["torch==2.13.0+cpu"]),
    ("https://mirror.example.org/simple", ["torch==2.13.0"]),      # not PyTorch's naming: no build label
])
def test_a_users_torch_index_url_wins(tmp_path, url, expected):
    rc, args, err = run(tmp_path, smi="580.95.05, 9.0", TORCH_INDEX_URL=url)
    assert (rc, args) == (0, ["--index-url", url] + expected), err
    assert "TORCH_INDEX_URL" in err[0] and not (tmp_path / "smi-calls").exists()  # nvidia-smi not even asked
    assert decide(None, "--index-url", url).pip_args() == ["--index-url", url] + expected


def test_flags_choose_without_nvidia_smi(tmp_path):
    rc, args, _ = run(tmp_path, "--cpu", smi="580.95.05, 9.0")
    assert (rc, args) == (0, CPU)
    rc, args, _ = run(tmp_path, "--driver", "550.54.15", smi="580.95.05, 9.0")
    assert (rc, args) == (0, CU126) and not (tmp_path / "smi-calls").exists()
    assert decide(None, "--driver", "580", "--compute-cap", "7.0").pip_args() == CU126


def test_a_local_wheel_of_the_chosen_build_is_installed_without_pytorchs_index(tmp_path):
    """This machine's case (and CI's docker/wheels/): the CPU wheel in a find-links folder is taken from there."""
    fake_wheel(tmp_path / "wheels", "2.13.0+cpu")
    rc, args, err = run(tmp_path, "--find-links", str(tmp_path / "wheels"))
    assert (rc, args) == (0, ["torch==2.13.0+cpu"]), err
    assert "torch-2.13.0+cpu-py3-none-any.whl" in err[0] and "no download" in err[0], err
    rc, args, err = run(tmp_path, PIP_FIND_LINKS=str(tmp_path / "wheels"))  # pip's own configuration
    assert (rc, args) == (0, ["torch==2.13.0+cpu"]), err


@pytest.mark.parametrize("smi, expected", [("580.95.05, 9.0", CU130), ("560.35.05, 8.0", CU126)])
def test_a_local_wheel_of_another_build_never_stands_in(tmp_path, smi, expected):
    """The CPU wheel CI leaves in docker/wheels/ is not the CUDA image's torch: each requirement names its build
    exactly (``===`` for PyPI's unlabelled CUDA 13.0 wheel), so pip itself cannot pick the +cpu wheel."""
    wheels = tmp_path / "wheels"
    fake_wheel(wheels, "2.13.0+cpu")
    rc, args, err = run(tmp_path, "--find-links", str(wheels), smi=smi)
    assert (rc, args) == (0, expected), err
    assert tb.local_wheel(expected[-1], [str(wheels)]) is None
    fake_wheel(wheels, expected[-1].split("=")[-1])  # the chosen build itself, now local
    assert tb.local_wheel(expected[-1], [str(wheels)]).endswith(".whl")


def test_setup_sh_and_the_images_use_the_rule():
    """One rule: setup.sh passes its arguments to scripts/torch_build.py and installs what it prints; the images'
    installer does the same with the build arguments (tests/deploy/test_docker_files.py checks the Dockerfiles)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'scripts/torch_build.py "$@"' in setup and '"${torch_args[@]}"' in setup
    assert "torch==" not in setup.replace("torch==2.13.0+", "")  # no pin of its own
    install = (ROOT / "docker" / "install.sh").read_text()
    assert "/usr/local/bin/torch-build" in install and '"${torch_args[@]}"' in install
    assert "torch-*.whl" not in install  # no longer "any torch wheel in /wheels"
