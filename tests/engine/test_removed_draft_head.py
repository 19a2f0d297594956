"""The draft head was removed on 2026-12-05 (docs/adapter.md, "Decision: the draft head goes"). What a user of an old
checkpoint gets, as Hugging Face does with a config key it no longer reads: a checkpoint whose ``dllm`` section names
a head (``draft_head``, with its ``draft_head/`` directory) still loads, serves exactly what the same checkpoint
without the head serves (speculative requests draft from mask rows), and logs one warning that the head is ignored;
``"draft_head": null``, which every checkpoint written before the removal holds, loads without a word. The command
that asked for a head, ``unmask train-head``, is an error naming it and what replaces it."""
from __future__ import annotations

import json
import logging

import pytest

import tiny
from unmask.cli.main import main as cli_main
from unmask.engine import LLM, SamplingParams
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.model import load_model

PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, speculative=True, block_size=4),
          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, block_size=1)]


def _with_dllm_key(out, value) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["dllm"]["draft_head"] = value
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(plain, with an old head, with ``"draft_head": null``): the same weights."""
    d = tmp_path_factory.mktemp("old-head")
    lm = tiny.loaded(initializer_range=0.5)
    for name in ("plain", "head", "null"):
        write_checkpoint(d / name, lm.model, lm.tokenizer, lm.dllm)
    _with_dllm_key(d / "head", "draft_head")
    (d / "head" / "draft_head").mkdir()
    (d / "head" / "draft_head" / "config.json").write_text(json.dumps({"window": 16, "max_drafts": 3}))
    (d / "head" / "draft_head" / "model.safetensors").write_bytes(b"an old head's weights")
    _with_dllm_key(d / "null", None)
    return d / "plain", d / "head", d / "null"


def _ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "draft_head" in r.getMessage()]


def test_an_old_head_checkpoint_loads_warns_once_and_decodes_as_without_it(checkpoints, caplog):
    plain, head, _ = checkpoints
    with caplog.at_level(logging.WARNING, logger="unmask"):
        old = load_model(head, weights="native")
    (msg,) = _ignored(caplog)
    assert "config.json:dllm.draft_head ('draft_head') is ignored" in msg and "removed on 2026-12-05" in msg
    assert not hasattr(old, "draft_head") and "draft_head" not in old.dllm.to_dict()
    new = LLM(load_model(plain, weights="native"))
    for params in PARAMS:
        want = new.generate("Hello there", params)[0].outputs[0].token_ids
        assert LLM(old).generate("Hello there", params)[0].outputs[0].token_ids == want


def test_a_null_draft_head_key_loads_without_a_warning(checkpoints, caplog):
    with caplog.at_level(logging.WARNING, logger="unmask"):
        load_model(checkpoints[2], weights="native")
    assert _ignored(caplog) == []


def test_export_of_an_old_head_checkpoint_drops_the_head(checkpoints, tmp_path, caplog):
    from unmask.training.export import export

    with caplog.at_level(logging.WARNING, logger="unmask"):
        export(checkpoints[1], tmp_path / "out", quantization="none")
    assert len(_ignored(caplog)) == 1
    assert "draft_head" not in json.loads((tmp_path / "out" / "config.json").read_text())["dllm"]
    assert not (tmp_path / "out" / "draft_head").exists()


def test_train_head_is_an_error_naming_the_command_and_its_replacement(capsys):
    assert cli_main(["train-head", "--verifier", "v", "--data", "d.jsonl", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unmask train-head: error: removed on 2026-12-05") and "\n" not in err
    assert "mask-row adapter" in err and "unmask recipe --trainable mask_lora" in err
