"""Break-it tests of the diffusion extras on ``/v1/responses`` (server/responses_protocol.py ``SHARED_EXTRAS``): each
field takes what chat completions takes (integer-valued floats, null, bounds, wrong types) with a 400 naming the
Responses field, on a plain tiny model and on DiffusionGemma, streamed too; DiffusionGemma's neutral
``temperature: 1``."""
from __future__ import annotations

import json
import types
import typing

import pytest
from fastapi.testclient import TestClient

from diffusion_gemma_tiny import save_replica
from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.model import load_model
from unmask.server import protocol
from unmask.server.app import build_app
from unmask.server.responses_protocol import EXTRAS, INTEGER_FIELDS, ResponsesRequest

CH, RS = "/v1/chat/completions", "/v1/responses"
PROMPT = "Diffusion language models"
UNIFORM = {"seed": 5, "max_denoising_steps": 4, "t_min": 0.2, "t_max": 0.6, "entropy_bound": 0.5,
           "stability_threshold": 2, "confidence_threshold": 0.01}


def _int_fields(cls) -> set[str]:
    """The fields of a request model whose type admits an integer (``int`` or ``int | None``)."""
    out = set()
    for name, field in cls.model_fields.items():
        a = field.annotation
        members = typing.get_args(a) if isinstance(a, types.UnionType) or typing.get_origin(a) is typing.Union \
            else (a,)
        if int in members and bool not in members:
            out.add(name)
    return out


def test_every_integer_field_of_every_request_model_takes_an_integral_float():
    """JSON Schema's integer includes ``7.0``: the integer fields of chat completions and completions missed
    ``max_post_steps``, ``max_denoising_steps`` and ``stability_threshold`` (a 400 there, a 200 on /v1/responses,
    whose list had them)."""
    assert _int_fields(ResponsesRequest) <= INTEGER_FIELDS
    for cls in (protocol.ChatCompletionRequest, protocol.CompletionRequest):
        missing = _int_fields(cls) - protocol._INTEGER_FIELDS - ({"logprobs"} if cls is protocol.CompletionRequest
                                                                 else set())
        assert not missing, (cls.__name__, missing)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    save_replica(path, canvas_length=8)
    with TestClient(build_app(AsyncEngine(load_model(str(path), device="cpu")), "m")) as c:
        yield c


@pytest.fixture(scope="module")
def plain():
    model = loaded(block_size=4)
    model.dllm.default_sampling = {"temperature": 0.0, "threshold": 0.0}  # a checkpoint default threshold
    with TestClient(build_app(AsyncEngine(model), "m")) as c:
        yield c


def _chat(extra, max_tokens=16):
    return {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, **extra}


def _resp(extra, max_tokens=16):
    return {"model": "m", "input": PROMPT, "max_output_tokens": max_tokens, **extra}


def _text(r) -> str:
    j = r.json()
    return j["choices"][0]["message"]["content"] if "choices" in j else j["output"][0]["content"][0]["text"]


def test_integral_floats_of_the_uniform_canvas_fields_on_both_apis(gemma):
    """``max_denoising_steps: 4.0`` and ``stability_threshold: 2.0`` are 4 and 2 on chat completions and on
    /v1/responses (same text as the integers); ``4.5`` is a 400 naming the field on both."""
    want = _text(gemma.post(CH, json=_chat(UNIFORM)))
    floats = {**UNIFORM, "max_denoising_steps": 4.0, "stability_threshold": 2.0}
    for path, body in ((CH, _chat(floats)), (RS, _resp(floats))):
        r = gemma.post(path, json=body)
        assert r.status_code == 200 and _text(r) == want, (path, r.text)
    for name in ("max_denoising_steps", "stability_threshold"):
        for path, body in ((CH, _chat({**UNIFORM, name: 4.5})), (RS, _resp({**UNIFORM, name: 4.5}))):
            r = gemma.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, r.text)


@pytest.mark.parametrize("name,value", [("max_denoising_steps", 0), ("max_denoising_steps", "4"),
                                        ("max_denoising_steps", True), ("t_min", -0.1), ("t_max", 0.1),
                                        ("entropy_bound", 0), ("entropy_bound", "x"), ("stability_threshold", -1),
                                        ("stability_threshold", 1.5), ("confidence_threshold", 0),
                                        ("temperature", 0.7), ("temperature", 0)])
def test_a_bad_uniform_canvas_field_is_the_same_400_on_both_apis_and_streamed(gemma, name, value):
    """The same 400 and ``param`` (the Responses field's own name) on chat completions, /v1/responses and a streamed
    /v1/responses request; the server keeps serving."""
    seen = []
    for path, body in ((CH, _chat({**UNIFORM, name: value})), (RS, _resp({**UNIFORM, name: value})),
                       (RS, _resp({**UNIFORM, name: value, "stream": True}))):
        r = gemma.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        seen.append(r.json()["error"]["param"])
    assert len(set(seen)) == 1 and seen[0] in (name, "t_max"), seen
    assert gemma.post(RS, json=_resp(UNIFORM)).status_code == 200


