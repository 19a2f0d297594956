"""LLaDA2.x through the server (docs/design.md#http-contract, "Revisable canvases"): a streamed token-editing
request whose denoising chunks show tokens changing while its content deltas only ever append final text, equal to
the non-streamed answer; the held-out OpenAI checks (llm-comply, system) on a tiny LLaDA2 checkpoint."""
from __future__ import annotations


import pytest
from fastapi.testclient import TestClient

from llada2_tiny import checkpoint_dir, loaded_llada2
from revisable_stream import check_revisable_stream, stream_chunks
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

CH = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "Diffusion language models"}], "max_tokens": 24,
        "temperature": 0, "threshold": 0.7, "editing_threshold": 0.5, "block_size": 8}


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(AsyncEngine(loaded_llada2(seed=1)), "m")) as c:
        yield c


def test_a_streamed_editing_request_revises_its_canvas_but_never_its_content(client):
    chunks, content = check_revisable_stream(client, BODY)
    # content was sent while later blocks were still being edited, and none of it was ever wrong: what a client
    # received before an edit is a prefix of the final answer (deltas only append final text)
    sent, prefixes, edits_after_content, last = "", [], 0, None
    for c in chunks:
        d = c.get("denoising")
        if d is not None:
            if last is not None and sent:
                edits_after_content += sum(x is not None and y is not None and x != y
                                           for x, y in zip(last["canvas"], d["canvas"]))
            last = d
        elif c.get("choices") and c["choices"][0]["delta"].get("content"):
            sent += c["choices"][0]["delta"]["content"]
            prefixes.append(sent)
    assert edits_after_content > 0
    assert all(content.startswith(p) for p in prefixes)


def test_editing_on_another_family_is_a_400_naming_the_field():
    from tiny import loaded

    with TestClient(build_app(AsyncEngine(loaded(attention="block_causal")), "m")) as c:
        r = c.post(CH, json={**BODY, "block_size": 4})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "editing_threshold"


@pytest.mark.system
def test_llm_comply_on_a_tiny_llada2(tmp_path):
    from test_comply import check_checkpoint_complies

    check_checkpoint_complies(tmp_path, str(checkpoint_dir(loaded_llada2(seed=1), tmp_path / "llada2")))


def test_streamed_logprobs_of_an_editing_request_join_into_the_non_streamed_ones(client):
    """Edited positions carry the logprobs of their last edit; the stream hands each out with the text that first
    shows its token (only final text is shown), so the chunks' logprobs joined equal the non-streamed ones."""
    body = {**BODY, "logprobs": True, "top_logprobs": 2}
    plain = client.post(CH, json=body).json()["choices"][0]["logprobs"]["content"]
    chunks = stream_chunks(client, body)
    streamed = [e for c in chunks if c.get("choices") and not c.get("denoising")
                for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [(e["token"], e["logprob"]) for e in streamed] == [(e["token"], e["logprob"]) for e in plain]


def test_the_logprobs_cursor_follows_an_edit_of_a_revealed_token():
    """A token edited after it was revealed (a revisable canvas) changes the prefix the cursor measures: the text
    of the edited token decides when its logprobs go out (a stale prefix handed position 1's out with the old
    token's one character)."""
    from unmask.engine import Revealed
    from unmask.server.stream_logprobs import TokenCursor

    cursor = TokenCursor(lambda ids: "".join(str(i) for i in ids))
    cursor.add([Revealed(0, 1, 0.9, -0.1), Revealed(1, 2, 0.9, -0.1)])
    cursor.add([Revealed(1, 234, 0.8, -0.2)])  # edited: its text is "234"
    assert [r.position for r in cursor.advance(2)] == [0]  # "12" of "1234": position 1 is not complete yet
    assert [(r.position, r.token_id) for r in cursor.advance(2)] == [(1, 234)]
