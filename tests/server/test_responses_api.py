"""``POST /v1/responses`` through the openai SDK's ``client.responses`` (sync and streaming) on a tiny in-process
server (docs/design.md#tools-and-the-responses-api): text, instructions, multi-turn input items with function calls and
their outputs, tools, the typed stream events and the denoising-step event."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from test_tools import CALL_TOKENS, SCHEMAS, TOOLS_TEMPLATE, WEATHER
from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's tool shape


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine(loaded(block_size=4))
    with TestClient(build_app(engine, "m", chat_template=TOOLS_TEMPLATE, api_key="k")) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)


def test_text_in_text_out_with_instructions(client):
    r = client.responses.create(model="m", input="Hello there", instructions="Answer briefly.",
                                max_output_tokens=8, extra_body={"seed": 0})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "m"
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text == r.output[0].content[0].text and r.instructions == "Answer briefly."
    assert r.usage.output_tokens <= 8 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == r.status  # the message item is incomplete too when max_output_tokens cut it
    # the same seed gives the same text
    same = client.responses.create(model="m", input="Hello there", instructions="Answer briefly.",
                                   max_output_tokens=8, extra_body={"seed": 0})
    assert same.output_text == r.output_text


def test_multi_turn_items_with_function_calls_and_outputs(client):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    r = client.responses.create(model="m", input=items, tools=[FLAT_WEATHER], max_output_tokens=4,
                                extra_body={"seed": 1})
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 30


def test_tool_choice_required_gives_a_function_call_item(client):
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[FLAT_WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=CALL_TOKENS,
                                temperature=1.0, extra_body={"seed": 2})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])


def test_text_format_json_schema_output_validates(client):
    """``text.format`` ``json_schema`` (the Responses API's ``response_format``): the output text parses and
    validates, plain and streamed."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}}
    for seed in range(3):
        r = client.responses.create(model="m", input="Answer in JSON", text=fmt, max_output_tokens=48,
                                    temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and r.text.format.type == "json_schema", r
        jsonschema.validate(json.loads(r.output_text), schema)
    events = list(client.responses.create(model="m", input="Answer in JSON", text=fmt, max_output_tokens=48,
                                          temperature=1.0, stream=True, extra_body={"seed": 0}))
    assert events[-1].type == "response.completed"
    jsonschema.validate(json.loads(events[-1].response.output_text), schema)


def test_parallel_tool_calls_false_gives_at_most_one_function_call_item():
    """The Responses API takes the chat path's parser (``parser_factory`` over the translated chat request), so
    ``parallel_tool_calls: false`` leaves one ``function_call`` item of a text with two calls, plain and streamed
    (it used to leave both)."""
    from test_tools import TWO_CALLS, _out
    from unmask.server.protocol import ChatCompletionRequest
    from unmask.server.render import Render
    from unmask.server.responses import Usage
    from unmask.server.responses_api import EventWriter, from_chat_body
    from unmask.server.responses_protocol import ResponsesRequest
    from unmask.server.tool_parsers import parser_factory

    TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    for parallel, names in ((False, ["get_time"]), (None, ["get_time", "get_weather"])):
        req = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [FLAT_WEATHER, TIME],
                                               **({} if parallel is None else {"parallel_tool_calls": parallel})})
        chat = ChatCompletionRequest.model_validate(req.chat_body())

        def render():
            return Render("chat", "resp_x", 0, "m", str, tool_parser=parser_factory("hermes", chat))

        body = render().body([_out(TWO_CALLS)], Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))
        plain = from_chat_body("resp_x", 0, req, body)
        assert [o["name"] for o in plain["output"] if o["type"] == "function_call"] == names
        writer, r = EventWriter("resp_x", 0, req), render()
        chunks = [c for i in range(0, len(TWO_CALLS), 7) for c in r.text_chunks(0, TWO_CALLS[i:i + 7])]
        for c in chunks + r.finish_chunks(0, _out(TWO_CALLS)):
            writer.chunk(c)
        final = writer.end(body["usage"])[-1]["response"]
        assert [o["name"] for o in final["output"] if o["type"] == "function_call"] == names