def test_null_uniform_canvas_fields_are_absent_and_temperature_one_is_neutral(gemma):
    """``null`` for every uniform-canvas field is the field absent; ``temperature: 1`` (and ``1.0``, with
    ``top_p: 1``) the answer without it, on both APIs."""
    want = _text(gemma.post(CH, json=_chat({"seed": 5})))
    nulls = {name: None for name in UNIFORM if name != "seed"}
    for extra in (nulls, {"temperature": 1}, {"temperature": 1.0, "top_p": 1}):
        for path, body in ((CH, _chat({"seed": 5, **extra})), (RS, _resp({"seed": 5, **extra}))):
            r = gemma.post(path, json=body)
            assert r.status_code == 200 and _text(r) == want, (path, extra, r.text)


def test_a_streamed_responses_request_with_the_knobs_ends_with_the_plain_text(gemma):
    """Streamed with every knob and denoising steps: content deltas concatenate to the non-streamed text, and the
    denoising events show the canvas."""
    want = _text(gemma.post(RS, json=_resp({**UNIFORM, "temperature": 1})))
    body = _resp({**UNIFORM, "temperature": 1, "stream": True, "stream_options": {"include_denoising": True}})
    with gemma.stream("POST", RS, json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")
                  and line[5:].strip() != "[DONE]"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == want
    assert any(e["type"] == "response.denoising_step" and e["denoising"]["canvas"] for e in events)


def test_an_explicit_null_threshold_turns_the_checkpoint_default_off_on_responses_too(plain):
    """Chat completions' ``"threshold": null`` decodes without the checkpoint's default threshold (one token per
    step here); /v1/responses dropped the null, so the default threshold still ran (2 forwards, not 8)."""
    nfe = {}
    for name, extra in (("absent", {}), ("null", {"threshold": None}), ("steps", {"steps": 4})):
        chat = plain.post(CH, json=_chat(extra, 8)).json()["usage"]["nfe"]
        resp = plain.post(RS, json=_resp(extra, 8)).json()["usage"]["nfe"]
        assert chat == resp, (name, chat, resp)
        nfe[name] = resp
    assert nfe == {"absent": 2, "null": 8, "steps": 4}


@pytest.mark.parametrize("name", EXTRAS)
def test_each_extra_on_a_plain_model_answers_as_chat_completions_does(plain, name):
    """Each Responses extra with a valid, a null, an integral-float, a wrong-type and an out-of-range value: the
    status and ``param`` chat completions gives."""
    values = [None, 2.0, "x", True, -5, 10 ** 9, [1]]
    for value in values:
        a = plain.post(CH, json=_chat({name: value}, 8))
        b = plain.post(RS, json=_resp({name: value}, 8))
        param = (lambda r: r.json()["error"]["param"] if r.status_code != 200 else None)
        assert (a.status_code, param(a)) == (b.status_code, param(b)), (name, value, a.text, b.text)


@pytest.fixture(scope="module")
def llada2():
    from llada2_tiny import loaded_llada2

    with TestClient(build_app(AsyncEngine(loaded_llada2(seed=1)), "m")) as c:
        yield c


@pytest.mark.parametrize("which,extra", [
    ("llada2", {"editing_threshold": 0.3, "max_post_steps": 2.0, "threshold": 0.6, "seed": 1, "temperature": 0.9}),
    ("plain", {"multi_block": 0.5, "block_size": 4, "seed": 3, "temperature": 0.8, "steps": 8.0}),
    ("plain", {"cfg_scale": 0.5, "remasking": "margin", "threshold": None, "seed": 4, "sub_block_size": 2})])
def test_streamed_extras_give_the_plain_and_the_chat_answer(which, extra, request):
    """Token editing (provisional tokens), multi-block and CFG with a null threshold, streamed on /v1/responses
    with denoising steps: the deltas, the final response, the plain response and chat completions agree."""
    client = request.getfixturevalue(which)
    body = _resp(extra, 24)
    text = _text(client.post(RS, json=body))
    with client.stream("POST", RS, json={**body, "stream": True, "stream_options": {"include_denoising": True}}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")
                  and line[5:].strip() != "[DONE]"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert any(e["type"] == "response.denoising_step" for e in events)
    assert _text(client.post(CH, json=_chat(extra, 24))) == text


def test_every_extra_publishes_the_chat_schema(plain):
    """Each diffusion extra of /v1/responses publishes chat completions' bounds and enum (the shared ones are copies
    of chat's fields: a bound added there must show here)."""
    schema = plain.get("/openapi.json").json()["components"]["schemas"]
    chat, responses = schema["ChatCompletionRequest"]["properties"], schema["ResponsesRequest"]["properties"]

    def bounds(props, name):
        branches = [b for b in props[name].get("anyOf", [props[name]]) if b.get("type") != "null"]
        return [{k: v for k, v in b.items() if k not in ("title", "default", "description")} for b in branches]

    for name in EXTRAS:
        assert bounds(responses, name) == bounds(chat, name), name
