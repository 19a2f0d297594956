"""Tenants (issue 41; docs/design.md#admission-and-limits): several API keys, each a tenant; the prefix cache never
shares KV across tenants (salted by tenant and by the request's ``cache_salt``), so ``cached_tokens`` reports only
the caller's own hits and the hit counter does not move for another tenant's guesses; each tenant's own multi-turn
chat still hits. In-process on the tiny prefix-causal model; the key file's format through ``read_api_keys``."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

KEYS = {"sk-tenant-a": "alice", "sk-tenant-b": "bob", "sk-tenant-a2": "alice"}
CH = "/v1/chat/completions"
SECRET = ("My PIN is 4711 and my account one two three four five six seven eight nine ten eleven twelve "
          "thirteen fourteen fifteen sixteen seventeen eighteen")


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine(loaded(block_size=4))
    with TestClient(build_app(engine, "m", api_keys=KEYS)) as c:
        yield c, engine


def _chat(client, key: str, messages: list[dict], **extra) -> tuple[dict, str]:
    r = client.post(CH, headers=_auth(key), json={"model": "m", "max_tokens": 4, "temperature": 0,
                                                  "messages": messages, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["message"]["content"]


def test_tenants_never_hit_each_others_cache(served):
    client, engine = served
    turn1 = [{"role": "user", "content": SECRET}]
    cached, answer = _chat(client, "sk-tenant-a", turn1)
    assert cached == 0
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the next one?"}]
    cached, _ = _chat(client, "sk-tenant-a", turn2)
    assert cached >= 16, cached  # alice's own multi-turn chat hits her cache
    hits = engine.prefix_cache_hits
    cached, _ = _chat(client, "sk-tenant-b", turn2)  # bob guesses alice's whole conversation
    assert cached == 0 and engine.prefix_cache_hits == hits
    r = client.post("/v1/completions", headers=_auth("sk-tenant-b"),  # and her prompt as completions text
                    json={"model": "m", "prompt": SECRET, "max_tokens": 2, "cache_salt": "guess"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.text
    assert engine.prefix_cache_hits == hits
    # a cache_salt separates requests of one tenant too; alice's second key is alice
    cached, _ = _chat(client, "sk-tenant-a", turn2, cache_salt="other")
    assert cached == 0 and engine.prefix_cache_hits == hits
    cached, _ = _chat(client, "sk-tenant-a2", turn2)
    assert cached >= 16


def test_each_tenant_own_chat_hits(served):
    client, _ = served
    turn1 = [{"role": "user", "content": "Bob's notes: " + SECRET[::-1]}]
    assert _chat(client, "sk-tenant-b", turn1)[0] == 0
    turn2 = turn1 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert _chat(client, "sk-tenant-b", turn2)[0] >= 16
    assert _chat(client, "sk-tenant-b", turn2, cache_salt="s1")[0] == 0
    assert _chat(client, "sk-tenant-b", turn2, cache_salt="s1")[0] >= 16  # the same salt shares


def test_unknown_key_is_a_401(served):
    client, _ = served
    r = client.post(CH, headers=_auth("sk-tenant-c"), json={"model": "m", "messages": [{"role": "user",
                                                                                         "content": "x"}]})
    assert r.status_code == 401


def test_the_key_file(tmp_path):
    from unmask.cli.main import UsageError
    from unmask.cli.serve import read_api_keys

    path = tmp_path / "keys"
    path.write_bytes(b"\xef\xbb\xbf# tenants\nk1 alice\n\n  k2   bob  \nk3\nk4 alice\n")
    assert read_api_keys(str(path)) == {"k1": "alice", "k2": "bob", "k3": "line 5", "k4": "alice"}
    for content, problem in (("k1 a b\n", "line 1: expected KEY or KEY TENANT"), ("k1\nk1 x\n", "line 2: this key"),
                             ("# none\n\n", "holds no key")):
        path.write_text(content)
        with pytest.raises(UsageError) as e:
            read_api_keys(str(path))
        assert problem in str(e.value) and "k1" not in str(e.value).replace(str(path), ""), str(e.value)


def test_an_unnamed_key_cannot_share_a_named_tenant(tmp_path):
    """Break-it: ``AAA line-2`` then an unnamed ``BBB`` on line 2 were one tenant (one prefix cache)."""
    from unmask.cli.serve import read_api_keys

    path = tmp_path / "keys"
    for named in ("line-2", "line2", "line_2"):
        path.write_text(f"AAA {named}\nBBB\n")
        keys = read_api_keys(str(path))
        assert keys["AAA"] != keys["BBB"], keys


def test_an_empty_api_key_is_refused_at_start(tmp_path):
    """Break-it: ``--api-key=`` (or an empty ``UNMASK_API_KEY``) started a server that took a bare ``Bearer``."""
    import subprocess
    import sys

    for args, env in (([f"--api-key="], {}), ([], {"UNMASK_API_KEY": " "})):
        # --port 0 (any free port): a server left on :8000 must not answer first
        proc = subprocess.run([sys.executable, "-m", "unmask.cli.main", "serve", str(tmp_path / "none"), *args,
                               "--port", "0"],
                              capture_output=True, text=True, timeout=120,
                              env={**__import__("os").environ, **env})
        assert proc.returncode == 2 and "is empty" in proc.stderr, (proc.returncode, proc.stderr[-400:])
