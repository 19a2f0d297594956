"""``unmask serve`` with no MODEL serves the default SmolLM2 A2D model (slow: converts the GGUF once into
``$UNMASK_HOME``, then loads the 135M model)."""
from __future__ import annotations

import re
import signal

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_serve_without_model_serves_the_default_and_says_which(tmp_path):
    from serving import require_default_model, start_serve

    require_default_model()
    proc, base, log_path = start_serve(tmp_path, timeout=600)
    try:
        text = log_path.read_text()
        served = re.search(r"serving (the (UNTRAINED|trained|default) .*?) as '([^']+)'", text)
        assert served, text[-2000:]
        name = served.group(3)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == name
        r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"].strip()
        if served.group(2) == "UNTRAINED":  # block_size 1: one token per forward, exactly the AR parent's decoding
            assert "block_size=1" in text
            assert body["usage"]["nfe"] == body["usage"]["completion_tokens"]
        if served.group(2) == "default":  # the parent + the shipped mask-row adapter (docs/design.md#mask-row-adapter)
            assert "mask-row adapter" in text
            msgs = [{"role": "user", "content": "Write a sentence about the sea."}]
            greedy = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": name, "messages": msgs, "max_tokens": 32, "temperature": 0}).json()
            parent = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": name, "messages": msgs, "max_tokens": 32, "temperature": 0, "block_size": 1,
                "speculative": False}).json()
            # greedy requests get the parent's exact answer (block 1 runs only the parent's weights)
            assert greedy["choices"][0]["message"]["content"] == parent["choices"][0]["message"]["content"]
            diffusion = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": name, "messages": msgs, "max_tokens": 32, "temperature": 0, "block_size": 4,
                "threshold": 0.5}).json()
            usage = diffusion["usage"]
            assert diffusion["choices"][0]["message"]["content"].strip()
            # a fresh clone's default decodes in parallel: more tokens than forwards (issue 25; docs/adapter.md)
            assert usage["completion_tokens"] > usage["nfe"], usage
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
