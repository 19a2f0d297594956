"""Tool calls on a tiny random model with a tools-capable chat template built here (docs/design.md section 20):
the hermes parser (one call, several, malformed JSON, an unknown name, pieces), tool-call deltas, ``tool_choice``
``required`` / named always yielding parseable calls (constrained decoding), ``n`` with tools, tool messages,
``response_format``, ``logit_bias``, ``echo`` and the accepted/refused OpenAI fields."""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import CompletionOutput
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app
from unmask.server.chat_prompt import shipped_template
from unmask.server.render import Render
from unmask.server.tool_parsers import HermesParser, parse

# a compact ChatML template that renders tools, assistant tool calls and tool results (the tiny model has 512
# positions; the shipped chatml-tools template's system prompt alone is ~500 tiny-BPE tokens)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>{% else %}{{ m['content'] }}"
    "{% endif %}{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TOKENS = 128  # a call is ~60-90 tokens of the tiny byte-level BPE; forced tokens cost no forward


@pytest.fixture(scope="module")
def client():
    model = loaded(block_size=4)
    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m", chat_template=TOOLS_TEMPLATE)) as c:
        yield c


def chat(client, **kw):
    body = {"model": "m", "messages": USER, "max_tokens": 48, **kw}
    return client.post("/v1/chat/completions", json=body)


def _valid_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert names is None or c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


# ------------------------------------------------------------------ the parser
NAMES = {"get_weather", "get_time"}


def test_hermes_parses_one_call_and_keeps_the_text_around_it():
    content, calls = parse(HermesParser(NAMES), 'Sure. <tool_call>\n{"name": "get_weather", "arguments": '
                                                 '{"city": "Paris", "days": 2}}\n</tool_call>')
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]


def test_hermes_parses_several_calls_and_drops_whitespace_between_them():
    text = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>\n')
    content, calls = parse(HermesParser(NAMES), text)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"}  # arguments given as JSON text are accepted
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',   # malformed JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',                 # a function not offered
    '<tool_call>["get_weather"]</tool_call>',                                     # not an object
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',             # arguments not an object
    '<tool_call>{"name": "get_time"',                                             # unclosed and incomplete
    'just text <tool_ca',                                                         # a tag prefix at the end
])
def test_malformed_calls_are_returned_as_text(text):
    assert parse(HermesParser(NAMES), text) == (text, [])


def test_an_unclosed_call_at_the_end_counts_when_it_parses():
    content, calls = parse(HermesParser(NAMES), '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert content is None and calls[0].name == "get_time"


def test_feeding_pieces_gives_what_the_whole_text_gives():
    text = ('Ok <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> and '
            '<tool_call>{"bad</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>  ')
    whole_content, whole = parse(HermesParser(NAMES), text)
    for step in (1, 2, 3, 7):
        p = HermesParser(NAMES)
        pieces = [x for i in range(0, len(text), step) for x in p.feed(text[i:i + step])] + p.finish()
        assert "".join(x for k, x in pieces if k == "content") == whole_content
        assert [(c.name, c.arguments) for k, c in pieces if k == "call"] == [(c.name, c.arguments) for c in whole]


def _out(text, finish="stop"):
    return CompletionOutput(index=0, text=text, token_ids=[1], finish_reason=finish, logprobs=None, steps=1, nfe=1)


def test_render_sends_malformed_output_as_content_and_calls_as_deltas():
    render = Render("chat", "chatcmpl-x", 0, "m", str, tool_parser=lambda: HermesParser(NAMES))
    from unmask.server.responses import Usage

    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    bad = render.body([_out('<tool_call>{"name": "get_time", </tool_call>')], usage)["choices"][0]
    assert bad["message"]["content"] == '<tool_call>{"name": "get_time", </tool_call>'
    assert "tool_calls" not in bad["message"] and bad["finish_reason"] == "stop"
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    chunks = render.text_chunks(0, text[:20]) + render.text_chunks(0, text[20:]) + render.finish_chunks(0, _out(text))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                                         "function": {"name": "get_time", "arguments": ""}}]}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone":"UTC"}'}}]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = render.body([_out(text, "length")], usage)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"]  # length stays length


# ------------------------------------------------------------------ the app
def test_tool_choice_required_always_yields_parseable_calls(client):
    for seed in range(4):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed,
                 temperature=1.0, max_tokens=CALL_TOKENS)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) == 1 and choice["message"]["content"] is None
        _valid_calls(choice["message"]["tool_calls"], NAMES)


def test_named_tool_choice_calls_that_function_with_n_choices(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
             n=3, seed=1, temperature=1.0, max_tokens=CALL_TOKENS)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        _valid_calls(choice["message"]["tool_calls"], {"get_time"})


def _stream(client, body):
    events = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streamed_tool_call_deltas_join_to_the_non_streamed_calls(client):
    body = {"model": "m", "messages": USER, "max_tokens": CALL_TOKENS, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "seed": 3, "temperature": 1.0}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls: dict[int, dict] = {}
    finish = None
    for ev in _stream(client, {**body, "stream": True}):
        choice = ev["choices"][0]
        for d in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            call["id"] = d.get("id") or call["id"]
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and all(c["id"] for c in calls.values())
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in plain["message"]["tool_calls"]]


