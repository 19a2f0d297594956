"""Every dLLM family loads from a tiny replica saved in its own layout, without remote code (issue 2,
docs/design.md#model-families), and a directory that is none of them fails clearly.

Each replica is a tiny random model of the transformers architecture the family maps onto, saved the way the family
publishes it: its own ``config.json`` keys, ``architectures``/``model_type``/``auto_map``, weight names (LLaDA's
OLMo-style ``model.transformer.*``), tokenizer files (Dream's remote-code ``DreamTokenizer`` class) and mask token.
The loaded model must give exactly the logits of the model it was written from and generate through ``LLM``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiny import (family_tokenizer, llada_config_dict, llama_to_llada_state_dict, make_llama, make_tokenizer,
                  save_foreign_checkpoint)

V = 336  # embedding rows: the tokenizer (321-322 tokens) rounded up, as published vocabularies are


def _qwen2(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, use_sliding_window=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # q/k/v biases: make them matter
                p.normal_(0.0, 0.5)
    return model


def _qwen3(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # q_norm/k_norm and layer norms: make them matter
                p.add_(0.2 * torch.randn_like(p))
        for p in model.parameters():  # SDAR ships bfloat16 weights: the reference is their value (buffers untouched)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def _qwen_hub_config(model, **family) -> dict:
    """``config.json`` as a transformers-4.x Qwen checkpoint writes it (rope_theta, rope_scaling, torch_dtype)."""
    c = model.config
    cfg = {
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings, "max_window_layers": 28,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads, "pad_token_id": 0, "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False, "use_sliding_window": False,
        "vocab_size": V,
    }
    cfg.update(family)
    return cfg


def _write_llada(out: Path):
    tok = family_tokenizer(["<|eot_id|>", "<|mdm_mask|>"])
    ref = make_llama(V, seed=11, rope_theta=500000.0, rms_norm_eps=1e-5)
    cfg = llada_config_dict(V, eos_token_id=0, mask_token_id=tok.convert_tokens_to_ids("<|mdm_mask|>"))
    save_foreign_checkpoint(out, llama_to_llada_state_dict(ref.state_dict()), cfg, tok, shards=2,
                            tokenizer_config_updates={"tokenizer_class": "PreTrainedTokenizerFast"})
    return ref, tok


def _write_dream(out: Path):
    tok = family_tokenizer(["<|mask|>"])
    ref = _qwen2(seed=12)
    cfg = _qwen_hub_config(ref, architectures=["DreamModel"], model_type="Dream",
                           auto_map={"AutoConfig": "configuration_dream.DreamConfig",
                                     "AutoModel": "modeling_dream.DreamModel"},
                           mask_token_id=tok.convert_tokens_to_ids("<|mask|>"))
    save_foreign_checkpoint(out, ref.state_dict(), cfg, tok, tokenizer_config_updates={
        "tokenizer_class": "DreamTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}})
    return ref, tok


def _write_fast_dllm_v2(out: Path):
    tok = family_tokenizer(["|<MASK>|"])  # no mask_token_id in config: found through the tokenizer
    ref = _qwen2(seed=13)
    cfg = _qwen_hub_config(ref, architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=8,
                           auto_map={"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
                           eos_token_id=2)
    save_foreign_checkpoint(out, ref.state_dict(), cfg, tok, tokenizer_config_updates={"tokenizer_class": "Qwen2Tokenizer"})
    return ref, tok


def _write_sdar(out: Path):
    tok = family_tokenizer(["<|MASK|>"])
    ref = _qwen3(seed=14)
    cfg = _qwen_hub_config(ref, architectures=["SDARForCausalLM"], model_type="sdar", block_size=4, head_dim=16,
                           attention_bias=False, mask_token_id=tok.convert_tokens_to_ids("<|MASK|>"),
                           attn_implementation="flex_attention", fuse_cross_entropy=True, debug=False,
                           micro_forward=False, skip_checkpoint=False, ep_size=1, use_deepep=False,
                           auto_map={"AutoConfig": "configuration_sdar.SDARConfig",
                                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"})
    state = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    save_foreign_checkpoint(out, state, cfg, tok, shards=3, tokenizer_config_updates={"tokenizer_class": "Qwen2Tokenizer"},
                            generation_config={"bos_token_id": 0, "do_sample": True, "eos_token_id": [2, 0],
                                               "pad_token_id": 0, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    return ref, tok


WRITERS = {"llada": _write_llada, "dream": _write_dream, "fast_dllm_v2": _write_fast_dllm_v2, "sdar": _write_sdar}

# family -> (attention, logit_shift, block_size, block_alignment, fixed_block_size, mask token, default temperature)
EXPECTED = {
    "llada": ("bidirectional", False, 32, "generation", False, "<|mdm_mask|>", 0.0),
    "dream": ("bidirectional", True, 32, "generation", False, "<|mask|>", 0.0),
    "fast_dllm_v2": ("block_causal", True, 8, "absolute", True, "|<MASK>|", 0.0),
    "sdar": ("block_causal", False, 4, "absolute", True, "<|MASK|>", 0.6),
}
END_TOKENS = {"llada": ["<|endoftext|>", "<|eot_id|>"], "dream": ["<|endoftext|>", "<|im_end|>"],
              "fast_dllm_v2": ["<|im_end|>", "<|endoftext|>"], "sdar": ["<|im_end|>", "<|endoftext|>"]}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """family -> (directory, reference model, tokenizer)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, write in WRITERS.items():
        ref, tok = write(root / family)
        out[family] = (root / family, ref, tok)
    return out


