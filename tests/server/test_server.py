"""The OpenAI-compatible server against a real uvicorn process (``unmask serve``) on a tiny a2d checkpoint.

One server process per module. It requires an API key, has 8 batch slots and a queue of 16 sequences.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import time

import httpx
import pytest

from serving import assert_exits_cleanly, start_server

KEY = "sk-test-unmask"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base, log_path = start_server(tmp_path_factory.mktemp("server"), "--served-model-name", MODEL,
                                        "--api-key", KEY, "--max-batch-size", "8", "--max-queue", "16",
                                        "--default-max-tokens", "16")
    yield {"url": base, "log": log_path, "proc": proc}
    # graceful shutdown with a stream open: the stream ends with an error event and [DONE], then the process exits
    import threading

    tail: list[str] = []
    started = threading.Event()

    def long_stream():
        body = {"model": MODEL, "prompt": "One", "max_tokens": 480, "ignore_eos": True, "cache": "none",
                "stream": True, "stream_options": {"include_denoising": True}}
        try:
            with httpx.stream("POST", base + C, json=body, headers=AUTH, timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: "):
                        tail.append(line[6:])
        except httpx.HTTPError as exc:  # pragma: no cover - reported by the assertion below
            tail.append(repr(exc))

    plain: dict = {}

    def long_plain():  # a non-streamed request in flight: a JSON 503 at once, not uvicorn's 500 after 10 s
        body = {"model": MODEL, "prompt": "Two", "max_tokens": 480, "ignore_eos": True, "cache": "none"}
        try:
            r = httpx.post(base + C, json=body, headers=AUTH, timeout=60)
            plain.update(status=r.status_code, body=r.text, at=time.time())
        except httpx.HTTPError as exc:  # pragma: no cover - reported by the assertion below
            plain.update(status=None, body=repr(exc), at=time.time())

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    poster = threading.Thread(target=long_plain, daemon=True)
    poster.start()
    started.wait(30)
    time.sleep(0.5)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    # a graceful stop is a clean exit (uvicorn re-raises the captured SIGTERM; `unmask serve` absorbs it)
    assert_exits_cleanly(proc, log_path)
    assert "stopped by SIGTERM" in log_path.read_text()
    assert "Application shutdown complete" in log_path.read_text()
    reader.join(10)
    assert tail[-1] == "[DONE]" and json.loads(tail[-2])["error"]["code"] == "server_shutdown", tail[-3:]
    poster.join(10)
    assert plain["status"] == 503, plain
    assert json.loads(plain["body"])["error"]["code"] == "server_shutdown" and plain["at"] - sent < 5, plain
    assert "Exception in ASGI application" not in log_path.read_text()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=60) as client:
        yield client


def health(http) -> dict:
    return http.get("/health").json()


def sse(http, path, body) -> tuple[httpx.Response, list]:
    """POST a streaming request; return the response and the parsed data payloads ('[DONE]' kept as a string)."""
    out = []
    with http.stream("POST", path, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "" or line.startswith(":"), line
    return r, out


def scrape(http) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


# ---------------------------------------------------------------------------------------------- basics
def test_models_health_metrics_routes(http, server):
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["object"] == "list" and r.json()["data"][0]["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # every route's 404 names the served id (a client configured with another name needs it: new-user pass)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"}), ("/v1/responses", {"input": "Hi"}),
                       ("/tokenize", {"prompt": "Hi"})):
        r = http.post(path, json={"model": "nope", **body})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
        assert f"this server serves `{MODEL}`" in r.json()["error"]["message"], (path, r.text)
    h = health(http)
    assert h["status"] == "ok" and h["running"] == 0
    r = httpx.get(f"{server['url']}/metrics", follow_redirects=False)  # no auth, no redirect
    assert r.status_code == 200 and "unmask:num_requests_running" in r.text
    schema = http.get("/openapi.json").json()
    req = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert req["additionalProperties"] is False and req["properties"]["model"]["enum"] == [MODEL]
    assert req["properties"]["temperature"]["anyOf"][0]["maximum"] == 2
    # null means the default (docs/design.md#admission-and-limits): the enum is the first member of anyOf
    assert set(req["properties"]["remasking"]["anyOf"][0]["enum"]) == {"low_confidence", "margin", "entropy",
                                                                       "random", "left_to_right"}


# ---------------------------------------------------------------------------------------------- openai SDK
def test_openai_sdk_sync(server):
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    comp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0, seed=1)
    assert comp.object == "text_completion" and comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage.prompt_tokens + comp.usage.completion_tokens == comp.usage.total_tokens
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                            seed=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == comp.usage.completion_tokens

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                          seed=3, n=2, extra_body={"steps": 4, "remasking": "margin"})
    assert chat.object == "chat.completion" and [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in chat.choices)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, seed=3, n=2, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"steps": 4, "remasking": "margin"})
    texts, usage = ["", ""], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]
    assert usage.completion_tokens == chat.usage.completion_tokens
    lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=1)
    content = lp.choices[0].logprobs.content
    assert content and all(e.logprob <= 0 and e.top_logprobs[0].token == e.token for e in content)


def test_openai_sdk_async_concurrent_results_do_not_cross(server):
    import openai

    prompts = [("The quick brown fox", 0.0, 1), ("One two three", 1.0, 2), ("Diffusion", 0.8, 3),
               ("Paris is", 1.2, 4), ("def add(a, b):", 0.5, 5), ("Grüße", 1.0, 6)]
    sync = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    alone = [sync.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=t, seed=s).choices[0].text
             for p, t, s in prompts]

    async def main():
        client = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)

        async def one(p, t, s, stream):
            if not stream:
                r = await client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=t, seed=s)
                return r.choices[0].text
            text = ""
            async for chunk in await client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=t,
                                                               seed=s, stream=True):
                text += "".join(c.text for c in chunk.choices)
            return text

        together = await asyncio.gather(*(one(p, t, s, i % 2 == 1) for i, (p, t, s) in enumerate(prompts)))
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, seed=9)
        chat_text = ""
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=9, stream=True,
                stream_options={"include_usage": True}):
            for c in chunk.choices:
                chat_text += c.delta.content or ""
        await client.close()
        return together, chat.choices[0].message.content, chat_text

    together, chat_text, streamed_chat = asyncio.run(main())
    assert together == alone
    assert streamed_chat == chat_text


# ---------------------------------------------------------------------------------------------- SSE invariants
def _check_stream(payloads, n, chat=True):
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = payloads[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(isinstance(c["created"], int) for c in chunks)
    texts, finished, role_seen = [""] * n, [False] * n, [False] * n
    denoise = {i: [] for i in range(n)}
    usage = None
    for c in chunks:
        if not c["choices"]:
            assert usage is None and c.get("usage")
            usage = c["usage"]
            continue
        assert usage is None, "the usage chunk comes last"
        (ch,) = c["choices"]
        i = ch["index"]
        assert not finished[i], "nothing after a choice's finish_reason"
        if chat:
            if not role_seen[i]:
                assert ch["delta"].get("role") == "assistant", "first chat delta carries the role"
                role_seen[i] = True
            else:
                assert "role" not in ch["delta"]
            texts[i] += ch["delta"].get("content") or ""
        else:
            texts[i] += ch["text"]
        if "denoising" in c:  # exactly the docs/design.md#decisions shape
            assert ch == ({"index": i, "delta": {}, "finish_reason": None} if chat
                          else {"index": i, "text": "", "finish_reason": None})
            assert set(c["denoising"]) == {"index", "block", "step", "nfe", "revealed", "canvas"}
            assert all(set(r) == {"position", "token_id", "text", "confidence"} for r in c["denoising"]["revealed"])
            denoise[i].append(c["denoising"])
        if ch["finish_reason"] is not None:
            finished[i] = True
    assert all(finished)
    return texts, denoise, usage


def test_sse_invariants_and_denoising_events(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 12, "seed": 5,
            "n": 2, "stream": True, "steps": 8, "block_size": 4,
            "stream_options": {"include_usage": True, "include_denoising": True}}
    r, payloads = sse(http, CH, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    texts, denoise, usage = _check_stream(payloads, 2)
    plain = http.post(CH, json={**body, "stream": False, "stream_options": None}).json()
    assert texts == [c["message"]["content"] for c in plain["choices"]]
    # the same usage but for cached prompt tokens (whichever request came second may reuse the first's prompt KV)
    assert {**usage, "prompt_tokens_details": None} == {**plain["usage"], "prompt_tokens_details": None}
    assert all(0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] for u in (usage, plain["usage"]))
    last_nfe = 0
    for i, events in denoise.items():
        assert [e["step"] for e in events] == list(range(len(events))), "one denoising event per step"
        nfes = [e["nfe"] for e in events]
        assert nfes == sorted(set(nfes)) and nfes[0] >= 1
        last_nfe += nfes[-1]
        assert all(e["index"] == i for e in events)
        blocks = [e["block"] for e in events]
        assert blocks == sorted(blocks)
        prev = [None] * 12
        for e in events:
            assert len(e["canvas"]) == 12 and e["revealed"]
            for rv in e["revealed"]:
                assert prev[rv["position"]] is None and e["canvas"][rv["position"]] == rv["text"]
                assert 0 <= rv["confidence"] <= 1 and isinstance(rv["token_id"], int)
            assert sum(x is not None for x in e["canvas"]) == sum(x is not None for x in prev) + len(e["revealed"])
            prev = e["canvas"]
    assert usage["nfe"] == last_nfe
    assert usage["denoising_steps"] == sum(len(v) for v in denoise.values())


def test_completion_stream_shape(http):
    r, payloads = sse(http, C, {"model": MODEL, "prompt": ["One two", "Paris"], "max_tokens": 6, "seed": 2,
                                "stream": True, "n": 2})
    assert r.status_code == 200
    texts, _, usage = _check_stream(payloads, 4, chat=False)
    assert usage is None and all(c["object"] == "text_completion" for c in payloads[:-1])
    plain = http.post(C, json={"model": MODEL, "prompt": ["One two", "Paris"], "max_tokens": 6, "seed": 2,
                               "n": 2}).json()
    assert texts == [c["text"] for c in plain["choices"]]


def test_joined_deltas_equal_plain_text_multibyte_and_stop(http):
    seen_non_ascii = False
    for seed in range(6):
        base = {"model": MODEL, "prompt": "Grüße aus München — 東京", "max_tokens": 24, "seed": seed,
                "temperature": 1.5, "block_size": 8, "steps": 12}
        plain = http.post(C, json=base).json()["choices"][0]["text"]
        _, payloads = sse(http, C, {**base, "stream": True})
        texts, _, _ = _check_stream(payloads, 1, chat=False)
        assert texts[0] == plain
        # every intermediate prefix was final: never a U+FFFD from a split character
        acc = ""
        for c in payloads[:-1]:
            acc += c["choices"][0]["text"]
            assert plain.startswith(acc)
        seen_non_ascii |= any(ord(ch) > 127 and ch != "\ufffd" for ch in plain)
        if len(plain) >= 6:  # a stop string from the middle of the text: cut before it, no prefix leaks
            stop = plain[len(plain) // 2: len(plain) // 2 + 2]
            cut = plain[: plain.find(stop)]
            stopped = http.post(C, json={**base, "stop": [stop, "zzzz"]}).json()["choices"][0]
            assert stopped["text"] == cut and stopped["finish_reason"] == "stop"
            _, payloads = sse(http, C, {**base, "stop": [stop, "zzzz"], "stream": True})
            texts, _, _ = _check_stream(payloads, 1, chat=False)
            assert texts[0] == cut
    assert seen_non_ascii, "the test prompts must exercise multi-byte characters"


# ---------------------------------------------------------------------------------------------- errors
GOOD_C = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
GOOD_CH = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _c(**kw):
    return {**GOOD_C, **kw}


def _ch(**kw):
    return {**GOOD_CH, **kw}


BAD = [
    # (name, method, path, kwargs for httpx, status, param or message fragment)
    ("no api key", "POST", C, {"json": GOOD_C, "headers": {"Authorization": ""}}, 401, None),
    ("wrong api key", "POST", C, {"json": GOOD_C, "headers": {"Authorization": "Bearer nope"}}, 401, None),
    ("unknown model", "POST", C, {"json": _c(model="gpt-9")}, 404, "model"),
    ("unknown model id", "GET", "/v1/models/gpt-9", {}, 404, None),
    ("unknown route", "GET", "/v1/nothing", {}, 404, None),
    ("wrong method", "GET", C, {}, 405, None),
    ("bad json", "POST", C, {"content": b'{"model": "tiny", ', "headers": {"Content-Type": "application/json"}},
     400, "invalid JSON"),
    ("wrong content type", "POST", C, {"content": json.dumps(GOOD_C), "headers": {"Content-Type": "text/plain"}},
     415, "Content-Type"),
    ("json array body", "POST", C, {"json": [GOOD_C]}, 400, None),
    ("missing prompt", "POST", C, {"json": {"model": MODEL}}, 400, "prompt"),
    ("missing messages", "POST", CH, {"json": {"model": MODEL}}, 400, "messages"),
    ("empty prompt", "POST", C, {"json": _c(prompt="")}, 400, "prompt"),
    ("empty prompt list", "POST", C, {"json": _c(prompt=[])}, 400, "prompt"),
    ("empty token list", "POST", C, {"json": _c(prompt=[[]])}, 400, "prompt"),
    ("token id out of vocab", "POST", C, {"json": _c(prompt=[10 ** 6])}, 400, "prompt"),
    ("empty messages", "POST", CH, {"json": _ch(messages=[])}, 400, "messages"),
    ("temperature as string", "POST", C, {"json": _c(temperature="0.5")}, 400, "temperature"),
    ("temperature negative", "POST", C, {"json": _c(temperature=-1)}, 400, "temperature"),
    ("temperature too high", "POST", CH, {"json": _ch(temperature=3)}, 400, "temperature"),
    ("temperature NaN", "POST", C, {"content": json.dumps(GOOD_C)[:-1] + ', "temperature": NaN}',
                                    "headers": {"Content-Type": "application/json"}}, 400, "temperature"),
    ("top_p zero", "POST", C, {"json": _c(top_p=0)}, 400, "top_p"),
    ("top_p above one", "POST", C, {"json": _c(top_p=1.5)}, 400, "top_p"),
    ("max_tokens zero", "POST", C, {"json": _c(max_tokens=0)}, 400, "max_tokens"),
    ("max_tokens float", "POST", C, {"json": _c(max_tokens=1.5)}, 400, "max_tokens"),
    ("max_tokens beyond context", "POST", C, {"json": _c(max_tokens=100000)}, 400, "max_tokens"),
    ("prompt fills the context", "POST", C, {"json": _c(prompt=[5] * 600)}, 400, "prompt"),
    ("messages fill the context", "POST", CH, {"json": _ch(messages=[{"role": "user", "content": "a b " * 600}])},
     400, "messages"),
    ("max_completion_tokens zero", "POST", CH, {"json": _ch(max_completion_tokens=0)}, 400,
     "max_completion_tokens"),
    ("n zero", "POST", C, {"json": _c(n=0)}, 400, "n"),
    ("n too large", "POST", C, {"json": _c(n=17)}, 400, "n"),
    ("five stop strings", "POST", C, {"json": _c(stop=["a", "b", "c", "d", "e"])}, 400, "stop"),
    ("empty stop string", "POST", C, {"json": _c(stop=[""])}, 400, "stop"),
    ("negative seed", "POST", C, {"json": _c(seed=-1)}, 400, "seed"),
    ("unknown remasking", "POST", C, {"json": _c(remasking="bogus")}, 400, "remasking"),
    ("unknown cache", "POST", C, {"json": _c(cache="bogus")}, 400, "cache"),
    ("threshold above one", "POST", C, {"json": _c(threshold=2)}, 400, "threshold"),
    ("block_size zero", "POST", C, {"json": _c(block_size=0)}, 400, "block_size"),
    ("steps zero", "POST", C, {"json": _c(steps=0)}, 400, "steps"),
    ("frequency_penalty too high", "POST", C, {"json": _c(frequency_penalty=3)}, 400, "frequency_penalty"),
    ("stream as string", "POST", C, {"json": _c(stream="yes")}, 400, "stream"),
    ("ignore_eos as int", "POST", C, {"json": _c(ignore_eos=1)}, 400, "ignore_eos"),
    ("unknown field", "POST", C, {"json": _c(foo=1)}, 400, "foo"),
    ("tools with duplicate names", "POST", CH, {"json": _ch(tools=[{"type": "function", "function": {"name": "f"}}] * 2)},
     400, "tools"),
    ("logit_bias key not a token id", "POST", CH, {"json": _ch(logit_bias={"five": 10})}, 400, "logit_bias"),
    ("response_format unknown type", "POST", CH, {"json": _ch(response_format={"type": "xml"})}, 400,
     "response_format"),
    ("unknown role", "POST", CH, {"json": _ch(messages=[{"role": "robot", "content": "x"}])}, 400, "messages.0.role"),
    ("image content part", "POST", CH, {"json": _ch(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])}, 400, "messages.0.content"),
    ("stream_options without stream", "POST", CH, {"json": _ch(stream_options={"include_usage": True})}, 400,
     "stream_options"),
    ("min_tokens above max_tokens", "POST", C, {"json": _c(min_tokens=9)}, 400, "min_tokens"),
    ("suffix on a causal model", "POST", C, {"json": _c(suffix="end")}, 400, "suffix"),
    ("top_logprobs too many", "POST", CH, {"json": _ch(logprobs=True, top_logprobs=21)}, 400, "top_logprobs"),
    ("best_of unlike n", "POST", C, {"json": _c(best_of=3)}, 400, "best_of"),
    ("oversized body", "POST", C, {"json": _c(prompt="x" * (5 * 1024 * 1024))}, 413, None),
    # token ids beyond the vocabulary in any field; integers too large for a float
    ("stop_token_ids out of vocab", "POST", C, {"json": _c(min_tokens=1, stop_token_ids=[10 ** 6])}, 400,
     "stop_token_ids"),
    ("max_tokens beyond float range", "POST", C, {"json": _c(max_tokens=10 ** 400)}, 400, "max_tokens"),
    ("min_tokens beyond float range", "POST", C, {"json": _c(min_tokens=10 ** 400)}, 400, "min_tokens"),
    ("max_completion_tokens beyond float range", "POST", CH, {"json": _ch(max_completion_tokens=10 ** 400)}, 400,
     "max_completion_tokens"),
]


def test_bad_requests_get_documented_4xx_then_a_good_request_succeeds(http):
    assert len(BAD) >= 30
    for name, method, path, kwargs, status, param in BAD:
        r = http.request(method, path, **kwargs)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        if param is not None:
            assert param in err["message"] or err["param"] == param, (name, err)
        if status == 401:
            assert r.headers.get("www-authenticate") == "Bearer"
    r = http.post(C, json=_c(max_tokens=100000))
    assert "512" in r.json()["error"]["message"], "both numbers of the context overflow are named"
    r = http.post(CH, json=_ch(messages=[{"role": "user", "content": "a b " * 600}]))
    assert r.json()["error"]["param"] == "messages" and "rendered prompt" in r.json()["error"]["message"]
    ok = http.post(CH, json=GOOD_CH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert health(http)["running"] == 0



def test_steps_or_threshold_with_speculative_true_is_a_400_naming_it_and_serving_goes_on(http):
    """docs/design.md#admission-and-limits: `steps` / `threshold` on a request that sets `speculative: true` are 400s
    naming the field (they were 200s that ignored them); speculative alone, `speculative: false` with them, and
    `"threshold": null` with speculative (no steps of the client's) are served as before."""
    bad = [(CH, _ch(speculative=True, steps=4), "steps"), (C, _c(speculative=True, steps=4), "steps"),
           (CH, _ch(speculative=True, threshold=0.9), "threshold"), (C, _c(speculative=True, threshold=0), "threshold"),
           (CH, _ch(speculative=True, steps=4, stream=True), "steps"),
           ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "speculative": True,
                              "steps": 4}, "steps")]
    for path, body, field in bad:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and "speculative decoding" in err["message"], (path, err)
        assert "decides its own reveals" in err["message"], err
    for body in (_ch(speculative=True), _ch(speculative=False, steps=4), _ch(speculative=False, threshold=0.9),
                 _ch(speculative=True, threshold=None), _ch(steps=4), _ch(threshold=0.9)):
        r = http.post(CH, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (body, r.text)
    assert health(http)["running"] == 0

@pytest.mark.parametrize("field, value", [("remasking", "margin"), ("remasking", "random"), ("sub_block_size", 2),
                                          ("steps", 4), ("threshold", 0.5)])
def test_a_field_speculative_decoding_does_not_use_is_a_400_with_speculative_true(http, field, value):
    """docs/design.md#admission-and-limits: every field self-speculative decoding has no use for (engine/plan.py
    NOT_SPECULATIVE_FIELDS), set with `speculative: true`, is a 400 naming it and saying why (`remasking` and
    `sub_block_size` were 200s that ignored them); the server goes on serving, and the same field with
    `speculative: false` (or without `speculative`) is a 200."""
    bad = [(CH, _ch(speculative=True, **{field: value})), (C, _c(speculative=True, **{field: value})),
           (CH, _ch(speculative=True, stream=True, **{field: value}))]
    if field != "sub_block_size":  # (not a /v1/responses field)
        bad.append(("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "speculative": True,
                                      field: value}))
    for path, body in bad:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error", (path, err)
        assert "has no effect with speculative decoding" in err["message"], err
        assert "decides its own reveals" in err["message"] and "speculative=false" in err["message"], err
    for body in (_ch(speculative=True), _ch(speculative=False, **{field: value}), _ch(**{field: value}),
                 _c(speculative=False, **{field: value}), _ch(speculative=True, remasking="low_confidence")):
        r = http.post(CH if "messages" in body else C, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (body, r.text)
    assert health(http)["running"] == 0


def test_null_fields_take_their_defaults_and_extreme_values_are_served(http):
    # the openai SDK sends null for an explicit None; OpenAI documents these fields as nullable
    r = http.post(C, json=_c(top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None,
                             top_k=None, cfg_scale=None, ignore_eos=None))
    assert r.status_code == 200, r.text[:300]
    r = http.post(CH, json=_ch(logprobs=None, top_p=None))
    assert r.status_code == 200, r.text[:300]
    # the largest seed with n > 1: choice i uses (seed + i) mod 2**63
    r = http.post(C, json=_c(seed=2 ** 63 - 1, n=2, temperature=1.0))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:300]
    r = http.post(C, json=_c(top_k=10 ** 400))
    assert r.status_code == 200, r.text[:300]


