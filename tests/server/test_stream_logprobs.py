"""Logprobs per token and per chunk (issue 40): ``top_logprobs`` up to 20 (chat) and ``logprobs`` up to 5
(completions), OpenAI's limits, recorded by every decoding path; streamed, each chunk carries the logprobs of the
tokens whose text it first shows (a token revealed early waits for its text, a UTF-8 fragment for the token that
completes its character), and the chunks' logprobs joined equal the non-streamed ones."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import LLM, ParamError, Revealed, SamplingParams
from unmask.engine.detokenize import decode
from unmask.server.stream_logprobs import TokenCursor

C, CH = "/v1/completions", "/v1/chat/completions"
# text the tiny byte-level BPE splits into fragments of multi-byte characters
HI = [{"role": "user", "content": "Grüße aus München — 東京 and 北京"}]


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


@pytest.fixture(scope="module")
def client(model):
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app

    engine = AsyncEngine(model)
    with TestClient(build_app(engine, "m")) as c:
        yield c


def _stream(client, path: str, body: dict) -> list[dict]:
    out = []
    body = {**body, "stream": True, "stream_options": {"include_denoising": True}}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def _entries(path: str, logprobs: dict | None) -> list:
    if not logprobs:
        return []
    if path == CH:
        return logprobs["content"]
    return [list(x) for x in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                 logprobs["text_offset"])]


def _text(path: str, choice: dict) -> str:
    return (choice["delta"].get("content") or "") if path == CH else choice["text"]


def _check_chunks(tok, path: str, chunks: list[dict]) -> dict[int, list]:
    """Each content chunk carries exactly the tokens its text completes; returns every choice's joined entries."""
    ids: dict[int, dict[int, int]] = {}
    text: dict[int, str] = {}
    got: dict[int, list] = {}
    for chunk in chunks:
        if "denoising" in chunk:
            d = chunk["denoising"]
            ids.setdefault(d["index"], {}).update({r["position"]: r["token_id"] for r in d["revealed"]})
            continue
        choice = chunk["choices"][0]
        c = choice["index"]
        text[c] = text.get(c, "") + _text(path, choice)
        got.setdefault(c, []).extend(_entries(path, choice.get("logprobs")))
        if choice["finish_reason"] is not None or not _text(path, choice):
            continue
        k, known = len(got[c]), ids.get(c, {})
        prefix = [known[i] for i in range(k)]  # every token carried was revealed, in order
        assert text[c].startswith(decode(tok, prefix)), (decode(tok, prefix), text[c])
        end = k  # the next run of tokens with whole text must not fit the text shown (else it came late)
        while end in known:
            end += 1
            piece = decode(tok, [known[i] for i in range(end)])
            if len(piece) > len(decode(tok, prefix)) and not piece.endswith("\ufffd"):
                assert len(piece) > len(text[c]), ("token held back", k, piece, text[c])
                break
    return got


