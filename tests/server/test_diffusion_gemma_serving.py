"""DiffusionGemma through the server (docs/design.md#http-contract, "Revisable canvases"): a streamed request whose
denoising chunks show the canvas changing between steps while its content deltas only ever append final text, equal
to the non-streamed answer; image inputs and the fields the uniform-canvas sampler does not honour are 400s naming
the field; the held-out OpenAI checks (llm-comply, system) on a tiny DiffusionGemma checkpoint."""
from __future__ import annotations


import pytest
from fastapi.testclient import TestClient

from diffusion_gemma_tiny import save_replica
from revisable_stream import check_revisable_stream
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.model import load_model
from unmask.server.app import build_app

CH = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "Diffusion language models"}], "max_tokens": 24,
        "seed": 3, "max_denoising_steps": 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    save_replica(path, canvas_length=8)
    return path


@pytest.fixture(scope="module")
def client(checkpoint):
    with TestClient(build_app(AsyncEngine(load_model(str(checkpoint), device="cpu")), "m")) as c:
        yield c


def test_a_streamed_request_refines_its_canvas_but_never_its_content(client):
    chunks, content = check_revisable_stream(client, BODY)
    # content was sent while a later canvas was still refined, and what a client received is a prefix of the answer
    sent, prefixes, later = "", [], 0
    for c in chunks:
        d = c.get("denoising")
        if d is not None and sent and d.get("final"):
            later += 1
        elif c.get("choices") and not d and c["choices"][0]["delta"].get("content"):
            sent += c["choices"][0]["delta"]["content"]
            prefixes.append(sent)
    assert later > 0 and prefixes
    assert all(content.startswith(p) for p in prefixes)


def test_the_seed_gives_the_same_answer_and_usage_counts_it(client):
    a, b = client.post(CH, json=BODY).json(), client.post(CH, json=BODY).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("extra, field", [({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"),
                                          ({"logprobs": True}, "logprobs"), ({"t_min": 0.9}, "t_max"),
                                          ({"min_tokens": 3}, "min_tokens")])
def test_what_the_sampler_does_not_do_is_a_400_naming_the_field(client, extra, field):
    r = client.post(CH, json={**BODY, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert client.post(CH, json=BODY).status_code == 200  # and the server keeps serving


def test_an_image_input_is_a_400_naming_the_field(client):
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    r = client.post(CH, json={**BODY, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages"), r.json()


@pytest.mark.system
def test_llm_comply_on_a_tiny_diffusion_gemma(checkpoint, tmp_path):
    from test_comply import check_checkpoint_complies

    check_checkpoint_complies(tmp_path, str(checkpoint))


def test_n_choices_take_seed_and_seed_plus_one_and_a_stop_string_cuts_the_text(client):
    two = client.post(CH, json={**BODY, "n": 2}).json()
    texts = [c["message"]["content"] for c in sorted(two["choices"], key=lambda c: c["index"])]
    one = client.post(CH, json={**BODY, "seed": BODY["seed"] + 1}).json()["choices"][0]["message"]["content"]
    assert texts[1] == one and texts[0] == client.post(CH, json=BODY).json()["choices"][0]["message"]["content"]
    stop = texts[0][2:4]
    cut = client.post(CH, json={**BODY, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and texts[0].startswith(cut["message"]["content"])
    assert stop not in cut["message"]["content"]


def test_the_responses_api_takes_the_uniform_canvas_fields_as_chat_completions_does(client):
    """``/v1/responses`` passes the sampler's knobs through (same answer as chat completions with the same ones),
    and refuses a bad one with a 400 naming it."""
    knobs = {"seed": 5, "max_denoising_steps": 4, "t_min": 0.2, "t_max": 0.6, "entropy_bound": 0.5,
             "stability_threshold": 2, "confidence_threshold": 0.01}
    chat = client.post(CH, json={**BODY, **knobs}).json()["choices"][0]["message"]["content"]
    r = client.post("/v1/responses", json={"model": "m", "input": BODY["messages"][0]["content"],
                                           "max_output_tokens": BODY["max_tokens"], **knobs})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == chat
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "t_min": 0.9, "t_max": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "t_max", r.text


def test_temperature_one_the_openai_default_is_the_schedule_itself(client):
    """Clients send ``temperature: 1`` unasked (OpenAI's default): the answer is the one without it; any other value
    stays a 400 naming ``temperature``."""
    plain = client.post(CH, json=BODY).json()["choices"][0]["message"]["content"]
    r = client.post(CH, json={**BODY, "temperature": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain
    assert client.post(CH, json={**BODY, "temperature": 0.0}).json()["error"]["param"] == "temperature"