def test_auto_with_a_random_model_answers_text_or_calls_never_a_500(client):
    for seed in range(3):
        r = chat(client, tools=[WEATHER], seed=seed, max_tokens=16)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["annotations"] == [] and (msg["content"] is not None or msg["tool_calls"])


def test_history_with_tool_calls_and_results_renders(client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with_history = chat(client, messages=history, tools=[WEATHER], max_tokens=4, seed=0)
    assert with_history.status_code == 200, with_history.text
    assert with_history.json()["usage"]["prompt_tokens"] > chat(client, tools=[WEATHER], max_tokens=4).json()[
        "usage"]["prompt_tokens"]


@pytest.mark.parametrize("kw,param", [
    ({"messages": USER + [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_and_format_fields_are_400s_naming_the_field(client, kw, param):
    r = chat(client, **kw)
    assert r.status_code == 400, (kw, r.text)
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_a_template_without_tools_is_a_400_naming_the_fix():
    engine = AsyncEngine(loaded(block_size=4))
    with TestClient(build_app(engine, "m")) as c:  # the tiny tokenizer's own template renders no tools
        r = chat(c, tools=[WEATHER])
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--chat-template chatml-tools" in r.json()["error"]["message"]


def test_the_shipped_chatml_tools_template_renders_tools_calls_and_results():
    tok = loaded().tokenizer
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(history, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                   chat_template=shipped_template("chatml-tools"))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_response_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(3):
        r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
                 seed=seed, temperature=1.0)
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


def test_logit_bias_forces_a_token(client):
    tok = client.app.state.unmask.tokenizer
    e = tok("e", add_special_tokens=False).input_ids[0]
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4, "ignore_eos": True,
                                             "logit_bias": {str(e): 100}, "seed": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "e" * 4


def test_echo_prepends_the_prompt_plain_and_streamed(client):
    body = {"model": "m", "prompt": "One two", "max_tokens": 4, "echo": True, "seed": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("One two") and len(text) > len("One two")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x[6:] != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] == "One two" and "".join(c["choices"][0]["text"] for c in chunks) == text
    r = client.post("/v1/completions", json={**body, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_metadata_service_tier_and_store_are_accepted(client):
    r = chat(client, metadata={"team": "a"}, service_tier="auto", store=False, max_tokens=2)
    assert r.status_code == 200, r.text
    assert chat(client, metadata={"k": 1}).status_code == 400  # values are strings (OpenAI)


# a tool whose parameters use local $refs: into its own $defs, the legacy definitions and the root (recursion)
REFS = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"$ref": "#/definitions/Days"},
                                     "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
    "required": ["city", "days", "next"], "additionalProperties": False,
    "$defs": {"City": {"enum": ["Paris", "Rome"]}}, "definitions": {"Days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 3}}}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "plan"}}])
def test_local_refs_in_enforced_tool_parameters_resolve(client, tool_choice):
    """The parameters are embedded under ``arguments`` of the call grammar; their ``#/...`` refs used to point at
    the call object's root ("Pointer '/$defs/City' does not exist", a 400). Each call is valid under the schema."""
    for seed in range(2):
        r = chat(client, tools=[WEATHER, REFS], tool_choice=tool_choice, parallel_tool_calls=False, seed=seed,
                 temperature=1.0, max_tokens=CALL_TOKENS)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        if r.json()["choices"][0]["finish_reason"] == "length":
            continue   # a random model may not close the recursion within max_tokens
        for c in calls:
            if c["function"]["name"] == "plan":
                jsonschema.validate(json.loads(c["function"]["arguments"]), REFS["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_bad_enforced_parameters_schema_is_a_400_naming_the_tool_without_grammar_text(client, tool_choice):
    bad = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "frobnicate"}}}}}
    r = chat(client, tools=[WEATHER, bad], tool_choice=tool_choice)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools.1.function.parameters", err
    assert err["message"].startswith("tools.1.function.parameters: ") and "frobnicate" in err["message"], err
    for internal in ("<tool_call>", "%json", "start:", " | ", "x-guidance"):
        assert internal not in err["message"], err


@pytest.mark.parametrize("json_schema,param", [
    ({"name": "bad name"}, "response_format.json_schema.name"),
    ({"name": "x", "strict": "yes"}, "response_format.json_schema.strict"),
    ({"name": "x", "extra": 1}, "response_format.json_schema.extra"),
])
def test_response_format_errors_name_the_path_once(client, json_schema, param):
    """The discriminator's value used to sit in the path: ``response_format.json_schema.json_schema.name``."""
    r = chat(client, response_format={"type": "json_schema", "json_schema": json_schema})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert "json_schema.json_schema" not in r.json()["error"]["message"]


def test_an_unknown_response_format_type_is_a_400_naming_it(client):
    r = chat(client, response_format={"type": "xml"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "json_schema" in r.json()["error"]["message"] and "JsonSchema" not in r.json()["error"]["message"]
