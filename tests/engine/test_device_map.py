"""device_map through accelerate (engine/placement.py, docs/design.md#scale-out): a tiny model's layers split
between CPU memory and disk offload give the unsplit model's tokens and logits; bad maps fail naming the field."""
from __future__ import annotations

import pytest
import torch

import tiny
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.llm import LLM
from unmask.engine.model import load_model
from unmask.engine.params import SamplingParams
from unmask.engine.placement import parse_device_map, parse_max_memory

PROMPTS = ["The quick brown fox", "Diffusion language models", "One two three"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("dmap") / "src"
    lm = tiny.loaded(num_hidden_layers=4)
    write_checkpoint(d, lm.model, lm.tokenizer, lm.dllm)
    return d


def _tokens(loaded, **kw):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in LLM(loaded).generate(PROMPTS, params)]


def _split_map(n_layers=4, on_disk=(2, 3)):
    m = {"model.embed_tokens": "cpu", "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}
    m.update({f"model.layers.{i}": ("disk" if i in on_disk else "cpu") for i in range(n_layers)})
    return m


def test_cpu_and_disk_split_gives_the_unsplit_tokens(ckpt, tmp_path):
    ref = load_model(ckpt, device="cpu", weights="native")
    split = load_model(ckpt, device="cpu", device_map=_split_map(), offload_folder=str(tmp_path / "off"))
    assert split.weight_format == "native" and split.device == torch.device("cpu")
    assert set(split.device_map.values()) == {"cpu", "disk"}
    assert list((tmp_path / "off").glob("*.dat")), "disk modules were not offloaded to the folder"
    # offloaded weights are not resident: their parameters sit on the meta device between forwards
    assert split.model.model.layers[3].mlp.up_proj.weight.device.type == "meta"
    assert split.model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        a = ref.logits(ref.hidden_states(ids, pos, None)[0])
        b = split.logits(split.hidden_states(ids, pos, None)[0])
    assert torch.equal(a, b)
    assert _tokens(split) == _tokens(ref)
    assert _tokens(split, block_size=4, threshold=0.5) == _tokens(ref, block_size=4, threshold=0.5)


def test_inferred_map_under_max_memory_offloads_the_tail(ckpt, tmp_path):
    ref = load_model(ckpt, device="cpu", weights="native")
    # 400 KB of CPU memory for a 756 KB model: the embedding and the first layer fit, the rest goes to disk
    # (accelerate's infer_auto_device_map, layers kept whole)
    split = load_model(ckpt, device="cpu", device_map="sequential", max_memory="cpu=400KB",
                       offload_folder=str(tmp_path / "off"))
    where = set(split.device_map.values())
    assert where == {"cpu", "disk"}, split.device_map
    assert split.device_map["model.layers.0"] == "cpu" and split.device_map["model.layers.3"] == "disk"
    assert _tokens(split) == _tokens(ref)


def test_bad_device_map_and_weights_fail_naming_the_field(ckpt):
    with pytest.raises(ValueError, match="device_map"):
        parse_device_map("everywhere")
    with pytest.raises(ValueError, match="device_map"):
        parse_device_map({"model.layers.0": "tpu"})
    with pytest.raises(ValueError, match="max_memory"):
        parse_max_memory("cpu:2GB")
    assert parse_max_memory("cpu=2GiB,0=20GB") == {"cpu": "2GiB", 0: "20GB"}
    with pytest.raises(ValueError, match="weights"):
        load_model(ckpt, device="cpu", weights="fp16", device_map="auto")
    with pytest.raises(ValueError, match="max_memory"):
        load_model(ckpt, device="cpu", device_map="auto", max_memory="cpu=1KB")
    # options that only a device map reads are refused without one (and max_memory beside an explicit map), not
    # silently ignored
    for kw, says in ((dict(max_memory="cpu=2GiB"), "max_memory: applies only with device_map"),
                     (dict(offload_folder="/tmp/x"), "offload_folder: applies only with device_map"),
                     (dict(device_map={"": "cpu"}, max_memory="cpu=2GiB"), "max_memory: an explicit device_map")):
        with pytest.raises(ValueError, match=says):
            load_model(ckpt, device="cpu", **kw)
    with pytest.raises(ValueError, match="accelerators"):
        load_model(ckpt, device="cpu", device_map={**_split_map(), "model.layers.0": "cuda:0",
                                                    "model.layers.1": "cuda:1"})


@pytest.mark.system
def test_serve_with_a_device_map_answers_as_the_unsplit_model(tmp_path):
    import json
    import urllib.request

    from serving import start_server, stop_server

    proc, base, log = start_server(tmp_path, "--device-map", "sequential", "--max-memory", "cpu=400KB",
                                   "--offload-folder", str(tmp_path / "off"))
    try:
        body = json.dumps({"model": "tiny-a2d", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        text = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
    finally:
        stop_server(proc)
    assert list((tmp_path / "off").glob("*.dat"))
    ref = LLM(load_model(tmp_path / "tiny-a2d", device="cpu", weights="native"))
    expect = ref.generate("The quick brown fox", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert text == expect[0].outputs[0].text
