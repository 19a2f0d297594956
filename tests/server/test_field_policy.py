"""The field policy (docs/api-fields.md) field by field, the openai SDK's own conversation loop with and without tools,
``stream_options`` (``continuous_usage_stats``, ``include_obfuscation``) and the tools fallback of a ChatML template
without tools (SmolLM2's, the default model's): a tiny random model in-process, the SDK over Starlette's TestClient."""
from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app
from unmask.server.chat_prompt import render_chat_ids

DOC = Path(__file__).resolve().parents[2] / "docs" / "api-fields.md"

# SmolLM2's own chat template (the default model's): ChatML, a default system prompt, no tools
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "Hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SDK_ASSISTANT = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None,
                 "function_call": None, "tool_calls": None}


@pytest.fixture(scope="module")
def model():
    # the shipped chatml-tools system prompt is ~500 tokens of the tiny byte-level BPE: a longer context
    m = loaded(block_size=4, max_position_embeddings=1024)
    m.max_context = 1024
    m.tokenizer.chat_template = SMOLLM2_TEMPLATE
    return m


@pytest.fixture(scope="module")
def client(model):
    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m")) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


# ------------------------------------------------------------------ the tables of docs/api-fields.md
def doc_tables() -> dict[str, dict[str, str]]:
    """``{section: {field: behaviour}}`` of docs/api-fields.md (behaviour: the first word of its column)."""
    tables, section = {}, None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"^\| `([a-z_.]+)` \| (honoured|no-op|400) \|", line)
        if m and section:
            tables.setdefault(section, {})[m.group(1)] = m.group(2)
    return tables


TABLES = doc_tables()
CHAT, COMPLETIONS = TABLES["Chat completions: request fields"], TABLES["Completions: request fields"]
STREAM, MESSAGES, VLLM = TABLES["`stream_options`"], TABLES["Messages"], TABLES["vLLM extensions"]


def _keys(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def test_the_doc_lists_every_field_of_the_openai_sdk():
    from openai.types import completion_create_params as legacy
    from openai.types import chat as c

    assert _keys(c.completion_create_params.CompletionCreateParamsBase) | {"stream"} <= set(CHAT)
    assert _keys(legacy.CompletionCreateParamsBase) | {"stream"} <= set(COMPLETIONS)
    assert _keys(c.ChatCompletionStreamOptionsParam) <= set(STREAM)
    roles = (c.ChatCompletionSystemMessageParam, c.ChatCompletionDeveloperMessageParam,
             c.ChatCompletionUserMessageParam, c.ChatCompletionAssistantMessageParam, c.ChatCompletionToolMessageParam)
    assert set().union(*map(_keys, roles)) | set(c.ChatCompletionMessage.model_fields) <= set(MESSAGES)


# an accepted value of each field (chat; completions reuse them), and for a field with refused values one of those
ACCEPT = {
    "messages": USER, "model": "m", "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"65": 1},
    "logprobs": True, "top_logprobs": 1, "max_completion_tokens": 2, "max_tokens": 2, "n": 2, "seed": 1,
    "stop": ["\n"], "stream": False, "stream_options": None, "temperature": 0.7, "top_p": 0.9, "tools": [WEATHER],
    "tool_choice": "none", "parallel_tool_calls": False, "response_format": {"type": "text"}, "modalities": ["text"],
    "metadata": {"k": "v"}, "store": False, "service_tier": "fast", "user": "u1", "safety_identifier": "s1",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit",
                                                                                         "ttl": "30m"},
    "prediction": {"type": "content", "content": "Hello there"},
    # completions
    "prompt": "Hi", "suffix": None, "echo": True, "best_of": 2,
    # vLLM
    "top_k": 5, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [65],
    "prompt_logprobs": 1, "cache_salt": "s",
}
REFUSE = {
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f"}], "function_call": "auto",
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {"search_context_size": "low"}, "moderation": {"model": "m"},
    "modalities": ["text", "audio"], "tools": [{"type": "custom", "custom": {"name": "c"}}],
    "prompt_logprobs": 21, "min_p": 0.1, "use_beam_search": True, "length_penalty": 0.5,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5, "allowed_token_ids": [1], "bad_words": ["x"], "add_generation_prompt": False,
    "continue_final_message": True, "add_special_tokens": True, "chat_template": "x", "chat_template_kwargs": {},
    "guided_json": {}, "guided_regex": "a", "guided_choice": ["a"], "guided_grammar": "a",
    "structured_outputs": {}, "priority": 1, "request_id": "r", "logits_processors": [],
    "return_tokens_as_token_ids": True, "cache_salt": "",
}


