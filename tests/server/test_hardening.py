"""Issue 22 against a real `unmask serve` (uvicorn): the HTTP parser's 400 as JSON, a 2 MB prompt (completions,
chat, /v1/responses) that stalls nobody, fair admission over HTTP, the API key from a file and never in a log line, the routes open without it, request ids in the log, and
schemathesis with every check (docs/design.md#admission-and-limits). In-process checks: test_hardening_inproc.py."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from serving import start_server, stop_server

KEY = "sk-harden-Zq81xV"
ENV_KEY = "sk-env-Hy72pQ"  # in the server's environment too: the file wins, and neither is ever logged
WRONG = "sk-wrong-Pm37yT"
MODEL = "tiny"
C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harden")
    key_file = tmp / "key"
    key_file.write_text(KEY + "\n")
    proc, base, log = start_server(tmp, "--served-model-name", MODEL, "--api-key-file", str(key_file),
                                   "--log-level", "debug", "--max-seqs-per-request", "8", "--max-batch-size", "4",
                                   env={"UNMASK_API_KEY": ENV_KEY})
    yield {"url": base, "log": log, "proc": proc, "port": int(base.rsplit(":", 1)[1])}
    stop_server(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            data += chunk
    head_part, _, payload = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, payload


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "12abc", "0x10", "5, 6"])
def test_a_garbage_content_length_is_a_json_400_in_the_openai_shape(server, length):
    head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close").encode()
    status, headers, payload = _raw(server["port"], head, b"{}")
    assert status == 400, (status, payload)
    assert headers["content-type"].startswith("application/json") and headers.get("x-request-id"), headers
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err


def test_a_2mb_prompt_stalls_neither_health_nor_another_stream(server, http):
    gaps: list[float] = []
    first = threading.Event()

    def stream():
        last = None
        body = {"model": MODEL, "prompt": "One", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with http.stream("POST", C, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    answers = {}

    def big(path, body):
        t0 = time.perf_counter()
        r = http.post(path, json={"model": MODEL, **body})
        answers[path] = (r.status_code, r.json()["error"]["param"], time.perf_counter() - t0)

    two_mb = "lorem ipsum " * 175_000
    posters = [threading.Thread(target=big, args=(C, {"prompt": two_mb, "max_tokens": 4})),
               threading.Thread(target=big, args=(CH, {"messages": [{"role": "user", "content": two_mb}],
                                                       "max_tokens": 4})),
               threading.Thread(target=big, args=(R, {"input": [{"role": "user", "content": two_mb}],
                                                      "max_output_tokens": 4}))]
    for p in posters:
        p.start()
    health = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert httpx.get(server["url"] + "/health", timeout=5).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    for p in posters:
        p.join(30)
    t.join(60)
    assert answers[C][:2] == (400, "prompt") and answers[CH][:2] == (400, "messages.0.content"), answers
    assert answers[R][:2] == (400, "input.0.content"), answers
    assert max(a[2] for a in answers.values()) < 2.0, answers  # refused before tokenizing (upload included)
    assert max(health) < 1.0 and gaps and max(gaps) < 1.0, (health, max(gaps))


def test_a_small_request_gets_its_first_token_while_a_large_one_holds_the_batch(server, http):
    """Fair admission over HTTP (docs/design.md#admission-and-limits): 2 prompts x n 4 (the server's
    --max-seqs-per-request 8, twice its --max-batch-size 4) of 480 tokens with ignore_eos fill the batch; a
    4-token request sent after it gets its first token (or a 429) within 5 s, while the large one is still
    unfinished. First come first served would run all 8 large sequences (two full batches) before it, so the large
    request would have finished first."""
    finished: set[int] = set()
    started, stop = threading.Event(), threading.Event()

    def large():
        body = {"model": MODEL, "prompt": ["One", "Two"], "n": 4, "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if stop.is_set():
                    return  # leaving the block closes the connection: the server aborts the request
                if line.startswith("data: {"):
                    started.set()
                    finished.update(c["index"] for c in json.loads(line[6:])["choices"] if c["finish_reason"])

    t = threading.Thread(target=large)
    t.start()
    try:
        assert started.wait(60), "the large request streamed nothing"
        t0 = time.perf_counter()
        small = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}
        with http.stream("POST", C, json=small) as r:
            status, first = r.status_code, None
            if status == 200:
                for line in r.iter_lines():
                    choice = json.loads(line[6:])["choices"][0] if line.startswith("data: {") else {}
                    if choice.get("text") or choice.get("finish_reason"):  # a token (or the end: 4 of them)
                        first = time.perf_counter() - t0
                        break
        large_done = len(finished)
    finally:
        stop.set()
        t.join(120)
    assert status in (200, 429), status
    if status == 200:
        assert first is not None and first < 5.0, first
        assert large_done < 8, "the large request finished before the small one's first token"


OPEN = ["/health", "/metrics", "/", "/docs", "/openapi.json", "/visualizer/app.js", "/favicon.ico"]


def test_routes_open_without_the_key_and_v1_needs_it(server, http):
    for path in OPEN:
        r = httpx.get(server["url"] + path, timeout=10)
        assert r.status_code == 200, (path, r.status_code)
    for method, path in [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", C), ("POST", CH),
                         ("GET", "/v1/nope"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                         ("GET", "/nope")]:
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": KEY}):
            r = httpx.request(method, server["url"] + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, headers)
    assert http.get("/v1/models").status_code == 200  # the file's key, its newline stripped


def _exercise(base: str, key: str) -> None:
    """Requests with the right key, a wrong key and no key; successes, 400s and 404s."""
    good = {"Authorization": f"Bearer {key}"}
    for headers in (good, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {WRONG}"}, {}):
        httpx.post(base + C, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=headers, timeout=30)
        httpx.post(base + C, json={"model": MODEL, "prompt": "Hi", "steps": 10 ** 9}, headers=headers, timeout=30)
        httpx.get(base + "/v1/models/none", headers=headers, timeout=30)
    httpx.get(base + "/health", headers={"Authorization": f"Bearer {WRONG}"}, timeout=30)


def _assert_secret_free(log_text: str, *secrets: str) -> None:
    assert " DEBUG " in log_text and "status=200" in log_text  # the log did record debug lines and requests
    for s in secrets:
        assert s not in log_text, f"a log line holds {s[:6]}..."


def test_no_log_line_holds_the_key_from_the_file_or_the_environment(server):
    assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {ENV_KEY}"},
                     timeout=10).status_code == 401  # --api-key-file wins over UNMASK_API_KEY
    _exercise(server["url"], KEY)
    _exercise(server["url"], ENV_KEY)
    time.sleep(0.3)
    _assert_secret_free(server["log"].read_text(), KEY, ENV_KEY, WRONG)
    pid = server["proc"].pid
    for name in ("cmdline", "environ"):  # the point of the file: not in `ps`, not in the environment
        try:
            data = open(f"/proc/{pid}/{name}", "rb").read()
        except OSError:  # pragma: no cover - no procfs
            pytest.skip("no /proc")
        assert KEY.encode() not in data, name
    assert ENV_KEY.encode() in open(f"/proc/{pid}/environ", "rb").read()  # (the check above can fail)


@pytest.mark.system  # a second server (~15 s); the file and environment keys are checked in the default run
def test_no_log_line_holds_the_key_from_the_flag_or_the_environment(tmp_path):
    """``--api-key`` wins over ``UNMASK_API_KEY``: neither key, nor a wrong one, appears in any log line."""
    flag_key, env_key = "sk-flag-Kd93mW", "sk-env-Hy72pQ"
    proc, base, log = start_server(tmp_path, "--served-model-name", MODEL, "--log-level", "debug",
                                   "--api-key", flag_key, env={"UNMASK_API_KEY": env_key})
    try:
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {env_key}"},
                         timeout=10).status_code == 401
        _exercise(base, flag_key)
        _exercise(base, env_key)
        time.sleep(0.3)
    finally:
        stop_server(proc)
    _assert_secret_free(log.read_text(), flag_key, env_key, WRONG)


@pytest.mark.parametrize("content,problem", [(None, "cannot read"), ("", "is empty"), ("\n  \n", "is empty"),
                                             ("two keys\n", "whitespace"), (b"\xff\xfe", "not UTF-8")])
def test_an_unusable_key_file_is_one_line_naming_the_file(tmp_path, content, problem):
    from unmask.cli.main import UsageError
    from unmask.cli.serve import read_api_key

    path = tmp_path / "keyfile"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UsageError) as e:
        read_api_key(str(path))
    msg = str(e.value)
    assert msg.startswith("--api-key-file: ") and str(path) in msg and problem in msg, msg
    assert "two keys" not in msg


@pytest.mark.parametrize("content", [b"\xef\xbb\xbfs3cret-Key\n", b"\xef\xbb\xbfs3cret-Key", b"s3cret-Key\r\n"])
def test_a_key_file_with_a_utf8_bom_gives_the_key_without_it(tmp_path, content):
    """Notepad and PowerShell write a BOM: as part of the key every client would get 401."""
    from unmask.cli.serve import read_api_key

    path = tmp_path / "keyfile"
    path.write_bytes(content)
    assert read_api_key(str(path)) == "s3cret-Key"


@pytest.mark.parametrize("kind", ["dir", "fifo", "devzero", "huge"])
def test_a_key_file_that_is_not_a_small_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO would block start-up, /dev/zero would be read until memory runs out (a MemoryError traceback)."""
    import os

    from unmask.cli.main import UsageError
    from unmask.cli.serve import read_api_key

    path = tmp_path / "keyfile"
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path = "/dev/zero"
    else:
        path.write_text("k" * 5000 + "\n")
    result: list = []

    def call():
        try:
            read_api_key(str(path))
        except BaseException as exc:  # noqa: BLE001 - the test inspects what came out
            result.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(5)
    if kind == "fifo" and t.is_alive():  # unblock the reader so the thread ends
        with open(path, "w") as w:
            w.write("x\n")
        t.join(5)
    assert result and isinstance(result[0], UsageError), result
    msg = str(result[0])
    assert msg.startswith("--api-key-file: ") and str(path) in msg and "\n" not in msg, msg
    assert ("not a regular file" if kind in ("dir", "fifo", "devzero") else "larger than") in msg, msg


