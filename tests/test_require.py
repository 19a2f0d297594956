"""``serving.require``, the one lookup of system tools for the system tests: PATH first, then the sbin directories
Debian installs daemons into (nginx is /usr/sbin/nginx, not on a non-root user's PATH); skip when missing, a
failure under CI=true. The one exemption from that rule, by name: the ``cuda`` lane skips without a GPU under
CI=true too (``serving.SKIP_UNDER_CI``, ``serving.require_cuda``)."""
from __future__ import annotations

import pytest

import serving


def _tool(directory, name="unmask-fake-daemon"):
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / name
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


def test_a_tool_only_in_sbin_is_found(tmp_path, monkeypatch):
    exe = _tool(tmp_path / "sbin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # the sbin directory is not on PATH, as for a non-root user
    monkeypatch.setattr(serving, "SBIN_DIRS", (str(tmp_path / "none"), str(tmp_path / "sbin")))
    assert serving.require(exe.name) == str(exe)


def test_path_comes_before_sbin(tmp_path, monkeypatch):
    on_path, _ = _tool(tmp_path / "bin"), _tool(tmp_path / "sbin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(serving, "SBIN_DIRS", (str(tmp_path / "sbin"),))
    assert serving.require(on_path.name) == str(on_path)


def test_the_sbin_directories_are_debians():
    assert {"/usr/sbin", "/sbin"} <= set(serving.SBIN_DIRS)


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_missing_tool_skips_except_under_ci(tmp_path, monkeypatch, ci, outcome):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(serving, "SBIN_DIRS", (str(tmp_path),))
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="unmask-no-such-tool is not installed"):
        serving.require("unmask-no-such-tool")


@pytest.mark.parametrize("ci", ["true", ""])
def test_the_cuda_lane_skips_without_a_gpu_even_under_ci(monkeypatch, ci):
    """The never-skip rule's one exemption, by name: the ``cuda`` lane (no CI machine has a GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CI", ci)
    assert set(serving.SKIP_UNDER_CI) == {"cuda"}
    with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
        serving.require_cuda()
