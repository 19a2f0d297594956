"""Only the decoding plan decides a default (issue 39; docs/design.md#decoding): a loaded model's ``dllm`` settings
are frozen after load, ``serve --block-size`` / ``--max-model-len`` (and the untrained default's block 1) are engine
options the plan reads, and the start-up log's ``default decoding`` line is the plan's own description."""
from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest

import tiny
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import DllmConfig
from unmask.engine.model import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    m = tiny.loaded(block_size=4)
    m.dllm.default_sampling = {"speculative": True, "temperature": 0.0, "threshold": 0.6}
    m.dllm.diffusion_block_size = 2
    return write_checkpoint(tmp_path_factory.mktemp("frozen") / "ckpt", m.model, m.tokenizer, m.dllm)


def test_a_loaded_models_settings_are_frozen(checkpoint):
    lm = load_model(checkpoint, device="cpu", weights="native")
    for f in dataclasses.fields(DllmConfig):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"dllm.{f.name}: .*frozen"):
            setattr(lm.dllm, f.name, getattr(lm.dllm, f.name))
    with pytest.raises(TypeError, match="read-only"):
        lm.dllm.default_sampling["threshold"] = 0.1
    with pytest.raises(TypeError):
        lm.dllm.default_sampling.update(threshold=0.1)
    copy = dataclasses.replace(lm.dllm, block_size=8)  # a changed copy is the caller's own
    assert copy.block_size == 8 and lm.dllm.block_size == 4
    assert lm.dllm.to_dict()["default_sampling"] == {"speculative": True, "temperature": 0.0, "threshold": 0.6}


def _serve_args(argv):
    from unmask.cli.main import build_parser
    from unmask.cli.serve import resolve_env

    return resolve_env(build_parser().parse_args(["serve", *argv]))


def test_serves_engine_options_change_the_plan_not_the_model(checkpoint, caplog):
    """--block-size 3 --max-model-len 100: the engine's defaults and context follow them; the loaded model keeps
    the checkpoint's settings; the log's default-decoding line is the engine's (the plan's) description."""
    from unmask.cli import serve

    args = _serve_args([str(checkpoint), "--block-size", "3", "--max-model-len", "100", "--device", "cpu",
                        "--default-drafts", "on", "--weights", "native"])
    engine_config, server_config = serve.configs(args)
    loaded, engine, path, what = serve.start_engine(args, engine_config)
    try:
        assert (loaded.dllm.block_size, loaded.dllm.diffusion_block_size, loaded.max_context) == (4, 2, 512)
        assert (engine.defaults.block_size, engine.defaults.plain_block_size, engine.max_context) == (3, 3, 100)
        with caplog.at_level(logging.INFO, logger="unmask.server"):
            serve.log_start(loaded, engine, "m", what, server_config)
        lines = [r.getMessage() for r in caplog.records]
        assert f"default decoding: {engine.describe_defaults()}" in lines
        assert "speculative decoding, drafts from the model's mask rows" in engine.describe_defaults()
        assert "block 3 and remasking low_confidence" in engine.describe_defaults()
        assert any("block_size=3 " in line and "context=100 " in line for line in lines), lines
    finally:
        engine.shutdown()


def test_the_untrained_defaults_block_1_is_an_engine_option(checkpoint, monkeypatch):
    """No MODEL and no adapter: default_model's block 1 reaches the engine as its block_size option."""
    from unmask.cli import serve

    monkeypatch.setattr(serve, "default_model", lambda shipped_adapter=True: (str(checkpoint), 1, "the untrained"))
    args = _serve_args(["--device", "cpu", "--weights", "native"])
    loaded, engine, path, what = serve.start_engine(args, serve.configs(args)[0])
    try:
        assert engine.defaults.block_size == 1 and loaded.dllm.block_size == 4 and what == "the untrained"
    finally:
        engine.shutdown()


def _assigned_settings(tree: ast.AST) -> list[str]:
    """``x.dllm.<field> = ...``, ``dllm.<field> = ...`` and ``<loaded>.max_context = ...`` in a module."""
    fields = {f.name for f in dataclasses.fields(DllmConfig)}
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if not isinstance(el, ast.Attribute):
                    continue
                owner = el.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                if (name == "dllm" and el.attr in fields) or (el.attr == "max_context" and name != "self"):
                    out.append(f"{name}.{el.attr} (line {el.lineno})")
    return out


def test_no_serving_module_changes_a_loaded_models_settings():
    """engine/, server/ and cli/ never assign a dllm setting or a loaded model's context (the trainer and exporter
    edit the configs of checkpoints they write, not a loaded model's)."""
    found = {}
    for sub in ("engine", "server", "cli"):
        for path in sorted((ROOT / sub).rglob("*.py")):
            hits = _assigned_settings(ast.parse(path.read_text(encoding="utf-8")))
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert not found, found
