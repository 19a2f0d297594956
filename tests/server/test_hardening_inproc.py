"""Issue 22 in-process (the app over a tiny model, no uvicorn): bounded request sizes, nothing on the event loop
that stalls others, fair admission, schema = validation, request ids (docs/design.md#admission-and-limits). The uvicorn
checks (HTTP parser errors, keys in logs, schemathesis) are in test_hardening.py."""
from __future__ import annotations

import collections

import asyncio
import json
import time

import httpx
import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import SamplingParams
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.limits import MAX_BLOCK_SIZE, MAX_N, MAX_STOP_CHARS, ParamError
from unmask.server.app import build_app

C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


@pytest.fixture(scope="module")
def engine(model):
    eng = AsyncEngine(model, max_batch_size=4, max_queue=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    app = build_app(engine, "m", shutdown_engine=False, max_seqs_per_request=8)
    with TestClient(app) as c:
        yield c


def _c(**kw):
    return {"model": "m", "prompt": "Hello", "max_tokens": 8, "seed": 0, **kw}


# ------------------------------------------------------------------------------------------- size knobs
BOUNDED = [  # (extra fields, the field the 400 must name)
    ({"block_size": 65536}, "block_size"),
    ({"block_size": 4096, "max_tokens": 1}, "block_size"),
    ({"block_size": MAX_BLOCK_SIZE + 1, "max_tokens": 1024}, "block_size"),
    ({"block_size": 512, "max_tokens": 1}, "block_size"),      # within the declared max, but unusable
    ({"block_size": 16, "max_tokens": 3}, "block_size"),       # 16 > max(model block 4, 4)
    ({"block_size": 10 ** 30}, "block_size"),
    ({"steps": 10 ** 9}, "steps"),
    ({"sub_block_size": 10 ** 6}, "sub_block_size"),
    ({"sub_block_size": 5}, "sub_block_size"),                 # > block_size 4: refused, not clamped
    ({"speculative": True, "speculative_branches": 10 ** 6}, "speculative_branches"),
    ({"speculative": True, "speculative_branches": 4}, "speculative_branches"),   # block 4: at most 3
    ({"speculative": True, "block_size": 2, "speculative_branches": 2}, "speculative_branches"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": 3, "prompt": ["a", "b", "c"]}, "n"),                # 9 sequences > --max-seqs-per-request 8
    ({"max_tokens": 10 ** 7}, "max_tokens"),
    ({"max_tokens": 600}, "max_tokens"),                       # the tiny model's context is 512
    ({"min_tokens": 9}, "min_tokens"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt": ["x"] * 33}, "prompt"),
    ({"prompt": [5] * 600}, "prompt"),                         # token ids past the context, before the engine
    ({"prompt": "word " * 200_000}, "prompt"),                 # 1 MB: refused before it is tokenized
]


@pytest.mark.parametrize("extra,field", BOUNDED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BOUNDED)])
def test_every_size_knob_is_bounded_with_a_fast_400_naming_the_field(client, extra, field):
    t0 = time.perf_counter()
    r = client.post(C, json=_c(**extra))
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == field, r.text[:300]
    assert took < 1.0, took


def test_chat_sizes_are_bounded_too(client):
    r = client.post(CH, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21,
                              "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    huge = [{"role": "user", "content": "hi"}, {"role": "user", "content": "word " * 200_000}]
    t0 = time.perf_counter()
    r = client.post(CH, json={"model": "m", "messages": huge})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.content", r.text[:300]
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("extra", [{"block_size": 8, "max_tokens": 5}, {"block_size": 4, "max_tokens": 1},
                                   {"steps": 8}, {"steps": 12, "max_tokens": 10}, {"steps": 13, "max_tokens": 10}, {"sub_block_size": 4},
                                   {"speculative": True, "speculative_branches": 3},
                                   {"n": 2, "prompt": ["a", "b", "c", "d"]}])
def test_values_at_the_bounds_are_served(client, extra):
    r = client.post(C, json=_c(ignore_eos=True, **extra))
    assert r.status_code == 200, r.text[:300]


def test_the_engine_api_refuses_the_same_sizes(model):
    """The bounds live in the engine (``unmask.engine.limits`` + the plan/layout), not only in the HTTP schema."""
    from unmask.engine.engine import make_requests

    for kw, field in [({"block_size": 4096}, "block_size"), ({"block_size": 32, "max_tokens": 2}, "block_size"),
                      ({"steps": 2 ** 21}, "steps"), ({"sub_block_size": 8}, "sub_block_size"),
                      ({"speculative": True, "speculative_branches": 7}, "speculative_branches")]:
        with pytest.raises(ParamError) as e:
            params = SamplingParams.from_flat(**{"max_tokens": 8, **kw})
            make_requests(model, [5, 6, 7], params, "r")
        assert e.value.field == field, (kw, e.value)


# ------------------------------------------------------------------------------------------- the event loop
class SlowTokenizer:
    """The model's tokenizer, but every encode / chat template takes ``delay`` seconds (a 2 MB prompt on a real
    tokenizer): whatever runs it on the event loop stalls every other request for that long."""

    def __init__(self, inner, delay: float):
        self._inner, self._delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, *a, **kw):
        time.sleep(self._delay)
        return self._inner.encode(*a, **kw)

    def __call__(self, *a, **kw):
        time.sleep(self._delay)
        return self._inner(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        time.sleep(self._delay)
        return self._inner.apply_chat_template(*a, **kw)


class SlowCheck:
    """``unmask.server.structured.check_constraint`` taking ``delay`` seconds more (an enforced ``tool_choice`` over
    tools of 60 KiB schemas: ~2-8 s of llguidance grammar checks on the 2-core CPU)."""

    def __init__(self, inner, delay: float):
        self._inner, self._delay = inner, delay

    def __call__(self, *a, **kw):
        time.sleep(self._delay)
        return self._inner(*a, **kw)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}}