# fields another one must come with, and the completions' own accepted values
WITH = {"top_logprobs": {"logprobs": True}, "best_of": {"n": 2}, "parallel_tool_calls": {"tools": [WEATHER]}}
COMPLETION_ACCEPT = {"logprobs": 1}


def _check(client, path: str, body: dict, field: str, behaviour: str, accept: dict = ACCEPT) -> None:
    body = {**body, **WITH.get(field, {})}
    if behaviour == "400":
        r = client.post(path, json={**body, field: REFUSE[field]})
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field or err["message"].startswith(f"{field}"), (field, err)
        return
    r = client.post(path, json={**body, field: accept.get(field, ACCEPT[field])})
    assert r.status_code == 200, (field, r.text)
    if field in REFUSE:  # a field honoured with some values and a 400 with others
        r = client.post(path, json={**body, field: REFUSE[field]})
        assert r.status_code == 400 and field in r.json()["error"]["param"], (field, r.text)


@pytest.mark.parametrize("field", sorted(set(CHAT) - {"messages", "stream_options", "stream"}))  # own tests
def test_chat_fields_as_documented(client, field):
    _check(client, "/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 2}, field, CHAT[field])


@pytest.mark.parametrize("field", sorted(set(COMPLETIONS) - {"stream_options", "stream", "prompt"}))  # own tests
def test_completions_fields_as_documented(client, field):
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
    _check(client, "/v1/completions", body, field, COMPLETIONS[field], {**ACCEPT, **COMPLETION_ACCEPT})


@pytest.mark.parametrize("field", sorted(f for f in VLLM if "." not in f))
def test_vllm_extensions_as_documented(client, field):
    _check(client, "/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 2}, field, VLLM[field])


# a conversation using each message field as OpenAI's SDK sends it, and refused values naming the field
MESSAGE_ACCEPT = {
    "role": [{"role": "developer", "content": "Be brief."}] + USER,
    "content": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}] + USER,
    "name": [{"role": "user", "content": "Hi", "name": "ann"}],
    "tool_calls": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tool_call_id": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]}],
    "refusal": USER + [{"role": "assistant", "content": None, "refusal": "I cannot."}] + USER,
    "annotations": USER + [{**SDK_ASSISTANT, "annotations": [{"type": "url_citation", "url_citation": {
        "start_index": 0, "end_index": 5, "title": "t", "url": "https://example.com"}}]}] + USER,
    "audio": USER + [SDK_ASSISTANT] + USER,
    "function_call": USER + [SDK_ASSISTANT] + USER,
}
MESSAGE_REFUSE = {
    "role": ([{"role": "function", "name": "f", "content": "x"}], "messages.0.role"),
    "content": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
    "audio": (USER + [{**SDK_ASSISTANT, "audio": {"id": "audio_1"}}], "messages.1.audio"),
    "function_call": (USER + [{**SDK_ASSISTANT, "function_call": {"name": "f", "arguments": "{}"}}],
                      "messages.1.function_call"),
    "tool_call_id": (USER + [{"role": "tool", "tool_call_id": "nope", "content": "x"}], "messages.1.tool_call_id"),
}


