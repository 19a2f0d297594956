"""Request options the loaded model cannot honour are never accepted silently (docs/design.md#admission-and-limits;
new-user report): a ``logit_bias`` key or a ``stop_token_ids`` entry on a token the model never samples (its mask token,
padding, suppressed ids) is a fast 400 naming the field and the id, and the server goes on serving; ``cache:
prefix|dual`` on a prefix-/block-causal model is its exact cache, the same output as ``auto``, accepted on purpose
and said so in the published schema and the README (docs/design.md#decisions "Cache"); the other attention-dependent
options are 400s naming them on a model that cannot use them."""
from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import SamplingParams
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.engine import make_requests
from unmask.engine.limits import ParamError
from unmask.engine.plan import resolve_cache
from unmask.server.app import build_app

C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


@pytest.fixture(scope="module")
def client(model):
    eng = AsyncEngine(model, max_batch_size=4, max_queue=64)
    app = build_app(eng, "m", shutdown_engine=False)
    with TestClient(app) as c:
        yield c
    eng.shutdown()


def _c(**kw):
    return {"model": "m", "prompt": "Hello", "max_tokens": 8, "seed": 0, "temperature": 0, **kw}


def _ch(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "seed": 0,
            "temperature": 0, **kw}


# ------------------------------------------------------------------------------------ never-sampled token ids
def test_a_logit_bias_on_the_mask_token_is_a_400_naming_the_key(client, model):
    mask = model.dllm.mask_token_id
    for path, body in [(C, _c(logit_bias={str(mask): 10})), (CH, _ch(logit_bias={str(mask): -100})),
                       (CH, _ch(logit_bias={"5": 3, str(mask): 100})),      # among good keys
                       (C, _c(logit_bias={str(mask): 1}, stream=True))]:
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and err["code"] == "invalid_value", err
        assert f'"{mask}"' in err["message"] and "mask token" in err["message"], err
        assert "never sampled" in err["message"] and "no effect" in err["message"], err
        assert time.perf_counter() - t0 < 1.0
    ok = client.post(CH, json=_ch(logit_bias={"5": 3, "0": -100}))  # other ids keep working
    assert ok.status_code == 200, ok.text[:300]


def test_a_stop_token_id_that_is_never_sampled_is_a_400(client, model):
    mask = model.dllm.mask_token_id
    for path, body in [(C, _c(stop_token_ids=[mask])), (CH, _ch(stop_token_ids=[0, mask]))]:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == "stop_token_ids" and f"token id {mask}" in err["message"], err
        assert "mask token" in err["message"] and "never stop" in err["message"], err
    ok = client.post(C, json=_c(stop_token_ids=[5, 0]))
    assert ok.status_code == 200, ok.text[:300]


def test_every_never_sampled_id_is_refused_by_the_engine_api(model):
    """The kind, not the one id: the mask token, a padding token that is not an EOS and the checkpoint's suppressed
    ids (``DllmConfig.never_generate_ids``, -inf before every draw) are refused by the Python API too, for each
    field; an EOS that is also the padding token stays usable (it is sampled)."""
    other = copy.copy(model)
    other.dllm = dataclasses.replace(model.dllm, pad_token_id=7, suppress_token_ids=[9])
    assert set(other.dllm.never_generate_ids) == {model.dllm.mask_token_id, 7, 9}
    for tok, why in [(model.dllm.mask_token_id, "mask token"), (7, "padding token"), (9, "suppresses")]:
        for field, kw in [("logit_bias", {"logit_bias": {tok: 5.0}}), ("stop_token_ids", {"stop_token_ids": [tok]})]:
            with pytest.raises(ParamError) as e:
                make_requests(other, [5, 6, 7], SamplingParams(max_tokens=4, **kw), "r")
            assert e.value.field == field and why in str(e.value), (tok, field, e.value)
    assert make_requests(model, [5, 6], SamplingParams(max_tokens=4, logit_bias={0: -100.0}, stop_token_ids=[0]),
                         "r")


# ----------------------------------------------------------------------------------------------- cache modes
def _ids(client, **kw):
    r = client.post(C, json=_c(ignore_eos=True, logprobs=1, **kw))
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_prefix_and_dual_on_a_causal_model_are_its_exact_cache(client):
    """Accepted on purpose, not a 400: on a prefix-causal model `prefix` and `dual` run the exact cache (what
    `dual` buys, forwarding only the active block, the exact cache already does), token for token `auto` and
    `none`, so one request body suits every model."""
    want = _ids(client)
    for mode in ("prefix", "dual", "none", "auto"):
        assert _ids(client, cache=mode) == want, mode


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal", "bidirectional"])
def test_what_each_cache_mode_runs_per_attention(attention):
    dllm = loaded(attention=attention).dllm
    causal = attention != "bidirectional"
    got = {mode: resolve_cache(mode, dllm) for mode in ("auto", "none", "prefix", "dual")}
    assert got == ({"auto": "exact", "none": "none", "prefix": "exact", "dual": "exact"} if causal else
                   {"auto": "none", "none": "none", "prefix": "prefix", "dual": "dual"})


def test_the_published_schema_and_the_readme_say_what_cache_does_on_a_causal_model(client):
    """The equivalence is explicit, not silent: the `cache` field's description (chat, completions, responses)
    and the README's table say that prefix/dual are the exact cache on prefix-/block-causal models."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        desc = schemas[name]["properties"]["cache"]["description"]
        assert "prefix_causal or block_causal model prefix and dual are its exact cache" in desc, (name, desc)
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `cache` |"))
    assert "exact cache" in row and "same as `auto`" in row, row


# ------------------------------------------------------------------------- other attention-dependent options
@pytest.mark.parametrize("attention, kw, field", [
    ("prefix_causal", {"suffix": "the end"}, "suffix"),
    ("block_causal", {"suffix": [5, 6]}, "suffix"),
    ("prefix_causal", {"constraints": {0: 5}}, "constraints"),
    ("bidirectional", {"multi_block": 0.5}, "multi_block"),
    ("bidirectional", {"speculative": True}, "speculative"),
    ("block_causal", {"speculative": True}, "speculative"),
])
def test_an_option_the_models_attention_cannot_use_is_a_400_naming_it(attention, kw, field):
    m = loaded(attention=attention)
    with pytest.raises(ParamError) as e:
        make_requests(m, [5, 6, 7], SamplingParams(max_tokens=4, **kw), "r")
    assert e.value.field == field and m.dllm.attention in str(e.value), e.value
