"""``unmask eval`` evaluates, by default, the model ``unmask serve`` serves: the conversion plus the shipped
mask-row adapter (found by a new user: the defaults were the parent and the untrained conversion only)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import eval_quality  # noqa: E402


def test_the_served_default_is_among_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("UNMASK_HOME", str(tmp_path))
    monkeypatch.delenv("UNMASK_DEFAULT_ADAPTER", raising=False)
    from unmask.default_adapter import available

    models = dict(eval_quality.default_models())
    assert models["untrained"] == str(tmp_path / "models" / "smollm2-135m-a2d")
    assert available()  # the repository ships the adapter
    assert models["default-adapter"] == str(tmp_path / "models" / "smollm2-135m-a2d-mask-adapter")
    assert set(eval_quality.PREPARED_ON_FIRST_USE) >= {"untrained", "default-adapter"}


def test_not_with_the_adapter_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("UNMASK_HOME", str(tmp_path))
    monkeypatch.setenv("UNMASK_DEFAULT_ADAPTER", "0")
    assert "default-adapter" not in dict(eval_quality.default_models())
