"""Device resolution's messages (engine/model.py): ``auto`` on a machine whose NVIDIA GPU this torch cannot use warns
in one line naming the driver and torch's build (the probe faked: no GPU needed), ``mps`` is refused in one line,
and loading an nf4 checkpoint prints no bitsandbytes kernel-hub notice (engine/__init__.py)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest
import unmask.engine.model as engine_model

ROOT = Path(__file__).resolve().parents[2]
#: the unpinned ``auto`` rule (tests/conftest.py pins ``auto`` to the CPU for every other test)
AUTO_DEVICE = getattr(conftest, "AUTO_DEVICE", engine_model.auto_device)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def auto_warnings(caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unmask.engine"):
        assert AUTO_DEVICE() == torch.device("cpu")
    return [r.getMessage() for r in caplog.records if r.name == "unmask.engine"]


@pytest.mark.parametrize("cuda, driver, says", [
    (None, "550.54.15", "is a CPU build"),
    ("13.0", "550.54.15", "a CUDA 13.0 build, which needs driver >= 580"),
    ("12.6", "470.82.01", "a CUDA 12.6 build, which needs driver >= 525.60.13"),
    ("13.0", "580.95.05", "yet sees no GPU"),
])
def test_auto_warns_in_one_line_when_a_gpu_is_present_but_torch_cannot_use_it(no_cuda, monkeypatch, caplog,
                                                                             cuda, driver, says):
    monkeypatch.setattr(engine_model, "nvidia_driver_version", lambda: driver)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    (msg,) = auto_warnings(caplog)
    assert "\n" not in msg and f"driver {driver}" in msg and torch.__version__ in msg and says in msg, msg
    with pytest.raises(ValueError, match=f"CUDA is not available .*driver {driver}"):  # an explicit cuda says it too
        engine_model.resolve_device("cuda")


def test_auto_is_silent_without_an_nvidia_driver(no_cuda, monkeypatch, caplog):
    monkeypatch.setattr(engine_model, "nvidia_driver_version", lambda: None)
    assert auto_warnings(caplog) == []


def test_the_driver_probe_reads_the_kernel_module_version(monkeypatch, tmp_path):
    """/proc/driver/nvidia/version, proprietary and open kernel modules; absent: nvidia-smi, absent too: None."""
    f = tmp_path / "version"
    monkeypatch.setattr(engine_model, "NVIDIA_PROC_VERSION", f)
    f.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                 "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert engine_model.nvidia_driver_version() == "550.54.15"
    f.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder)\n")
    assert engine_model.nvidia_driver_version() == "580.95.05"
    f.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    assert engine_model.nvidia_driver_version() is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 570.124.06\n")
    fake.chmod(0o755)
    assert engine_model.nvidia_driver_version() == "570.124.06"


def test_mps_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^device: 'mps' is not supported: the sampler draws in float64") as e:
        engine_model.resolve_device("mps")
    assert "\n" not in str(e.value)


_NF4_LOAD = """
import os, sys, tempfile
sys.path.insert(0, "tests")
import tiny
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.model import load_model
from unmask.training.export import export
d = tempfile.mkdtemp()
lm = tiny.loaded()
write_checkpoint(os.path.join(d, "src"), lm.model, lm.tokenizer, lm.dllm)
export(os.path.join(d, "src"), os.path.join(d, "nf4"), quantization="nf4")
m = load_model(os.path.join(d, "nf4"), device="cpu", weights="native")  # bitsandbytes layers as loaded
assert "4bit" in type(m.model.model.layers[0].mlp.down_proj).__name__, type(m.model.model.layers[0].mlp.down_proj)
print("loaded")
"""
NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def test_loading_an_nf4_model_prints_no_kernel_hub_notice(tmp_path):
    """bitsandbytes' import on an AVX512-BF16 CPU (this CI machine's) logs that its optional Hugging Face hub kernel
    did not load, naming trust_remote_code; unmask filters exactly that record (and kernels' offline notice for
    the same repository). The control shows the notice exists here; elsewhere the record is fed in directly."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    control = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True, text=True, env=env,
                             timeout=300, cwd=ROOT)
    r = subprocess.run([sys.executable, "-c", _NF4_LOAD], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]
    for needle in (NOTICE, "kernels-community", "trust_remote_code"):
        assert needle not in r.stderr, r.stderr[-2000:]
    if NOTICE not in control.stderr:  # a CPU without AVX512-BF16: bitsandbytes never tries the hub kernel
        assert "kernels-community" not in control.stderr


def test_the_filter_drops_only_the_kernel_hub_notice(caplog):
    import unmask.engine  # noqa: F401  (installs the filter)

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        log.warning("%s: Kernel repository 'kernels-community/quantization-bitsandbytes' could not verify ... "
                    "trust_remote_code=True ...", NOTICE)
        logging.getLogger("kernels._internals.hf_hub").warning(
            "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face "
            "Hub is in offline mode.")
        log.warning("some other bitsandbytes warning")
        logging.getLogger("kernels._internals.hf_hub").warning(
            "Skipping publisher trust check for 'someone/else' because Hugging Face Hub is in offline mode.")
    assert [r.getMessage() for r in caplog.records] == [
        "some other bitsandbytes warning",
        "Skipping publisher trust check for 'someone/else' because Hugging Face Hub is in offline mode."]
