"""Golden SSE bytes: seeded streamed requests against a tiny random model served in-process by the real app
(``build_app`` over an ``AsyncEngine``, Starlette's TestClient), compared byte for byte with
``tests/server/golden/sse/<case>.txt`` (issue 39: recorded before the configuration and plan refactor, identical
after it; issue 40 recorded the two logprobs cases again: each content chunk now carries its tokens' logprobs).

Normalized, because they legitimately vary between runs: the response ``id`` (``chatcmpl-``/``cmpl-`` + random
hex -> ``<id>``) and ``created`` (unix seconds -> 0). Nothing else: the stream carries no timing fields (usage
counts tokens, forwards and steps only). Record again (only when a change of the bytes is intended) with
``UNMASK_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/server/test_sse_golden.py``.

Three servings of two tiny models (the default ones of ``tests/tiny.loaded``):

* ``plain``: a prefix-causal checkpoint without decoding defaults, every option at its default;
* ``defaults``: a checkpoint whose ``dllm`` sets a speculative default, a default threshold and temperature and a
  plain-diffusion block of 2, served as ``unmask serve --block-size 3 --max-model-len 48 --default-max-tokens 16
  --default-drafts on --cache none`` would serve it;
* ``defaults-auto``: the same checkpoint with every serve option at its default (no drafts on a CPU).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tiny import loaded

GOLDEN = Path(__file__).parent / "golden" / "sse"
RECORD = os.environ.get("UNMASK_RECORD_GOLDEN") == "1"
C, CH = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "What is the capital of France?"}]


def _stream(body: dict, usage: bool = False, denoising: bool = False) -> dict:
    opts = {k: True for k, on in (("include_usage", usage), ("include_denoising", denoising)) if on}
    return {"model": "m", "stream": True, **({"stream_options": opts} if opts else {}), **body}


# case name -> (serving, route, body)
CASES = {
    "plain-completion-greedy": ("plain", C, _stream({"prompt": "The quick brown fox", "max_tokens": 8,
                                                     "temperature": 0, "seed": 0, "ignore_eos": True}, usage=True)),
    "plain-completion-sampled-steps-n2": ("plain", C, _stream({"prompt": "One two three", "max_tokens": 8,
                                                               "temperature": 0.8, "seed": 3, "steps": 4, "n": 2,
                                                               "ignore_eos": True}, usage=True, denoising=True)),
    "plain-completion-logprobs": ("plain", C, _stream({"prompt": "Diffusion language", "max_tokens": 6,
                                                       "temperature": 0, "seed": 1, "logprobs": 1,
                                                       "remasking": "entropy", "ignore_eos": True})),
    "plain-chat-threshold": ("plain", CH, _stream({"messages": HI, "max_tokens": 8, "temperature": 0, "seed": 0,
                                                   "threshold": 0.3, "ignore_eos": True}, denoising=True)),
    "plain-chat-speculative-sampled-n2": ("plain", CH, _stream({"messages": HI, "max_tokens": 8, "temperature": 0.7,
                                                                "seed": 5, "speculative": True, "n": 2,
                                                                "ignore_eos": True}, usage=True)),
    "plain-chat-speculative-greedy": ("plain", CH, _stream({"messages": HI, "max_tokens": 8, "temperature": 0,
                                                            "speculative": True, "ignore_eos": True},
                                                           usage=True, denoising=True)),
    "plain-chat-logprobs-cfg": ("plain", CH, _stream({"messages": HI, "max_tokens": 6, "temperature": 0, "seed": 2,
                                                      "logprobs": True, "top_logprobs": 1, "cfg_scale": 1.0,
                                                      "ignore_eos": True}, usage=True)),
    "defaults-chat-no-params": ("defaults", CH, _stream({"messages": HI, "seed": 0}, usage=True, denoising=True)),
    "defaults-completion-steps-sampled-n2": ("defaults", C, _stream({"prompt": "One two", "max_tokens": 6,
                                                                     "steps": 3, "temperature": 0.9, "seed": 11,
                                                                     "n": 2, "ignore_eos": True}, usage=True)),
    "defaults-completion-cfg-threshold": ("defaults", C, _stream({"prompt": "The quick", "max_tokens": 6, "seed": 4,
                                                                  "cfg_scale": 0.5, "ignore_eos": True},
                                                                 denoising=True)),
    "defaults-completion-fitted": ("defaults", C, _stream({"prompt": "The quick brown fox jumps over the lazy "
                                                                     "dog. The quick",
                                                           "seed": 9, "ignore_eos": True}, usage=True)),
    "defaults-auto-chat-no-params": ("defaults-auto", CH, _stream({"messages": HI, "seed": 0}, usage=True)),
    "defaults-auto-completion-diffusion-block": ("defaults-auto", C, _stream({"prompt": "One two", "max_tokens": 6,
                                                                              "steps": 6, "seed": 1,
                                                                              "ignore_eos": True}, denoising=True)),
}

_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')


def normalize(raw: bytes) -> bytes:
    """``raw`` with the response id and ``created`` replaced (the fields that vary between runs)."""
    return _CREATED.sub(b'"created":0', _ID.sub(rb'"id":"\1-<id>"', raw))


def defaults_model():
    """The tiny prefix-causal model with decoding defaults in its ``dllm`` (speculative, threshold, temperature,
    a plain-diffusion block)."""
    m = loaded(block_size=4)
    m.dllm.default_sampling = {"speculative": True, "threshold": 0.6, "temperature": 0.0}
    m.dllm.diffusion_block_size = 2
    m.dllm.validate()
    return m


def serve_app(model, **options):
    """The app ``unmask serve`` builds for ``model`` with these options (``--block-size 3`` is ``block_size=3``;
    the rest at their defaults): the engine's options to the ``AsyncEngine``, the server's to ``build_app``."""
    import dataclasses

    from unmask.engine import EngineConfig
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app
    from unmask.server.config import ServerConfig

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = AsyncEngine(model, EngineConfig(**{k: v for k, v in options.items() if k in engine_fields}))
    return build_app(engine, "m", ServerConfig(**{k: v for k, v in options.items() if k not in engine_fields}))


SERVINGS = {
    "plain": lambda: serve_app(loaded(block_size=4)),
    "defaults": lambda: serve_app(defaults_model(), block_size=3, max_model_len=48, default_max_tokens=16,
                                  default_drafts="on", cache="none"),
    "defaults-auto": lambda: serve_app(defaults_model()),
}


@pytest.fixture(scope="module")
def bodies():
    """Every case's normalized SSE body, the cases of one serving in order through one app."""
    out = {}
    for serving, make in SERVINGS.items():
        with TestClient(make()) as client:
            for name, (where, route, body) in CASES.items():
                if where != serving:
                    continue
                with client.stream("POST", route, json=body) as r:
                    assert r.status_code == 200, (name, r.read())
                    out[name] = normalize(r.read())
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_sse_bytes_match_golden(bodies, name):
    path = GOLDEN / f"{name}.txt"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bodies[name])
    assert path.is_file(), f"no golden file {path}: record with UNMASK_RECORD_GOLDEN=1"
    assert bodies[name] == path.read_bytes(), name


def test_golden_cover_the_decoding_paths():
    """The recorded streams include denoising steps of every strategy, usage chunks and two-choice requests."""
    texts = {name: (GOLDEN / f"{name}.txt").read_text(encoding="utf-8") for name in CASES}
    assert all(t.rstrip().endswith("data: [DONE]") for t in texts.values())
    assert '"denoising":' in texts["plain-chat-threshold"] and '"denoising":' in texts["defaults-chat-no-params"]
    assert '"choices":[]' in texts["plain-completion-greedy"]
    assert '"index":1' in texts["plain-chat-speculative-sampled-n2"]