@pytest.fixture(scope="module")
def loaded_models(replicas):
    from unmask.engine.model import load_model

    return {family: load_model(d, device="cpu", dtype="float32", weights="native") for family, (d, _, _) in replicas.items()}


@pytest.mark.parametrize("family", list(WRITERS))
def test_family_detected_and_settings_from_checkpoint(family, replicas, loaded_models):
    d, ref, tok = replicas[family]
    lm = loaded_models[family]
    attention, shift, block, align, fixed, mask_token, temperature = EXPECTED[family]
    dl = lm.dllm
    assert dl.family == family
    assert (dl.attention, dl.logit_shift, dl.block_size, dl.block_alignment, dl.fixed_block_size) == \
        (attention, shift, block, align, fixed)
    assert dl.mask_token_id == tok.convert_tokens_to_ids(mask_token)
    assert set(dl.eos_token_ids) == {tok.convert_tokens_to_ids(t) for t in END_TOKENS[family]}
    assert dl.mask_token_id not in dl.eos_token_ids
    assert dl.suppress_token_ids == list(range(len(tok), V))  # padding rows past the tokenizer: never generated
    assert dl.default_sampling == {"temperature": temperature}
    assert (dl.sub_block_size == 8) == (family == "fast_dllm_v2")
    assert lm.vocab_size == V and lm.max_context == 512
    assert type(lm.model).__name__ == {"llada": "LlamaForCausalLM", "sdar": "Qwen3ForCausalLM"}.get(
        family, "Qwen2ForCausalLM")
    # SDPA with the engine's boolean masks, per lane over each lane's own keys (engine/lane_attention.py)
    assert lm.model.config._attn_implementation == "unmask_lanes" and lm.lane_attention


@pytest.mark.parametrize("family", list(WRITERS))
def test_loaded_weights_give_reference_logits(family, replicas, loaded_models):
    _, ref, _ = replicas[family]
    lm = loaded_models[family]
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    n = ids.shape[1]
    bidir = torch.ones(2, 1, n, n, dtype=torch.bool)
    pos = torch.arange(n).expand(2, n)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=bidir, position_ids=pos).logits
        got = lm.logits(lm.hidden_states(ids, pos, bidir))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(WRITERS))
