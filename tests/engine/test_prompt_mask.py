"""The mask token in prompts (docs/design.md#http-contract, "Prompts and the mask token"): text that spells it is
tokenized as plain text everywhere text becomes ids (completions prompts, chat messages, a text suffix), and ids
that hold it are refused naming the field. Found by a break-it run: ``<|mask|>`` in a chat message became the mask
id, a committed prompt row that ran the mask-row adapter and answered differently from the parent."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import LLM, ParamError, SamplingParams
from unmask.engine.text_ids import encode_text
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

MASK = "[MASK]"


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


@pytest.mark.parametrize("text", ["a [MASK] b", "[MASK]", "x[MASK][MASK]y", " [MASK] ", "no mask here"])
@pytest.mark.parametrize("special", [True, False])
def test_mask_text_is_plain_text(model, text, special):
    tok, mask_id = model.tokenizer, model.dllm.mask_token_id
    assert (mask_id in tok(text).input_ids) == (MASK in text)  # the tokenizer alone parses it into the mask id
    ids = encode_text(tok, text, mask_id, add_special_tokens=special)
    assert mask_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text  # the characters survive
    if MASK not in text:
        assert ids == tok(text, add_special_tokens=special).input_ids  # the common path is the plain call


def test_special_tokens_are_wrapped_as_the_plain_call_does():
    """A tokenizer that adds BOS/EOS: the literal encoding keeps them around the text, once."""
    from tokenizers.processors import TemplateProcessing

    m = loaded(block_size=4)
    tok = m.tokenizer
    bos, eos = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A <|im_end|>",
                                                       special_tokens=[("<|im_start|>", bos), ("<|im_end|>", eos)])
    ids = encode_text(tok, "a [MASK] b", m.dllm.mask_token_id)
    assert ids[0] == bos and ids[-1] == eos and ids.count(bos) == 1 and ids.count(eos) == 1
    assert m.dllm.mask_token_id not in ids


def test_llm_prompts_and_chats_never_carry_the_mask_id(model):
    llm = LLM(model)
    mask_id = model.dllm.mask_token_id
    assert mask_id not in llm.encode("fill [MASK] in")
    chat = llm.apply_chat_template([{"role": "user", "content": "what is [MASK]?"}])
    assert mask_id not in chat and "[MASK]" in model.tokenizer.decode(chat)
    out = llm.generate(["fill [MASK] in"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.encode("fill [MASK] in")


@pytest.fixture(scope="module")
def bidirectional():
    return loaded(attention="bidirectional", block_size=4)  # infilling (suffix) needs one


@pytest.mark.parametrize("field", ["prompt", "suffix"])
def test_mask_ids_are_refused_naming_the_field(bidirectional, field):
    model = bidirectional
    llm = LLM(model)
    mask_id = model.dllm.mask_token_id
    ok = llm.encode("one two")
    prompt = ok[:1] + [mask_id] + ok[1:] if field == "prompt" else ok
    params = SamplingParams(max_tokens=4, temperature=0, suffix=[ok[0], mask_id] if field == "suffix" else None)
    with pytest.raises(ParamError) as e:
        llm.generate([prompt], params)
    assert e.value.field == field and f"token id {mask_id} at position 1" in str(e.value)


def test_text_suffix_spelling_the_mask_is_plain_text(bidirectional):
    from unmask.engine.text_ids import suffix_ids

    llm = LLM(bidirectional)
    params = SamplingParams(max_tokens=4, temperature=0, suffix=" [MASK] end")
    ids = suffix_ids(params, bidirectional.tokenizer, bidirectional.dllm.mask_token_id)
    assert bidirectional.dllm.mask_token_id not in ids and bidirectional.tokenizer.decode(ids) == " [MASK] end"
    out = llm.generate([llm.encode("one")], params)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_server_chat_and_completions(model):
    engine = AsyncEngine(model)
    mask_id = model.dllm.mask_token_id
    try:
        with TestClient(build_app(engine, "m", shutdown_engine=False)) as c:
            base = {"model": "m", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/chat/completions", json={**base, "messages": [{"role": "user", "content": "a [MASK] b"}]})
            assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={**base, "prompt": "a [MASK] b", "echo": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("a [MASK] b"), r.text
            r = c.post("/v1/completions", json={**base, "prompt": [5, mask_id, 6]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "mask token" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={**base, "prompt": [[5, 6], [7, mask_id]]})  # which prompt: named
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text
            assert r.json()["error"]["message"].startswith("prompt.1: token id")
            assert c.post("/v1/completions", json={**base, "prompt": [5, 6]}).status_code == 200  # still serving
    finally:
        engine.shutdown()
