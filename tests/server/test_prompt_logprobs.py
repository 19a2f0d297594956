"""Prompt log-probabilities over HTTP (docs/api-fields.md#prompt-log-probabilities): lm-eval's log-likelihood request
(``echo``, ``logprobs: 1``, ``max_tokens`` 1 or 0, token-id prompts) answers the parent's float32 log-probabilities
on a causal path, vLLM's ``prompt_logprobs`` on both endpoints, a Monte-Carlo estimate with its standard error on a
bidirectional model, a 400 where neither applies."""
from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 18, 64, 120]]


def _client(m):
    return TestClient(build_app(AsyncEngine(m), "m"))


@pytest.fixture(scope="module")
def causal():
    m = loaded()
    with _client(m) as c:
        yield m, c


def test_lm_eval_request_is_the_parents_log_likelihood(causal):
    m, c = causal
    for max_tokens in (0, 1):  # lm-eval 0.4.13 sends 1 and drops the last entry
        r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPTS, "temperature": 0, "max_tokens": max_tokens,
                                            "logprobs": 1, "seed": 1234, "echo": True})
        assert r.status_code == 200, r.text
        for ids, choice in zip(PROMPTS, sorted(r.json()["choices"], key=lambda ch: ch["index"])):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
            with torch.no_grad():
                want = torch.log_softmax(m.model(torch.tensor([ids])).logits[0].float(), -1)
            for i in range(1, len(ids)):
                assert abs(lp["token_logprobs"][i] - want[i - 1, ids[i]].item()) < 1e-4
                assert max(lp["top_logprobs"][i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
            est = choice["prompt_log_likelihood"]
            assert est["method"] == "causal" and est["stderr"] == 0
    assert r.json()["usage"]["completion_tokens"] == 2


def test_prompt_logprobs_vllm_shape_on_both_endpoints(causal):
    _, c = causal
    r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 0, "prompt_logprobs": 2})
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(PROMPTS[0])
    for i, entry in enumerate(pl[1:], 1):
        own = entry[str(PROMPTS[0][i])]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
        assert {e["rank"] for k, e in entry.items() if k != str(PROMPTS[0][i])} <= {1, 2}
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None
    assert r.json()["prompt_log_likelihood"]["method"] == "causal"


def test_refusals(causal):
    _, c = causal
    for body, param in (({"max_tokens": 0}, "max_tokens"),
                        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
                        ({"prompt_logprobs": 1, "prompt_logprobs_samples": 0}, "prompt_logprobs_samples")):
        r = c.post("/v1/completions", json={"model": "m", "prompt": "Hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_monte_carlo_estimate_on_a_bidirectional_model():
    m = loaded(attention="bidirectional", logit_shift=False)
    with _client(m) as c:
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 1,
                "prompt_logprobs_samples": 16, "seed": 3}
        a, b = (c.post("/v1/completions", json=body).json()["choices"][0] for _ in range(2))
        assert a["logprobs"] == b["logprobs"]  # a fixed seed
        est = a["prompt_log_likelihood"]
        assert est["method"] == "monte_carlo" and est["samples"] == 16 and est["seed"] == 3 and est["stderr"] > 0
        assert sum(a["logprobs"]["token_logprobs"][1:]) == pytest.approx(est["value"], abs=1e-6)


def test_no_causal_path_is_a_400():
    m = loaded(attention="block_causal", logit_shift=False, block_alignment="absolute", fixed_block_size=True)
    with _client(m) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 0, "echo": True,
                                            "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
