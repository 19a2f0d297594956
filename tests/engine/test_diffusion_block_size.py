"""``dllm.diffusion_block_size``: the default block of plain-diffusion requests that send no ``block_size``
(engine/plan.py ``resolve``; docs/design.md#model-families). Speculative requests keep ``block_size`` as their draft
block; a request's own ``block_size`` wins; an adapter may set it; ``unmask serve --block-size`` replaces both."""
from __future__ import annotations

import dataclasses

import pytest

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError, DllmConfig
from unmask.engine.model import load_model
from unmask.engine.plan import resolve


def _dllm(**kw):
    base = dict(family="a2d", mask_token_id=3, attention="prefix_causal", block_size=4, logit_shift=True,
                eos_token_ids=[0], default_sampling={"speculative": True, "temperature": 0.0})
    return DllmConfig(**{**base, **kw})


@pytest.mark.parametrize("request_fields, block", [
    ({"steps": 8}, 2), ({"threshold": 0.9}, 2), ({"speculative": False}, 2),  # plain diffusion: its own default
    ({}, 4), ({"speculative": True}, 4),                                       # speculative: the draft block
    ({"steps": 8, "block_size": 8}, 8), ({"speculative": False, "block_size": 1}, 1),   # the request's own wins
])
def test_plain_diffusion_gets_its_own_default_block(request_fields, block):
    plan = resolve(SamplingParams.from_flat(max_tokens=16, **request_fields), _dllm(diffusion_block_size=2),
                   default_drafts="on")
    assert plan.block_size == block


def test_without_it_every_request_gets_block_size():
    plan = resolve(SamplingParams.from_flat(max_tokens=16, steps=8), _dllm(), default_drafts="on")
    assert plan.block_size == 4


@pytest.mark.parametrize("value, says", [(0, "must be a positive integer"), (True, "must be a positive integer"),
                                         ("2", "must be a positive integer")])
def test_bad_values_name_the_field(value, says):
    with pytest.raises(CheckpointError, match=f"diffusion_block_size: {says}"):
        _dllm(diffusion_block_size=value)


def test_a_fixed_block_family_cannot_take_another():
    with pytest.raises(CheckpointError, match="diffusion_block_size: this sdar model decodes with its trained"):
        DllmConfig(family="sdar", mask_token_id=3, attention="block_causal", block_size=4, logit_shift=False,
                   eos_token_ids=[0], fixed_block_size=True, diffusion_block_size=2)


def test_an_adapter_sets_it_and_decoding_uses_it(tmp_path):
    """Through a mask-row adapter's dllm overrides (as the shipped default's): a plain-diffusion request without
    block_size decodes exactly as the same request with block_size 2."""
    m = tiny.loaded()
    write_checkpoint(tmp_path / "parent", m.model, m.tokenizer, m.dllm)
    write_adapter(tmp_path / "adapter", tiny.random_adapter_weights(m),
                  {"sha256": parent_hash(tmp_path / "parent"), "name": str(tmp_path / "parent")},
                  dllm={"block_size": 4, "diffusion_block_size": 2})
    lm = load_model(tmp_path / "adapter")
    assert (lm.dllm.block_size, lm.dllm.diffusion_block_size) == (4, 2)
    assert dataclasses.asdict(lm.dllm)["diffusion_block_size"] == 2
    llm = LLM(lm)
    ids = llm.encode("Hello world the quick brown")
    implicit = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, steps=6, ignore_eos=True))[0]
    explicit = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, steps=6, ignore_eos=True,
                                                  block_size=2))[0]
    assert implicit.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert implicit.outputs[0].nfe == explicit.outputs[0].nfe

    def blocks(**kw):  # the blocks the denoising stream reports: 12 tokens in blocks of 2 are 6, of 4 are 3
        events = list(llm.stream(ids, SamplingParams(max_tokens=12, temperature=0, steps=6, ignore_eos=True, **kw)))
        return max(ev.block for ev in events) + 1

    assert blocks() == 6 and blocks(block_size=4) == 3


def test_serves_block_size_option_is_every_requests_default():
    """The engine option block_size (``serve --block-size``) is an input to the plan: it replaces both defaults for
    every request that sends none; the checkpoint's settings stay as they are."""
    from unmask.engine.plan import engine_defaults

    d = _dllm(diffusion_block_size=2)
    assert engine_defaults(d).plain_block_size == 2 and engine_defaults(d).block_size == 4
    eight = engine_defaults(d, block_size=8, default_drafts="on")
    assert (eight.block_size, eight.diffusion_block_size) == (8, None)
    assert (d.block_size, d.diffusion_block_size) == (4, 2)
    for fields in ({"steps": 8}, {}):  # plain diffusion and the speculative default
        plan = resolve(SamplingParams.from_flat(max_tokens=16, **fields), d, defaults=eight)
        assert plan.block_size == 8 and plan.model_block_size == 8, fields
    fixed = DllmConfig(family="sdar", mask_token_id=3, attention="block_causal", block_size=4, logit_shift=False,
                       eos_token_ids=[0], fixed_block_size=True)
    with pytest.raises(ValueError, match=r"^block_size: this sdar model decodes with its trained block"):
        engine_defaults(fixed, block_size=8)
    assert engine_defaults(fixed, block_size=4).block_size == 4


def test_serve_names_the_option_of_a_block_size_the_model_refuses(monkeypatch, capsys, tmp_path):
    """An engine option the model does not allow is one line naming the flag, or the variable it came from."""
    from unmask.cli.main import main

    m = tiny.loaded(fixed_block_size=True)
    write_checkpoint(tmp_path / "fixed", m.model, m.tokenizer, m.dllm)
    monkeypatch.setenv("UNMASK_BLOCK_SIZE", "8")
    assert main(["serve", str(tmp_path / "fixed"), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "$UNMASK_BLOCK_SIZE: this a2d model decodes with its trained block size 4 only" in err, err
    assert main(["serve", str(tmp_path / "fixed"), "--port", "0", "--device", "cpu", "--block-size", "2"]) == 2
    assert "--block-size: this a2d model decodes" in capsys.readouterr().err


def test_a_checkpoint_default_longer_than_a_requests_limit_is_still_served():
    """The default is the checkpoint's, not a request field: a request's 512 limit does not apply to it (break-it:
    every plain-diffusion request became a 400 naming block_size, a field the client never sent)."""
    plan = resolve(SamplingParams.from_flat(max_tokens=16, steps=8), _dllm(diffusion_block_size=600),
                   default_drafts="on")
    assert plan.block_size == 600 and plan.params.block_size is None


def test_an_adapters_default_longer_than_the_context_is_refused_at_load(tmp_path):
    m = tiny.loaded()
    write_checkpoint(tmp_path / "parent", m.model, m.tokenizer, m.dllm)
    write_adapter(tmp_path / "adapter", tiny.random_adapter_weights(m),
                  {"sha256": parent_hash(tmp_path / "parent"), "name": str(tmp_path / "parent")},
                  dllm={"block_size": 4, "diffusion_block_size": 100000})
    with pytest.raises(CheckpointError, match=r"mask_adapter\.json:dllm\.diffusion_block_size: 100000 exceeds the "
                                              r"model's context"):
        load_model(tmp_path / "adapter")