def test_a_bad_token_id_never_breaks_the_running_batch(http):
    """A request with an out-of-vocabulary stop id used to fail inside the batched step, aborting every request
    of the batch; it must be refused on its own while a concurrent stream finishes normally."""
    async def run():
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=AUTH, timeout=60) as client:
            async def stream():
                async with client.stream("POST", C, json=_c(max_tokens=200, ignore_eos=True, stream=True)) as r:
                    assert r.status_code == 200
                    lines = [x async for x in r.aiter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
                return [json.loads(x[6:]) for x in lines]

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.3)
            bad = await client.post(C, json=_c(min_tokens=1, stop_token_ids=[10 ** 6], max_tokens=8))
            return bad, await task

    bad, events = asyncio.run(run())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
    assert not [e for e in events if "error" in e]
    assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")] == ["length"]


def test_queue_full_is_429_with_retry_after(http):
    # 16 long choices: 8 run, 8 wait -> a further 16 would overflow the queue of 16
    body = {"model": MODEL, "prompt": "One", "max_tokens": 300, "n": 16, "seed": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_denoising": True}}
    with http.stream("POST", C, json=body) as r:
        lines = r.iter_lines()  # keep the iterator: closing it would close the connection (a disconnect)
        for line in lines:
            if '"denoising"' in line:
                break
        full = http.post(C, json=_c(n=16))
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
    _wait_idle(http)
    assert http.post(C, json=GOOD_C).status_code == 200


# ---------------------------------------------------------------------------------------------- disconnects
def _wait_idle(http, timeout=15.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = health(http)
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    pytest.fail(f"engine still busy: {health(http)}")


def _assert_nfe_stops(http):
    before = _wait_idle(http)["batched_forwards"]
    time.sleep(0.5)
    assert health(http)["batched_forwards"] == before, "the engine kept spending forwards on a cancelled request"


# A request far longer than a client can be descheduled for: 480 steps of full forwards (no KV cache) over 4 choices
# with their CFG lanes, ~16 s on a quiet 2-core CPU (480 steps of one lane, ~3 s, finished before the disconnect
# when CI's client process was starved, and the abort could not happen).
LONG = {"prompt": "One two", "max_tokens": 480, "ignore_eos": True, "seed": 0, "cache": "none", "n": 4,
        "cfg_scale": 1.0}


def test_streaming_disconnect_aborts_the_request(http, server):
    before = scrape(http)
    body = {"model": MODEL, **LONG, "stream": True, "stream_options": {"include_denoising": True}}
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=60) as client:
        with client.stream("POST", C, json=body) as r:
            assert r.status_code == 200, r.read()
            seen, text, lines = 0, "", []
            # the iterator stays referenced: an abandoned one is closed at once, and httpx then closes the
            # connection, so the server could see the disconnect before the health check below (flaky under load)
            stream_lines = r.iter_lines()
            for line in stream_lines:
                lines.append(line[:300])
                if line.startswith("data: "):
                    seen += 1
                    chunk = json.loads(line[6:])
                    text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if seen >= 2:  # streaming has started; disconnect long before the request's last step
                    break
            h = health(http)
            assert h["running"] == 1, (h, lines, server["log"].read_text()[-3000:])
    _assert_nfe_stops(http)
    after = scrape(http)
    key = ("unmask:request_failure_total", (("reason", "abort"),))
    assert after[key] == before[key] + 1
    # the cancelled request's work is counted: at least the tokens the client saw, and its forwards
    gen = ("unmask:generation_tokens_total", ())
    assert after[gen] - before.get(gen, 0) >= (1 if text else 0)
    nfe = ("unmask:nfe_total", ())
    assert after[nfe] - before.get(nfe, 0) >= seen - 2


def test_non_streaming_disconnect_aborts_the_request(http, server):
    before = scrape(http)
    body = {"model": MODEL, **LONG}  # far longer than the client waits
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + C, json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
    _assert_nfe_stops(http)
    key = ("unmask:request_failure_total", (("reason", "abort"),))
    assert scrape(http)[key] == before[key] + 1, "the request must have been aborted, not completed"


# ---------------------------------------------------------------------------------------------- metrics and logs
def test_metrics_deltas_equal_usage(http):
    before = scrape(http)
    usages, choices = [], 0
    for body in (_c(max_tokens=7, seed=1, n=2), _ch(max_tokens=9, seed=2, steps=3)):
        r = http.post(C if "prompt" in body else CH, json=body).json()
        usages.append(r["usage"])
        choices += len(r["choices"])
    _, payloads = sse(http, CH, _ch(max_tokens=6, seed=3, stream=True, stream_options={"include_usage": True}))
    usages.append(payloads[-2]["usage"])
    choices += 1
    after = scrape(http)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("unmask:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("unmask:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("unmask:nfe_total") == sum(u["nfe"] for u in usages)
    assert delta("unmask:denoising_steps_total") == sum(u["denoising_steps"] for u in usages)
    assert (delta("unmask:request_success_total", (("finished_reason", "stop"),))
            + delta("unmask:request_success_total", (("finished_reason", "length"),))) == choices
    assert delta("unmask:e2e_request_latency_seconds_count") == 3
    assert delta("unmask:time_to_first_token_seconds_count") <= 3
    assert delta("unmask:request_queue_time_seconds_count") == 3
    assert delta("unmask:tokens_per_forward_count") == choices
    assert after[("unmask:num_requests_running", ())] == 0


def test_one_log_line_per_request(http, server):
    r = http.post(C, json=_c(seed=11)).json()
    time.sleep(0.1)
    lines = [ln for ln in server["log"].read_text().splitlines() if r["id"] in ln]
    assert len(lines) == 1, lines
    m = re.search(r"status=200 prompt_tokens=(\d+) completion_tokens=(\d+) nfe=(\d+) tpf=([\d.]+) steps=\d+ "
                  r"seconds=([\d.]+)", lines[0])
    assert m and int(m.group(2)) == r["usage"]["completion_tokens"] and int(m.group(3)) == r["usage"]["nfe"]
    assert math.isclose(float(m.group(4)), r["usage"]["completion_tokens"] / r["usage"]["nfe"], abs_tol=0.01)


# ---------------------------------------------------------------------------------------------- fuzzing
def test_schemathesis_finds_no_server_errors(server, http):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(server["url"] + "/openapi.json")
    failures, calls = [], 0
    statuses: dict[tuple[str, str, int], int] = {}
    t0 = time.time()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=12 if op.method.upper() == "POST" else 5, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck), derandomize=True)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                nonlocal calls
                calls += 1
                if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 64)  # keep the run short
                response = case.call(base_url=server["url"], headers=AUTH, timeout=60)
                key = (op.path, mode.value, response.status_code)
                statuses[key] = statuses.get(key, 0) + 1
                if response.status_code >= 500:
                    failures.append((response.status_code, case.as_curl_command(), response.text[:300]))

            try:
                check()
            except Unsatisfiable:  # no invalid input exists for an operation without parameters (GET /v1/models)
                assert mode == schemathesis.GenerationMode.NEGATIVE and not op.body and not op.path_parameters
    print(sorted(statuses.items()))
    assert calls >= 40
    assert not failures, failures[:3]
    # the fuzzing reached generation: valid generated requests succeeded, invalid ones were 4xx
    for path in (C, CH):
        assert statuses.get((path, "positive", 200), 0) >= 1, statuses
    assert time.time() - t0 < 120
    assert http.post(C, json=GOOD_C).status_code == 200


def test_server_threads_leave_a_core_to_the_http_server_on_a_cpu():
    from unmask.cli.serve import server_threads

    assert server_threads(None, "cpu", 2, {}) == 1
    assert server_threads(None, "cpu", 16, {}) == 15
    assert server_threads(None, "cpu", 1, {}) == 1
    assert server_threads(None, "cpu", 2, {"OMP_NUM_THREADS": "2"}) == 2  # the user's setting wins
    assert server_threads(3, "cpu", 2, {}) == 3  # --threads wins
    assert server_threads(None, "cuda", 16, {}) == 16