BODIES = {
    "quota random": {"steps": 8, "remasking": "random", "temperature": 0.9, "seed": 1},
    "low_confidence": {"temperature": 0.7, "seed": 2},
    "threshold": {"threshold": 0.2, "temperature": 0, "seed": 0},
    "speculative greedy": {"speculative": True, "temperature": 0},
    "speculative sampled": {"speculative": True, "temperature": 0.8, "seed": 3},
    "multi_block": {"multi_block": 0.5, "temperature": 0.5, "seed": 4},
    "stop string": {"stop": ["e", " "], "temperature": 0.9, "seed": 5},
    "n=2": {"n": 2, "temperature": 0.9, "seed": 6, "steps": 6},
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_chat_chunks_carry_their_tokens_and_join_to_the_plain_logprobs(client, model, name):
    body = {"model": "m", "messages": HI, "max_tokens": 16, "logprobs": True, "top_logprobs": 20, **BODIES[name]}
    plain = client.post(CH, json=body).json()
    got = _check_chunks(model.tokenizer, CH, _stream(client, CH, body))
    for choice in plain["choices"]:
        want = choice["logprobs"]["content"]
        assert got[choice["index"]] == want, name
        assert all(len(t["top_logprobs"]) == 20 for t in want)
        for t in want:  # most likely first; the token's own logprob where it is among them
            lps = [a["logprob"] for a in t["top_logprobs"]]
            assert lps == sorted(lps, reverse=True)
            assert all(a["logprob"] == t["logprob"] for a in t["top_logprobs"] if a["token"] == t["token"]) or \
                t["token"] == "\ufffd"


def test_a_greedy_tokens_first_alternative_is_itself(client):
    body = {"model": "m", "messages": HI, "max_tokens": 8, "logprobs": True, "top_logprobs": 3, "temperature": 0}
    for t in client.post(CH, json=body).json()["choices"][0]["logprobs"]["content"]:
        assert t["top_logprobs"][0]["logprob"] == t["logprob"] and len(t["top_logprobs"]) == 3


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "json_object"}}, {"stop": ["a"]}])
def test_completions_chunks_join_with_offsets_and_up_to_five_alternatives(client, model, extra):
    body = {"model": "m", "prompt": ["Grüße aus", "東京"], "max_tokens": 12, "logprobs": 5, "temperature": 0.9,
            "seed": 7, "steps": 6, **extra}
    if "response_format" in extra:  # chat only: the constrained path on chat instead
        body = {"model": "m", "messages": HI, "max_tokens": 24, "logprobs": True, "top_logprobs": 5,
                "temperature": 0.9, "seed": 7, **extra}
        plain = client.post(CH, json=body).json()
        got = _check_chunks(model.tokenizer, CH, _stream(client, CH, body))
        assert got[0] == plain["choices"][0]["logprobs"]["content"]
        return
    plain = client.post(C, json=body).json()
    got = _check_chunks(model.tokenizer, C, _stream(client, C, body))
    for choice in plain["choices"]:
        lp = choice["logprobs"]
        assert got[choice["index"]] == [list(x) for x in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                                             lp["text_offset"])]
        for token, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert token in top and 1 <= len(top) <= 6  # 5 alternatives and the sampled token (texts may repeat)


@pytest.mark.parametrize("path,body,param", [
    (CH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (C, {"logprobs": 6}, "logprobs"),
])
def test_beyond_openais_limits_is_a_400(client, path, body, param):
    base = {"model": "m", "max_tokens": 2, **({"messages": HI} if path == CH else {"prompt": "Hi"})}
    r = client.post(path, json={**base, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ the cursor and the engine's record
def test_the_cursor_waits_for_the_prefix_the_text_and_whole_characters(model):
    tok = model.tokenizer
    ids = tok("a東京b", add_special_tokens=False).input_ids  # 東 and 京 are several byte tokens each
    assert len(ids) > 4
    cursor = TokenCursor(lambda x: decode(tok, x))
    rev = [Revealed(i, t, 0.5, -float(i), ()) for i, t in enumerate(ids)]
    cursor.add(rev[2:])               # revealed early, not yet the prefix
    assert cursor.advance(0) == []
    cursor.add(rev[:2])
    assert [r.position for r in cursor.advance(1)] == [0]  # "a" shown: only its token
    first = next(k for k in range(2, len(ids) + 1) if not decode(tok, ids[:k]).endswith("\ufffd"))
    assert cursor.advance(0) == []    # a fragment of 東 waits for the token that completes it
    assert [r.position for r in cursor.advance(1)] == list(range(1, first))
    rest = cursor.advance(len("京b"))
    assert [r.position for r in rest] == list(range(first, len(ids)))


def test_the_engine_records_top_logprobs_on_every_path(model):
    llm = LLM(model)
    for kw in ({}, {"speculative": True, "temperature": 0}, {"threshold": 0.3}):
        params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=4, seed=0, ignore_eos=True, **kw)
        out = llm.generate(["One two"], params)[0].outputs[0]
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
        assert all(1 <= len(top) <= 4 for top in out.top_logprobs)
    plain = llm.generate(["One two"], SamplingParams(max_tokens=8, logprobs=True, seed=0))[0].outputs[0]
    assert plain.top_logprobs is None
    with pytest.raises(ParamError, match="top_logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ParamError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