TOOLS_CHAT = "{% if tools %}tools{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("slow,path,body", [
    ("tokenizer", C, {"prompt": "a slow prompt"}),
    ("tokenizer", C, {"prompt": ["one slow", "two slow"]}),
    ("tokenizer", CH, {"messages": [{"role": "user", "content": "a slow chat"}]}),
    # the schema checks of an enforced tool_choice ran on the event loop (in sampling_params) before
    ("grammar", CH, {"messages": [{"role": "user", "content": "call f"}], "tools": [TOOL], "tool_choice": "required"}),
    ("grammar", "/v1/responses", {"input": "call f", "tools": [{"type": "function", **TOOL["function"]}],
                                  "tool_choice": "required", "max_output_tokens": 16}),
])
def test_tokenizing_and_grammar_checks_never_stall_health_or_other_streams(engine, monkeypatch, slow, path, body):
    import unmask.server.structured as structured

    app = build_app(engine, "m", shutdown_engine=False, chat_template=TOOLS_CHAT)
    state = app.state.unmask
    delay = 2.0
    check = structured.check_constraint

    def slow_down(on: bool):
        if slow == "tokenizer":
            state.tokenizer = SlowTokenizer(engine.tokenizer, delay) if on else engine.tokenizer
        else:
            monkeypatch.setattr(structured, "check_constraint", SlowCheck(check, delay) if on else check)

    async def scenario():
        transport = httpx.ASGITransport(app=app)  # the app on this test's own event loop
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as http:
            done = asyncio.Event()

            async def prober():  # /health every 50 ms: the times its answers arrive
                times = []
                while not done.is_set():
                    assert (await http.get("/health")).status_code == 200
                    times.append(time.perf_counter())
                    await asyncio.sleep(0.05)
                return times

            async def other_request():  # a short generation sent while the slow one is being tokenized
                await asyncio.sleep(0.3)
                t0 = time.perf_counter()
                r = await http.post(C, json=_c(max_tokens=4, ignore_eos=True))
                assert r.status_code == 200, r.text[:300]
                return t0, time.perf_counter()

            probes = asyncio.create_task(prober())
            await asyncio.sleep(0.2)
            slow_down(True)
            other = asyncio.create_task(other_request())
            t_slow = time.perf_counter()
            extra = {} if path.endswith("responses") else {"max_tokens": 4}
            r = await http.post(path, json={"model": "m", **extra, **body})
            t_end = time.perf_counter()
            slow_down(False)
            done.set()
            return r, t_slow, t_end, await probes, await other

    def worst_gap(times, lo, hi):  # the longest silence within [lo, hi]
        inside = [lo] + [t for t in times if lo <= t <= hi] + [hi]
        return max(b - a for a, b in zip(inside, inside[1:]))

    r, t_slow, t_end, health, (o_start, o_end) = asyncio.run(scenario())
    assert r.status_code == 200, r.text[:300]
    assert t_end - t_slow >= delay  # the slow part did run for this request
    assert worst_gap(health, t_slow, t_end) < 1.0, worst_gap(health, t_slow, t_end)
    # (with a slow tokenizer the other request used it too: it ran in its own worker thread meanwhile)
    assert o_end - o_start < delay + 1.0 and o_end < t_end + 0.5, (o_end - o_start, o_end - t_end)


