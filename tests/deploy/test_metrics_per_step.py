"""The work counters grow as a request runs (docs/design.md#deployment-and-metrics): ``unmask:generation_tokens_total``
counts tokens as denoising steps reveal them, not when the request ends, and over whole requests still equals usage."""
from __future__ import annotations

import json

import httpx
import pytest

from serving import served_tiny
from unmask.server.accounting import Tally, Work

COUNTERS = ("generation_tokens_total", "nfe_total", "denoising_steps_total", "prompt_tokens_total")


def scrape(base: str) -> dict[str, float]:
    """``unmask:NAME`` (without labels) -> value, for the label-free-by-reason counters above."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("unmask:") and "{" in line:
            name = line[len("unmask:"):line.index("{")]
            if name in COUNTERS:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served_tiny(tmp_path_factory.mktemp("per-step"))


def test_a_long_streams_generation_tokens_grow_before_it_ends(server):
    before = scrape(server)
    # 480 steps of full forwards (no KV cache): seconds; one token revealed per step
    body = {"model": "tiny", "prompt": "One two", "max_tokens": 480, "ignore_eos": True, "seed": 0, "stream": True,
            "cache": "none", "stream_options": {"include_usage": True}}
    mid, usage, chunks = None, None, 0
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0].get("text"):
                chunks += 1
                if chunks == 20 and mid is None:  # well inside the stream: the request is still running
                    mid = scrape(server)
    after = scrape(server)
    assert mid is not None and usage is not None and usage["completion_tokens"] == 480
    grown = {k: mid[k] - before[k] for k in COUNTERS}
    assert grown["generation_tokens_total"] >= 20, grown  # at least the tokens the client has already seen
    assert grown["generation_tokens_total"] < 480, grown  # ... and not the whole request yet
    assert grown["nfe_total"] >= 20 and grown["denoising_steps_total"] >= 20, grown
    assert grown["prompt_tokens_total"] == usage["prompt_tokens"], grown  # counted at the first forward
    # at the end the counters moved by exactly the usage
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == usage["completion_tokens"]
    assert after["nfe_total"] - before["nfe_total"] == usage["nfe"]
    assert after["denoising_steps_total"] - before["denoising_steps_total"] == usage["denoising_steps"]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == usage["prompt_tokens"]


def test_stop_strings_and_eos_keep_the_counters_equal_to_usage(server):
    before = scrape(server)
    usages = []
    for body in ({"prompt": "One two", "max_tokens": 24, "seed": 1, "stop": [" "]},  # cut by a stop string
                 {"prompt": "The quick", "max_tokens": 24, "seed": 2, "n": 2},    # may end by EOS
                 {"prompt": ["a", "b"], "max_tokens": 8, "seed": 3}):
        r = httpx.post(server + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    after = scrape(server)
    for name, field in (("generation_tokens_total", "completion_tokens"), ("nfe_total", "nfe"),
                        ("denoising_steps_total", "denoising_steps"), ("prompt_tokens_total", "prompt_tokens")):
        assert after[name] - before[name] == sum(u[field] for u in usages), name


def test_tally_counts_increases_once_and_prompts_at_their_first_forward():
    counted: list[tuple[int, Work]] = []
    tally = Tally(lambda p, w: counted.append((p, w)), prompt_tokens=[5, 7], n=2)
    tally.advance(0, Work(tokens=0, nfe=0, steps=0))  # queued, nothing done: nothing counted
    assert counted == []
    tally.advance(0, Work(tokens=1, nfe=1, steps=1))
    tally.advance(1, Work(tokens=0, nfe=1, steps=1))  # same prompt: its tokens are not counted twice
    tally.advance(0, Work(tokens=1, nfe=1, steps=1))  # no change: nothing counted
    tally.advance(0, Work(tokens=4, nfe=3, steps=3, drafts_proposed=2, drafts_accepted=1))
    assert counted == [(5, Work(1, 1, 1)), (0, Work(0, 1, 1)), (0, Work(3, 2, 2, 2, 1))]
    counted.clear()
    # the end: choice 0 finished with 4 tokens, 1 with 2; prompt 1 (choices 2, 3) never ran but the request
    # completed, so its tokens count (usage counts every prompt)
    tally.settle([Work(4, 3, 3, 2, 1), Work(2, 2, 2), Work(), Work()], completed=True)
    assert counted == [(0, Work(2, 1, 1)), (7, Work())]
    counted.clear()
    tally.settle([Work(4, 3, 3, 2, 1), Work(2, 2, 2), Work(), Work()], completed=True)  # idempotent
    assert counted == []


def test_a_failed_request_does_not_count_its_unrun_prompts():
    counted: list[tuple[int, Work]] = []
    tally = Tally(lambda p, w: counted.append((p, w)), prompt_tokens=[5, 7], n=1)
    tally.settle([Work(2, 2, 2), Work()], completed=False)
    assert counted == [(5, Work(2, 2, 2))]
