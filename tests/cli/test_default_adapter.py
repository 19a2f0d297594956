"""``unmask serve`` with no MODEL: the parent conversion + the shipped mask-row adapter (cli/serve.py
``default_with_adapter``; docs/design.md#mask-row-adapter), and the fallbacks when there is no adapter."""
from __future__ import annotations

import json

import pytest

from default_stand_ins import write_default
from unmask.engine.adapter_files import ADAPTER_CONFIG
from unmask.engine.model import load_model


def _shipped(tmp_path):
    return write_default(tmp_path, dllm={"block_size": 4, "default_sampling": {"speculative": True,
                                                                              "temperature": 0.0}})


def test_the_default_is_the_parent_plus_the_shipped_adapter(monkeypatch, tmp_path):
    import unmask.default_adapter as pkg
    from unmask.cli import serve

    parent, shipped = _shipped(tmp_path)
    monkeypatch.setattr(pkg, "directory", lambda: shipped)
    path, block, what = serve.default_with_adapter(parent)
    assert block is None and "mask-row adapter" in what and "rank 2" in what
    cfg = json.loads((tmp_path / "models" / "smollm2-135m-a2d-mask-adapter" / ADAPTER_CONFIG).read_text())
    assert cfg["parent"]["name"] == str(parent.resolve())
    lm = load_model(path)  # finds the parent through the hint, checks its hash
    assert lm.adapter is not None and lm.dllm.block_size == 4 and lm.dllm.default_sampling["speculative"]
    assert serve.default_with_adapter(parent)[0] == path  # the second start reuses the copy


def test_no_adapter_files_or_opt_out_falls_back(monkeypatch, tmp_path):
    import unmask.default_adapter as pkg
    from unmask.cli import serve

    parent, shipped = _shipped(tmp_path)
    monkeypatch.setattr(pkg, "directory", lambda: tmp_path / "empty")
    assert serve.default_with_adapter(parent) is None
    monkeypatch.setattr(pkg, "directory", lambda: shipped)
    for off in ("0", "false", "OFF", "no"):  # read like every UNMASK_* switch (breaker: "false" kept it on)
        monkeypatch.setenv("UNMASK_DEFAULT_ADAPTER", off)
        assert serve.default_with_adapter(parent) is None
    from unmask.cli.main import UsageError
    monkeypatch.setenv("UNMASK_DEFAULT_ADAPTER", "maybe")
    with pytest.raises(UsageError, match="UNMASK_DEFAULT_ADAPTER"):
        serve.default_with_adapter(parent)
    monkeypatch.delenv("UNMASK_DEFAULT_ADAPTER")
    assert serve.default_with_adapter(tmp_path / "missing") is None