def test_streaming_events_and_the_final_response(client):
    events = list(client.responses.create(model="m", input="Count to three", max_output_tokens=12, stream=True,
                                          extra_body={"seed": 0}))
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    seq = [e.sequence_number for e in events]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == final.output_text
    assert [o.status for o in final.output if o.type == "message"] == [final.status]
    plain = client.responses.create(model="m", input="Count to three", max_output_tokens=12, extra_body={"seed": 0})
    assert plain.output_text == text  # streamed = non-streamed for the same seed
    for t in ("response.output_item.added", "response.content_part.added", "response.content_part.done",
              "response.output_item.done"):
        assert t in types


def test_streamed_function_call_and_denoising_steps(client):
    body = {"model": "m", "input": "Weather?", "tools": [FLAT_WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": CALL_TOKENS, "temperature": 1.0, "seed": 4,
            "stream": True, "stream_options": {"include_denoising": True}}
    events = []
    http = client._client
    with http.stream("POST", "/v1/responses", json=body, headers={"Authorization": "Bearer k"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    steps = [e for e in events if e["type"] == "response.denoising_step"]
    assert steps and all(s["denoising"]["revealed"] for s in steps)
    args = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(args["arguments"]), SCHEMAS["get_weather"])
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [o["type"] for o in final["response"]["output"]] == ["function_call"]


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": "m", **body}, cast_to=object)
    err = e.value.body if isinstance(e.value.body, dict) and "param" in e.value.body else e.value.body["error"]
    assert err["param"] == param or err["param"].startswith(param) or param in err["message"], err


BAD_FIELDS = [  # (body, the Responses field the 400 must name exactly): never a chat-completion field
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}], "instructions": "Be."},
     "input.1.content"),                                        # chat's messages.2 (instructions shift it)
    ({"input": "hi", "instructions": "x\ud800"}, "instructions"),
    ({"input": "x\ud800"}, "input"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "zz", "output": "o"}]}, "input.2.call_id"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 3000 + "]" * 3000}]},
     "input.0.arguments"),                                      # nested past the body's rule: was a 500
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 1000 + "]" * 1000}]},
     "input.1.arguments"),
    ({"input": [{"role": "user", "content": "a"},                # parsed, but too deep for the template's tojson
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 600 + "]" * 600}]},
     "input.1.arguments"),
    ({"input": "hi", "tools": [FLAT_WEATHER, {"type": "function", "name": "g", "parameters": {
        "type": "object", "properties": {"a": json.loads("[" * 600 + "]" * 600)}}}]}, "tools.1.parameters"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input.0.arguments"),                                      # an object, not JSON text: was "input"
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": 7}]}, "input.1.arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input.1.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "o"},
                {"role": "user", "content": "again"},
                {"type": "function_call_output", "call_id": "c", "output": "o2"}]}, "input.3.call_id"),
    # the context (512 tokens): past the character pre-check (the longest field is named) and past it only in tokens
    ({"input": "hi", "instructions": "hello " * 2000}, "instructions"),
    ({"input": "hi", "instructions": "hello " * 1000}, "instructions"),  # instructions alone overflow: was "input"
    ({"input": "hello " * 1000, "instructions": "Be brief."}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "hello " * 2000}],
      "instructions": "Be brief."}, "input.1.content"),
    ({"input": "hi", "stream_options": {"include_denoising": True}}, "stream_options"),
    ({"input": "hi", "stream": False, "stream_options": {"include_denoising": True}}, "stream_options"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
     "text.format.name"),
    ({"input": "hi", "tools": [FLAT_WEATHER, {"type": "function", "name": "g", "parameters": {
        "type": "object", "properties": {"z": {"type": "frob"}}}}], "tool_choice": "required"}, "tools.1.parameters"),
    # llguidance segfaulted the server on these integer ranges (breaker F1)
    ({"input": "hi", "tools": [FLAT_WEATHER, {"type": "function", "name": "g", "parameters": {
        "type": "object", "properties": {"z": {"type": "integer", "minimum": -2e19, "maximum": -1e19}}}}],
      "tool_choice": "required"}, "tools.1.parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r", "schema": {
        "type": "integer", "minimum": -2 ** 63, "maximum": -2 ** 63}}}}, "text.format"),
]