# ------------------------------------------------------------------------------------------- fair admission
async def _first_event_time(stream) -> float:
    async for _ in stream:
        return time.perf_counter()


def test_a_small_request_runs_at_once_while_a_large_one_holds_the_batch(model):
    """A 4-sequence request of 128 tokens each fills the batch (2 slots) for two waves; 4-token requests sent
    after it get their first token within 5 s (the next step) and finish long before the large one (first-come
    first-served would make them wait for both waves): they take a slot from the large request, whose sequence
    is paused, not restarted, and still decodes the same tokens."""
    eng = AsyncEngine(model, max_batch_size=2, max_queue=64)
    big = SamplingParams(max_tokens=128, ignore_eos=True, seed=3, temperature=1.0)
    small = SamplingParams(max_tokens=4, ignore_eos=True, seed=1, temperature=0)

    async def scenario():
        s_big = eng.submit([5, 6, 7], big, "big", n=4)
        async for _ in s_big:  # the large request is running
            break
        outs = []
        for k in range(3):  # variants: several small requests, one after the other
            t0 = time.perf_counter()
            s_small = eng.submit([9, 8, 7 + k], small, f"small-{k}")
            first = await asyncio.wait_for(_first_event_time(s_small), 5.0)
            async for _ in s_small:
                pass
            outs.append((first - t0, s_small.outputs[0], s_big.finished))
        async for _ in s_big:
            pass
        return outs, [o.token_ids for o in s_big.outputs]

    try:
        outs, big_ids = asyncio.run(scenario())
        paused = eng.scheduler.preemptions
    finally:
        eng.shutdown()
    for wait, out, big_done in outs:
        assert wait < 5.0 and len(out.token_ids) == 4 and not big_done, (wait, big_done)
    assert paused >= 1  # a later small request may find a free slot (which the least served request gets)
    # pausing is exact: the large request's tokens equal an undisturbed run's
    ref = AsyncEngine(model, max_batch_size=2, max_queue=64)

    async def alone():
        s = ref.submit([5, 6, 7], big, "big", n=4)
        async for _ in s:
            pass
        return [o.token_ids for o in s.outputs]

    try:
        assert asyncio.run(alone()) == big_ids
    finally:
        ref.shutdown()


def test_free_slots_go_to_the_least_served_request(model):
    from unmask.engine.engine import Engine

    eng = Engine(model, max_batch_size=4)
    p = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    eng.add_request([5, 6], p, "a", n=8)
    eng.add_request([5, 7], p, "b", n=8)
    eng.add_request([5, 8], p, "c", n=1)
    eng.step()
    held = sorted(s.request_id for s in eng.scheduler.running)
    assert held.count("c") == 1 and held.count("a") >= 1 and held.count("b") >= 1, held


def test_fair_share_is_per_client_request_across_its_prompts(model):
    """Several client requests of 4 prompts x n=16 fill the batch and the queue (one engine request per prompt):
    their shares are counted per client request (``group``), so a small request still gets a slot at once. Counted
    per prompt, 16 prompts holding one slot each were all "within their share" and the small one waited for a whole
    200-token sequence to end (found by the breaker: 41.8 s to its first token)."""
    from unmask.engine.engine import Engine

    eng = Engine(model, max_batch_size=16, max_queue=256)
    p = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
    for big in range(4):
        for prompt in range(4):
            eng.add_request([5, 6 + prompt], p, f"big{big}-{prompt}", n=16, group=f"big{big}")
    for _ in range(3):
        eng.step()
    eng.add_request([5, 9], SamplingParams(max_tokens=4, temperature=0), "small", n=1)
    eng.step()
    assert any(s.request_id == "small" for s in eng.scheduler.running), eng.scheduler.running
    held = collections.Counter(s.group for s in eng.scheduler.running)
    assert max(held.values()) - min(held[g] for g in ("big0", "big1", "big2", "big3")) <= 1, held