def test_family_generates_like_its_reference_model(family, replicas, loaded_models):
    """Decoding through the loaded checkpoint = decoding the model it was written from with the same settings."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import LoadedModel

    _, ref, tok = replicas[family]
    lm = loaded_models[family]
    twin = LoadedModel(model=ref, tokenizer=tok, dllm=lm.dllm, path="<memory>", device=torch.device("cpu"),
                       dtype=torch.float32, max_context=512)
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=0, ignore_eos=True)
    prompt = tok("What is the capital of France?").input_ids
    got = LLM(lm).generate([prompt], params)[0].outputs[0]
    want = LLM(twin).generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert len(got.token_ids) == 6 and got.finish_reason == "length"
    assert not set(got.token_ids) & set(lm.dllm.never_generate_ids)


@pytest.mark.parametrize("family", ["fast_dllm_v2", "sdar"])
def test_block_causal_families_keep_their_block_size(family, loaded_models):
    from unmask.engine import LLM, ParamError, SamplingParams

    lm = loaded_models[family]
    with pytest.raises(ParamError, match="block_size"):
        LLM(lm).generate([[5, 6, 7]], SamplingParams(max_tokens=4, block_size=lm.dllm.block_size * 2, temperature=0))


def test_generate_by_path_autodetects(replicas):
    """``LLM(path)``: detection, loading and decoding from the directory alone."""
    from unmask.engine import LLM, SamplingParams

    d, _, _ = replicas["sdar"]
    out = LLM(str(d), device="cpu").generate("The quick", SamplingParams(max_tokens=4, temperature=0.0, seed=0))
    assert out[0].outputs[0].finish_reason in ("stop", "length") and len(out[0].outputs[0].token_ids) <= 4


# ------------------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize("family,config", [
    ("llada", {"architectures": ["LLaDAModelLM"]}), ("llada", {"model_type": "llada"}),
    ("dream", {"architectures": ["DreamModel"]}), ("dream", {"model_type": "Dream"}),
    ("fast_dllm_v2", {"architectures": ["Fast_dLLM_QwenForCausalLM"]}),
    ("fast_dllm_v2", {"model_type": "Fast_dLLM_Qwen"}),
    ("sdar", {"architectures": ["SDARForCausalLM"]}), ("sdar", {"model_type": "sdar"}),
    ("a2d", {"architectures": ["DreamModel"], "dllm": {"family": "a2d"}}),
])
def test_detect_by_architectures_or_model_type(family, config):
    from unmask.engine.families import detect_family

    assert detect_family(config) == family


# ------------------------------------------------------------------------------------------------ failures


def test_plain_ar_checkpoint_fails_saying_what_was_expected(tmp_path):
    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    make_llama(320).save_pretrained(tmp_path / "ar")
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "ar")
    msg = str(err.value)
    assert str(tmp_path / "ar" / "config.json") in msg
    for expected in ("dllm", "LLaDAModelLM", "DreamModel", "Fast_dLLM_QwenForCausalLM", "SDARForCausalLM",
                     "unmask convert"):
        assert expected in msg


def test_missing_directory_and_missing_config_fail_clearly(tmp_path):
    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    with pytest.raises(CheckpointError, match="no such directory"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(tmp_path / "empty")


def _copy(replicas, family, tmp_path) -> Path:
    d = tmp_path / family
    shutil.copytree(replicas[family][0], d)
    return d


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def test_llada_option_without_llama_equivalent_is_refused(replicas, tmp_path):
    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    d = _copy(replicas, "llada", tmp_path)
    _edit_json(d / "config.json", block_type="sequential")
    with pytest.raises(CheckpointError, match=r"config\.json:block_type: 'sequential' is not supported"):
        load_model(d)
    _edit_json(d / "config.json", block_type="llama", scale_logits=True)
    with pytest.raises(CheckpointError, match="scale_logits"):
        load_model(d)


def test_weights_that_do_not_match_are_named(replicas, tmp_path):
    from safetensors.torch import load_file, save_file

    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    d = _copy(replicas, "llada", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"]["model.transformer.ln_f.weight"]
    tensors = load_file(str(shard))
    save_file({**tensors, "model.transformer.blocks.0.att_proj.weight": torch.zeros(3, 3)}, str(shard))
    with pytest.raises(CheckpointError, match="att_proj"):  # a sequential-block tensor: no Llama equivalent
        load_model(d)
    tensors.pop("model.transformer.ln_f.weight")
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"absent from the shards.*ln_f"):  # index names it, shard lacks it
        load_model(d)
    index["weight_map"].pop("model.transformer.ln_f.weight")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing keys.*model\.norm\.weight"):
        load_model(d)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_model(d)


def test_mask_token_must_exist_and_fit(replicas, tmp_path):
    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    d = _copy(replicas, "dream", tmp_path)
    _edit_json(d / "config.json", mask_token_id=V + 5)
    with pytest.raises(CheckpointError, match=r"mask_token_id: mask token id 341 is outside the model's 336"):
        load_model(d)
    # Fast-dLLM v2 without the |<MASK>| token and without mask_token_id: the published id 151665 does not fit
    d = _copy(replicas, "fast_dllm_v2", tmp_path)
    make_tokenizer(320).save_pretrained(str(d))
    with pytest.raises(CheckpointError, match=r"no mask token found.*\|<MASK>\|"):
        load_model(d)


def test_dream_tokenizer_class_is_never_run_as_remote_code(replicas):
    """Dream names a remote-code ``DreamTokenizer``; we load its files with a transformers class instead."""
    from unmask.engine.families.common import load_tokenizer_without_remote_code

    d, _, tok = replicas["dream"]
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "DreamTokenizer"
    got = load_tokenizer_without_remote_code(d, ("Qwen2Tokenizer",))
    text = "Paris is the capital of France. <|mask|>"
    assert got(text).input_ids == tok(text).input_ids
    assert got.chat_template == tok.chat_template


def test_dream_tokenizer_from_vocab_and_merges_only(tmp_path):
    """Dream's hub files have no tokenizer.json: vocab.json + merges.txt + a v4 ``tokenizer_config.json`` whose
    ``added_tokens_decoder`` holds the special tokens (``<|mask|>`` included). ``Qwen2Tokenizer`` reads them."""
    from unmask.engine.families.common import load_tokenizer_without_remote_code

    tok = family_tokenizer(["<|mask|>"])
    tok.save_pretrained(str(tmp_path))
    tok.backend_tokenizer.model.save(str(tmp_path))  # vocab.json + merges.txt
    (tmp_path / "tokenizer.json").unlink()
    specials = [(0, "<|endoftext|>"), (1, "<|im_start|>"), (2, "<|im_end|>"), (320, "<|mask|>")]
    _edit_json(tmp_path / "tokenizer_config.json", tokenizer_class="DreamTokenizer",
               auto_map={"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
               additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|mask|>"],
               added_tokens_decoder={str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": True} for i, c in specials})
    got = load_tokenizer_without_remote_code(tmp_path, ("Qwen2Tokenizer",))
    assert type(got).__name__ == "Qwen2Tokenizer"
    assert got.convert_tokens_to_ids("<|mask|>") == 320 and got.eos_token == "<|endoftext|>"
    text = "What is the capital of France?"
    assert got(text).input_ids == tok(text).input_ids
    assert got.decode(got("a<|mask|>b").input_ids, skip_special_tokens=True) == "ab"


def test_tied_head_checkpoints_load(tmp_path):
    """LLaDA ``weight_tying: true`` (no ``ff_out`` head) and SDAR-1.7B-style ``tie_word_embeddings`` (no
    ``lm_head.weight``; a stray saved ``rotary_emb.inv_freq`` buffer is tolerated) load with the tied head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unmask.engine.model import load_model

    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = make_llama(V, seed=3, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    state = llama_to_llada_state_dict({k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"})
    tok = family_tokenizer(["<|eot_id|>", "<|mdm_mask|>"])
    save_foreign_checkpoint(tmp_path / "llada", state, llada_config_dict(V, 0, 321, weight_tying=True), tok)
    lm = load_model(tmp_path / "llada", weights="native")
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)

    torch.manual_seed(0)
    q = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=True)).eval()
    state = {k: v for k, v in q.state_dict().items() if k != "lm_head.weight"}
    state["model.rotary_emb.inv_freq"] = q.model.rotary_emb.inv_freq.clone()
    cfg = {"architectures": ["SDARForCausalLM"], "model_type": "sdar", "vocab_size": V, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "tie_word_embeddings": True, "rope_theta": 10000.0, "mask_token_id": 320,
           "eos_token_id": 0, "block_size": 4}
    save_foreign_checkpoint(tmp_path / "sdar", state, cfg, family_tokenizer(["<|MASK|>"]))
    lm = load_model(tmp_path / "sdar", weights="native")
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, q(ids).logits, atol=1e-5, rtol=0)