@pytest.mark.parametrize("body,param", BAD_FIELDS)
def test_errors_name_the_responses_fields(client, body, param):
    """Errors of the translated chat request used to name chat fields (``messages.0.content``, ``max_tokens``),
    and ``stream_options`` without ``stream`` was accepted (breaker)."""
    raw = client._client.post("/v1/responses", content=json.dumps({"model": "m", **body}),
                              headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert raw.status_code == 400, raw.text
    err = raw.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    for chat_field in ("messages", "max_tokens", "max_completion_tokens", "response_format", "function.",
                       "tool_call_id"):
        assert chat_field not in err["message"], err


# the fields /v1/responses shares with chat completions (its name -> chat's): one declaration of their ranges
SHARED = {"max_output_tokens": "max_completion_tokens", **{f: f for f in (
    "temperature", "top_p", "seed", "steps", "block_size", "threshold", "remasking", "cfg_scale", "top_k", "cache")}}


def _bounds(props: dict, name: str) -> dict:
    """A field's published JSON schema without ``null``, its title, default and description."""
    schema = props[name]
    branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
    assert len(branches) == 1, (name, schema)
    return {k: v for k, v in branches[0].items() if k not in ("title", "default", "description")}


def test_the_published_ranges_are_the_chat_ranges(client):
    """The Responses schema used to publish ``steps``, ``block_size``, ``top_k``, ``remasking``... with no bound or
    enum while validation refused values outside them (schemathesis' positive cases got undocumented 400s)."""
    schema = client._client.get("/openapi.json").json()["components"]["schemas"]
    chat, responses = schema["ChatCompletionRequest"]["properties"], schema["ResponsesRequest"]["properties"]
    for ours, theirs in SHARED.items():
        bounds = _bounds(responses, ours)
        assert bounds == _bounds(chat, theirs), ours
        assert bounds.keys() & {"minimum", "exclusiveMinimum", "maximum", "enum"}, (ours, bounds)


@pytest.mark.parametrize("field,value", [("block_size", 513), ("block_size", 0), ("steps", 2**20 + 1),
                                         ("top_k", -2), ("threshold", 1.5), ("cfg_scale", 101), ("seed", -1),
                                         ("remasking", "sideways"), ("cache", "l2"), ("temperature", 2.5)])
def test_a_value_outside_the_published_range_is_a_400_naming_it(client, field, value):
    raw = client._client.post("/v1/responses", json={"model": "m", "input": "hi", field: value},
                              headers={"Authorization": "Bearer k"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == field, raw.text


def test_integral_numbers_are_integers_as_in_the_schema(client):
    """JSON Schema's integer includes ``4.0``: chat completions took it, /v1/responses refused it (schemathesis)."""
    body = {"model": "m", "input": "hi", "max_output_tokens": 4.0, "top_k": 2.0, "seed": 1.0, "block_size": 4.0,
            "steps": 4.0}
    raw = client._client.post("/v1/responses", json=body, headers={"Authorization": "Bearer k"})
    assert raw.status_code == 200 and raw.json()["usage"]["output_tokens"] <= 4, raw.text
    for value in (2.5, "2", True):
        raw = client._client.post("/v1/responses", json={**body, "top_k": value}, headers={"Authorization": "Bearer k"})
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "top_k", (value, raw.text)


def test_a_block_size_error_names_max_output_tokens(client):
    """The block-size bound depends on the generation length: a Responses request has no ``max_tokens``, so the
    message names ``max_output_tokens`` (it named ``max_tokens``)."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input="hi", max_output_tokens=2, extra_body={"block_size": 64})
    err = exc.value.body
    assert err["param"] == "block_size" and "max_output_tokens 2" in err["message"]
    assert "max_tokens" not in err["message"].replace("max_output_tokens", "")
