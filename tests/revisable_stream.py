"""The revisable-canvas stream checked through the server (docs/design.md#http-contract, "Revisable canvases"): a
streamed request whose denoising chunks show tokens changing between steps, each change inside the provisional
region the previous chunk announced (``final``), and whose content deltas equal the non-streamed answer. Shared by
the families that revise a canvas (LLaDA2's token editing, DiffusionGemma's uniform canvas)."""
from __future__ import annotations

import json

CHAT = "/v1/chat/completions"


def stream_chunks(client, body: dict) -> list[dict]:
    """The ``data:`` objects of ``body`` streamed with ``include_denoising`` (``[DONE]`` left out)."""
    out = []
    with client.stream("POST", CHAT, json={**body, "stream": True,
                                           "stream_options": {"include_denoising": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def check_revisable_stream(client, body: dict) -> tuple[list[dict], str]:
    """Stream ``body`` and check the revisable-canvas rules against its non-streamed answer; returns the chunks and
    the answer's content. Fails when no token changed between steps (the check would be vacuous)."""
    plain = client.post(CHAT, json=body)
    assert plain.status_code == 200, plain.text
    answer = plain.json()["choices"][0]["message"]["content"]
    chunks = stream_chunks(client, body)
    canvases = [c["denoising"] for c in chunks if c.get("denoising")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                      if c.get("choices") and not c.get("denoising"))
    assert content == answer
    changed = [i for a, b in zip(canvases, canvases[1:]) for i, (x, y) in enumerate(zip(a["canvas"], b["canvas"]))
               if x is not None and y is not None and x != y]
    assert changed, "no token changed between steps: the check would be vacuous"
    for a, b in zip(canvases, canvases[1:]):
        for i, (x, y) in enumerate(zip(a["canvas"], b["canvas"])):
            if x is not None and x != y:
                assert a.get("final") is not None and i >= a["final"], (i, a.get("final"))
    return chunks, answer