# ------------------------------------------------------------------------------------------- schema = validation
def _schema(client, name):
    schema = client.get("/openapi.json").json()
    comp = schema["components"]["schemas"]
    return {**comp[name], "components": schema["components"]}, comp


@pytest.mark.parametrize("extra,accepted", [
    ({"speculative": True, "speculative_epsilon": 0.1, "speculative_ratio": 0.5}, False),
    ({"speculative": True, "speculative_epsilon": None, "speculative_ratio": 0.5}, True),
    ({"speculative": True, "speculative_epsilon": 0.1}, True),
    ({"stream_options": {"include_usage": True}}, False),
    ({"stream_options": {"include_usage": True}, "stream": False}, False),
    ({"stream_options": None}, True),
])
def test_the_published_schema_says_what_validation_rejects(client, extra, accepted):
    schema, _ = _schema(client, "CompletionRequest")
    body = _c(temperature=0, **extra)
    schema_ok = jsonschema_rs.Draft202012Validator(schema).is_valid(body)  # "#/components/..." refs resolve here
    r = client.post(C, json=body)
    assert schema_ok == accepted, body
    assert (r.status_code == 200) == accepted, r.text[:300]


def test_chat_schema_ties_top_logprobs_to_logprobs(client):
    _, comp = _schema(client, "ChatCompletionRequest")
    rules = comp["ChatCompletionRequest"]["allOf"]
    assert any(r.get("if", {}).get("required") == ["top_logprobs"] for r in rules)
    r = client.post(CH, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE", "POST"])
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/"])
def test_wrong_methods_on_get_routes_are_405_with_allow(client, method, path):
    r = client.request(method, path, content=b"plain text", headers={"content-type": "text/plain"})
    assert r.status_code == 405, (method, path, r.status_code, r.text[:200])
    assert "GET" in r.headers["allow"]
    assert r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_wrong_methods_on_post_routes_are_405_with_allow(client, method):
    r = client.request(method, C)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"]


@pytest.mark.parametrize("path,body,param", [
    (CH, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (CH, {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "x"},
                       {"role": "user", "content": "\udfff"}]}, "messages.2.content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "b\udc80"}]}]},
     "messages.0.content.0.text"),
    (CH, {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages.0.name"),
    (C, {"prompt": "x\ud83d"}, "prompt"),
    (C, {"prompt": ["fine", "y\ud83d"]}, "prompt.1"),
    (C, {"prompt": "fine", "stop": "\ud800"}, "stop"),
    # nested strings the chat template or tokenizer reads: tool-call arguments, tool schemas (keys included)
    (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get", "arguments": "{\"a\": \"\udfff\"}"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "get", "parameters": {"type": "object", "properties": {"a": {"description": "\ud800"}}}}}]},
     "tools.0.function.parameters.properties.a.description"),
    (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "get", "parameters": {"type": "object", "properties": {"\ud800": {"type": "string"}}}}}]},
     "tools.0.function.parameters.properties"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "get", "arguments": "\udfff"}]},
     "input.0.arguments"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    import json

    raw = json.dumps({"model": "m", "max_tokens": 2, **body})  # ensure_ascii: the surrogate as \\ud800
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"] and "template" not in err["message"], err


