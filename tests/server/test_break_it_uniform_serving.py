"""Breaking DiffusionGemma through the server (docs/design.md#decoding, "Uniform canvas";
docs/design.md#admission-and-limits): refusals name a field the client can change, and the server keeps serving."""
from __future__ import annotations

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
