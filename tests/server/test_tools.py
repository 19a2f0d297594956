"""Tool calls on a tiny random model with a tools-capable chat template built here
(docs/design.md#tools-and-the-responses-api): the hermes parser (one call, several, malformed JSON, an unknown name,
pieces), tool-call deltas, ``tool_choice`` ``required`` / named always yielding parseable calls (constrained decoding),
``n`` with tools, tool messages, ``response_format``, ``logit_bias``, ``echo`` and the accepted/refused OpenAI
fields."""
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
from unmask.server.protocol import ChatCompletionRequest
from unmask.server.render import Render
from unmask.server.tool_parsers import HermesParser, parse, parser_factory

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
    # the newlines between calls are no content when a later call is text (they used to lead it)
    content, calls = parse(HermesParser(NAMES), text + '<tool_call>{"name": "get_time", "argu')
    assert len(calls) == 2 and content == '<tool_call>{"name": "get_time", "argu'
    content, calls = parse(HermesParser(NAMES), "Let me check.\n" + text + "\n Done. ")
    assert len(calls) == 2 and content == "Let me check.\nDone."  # joined by the gap before the calls


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


DEEP_JSON = ["[" * 1000 + "]" * 1000, "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000]


@pytest.mark.parametrize("text", [
    "<tool_call>" + DEEP_JSON[1] + "</tool_call>",                                         # the body itself
    '<tool_call>{"name": "get_time", "arguments": ' + DEEP_JSON[2] + "}</tool_call>",      # an object argument
    '<tool_call>{"name": "get_time", "arguments": "' + DEEP_JSON[1] + '"}</tool_call>',   # a string argument
    "<tool_call>" + DEEP_JSON[1],                                                           # unclosed at the end
])
def test_deeply_nested_model_output_comes_back_as_text(text):
    """It was a RecursionError out of ``json.loads`` (a 500, or a broken stream)."""
    assert parse(HermesParser(NAMES), text) == (text, [])


DEEP_600 = ["[" * 600 + "]" * 600, '{"a":' * 600 + "1" + "}" * 600]  # parsed, but past the template's tojson


@pytest.mark.parametrize("args", DEEP_JSON + DEEP_600)
def test_deeply_nested_tool_call_arguments_are_a_400_naming_the_field(client, args):
    """A RecursionError while rendering the history was a 500 with a traceback (breaker F5); JSON that parses but
    is past the template's ``tojson`` recursion was a 400 naming ``messages``."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = chat(client, messages=messages, tools=[WEATHER])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.tool_calls.0.function.arguments" and err["code"] == "invalid_json", err
    assert err["message"].startswith(err["param"] + ": ") and "nested" in err["message"], err
    assert chat(client, max_tokens=2).status_code == 200  # still serving


@pytest.mark.parametrize("args", DEEP_600)
def test_tool_parameters_the_template_cannot_nest_that_deep_are_a_400_naming_them(client, args):
    deep = {"type": "object", "properties": {"a": json.loads(args)}}
    r = chat(client, tools=[WEATHER, {"type": "function", "function": {"name": "g", "parameters": deep}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.parameters", r.text


def test_an_unclosed_call_at_the_end_counts_when_it_parses():
    content, calls = parse(HermesParser(NAMES), '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert content is None and calls[0].name == "get_time"


@pytest.mark.parametrize("cut", ["</tool_call", "</", "<", "\n</tool_ca"])
def test_a_close_tag_cut_short_at_the_end_is_not_part_of_the_call(cut):
    """max_tokens can stop the text inside the close tag (found by a new user: the cut call came back as markup in
    content beside the parsed call before it). A body that still does not parse stays text, tag and all."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
    content, calls = parse(HermesParser(NAMES), call + '<tool_call>\n{"name": "get_time", "arguments": {}}' + cut)
    assert content is None and [c.name for c in calls] == ["get_time", "get_time"], (content, calls)
    content, calls = parse(HermesParser(NAMES), call + '<tool_call>{"name": "get_ti' + cut)
    assert content == '<tool_call>{"name": "get_ti' + cut and len(calls) == 1


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


# ------------------------------------------------------------------ parallel_tool_calls: false (at most one call)
TWO_CALLS = ('Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call> Done.')


def test_a_parser_with_max_calls_1_ends_the_answer_at_the_first_call():
    for text, first in ((TWO_CALLS, "get_time"),
                        # a malformed first call is text, so the next valid call is the one
                        ('<tool_call>{"bad</tool_call> ' + TWO_CALLS.split(" ", 2)[2], "get_time")):
        whole = HermesParser(NAMES, max_calls=1)
        content, calls = parse(whole, text)
        assert [c.name for c in calls] == [first] and whole.ended
        assert "get_weather" not in (content or "") and "Done" not in (content or "")
        for step in (1, 3, 11):  # the same, however the text is cut
            p = HermesParser(NAMES, max_calls=1)
            pieces = [x for i in range(0, len(text), step) for x in p.feed(text[i:i + step])] + p.finish()
            assert [c.name for k, c in pieces if k == "call"] == [first]
            assert ("".join(x for k, x in pieces if k == "content") or None) == content
    assert [c.name for c in parse(HermesParser(NAMES), TWO_CALLS)[1]] == ["get_time", "get_weather"]


def _render_for(body: dict) -> Render:
    """The Render the chat route builds for ``body`` (its parser from :func:`parser_factory`)."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body})
    return Render("chat", "chatcmpl-x", 0, "m", str, tool_parser=parser_factory("hermes", req))


def _streamed_calls(render: Render, text: str, finish: str) -> tuple[list[str], str]:
    chunks = [c for i in range(0, len(text), 9) for c in render.text_chunks(0, text[i:i + 9])]
    chunks += render.finish_chunks(0, _out(text, finish))
    names = [d["function"]["name"] for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []
             if d.get("id")]
    return names, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("tool_choice", [None, "auto"])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_parallel_tool_calls_false_returns_at_most_one_call_plain_and_streamed(tool_choice, finish):
    """``parallel_tool_calls: false`` used to shape only the ``required`` grammar: under ``auto`` every call the
    model wrote was returned (OpenAI returns at most one). What the engine decoded after the first call, up to a
    ``length``, is dropped, so the answer is a complete call: ``finish_reason`` ``tool_calls``."""
    from unmask.server.responses import Usage
    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    body = {"tools": [WEATHER, TIME], "parallel_tool_calls": False}
    if tool_choice:
        body["tool_choice"] = tool_choice
    choice = _render_for(body).body([_out(TWO_CALLS, finish)], usage)["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert choice["message"]["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert _streamed_calls(_render_for(body), TWO_CALLS, finish) == (["get_time"], "tool_calls")
    # parallel_tool_calls true (the default): every call, and length stays length
    both = _render_for({**body, "parallel_tool_calls": True}).body([_out(TWO_CALLS, finish)], usage)["choices"][0]
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == ["get_time", "get_weather"]
    assert both["finish_reason"] == ("tool_calls" if finish == "stop" else "length")


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


def _eos_bias(client) -> dict[str, int]:
    """``logit_bias`` pushing every EOS id of the served model to -100 (a grammar still allows them, unlikely)."""
    tok = client.app.state.unmask.tokenizer  # tiny.loaded's EOS ids
    return {str(tok.convert_tokens_to_ids(t)): -100 for t in ("<|endoftext|>", "<|im_end|>")}


def test_required_with_parallel_calls_gives_several_calls_each_parseable(client):
    """``required`` with ``parallel_tool_calls`` (the default): the grammar allows ``call ("\n" call)*``. With EOS
    pushed to -100 after each call the model must go on, so the answer holds several calls; every complete call
    parses and names a listed tool, and the call ``max_tokens`` cut is returned as text (``length``)."""
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=5, temperature=1.0,
             max_tokens=3 * CALL_TOKENS, logit_bias=_eos_bias(client))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["message"]["tool_calls"]) >= 2, choice
    _valid_calls(choice["message"]["tool_calls"], NAMES)
    assert choice["finish_reason"] == "length" and (choice["message"]["content"] or "").startswith("<tool_call>")
    for seed in range(3):  # without the bias: one or more calls, each parseable
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=seed, temperature=1.0,
                 max_tokens=CALL_TOKENS)
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            _valid_calls(choice["message"]["tool_calls"], NAMES)
            assert choice["message"]["content"] is None


def test_tool_choice_none_renders_no_tools_parses_nothing_and_constrains_nothing(client):
    """``tool_choice: none``: the prompt is the one without tools, the answer is the tool-less answer token for
    token (no grammar), and model text that looks like a call stays content (no parser)."""
    kw = dict(seed=2, temperature=1.0, max_tokens=24)
    plain, none = chat(client, **kw).json(), chat(client, tools=[WEATHER, TIME], tool_choice="none", **kw).json()
    auto = chat(client, tools=[WEATHER, TIME], **kw).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] < auto["usage"]["prompt_tokens"]
    assert none["choices"] == plain["choices"] and "tool_calls" not in none["choices"][0]["message"]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": [WEATHER],
                                                "tool_choice": "none"})
    assert req.constraint() is None and req.template_tools() is None and parser_factory("hermes", req) is None
    from unmask.server.responses import Usage
    render = _render_for({"tools": [WEATHER, TIME], "tool_choice": "none"})
    body = render.body([_out(TWO_CALLS)], Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))
    assert body["choices"][0]["message"]["content"] == TWO_CALLS and body["choices"][0]["finish_reason"] == "stop"


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
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_and_format_fields_are_400s_naming_the_field(client, kw, param):
    r = chat(client, **kw)
    assert r.status_code == 400, (kw, r.text)
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_a_template_without_tools_is_a_400_naming_the_fix():
    """A template that renders no tools and is not ChatML (a ChatML one gets the chatml-tools fallback:
    tests/server/test_field_policy.py)."""
    model = loaded(block_size=4)
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m")) as c:
        r = chat(c, tools=[WEATHER])
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--chat-template chatml-tools" in r.json()["error"]["message"]


@pytest.mark.parametrize("form", ["string", "tool_use dict"])
def test_the_models_own_tools_capable_template_is_used_without_chat_template(form):
    """No ``--chat-template``: the tokenizer's own template renders the tools, as a Qwen-style model's does; in the
    transformers dict form (``{"default": ..., "tool_use": ...}``) ``tool_use`` renders requests with tools and
    ``default`` the others. An enforced call parses."""
    from tiny import CHAT_TEMPLATE

    model = loaded(block_size=4)
    tok = model.tokenizer
    tok.chat_template = TOOLS_TEMPLATE if form == "string" else {"default": CHAT_TEMPLATE, "tool_use": TOOLS_TEMPLATE}

    def prompt_len(template, tools=None):
        return len(tok(tok.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True,
                                               chat_template=template), add_special_tokens=False).input_ids)

    with TestClient(build_app(AsyncEngine(model), "m")) as c:
        r = chat(c, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=0,
                 temperature=1.0, max_tokens=CALL_TOKENS)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == prompt_len(TOOLS_TEMPLATE, [WEATHER, TIME])
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        _valid_calls(choice["message"]["tool_calls"], NAMES)
        plain = chat(c, max_tokens=2, seed=0)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["prompt_tokens"] == prompt_len(
            TOOLS_TEMPLATE if form == "string" else CHAT_TEMPLATE)


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
    r = client.post("/v1/completions", json={**body, "logprobs": 1})  # the prompt's tokens first, then the choice's
    lp = r.json()["choices"][0]["logprobs"]
    assert r.status_code == 200 and lp["token_logprobs"][0] is None and "".join(lp["tokens"]).startswith("One two")
    r = client.post("/v1/completions", json={**body, "logprobs": 1, "stream": True})  # not streamed
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


@pytest.mark.parametrize("where", ["--tool-call-parser", "$UNMASK_TOOL_CALL_PARSER"])
def test_an_unknown_tool_call_parser_is_a_one_line_error_before_the_model_loads(capsys, monkeypatch, where):
    """``unmask serve --tool-call-parser NAME`` (or the variable): the names are the server's parsers (one list); an
    unknown one exits 2 with one line naming the option or variable and the known names (argparse's ``choices``
    printed the usage too)."""
    from unmask.cli.main import main

    argv = ["serve", "no-such-model-dir"]
    if where.startswith("$"):
        monkeypatch.setenv(where[1:], "nope")
    else:
        argv += [where, "nope"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{where}: unknown parser 'nope'" in err and "hermes" in err, err


CRASHY = [{"type": "integer", "minimum": -2e19, "maximum": -1e19},
          {"type": "object", "properties": {"n": {"type": "integer", "minimum": -2 ** 63, "maximum": -2 ** 63}}},
          {"type": "integer", "minimum": 1e19, "maximum": 2e19}]


@pytest.mark.parametrize("schema", CRASHY)
def test_integer_bounds_llguidance_crashes_on_are_400s_and_the_server_keeps_serving(client, schema):
    """F1: these integer ranges segfaulted the server (llguidance); a 400 naming the field now, as response_format
    and as enforced tool parameters (chat and, in test_responses_api, /v1/responses)."""
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "integer range" in r.json()["error"]["message"], r.text
    params = schema if schema.get("type") == "object" else {"type": "object", "properties": {"n": schema}}
    tool = {"type": "function", "function": {"name": "get_n", "parameters": params}}
    r = chat(client, tools=[WEATHER, tool], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.parameters", r.text
    assert chat(client, max_tokens=2).status_code == 200


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                                    {"type": "string", "pattern": "^(a{1000}){1000}$"}])
def test_a_schema_no_output_satisfies_is_a_400(client, schema):
    """F4: used to be a 200 with an empty / invalid output and finish_reason stop."""
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