@pytest.mark.parametrize("field", sorted(MESSAGES))
def test_message_fields_as_documented(client, field):
    body = {"model": "m", "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**body, "messages": MESSAGE_ACCEPT[field]})
    assert r.status_code == 200, (field, r.text)
    if field in MESSAGE_REFUSE:
        messages, param = MESSAGE_REFUSE[field]
        r = client.post("/v1/chat/completions", json={**body, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (field, r.text)


# ------------------------------------------------------------------ the openai SDK's conversation loop
def test_sdk_appends_the_returned_message_and_its_model_dump(sdk):
    messages = [{"role": "user", "content": "Hi"}]
    for turn in range(3):
        c = sdk.chat.completions.create(model="m", messages=messages, max_tokens=3, seed=turn, modalities=["text"])
        message = c.choices[0].message
        messages.append(message if turn % 2 == 0 else message.model_dump())
        messages.append({"role": "user", "content": "And?"})
    assert len(messages) == 7 and isinstance(messages[3], dict) and messages[3]["audio"] is None


def test_sdk_appends_tool_calls_and_results(sdk):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    c = sdk.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=128, seed=0,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    parallel_tool_calls=False)
    message = c.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather", message
    messages.append(message)
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"sky": "sunny"}'})
    c = sdk.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=4, seed=0)
    answer = c.choices[0].message
    assert answer.content is not None or answer.tool_calls
    messages.append(answer.model_dump())
    messages.append({"role": "user", "content": "Thanks"})
    c = sdk.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=2, seed=0)
    assert c.choices[0].message.role == "assistant"


# ------------------------------------------------------------------ tools on a ChatML template without tools
@pytest.mark.parametrize("messages", [
    USER,
    [{"role": "system", "content": "Be brief."}] + USER,
    USER + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}],
])
def test_a_prompt_without_tools_is_the_models_own_template_byte_for_byte(model, messages):
    tok = model.tokenizer
    own = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    mask = model.dllm.mask_token_id
    assert render_chat_ids(tok, messages, mask_token_id=mask, special_tokens_in_content=True) == own
    if not any("<|" in m["content"] for m in messages):  # special-token text in a message is text by default
        assert render_chat_ids(tok, messages, mask_token_id=mask) == own


def test_tools_keep_the_default_system_prompt_and_results_are_words(model):
    tok = model.tokenizer
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.decode(render_chat_ids(tok, history, tools=[WEATHER]))
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n# Tools") and '"get_weather"' in text
    assert "get_weather returned: sunny" in text and "<tool_response>" not in text
    assert text.endswith("<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be brief."}] + history
    assert tok.decode(render_chat_ids(tok, own_system, tools=[WEATHER])).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools")


def test_the_server_answers_tools_on_that_template_and_tool_choice_none_keeps_the_prompt(client):
    body = {"model": "m", "messages": USER, "max_tokens": 4, "seed": 0}
    plain = client.post("/v1/chat/completions", json=body).json()
    r = client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the tools are in the prompt
    none = client.post("/v1/chat/completions", json={**body, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


# ------------------------------------------------------------------ stream_options
def _chunks(client, body: dict) -> list[dict]:
    out = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client):
    body = {"model": "m", "messages": USER, "max_tokens": 6, "seed": 0, "n": 2, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(client, body)
    assert all(c["usage"] is not None for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 12
    assert chunks[-1]["choices"] == [] and chunks[-2]["usage"] == chunks[-1]["usage"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    # vLLM's rule: without include_usage it has no effect
    alone = _chunks(client, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone)


def test_include_obfuscation_pads_every_chunk_with_choices(client):
    body = {"model": "m", "messages": USER, "max_tokens": 6, "seed": 0, "stream": True,
            "stream_options": {"include_obfuscation": True, "include_usage": True}}
    chunks = _chunks(client, body)
    for c in chunks[:-1]:
        pad = c["obfuscation"]
        assert re.fullmatch(r"[A-Za-z0-9]{1,32}", pad)
        assert (len(c["choices"][0]["delta"].get("content") or "") + len(pad)) % 32 == 0
    assert "obfuscation" not in chunks[-1]  # the usage chunk has no choices
    plain = _chunks(client, {**body, "stream_options": {"include_obfuscation": False}})
    assert all("obfuscation" not in c for c in plain)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in plain)


def test_continuous_usage_stats_report_the_cached_prompt_tokens_from_the_first_step(client):
    """A repeated prompt loads its prefix from the prefix cache at admission: every usage-bearing chunk of the
    stream says so, not only the last (was 0 until a choice finished)."""
    long_user = [{"role": "user", "content": "tell me about the sea " * 12}]
    body = {"model": "m", "messages": long_user, "max_tokens": 8, "seed": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _chunks(client, body)  # fills the prefix cache
    chunks = _chunks(client, body)
    cached = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks if c["choices"]]
    assert cached[-1] > 0 and set(cached[1:]) == {cached[-1]}, cached  # the role chunk precedes the first step
