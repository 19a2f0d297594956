"""Breaking DiffusionGemma through the server (docs/design.md#decoding, "Uniform canvas";
docs/design.md#admission-and-limits): refusals name a field the client can change, and the server keeps serving."""
from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from diffusion_gemma_tiny import save_replica
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.model import load_model
from unmask.server.app import build_app

CO = "/v1/completions"


@pytest.fixture(scope="module")
def wide_canvas(tmp_path_factory):
    """transformers' default canvas (256 tokens: past the default --max-step-rows of 130)."""
    path = tmp_path_factory.mktemp("diffusion_gemma_256")
    save_replica(path, canvas_length=256)
    with TestClient(build_app(AsyncEngine(load_model(str(path), device="cpu")), "m")) as c:
        yield c


def test_a_canvas_wider_than_the_step_limit_is_served_and_n_is_named(wide_canvas):
    body = {"model": "m", "prompt": "Diffusion", "max_tokens": 4, "seed": 1, "max_denoising_steps": 2}
    one = wide_canvas.post(CO, json=body)
    assert one.status_code == 200, one.text  # was a 400 naming block_size, which the checkpoint fixes
    assert one.json()["usage"]["completion_tokens"] == 4
    two = wide_canvas.post(CO, json={**body, "n": 2})
    assert two.status_code == 400, two.text
    assert two.json()["error"]["param"] == "n", two.json()
    assert "--max-step-rows" in two.json()["error"]["message"]
    assert wide_canvas.post(CO, json=body).json()["choices"][0]["text"] == one.json()["choices"][0]["text"]


CH = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma_8")
    save_replica(path, canvas_length=8)
    engine = AsyncEngine(load_model(str(path), device="cpu"))
    with TestClient(build_app(engine, "m")) as c:
        yield c, engine


def _body(i: int) -> dict:
    """Mixed requests: prompt lengths, seeds, max_tokens not a multiple of the canvas, steps, schedules, stops."""
    return {"model": "m", "messages": [{"role": "user", "content": f"prompt number {i} " * (1 + i % 3)}],
            "max_tokens": 13 + i, "seed": 100 + i, "max_denoising_steps": 3 + i % 4, "t_min": 0.1 * (i % 3),
            "t_max": 0.9, **({"stop": ["zz"]} if i % 2 else {})}


def _streamed(client, body: dict, keep: int | None = None) -> str:
    """The content deltas of a streamed request (denoising chunks shown); ``keep``: hang up after that many lines."""
    text = ""
    with client.stream("POST", CH, json={**body, "stream": True, "stream_options": {"include_denoising": True}}) as r:
        assert r.status_code == 200, r.read()
        for k, line in enumerate(r.iter_lines()):
            if keep is not None and k >= keep:
                break
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and not chunk.get("denoising"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("extra, field", [
    ({"temperature": 0.7}, "temperature"), ({"top_k": 5}, "top_k"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"steps": 4}, "steps"), ({"block_size": 4}, "block_size"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"), ({"response_format": {"type": "json_object"}},
                                                                    "response_format"),
    ({"t_min": 0.8, "t_max": 0.8}, "t_max"), ({"max_denoising_steps": 0}, "max_denoising_steps"),
    ({"max_denoising_steps": 1025}, "max_denoising_steps"), ({"entropy_bound": -1.0}, "entropy_bound"),
    ({"confidence_threshold": 0}, "confidence_threshold"), ({"stability_threshold": -1}, "stability_threshold"),
    ({"max_tokens": 100_000}, "max_tokens"), ({"n": 17}, "n"),
])
def test_a_refused_field_is_a_400_naming_it_and_the_server_keeps_serving(served, extra, field):
    client, _ = served
    r = client.post(CH, json={**_body(0), **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()
    assert client.post(CH, json={**_body(0), "max_tokens": 4}).status_code == 200


def test_concurrent_mixed_requests_and_hang_ups_get_their_own_tokens(served):
    """Each request alone = beside five others (half streamed, content deltas = the plain text); clients that hang
    up mid-stream leave nothing running and the encoder store within its bound; the next request is unchanged."""
    client, engine = served
    alone = [client.post(CH, json=_body(i)).json()["choices"][0]["message"]["content"] for i in range(6)]
    got = [None] * 6

    def one(i):
        got[i] = _streamed(client, _body(i)) if i % 2 else \
            client.post(CH, json=_body(i)).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    for i in range(3):
        _streamed(client, {**_body(i), "max_tokens": 200, "max_denoising_steps": 8}, keep=5)
    deadline = time.monotonic() + 10
    while engine.engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.scheduler.running
    store = engine.engine.denoiser.encoder_store
    assert len(store._entries) <= store.max_entries
    assert client.post(CH, json=_body(0)).json()["choices"][0]["message"]["content"] == alone[0]