def test_the_server_log_lines_of_a_request_carry_its_id(server, http):
    rid = "trace-Harden-42"
    r = http.post(C, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": rid})
    bad = http.post(C, json={"model": MODEL, "prompt": "Hi", "block_size": 10 ** 5},
                    headers={"X-Request-Id": rid + "-bad"})
    assert r.headers["x-request-id"] == rid and bad.headers["x-request-id"] == rid + "-bad"
    time.sleep(0.3)
    text = server["log"].read_text()
    done = [ln for ln in text.splitlines() if r.json()["id"] in ln]
    refused = [ln for ln in text.splitlines() if f"[{rid}-bad]" in ln and " INFO " in ln]  # (+ a DEBUG line)
    assert done and all(f"[{rid}]" in ln for ln in done), done
    assert refused and "status=400" in refused[0] and "param=block_size" in refused[0], refused
    forged = http.get("/health", headers={"X-Request-Id": "a b\r"[:3]})  # not sane: replaced
    assert re.fullmatch(r"req-[0-9a-f]{24}", forged.headers["x-request-id"])


# ---------------------------------------------------------------------------------------------- schemathesis
# documented 400s that depend on the model or on another field in a way JSON Schema cannot state
# (docs/design.md#admission-and-limits): a schema-valid request may still get one of these, naming this field
MODEL_DEPENDENT_400 = {
    "max_tokens",          # prompt + max_tokens beyond the context (or the KV budget)
    "max_completion_tokens",
    "prompt",              # a token id outside the vocabulary; a prompt that fills the context
    "prompt.N",            # the same for one prompt of several (named by its index)
    "tokens.N",            # /detokenize: a token id outside the vocabulary
    "messages",            # the chat template refuses the role order
    "stop_token_ids",      # an id outside the vocabulary, or one the model never samples (its mask token)
    "block_size",          # longer than max_tokens can use / than the context
    "steps", "threshold", "remasking",  # with speculative: true (speculative decoding decides its own reveals)
    "sub_block_size",      # longer than block_size; with speculative: true
    "min_tokens",          # more than max_tokens
    "best_of",             # best_of != n
    "n",                   # prompts x n beyond --max-seqs-per-request
    "suffix",              # infilling needs a bidirectional model
    "speculative", "speculative_branches", "speculative_epsilon", "speculative_ratio",
    "speculative_no_repeat_ngram",  # speculative decoding's model and greedy-only rules
    "logit_bias",          # a token id outside the vocabulary, or one the model never samples (its mask token)
    "multi_block",         # needs a prefix/block-causal model, whole-block windows, no speculative decoding
    "editing_threshold", "max_post_steps",  # token editing: llada2 models only; max_post_steps needs editing
    "max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
    "confidence_threshold",  # the uniform-canvas sampler's options (diffusion_gemma models only)
    "response_format", "tool_choice", "tools",  # a schema llguidance cannot compile; a template without tools
    "messages.N.tool_call_id",  # a tool message must answer a call of an earlier assistant message (across items)
    # /v1/responses: its errors name its own fields (the chat ones above are translated: max_output_tokens, input,
    # input.N.content, text.format, tools.N.parameters, ...)
    "max_output_tokens",   # as max_tokens
    "input",               # as prompt / messages: the context, the template's role order
    "input.N.call_id",     # a function_call_output must answer a function_call of an earlier item
    "text.format", "text.format.schema",  # as response_format
    "tools.N.parameters",  # a parameters schema llguidance cannot compile
    "messages.N.tool_calls.N.function.arguments", "tools.N.function.parameters",
    "input.N.arguments",  # JSON nested too deep (docs/design.md#admission-and-limits)
}


def _past_declared_bound(body, param: str | None) -> bool:
    """Whether ``body[param]`` is an integer past the bound the schema declares for it (``engine/limits.py``'s
    range, published exactly). schemathesis' positive generator compares integer bounds near 2**63 in float64 and
    emits such values (``seed: 9223372036854775998`` against a maximum of 2**63 - 1): exactly compared they are
    invalid, and a 400 naming the field is what the schema promises."""
    from unmask.engine.limits import RANGES

    rng = RANGES.get(param or "")
    value = body.get(param) if isinstance(body, dict) and param else None
    if rng is None or not isinstance(value, int) or isinstance(value, bool):
        return False
    return (rng.hi is not None and value > rng.hi) or (rng.lo is not None and value < rng.lo)


def _fuzz(server, post_examples: int, get_examples: int) -> tuple[int, list, list]:
    """schemathesis with every check (but its positive-data acceptance, replaced by ours: a schema-valid request
    may get only a 400 naming a field of :data:`MODEL_DEPENDENT_400`) on every operation of /openapi.json, positive
    and negative data, ``post_examples`` per POST operation and mode (``get_examples`` per GET). Returns
    ``(calls, failed checks, undocumented answers)``."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    checks = [c for c in CHECKS.get_all() if c.__name__ != "positive_data_acceptance"]
    auth = {"Authorization": f"Bearer {KEY}"}
    schema = schemathesis.openapi.from_url(server["url"] + "/openapi.json")
    failures, undocumented, calls = [], [], 0
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=post_examples if op.method.upper() == "POST" else get_examples, deadline=None,
                      database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                      derandomize=True)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                nonlocal calls
                calls += 1
                if isinstance(case.body, dict):
                    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # keep the run short
                        if isinstance(case.body.get(name), int) and case.body[name] > 0:
                            case.body[name] = min(case.body[name], 16)
                response = case.call(base_url=server["url"], headers=auth, timeout=60)
                try:
                    case.validate_response(response, checks=checks, headers=auth)
                except Exception as exc:  # schemathesis' FailureGroup: every failed check
                    failures.append((str(exc)[:400], case.as_curl_command()))
                if mode == schemathesis.GenerationMode.POSITIVE and response.status_code >= 400:
                    param = (response.json().get("error") or {}).get("param") if response.status_code == 400 else None
                    if _past_declared_bound(case.body, param):
                        return  # not a schema-valid case, whatever the generator says
                    if param is None or re.sub(r"\.\d+", ".N", param) not in MODEL_DEPENDENT_400:
                        undocumented.append((response.status_code, response.text[:300], case.as_curl_command()))

            try:
                check()
            except Unsatisfiable:  # no invalid input exists for an operation without parameters
                assert mode == schemathesis.GenerationMode.NEGATIVE
    return calls, failures, undocumented


def _assert_clean(failures: list, undocumented: list) -> None:
    assert not failures, failures[:3]
    assert not undocumented, (sorted({u[1][:160] for u in undocumented}), undocumented[0][2][-600:])


def test_schemathesis_with_every_check_a_few_examples(server):
    """The default run's bounded version (4 examples per POST operation and mode, 1 per GET): ~20 s."""
    calls, failures, undocumented = _fuzz(server, post_examples=4, get_examples=1)
    assert calls >= 12  # 3 POST operations x 4 positive examples, at least
    _assert_clean(failures, undocumented)


@pytest.mark.system  # a few minutes of fuzzing; the default run has the bounded version above
def test_schemathesis_with_every_check_finds_nothing_undocumented(server):
    t0 = time.time()
    calls, failures, undocumented = _fuzz(server, post_examples=40, get_examples=4)
    assert calls >= 120  # 3 POST operations x 40 positive examples, at least
    _assert_clean(failures, undocumented)
    assert time.time() - t0 < 600  # ~1 min on a quiet 2-core machine


def test_the_schema_says_which_routes_need_the_key(http):
    from unmask.server.guard import needs_key

    schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert ("security" in op) == needs_key(path), (method, path)