# ------------------------------------------------------------------------------------------- request ids
def test_every_response_carries_a_request_id(client):
    seen = set()
    for method, path, kw in [("GET", "/health", {}), ("GET", "/nope", {}), ("PUT", "/health", {}),
                             ("POST", C, {"json": _c(max_tokens=2)}), ("POST", C, {"json": _c(block_size=10 ** 6)}),
                             ("POST", C, {"content": b"x", "headers": {"content-type": "text/plain"}}),
                             ("GET", "/metrics", {}), ("GET", "/openapi.json", {})]:
        r = client.request(method, path, **kw)
        rid = r.headers.get("x-request-id")
        assert rid and rid.startswith("req-") and len(rid) == 28, (method, path, r.headers)
        seen.add(rid)
    assert len(seen) == 8  # a fresh one each time
    with client.stream("POST", C, json=_c(max_tokens=2, stream=True)) as r:
        assert r.headers["x-request-id"].startswith("req-")


@pytest.mark.parametrize("given,kept", [("abc-123", True), ("0f8fad5b-d9cb-469f-a165-70867728950e", True),
                                        ("x" * 128, True), ("x" * 129, False), ("has space", False),
                                        ("tab\there", False), ("caf\u00e9", False), ("", False)])
def test_a_sane_client_request_id_is_kept_else_replaced(client, given, kept):
    r = client.get("/health", headers={"X-Request-Id": given.encode("utf-8")})
    got = r.headers["x-request-id"]
    assert (got == given) == kept and (kept or got.startswith("req-")), got


def test_log_lines_of_a_request_name_its_id(client, caplog):
    import logging

    from unmask.server.request_id import RequestIdFilter

    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="unmask"):
        ok = client.post(C, json=_c(max_tokens=2), headers={"X-Request-Id": "trace-ok-1"})
        bad = client.post(C, json=_c(steps=10 ** 9), headers={"X-Request-Id": "trace-bad-2"})
    assert ok.status_code == 200 and bad.status_code == 400
    for rid, marker in (("trace-ok-1", ok.json()["id"]), ("trace-bad-2", "status=400")):
        lines = [r for r in caplog.records if r.name.startswith("unmask") and marker in r.getMessage()]
        assert lines and all(r.request_id == rid for r in lines), [(r.request_id, r.getMessage()) for r in lines]


@pytest.mark.parametrize("path,body", [
    (C, {"prompt": "a\u2028b\u2029c\x85d", "echo": True, "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "a\u2028b\u2029c\x85d", "max_output_tokens": 2, "stream": True,
                       "stream_options": {"include_denoising": True}}),
])
def test_sse_data_lines_survive_line_splitting_clients(client, path, body):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (httpx's iter_lines): raw inside a data line they
    cut its JSON in two (breaker). Every data line must parse after splitting the body that way."""
    with client.stream("POST", path, json={"model": "m", **body}) as r:
        assert r.status_code == 200
        text = r.read().decode("utf-8")
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data
    for d in data:
        if d != "[DONE]":
            json.loads(d)


# ------------------------------------------------------------------------------------------- encodings, HEAD
@pytest.mark.parametrize("encoding,expect", [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16-LE"), ("utf-16-be", "UTF-16-BE"), ("utf-32", "UTF-32"),
    ("utf-8-sig", "byte order mark"),
])
@pytest.mark.parametrize("path", [C, CH, "/v1/responses"])
def test_a_body_that_is_not_utf8_is_a_400_naming_the_encoding(client, path, encoding, expect):
    """RFC 8259 8.1: networked JSON is UTF-8 without a BOM; json.loads decoded UTF-16 and skipped the BOM silently
    (breaker)."""
    import json

    body = {"model": "m", "max_tokens": 2, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
            "input": "hi"}
    body = {k: v for k, v in body.items() if k in {C: ("model", "max_tokens", "prompt"),
                                                    CH: ("model", "max_tokens", "messages"),
                                                    "/v1/responses": ("model", "input")}[path]}
    raw = json.dumps(body).encode(encoding)
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert expect in err["message"] and "UTF-8" in err["message"] and err["code"] == "invalid_encoding", err
    ok = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text[:300]


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/models/m", "/"])
def test_head_on_get_routes_answers_like_get_without_a_body(client, path):
    get = client.get(path)
    head = client.head(path)
    assert head.status_code == get.status_code == 200, (head.status_code, head.text[:200])
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["x-request-id"]


def test_head_on_an_unknown_path_is_a_404(client):
    assert client.head("/nope").status_code == 404


def test_health_counts_batched_forwards_and_usage_counts_per_choice(client):
    """/health said ``nfe`` for model calls while ``usage.nfe`` counts one choice's forwards (breaker): two names.
    Two choices decoded side by side share every forward: their usage sums to about twice the calls made."""
    before = client.get("/health").json()
    assert "nfe" not in before and isinstance(before["batched_forwards"], int)
    r = client.post(C, json=_c(n=2, max_tokens=8, ignore_eos=True, temperature=0))
    assert r.status_code == 200, r.text
    calls = client.get("/health").json()["batched_forwards"] - before["batched_forwards"]
    per_choice = r.json()["usage"]["nfe"]
    assert 0 < calls < per_choice <= 2 * calls, (calls, per_choice)


# ------------------------------------------------------------------------------------------- wording of 400s
def test_an_integer_past_pythons_digit_limit_is_named_as_such(client):
    """A 5000-digit integer: json.loads raises ValueError (int max str digits); the 400 said the body was not UTF-8
    (break-it)."""
    raw = ('{"model": "m", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}").encode()
    r = client.post(C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert "digits" in msg and "UTF-8" not in msg, msg


def test_a_string_length_bound_counts_characters(client):
    """A stop string past MAX_STOP_CHARS said "Value should have at most N items" (break-it)."""
    r = client.post(C, json={"model": "m", "prompt": "hi", "max_tokens": 2, "stop": ["a" * (MAX_STOP_CHARS + 1)]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (f"stop.0: String should have at most {MAX_STOP_CHARS} characters, "
                                            f"not {MAX_STOP_CHARS + 1}"), r.text
    r = client.post(C, json={"model": "m", "prompt": "hi", "max_tokens": 2, "stop": ["a"] * 50})
    assert r.status_code == 400 and "items" in r.json()["error"]["message"]
    assert "after validation" not in r.json()["error"]["message"]


@pytest.mark.parametrize("role", ["wizard", "", 5, "Assistant"])
def test_an_unknown_message_role_lists_every_role(client, role):
    """The error named only system/developer/user (the first member of the message union; new-user run)."""
    r = client.post(CH, json={"model": "m", "max_tokens": 2, "messages": [{"role": role, "content": "x"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.role", err
    for name in ("system", "developer", "user", "assistant", "tool"):
        assert f"'{name}'" in err["message"], err
    r = client.post(CH, json={"model": "m", "max_tokens": 2, "messages": [{"content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text  # missing: required


def test_usage_reports_cached_prompt_tokens(client):
    """prompt_tokens_details.cached_tokens (chat, completions) and input_tokens_details.cached_tokens (Responses)
    count the prompt tokens read from the prefix cache; the Responses value was hard-coded 0 (break-it)."""
    prompt = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    client.post(C, json=body)
    u = client.post(C, json=body).json()["usage"]
    assert 16 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"], u
    chat = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": prompt}]}
    client.post(CH, json=chat)
    u = client.post(CH, json=chat).json()["usage"]
    assert 16 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"], u
    resp = {"model": "m", "input": prompt, "max_output_tokens": 2, "temperature": 0}
    client.post("/v1/responses", json=resp)
    u = client.post("/v1/responses", json=resp).json()["usage"]
    assert 16 <= u["input_tokens_details"]["cached_tokens"] < u["input_tokens"], u


def test_a_null_role_lists_every_role_too(client):
    r = client.post(CH, json={"model": "m", "max_tokens": 2, "messages": [{"role": None, "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text
    assert "'tool'" in r.json()["error"]["message"], r.text


def test_length_wording_of_plain_strings_and_huge_bias_keys(client):
    r = client.post(C, json={"model": "m", "prompt": "hi", "max_tokens": 2, "user": "u" * 600})
    assert r.json()["error"]["message"] == "user: String should have at most 512 characters, not 600", r.text
    r = client.post(C, json={"model": "m", "prompt": "hi", "max_tokens": 2, "stop": [""]})
    assert r.json()["error"]["message"] == "stop.0: String should have at least 1 character, not 0", r.text
    r = client.post(C, json={"model": "m", "prompt": "hi", "max_tokens": 2, "logit_bias": {"9" * 5000: 1}})
    assert r.status_code == 400 and len(r.content) < 600 and "5000 characters" in r.text, r.text[:300]
